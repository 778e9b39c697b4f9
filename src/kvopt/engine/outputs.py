"""What the engine returns per request (vLLM's ``RequestOutput`` shape)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    #: "stop" (EOS, a stop id or string), "length" (max_tokens or the model's context), "abort",
    #: "error"; None while generating.
    finish_reason: str | None = None
    #: Per generated token: {token id: log-probability} of the chosen token and the top alternatives.
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    #: Prompt tokens whose KV came from the prefix cache instead of being computed.
    cached_tokens: int = 0
    inter_token_latencies: list[float] = field(default_factory=list)

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    #: Why the request failed (finish_reason "error"); the other requests are unaffected.
    error: str | None = None
