"""One sequence being generated: its tokens, its block table and where it stands."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from kvopt.engine.kv.base import SequenceKV, StoredPrompt
from kvopt.engine.kv.lossless import LosslessKV
from kvopt.engine.sampling_params import SamplingParams
from kvopt.speculative.control import DraftPace


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    #: Preempted with its blocks copied out of the pool (``preemption_mode="swap"``).
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """Token ids (prompt then output), how many have their KV in the pool, and the blocks holding it.

    ``num_computed_tokens`` counts tokens whose keys/values are written (or were found in the
    prefix cache); the newest sampled token is never computed until the next step feeds it.
    It is also the next token's position; a compressed sequence stores fewer tokens than that.
    """

    seq_id: int
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    arrival_time: float
    #: Which of the request's ``n`` completions this is.
    index: int = 0
    priority: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    #: Prompt tokens found in the prefix cache at the first admission (reported to the user), once looked up.
    num_cached_tokens: int = 0
    prefix_looked_up: bool = False
    block_table: list[int] = field(default_factory=list)
    #: How its KV is held (:mod:`kvopt.engine.kv`): the engine drives it through this protocol alone.
    kv: SequenceKV = field(default_factory=LosslessKV)
    #: A compressed sequence's blocks of quantized groups.
    code_table: list[int] = field(default_factory=list)
    #: A compressed prompt's state found in the KV tiers, until it is installed at admission.
    prompt_state: StoredPrompt | None = None
    finish_reason: str | None = None
    #: Per-request random stream (``SamplingParams.seed``), shared by the request's completions.
    generator: torch.Generator | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    #: Tokens guessed after the newest one for this step (speculative decoding): computed with it, kept only as
    #: far as the model's own choices agree (never part of ``token_ids`` until then).
    draft_token_ids: list[int] = field(default_factory=list)
    #: How much to draft next, following what the model accepted (None until the first draft).
    draft_pace: DraftPace | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_stored_tokens(self) -> int:
        """Tokens in the slots of ``block_table`` (fewer than computed once a method compressed them)."""
        return self.kv.stored_tokens(self.num_computed_tokens)

    def slots_needed(self, num_new_tokens: int) -> int:
        """Slots ``block_table`` must have once ``num_new_tokens`` more tokens are stored."""
        return self.kv.slots_needed(self.num_computed_tokens, num_new_tokens)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def step_token_ids(self, count: int) -> list[int]:
        """The ``count`` tokens this step computes: the first uncomputed ones, then the drafts."""
        first = self.num_computed_tokens
        own = self.token_ids[first : first + count]
        return own + self.draft_token_ids[: count - len(own)] if len(own) < count else own

    def append_token(self, token_id: int, now: float) -> None:
        self.token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = now
        elif now != self.last_token_time:  # the tokens of one step (accepted drafts) arrive together: one gap a step
            self.inter_token_latencies.append(now - self.last_token_time)
        self.last_token_time = now

    def fork(self, seq_id: int, index: int) -> Sequence:
        """A sibling sharing this sequence's tokens and blocks (the caller raises the blocks' ref counts).

        A seeded request's siblings get streams of their own (seed + index, as vLLM), so what one
        draws never depends on which of them sample in the same step.
        """
        seed = self.params.seed
        generator = None if seed is None else torch.Generator().manual_seed(seed + index)
        return Sequence(
            seq_id, self.request_id, list(self.token_ids), self.num_prompt_tokens, self.params, self.arrival_time,
            index=index, priority=self.priority, status=self.status, num_computed_tokens=self.num_computed_tokens,
            num_cached_tokens=self.num_cached_tokens, prefix_looked_up=True, block_table=list(self.block_table),
            generator=generator,
        )  # fmt: skip

    @property
    def width(self) -> int:
        """Sequences this one will run as: ``n`` until a parallel-sampling request forks (a lossless one shares its
        prompt's blocks; a compressed one's completions are sequences of their own from the start), then 1."""
        return self.params.n if self.kv.shares_blocks and self.num_output_tokens == 0 else 1
