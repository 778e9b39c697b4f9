"""The user-facing cache: a transformers ``Cache`` made of :class:`KVLayer` objects."""

from __future__ import annotations

from dataclasses import dataclass

from transformers.cache_utils import Cache

from kvopt.cache.attention import ATTENTION_NAME
from kvopt.cache.layer import KVLayer
from kvopt.errors import CacheUsageError, ContextTooLongError
from kvopt.methods import Method, parse
from kvopt.models.info import ModelInfo


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
        layers = [KVLayer(methods, window) for window in info.sliding_windows]
        for index, layer in enumerate(layers):
            layer.index, layer.siblings = index, layers
        super().__init__(layers=layers)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if layer_idx == 0 and self._config is not None:
            implementation = getattr(self._config, "_attn_implementation", None)
            if implementation != ATTENTION_NAME:
                raise CacheUsageError(
                    f"the model runs attn_implementation={implementation!r}, but a kvopt cache is read by kvopt's "
                    "attention; call kvopt.prepare(model) (kvopt.load_model and kvopt.cache do it)"
                )
        limit = None if any(m.extends_context for m in self.methods) else self.info.max_positions
        if layer_idx == 0 and limit is not None:
            total = self.layers[0].seen + key_states.shape[-2]
            if total > limit:
                raise ContextTooLongError(
                    f"context of {total} tokens exceeds the model's maximum of {limit} positions; "
                    "shorten the prompt or lower max_new_tokens"
                )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @property
    def needs_prefill_pass(self) -> bool:
        return any(m.needs_prefill_pass for m in self.methods)

    def after_prefill(self, model, input_ids, attention_mask=None, tokenizer=None) -> None:
        """Let methods that need the prompt's ids act once it is cached (see :meth:`prefill`)."""
        for method in self.methods:
            method.after_prefill(self, model, input_ids, attention_mask, tokenizer)

    def prefill(self, model, input_ids, attention_mask=None, tokenizer=None):
        """Cache a prompt and run the methods' post-prefill step; returns the model output.

        With ``model.generate``, prefill all but the prompt's last token here, then pass the whole
        prompt to ``generate`` with this cache: it feeds only what is not cached yet.
        """
        import torch

        with torch.no_grad():
            output = model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=self, use_cache=True)
        self.after_prefill(model, input_ids, attention_mask, tokenizer)
        return output

    def replay_prefill(self, source: KVCache) -> None:
        """Start from ``source``'s prefilled tokens and let this cache's methods compress them.

        ``source`` comes from :func:`record_prefill`. Because methods act after attention, this
        equals prefilling this cache directly with the same one forward pass, so one prefill
        serves many methods (the evaluation grid compares a dozen on each prompt).
        """
        steps = [layer.state.get(PREFILL_STEP) for layer in source.layers]
        if len(source.layers) != len(self.layers) or any(step is None for step in steps):
            raise CacheUsageError("replay_prefill needs a cache filled by kvopt.cache.record_prefill on the same model")
        for layer, done, step in zip(self.layers, source.layers, steps):
            layer.replay_prefill(done, step)

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


PREFILL_STEP = "record_prefill.step"


@dataclass
class _RecordPrefill(Method):
    """Keeps each layer's prefill step (its queries) so other caches can replay the prefill."""

    def after_attention(self, layer, step) -> None:
        if step.is_prefill:
            layer.state[PREFILL_STEP] = step


def record_prefill(model, input_ids, attention_mask=None, **forward_kwargs) -> tuple[KVCache, object]:
    """Prefill a lossless cache in one forward pass, recording what methods need to replay it.

    Returns ``(cache, model output)``; pass the cache to :meth:`KVCache.replay_prefill`.
    ``forward_kwargs`` go to the forward call (e.g. ``position_ids``, ``logits_to_keep``).
    Recording keeps every layer's queries (as large as the keys held).
    """
    import torch

    cache = build_cache([_RecordPrefill()], model)
    for layer in cache.layers:
        # Keep what a sliding layer would forget: a direct prefill runs its methods before
        # forgetting, and so does the replay. (The model still masks by the window.)
        layer.sliding_window = None
    with torch.no_grad():
        output = model(
            input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True, **forward_kwargs
        )
    return cache, output


def build_cache(spec: str | list[Method], model) -> KVCache:
    """Create a cache for ``model`` following ``spec`` (e.g. ``"full"`` or ``"window:size=1024"``)."""
    from kvopt.models.loading import prepare

    methods = parse(spec) if isinstance(spec, str) else list(spec)
    info = ModelInfo.from_config(model.config)
    for method in methods:
        method.check_model(info)
    prepare(model)
    for method in methods:
        method.prepare(model)
    return KVCache(methods, info, model.config)
