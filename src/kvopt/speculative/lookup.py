"""``prompt_lookup``: draft the tokens that followed the latest earlier occurrence of the text's last n-gram.

Prompt lookup decoding (Saxena, 2023; HF's ``prompt_lookup_num_tokens``): input-grounded tasks
(summarising, extracting, editing code) copy spans of the prompt, so the continuation of a
repeated n-gram is a good guess and costs no second model. The longest n-gram (``ngram`` down
to 1) with an earlier match wins; among matches, the most recent (HF takes the first).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvopt.errors import KVOptError


@dataclass
class PromptLookup:
    """Proposes up to ``k`` tokens copied from the prompt and the output so far (deterministic drafts)."""

    k: int = 4
    ngram: int = 3

    name = "prompt_lookup"

    def __post_init__(self) -> None:
        if self.k < 1 or self.ngram < 1:
            raise KVOptError(f"prompt_lookup: k={self.k} and ngram={self.ngram} must be >= 1, e.g. prompt_lookup:k=4")

    def bind(self, model, cache, sampler) -> None:
        """Nothing to set up: the drafts come from the token ids alone."""

    def propose(self, tokens: list[int], count: int) -> tuple[list[int], None]:
        # numpy reads a list of ints ~10x faster than torch.tensor (32k tokens: 0.4 vs 3.9 ms), a cost paid per
        # sequence and step in the engine
        ids = torch.from_numpy(np.fromiter(tokens, dtype=np.int64, count=len(tokens)))
        for size in range(min(self.ngram, len(tokens) - 1), 0, -1):
            windows = ids[:-1].unfold(0, size, 1)  # every n-gram that has a token after it
            matches = (windows == ids[-size:]).all(dim=1).nonzero()
            if matches.numel():
                start = int(matches[-1]) + size
                return tokens[start : start + count], None
        return [], None
