"""Sequence indices and validity of stored tokens, without bytes per token when they are implied.

Attention masks come from each stored token's sequence index and padding bit. Most of the
time the tokens of a store are a run of consecutive indices, all real, the same for every
KV head (no eviction, no padding): then one start index says it all, and the
per-token tensors are built only when a mask needs them. Eviction, head-wise selection or
padding switch to explicit tensors ``[batch, 1 or kv_heads, tokens]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvopt.cache.part import tensor_bytes


@dataclass
class TokenIndex:
    """Positions (int32) and validity of ``length`` tokens, ``[batch, 1 or kv_heads, length]``.

    Implicit (``start`` set): token ``t`` of every row sits at ``start + t`` and is real.
    Explicit: ``explicit_positions`` and ``explicit_valid`` (None when every token is real).
    """

    length: int
    batch: int
    device: torch.device
    start: int | None = None
    explicit_positions: torch.Tensor | None = None
    explicit_valid: torch.Tensor | None = None

    @classmethod
    def of(cls, positions: torch.Tensor, valid: torch.Tensor | None) -> TokenIndex:
        """The compact form of ``positions/valid [B, H, T]`` (copies; one row for aligned heads)."""
        batch, length = positions.shape[0], positions.shape[-1]
        all_valid = valid is None or bool(valid.all())
        aligned = bool((positions == positions[:, :1]).all()) and (all_valid or bool((valid == valid[:, :1]).all()))
        rows = slice(0, 1) if aligned else slice(None)
        positions = positions[:, rows]
        if all_valid and aligned and length:
            start = int(positions[0, 0, 0])
            run = torch.arange(start, start + length, dtype=positions.dtype, device=positions.device)
            if torch.equal(positions, run.expand_as(positions)):
                return cls(length, batch, positions.device, start=start)
        kept_valid = None if all_valid else valid[:, rows].clone()
        return cls(length, batch, positions.device, None, positions.to(torch.int32).clone(), kept_valid)

    @property
    def positions(self) -> torch.Tensor:
        """``[B, 1 or H, length]`` int32 (built on demand when implicit)."""
        if self.start is None:
            return self.explicit_positions
        return self.span(0, self.length)[0]

    @property
    def valid(self) -> torch.Tensor | None:
        """``[B, 1 or H, length]`` bool, or None when every token is real."""
        return self.explicit_valid

    def valid_counts(self) -> torch.Tensor:
        """Real tokens per batch row."""
        if self.explicit_valid is None:
            return torch.full((self.batch,), self.length, dtype=torch.long, device=self.device)
        return self.explicit_valid[:, 0].sum(dim=-1)

    def span(self, begin: int, end: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Positions and validity of tokens ``begin:end``."""
        if self.start is not None:
            run = torch.arange(self.start + begin, self.start + end, dtype=torch.int32, device=self.device)
            return run.expand(self.batch, 1, -1), None
        valid = None if self.explicit_valid is None else self.explicit_valid[..., begin:end]
        return self.explicit_positions[..., begin:end], valid

    def cat(self, other: TokenIndex) -> TokenIndex:
        """These tokens followed by ``other``'s (implicit while the run continues)."""
        if self.start is not None and other.start == self.start + self.length:
            return TokenIndex(self.length + other.length, self.batch, self.device, start=self.start)
        heads = max(self.positions.shape[1], other.positions.shape[1])
        joined = lambda a, b: torch.cat([a.expand(-1, heads, -1), b.expand(-1, heads, -1)], -1)  # noqa: E731
        valid = None
        if self.valid is not None or other.valid is not None:
            valid = joined(*(part._valid_or_ones() for part in (self, other)))
        positions = joined(self.positions, other.positions)
        return TokenIndex(self.length + other.length, self.batch, self.device, None, positions, valid)

    def _valid_or_ones(self) -> torch.Tensor:
        """``[B, 1 or H, length]`` validity, all True when none is stored."""
        if self.explicit_valid is not None:
            return self.explicit_valid
        return torch.ones(self.positions.shape, dtype=torch.bool, device=self.device)

    def tensors(self) -> list[torch.Tensor]:
        """The tensors held for the sequence (what nbytes counts)."""
        return [t for t in (self.explicit_positions, self.explicit_valid) if t is not None]

    def nbytes(self) -> int:
        return tensor_bytes(self.tensors())
