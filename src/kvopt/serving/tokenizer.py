"""Tokenization for the server on its own thread (vLLM's API server does the same).

Encoding a long prompt or rendering a chat template takes milliseconds to seconds; on the event
loop it would stall every stream. A single worker thread owns a copy of the tokenizer, so it never
shares one with the engine thread, which detokenizes with its own.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from kvopt.engine.llm_engine import ChunkedPrompt
from kvopt.serving.errors import APIError

#: Where the documents go in a rendered conversation (replaced, never sent to the model).
DOCUMENTS_MARK = "\uE000kvopt-documents\uE000"
#: Where the conversation's first user message starts: the text before it is the preamble documents are computed after.
PREAMBLE_MARK = "\uE000kvopt-preamble\uE000"


class AsyncTokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="kvopt-tokenizer")

    async def _run(self, function, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, function, *args)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._run(self._encode, text, add_special_tokens)

    async def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of the conversation in the model's chat template, ready for the assistant's reply."""
        return await self._run(self._encode_chat, messages)

    async def encode_chat_documents(self, messages: list[dict[str, str]], documents: list[str]) -> tuple[ChunkedPrompt, int]:
        """The conversation with ``documents`` at the start of the last user message's text, each tokenized on its own
        (a chunk reused by content, :mod:`kvopt.chunks`); and the prompt's token count.

        The preamble the documents are computed after is the text before the first user message (the template's
        head, the system prompt): the same on every turn of a conversation, so later turns reuse the documents."""
        users = [index for index, message in enumerate(messages) if message["role"] == "user"]
        if not users:
            raise APIError(400, "documents go before the last user message; the messages have none", param="documents")
        marks = {users[0]: PREAMBLE_MARK} | {users[-1]: PREAMBLE_MARK * (users[0] == users[-1]) + DOCUMENTS_MARK}
        marked = [{**message, "content": marks[index] + message["content"]} if index in marks else message
                  for index, message in enumerate(messages)]  # fmt: skip
        rendered = await self._run(self._render, marked)
        head, _, rest = rendered.partition(PREAMBLE_MARK)
        history, _, tail = rest.partition(DOCUMENTS_MARK)
        chunks = [await self.encode(f"{document}\n\n", add_special_tokens=False) for document in documents]
        preamble, question = await self.encode(head, False), await self.encode(tail, False)
        history_ids = await self.encode(history, False) if history else []
        count = len(preamble) + len(history_ids) + sum(map(len, chunks)) + len(question)
        return ChunkedPrompt(tuple(tuple(chunk) for chunk in chunks), question, preamble, history_ids), count

    async def token_strings(self, token_ids: list[int]) -> dict[int, str]:
        """The text of each token on its own (for log-probabilities)."""
        unique = sorted(set(token_ids))
        texts = await self._run(self.tokenizer.batch_decode, [[token] for token in unique])
        return dict(zip(unique, texts))

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def _encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        # The template writes the special tokens (BOS, role markers) itself.
        return self._encode(self._render(messages), add_special_tokens=False)

    def _render(self, messages: list[dict[str, str]]) -> str:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise APIError(400, "this model's tokenizer has no chat template; send a plain prompt to /v1/completions",
                           param="messages")  # fmt: skip
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as error:  # noqa: BLE001 - templates raise what they like (e.g. "roles must alternate")
            raise APIError(400, f"the model's chat template refused these messages: {error}", param="messages") from None
