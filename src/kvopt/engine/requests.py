"""The one request schema: what the Python API (:class:`~kvopt.SamplingParams`, ``LLM.generate``), ``kvopt batch``
and the HTTP server accept, as pydantic models, so the three accept and refuse the same things with the same
message, naming the field.

Request bodies are OpenAI's (``temperature`` 1, completions' ``max_tokens`` 16), plus vLLM's sampling extensions
(``top_k``, ``ignore_eos``, ``stop_token_ids``) and kvopt's ``kv_method``. Validation is strict (no string-to-number
coercion) and an unknown field is refused rather than ignored, so a typo never silently changes sampling. Fields
that take one of several shapes validate through one function each, so an error names the field once with what it
accepts. Text must be encodable as UTF-8 (a lone surrogate such as ``"\\ud800"`` is refused, not handed to the
tokenizer).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import (
    AfterValidator, BaseModel, ConfigDict, Field, PlainValidator, ValidationError, ValidationInfo, field_validator,
)  # fmt: skip
from pydantic_core import PydanticCustomError

from kvopt.errors import KVOptError
from kvopt.methods import parse

if TYPE_CHECKING:
    from kvopt.engine.sampling_params import SamplingParams

#: Most alternatives per token a request may ask log-probabilities of (OpenAI's chat limit, vLLM's default).
MAX_LOGPROBS = 20
#: Most completions per prompt.
MAX_N = 16
#: The name the default model (the embedded SmolLM2-135M-Instruct) is served under when no --model names one.
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
STRICT = ConfigDict(extra="forbid", strict=True)


class RequestSchemaError(KVOptError):
    """A request field is missing, of the wrong type or out of range; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def unencodable(text: str) -> str | None:
    """Why ``text`` cannot be UTF-8 (a lone surrogate, which JSON's ``\\ud800`` escapes can carry), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return (f"holds a lone surrogate (U+{ord(text[error.start]):04X} at character {error.start}), which is not "
                "text; send valid Unicode")  # fmt: skip
    return None


def check_text(text: str, field: str) -> str:
    """``text`` if it is valid Unicode; else a :class:`RequestSchemaError` naming ``field``."""
    problem = unencodable(text)
    if problem:
        raise RequestSchemaError(f"{field} {problem}", param=field.split("[")[0].split(".")[0])
    return text


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise PydanticCustomError("string_type", "must be a string")
    problem = unencodable(value)
    if problem:
        raise PydanticCustomError("unicode", problem)
    return value


def _token_ids(value: object) -> bool:
    return isinstance(value, list) and all(type(token) is int and token >= 0 for token in value)


def _prompt(value: object) -> str | list[int]:
    if isinstance(value, str):
        return _text(value)
    if _token_ids(value):
        return value
    raise PydanticCustomError("prompt_type", "must be a string or a list of token ids >= 0 (one prompt per request)")


def _stop(value: object) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if isinstance(value, list) and len(value) <= 16 and all(isinstance(s, str) and s for s in value):
        return [_text(s) for s in value]
    raise PydanticCustomError("stop_type", "must be a non-empty string or a list of at most 16 of them")


def _content(value: object) -> str:
    """Text content, or OpenAI's list of content parts of type ``text`` (joined)."""
    if isinstance(value, str):
        return _text(value)
    if isinstance(value, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        and set(part) <= {"type", "text"} for part in value
    ):  # fmt: skip
        return _text("".join(part["text"] for part in value))
    raise PydanticCustomError(
        "content_type", "must be a string or a list of {\"type\": \"text\", \"text\": ...} parts (text only)"
    )


def _document(value: object) -> str:
    """A retrieved document: text with something in it (an empty one has no KV to reuse; the API refuses it too)."""
    text = _text(value)
    if not text:
        raise PydanticCustomError("empty_document", "must not be empty; drop empty documents")
    return text


def _known_method(value: str) -> str:
    """A spec that parses, naming each method once (``full+full`` is as much a mistake as ``snapkv+snapkv``)."""
    try:
        names = [method.name for method in parse(value)]
    except KVOptError as error:
        raise PydanticCustomError("kv_method", "{problem}", {"problem": str(error)}) from None
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise PydanticCustomError("kv_method", "names {names} more than once; give each method once",
                                  {"names": ", ".join(repeated)})  # fmt: skip
    return value


Text = Annotated[str, PlainValidator(_text, json_schema_input_type=str)]
Prompt = Annotated[str | list[int], PlainValidator(_prompt, json_schema_input_type=str | list[int])]
Stop = Annotated[list[str], PlainValidator(_stop, json_schema_input_type=str | list[str] | None)]
Content = Annotated[str, PlainValidator(_content, json_schema_input_type=str | list[dict[str, str]])]
Document = Annotated[str, PlainValidator(_document, json_schema_input_type=str)]
KVMethod = Annotated[str, AfterValidator(_known_method)]
N = Annotated[int, Field(ge=1, le=MAX_N, description="completions per prompt (sharing the prompt's KV blocks)")]
Temperature = Annotated[float, Field(ge=0.0, le=2.0, description="0 is greedy")]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
TopK = Annotated[int, Field(ge=0, description="vLLM extension: sample among the k most likely tokens (0: all)")]
Seed = Annotated[int, Field(ge=0, lt=2**63)]
MaxTokens = Annotated[int, Field(ge=1, description="tokens to generate at most")]
Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS, description="alternatives per token to report")]
TokenIds = list[Annotated[int, Field(ge=0)]]


class SamplingFields(BaseModel):
    """:class:`~kvopt.SamplingParams` as checked: the bodies' bounds, the Python API's defaults (greedy)."""

    model_config = STRICT
    n: N = 1
    temperature: Temperature = 0.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    seed: Seed | None = None
    max_tokens: MaxTokens = 16
    stop: Stop = Field(default_factory=list)
    stop_token_ids: TokenIds = Field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: Logprobs | None = None
    kv_method: KVMethod | None = None


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class GenerateRequest(BaseModel):
    """The fields completions and chat share."""

    model_config = STRICT
    model: str | None = Field(None, description="the served model's name (GET /v1/models); optional")
    max_tokens: MaxTokens | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    n: N = 1
    stop: Stop = Field(default_factory=list, description="strings that end a completion (not included)")
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, description="not supported: must be 0")
    frequency_penalty: float = Field(0.0, description="not supported: must be 0")
    logit_bias: dict[str, float] | None = Field(None, description="not supported: must be empty")
    user: str | None = Field(None, description="an end-user id (ignored)")
    top_k: TopK = 0
    ignore_eos: bool = Field(False, description="vLLM extension: continue past the end-of-sequence token")
    stop_token_ids: TokenIds = Field(default_factory=list, description="vLLM extension")
    kv_method: KVMethod | None = Field(
        None, description="kvopt extension: the KV-cache method spec for this request, e.g. 'full' (`kvopt methods`)"
    )
    #: kvopt's extension for long conversations: the request is a turn of the named conversation, answered from the
    #: episode of its history its question matches (an ``epicache`` kv_method; :mod:`kvopt.engine.conversations`).
    session: Text | None = Field(
        None, min_length=1, description="kvopt: a long conversation's name; its turns are answered from episodes (epicache)",
    )  # fmt: skip

    @field_validator("presence_penalty", "frequency_penalty", "logit_bias")
    @classmethod
    def _neutral(cls, value):
        if value:
            raise PydanticCustomError("unsupported", "not supported by kvopt's engine; leave it out (or set 0)")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        """The name the request gave its output limit under (errors about it name that)."""
        return "max_tokens"

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's settings for this request (``SamplingParamsError`` names a field out of range)."""
        from kvopt.engine.sampling_params import SamplingParams

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
    logprobs: Logprobs | None = None

    @property
    def requested_logprobs(self) -> int | None:
        """Alternatives per token to report log-probabilities of; None for no log-probabilities."""
        return self.logprobs


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content
    name: Text | None = None

    def as_template_input(self) -> dict[str, str]:
        message = {"role": self.role, "content": self.content}
        return message | ({"name": self.name} if self.name else {})


class ChatCompletionRequest(GenerateRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    #: kvopt's extension for retrieval-augmented prompts: each document is tokenized on its own and placed, followed by
    #: a blank line, at the start of the last user message's text (where that message's content begins in the chat
    #: template); its KV is computed once and reused wherever it appears (``kvopt serve --chunk-caching``).
    documents: list[Document] | None = Field(
        None, min_length=1, description="kvopt: retrieved documents before the last user message, reused by content",
    )  # fmt: skip
    max_completion_tokens: MaxTokens | None = Field(None, description="OpenAI's newer name for max_tokens")
    logprobs: bool = False
    top_logprobs: Logprobs | None = None

    @field_validator("documents")
    @classmethod
    def _without_session(cls, value: list[str] | None, info: ValidationInfo) -> list[str] | None:
        # A session's turn is answered from its episodes, which hold no documents reused by content.
        if value is not None and info.data.get("session") is not None:
            raise PydanticCustomError("documents_session", "cannot be combined with session; send the documents in "
                                      "the messages")  # fmt: skip
        return value

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
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def unserved_model(name: str | None, served: str) -> str | None:
    """Why a request naming ``model`` ``name`` is not for the ``served`` one (the server answers 404, ``kvopt batch``
    refuses the line); None when it names that one or none."""
    if name is None or name == served:
        return None
    return f"model {name!r} is not served here; use {served!r} or leave model out"


def check_prompt(value: object, field: str = "prompt") -> str | list[int]:
    """One prompt (text, or token ids as a list or tuple of ints >= 0) checked like the server's ``prompt``."""
    try:
        return _prompt(list(value) if isinstance(value, tuple) else value)
    except PydanticCustomError as error:
        raise RequestSchemaError(f"{field}: {error.message()} (got {_shown(value)})", field.split("[")[0]) from None


def validated(model: type[BaseModel], data: object, prefix: str = "") -> BaseModel:
    """``model`` validated from ``data``; a :class:`RequestSchemaError` (``prefix`` + one sentence) otherwise."""
    try:
        return model.model_validate(data)
    except ValidationError as error:
        message, param = describe_validation_error(error.errors())
        raise RequestSchemaError(prefix + message, param) from None


def check_messages(messages: object) -> list[dict[str, str]]:
    """A conversation (a list of ``{"role", "content"}``) as the chat template reads it, checked like the server's."""
    if not isinstance(messages, list) or not messages:
        raise RequestSchemaError(
            f"messages must be a non-empty list of {{\"role\": ..., \"content\": ...}} (got {_shown(messages)})",
            "messages",
        )  # fmt: skip
    return [validated(ChatMessage, message, f"messages[{index}].").as_template_input()
            for index, message in enumerate(messages)]  # fmt: skip


def max_tokens_within(
    requested: int | None, prompt_tokens: int, context: int, default: int, name: str = "max_tokens",
    limit: int | None = None, limit_source: str = "",
) -> int:  # fmt: skip
    """The output tokens a request gets: ``requested`` if it fits the context after the prompt (and ``limit``, set by
    ``limit_source``), else a :class:`RequestSchemaError` saying how many would fit; ``default`` (capped to the room
    left) if None."""
    room = context - prompt_tokens
    limit = min(limit or context - 1, context - 1)
    if requested is None:
        return min(default, limit, room)
    if requested > limit:
        raise RequestSchemaError(f"{name}={requested} is more than the limit of {limit}{limit_source}; ask for at "
                                 f"most {limit}", name)  # fmt: skip
    if requested > room:
        raise RequestSchemaError(
            f"the prompt's {prompt_tokens} tokens plus {name}={requested} exceed the model's context of {context} "
            f"tokens; ask for at most {room} or shorten the prompt", name,
        )  # fmt: skip
    return requested


def describe_validation_error(errors: list[dict]) -> tuple[str, str | None]:
    """One sentence for the first problem pydantic found, and the field it concerns."""
    first = errors[0]
    loc = [part for part in first["loc"] if part != "body"]
    kind = first["type"]
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error", "malformed")
        return f"the body is not valid JSON ({detail} at character {loc[0] if loc else 0}); send one JSON object", None
    if not loc:
        if kind == "missing":
            return "the request has no body; send a JSON object with Content-Type: application/json", None
        return (f"the body must be a JSON object with Content-Type: application/json, "
                f"not {type(first.get('input')).__name__}"), None  # fmt: skip
    # A field of several shapes (``int | None``) reports the shape tried: name the field alone.
    loc = [part for part in loc if not (isinstance(part, str) and ("[" in part or part in ("int", "float", "str")))]
    path = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")
    if kind == "extra_forbidden":
        return f"unknown field {path!r}; see /docs for the fields this endpoint reads", str(loc[0])
    if kind == "missing":
        return f"{path} is required", str(loc[0])
    return f"{path}: {first['msg'][:1].lower()}{first['msg'][1:]} (got {_shown(first.get('input'))})", str(loc[0])


def _shown(value: object) -> str:
    shown = json.dumps(value, default=repr)
    return shown if len(shown) <= 80 else shown[:77] + "..."
