"""Engine settings and the sizing of the KV pool from a memory budget."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from kvopt.errors import KVOptError
from kvopt.speculative.lookup import PromptLookup
from kvopt.speculative.spec import parse_proposer

_UNITS = {
    "": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
    "kib": 2**10, "mib": 2**20, "gib": 2**30,
}  # fmt: skip
PREEMPTION_MODES = ("recompute", "swap")
POLICIES = ("fcfs", "priority")
#: On a CPU a step computing more tokens costs nearly proportionally more once a few sequences decode together:
#: with prompt-lookup drafts the default model decoded 2.4x / 2.9x faster than without with 1 / 2 sequences on an
#: input-grounded task, 1.03x with 4 and 0.92x with 8 (BENCHMARKS.md, "Speculative decoding in the engine").
CPU_SPECULATE_MAX_BATCH = 2


class EngineConfigError(KVOptError):
    """An engine setting is invalid (names the setting and a valid example)."""


@dataclass(slots=True)
class EngineConfig:
    kv_method: str = "full"
    block_size: int = 16
    #: Bytes for the KV pool: ``"1GB"``, ``"512MiB"``, an int, or a fraction of free memory (``0.5``).
    kv_memory: str | int | float = "1GB"
    enable_prefix_caching: bool = True
    #: Sequences decoded together at most.
    max_num_seqs: int = 64
    #: Tokens computed in one forward pass at most (decodes plus prefill chunks). Larger passes use the
    #: CPU's matrix units better, up to a point (one thread, 24 prompts of 100-1,000 tokens + 48 new
    #: tokens each, wall time: 1024 tokens 50.2 s, 2048 50.6 s, 4096 43.1 s, 8192 65.3 s); a server
    #: wanting smooth inter-token latency under bursts of long prompts sets it lower.
    max_num_batched_tokens: int = 4096
    #: A prompt longer than this is computed in chunks of at most this many tokens per step (vLLM's name): lower
    #: keeps decoding sequences' steps short while long prompts arrive, at the price of more steps per prompt.
    #: None: a prompt's chunk is bounded by ``max_num_batched_tokens`` alone.
    long_prefill_token_threshold: int | None = None
    #: Prompts part-way through their prefill at once at most (vLLM's name): 1 finishes one prompt before starting
    #: the next (its first token sooner; the others wait); None: as many as the token budget reaches.
    max_num_partial_prefills: int | None = None
    #: Inter-token latency to keep while sequences decode, in milliseconds: each step's prompt tokens are sized so
    #: that the step, predicted from the steps just measured, stays within it (:mod:`kvopt.engine.step_budget`);
    #: ``"auto"``: 3x the decoding batch's own step (at least 3x one sequence's, timed when the engine starts);
    #: None: no target (prompts take what the token budget leaves).
    itl_target_ms: float | str | None = None
    #: Longest prompt + output; None: the model's maximum positions.
    max_model_len: int | None = None
    preemption_mode: str = "recompute"
    policy: str = "fcfs"
    #: Where prefix blocks go beyond the pool, fastest first: ``"cpu:4GB"``, ``"disk:/var/cache/kvopt:20GB"``,
    #: ``"redis://127.0.0.1:6379/0?max=1GB"`` (see :mod:`kvopt.engine.offload`).
    kv_tiers: tuple[str, ...] = ()
    #: How tier entries are encoded (:mod:`kvopt.codec`): ``raw`` (lossless) or a lossy codec.
    kv_tier_encoding: str = "raw"
    #: Speculative decoding of lossless sequences: ``"prompt_lookup:k=4,ngram=3"`` drafts up to ``k`` tokens per
    #: step from earlier text, verified in the same forward pass (None: one token per step).
    speculate: str | None = None
    #: Drafts are made only while at most this many sequences run (vLLM's ``disable_by_batch_size``); None: on a CPU
    #: :data:`CPU_SPECULATE_MAX_BATCH`, on an accelerator any number.
    speculate_max_batch: int | None = None
    #: Host memory for the episodes of named conversations (:mod:`kvopt.engine.conversations`): beyond it, the least
    #: recently used idle sessions are dropped (their next turn builds its episodes again).
    session_memory: str | int | float = "1GB"

    def __post_init__(self) -> None:
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens")
        optional = ("speculate_max_batch", "long_prefill_token_threshold", "max_num_partial_prefills")  # when given
        for name in positive + optional:
            value = getattr(self, name)
            if value is None and name in optional:
                continue
            if not _is_int(value) or value < 1:
                raise EngineConfigError(f"{name}={value!r} must be a positive integer")
        threshold, most = self.long_prefill_token_threshold, self.max_num_batched_tokens
        if threshold is not None and threshold > most:
            raise EngineConfigError(f"long_prefill_token_threshold={threshold} is more than max_num_batched_tokens="
                                    f"{most}, which no step exceeds; give at most {most}, or raise "
                                    "max_num_batched_tokens")  # fmt: skip
        self.itl_target_ms = check_itl_target(self.itl_target_ms)
        specs = {"kv_method": "snapkv:ratio=0.5", "kv_tier_encoding": "int8", "speculate": "prompt_lookup:k=4"}
        for name, example in specs.items():
            value = getattr(self, name)
            if not isinstance(value, str) and not (name == "speculate" and value is None):
                raise EngineConfigError(f"{name}={value!r} must be a spec string, e.g. {example!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise EngineConfigError(f"enable_prefix_caching={self.enable_prefix_caching!r} must be True or False")
        if self.max_model_len is not None and (not _is_int(self.max_model_len) or self.max_model_len < 2):
            raise EngineConfigError(f"max_model_len={self.max_model_len!r} must be an integer of at least 2 tokens")
        if isinstance(self.kv_tiers, str):
            self.kv_tiers = (self.kv_tiers,)  # one tier, not one per character
        if not isinstance(self.kv_tiers, (list, tuple)) or not all(isinstance(tier, str) for tier in self.kv_tiers):
            raise EngineConfigError(f"kv_tiers={self.kv_tiers!r} must be a tier spec or a list of them, fastest "
                                    "first, e.g. ['cpu:4GB', 'disk:/var/cache/kvopt:20GB']")  # fmt: skip
        self.kv_tiers = tuple(self.kv_tiers)
        if self.preemption_mode not in PREEMPTION_MODES:
            raise EngineConfigError(f"preemption_mode={self.preemption_mode!r}; use one of {PREEMPTION_MODES}")
        if self.policy not in POLICIES:
            raise EngineConfigError(f"policy={self.policy!r}; use one of {POLICIES}")
        parse_memory(self.kv_memory, torch.device("cpu"))  # fail early on a malformed size
        parse_memory(self.session_memory, torch.device("cpu"), "session_memory")
        self.proposer()

    def proposer(self) -> PromptLookup | None:
        """The drafting of ``speculate`` (None without it)."""
        if self.speculate is None:
            return None
        try:
            proposer = parse_proposer(self.speculate)
        except KVOptError as error:
            raise EngineConfigError(f"speculate={self.speculate!r}: {error}") from None
        if not isinstance(proposer, PromptLookup):
            raise EngineConfigError(
                f"speculate={self.speculate!r}: the engine drafts with prompt_lookup (e.g. 'prompt_lookup:k=4'), "
                f"which needs no second model or cache per sequence; {proposer.name} runs in kvopt.generate"
            )
        return proposer


def check_itl_target(value: float | str | None) -> float | str | None:
    """``itl_target_ms`` as None, ``"auto"`` or a positive finite number of milliseconds (a numeric string, as the
    command line gives it, included); else one line naming the fix."""
    if value is None or value == "auto":
        return value
    number = value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = None
    if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number) or number <= 0:
        raise EngineConfigError(f"itl_target_ms={value!r} must be a positive number of milliseconds (e.g. 250) or "
                                "'auto' (3x the decoding batch's step)")  # fmt: skip
    return float(number)


def _is_int(value: object) -> bool:
    """An int that is not a bool (``True`` is no count of tokens)."""
    return isinstance(value, int) and not isinstance(value, bool)


def parse_memory(value: str | int | float, device: torch.device, name: str = "kv_memory") -> int:
    """Bytes from ``"1GB"`` / ``"512MiB"`` / ``1_000_000`` / a fraction of the device's free memory
    (``name`` is the setting errors name)."""
    if isinstance(value, float) or (isinstance(value, str) and re.fullmatch(r"0?\.\d+|1\.0*", value.strip())):
        fraction = float(value)
        if not 0.0 < fraction <= 1.0:
            raise EngineConfigError(f"{name}={value!r}: a fraction of free memory must lie in (0, 1], e.g. 0.5")
        return int(fraction * free_memory(device))
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise EngineConfigError(
                f"{name}={value!r} is not a size; write e.g. '1GB', '512MiB', 1000000 or a fraction such as 0.5"
            )
        size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise EngineConfigError(f"{name}={value!r} must be more than 0 bytes")
    return size


def free_memory(device: torch.device) -> int:
    """Bytes free on ``device``: VRAM for accelerators, available RAM for the CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available
