"""The user-facing cache: a transformers ``Cache`` made of :class:`KVLayer` objects."""

from __future__ import annotations

import weakref
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

from transformers.cache_utils import Cache

from kvopt.cache.attention import ATTENTION_NAME, prepare
from kvopt.cache.layer import AttentionStep, KVLayer
from kvopt.errors import CacheUsageError, ContextTooLongError
from kvopt.models.forward import cache_kwargs, final_states
from kvopt.models.info import ModelInfo

if TYPE_CHECKING:
    from kvopt.methods.base import Method


#: Where a recording cache (:func:`kvopt.methods.recording.record_prefill`) keeps each layer's prefill step in
#: :attr:`KVLayer.state`: what :meth:`KVCache.replay_prefill` runs the replaying cache's methods on.
RECORDED_PREFILL = "recorded prefill"


def recorded_step(layer: KVLayer) -> AttentionStep | None:
    """The prefill step a recording cache kept in ``layer`` (its queries), or None."""
    return layer.state.get(RECORDED_PREFILL)


@dataclass(frozen=True)
class LayerStats:
    layer: int
    #: Real (non-padding) tokens each sequence has seen, summed over the batch.
    seen: int
    #: Real tokens still stored, summed over the batch.
    kept: int
    nbytes: int


class KVCache(Cache):
    """Pass as ``past_key_values=`` to ``model.generate`` or a forward call.

    Build it with :func:`kvopt.cache`. It stores every layer through kvopt storage, applies the
    methods of its spec after each attention call, and reports the bytes it really holds.
    """

    def __init__(self, methods: list[Method], info: ModelInfo, config=None) -> None:
        self.methods = methods
        self.info = info
        self._config = config
        #: The model :meth:`for_model` built this cache for (weak: a cache never keeps a model alive).
        self._model: weakref.ref | None = None
        #: The prompt's final hidden states ``[batch, tokens, hidden]`` from the prefill, for methods that
        #: read the model's own predictions of the prompt (``reads_prompt_states``); dropped once they acted.
        self.prompt_states = None
        layers = [KVLayer(methods, window) for window in info.sliding_windows]
        for index, layer in enumerate(layers):
            layer.index, layer.siblings = index, layers
        super().__init__(layers=layers)

    @classmethod
    def for_model(cls, methods: list[Method], model) -> KVCache:
        """A cache of ``model``'s shape whose ``methods`` were checked against it; the model's attention
        is set to kvopt's (:func:`~kvopt.cache.attention.prepare`). Methods' one-time set-up is the caller's."""
        info = ModelInfo.from_config(model.config)
        for method in methods:
            method.check_model(info)
        prepare(model)
        cache = cls(methods, info, model.config)
        cache._model = weakref.ref(model)
        return cache

    @property
    def model(self):
        """The model this cache was built for by :meth:`for_model` (None otherwise, or once it is gone)."""
        return self._model() if self._model is not None else None

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        self.info.check_keys(layer_idx, key_states)
        if layer_idx == 0 and self._config is not None:
            implementation = getattr(self._config, "_attn_implementation", None)
            if implementation != ATTENTION_NAME:
                raise CacheUsageError(
                    f"the model runs attn_implementation={implementation!r}, but a kvopt cache is read by kvopt's "
                    "attention; call kvopt.prepare(model) (kvopt.load_model and kvopt.cache do it)"
                )
        limit = None if any(m.extends_context for m in self.methods) else self.info.max_positions
        if layer_idx == 0 and limit is not None:
            total, mode = self.layers[0].seen + key_states.shape[-2], self.layers[0].mode
            if total > limit and not (mode is not None and mode.forgets_tokens):  # a scoring pass may run past it
                raise ContextTooLongError(
                    f"context of {total} tokens exceeds the model's maximum of {limit} positions; "
                    "shorten the prompt or lower max_new_tokens"
                )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @property
    def needs_prefill_pass(self) -> bool:
        return any(m.needs_prefill_pass for m in self.methods)

    @property
    def reads_prompt_states(self) -> bool:
        return any(m.reads_prompt_states for m in self.methods)

    def after_prefill(self, model, input_ids, attention_mask=None, tokenizer=None) -> None:
        """Let methods that need the prompt's ids act once it is cached (see :meth:`prefill`)."""
        try:
            for method in self.methods:
                method.after_prefill(self, model, input_ids, attention_mask, tokenizer)
        finally:
            self.prompt_states = None

    def prefill(self, model, input_ids, attention_mask=None, tokenizer=None):
        """Cache a prompt and run the methods' post-prefill step; returns the model output (the last
        position's logits only: ``[tokens, vocab]`` logits would cost gigabytes at long prompts).

        With ``model.generate``, prefill all but the prompt's last token here, then pass the whole
        prompt to ``generate`` with this cache: it feeds only what is not cached yet.
        """
        import torch

        with torch.no_grad(), final_states(model) if self.reads_prompt_states else nullcontext([]) as states:
            output = model(
                input_ids=input_ids, attention_mask=attention_mask, **cache_kwargs(model, self), use_cache=True,
                logits_to_keep=1,
            )  # fmt: skip
        self.prompt_states = states[-1] if states else None
        self.after_prefill(model, input_ids, attention_mask, tokenizer)
        return output

    def run_prompt_pass(self, model, input_ids, tokenizer=None):
        """Before a fresh cache is fed its prompt: methods that act on the whole prompt after the prefill
        (``needs_prefill_pass``: kvzip, surprisal) get all but its last token cached and compressed here, with the
        ids in hand. Returns the ids still to feed (the last one, or all of them when no pass runs); ``generate``
        may be passed the whole prompt, as it feeds only what is not cached yet."""
        if not self.needs_prefill_pass or input_ids.shape[-1] < 2 or self.get_seq_length():
            return input_ids
        self.prefill(model, input_ids[:, :-1], tokenizer=tokenizer)
        return input_ids[:, -1:]

    def replay_prefill(self, source: KVCache) -> None:
        """Start from ``source``'s prefilled tokens and let this cache's methods compress them.

        ``source`` comes from :func:`~kvopt.methods.recording.record_prefill`. Because methods act
        after attention, this equals prefilling this cache directly with the same one forward pass,
        so one prefill serves many methods (the evaluation grid compares a dozen on each prompt).
        """
        shaping = [m.name for m in self.methods if m.shapes_prefill]
        if shaping:
            raise CacheUsageError(
                f"{shaping[0]} changes the prefill itself, so a recorded lossless prefill cannot stand for it; "
                "prefill this cache directly (model(ids, past_key_values=cache))"
            )
        steps = [recorded_step(layer) for layer in source.layers]
        if len(steps) != len(self.layers) or any(step is None for step in steps):
            raise CacheUsageError(
                "replay_prefill needs a cache filled by kvopt.methods.recording.record_prefill on the same model"
            )
        for layer, done, step in zip(self.layers, source.layers, steps):
            # Methods act after attention, so a one-pass prefill's outputs never depend on them: a copy of the
            # recorded tokens, acted on, equals prefilling this layer directly.
            if layer.seen or not step.is_prefill:
                raise CacheUsageError("replay_prefill needs an empty cache and a recorded one-pass prefill")
            layer.dtype, layer.device, layer.is_initialized = done.dtype, done.device, True
            layer.store = done.store.clone()
            layer.seen, layer.seen_real = done.seen, done.seen_real
            layer.act(step)
        self.prompt_states = source.prompt_states if self.reads_prompt_states else None

    @property
    def spec(self) -> str:
        return "+".join(method.spec() for method in self.methods)

    def nbytes(self) -> int:
        """Bytes of tensors the cache holds now (keys, values, positions, validity, slack)."""
        return sum(layer.nbytes() for layer in self.layers)

    def stats(self) -> list[LayerStats]:
        """Per layer: real tokens seen vs real tokens kept (summed over the batch), and bytes."""
        out = []
        for index, layer in enumerate(self.layers):
            kept = int(layer.kept_per_row().sum())
            seen = layer.seen_real
            out.append(LayerStats(index, seen, kept, layer.nbytes()))
        return out

    def __repr__(self) -> str:
        seen = self.get_seq_length()
        return f"KVCache(spec={self.spec!r}, layers={len(self.layers)}, seen={seen}, nbytes={self.nbytes()})"
