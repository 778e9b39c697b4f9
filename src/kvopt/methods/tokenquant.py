"""``tokenquant``: plain per-token quantization of keys and values, the simple baseline.

Each token's key and value vectors are quantized on their own (groups of ``group`` channels,
min-max, fp16 scale and zero-point), the way a generic int8/int4 KV cache does it. KIVI's
observation is that keys have outlier *channels*, which per-token groups spread over every
token's range; compare ``tokenquant:bits=4`` with ``kivi:bits=4`` to see what that costs.
Storage, residual window and attention are KIVI's (see :mod:`kvopt.methods.kivi`); tokens
still leave the residual ``group`` at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvopt.methods.base import register
from kvopt.methods.kivi import KIVI


@register
@dataclass
class TokenQuant(KIVI):
    """Keys and values quantized per token (groups of channels); the newest ``residual`` tokens in full precision."""

    name = "tokenquant"
    summary = "per-token int8/int4 quantization of keys and values (simple baseline), recent tokens in fp"

    bits: int = field(default=8, metadata={"help": "bits per quantized element: 2, 4 or 8"})
    group: int = field(default=64, metadata={"help": "channels per quantization group (tokens leave the residual this many at a time)"})

    key_mode = "token"
