"""``kvopt.LLM``: offline batched generation on the engine, vLLM's ``LLM`` interface."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator, Sequence

from kvopt.engine import sessions
from kvopt.engine.config import EngineConfig
from kvopt.engine.llm_engine import LLMEngine
from kvopt.engine.outputs import RequestOutput
from kvopt.engine.sampling_params import SamplingParams

Prompt = str | list[int]
Messages = list[dict[str, str]]


class LLM:
    """Serve many prompts at once over a paged, prefix-cached KV pool.

        llm = kvopt.LLM()                                  # embedded SmolLM2-135M-Instruct
        outputs = llm.generate(prompts, kvopt.SamplingParams(max_tokens=64))
        llm.metrics()["prefix_cache_hits_total"]

    ``model`` is a name or path understood by :func:`kvopt.load_model`, or an already loaded HF
    model (then pass its ``tokenizer``, or give prompts as token ids). ``device`` places a model loaded by name
    (``auto``: a CUDA GPU when there is one); a loaded model stays where it is.
    """

    def __init__(
        self, model=None, kv_method: str = "full", block_size: int = 16, kv_memory: str | int | float = "1GB",
        enable_prefix_caching: bool = True, tokenizer=None, dtype=None, device=None, **engine_options,
    ) -> None:  # fmt: skip
        config = EngineConfig(kv_method, block_size, kv_memory, enable_prefix_caching, **engine_options)
        if model is None or isinstance(model, str) or hasattr(model, "__fspath__"):
            from kvopt.api import load_model

            model, tokenizer = load_model(model, dtype=dtype, device=device)
        self.engine = LLMEngine(model, tokenizer, config)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True, priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:  # fmt: skip
        """Generate for every prompt (text or token ids); outputs in the prompts' order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; give one, or one per prompt")
        ids = []
        for index, (prompt, param) in enumerate(zip(prompts, params)):
            ids.append(str(next(self._ids)))
            self.engine.add_request(ids[-1], prompt, param, priority[index] if priority else 0)
        finished = self._run(set(ids), use_tqdm)
        return [finished[request_id] for request_id in ids]

    def chat(
        self, messages: Messages | Sequence[Messages], sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:  # fmt: skip
        """Generate a reply to one conversation or to each of several (the tokenizer's chat template)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self.generate([self.chat_prompt(conversation) for conversation in conversations], sampling_params,
                             use_tqdm)  # fmt: skip

    def chat_prompt(self, messages: Messages) -> list[int]:
        """Token ids of a conversation under the chat template (which writes BOS itself: none is added again)."""
        return list(self.tokenizer(self.apply_chat_template(messages), add_special_tokens=False).input_ids)

    def apply_chat_template(self, messages: Messages) -> str:
        if self.tokenizer is None or getattr(self.tokenizer, "chat_template", None) is None:
            from kvopt.engine.llm_engine import RequestError

            raise RequestError("chat needs a tokenizer with a chat template; use generate() with a plain prompt")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the request's output after every step that advanced it (cumulative text and ids)."""
        request_id = str(next(self._ids))
        self.engine.add_request(request_id, prompt, sampling_params)
        while True:
            for output in self.engine.step():
                if output.request_id == request_id:
                    yield output
                    if output.finished:
                        return

    def metrics(self) -> dict:
        return self.engine.metrics()

    def save_session(self, conversation: RequestOutput | list[int], path: str | os.PathLike, encoding: str = "raw"):
        """Save a finished request's KV (its prompt + first completion, or the token ids given) to ``path``.

        After a restart, :meth:`load_session` puts it back; a prompt continuing those tokens then
        computes only what is new (see :mod:`kvopt.engine.sessions`). Returns the path.
        """
        if isinstance(conversation, RequestOutput):
            conversation = list(conversation.prompt_token_ids) + list(conversation.outputs[0].token_ids)
        return sessions.save_session(self.engine, conversation, path, encoding)

    def load_session(self, path: str | os.PathLike) -> list[int]:
        """Restore a saved session's blocks into the prefix cache; returns its token ids (prompt + output)."""
        return sessions.load_session(self.engine, path)

    def close(self) -> None:
        """Finish writing blocks to the KV tiers (``kv_tiers=``); the engine keeps serving from its pool."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self, wanted: set[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with _Progress(len(wanted), use_tqdm) as progress:
            while len(finished) < len(wanted):
                for output in self.engine.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                progress.update(len(finished), self.engine.stats.generation_tokens)
        return finished


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
