"""Request bodies of the OpenAI API as the server reads them: the shared schema of
:mod:`kvopt.engine.requests` (completions, chat; the Python API and ``kvopt batch`` check requests with the same
models), and vLLM's ``/tokenize``.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from kvopt.engine.requests import (
    STRICT, ChatCompletionRequest, ChatMessage, CompletionRequest, GenerateRequest, StreamOptions, Text,
)  # fmt: skip

__all__ = ["ChatCompletionRequest", "ChatMessage", "CompletionRequest", "GenerateRequest", "StreamOptions",
           "TokenizeRequest"]  # fmt: skip


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize``: a prompt, or messages in the chat template."""

    model_config = STRICT
    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
