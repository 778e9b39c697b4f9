"""Speculation specs: ``prompt_lookup:k=4,ngram=3``, ``self:layers=8,k=4``, ``draft:model=PATH,k=4,cache=SPEC``."""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from kvopt.errors import KVOptError
from kvopt.speculative.draft_model import DraftModel
from kvopt.speculative.lookup import PromptLookup
from kvopt.speculative.self_draft import SelfSpeculation


class Proposer(Protocol):
    """Guesses the next tokens; verification decides which to keep."""

    name: str
    #: Most tokens drafted per round.
    k: int

    def bind(self, model, cache, sampler) -> None:
        """Set up for one generation: the target model, its kvopt cache and the sampler."""

    def propose(self, tokens: list[int], count: int) -> tuple[list[int], torch.Tensor | None]:
        """Up to ``count`` drafts after ``tokens`` (the committed sequence plus the target's next token),
        with their distributions ``[drafts, vocab]`` -- None for deterministic drafts."""


PROPOSERS = {cls.name: cls for cls in (PromptLookup, SelfSpeculation, DraftModel)}
EXAMPLES = "prompt_lookup:k=4, self:layers=8,k=4 or draft:model=PATH,k=4,cache=kivi:bits=4"


def parse_proposer(spec: str | Proposer) -> Proposer:
    """A proposer from its spec string (or the proposer itself)."""
    if not isinstance(spec, str):
        return spec
    name, _, text = spec.strip().partition(":")
    if name not in PROPOSERS:
        raise KVOptError(f"unknown speculation {name!r}; choose one of {', '.join(PROPOSERS)}, e.g. {EXAMPLES}")
    cls = PROPOSERS[name]
    params: dict[str, str] = {}
    if "cache=" in text:  # a cache spec has commas of its own: it runs to the end
        text, _, params["cache"] = text.partition("cache=")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for item in filter(None, text.strip(",").split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in fields:
            raise KVOptError(f"{name}: bad parameter {item!r}; it takes {', '.join(fields)} (e.g. {EXAMPLES})")
        params[key] = value
    try:
        values = {key: int(value) if fields[key].type == "int" else value for key, value in params.items()}
    except ValueError:
        raise KVOptError(f"{name}: {params} -- k, ngram and layers are integers, e.g. {EXAMPLES}") from None
    return cls(**values)
