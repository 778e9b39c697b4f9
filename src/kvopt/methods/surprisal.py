"""``surprisal``: query-agnostic eviction by the information each prompt token carried, read off the prefill.

KVzip's premise is that a cache compressed before the question is known must keep what is needed to
reproduce the context; it finds those tokens with a reconstruction pass costing several prefills. The
tokens the model *could not predict* are the same in spirit: a token predicted well (the hundredth copy of
a filler sentence, the end of a common word) adds little the rest of the cache does not imply, while one
it could not predict (a passkey's digits, a name, a number) is information no other cached token holds.
Self-information ``-log p(x_t | x_<t)`` ranks a prompt's tokens that way (Selective Context, Li et al.,
arXiv 2310.06201, prunes prompt *text* by it); here it ranks cached tokens. The model's predictions come
from the prefill's own final hidden states (captured during the forward, :func:`final_states`), through
the LM head in chunks: one extra pass of the LM head over the prompt, no second forward.

Each token's score is the largest surprisal within ``pool`` tokens of it: a surprising token's
neighbours hold its context ("the best thing to do in San Francisco is eat a sandwich" around "Dolores").
The first ``sinks`` tokens and the last ``window`` (at most a quarter of the budget) are always kept,
inside the budget. One token set serves every layer and KV head. The defaults come from pilots on the
default model. The recent window matters more than for KVzip, whose per-head scores keep local context by
themselves: the benchmark's first 2k passkey prompt was lost with ``window=8`` and kept with 64, at 75% and
90% removed. But a fixed 64 ate small budgets: on 1k prompts at 90% removed (103 tokens kept), 9 prompts of
passkey / niah / niah_multivalue kept 14% of their answers with 64, 36% with 32 and 38% with 16, while at
75% removed (256 kept) 64 beat 32 (75% vs 62%); hence the quarter. ``pool=2`` lost
every niah needle hidden in license text on the benchmark's first prompts (a needle's words are not
surprising there, only its rarest token is), so ``pool`` was chosen on prompts outside the benchmark
(samples 20-22 of passkey / niah / niah_multivalue at 2k): 8 kept 72% / 69% of ``full``'s answers at
75% / 90% removed, 12 and 16 fewer.

Cost: the LM head over every prompt token, chunked ([chunk, vocab] logits at a time): 1.30x a plain
prefill at 2k and 1.19x at 4k here (BENCHMARKS.md, ``benchmarks/frontier.py``), against KVzip's 3.7x / 3.9x.
Deviations from Selective Context: tokens, not phrases or sentences, and KV eviction, not prompt pruning.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvopt.errors import CacheUsageError, MethodParameterError
from kvopt.methods.base import register
from kvopt.methods.eviction import Eviction, keep_top, protect_first
from kvopt.methods.scores import pool


@register
@dataclass
class Surprisal(Eviction):
    """Keep the prompt tokens the model predicted worst (and their neighbours), the same set in every layer."""

    name = "surprisal"
    summary = "query-agnostic: keep the prompt tokens the model could not predict (self-information, one LM-head pass)"
    needs_prefill_pass = True
    reads_prompt_states = True
    selects_per_head = False
    runs_in_engine = False  # scores the whole prompt after the prefill, with the prompt's hidden states in hand

    window: int = field(default=64, metadata={"help": "most recent tokens always kept (at most a quarter of the budget), counted in it"})
    sinks: int = field(default=4, metadata={"help": "first tokens always kept (attention sinks)"})
    pool: int = field(default=8, metadata={"help": "a token scores the surprisal within this many tokens of it..."})
    pooling: str = field(default="max", metadata={"help": "...pooled by max or mean"})
    chunk: int = field(default=256, metadata={"help": "prompt tokens per LM-head call (bounds the logits' memory)"})

    def validate(self) -> None:
        super().validate()
        if self.sinks < 0 or self.pool < 0 or self.chunk < 1 or self.pooling not in ("max", "mean"):
            raise MethodParameterError(
                f"surprisal: sinks={self.sinks} and pool={self.pool} must be >= 0, chunk={self.chunk} >= 1 and "
                f"pooling={self.pooling!r} 'max' or 'mean'"
            )

    def after_attention(self, layer, step) -> None:
        """Nothing during the prefill itself: scoring needs the whole prompt's predictions first."""

    def after_prefill(self, cache, model, input_ids, attention_mask, tokenizer) -> None:
        states = cache.prompt_states
        if states is None:
            raise CacheUsageError(
                "surprisal reads the prompt's final hidden states, captured by cache.prefill(model, ids) (or a "
                "recorded prefill replayed); prefill through it, on a model whose decoder has a final `norm`"
            )
        if states.shape[:2] != input_ids.shape or any(layer.seen != input_ids.shape[1] for layer in cache.layers):
            raise CacheUsageError(
                f"surprisal compresses one prompt prefilled into an empty cache: the cache has seen "
                f"{cache.layers[0].seen} tokens for a prompt of {input_ids.shape[1]}"
            )
        information = self.ranks(prompt_surprisal(model, states, input_ids, attention_mask, self.chunk))
        for layer in cache.layers:
            scores = information[:, None, -len(layer.store) :]  # a sliding layer holds the newest tokens
            sinks = protect_first(scores, layer.store.valid[:, :1], max(self.sinks, 1))  # the first token at least
            targets = self.targets(layer, None)
            keep_top(layer, sinks, targets, (targets // 4).clamp(max=self.window))  # a quarter of the budget at most

    def ranks(self, surprisal: torch.Tensor) -> torch.Tensor:
        """Each token's score as a rank, higher kept first: by pooled surprisal, ties by the token's own.

        Max-pooling copies a spike's value to its neighbours, so budgets often cut through a run of equal
        scores; the tie-break keeps the run's most surprising tokens first, and the same ones whether a prompt
        is scored alone or in a padded batch (``topk`` breaks exact ties arbitrarily).
        """
        order = surprisal.argsort(dim=-1, descending=True, stable=True)
        order = order.gather(-1, self.pooled(surprisal).gather(-1, order).argsort(dim=-1, descending=True, stable=True))
        ranks = torch.empty_like(surprisal)
        best_first = -torch.arange(surprisal.shape[-1], dtype=surprisal.dtype, device=surprisal.device)
        return ranks.scatter_(-1, order, best_first.expand_as(order))

    def pooled(self, surprisal: torch.Tensor) -> torch.Tensor:
        """Each token's surprisal pooled (max or mean) over the ``pool`` tokens either side, ``[batch, tokens]``."""
        return pool(surprisal, 2 * self.pool + 1, "max" if self.pooling == "max" else "avg")


def prompt_surprisal(
    model, states: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, chunk: int = 256
) -> torch.Tensor:
    """``-log p(x_t | x_<t)`` of every prompt token from the final hidden states ``[batch, tokens, hidden]``,
    ``[batch, tokens]`` float32. A row's first real token (nothing predicts it) and its padding score 0."""
    head = model.get_output_embeddings()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    batch, tokens = input_ids.shape
    surprisal = torch.zeros((batch, tokens), device=input_ids.device)
    for start in range(0, tokens - 1, chunk):
        stop = min(start + chunk, tokens - 1)
        logits = head(states[:, start:stop]).float()  # predictions of tokens start+1 ... stop
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        # log_softmax, then one gather: torch.logsumexp over the vocabulary is ~6x slower on CPU
        chosen = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, start + 1 : stop + 1, None])[..., 0]
        surprisal[:, start + 1 : stop + 1] = -chosen
    if attention_mask is not None:  # a real token after padding is predicted from a padding slot: no prediction
        real = attention_mask.bool()
        predicted = real & F.pad(real[:, :-1], (1, 0), value=False)
        surprisal = surprisal.masked_fill(~predicted, 0.0)
    return surprisal
