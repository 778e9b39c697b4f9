"""``kvopt.LLM``: offline batched generation on the engine, vLLM's ``LLM`` interface."""

from __future__ import annotations

import itertools
import numbers
import os
import threading
import time
from collections.abc import Iterator, Sequence

import torch

from kvopt.engine import sessions
from kvopt.engine.config import EngineConfig, EngineConfigError
from kvopt.engine.conversations import SessionPrompt
from kvopt.engine.llm_engine import ChunkedPrompt, LLMEngine, RequestError
from kvopt.engine.outputs import RequestOutput
from kvopt.engine.requests import RequestSchemaError, check_messages, check_prompt, max_tokens_within
from kvopt.engine.sampling_params import SamplingParams
from kvopt.models.info import ModelInfo

Prompt = str | list[int] | ChunkedPrompt | SessionPrompt
Messages = list[dict[str, str]]


class LLM:
    """Serve many prompts at once over a paged, prefix-cached KV pool.

        llm = kvopt.LLM()                                  # embedded SmolLM2-135M-Instruct
        outputs = llm.generate(prompts, kvopt.SamplingParams(max_tokens=64))
        llm.metrics()["prefix_cache_hits_total"]

    ``model`` is a name or path understood by :func:`kvopt.load_model`, or an already loaded HF
    model (then pass its ``tokenizer``, or give prompts as token ids). ``device`` places a model loaded by name
    (``auto``: a CUDA GPU when there is one); a loaded model stays where it is. ``dtype`` (``fp32``, ``bf16``, or
    ``auto``: bf16 on a CPU with bf16 arithmetic, else fp32) is a model loaded by name's; the KV pool takes the
    model's dtype.

    ``enable_chunk_caching=True`` serves retrieval-augmented prompts ``{"preamble": system_text, "chunks": [doc_a,
    doc_b], "prompt": question}`` (text or token ids; the preamble is optional): each document's KV is computed once
    after the preamble, kept by content (and in ``kv_tiers``), and reused wherever it appears, blended by
    ``blend_strategy`` (``cacheblend``: ``blend_ratio`` of the chunk tokens recomputed, 0 = plain concatenation, 1 =
    full prefill, chosen at layer ``blend_check_layer`` (default 1; a deeper layer chooses better and computes every
    token up to it); ``epic``: each chunk's first tokens), see :mod:`kvopt.chunks`; ``chunk_memory`` bounds the chunk
    KV kept in this process (least recently used first out).

    ``{"session": name, "prompt": conversation_so_far_and_new_turn}`` is a turn of a long conversation with
    ``kv_method="epicache:..."``: the engine keeps the session's episodes and answers each question from its own
    episode's cache (:mod:`kvopt.engine.conversations`).
    """

    def __init__(
        self, model=None, kv_method: str = "full", block_size: int = 16, kv_memory: str | int | float = "1GB",
        enable_prefix_caching: bool = True, tokenizer=None, dtype=None, device=None, weights: str | None = None,
        enable_chunk_caching: bool = False,
        blend_ratio: float = 0.15, blend_strategy: str = "cacheblend", chunk_memory: str | int | float = "256MB",
        blend_check_layer: int | None = None, **engine_options,
    ) -> None:  # fmt: skip
        config = EngineConfig(kv_method, block_size, kv_memory, enable_prefix_caching, **engine_options)
        if model is None or isinstance(model, str) or hasattr(model, "__fspath__"):
            from kvopt.api import load_model

            model, tokenizer = load_model(model, dtype=dtype, device=device, weights=weights)
        elif not (isinstance(model, torch.nn.Module) and hasattr(model, "config")):
            raise EngineConfigError(f"model={model!r} is not a model; give a name or path (e.g. 'qwen2.5-coder-0.5b' "
                                    "or a Hugging Face model folder), or a loaded Hugging Face causal LM")  # fmt: skip
        elif dtype is not None:  # a loaded model runs in its own dtype: silently ignoring the setting would mislead
            raise EngineConfigError(f"dtype={dtype!r} applies to a model loaded by name; convert a loaded model "
                                    "itself (model.to(torch.bfloat16)) or pass its name or path")  # fmt: skip
        elif weights is not None:
            raise EngineConfigError(f"weights={weights!r} applies to a model loaded by name; quantize a loaded model "
                                    "with kvopt.models.int8_linear.quantize_linears(model) or pass its name or path")  # fmt: skip
        _check_context(config.max_model_len, model)
        self.engine = LLMEngine(model, tokenizer, config)
        if enable_chunk_caching:
            self.engine.enable_chunk_caching(blend_ratio, blend_strategy, memory=chunk_memory, check_layer=blend_check_layer)
        self._ids = itertools.count()
        #: One caller at a time drives the engine (which is not thread-safe): add, step, abort, snapshots.
        self._lock = threading.RLock()
        #: Requests some ``generate``/``stream`` call waits for, and the latest output another caller's step made.
        self._owned: set[str] = set()
        self._mailbox: dict[str, RequestOutput] = {}

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True, priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:  # fmt: skip
        """Generate for every prompt (text or token ids); outputs in the prompts' order."""
        prompts = _prompt_list(prompts)
        params = _params_for(sampling_params, len(prompts))
        priorities = [0] * len(prompts) if priority is None else _priorities(priority, len(prompts))
        ids = [str(next(self._ids)) for _ in prompts]
        finished = dict(self._finishing(list(zip(ids, prompts, params, priorities)), use_tqdm))
        return [finished[request_id] for request_id in ids]

    def as_completed(
        self, prompts: Sequence[Prompt], sampling_params: Sequence[SamplingParams], use_tqdm: bool = True,
    ) -> Iterator[tuple[int, RequestOutput]]:  # fmt: skip
        """``(index of the prompt, its final output)`` as each request finishes, so a caller can keep every result
        at once (``kvopt batch`` writes them as they come). Closing the iterator early aborts the rest."""
        prompts = [_one_prompt(prompt, f"prompts[{index}]") for index, prompt in enumerate(prompts)]
        params = _params_for(sampling_params, len(prompts))
        ids = [str(next(self._ids)) for _ in prompts]
        index = {request_id: position for position, request_id in enumerate(ids)}
        for request_id, output in self._finishing(list(zip(ids, prompts, params, [0] * len(ids))), use_tqdm):
            yield index[request_id], output

    def chat(
        self, messages: Messages | Sequence[Messages], sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:  # fmt: skip
        """Generate a reply to one conversation or to each of several (the tokenizer's chat template)."""
        single = isinstance(messages, list) and bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if single or not isinstance(messages, Sequence) else list(messages)
        return self.generate([self.chat_prompt(conversation) for conversation in conversations], sampling_params,
                             use_tqdm)  # fmt: skip

    def chat_prompt(self, messages: Messages) -> list[int]:
        """Token ids of a conversation under the chat template (which writes BOS itself: none is added again)."""
        return list(self.tokenizer(self.apply_chat_template(messages), add_special_tokens=False).input_ids)

    def apply_chat_template(self, messages: Messages) -> str:
        messages = check_messages(messages)
        if self.tokenizer is None or getattr(self.tokenizer, "chat_template", None) is None:
            raise RequestError("chat needs a tokenizer with a chat template; use generate() with a plain prompt")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the request's output after every step that advanced it (cumulative text and ids).

        Closing the generator early (``break``, ``close()``) aborts the request, so its blocks return to the pool.
        """
        request_id = str(next(self._ids))
        (params,) = _params_for(sampling_params, 1)
        self._add([(request_id, _one_prompt(prompt, "prompt"), params, 0)])
        finished = False
        try:
            while not finished:
                for output in self._advance({request_id}):
                    finished = output.finished
                    yield output
        finally:
            self._release({request_id}, {request_id} if finished else set())

    def abort(self, request_id: str) -> None:
        """Stop a request (from any thread); its ``generate`` or ``stream`` ends with ``finish_reason="abort"``."""
        with self._lock:
            self.engine.abort(request_id)

    def metrics(self) -> dict:
        with self._lock:
            return self.engine.metrics()

    def save_session(self, conversation: RequestOutput | list[int], path: str | os.PathLike, encoding: str = "raw"):
        """Save a finished request's KV (its prompt + first completion, or the token ids given) to ``path``.

        After a restart, :meth:`load_session` puts it back; a prompt continuing those tokens then
        computes only what is new (see :mod:`kvopt.engine.sessions`). Returns the path.
        """
        if isinstance(conversation, RequestOutput):
            conversation = list(conversation.prompt_token_ids) + list(conversation.outputs[0].token_ids)
        if not isinstance(conversation, (list, tuple)) or not conversation:
            raise RequestError(f"save_session needs a finished RequestOutput or its token ids, not {conversation!r}")
        with self._lock:
            return sessions.save_session(self.engine, conversation, path, encoding)

    def load_session(self, path: str | os.PathLike) -> list[int]:
        """Restore a saved session's blocks into the prefix cache; returns its token ids (prompt + output)."""
        with self._lock:
            return sessions.load_session(self.engine, path)

    def close(self) -> None:
        """Finish writing blocks to the KV tiers (``kv_tiers=``); the engine keeps serving from its pool."""
        with self._lock:
            self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _finishing(self, requests: list[tuple[str, Prompt, SamplingParams | None, int]], use_tqdm: bool,
                   ) -> Iterator[tuple[str, RequestOutput]]:  # fmt: skip
        """Add ``requests`` (id, prompt, params, priority) and step until all finish, yielding each final output.
        Whatever stops this early (an error, Ctrl-C, the caller) aborts the ones left, so none keeps decoding or
        holding blocks."""
        wanted = {request_id for request_id, *_ in requests}
        finished: set[str] = set()
        try:
            self._add(requests)
            with _Progress(len(wanted), use_tqdm) as progress:
                while len(finished) < len(wanted):
                    for output in self._advance(wanted - finished):
                        if output.finished:
                            finished.add(output.request_id)
                            yield output.request_id, output
                    progress.update(len(finished), self.engine.stats.generation_tokens)
        finally:
            self._release(wanted, finished)

    def _add(self, requests: list[tuple[str, Prompt, SamplingParams | None, int]]) -> None:
        """Queue ``requests`` (id, prompt, params, priority): none if one asks for more tokens than fit."""
        for position, (_, prompt, params, _) in enumerate(requests):
            self._check_room(prompt, params, f"prompts[{position}]" if len(requests) > 1 else "prompt")
        with self._lock:
            for request_id, prompt, params, priority in requests:
                self._owned.add(request_id)
                self.engine.add_request(request_id, prompt, params, priority)

    def _check_room(self, prompt: Prompt, params: SamplingParams | None, where: str) -> None:
        """A ``max_tokens`` that cannot fit after the prompt is refused as the server and ``kvopt batch`` refuse it
        (the default, without ``sampling_params``, stops at the context). A prompt too long for any output, or text
        without a tokenizer, is the engine's to refuse (naming the prompt)."""
        if isinstance(prompt, SessionPrompt):
            prompt = prompt.prompt
        if params is None or isinstance(prompt, ChunkedPrompt) or (isinstance(prompt, str) and self.tokenizer is None):
            return
        length = len(prompt) if isinstance(prompt, list) else len(self.tokenizer(prompt).input_ids)
        context = self.engine.max_model_len
        if length < context:
            try:
                max_tokens_within(params.max_tokens, length, context, params.max_tokens)
            except RequestSchemaError as error:
                raise RequestSchemaError(f"{where}: {error}", error.param) from None

    def _advance(self, wanted: set[str]) -> list[RequestOutput]:
        """The next outputs of ``wanted`` requests: kept for them by another caller's step, else from one step.

        Several threads may each wait for their own requests: one steps the engine at a time (under the lock), and
        outputs for another caller's requests are left for it (the latest per request: outputs are cumulative).
        """
        with self._lock:
            mine = [self._mailbox.pop(request_id) for request_id in wanted if request_id in self._mailbox]
            if mine:
                return mine
            for output in self.engine.step():
                if output.request_id in wanted:
                    mine.append(output)
                elif output.request_id in self._owned:
                    self._mailbox[output.request_id] = output
            return mine

    def _release(self, wanted: set[str], finished: set[str]) -> None:
        """A caller stops waiting for ``wanted``: abort those not ``finished``, forget what was kept for them."""
        with self._lock:
            for request_id in wanted - finished:
                self.engine.abort(request_id)
            for request_id in wanted:
                self._mailbox.pop(request_id, None)
                self._owned.discard(request_id)


class _Progress:
    """A rich progress bar over requests with live output tokens per second."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self.started = time.perf_counter()
        self.tokens_at_start: int | None = None

    def __enter__(self) -> _Progress:
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn("[bold]generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TextColumn("{task.fields[rate]}"), transient=True,
            )  # fmt: skip
            self.bar.start()
            self.task = self.bar.add_task("generate", total=self.total, rate="")
        return self

    def update(self, done: int, tokens: int) -> None:
        if not self.enabled:
            return
        if self.tokens_at_start is None:
            self.tokens_at_start = tokens
        elapsed = time.perf_counter() - self.started
        rate = (tokens - self.tokens_at_start) / elapsed if elapsed else 0.0
        self.bar.update(self.task, completed=done, rate=f"{rate:.1f} tok/s")

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self.bar.stop()


def _params_for(sampling_params: object, count: int) -> list[SamplingParams | None]:
    """One ``SamplingParams`` (or None: the defaults) per prompt, from one for all or a list of one per prompt."""
    params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * count
    if len(params) != count:
        raise RequestSchemaError(f"got {len(params)} SamplingParams for {count} prompts; give one, or one per prompt",
                                 "sampling_params")  # fmt: skip
    for param in params:
        if param is not None and not isinstance(param, SamplingParams):
            raise RequestSchemaError(f"sampling_params must be kvopt.SamplingParams (or a list of them), not "
                                     f"{type(param).__name__}", "sampling_params")  # fmt: skip
    return params


def _priorities(priority: Sequence[int], count: int) -> list[int]:
    """One integer per prompt (lower runs first under ``policy="priority"``), or one line naming the fix: a string,
    a float such as NaN or a bool would sort silently, or not at all."""
    if isinstance(priority, (str, bytes)) or not isinstance(priority, Sequence):
        raise RequestSchemaError(f"priority must be a list of integers, one per prompt; got {priority!r}", "priority")
    if len(priority) != count:
        raise RequestSchemaError(f"got {len(priority)} priorities for {count} prompts; give one per prompt", "priority")
    for index, value in enumerate(priority):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise RequestSchemaError(f"priority[{index}] is {value!r}; give an integer (lower runs first), e.g. 0",
                                     "priority")  # fmt: skip
    return [int(value) for value in priority]


def _check_context(max_model_len: int | None, model) -> None:
    """A ``max_model_len`` the model's positions cannot reach is refused, not quietly lowered to them."""
    positions = ModelInfo.from_config(model.config).max_positions
    if max_model_len is not None and positions is not None and max_model_len > positions:
        raise EngineConfigError(f"max_model_len={max_model_len} is more than the model's maximum of {positions} "
                                f"positions; give at most {positions}, or leave it out for the model's maximum")  # fmt: skip


def _prompt_list(prompts: object) -> list[Prompt]:
    """``prompts`` as a list of prompts: one text or token-id list becomes a list of one; each checked."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                            and all(isinstance(token, int) for token in prompts)):  # fmt: skip
        return [_one_prompt(prompts, "prompts")]
    if not isinstance(prompts, (list, tuple)):
        raise RequestSchemaError(f"prompts must be a string, a list of token ids, or a list of those; not "
                                 f"{type(prompts).__name__}", "prompts")  # fmt: skip
    return [_one_prompt(prompt, f"prompts[{index}]") for index, prompt in enumerate(prompts)]


def _one_prompt(prompt: object, field: str) -> Prompt:
    """A checked prompt; ``{"preamble": ..., "chunks": [...], "prompt": ...}`` becomes a :class:`ChunkedPrompt`,
    ``{"session": ..., "prompt": ...}`` a :class:`SessionPrompt`."""
    if not isinstance(prompt, dict):
        return check_prompt(prompt, field)
    keys = set(prompt)
    if "session" in keys:
        name = prompt["session"]
        if keys != {"session", "prompt"} or not isinstance(name, str) or not name.strip():
            raise RequestSchemaError(f'{field}: a turn of a session is {{"session": name, "prompt": the conversation '
                                     f"so far and the new turn}} with a non-empty name (got keys {sorted(prompt)})",
                                     field.split("[")[0])  # fmt: skip
        return SessionPrompt(name, check_prompt(prompt["prompt"], f"{field}.prompt"))
    if (not {"chunks", "prompt"} <= keys <= {"preamble", "chunks", "prompt"}
            or not isinstance(prompt["chunks"], (list, tuple)) or not prompt["chunks"]):  # fmt: skip
        raise RequestSchemaError(f'{field}: a prompt with chunks is {{"preamble": system_text (optional), "chunks": '
                                 f'[document, ...], "prompt": question}} with at least one document (got keys '
                                 f"{sorted(prompt)})", field.split("[")[0])  # fmt: skip
    chunks = tuple(check_prompt(chunk, f"{field}.chunks[{index}]") for index, chunk in enumerate(prompt["chunks"]))
    question = check_prompt(prompt["prompt"], f"{field}.prompt")
    preamble = check_prompt(prompt["preamble"], f"{field}.preamble") if "preamble" in prompt else ()
    return ChunkedPrompt(tuple(chunk if isinstance(chunk, str) else tuple(chunk) for chunk in chunks), question, preamble)
