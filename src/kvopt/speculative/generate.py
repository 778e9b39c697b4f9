"""Single-sequence generation through a kvopt cache, with or without speculative decoding.

Each round a proposer drafts tokens after the committed sequence; the target verifies the
block ``[next token, drafts...]`` in one forward pass inside a speculative block of the cache
(:meth:`KVCache.speculate`), :func:`~kvopt.speculative.verify.verify` decides how many drafts
to keep, and the cache commits exactly the tokens plain decoding would have fed. Greedy output
therefore equals plain greedy decoding with the same cache, and the cache ends up holding the
same tokens; sampled output follows the target's distribution.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvopt.cache import KVCache
from kvopt.errors import KVOptError
from kvopt.models.forward import cache_kwargs
from kvopt.speculative.control import DraftControl
from kvopt.speculative.restore import block_limit, speculate
from kvopt.speculative.sampling import Sampler
from kvopt.speculative.spec import Proposer, parse_proposer
from kvopt.speculative.verify import verify


@dataclass
class SpeculationStats:
    #: Drafted tokens sent to verification, and those accepted.
    proposed: int = 0
    accepted: int = 0
    #: Verification passes (rounds with drafts) and plain one-token steps.
    rounds: int = 0
    plain_steps: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else float("nan")

    @property
    def mean_accepted_length(self) -> float:
        """Drafts accepted per verification pass (each pass also emits one token of the target's own)."""
        return self.accepted / self.rounds if self.rounds else float("nan")


@dataclass
class GenerateOutput:
    #: The new tokens (the prompt excluded).
    tokens: list[int]
    prompt_tokens: int
    prefill_seconds: float
    decode_seconds: float
    stats: SpeculationStats = field(default_factory=SpeculationStats)

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first (which comes out of the prefill) per second of decoding."""
        steps = len(self.tokens) - 1
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds else float("nan")


def generate(
    model,
    input_ids: torch.Tensor | list[int],
    cache: str | KVCache = "full",
    speculate: str | Proposer | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    eos_token_id: int | list[int] | None = None,
    adaptive: bool = True,
    tokenizer=None,
) -> GenerateOutput:
    """Generate up to ``max_new_tokens`` for one prompt through a kvopt ``cache`` (a spec or a fresh cache).

    ``speculate``: None (plain decoding), a spec such as ``"prompt_lookup:k=4"``, ``"self:layers=8"``,
    ``"draft:model=PATH,k=4,cache=kivi:bits=4"``, or a proposer object. ``adaptive`` lets drafting
    shrink and pause while it does not pay (measured); off, every round drafts ``k`` tokens.
    ``eos_token_id`` defaults to the model's; ``tokenizer`` is needed by methods that re-read the
    prompt (kvzip).
    """
    from kvopt.api import build_cache

    ids = _prompt_ids(input_ids, model.config.get_text_config().vocab_size)
    if max_new_tokens < 1:
        raise KVOptError(f"max_new_tokens={max_new_tokens} must be at least 1")
    sampler = Sampler(temperature, top_k, top_p, seed)
    proposer = parse_proposer(speculate) if speculate is not None else None
    cache = build_cache(cache, model) if isinstance(cache, str) else cache
    if not isinstance(cache, KVCache) or cache.get_seq_length():
        raise KVOptError("kvopt.generate needs a fresh kvopt cache: pass a spec, or a new kvopt.cache(spec, model)")
    if proposer is not None:
        proposer.bind(model, cache, sampler)
    stops = _stop_tokens(model, eos_token_id)
    ids = ids.to(model.device)
    with torch.inference_mode():
        start = time.perf_counter()
        new = [sampler.draw(sampler.probs(_prefill(model, cache, ids, tokenizer))[0])]
        prefilled = time.perf_counter()
        stats = _decode(model, cache, proposer, sampler, ids[0].tolist(), new, max_new_tokens, stops, adaptive)
        finished = time.perf_counter()
    return GenerateOutput(new, ids.shape[-1], prefilled - start, finished - prefilled, stats)


def _decode(model, cache, proposer, sampler, prompt, new, max_new_tokens, stops, adaptive) -> SpeculationStats:
    """Extend ``new`` in place until ``max_new_tokens``, a stop token or the context's end."""
    stats = SpeculationStats()
    control = DraftControl(proposer.k if proposer else 0, adaptive and proposer is not None)
    limit = None if any(m.extends_context for m in cache.methods) else cache.info.max_positions
    while len(new) < max_new_tokens and new[-1] not in stops:
        # Drafts that fit: all but the last token still to emit, a block the methods allow, the context.
        blocks = [max_new_tokens - len(new), block_limit(cache), limit and limit - cache.get_seq_length()]
        count = control.next_length(min(block for block in blocks if block is not None) - 1)
        began = time.perf_counter()
        drafts, draft_probs = proposer.propose(prompt + new, count) if count > 0 else ([], None)
        if not drafts:
            new.append(sampler.draw(sampler.probs(_forward(model, cache, new[-1:]))[0]))
            stats.plain_steps += 1
            control.after_step(time.perf_counter() - began)
            continue
        with speculate(cache) as block:
            target = sampler.probs(_forward(model, cache, new[-1:] + drafts))
            accepted, following = verify(sampler, target, drafts, draft_probs)
            emitted = _until_stop(drafts[:accepted] + [following], stops)[: max_new_tokens - len(new)]
            block.commit(len(emitted))  # the block's first token and all emitted but the last
        new.extend(emitted)
        stats.proposed += len(drafts)
        stats.accepted += accepted
        stats.rounds += 1
        control.after_round(len(drafts), accepted, time.perf_counter() - began)
    return stats


def _prefill(model, cache: KVCache, ids: torch.Tensor, tokenizer) -> torch.Tensor:
    """Cache the prompt; the last position's logits ``[1, vocab]``."""
    ids = cache.run_prompt_pass(model, ids, tokenizer)
    return model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1).logits[0]


def _forward(model, cache: KVCache, tokens: list[int]) -> torch.Tensor:
    """Feed ``tokens``; logits ``[len(tokens), vocab]``."""
    ids = torch.tensor([tokens], device=model.device)
    return model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True).logits[0]


def _stop_tokens(model, eos_token_id) -> set[int]:
    if eos_token_id is None:
        config = getattr(model, "generation_config", None) or model.config
        eos_token_id = getattr(config, "eos_token_id", None)
    if eos_token_id is None:
        return set()
    return {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)


def _until_stop(tokens: list[int], stops: set[int]) -> list[int]:
    """``tokens`` up to and including the first stop token."""
    for index, token in enumerate(tokens):
        if token in stops:
            return tokens[: index + 1]
    return tokens


def _prompt_ids(input_ids, vocab: int) -> torch.Tensor:
    """``[1, n]`` int64 ids from a tensor, a list, or a tokenizer's output (``BatchEncoding``: its ``input_ids``),
    each a token id of the model's vocabulary."""
    if hasattr(input_ids, "keys") and "input_ids" in input_ids.keys():
        input_ids = input_ids["input_ids"]
    try:
        ids = input_ids if torch.is_tensor(input_ids) else torch.as_tensor(input_ids, device="cpu").reshape(1, -1)
    except (TypeError, ValueError, RuntimeError):
        raise KVOptError(f"kvopt.generate takes token ids (a [1, n] tensor, a list of ints, or a tokenizer's output), "
                         f"not {type(input_ids).__name__}") from None  # fmt: skip
    if ids.ndim != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise KVOptError(f"kvopt.generate takes one non-empty prompt ([1, n] ids), got shape {tuple(ids.shape)}")
    if ids.is_floating_point() or ids.dtype == torch.bool or ids.is_complex():
        raise KVOptError(f"kvopt.generate takes integer token ids, got {ids.dtype}")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise KVOptError(f"kvopt.generate: token ids must lie in [0, {vocab}); got {int(ids.min())}..{int(ids.max())}")
    return ids.long()
