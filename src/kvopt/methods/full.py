"""``full``: the lossless baseline, bit-for-bit the attention of HF's ``DynamicCache``."""

from __future__ import annotations

from dataclasses import dataclass

from kvopt.methods.base import Method, register


@register
@dataclass
class Full(Method):
    """Keep every token at full precision (sliding layers still forget what their window no longer sees)."""

    name = "full"
    summary = "lossless: keep every token (the baseline every method is compared with)"
    budget_convention = "keeps every token"
    runs_in_engine = True
    verifies_at_once = True
