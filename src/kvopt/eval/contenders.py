"""Contenders for evaluation and benchmarks: kvopt specs and the peers they are compared with.

A contender knows how to make a fresh cache for one prompt, what to wrap the compressed
forward pass in (kvpress presses are context managers), and how many bytes its cache holds.
Spec strings:

- any kvopt spec (``full``, ``window:size=512`` ...);
- ``hf``: plain transformers ``DynamicCache`` with SDPA attention;
- ``hf-quanto:bits=4`` / ``hf-hqq:bits=4``: transformers ``QuantizedCache`` (needs optimum-quanto / hqq);
- ``kvpress:<press>:ratio=R``: an NVIDIA kvpress press (``pip install -e .[compare]``), e.g.
  ``kvpress:snapkv:ratio=0.5``; ``kvpress:adakv-snapkv:ratio=0.5`` wraps SnapKV in AdaKV;
- ``saved:<encoding>:<kvopt spec>``: the kvopt cache saved with a :mod:`kvopt.codec` encoding after
  the prefill and loaded back before the question (a stored session), e.g. ``saved:cachegen:full``:
  the accuracy a lossy codec costs.
"""

from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass, field

import torch

from kvopt.errors import MethodParameterError

#: kvpress press names accepted after ``kvpress:``, mapped to their class names.
KVPRESS_PRESSES = {
    "snapkv": "SnapKVPress",
    "streamingllm": "StreamingLLMPress",
    "tova": "TOVAPress",
    "knorm": "KnormPress",
    "pyramidkv": "PyramidKVPress",
    "expectedattention": "ExpectedAttentionPress",
    "random": "RandomPress",
}
COMPARE_HINT = "install the peers with: pip install -e '.[compare]'"


@dataclass
class Contender:
    """One way of caching: a kvopt spec or a peer."""

    spec: str
    family: str
    method_name: str
    ratio: float | None = None
    options: dict = field(default_factory=dict)
    #: False when the contender's prefill differs from a lossless one (FastKV, kvpress presses that hook the
    #: forward pass), so it cannot replay a shared one.
    replays: bool = True

    def missing(self) -> str | None:
        """Why this contender cannot run here (with the install command), or None."""
        if self.family == "kvpress" and not _installed("kvpress"):
            return f"{self.spec}: kvpress is not installed; {COMPARE_HINT}"
        if self.spec.startswith("hf-quanto") and not _installed("optimum.quanto"):
            return f"{self.spec}: optimum-quanto is not installed; {COMPARE_HINT}"
        if self.spec.startswith("hf-hqq") and not _installed("hqq"):
            return f"{self.spec}: hqq is not installed; pip install hqq"
        return None

    def new_cache(self, model):
        """A fresh cache, with the model's attention set the way this contender needs it."""
        from transformers import DynamicCache

        from kvopt.api import build_cache

        if self.family == "kvopt":
            return build_cache(self.options.get("cache", self.spec), model)
        model.set_attn_implementation("sdpa")
        if self.spec.startswith("hf-"):
            from transformers import QuantizedCache

            backend = "quanto" if self.spec.startswith("hf-quanto") else "hqq"
            return QuantizedCache(backend=backend, config=model.config, nbits=self.options["bits"])
        return DynamicCache(config=model.config)

    def replay_prefill(self, cache, recorded) -> None:
        """Fill a fresh ``cache`` from a recorded lossless prefill instead of running the forward pass again.

        A kvopt cache lets its methods act on the copied tokens (:meth:`KVCache.replay_prefill`). An HF cache,
        quantized or not, receives each layer's keys and values in one ``update``, as the one-pass prefill gives
        them: HF's quantized cache attends to the unquantized prefill and quantizes what it stores, so its
        prefill outputs are the lossless ones and the recording stands for them.
        """
        if not self.replays:
            raise MethodParameterError(f"{self.spec} changes the prefill itself; prefill its cache directly")
        if self.family == "kvopt":
            cache.replay_prefill(recorded)
            return
        for index, layer in enumerate(recorded.layers):
            cache.update(layer.store.keys, layer.store.values, index)

    def compressing(self, model):
        """Context for the forward pass that may compress (a kvpress press hooks the model here)."""
        if self.family != "kvpress":
            return contextlib.nullcontext()
        return self._press()(model)

    def after_prefill(self, model, cache, ids, tokenizer) -> None:
        """kvopt methods that act with the prompt's ids in hand (KVzip) do so here."""
        if self.family == "kvopt" and cache.needs_prefill_pass:
            cache.after_prefill(model, torch.as_tensor([list(ids)], device=model.device), tokenizer=tokenizer)

    def reloaded(self, model, cache):
        """The cache after the prefill as the rest of the prompt sees it: saved and loaded back through the codec
        for a ``saved:`` contender (encoded lossily as its encoding says), else the cache itself."""
        encoding = self.options.get("encoding")
        if encoding is None:
            return cache
        from kvopt.codec import cache_bytes, cache_from_bytes

        return cache_from_bytes(cache_bytes(cache, model, encoding), model)[0]

    def _press(self):
        import kvpress

        name = self.options["press"]
        ratio = self.ratio
        if name.startswith("adakv-"):
            inner = getattr(kvpress, KVPRESS_PRESSES[name.removeprefix("adakv-")])(compression_ratio=ratio)
            return kvpress.AdaKVPress(inner)
        return getattr(kvpress, KVPRESS_PRESSES[name])(compression_ratio=ratio)

    @staticmethod
    def held_bytes(cache) -> int:
        """Bytes of tensors a cache holds, measured from the tensors themselves."""
        if hasattr(cache, "nbytes") and callable(cache.nbytes):
            return cache.nbytes()
        total = 0
        for layer in cache.layers:
            for value in vars(layer).values():
                total += _tensor_bytes(value)
        return total


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported; a dotted name whose parent package is absent is not (find_spec raises)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _tensor_bytes(value) -> int:
    """Bytes of a tensor, or of the tensors inside a quantized tensor object (quanto/HQQ)."""
    flatten = getattr(value, "__tensor_flatten__", None)
    if flatten is not None:  # tensor subclasses such as quanto's QTensor: count their inner tensors
        names, _ = flatten()
        return sum(_tensor_bytes(getattr(value, name)) for name in names)
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_tensor_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    return 0


def parse_contender(spec: str) -> Contender:
    """Parse one contender spec; kvopt specs are validated through the method registry."""
    spec = spec.strip()
    if spec == "hf":
        return Contender(spec, "hf", "hf")
    if spec.startswith(("hf-quanto", "hf-hqq")):
        name, _, args = spec.partition(":")
        bits = int(_options(spec, args).get("bits", 4))
        if bits not in (2, 4, 8):
            raise MethodParameterError(f"{spec}: bits must be 2, 4 or 8")
        return Contender(spec, "hf", name, options={"bits": bits})
    if spec.startswith("kvpress:"):
        _, _, rest = spec.partition(":")
        press, _, args = rest.partition(":")
        options = _options(spec, args)
        base = press.removeprefix("adakv-")
        if base not in KVPRESS_PRESSES:
            raise MethodParameterError(f"{spec}: unknown kvpress press {press!r}; choose from {', '.join(KVPRESS_PRESSES)}")
        if "ratio" not in options:
            raise MethodParameterError(f"{spec}: give the fraction removed, e.g. kvpress:{press}:ratio=0.5")
        ratio = float(options["ratio"])
        if not 0 < ratio < 1:
            raise MethodParameterError(f"{spec}: ratio={ratio} is outside (0, 1); it is the fraction of tokens removed")
        return Contender(spec, "kvpress", f"kvpress:{press}", ratio, {"press": press}, replays=False)
    if spec.startswith("saved:"):
        from kvopt.codec import ENCODINGS

        _, _, rest = spec.partition(":")
        encoding, _, inner = rest.partition(":")
        if encoding not in ENCODINGS or not inner:
            raise MethodParameterError(f"{spec}: write saved:<encoding>:<kvopt spec> with an encoding of "
                                       f"{', '.join(ENCODINGS)}, e.g. saved:int4:full")  # fmt: skip
        cached = parse_contender(inner)
        if cached.family != "kvopt":
            raise MethodParameterError(f"{spec}: only kvopt caches are saved by the codec; name a kvopt spec after the encoding")
        options = {"encoding": encoding, "cache": cached.spec}
        return Contender(f"saved:{encoding}:{cached.spec}", "kvopt", f"saved:{encoding}:{cached.method_name}", cached.ratio,
                         options)  # fmt: skip
    from kvopt.methods import parse, spec_text

    methods = parse(spec)
    ratio = next((getattr(m, "ratio") for m in methods if getattr(m, "ratio", None) is not None), None)
    replays = not any(m.shapes_prefill for m in methods)
    names = "+".join(m.name for m in methods)
    return Contender(spec_text(methods), "kvopt", names, ratio, replays=replays)


def _options(spec: str, args: str) -> dict[str, str]:
    options = {}
    for item in filter(None, args.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise MethodParameterError(f"{spec}: parameter {item!r} needs a value, written as key=value")
        options[key.strip()] = value.strip()
    return options


def split_specs(text: str) -> list[str]:
    """Split a comma-separated list of specs where parameters also use commas.

    ``"full,window:size=512,hf"`` -> three specs; a piece with ``=`` but no ``:`` continues the
    previous spec's parameters (``"window:size=512,other=1"`` stays one spec).
    """
    specs: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        if specs and "=" in piece and ":" not in piece:
            specs[-1] += "," + piece
        else:
            specs.append(piece)
    return specs
