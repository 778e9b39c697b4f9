"""OpenAI response bodies and stream chunks, built from the engine's cumulative outputs.

Completions and chat differ only in names (``text`` vs ``message``/``delta``, the logprobs
layout, the objects' ``object`` field), so one :class:`Formatter` with a ``chat`` flag builds both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvopt.engine import CompletionOutput, RequestOutput

LOWEST_LOGPROB = -9999.0


@dataclass
class Delta:
    """What one choice produced since the previous chunk."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    #: Characters of this choice sent before this delta (completions' ``text_offset``).
    offset: int


class DeltaTracker:
    """Turns cumulative outputs into per-choice deltas, one per engine step that produced something.

    Text that could still turn out to be the start of a stop string is held back until the next
    token decides (the engine cuts a stop string off the text once it is complete), so streamed
    text never has to be taken back.
    """

    def __init__(self, n: int, stop: list[str]) -> None:
        self.sent_text, self.sent_tokens, self.done = [0] * n, [0] * n, [False] * n
        self.holdback = max((len(s) for s in stop), default=1) - 1

    def advance(self, output: RequestOutput) -> list[Delta]:
        deltas = []
        for choice in output.outputs:
            index = choice.index
            if self.done[index]:
                continue
            finished = choice.finish_reason is not None
            end = len(choice.text) if finished else max(self.sent_text[index], len(choice.text) - self.holdback)
            text = choice.text[self.sent_text[index] : end]
            tokens = choice.token_ids[self.sent_tokens[index] :]
            logprobs = None if choice.logprobs is None else choice.logprobs[self.sent_tokens[index] :]
            if text or finished or (logprobs and tokens):
                deltas.append(Delta(index, text, tokens, logprobs, choice.finish_reason, self.sent_text[index]))
                self.sent_text[index], self.sent_tokens[index] = end, len(choice.token_ids)
                self.done[index] = finished
        return deltas


def whole(choice: CompletionOutput) -> Delta:
    """A finished choice as one delta (a non-streamed response)."""
    return Delta(choice.index, choice.text, choice.token_ids, choice.logprobs, choice.finish_reason, 0)


def usage(output: RequestOutput) -> dict:
    prompt = len(output.prompt_token_ids)
    completion = sum(len(choice.token_ids) for choice in output.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": output.metrics.cached_tokens}}  # fmt: skip


def sse(payload: dict | str) -> str:
    """One server-sent event (``data: ...`` and a blank line)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


@dataclass
class Formatter:
    request_id: str
    created: int
    model: str
    chat: bool
    #: Alternatives per token in log-probabilities; None when the request asked for none.
    top_logprobs: int | None

    def body(self, output: RequestOutput, token_strings: dict[int, str]) -> dict:
        """The whole response of a finished, non-streamed request."""
        choices = [self._choice(whole(choice), token_strings, stream=False) for choice in output.outputs]
        return self._envelope(choices, stream=False) | {"usage": usage(output)}

    def chunk(self, deltas: list[Delta], token_strings: dict[int, str], include_usage: bool) -> dict:
        body = self._envelope([self._choice(delta, token_strings, stream=True) for delta in deltas], stream=True)
        return body | ({"usage": None} if include_usage else {})

    def role_chunk(self, n: int, include_usage: bool) -> dict:
        """Chat streams open with the assistant's role for every choice (as OpenAI's do)."""
        choices = [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None} for index in range(n)]  # fmt: skip
        return self._envelope(choices, stream=True) | ({"usage": None} if include_usage else {})

    def usage_chunk(self, output: RequestOutput) -> dict:
        return self._envelope([], stream=True) | {"usage": usage(output)}

    def _envelope(self, choices: list[dict], stream: bool) -> dict:
        kind = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def _choice(self, delta: Delta, token_strings: dict[int, str], stream: bool) -> dict:
        logprobs = None
        if self.top_logprobs is not None and delta.logprobs is not None:
            logprobs = self._logprobs(delta, token_strings)
        if not self.chat:
            return {"index": delta.index, "text": delta.text, "logprobs": logprobs, "finish_reason": delta.finish_reason}
        content = {"content": delta.text} if stream else {"role": "assistant", "content": delta.text}
        return {"index": delta.index, "delta" if stream else "message": content, "logprobs": logprobs,
                "finish_reason": delta.finish_reason}  # fmt: skip

    def _logprobs(self, delta: Delta, strings: dict[int, str]) -> dict:
        # JSON has no -inf; vLLM reports impossible tokens as -9999 too.
        finite = [{token: max(value, LOWEST_LOGPROB) for token, value in entry.items()} for entry in delta.logprobs]
        top = [sorted(entry.items(), key=lambda item: -item[1])[: self.top_logprobs] for entry in finite]
        if self.chat:
            entry = lambda token, logprob: {"token": strings[token], "logprob": logprob,  # noqa: E731
                                            "bytes": list(strings[token].encode())}  # fmt: skip
            return {"content": [entry(token, logprobs[token]) | {"top_logprobs": [entry(t, v) for t, v in alternatives]}
                                for token, logprobs, alternatives in zip(delta.token_ids, finite, top)]}  # fmt: skip
        offsets, offset = [], delta.offset
        for token in delta.token_ids:
            offsets.append(offset)
            offset += len(strings[token])
        return {
            "tokens": [strings[token] for token in delta.token_ids],
            "token_logprobs": [logprobs[token] for token, logprobs in zip(delta.token_ids, finite)],
            "top_logprobs": [{strings[t]: v for t, v in alternatives} for alternatives in top],
            "text_offset": offsets,
        }

    def needed_strings(self, deltas: list[Delta]) -> list[int]:
        """Token ids whose text the log-probabilities of ``deltas`` show."""
        if self.top_logprobs is None:
            return []
        return [token for delta in deltas for entry in delta.logprobs or () for token in entry]
