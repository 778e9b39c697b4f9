"""``draft``: a small model sharing the target's tokenizer proposes; it keeps its own kvopt cache.

The draft's cache holds exactly the committed tokens: each round feeds it what was committed
since the last (the target's last token, the accepted drafts), then drafts inside a speculative
block that forgets the drafted tokens when it closes. The draft's cache may be compressed
differently from the target's (``draft:model=PATH,cache=kivi:bits=4``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvopt.errors import KVOptError
from kvopt.models.forward import cache_kwargs
from kvopt.speculative.restore import speculate


@dataclass
class DraftModel:
    """Drafts ``k`` tokens with ``model`` (a loaded model, or a name/path for :func:`kvopt.load_model`)."""

    model: object = None
    cache: str = "full"
    k: int = 4

    name = "draft"

    def __post_init__(self) -> None:
        if self.model is None:
            raise KVOptError("draft: name the draft model, e.g. draft:model=path/to/small-model,k=4")
        if self.k < 1:
            raise KVOptError(f"draft: k={self.k} must be >= 1")

    def bind(self, model, cache, sampler) -> None:
        from kvopt.api import build_cache, load_model

        draft = load_model(self.model, device=model.device)[0] if isinstance(self.model, str) else self.model
        vocab, draft_vocab = model.get_output_embeddings().out_features, draft.get_output_embeddings().out_features
        if vocab != draft_vocab:
            raise KVOptError(
                f"draft: the draft model scores {draft_vocab} tokens but the target {vocab}; "
                "use a draft of the same family (same tokenizer and vocabulary)"
            )
        self.draft, self.sampler = draft, sampler
        self.draft_cache = build_cache(self.cache, draft)
        self.fed = 0  # tokens the draft cache holds (all committed)

    def propose(self, tokens: list[int], count: int) -> tuple[list[int], torch.Tensor | None]:
        device = self.draft.device
        logits = self._forward(tokens[self.fed :], device)  # catch up on what was committed
        self.fed = len(tokens)
        drafts, probs = [], []
        with speculate(self.draft_cache):  # the drafted tokens are forgotten on exit
            for index in range(count):
                q = self.sampler.probs(logits)[0]
                drafts.append(self.sampler.draw(q))
                probs.append(q)
                if index + 1 < count:
                    logits = self._forward(drafts[-1:], device)
        return drafts, None if self.sampler.greedy else torch.stack(probs)

    def _forward(self, ids: list[int], device) -> torch.Tensor:
        batch = torch.tensor([ids], device=device)
        return self.draft(input_ids=batch, **cache_kwargs(self.draft, self.draft_cache), use_cache=True, logits_to_keep=1).logits[0]
