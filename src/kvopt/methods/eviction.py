"""The shared mechanism of selective-retention methods: budget, score, keep the best per KV head.

A method subclasses :class:`Eviction` and implements only :meth:`Eviction.score`, returning
one importance value per (batch row, KV head, stored token) -- or per (row, token) with a
head axis of 1 when the method shares one index set across the layer's heads (TOVA,
StreamingLLM). The base turns the budget into a token count per row, protects the most
recent ``window`` tokens, never keeps padding as a kept token, selects the top tokens and
*moves them into a smaller buffer*, so the bytes held really drop.

Budgets: ``ratio`` is the fraction of the *prompt* removed at the prefill, kvpress's
convention: tokens that arrive later (the question, the answer) are added on top, so at equal
ratio every method and every press holds the same number of tokens; ``budget`` is the number
of tokens kept per sequence, head and layer, the papers' ``max_capacity`` convention: at all
times for ``decode`` schedules (memory stays bounded during long generations), and for the
prompt's share for ``prefill`` schedules (decoded tokens come on top). Protected recent tokens
count inside the budget.

Schedules: ``prefill`` methods compress once, right after the first forward pass (SnapKV
family); ``decode`` methods compress whenever the cache holds ``compress_every`` tokens more
than the budget (H2O, TOVA, StreamingLLM, MorphKV), so memory stays bounded while generating.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvopt.cache.quantized import QuantizedKV
from kvopt.cache.ragged import RaggedKV
from kvopt.errors import CacheUsageError, MethodParameterError
from kvopt.methods.base import Method, require_positive, require_ratio


@dataclass
class Eviction(Method):
    """Base class: subclasses set ``name``/``summary``/``schedule`` and implement ``score``."""

    ratio: float | None = field(default=None, metadata={"help": "fraction of tokens removed (kvpress convention)"})
    budget: int | None = field(default=None, metadata={"help": "tokens kept per sequence, head and layer"})
    window: int = field(default=0, metadata={"help": "most recent tokens always kept, counted in the budget"})
    compress_every: int = field(default=1, metadata={"help": "decode schedule: evict once this many tokens over budget"})

    schedule: ClassVar[str] = "prefill"
    selects_per_head = True
    runs_in_engine = True
    budget_convention = (
        "ratio = fraction of the prompt removed (later tokens added), or budget = tokens kept (of the prompt for "
        "prefill-time methods, at all times for decode-time ones)"
    )

    @property
    def verifies_at_once(self) -> bool:  # prefill-time methods compress once, then never act
        return self.schedule == "prefill"

    def validate(self) -> None:
        if (self.ratio is None) == (self.budget is None):
            raise MethodParameterError(
                f"{self.name}: give exactly one of ratio (fraction removed) or budget (tokens kept), "
                f"e.g. {self.name}:ratio=0.5 or {self.name}:budget=1024"
            )
        if self.ratio is not None:
            require_ratio(self, "ratio")
        else:
            require_positive(self, "budget")
            if self.window >= self.budget:
                raise MethodParameterError(
                    f"{self.name}: window={self.window} must be smaller than budget={self.budget} (it is counted inside it)"
                )
        if self.window < 0:
            raise MethodParameterError(f"{self.name}: window={self.window} must be >= 0")
        require_positive(self, "compress_every")

    def check_model(self, model) -> None:
        if self.budget is not None and model.max_positions is not None and self.budget > model.max_positions:
            raise MethodParameterError(
                f"{self.name}: budget={self.budget} exceeds the model's context ({model.max_positions} positions)"
            )

    # -- what subclasses provide ------------------------------------------------------------
    def score(self, layer, step) -> torch.Tensor:
        """Importance of each live slot, ``[batch, kv_heads or 1, tokens]``; higher is kept."""
        raise NotImplementedError

    # -- the mechanism ----------------------------------------------------------------------
    def after_attention(self, layer, step) -> None:
        if self.schedule == "prefill" and not step.is_prefill:
            return
        if layer.parts_of(RaggedKV):
            raise CacheUsageError(
                f"{self.name} cannot act after adakv's head-wise compression; use one of them, or put {self.name} first"
            )
        if layer.parts_of(QuantizedKV):
            raise CacheUsageError(
                f"{self.name} cannot evict quantized tokens; put {self.name} before kivi in the spec, and use a "
                "prefill-time method (snapkv, pyramidkv, ...) with kivi"
            )
        targets = self.targets(layer, step)
        held = len(layer.store)
        slack = self.compress_every - 1 if self.schedule == "decode" else 0
        if held <= int(targets.max()) + slack:
            return
        keep_top(layer, self.score(layer, step).float(), targets, self.window or 0)

    def targets(self, layer, step) -> torch.Tensor:
        """Tokens each batch row keeps, ``[batch]``; a ratio is fixed from the real tokens of the prefill.

        ``step`` is None when a method compresses outside an attention call (KVzip, after the prefill).
        """
        key, since = f"{self.name}.targets", f"{self.name}.seen_at_prefill"
        if step is None or step.is_prefill or key not in layer.state:
            real = self.prompt_tokens(layer)
            if self.ratio is not None:
                targets = (real.double() * (1 - self.ratio)).long().clamp(min=1)
            else:
                targets = real.clamp(max=self.budget) if self.schedule == "prefill" else torch.full_like(real, self.budget)
            layer.state[key], layer.state[since] = targets, layer.seen
        if self.ratio is not None:  # later tokens come on top of the prompt's share (kvpress's convention)
            return layer.state[key] + (layer.seen - layer.state[since])
        return layer.state[key]

    def prompt_tokens(self, layer) -> torch.Tensor:
        """Real tokens of each row's prompt, ``[batch]``, which the budget is a share of: the tokens the layer
        stores at the prefill (FastKV's later layers store fewer than the prompt had)."""
        return layer.store.valid[:, 0].sum(dim=-1)

    def kept_tokens(self, seen_tokens: int) -> int:
        if self.ratio is not None:
            return max(1, int(seen_tokens * (1 - self.ratio)))
        return min(seen_tokens, self.budget)


def protect_first(scores: torch.Tensor, valid: torch.Tensor, count: int) -> torch.Tensor:
    """``scores`` with each row's (and head's) first ``count`` real slots raised to +inf: attention sinks
    that a selection keeps whatever they score (``valid`` marks real slots, broadcast like ``scores``)."""
    rank = torch.cumsum(valid.long(), dim=-1)  # 1-based rank among real tokens
    return scores.masked_fill((rank <= count) & valid, float("inf"))


def keep_top(layer, scores: torch.Tensor, targets: torch.Tensor, protect_recent: int | torch.Tensor = 0) -> None:
    """Keep, per row and head, the ``targets[row]`` best-scoring valid slots (the newest ``protect_recent``, one
    count or one per row, protected).

    Rows are stored rectangularly, so a row whose budget is below the batch's largest keeps a
    few surplus slots marked invalid (masked, not counted as kept) until ragged storage.
    """
    store = layer.store
    heads = scores.shape[1]
    valid = store.valid[:, :heads] if heads > 1 else store.valid[:, :1]
    scores = scores.masked_fill(~valid, float("-inf"))
    recent = torch.minimum(targets, torch.as_tensor(protect_recent, device=targets.device))
    if bool(recent.any()):
        # Each row protects its newest min(window, its target) slots.
        slots = torch.arange(scores.shape[-1], device=scores.device)
        recent = recent[:, None, None]
        protected = (slots >= scores.shape[-1] - recent) & valid
        scores = scores.masked_fill(protected, float("inf"))
    keep = min(int(targets.max()), scores.shape[-1])
    ranked = scores.topk(keep, dim=-1).indices  # best first
    surplus = torch.arange(keep, device=scores.device)[None, None, :] >= targets[:, None, None]
    order = ranked.sort(dim=-1)
    store.keep(order.values)
    if bool(surplus.any()):
        dropped = surplus.expand_as(ranked).gather(-1, order.indices)
        store.valid[...] &= ~dropped.expand_as(store.valid)
        store.all_valid = False
