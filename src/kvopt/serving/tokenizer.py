"""Tokenization for the server on its own thread (vLLM's API server does the same).

Encoding a long prompt or rendering a chat template takes milliseconds to seconds; on the event
loop it would stall every stream. A single worker thread owns a copy of the tokenizer, so it never
shares one with the engine thread, which detokenizes with its own.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from kvopt.serving.errors import APIError


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
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise APIError(400, "this model's tokenizer has no chat template; send a plain prompt to /v1/completions",
                           param="messages")  # fmt: skip
        return await self._run(self._encode_chat, messages)

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
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as error:  # noqa: BLE001 - templates raise what they like (e.g. "roles must alternate")
            raise APIError(400, f"the model's chat template refused these messages: {error}", param="messages") from None
        # The template writes the special tokens (BOS, role markers) itself.
        return self._encode(text, add_special_tokens=False)
