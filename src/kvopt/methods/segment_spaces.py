"""Where ``epicache`` places a conversation's segments and questions: the vectors it clusters and routes by.

One interface, two kinds (``epicache:embedding=...``). A space is *fitted* on the history's segments (which gives
their points, unit vectors), then places any later piece (a question) in the same space; its :meth:`state` travels
with a session's episodes so a resumed conversation routes its next question exactly as before.

- ``tfidf`` (the default): each piece a bag of its token ids, weighted ``(1 + log count) * log((1 + n) / (1 + df))``
  with ``df`` the number of the history's ``n`` segments holding the token (sklearn's smoothed idf), L2-normalised.
  A question names its topic's words, and a word's idf over a few dozen segments singles out the topics that use
  it. Measured on the long-conversation task at 4k (24 conversations, 4 episodes; ``benchmarks/conversations.py
  --steps routing``): the question reaches its fact's episode in 21/24 on SmolLM2-135M and 22/24 on
  Qwen2.5-Coder-0.5B, where the model's own states route at chance (6/24 and 4/24; chance is 6/24).
- ``states``: the model's hidden states after its middle decoder layer, each piece run alone (no cache, the
  forward stopped there), mean-pooled over its tokens but the first (an attention sink, whose activations are
  orders of magnitude larger), centred on the history's mean (removing the component all segments share) and
  L2-normalised. The paper's choice is a separate 0.6B sentence encoder, a download this package avoids; small
  decoders' pooled states do not separate topics (above), so this kind is kept for larger models and comparison.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import ClassVar

import torch


class SegmentSpace(ABC):
    """A vector space for a conversation's pieces of token ids, fitted on its history's segments."""

    kind: ClassVar[str]

    @classmethod
    @abstractmethod
    def fit(cls, model, segments: list[list[int]]) -> tuple[SegmentSpace, torch.Tensor]:
        """The space learned from the history's ``segments`` and their points ``[len(segments), dim]``."""

    @abstractmethod
    def points(self, model, pieces: list[list[int]]) -> torch.Tensor:
        """``[len(pieces), dim]``: unit vectors (zero for a piece with nothing in common with the history)."""

    @property
    @abstractmethod
    def dim(self) -> int:
        """The points' length."""

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes the space holds (a session's memory counts them)."""

    @abstractmethod
    def state(self) -> dict:
        """JSON-able: :func:`space_from_state` rebuilds the same space from it."""

    @classmethod
    @abstractmethod
    def from_state(cls, state: dict) -> SegmentSpace:
        """The space :meth:`state` described; ``ValueError`` / ``KeyError`` / ``TypeError`` when it is damaged."""

    @abstractmethod
    def fits(self, model) -> bool:
        """Whether the space can place pieces for ``model`` (a saved state checked against the model resumed)."""


class TfidfSpace(SegmentSpace):
    """Token TF-IDF over the history's vocabulary (see the module docstring)."""

    kind = "tfidf"

    def __init__(self, tokens: torch.Tensor, idf: torch.Tensor) -> None:
        if tokens.dim() != 1 or tokens.shape != idf.shape or not bool((tokens.diff() > 0).all()):
            raise ValueError(f"a tfidf space needs sorted, distinct tokens and one idf each ({tuple(tokens.shape)}, "
                             f"{tuple(idf.shape)})")  # fmt: skip
        self.tokens, self.idf = tokens.long(), idf.float()

    @classmethod
    def fit(cls, model, segments: list[list[int]]) -> tuple[TfidfSpace, torch.Tensor]:
        present = [torch.as_tensor(sorted(set(segment)), dtype=torch.long) for segment in segments]
        tokens, df = torch.cat(present).unique(return_counts=True)
        space = cls(tokens, torch.log((1 + len(segments)) / (1 + df.double())).float())
        return space, space.points(model, segments)

    def points(self, model, pieces: list[list[int]]) -> torch.Tensor:
        rows = torch.zeros(len(pieces), self.dim)
        for row, piece in zip(rows, pieces):
            ids = torch.as_tensor(piece, dtype=torch.long)
            index = torch.searchsorted(self.tokens, ids).clamp(max=max(self.dim - 1, 0))
            known = index[self.tokens[index] == ids] if self.dim else index[:0]
            counts = torch.bincount(known, minlength=self.dim).float()
            row += torch.where(counts > 0, 1 + counts.clamp(min=1).log(), counts) * self.idf
        return torch.nn.functional.normalize(rows, dim=-1)

    @property
    def dim(self) -> int:
        return len(self.tokens)

    def nbytes(self) -> int:
        return self.tokens.numel() * self.tokens.element_size() + self.idf.numel() * self.idf.element_size()

    def state(self) -> dict:
        return {"kind": self.kind, "tokens": self.tokens.tolist(), "idf": self.idf.tolist()}

    @classmethod
    def from_state(cls, state: dict) -> TfidfSpace:
        idf = torch.tensor(state["idf"], dtype=torch.float32)
        if not all(math.isfinite(value) and value >= 0 for value in idf.tolist()):
            raise ValueError("a tfidf space's idf must be finite and >= 0")
        return cls(torch.tensor(state["tokens"], dtype=torch.long), idf)

    def fits(self, model) -> bool:
        return not self.dim or 0 <= int(self.tokens[0]) and int(self.tokens[-1]) < model.config.get_text_config().vocab_size


class StatesSpace(SegmentSpace):
    """The model's middle-layer states, mean-pooled and centred on the history's mean (see the module docstring)."""

    kind = "states"

    def __init__(self, mean: torch.Tensor) -> None:
        if mean.dim() != 1:
            raise ValueError(f"a states space's mean is one vector, not {tuple(mean.shape)}")
        self.mean = mean.float()

    @classmethod
    def fit(cls, model, segments: list[list[int]]) -> tuple[StatesSpace, torch.Tensor]:
        pooled = pooled_states(model, segments)
        space = cls(pooled.mean(dim=0).cpu())
        return space, space.centred(pooled)

    def points(self, model, pieces: list[list[int]]) -> torch.Tensor:
        return self.centred(pooled_states(model, pieces))

    def centred(self, pooled: torch.Tensor) -> torch.Tensor:
        """``pooled`` less the history's mean, L2-normalised (on the CPU, as every space's points are)."""
        return torch.nn.functional.normalize(pooled.cpu() - self.mean, dim=-1)

    @property
    def dim(self) -> int:
        return len(self.mean)

    def nbytes(self) -> int:
        return self.mean.numel() * self.mean.element_size()

    def state(self) -> dict:
        return {"kind": self.kind, "mean": self.mean.tolist()}

    @classmethod
    def from_state(cls, state: dict) -> StatesSpace:
        return cls(torch.tensor(state["mean"], dtype=torch.float32))

    def fits(self, model) -> bool:
        return self.dim == model.config.get_text_config().hidden_size


#: The kinds ``epicache:embedding=`` names.
SPACES: dict[str, type[SegmentSpace]] = {space.kind: space for space in (TfidfSpace, StatesSpace)}


def space_from_state(state: dict) -> SegmentSpace:
    """The space a saved :meth:`SegmentSpace.state` describes (``ValueError`` naming an unknown kind)."""
    if not isinstance(state, dict) or state.get("kind") not in SPACES:
        raise ValueError(f"unknown segment space {state.get('kind') if isinstance(state, dict) else state!r}")
    return SPACES[state["kind"]].from_state(state)


class _Stop(Exception):
    """Ends a forward once the middle layer's hidden states are captured."""


def pooled_states(model, pieces: list[list[int]]) -> torch.Tensor:
    """``[len(pieces), hidden]``: each piece alone through the model up to its middle layer, mean-pooled over its
    tokens but the first (all of them for a one-token piece)."""
    layers = model.get_decoder().layers
    captured: list[torch.Tensor] = []

    def stop(module, args, output):
        captured.append((output[0] if isinstance(output, tuple) else output)[0].float())
        raise _Stop

    handle = layers[len(layers) // 2].register_forward_hook(stop)
    try:
        for piece in pieces:
            ids = torch.as_tensor([piece], device=model.device)
            try:
                with torch.no_grad():
                    model(input_ids=ids, use_cache=False)
            except _Stop:
                pass
    finally:
        handle.remove()
    return torch.stack([states[1:].mean(dim=0) if len(states) > 1 else states[0] for states in captured])
