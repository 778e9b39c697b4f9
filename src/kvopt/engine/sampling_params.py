"""Per-request generation settings, named and validated as vLLM's ``SamplingParams``."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvopt.engine.requests import RequestSchemaError, SamplingFields, validated


#: vLLM's epsilon: a temperature this small is greedy.
GREEDY_BELOW = 1e-5


class SamplingParamsError(RequestSchemaError):
    """A sampling parameter is of the wrong type or out of range (a ``ValueError`` naming the field)."""


@dataclass(slots=True)
class SamplingParams:
    """How one request samples and when it stops.

    ``temperature=0`` is greedy (the default, so outputs equal ``model.generate``'s); ``n``
    samples share the prompt's blocks and copy a block only when they write into it.
    """

    n: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    #: Return the log-probability of each sampled token and of this many top alternatives (None: none).
    logprobs: int | None = None
    #: The KV method spec for this request, overriding the engine's (e.g. ``"snapkv:ratio=0.75"``).
    kv_method: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        """The request schema's checks (:mod:`kvopt.engine.requests`: the server and ``kvopt batch`` use the same)."""
        try:
            validated(SamplingFields, {name: getattr(self, name) for name in SamplingFields.model_fields},
                      "SamplingParams.")  # fmt: skip
        except RequestSchemaError as error:
            raise SamplingParamsError(str(error), error.param) from None
        if self.n > 1 and self.greedy:
            raise SamplingParamsError(
                f"SamplingParams.n={self.n} with temperature=0 would return {self.n} identical greedy answers; "
                "set temperature > 0"
            )

    @property
    def greedy(self) -> bool:
        """Temperatures below ``GREEDY_BELOW`` sample the argmax (dividing by them overflows the logits)."""
        return self.temperature < GREEDY_BELOW
