"""``window``: a plain sliding window over the sequence.

The simplest eviction policy and a proof that eviction frees memory: after each forward
pass every layer keeps only the ``size`` most recent tokens of each sequence. Tokens keep
their original positions (post-RoPE keys), so the total length stays within the model's
context. Within one forward pass (e.g. the prefill) attention still sees all new tokens;
eviction shapes what later tokens can see. StreamingLLM (sinks + window) comes separately.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvopt.errors import MethodParameterError
from kvopt.methods.base import Method, register, require_positive, require_ratio


@register
@dataclass
class Window(Method):
    """Keep the ``size`` most recent tokens of every sequence; evict the oldest.

    With ``ratio`` instead, the prefill keeps ``int(n * (1 - ratio))`` of its ``n`` tokens and
    later tokens are added on top: kvpress's budget convention (use ``size`` to bound memory).
    """

    name = "window"
    summary = "sliding window: keep the most recent tokens, evict the oldest"
    budget_convention = "size = tokens kept, or ratio = fraction of the prefill removed"
    runs_in_engine = True
    evicts_oldest_only = True

    size: int = field(default=1024, metadata={"help": "tokens kept per sequence and layer"})
    ratio: float | None = field(default=None, metadata={"help": "fraction of prefill tokens removed (overrides size)"})

    @property
    def schedule(self) -> str:
        """When it evicts (see :func:`kvopt.methods.spec.evicts_while_decoding`): ``ratio`` fixes the kept
        share at the prefill and adds later tokens on top; ``size`` evicts at every step."""
        return "prefill" if self.ratio is not None else "decode"

    @property
    def verifies_at_once(self) -> bool:  # a ratio fixes the kept share at the prefill, later tokens add on
        return self.ratio is not None

    def validate(self) -> None:
        require_positive(self, "size")
        if self.ratio is not None:
            require_ratio(self, "ratio")

    def check_model(self, model) -> None:
        if self.ratio is None and model.max_positions is not None and self.size > model.max_positions:
            raise MethodParameterError(
                f"window: size={self.size} is larger than the model's context ({model.max_positions} positions); "
                f"use window:size=N with N <= {model.max_positions}"
            )

    def after_attention(self, layer, step) -> None:
        size = self.size
        if self.ratio is not None:
            if step.is_prefill:
                layer.state[self.name] = max(1, int(step.query.shape[-2] * (1 - self.ratio))) - layer.seen
            size = layer.state[self.name] + layer.seen
        excess = len(layer.store) - size
        if excess > 0:
            layer.store.drop_oldest(excess)

    def kept_tokens(self, seen_tokens: int) -> int:
        if self.ratio is not None:
            return max(1, int(seen_tokens * (1 - self.ratio)))
        return min(seen_tokens, self.size)
