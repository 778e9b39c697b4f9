"""``locret``: trained retaining heads score every token as it is cached; eviction inside a chunked prefill.

Locret (Huang et al., arXiv 2410.01805; code huangyuxiang03/Locret): a small MLP per layer
(:mod:`kvopt.methods.locret_heads`) predicts, from a token's own query, key and value, how much
the tokens after it will attend to it (its causal importance). Scores are causal, so they are
computed once, when the token is cached, and kept beside it (a ``[B, H_kv, T]`` store extra that
moves with the tokens) until the prompt is done. The prompt is prefilled in chunks of ``chunk``
tokens; after each, every layer keeps, per KV head, the ``budget`` best-scored tokens with the
newest ``window`` ones (the paper's *stabilizers*) protected, so a layer never holds more than
``budget + chunk`` of the prompt. Tokens after the prompt (the question, the answer) come on top,
never evicted (Alg. 1). Query-agnostic by construction: the heads never see a question.

The chunking needs no caller's help: any forward that brings the prompt whole into an empty
cache (``model.generate``, ``kvopt.generate``, the evaluation grid, the engine's own-cache
sequences) is split *inside every attention module* by a forward pre-hook (:func:`install`),
which runs the earlier chunks through the module and hands the last to the forward, and a forward
hook that joins the outputs. Everything else in a decoder layer is per token, so layer by layer
this computes exactly what a chunk-by-chunk prefill computes (each chunk attends to what its layer
kept of the chunks before), while each layer's cache stays within ``budget + chunk``.
Do not pass ``prefill_chunk_size`` to ``generate``: its first chunk would be taken for the prompt.

Budgets: ``ratio`` removes that share of the prompt (the budget is fixed from the prompt's length
when it arrives, kvpress's convention), ``budget`` keeps that many tokens per layer and KV head.
Methods after ``locret`` in a spec (a quantizer: ``locret:ratio=0.75+kivi:bits=4``) act once the
prompt's last chunk is evicted, so they never hold a token eviction still needs; no other
eviction may share its spec.

Deviations: the first ``sinks`` tokens are always kept (StreamingLLM's attention sinks: the heads train on
sequences cut from running text, which never begin where a prompt does, so they cannot learn what a
prompt's first tokens are for); at each eviction the scores are max-pooled over ``pool`` neighbouring held
tokens (SnapKV's smoothing, in the spirit of the paper's smoothness loss: a needle's digits and the words
around it go together); the stabilizers are kept at the last chunk too (the paper's last chunk keeps only the
best scores; the newest tokens are the ones a question reads); the prompt's tail is not held back
(``n_loc``): a question asked in a later forward comes on top, as in the paper; the default
``window`` is a quarter of the budget at most (the paper: 2,500 of 6,000 to 16,384), ``chunk`` 512
(the paper: 1,024 to 4,096 for 128k prompts). Heads: see :mod:`kvopt.methods.locret_heads`.

Where the heads come from: ``kvopt.cache("locret:ratio=0.75", model)`` loads the model's heads from
``$KVOPT_CACHE/locret`` (a read-only cache folder is fine) or from ``heads=PATH``. With none cached,
a model whose training is estimated under a minute (tiny test models) trains on first use with a
one-line notice; any larger one (the default model: 1.5-3 min on one CPU thread, Qwen2.5-Coder-0.5B
about 4) stops with one line naming ``kvopt train locret --model PATH [--tokens N]``, which shows a
progress bar, resumes an interrupted run and prints the held-out validation loss.

Measured on the default model (heads format 3: 32,768 tokens, 95-196 s of CPU time by the machine's load),
query-agnostic on the 24 passkey / niah / niah_multivalue prompts at 2k of BENCHMARKS.md's prefill-cheap table,
paired with ``full``: at 75% removed it keeps 87% [68–95] of ``full``'s answers (``kvzip`` 73%, ``surprisal`` 68%,
``shallowzip`` 64%, ``tova`` 49% on the same prompts) at 1.12x ``full``'s prefill (``kvzip`` ~3.7x); at 90%
removed 65% [44–81] (``kvzip`` 57%). Without pooling it kept 66% on 23 prompts; format 2 (prose only, pre-RoPE
target) 1.2 of ``full``'s 17.8 answers.
On Qwen2.5-Coder-0.5B (heads: 32,768 tokens, 231 s, 14.4 MB), passkey / niah / niah_multivalue, 24 prompts per
length: 97% [81-100] of ``full``'s answers kept at 75% removed at 4k and 98% [82-100] at 8k (``kvzip`` 97%, 96%),
prefill 1.02x and 1.00x ``full``'s in interleaved runs (``kvzip`` 3.57x, 4.43x); a 16,384-token prompt under
``budget=1024`` peaks at 26.7 MB of KV (one layer holding a chunk more than its budget), 1/15.1 of ``full``'s.
The default model at 4k keeps less: 73% [51-88] (``kvzip`` 99%). Not for want of long training sequences: heads
trained on 4,096-token ones (65,536 tokens, 277 s) kept 56% [35-75] of ``full``'s answers on the same 24 prompts.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvopt.cache.kv_cache import KVCache
from kvopt.cache.prerope import RopeError, rope_positions
from kvopt.errors import CacheUsageError, MethodParameterError
from kvopt.methods import locret_heads
from kvopt.methods.base import register, require_positive
from kvopt.methods.eviction import Eviction, keep_top, protect_first
from kvopt.methods.locret_data import prose_sequences
from kvopt.methods.nuq_calibration import attention_modules
from kvopt.methods.scores import pool
from kvopt.methods.spec import evicts

#: Set on an attention module once :func:`split_prompt` and :func:`join_prompt` are registered on it.
HOOKED = "_kvopt_locret_chunks"
SCORES = "locret.scores"
PROMPT_END, PROMPT_REAL, OFFSETS, OUTPUTS = "locret.prompt_end", "locret.prompt_real", "locret.offsets", "locret.outputs"


@register
@dataclass
class Locret(Eviction):
    """Keep, per layer and KV head, the prompt tokens trained retaining heads score highest, chunk by chunk."""

    name = "locret"
    summary = "trained retaining heads score tokens as they are cached; evicts to the budget inside a chunked prefill (Locret)"
    shapes_prefill = True  # later chunks attend to an evicted cache: a lossless recorded prefill cannot stand for it
    runs_in_engine = False  # the engine's runner feeds the prompt whole to the pool; own caches chunk it here

    window: int = field(default=128, metadata={"help": "newest tokens kept at each eviction (stabilizers), at most a quarter of a ratio's budget"})
    sinks: int = field(default=4, metadata={"help": "first prompt tokens always kept (attention sinks)"})
    pool: int = field(default=7, metadata={"help": "odd kernel of a max-pool over neighbouring held tokens' scores at each eviction (0: none)"})
    chunk: int = field(default=512, metadata={"help": "prompt tokens per prefill chunk"})
    heads: str = field(default="", metadata={"help": "heads file from `kvopt train locret` (default: the model's, cached)"})

    def __post_init__(self) -> None:
        self.trained: locret_heads.TrainedHeads | None = None
        self.tables: dict[int, locret_heads.RopeTable] = {}
        super().__post_init__()

    def validate(self) -> None:
        super().validate()
        require_positive(self, "chunk")
        if self.sinks < 0 or self.pool < 0 or (self.pool and self.pool % 2 == 0):
            raise MethodParameterError(
                f"locret: sinks={self.sinks} must be >= 0 and pool={self.pool} 0 or odd (e.g. locret:pool=7)"
            )

    # -- heads ------------------------------------------------------------------------------
    def prepare(self, model, calibration_text) -> None:
        install(model)
        if self.trained is not None:
            return
        if self.heads:
            path = Path(self.heads).expanduser()
            if not path.is_file():
                raise MethodParameterError(f"locret: heads={self.heads} is not a file; pass a file `kvopt train locret` wrote")
            try:
                self.trained = locret_heads.load(path, locret_heads.model_fingerprint(model), next(model.parameters()).device)
            except locret_heads.HeadsFileError as error:
                raise locret_heads.HeadsFileError(f"{error}; train heads for this model: {locret_heads.train_command(model)}") from None
        else:
            notice = lambda line: print(line, file=sys.stderr)  # noqa: E731
            self.trained = locret_heads.cached_or_trained(model, calibration_text, notice)

    def fit(self, model, ids: torch.Tensor, sequence: int | None = None, **options) -> locret_heads.TrainingReport:
        """Train heads on token ids ``[N]`` of real text cut into prose sequences of ``sequence`` tokens (instead of
        the cached heads, e.g. for a model without a tokenizer); returns the report."""
        length = sequence or locret_heads.prose_length(model, ids.numel())
        pieces = prose_sequences(ids, length, locret_heads.answer_length(length))
        self.trained = locret_heads.train(model, pieces, **options)
        return self.trained.report

    def model_bytes(self) -> int:
        """Bytes of the heads, held once per model apart from the per-token bytes."""
        return self.trained.heads.nbytes() if self.trained is not None else 0

    # -- the prompt -------------------------------------------------------------------------
    def start_prompt(self, cache: KVCache, layer, hidden: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Note the prompt (``hidden [B, tokens, hidden]``) arriving in ``layer``; ``mask [B, tokens]`` marks its real
        tokens (None: all real)."""
        others = [m.name for m in cache.methods if m is not self and evicts(m)]
        if others:
            raise CacheUsageError(
                f"locret evicts inside its chunked prefill and shares a spec with quantizers only, not with {others[0]}; "
                "use one of them (e.g. locret:ratio=0.75+kivi:bits=4)"
            )
        batch, tokens = hidden.shape[:2]
        real = mask[:, -tokens:].sum(dim=-1) if mask is not None else torch.full((batch,), tokens)
        layer.state[PROMPT_END] = layer.seen + tokens
        layer.state[PROMPT_REAL] = real.long()
        layer.state[OFFSETS] = None if mask is None else (tokens - real).long()

    def prompt_target(self, layer) -> torch.Tensor:
        """Tokens each row keeps of its prompt, ``[batch]``."""
        real = layer.state[PROMPT_REAL].to(layer.store.keys.device)
        if self.ratio is not None:
            return (real.double() * (1 - self.ratio)).long().clamp(min=1)
        return real.clamp(max=self.budget)

    def after_attention(self, layer, step) -> None:
        if PROMPT_END not in layer.state and step.is_prefill:  # a prompt that came without the hook: one chunk
            valid = layer.store.valid[:, 0]
            layer.state[PROMPT_END], layer.state[PROMPT_REAL] = layer.seen, valid.sum(dim=-1)
            layer.state[OFFSETS] = None if bool(valid.all()) else (~valid).sum(dim=-1)
        end = layer.state.get(PROMPT_END)
        if end is None or layer.seen > end:
            return  # tokens after the prompt come on top
        store, new = layer.store, step.query.shape[-2]
        if not store.has_extra(SCORES):
            store.add_extra(SCORES)
        store.extra(SCORES)[..., -new:] = self.score_new(layer, step)
        targets = self.prompt_target(layer)
        if len(store) > int(targets.max()):
            window = targets if self.budget is not None else targets // 4
            scores = pool(store.extra(SCORES), self.pool, "max")  # SnapKV's smoothing: a needle's neighbours go with it
            keep_top(layer, protect_first(scores, store.valid, self.sinks), targets, window.clamp(max=self.window))
        if layer.seen == end:  # the prompt is in: its scores are no longer needed
            store.drop_extra(SCORES)

    def score_new(self, layer, step) -> torch.Tensor:
        """The heads' scores ``[B, H_kv, new]`` of the tokens this step stored (the newest slots)."""
        if self.trained is None:
            raise CacheUsageError("locret has no retaining heads: build the cache with kvopt.cache(spec, model)")
        store, new = layer.store, step.query.shape[-2]
        table = self.tables.get(layer.index)
        if table is None:
            try:
                table = locret_heads.rope_table(step.module, layer.index, step.query.shape[-1], step.query.device)
            except RopeError as error:
                raise MethodParameterError(f"locret reads pre-RoPE queries and keys, but {error}") from None
            self.tables[layer.index] = table
        positions = step.query_positions.reshape(1, 1, new).expand(step.query.shape[0], 1, new).long()
        positions = rope_positions(positions, layer.state.get(OFFSETS))
        features = locret_heads.token_features(
            step.query, store.keys[:, :, -new:], store.values[:, :, -new:], positions, table
        )
        return self.trained.heads.score(layer.index, features)

    def prompt_tokens(self, layer) -> torch.Tensor:
        return layer.state.get(PROMPT_REAL, super().prompt_tokens(layer))


# -- chunking the prompt inside each attention module ---------------------------------------------
def install(model) -> None:
    """Register :func:`split_prompt` and :func:`join_prompt` on each attention module, once however often called."""
    for module in attention_modules(model):
        if not getattr(module, HOOKED, False):
            module.register_forward_pre_hook(split_prompt, with_kwargs=True)
            module.register_forward_hook(join_prompt, with_kwargs=True)
            setattr(module, HOOKED, True)


def _locret_layer(module, kwargs: dict):
    """``(method, cache layer)`` when this attention call writes into a kvopt cache with ``locret``, else None."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if not isinstance(cache, KVCache):
        return None
    method = next((m for m in cache.methods if isinstance(m, Locret)), None)
    return None if method is None else (cache, method, cache.layers[module.layer_idx])


def split_prompt(module, args: tuple, kwargs: dict):
    """Forward pre-hook: a prompt entering an empty layer runs its chunks but the last through ``module`` here
    (the methods after ``locret`` waiting), and the forward gets the last chunk."""
    found = _locret_layer(module, kwargs)
    if found is None:
        return None
    cache, method, layer = found
    kwargs = dict(kwargs)
    if args:
        kwargs["hidden_states"], args = args[0], args[1:]
    hidden = kwargs["hidden_states"]
    tokens = hidden.shape[1]
    if layer.seen:
        return None
    mask = kwargs.get("attention_mask")
    method.start_prompt(cache, layer, hidden, mask if isinstance(mask, torch.Tensor) else None)
    if tokens <= method.chunk:
        return None
    last = (tokens - 1) // method.chunk * method.chunk
    methods = layer.methods
    layer.methods = methods[: methods.index(method) + 1]
    try:
        outputs = [module.forward(*args, **_chunk(kwargs, start, start + method.chunk))[0] for start in range(0, last, method.chunk)]
    finally:
        layer.methods = methods
    layer.state[OUTPUTS] = outputs
    return args, _chunk(kwargs, last, tokens)


def join_prompt(module, args: tuple, kwargs: dict, output):
    """Forward hook: the earlier chunks' outputs before the last one's."""
    found = _locret_layer(module, kwargs)
    earlier = found[2].state.pop(OUTPUTS, None) if found is not None else None
    if earlier is None:
        return None
    return (torch.cat([*earlier, output[0]], dim=1), *output[1:])


def _chunk(kwargs: dict, start: int, stop: int) -> dict:
    """An attention module's arguments for the prompt's tokens ``start:stop`` (the padding mask up to ``stop``)."""
    sliced = dict(kwargs, hidden_states=kwargs["hidden_states"][:, start:stop])
    if kwargs.get("position_embeddings") is not None:
        sliced["position_embeddings"] = tuple(t[:, start:stop] for t in kwargs["position_embeddings"])
    if kwargs.get("position_ids") is not None:
        sliced["position_ids"] = kwargs["position_ids"][..., start:stop]
    if isinstance(kwargs.get("attention_mask"), torch.Tensor):
        sliced["attention_mask"] = kwargs["attention_mask"][:, :stop]
    return sliced
