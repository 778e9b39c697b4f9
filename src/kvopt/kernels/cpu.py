"""C++ kernels for a CPU, built on this machine the first time they are needed and kept in kvopt's cache folder.

A decode step's attention reads each key and value once; PyTorch's CPU flash kernel (tiled for many queries)
served one query per sequence at 2-5 GB/s in bf16 and ~10 GB/s in fp32, so at 2k-8k tokens of context it took
more of a step than all the weight matmuls (issue 65). ``csrc/decode_attention.cpp`` attends every decoding
sequence of a step at once, straight from the paged pool through each sequence's runs of slots (no gather, no
merge of pieces), with fp32 accumulation: 2.5-3x the flash kernel in bf16 and ~2x in fp32 on one core
(BENCHMARKS.md, "A decode step against this CPU's limits"). The same call reads a KIVI sequence's quantized
groups in place from their records in the engine's code blocks (keys scored against the codes with the scales
folded into the query, values dequantized 16 tokens at a time in registers) and merges them with its
full-precision tokens: the torch path gathered every group, unpacked it into
fp32 tensors, ran the flash kernel over them and merged the parts with a dozen more ops per layer.

It is compiled with ``-march=native`` by ``torch.utils.cpp_extension`` (g++ or clang, and ninja: the ``ninja``
wheel kvopt depends on, or one on ``PATH``) into ``$KVOPT_CACHE/kernels/<key>``, the key digesting the source,
torch's version and the CPU's flags, so a cache folder shared by different machines holds one build per kind of
CPU. A first build takes ~25 s on two cores (four files; the Python bindings ~10 s of it); later processes load it in
milliseconds. Where no compiler is present or the build fails, kvopt warns once and attention takes the flash kernel
(the same results within fp32 rounding); ``KVOPT_CPU_KERNELS=0`` (or ``false``, ``no``, ``off``) skips the build
altogether.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from kvopt.paths import cache_root

ENV_SWITCH = "KVOPT_CPU_KERNELS"
_OFF = ("0", "false", "no", "off")
#: The extension's sources: decode attention, linear layers over a few rows (weight-only int8 among them), a
#: decoder layer's small steps between its matmuls, and their Python bindings.
SOURCES = tuple(Path(__file__).with_name("csrc") / name
                for name in ("decode_attention.cpp", "weight_rows.cpp", "layer_glue.cpp", "bindings.cpp"))  # fmt: skip
#: What they include (a change rebuilds them too).
HEADERS = tuple(Path(__file__).with_name("csrc") / name for name in ("vectors.h", "kernels.h"))
#: Head dims the kernel is compiled for (its vectors hold 16 floats).
HEAD_DIMS = frozenset({32, 64, 80, 96, 128, 256})
#: Query heads per KV head it holds (a GQA group).
MAX_GROUP = 16
#: The pool dtypes it reads.
DTYPES = (torch.float32, torch.bfloat16)
DecodeAttention = Callable[..., tuple[torch.Tensor, torch.Tensor]]
LinearRows = Callable[..., torch.Tensor]


def switched_off() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() in _OFF


def decode_attention_serves(dtype: torch.dtype, head_dim: int, group: int) -> bool:
    """Whether :func:`decode_attention` reads a CPU pool of this dtype and head dim for GQA groups of ``group`` query
    heads (building the kernel the first time, if it can be built here)."""
    return dtype in DTYPES and head_dim in HEAD_DIMS and group <= MAX_GROUP and _library()


def decode_attention() -> DecodeAttention | None:
    """The decode-attention op, or None where the kernels cannot be built here (warned once) or are switched off.

    ``op(query [S, kv_heads, group, D] fp32 contiguous, keys, values [kv_heads, slots, D], runs [R, 2] int64,
    offsets [S + 1] int64, scale, key_records=None, value_records=None, blocks=None, records=None, counts=None,
    layout=None) -> (output [S, kv_heads, group, D] fp32, lse [S, kv_heads, group] fp32)``: sequence ``s`` attends
    over the slots of runs ``offsets[s]:offsets[s + 1]`` (``(start, stop)`` each), all visible, and, given the
    code arguments, over its first ``counts[s]`` quantized groups, group ``j`` being record ``records[s, j]`` of
    block ``blocks[s, j]`` in the byte pools ``[kv_heads, blocks, block bytes]``, laid out as ``layout`` says
    (:attr:`kvopt.engine.kv.compressed.CodeFormat.kernel_layout`); every part merged by its log-sum-exp.
    """
    return _extension().decode_attention if _library() else None


def linear_rows() -> LinearRows | None:
    """The few-rows linear op, or None where the kernels cannot be built here (warned once) or are switched off.

    ``op(input [M, K] fp32/bf16, weight [N, K] int8/bf16/fp32 contiguous, scale=None [N], bias=None [N]) ->
    [M, N]`` in the input's dtype: ``(input @ weight.T) * scale + bias`` with fp32 products and sums, each weight
    row read once for all ``M`` rows. Built for decode steps: one row per sequence is bound by reading the
    weights, and it streams them at the memory's pace; at more rows a BLAS's tiling wins (see
    :class:`kvopt.models.int8_linear.Int8Linear`).
    """
    return _extension().linear_rows if _library() else None


def layer_glue():
    """The namespace of a decoder layer's small steps (the extension's module), or None where the kernels cannot be
    built here (warned once) or are switched off: ``rms_norm(x, weight, eps, plus_one)``, ``add_rms_norm(x, addend,
    weight, eps, plus_one) -> (x + addend, its norm)``, ``rotary(qkv, cos, sin, heads, dim)`` (the first ``heads``
    heads of each row rotated, ``sin``'s first half negated) and ``silu_mul(gate_up)``, over contiguous fp32 or bf16
    rows ``[tokens, width]``, rounding where Hugging Face's modules round (:mod:`kvopt.models.lean_forward`)."""
    return _extension() if _library() else None


#: The loaded extension (set by :func:`_library`).
_loaded: list = []


def _extension():
    """The extension's Python module: its functions, the same kernels as the ``torch.ops.kvopt_cpu`` ops it
    registers, called without the dispatcher's per-call boxing (``csrc/bindings.cpp``)."""
    return _loaded[-1]


@functools.cache
def _library() -> bool:
    """Build (or load) the kernels once per process; False where they cannot be (warned once) or are switched off."""
    if switched_off():
        return False
    try:
        _loaded.append(_build())
    except Exception as error:  # no compiler, no ninja, a build error: PyTorch's kernels serve instead
        reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        warnings.warn(
            f"kvopt's CPU kernels cannot be built on this machine ({reason}); decode attention and int8 weights "
            f"take PyTorch's kernels (the same results, slower). Install a C++ compiler "
            f"(g++ or clang) to build them, or set {ENV_SWITCH}=0 to skip trying",
            RuntimeWarning, stacklevel=3,
        )  # fmt: skip
        return False
    return True


def _build():
    """Compile (or find already compiled) and load the extension: its module, and its ops in ``torch.ops.kvopt_cpu``."""
    from torch.utils import cpp_extension

    key = _build_key(b"\0".join(path.read_bytes() for path in (*SOURCES, *HEADERS)))
    folder = cache_root() / "kernels" / key
    folder.mkdir(parents=True, exist_ok=True)
    flags = ["-O3", "-fopenmp", *_native_flags()]
    with _ninja_on_path():
        return cpp_extension.load(
            name=f"kvopt_cpu_{key}", sources=[str(source) for source in SOURCES], extra_cflags=flags, extra_ldflags=["-fopenmp"],
            build_directory=str(folder), is_python_module=True, verbose=False,
        )  # fmt: skip


def _build_key(source: bytes) -> str:
    """What a build depends on: the source, torch's version (its headers and ABI), the CPU's flags (torch's own
    reading, as :mod:`kvopt.models.cpu_features` takes it) and the compiler."""
    probe = getattr(torch.cpu, "get_capabilities", None)
    flags = sorted(name for name, value in (probe() if probe is not None else {}).items() if value is True)
    digest = hashlib.sha256(source)
    for part in (torch.__version__, platform.machine(), " ".join(flags), os.environ.get("CXX", "")):
        digest.update(b"\0" + part.encode())
    return digest.hexdigest()[:16]


def _native_flags() -> list[str]:
    """Tune for the CPU this runs on (the build is keyed by its flags)."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i686"):
        return ["-march=native"]
    if machine in ("aarch64", "arm64"):
        return ["-mcpu=native"]
    return []


class _ninja_on_path:
    """Put the ``ninja`` wheel's binary on ``PATH`` for the build (a virtual environment's ``bin`` is not on it
    unless activated); a system ninja serves otherwise."""

    def __enter__(self) -> None:
        self.saved = os.environ.get("PATH", "")
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, self.saved])

    def __exit__(self, *exc) -> None:
        os.environ["PATH"] = self.saved
