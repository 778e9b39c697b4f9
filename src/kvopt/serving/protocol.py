"""Request bodies of the OpenAI API as pydantic models, and their translation into engine terms.

Fields and defaults are OpenAI's (``temperature`` 1, completions' ``max_tokens`` 16), plus vLLM's
sampling extensions (``top_k``, ``ignore_eos``, ``stop_token_ids``) and kvopt's ``kv_method``.
Validation is strict (no string-to-number coercion) and an unknown field is refused rather than
ignored, so a typo never silently changes sampling. Fields that take one of several shapes
validate through one function each, so an error names the field once with what it accepts.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from kvopt.engine import SamplingParams
from kvopt.errors import KVOptError
from kvopt.methods import parse

#: Most alternatives per token a request may ask log-probabilities of (OpenAI's chat limit).
MAX_TOP_LOGPROBS = 20
STRICT = ConfigDict(extra="forbid", strict=True)


def _token_ids(value: object) -> bool:
    return isinstance(value, list) and all(type(token) is int and token >= 0 for token in value)


def _prompt(value: object) -> str | list[int]:
    if isinstance(value, str) or _token_ids(value):
        return value
    raise PydanticCustomError("prompt_type", "must be a string or a list of token ids >= 0 (one prompt per request)")


def _stop(value: object) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if isinstance(value, list) and len(value) <= 16 and all(isinstance(s, str) and s for s in value):
        return value
    raise PydanticCustomError("stop_type", "must be a non-empty string or a list of at most 16 of them")


def _content(value: object) -> str:
    """Text content, or OpenAI's list of content parts of type ``text`` (joined)."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        and set(part) <= {"type", "text"} for part in value
    ):  # fmt: skip
        return "".join(part["text"] for part in value)
    raise PydanticCustomError(
        "content_type", "must be a string or a list of {\"type\": \"text\", \"text\": ...} parts (text only)"
    )


Prompt = Annotated[str | list[int], PlainValidator(_prompt, json_schema_input_type=str | list[int])]
Stop = Annotated[list[str], PlainValidator(_stop, json_schema_input_type=str | list[str] | None)]
Content = Annotated[str, PlainValidator(_content, json_schema_input_type=str | list[dict[str, str]] | None)]


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class GenerateRequest(BaseModel):
    """The fields completions and chat share."""

    model_config = STRICT
    model: str | None = Field(None, description="the served model's name (GET /v1/models); optional")
    max_tokens: int | None = Field(None, ge=1, description="tokens to generate at most")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 is greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=16, description="completions per prompt (sharing the prompt's KV blocks)")
    stop: Stop = Field(default_factory=list, description="strings that end a completion (not included)")
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, description="not supported: must be 0")
    frequency_penalty: float = Field(0.0, description="not supported: must be 0")
    logit_bias: dict[str, float] | None = Field(None, description="not supported: must be empty")
    user: str | None = Field(None, description="an end-user id (ignored)")
    top_k: int = Field(0, ge=0, description="vLLM extension: sample among the k most likely tokens (0: all)")
    ignore_eos: bool = Field(False, description="vLLM extension: continue past the end-of-sequence token")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list, description="vLLM extension")
    kv_method: str | None = Field(
        None, description="kvopt extension: the KV-cache method spec for this request, e.g. 'full' (`kvopt methods`)"
    )

    @field_validator("presence_penalty", "frequency_penalty", "logit_bias")
    @classmethod
    def _neutral(cls, value):
        if value:
            raise PydanticCustomError("unsupported", "not supported by kvopt's engine; leave it out (or set 0)")
        return value

    @field_validator("kv_method")
    @classmethod
    def _known_method(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                parse(value)
            except KVOptError as error:
                raise PydanticCustomError("kv_method", "{problem}", {"problem": str(error)}) from None
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's settings for this request (``SamplingParamsError`` names a field out of range)."""
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
            max_tokens=max_tokens, stop=list(self.stop), stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos, logprobs=self.requested_logprobs, kv_method=self.kv_method,
        )  # fmt: skip

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(GenerateRequest):
    prompt: Prompt = Field(description="text, or token ids")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="alternatives per token to report")

    @property
    def requested_logprobs(self) -> int | None:
        """Alternatives per token to report log-probabilities of; None for no log-probabilities."""
        return self.logprobs


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content = ""
    name: str | None = None

    def as_template_input(self) -> dict[str, str]:
        message = {"role": self.role, "content": self.content}
        return message | ({"name": self.name} if self.name else {})


class ChatCompletionRequest(GenerateRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI's newer name for max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise PydanticCustomError("top_logprobs", "needs \"logprobs\": true")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize``: a prompt, or messages in the chat template."""

    model_config = STRICT
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
