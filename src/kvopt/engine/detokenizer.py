"""Incremental detokenization and stop strings for one sequence.

Decoding only the last few tokens each step (vLLM's prefix/read offsets) keeps the cost per
token constant, and a token that ends inside a multi-byte character waits for the next one
instead of printing a replacement character.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str], include_stop: bool) -> None:
        self.tokenizer = tokenizer
        self.stop, self.include_stop = stop, include_stop
        self.text = ""
        self.ids = list(prompt_ids[-6:])  # a little context so the first tokens decode with their leading spaces
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def add(self, token_id: int) -> bool:
        """Append a token's text; True when a stop string was produced (the text is cut there)."""
        if self.tokenizer is None:
            return False
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        full = decode(self.ids[self.prefix_offset :], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False
        before = len(self.text)
        self.text += full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._cut_at_stop(before)

    def _cut_at_stop(self, before: int) -> bool:
        for stop in self.stop:
            found = self.text.find(stop, max(0, before - len(stop) + 1))
            if found != -1:
                self.text = self.text[: found + (len(stop) if self.include_stop else 0)]
                return True
        return False
