"""``kvzip``: query-agnostic importance by context reconstruction.

KVzip (Kim et al., arXiv 2505.23416): once the context is cached, ask the model to repeat it
("Repeat the previous context exactly." followed by the context itself, chunk by chunk) and
score every cached token by the largest attention any reconstruction query pays it (max over
the queries and over the query heads of its GQA group). Tokens needed to reproduce the context
are the ones any later question may need, so the cache can be compressed before the question
is known. Reconstruction tokens are attended with and then forgotten (they never stay in the
cache). ``budgets=global`` (the paper's and kvpress's default) ranks all layers' and KV heads'
scores together, so layers and heads keep different numbers of tokens (ragged storage, real
savings) within the same total; ``budgets=layer`` keeps the same share in every layer and head.
``sinks`` first and ``window`` last tokens are always kept, inside the budget.

Cost: one extra forward over the context (plus a short prompt per chunk) attending to the
whole cached context, about 3-4x the prefill time of the context alone here (BENCHMARKS.md).
Deviations: chunks after the first restart from the previous chunk's last tokens as in the
paper's code; scores are attention over the whole context (the paper's code renormalises over
the chunk being rebuilt); sliding-window layers, which compact parts do not serve, keep the
per-layer share under ``budgets=global``. A prompt that fits the model's positions is scored even where the
reconstruction forwards run past them (an 8,182-token prompt on an 8,192-position model): those tokens only
score and are forgotten, with RoPE positions a chunk beyond the trained range.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvopt.cache.layer import AttentionStep, KVLayer
from kvopt.cache.ragged import RaggedKV
from kvopt.errors import CacheUsageError, MethodParameterError
from kvopt.methods.adakv import allocate
from kvopt.methods.base import register
from kvopt.methods.eviction import Eviction, keep_top, protect_first
from kvopt.methods.scores import attention_probs, grouped_attention_output
from kvopt.models.forward import cache_kwargs

REPEAT_PROMPT = "\n\nRepeat the previous context exactly."
CONTINUE_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
EXTRA = "kvzip"


@register
@dataclass
class KVzip(Eviction):
    """Keep, per KV head, the tokens the model attends to most when asked to reproduce the context."""

    name = "kvzip"
    summary = "query-agnostic: score tokens by attention while the model repeats the context (KVzip)"
    needs_prefill_pass = True
    needs_tokenizer = True
    runs_in_engine = False  # one ranking over all layers: layers and heads keep different numbers of tokens

    window: int = field(default=8, metadata={"help": "most recent tokens always kept, counted in the budget"})
    sinks: int = field(default=4, metadata={"help": "first tokens always kept (attention sinks)"})
    chunk: int = field(default=512, metadata={"help": "context tokens reconstructed per extra forward"})
    budgets: str = field(
        default="global", metadata={"help": "global: one ranking over all layers and KV heads; layer: equal shares"}
    )

    def validate(self) -> None:
        super().validate()
        if self.sinks < 0 or self.chunk < 16:
            raise MethodParameterError(f"kvzip: sinks={self.sinks} must be >= 0 and chunk={self.chunk} >= 16")
        if self.budgets not in ("global", "layer"):
            raise MethodParameterError(f"kvzip: budgets={self.budgets!r} must be 'global' or 'layer'")

    @property
    def storage(self) -> str | None:
        """One ranking over all layers moves the survivors into ragged storage (:func:`kvopt.methods.spec.storage`)."""
        return "ragged" if self.budgets == "global" else None

    def after_attention(self, layer, step) -> None:
        """Nothing during the prefill itself: scoring needs the whole context cached first."""

    def after_prefill(self, cache, model, input_ids, attention_mask, tokenizer) -> None:
        for layer in cache.layers:
            layer.store.add_extra(EXTRA)
        self.reconstruct(cache, model, input_ids, attention_mask, tokenizer, cache.layers)
        self.select(cache, model)

    def reconstruct(self, cache, model, input_ids, attention_mask, tokenizer, scored: list) -> None:
        """Feed the reconstruction forwards; the ``scored`` layers raise their tokens' scores (store extra
        ``kvzip``) to the attention the reconstruction queries pay them."""
        if tokenizer is None:
            raise CacheUsageError(
                f"{self.name} needs the tokenizer: call cache.prefill(model, ids, tokenizer=tokenizer)"
            )
        batch = input_ids.shape[0]
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        for layer in scored:
            layer.mode = RECONSTRUCTION
        try:
            for prompt_ids, chunk_ids, chunk_mask in self._reconstruction_chunks(tokenizer, input_ids, attention_mask):
                prompt = torch.as_tensor(prompt_ids, device=input_ids.device).expand(batch, -1)
                ids = torch.cat([prompt, chunk_ids], dim=1)
                mask = torch.cat([attention_mask, torch.ones_like(prompt), chunk_mask], dim=1)
                with torch.no_grad():
                    self.forward(model, ids, mask, cache)
        finally:
            for layer in scored:
                layer.mode = None

    def forward(self, model, ids, mask, cache) -> None:
        """One reconstruction forward."""
        model(input_ids=ids, attention_mask=mask, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)

    def select(self, cache, model) -> None:
        """Keep the best-scored tokens: one ranking over the layers ragged storage serves, or per layer."""
        together = []
        if self.budgets == "global":
            together = [layer for layer in cache.layers if layer.sliding_window is None]
        for layer in cache.layers:
            if not any(layer is other for other in together):
                self._compress(layer)
        if together:
            self._compress_together(together)

    def _reconstruction_chunks(self, tokenizer, input_ids, attention_mask):
        """(prompt ids, chunk ids, chunk mask) per chunk; later prompts quote the previous chunk's tail."""
        encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        first, later = encode(REPEAT_PROMPT), encode(CONTINUE_PROMPT)
        for start in range(0, input_ids.shape[1], self.chunk):
            stop = start + self.chunk
            tail = input_ids[0, max(start - 8, 0) : start].tolist() if start else []
            yield (first if not start else later + tail), input_ids[:, start:stop], attention_mask[:, start:stop]

    def _scores(self, layer) -> torch.Tensor:
        """The layer's reconstruction scores ``[B, H_kv, T]``, sinks raised to +inf; frees the scratch scores."""
        store = layer.store
        scores = store.extra(EXTRA)
        store.drop_extra(EXTRA)  # the scores were only needed for this selection
        return protect_first(scores, store.valid, self.sinks)

    def _compress(self, layer) -> None:
        keep_top(layer, self._scores(layer), self.targets(layer, None), self.window)

    def _compress_together(self, layers: list) -> None:
        """One ranking over every (layer, KV head): Ada-KV's allocation with the layers' heads side by side.

        Full-attention layers see the same prefill, so they share the token axis and the budget.
        """
        heads = layers[0].store.keys.shape[1]
        targets = self.targets(layers[0], None)
        for layer in layers[1:]:
            self.targets(layer, None)  # every layer records its prompt share (later tokens add on top)
        scores = torch.cat([self._scores(layer).float().expand(-1, heads, -1) for layer in layers], dim=1)
        selected = allocate(scores, layers[0].store.valid, targets, self.window, alpha=0.0)
        batch, columns = scores.shape[0], len(layers) * heads
        for index, layer in enumerate(layers):
            first = index * heads
            RaggedKV.move_into(layer, [selected[row * columns + first + head] for row in range(batch) for head in range(heads)])


def score_reconstruction(layer, step, softcap: float | None) -> torch.Tensor:
    """Attend, and raise each older token's score to the max attention the new queries pay it.

    What :class:`ReconstructionPass` runs in each layer: one explicit
    softmax serves both the scores and the output (no second attention pass).
    """
    store = layer.store
    probs = attention_probs(layer, step, softcap=softcap)  # [B, H_kv, g, q, T]
    old = len(store) - step.query.shape[-2]
    extra = store.extra(EXTRA)[..., :old]
    torch.maximum(extra, probs[..., :old].amax(dim=(2, 3)), out=extra)
    return grouped_attention_output(probs, store.values).to(step.query.dtype).contiguous()


class ReconstructionPass:
    """A layer's attention during kvzip's reconstruction pass (set as :attr:`KVLayer.mode`): the new queries attend
    to everything stored and raise the stored tokens' scores (:func:`score_reconstruction`), then the new tokens
    are forgotten, so the pass leaves only scores behind."""

    purpose = "kvzip's reconstruction pass"
    forgets_tokens = True

    def attend(self, layer: KVLayer, module, query, key, value, padding, scaling, sliding_window, softcap) -> torch.Tensor:
        if layer.parts:
            held = " and ".join(part.kind for part in layer.parts)
            raise CacheUsageError(
                "kvzip's reconstruction pass needs the prompt dense and in full precision, but this layer already "
                f"holds {held}; kvzip cannot share a cache with those methods yet: use it alone, with kivi, or with "
                "other eviction methods"
            )
        new = key.shape[-2]
        positions, real = layer.store_tokens(key, value, padding[:, -new:] if padding is not None else None)
        output = score_reconstruction(layer, AttentionStep(module, query, positions, scaling, False), softcap)
        layer.store.end -= new
        layer.seen -= new
        layer.seen_real -= real
        return output


RECONSTRUCTION = ReconstructionPass()
