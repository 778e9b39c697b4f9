"""Spec strings: the one syntax for choosing methods in the CLI and the API.

Grammar: ``method[:key=value[,key=value...]][+method...]``, e.g. ``full``,
``window:size=1024`` or ``snapkv:ratio=0.5+kivi:bits=4``. Methods compose left to right.

A composition is checked as a whole (:func:`check_composition`), because eviction only reaches
the full-precision dense store: a spec whose methods would silently not act (a second
quantizer), act too late (eviction after quantization) or outgrow their budget (decode-time
eviction beside a method that moves tokens out of its reach) is refused when parsed, not
after a long prefill.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence

from kvopt.errors import MethodParameterError
from kvopt.methods.base import Method, get

#: Where a method moves tokens out of the dense store (the only one the others act on), in the order the
#: stages must run: evict in the dense store, then head-wise (ragged) or sparse-attention storage, then
#: merge, then quantize.
STAGES = {None: 0, "ragged": 1, "sparse": 1, "merged": 2, "quantized": 3}
#: Storages that take over a later method's job instead of leaving it no tokens: merged layer pairs
#: store their shared directions in KIVI's format when kivi follows (see :mod:`kvopt.methods.minicache`);
#: sparse-attention rows store their tokens in tokenquant's per-token format (see :mod:`kvopt.methods.rocketkv`);
#: kivi quantizes ragged rows (head-wise budgets: adakv, kvzip) per token (see :meth:`RaggedKV.quantized`).
ADOPTS = {"merged": ("kivi",), "sparse": ("tokenquant",), "ragged": ("kivi",)}


def parse(spec: str) -> list[Method]:
    """Build the methods named by ``spec`` with validated parameters and a workable composition."""
    if not isinstance(spec, str):
        raise MethodParameterError(
            f"a method spec is a string such as 'snapkv:ratio=0.5+kivi:bits=4', got {_describe(spec)}"
        )
    spec = spec.strip()
    if not spec:
        raise MethodParameterError("empty method spec; use e.g. 'full' or 'window:size=1024'")
    parts = [part.strip() for part in spec.split("+")]
    if not all(parts):  # before any method is built, so the empty one is named rather than a neighbour's parameter
        raise MethodParameterError(f"empty method in spec {spec!r}; join methods with a single '+'")
    methods = [_parse_one(part) for part in parts]
    check_composition(methods, spec)
    return methods


def _describe(value: object) -> str:
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        return f"a {type(value).__name__} of strings; join them with '+': {'+'.join(value)!r}"
    return repr(value) if value is None else f"a {type(value).__name__}"


def _parse_one(part: str) -> Method:
    name, _, arg_text = part.partition(":")
    cls = get(name.strip())
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, object] = {}
    for item in filter(None, (a.strip() for a in arg_text.split(","))):
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not raw.strip():
            raise MethodParameterError(f"{cls.name}: parameter {item!r} needs a value, written as key=value")
        if key not in fields:
            allowed = ", ".join(fields) or "none"
            raise MethodParameterError(f"{cls.name}: unknown parameter {key!r}; its parameters are: {allowed}")
        if key in kwargs:
            raise MethodParameterError(f"{cls.name}: parameter {key!r} is given twice in {part!r}; give it once")
        kwargs[key] = _coerce(cls.name, key, raw.strip(), hints[key])
    return cls(**kwargs)


def _coerce(method: str, key: str, raw: str, kind: object) -> object:
    optional = typing.get_args(kind)
    if optional and type(None) in optional:  # `float | None` takes the non-None type
        kind = next(arg for arg in optional if arg is not type(None))
    try:
        if kind is bool:
            lowered = raw.lower()
            if lowered not in {"true", "false", "1", "0", "yes", "no"}:
                raise ValueError(raw)
            return lowered in {"true", "1", "yes"}
        if kind is int:
            return int(raw)
        if kind is float:
            return float(raw)
        return raw
    except ValueError:
        type_name = getattr(kind, "__name__", str(kind))
        raise MethodParameterError(f"{method}: {key}={raw!r} is not a valid {type_name}") from None


# -- composition ----------------------------------------------------------------------------


def spec_text(methods: Sequence[Method]) -> str:
    """The spec ``methods`` make, as kvopt writes it (each method's defaults left out, its parameters in order):
    what keys, rows and saved states name them by."""
    return "+".join(method.spec() for method in methods)


def canonical_spec(spec: str) -> str:
    """``spec`` as kvopt writes it: ``kivi`` and ``kivi:bits=4`` are one spec."""
    return spec_text(parse(spec))


def storage(method: Method) -> str | None:
    """Where ``method`` moves tokens out of the dense store (``ragged``, ``sparse``, ``merged``, ``quantized``),
    or None.

    Declared by a method's ``storage`` attribute; a method that stores its layers' tokens its own
    way (it overrides :meth:`Method.owns_layer`, as cross-layer merging does) counts as ``merged``.
    """
    declared = getattr(method, "storage", None)
    if declared is None and type(method).owns_layer is not Method.owns_layer:
        return "merged"
    return declared


def evicts(method: Method) -> bool:
    """True for methods that drop tokens (they declare when: a ``schedule`` of prefill or decode)."""
    return getattr(method, "schedule", None) is not None


def evicts_while_decoding(method: Method) -> bool:
    return getattr(method, "schedule", None) == "decode"


def check_composition(methods: Sequence[Method], spec: str | None = None) -> None:
    """Refuse a spec whose methods cannot all do what they promise together; the error says how to fix it.

    Every method acts on the dense full-precision store only, so: each method that evicts or moves
    tokens appears once; eviction comes before the methods that move tokens out of the dense store,
    which come in the order of :data:`STAGES`; a second such method must be one the first takes
    over (:data:`ADOPTS`), since it would find no tokens left; decode-time eviction shares no spec
    with them (the moved tokens would never be evicted and the cache would outgrow its budget);
    merging needs every layer to keep the same tokens; and a method that acts on the whole prompt
    after the prefill (``needs_prefill_pass``) shares no spec with one that moves tokens during it
    (unless that one waits for the pass: ``waits_for_prompt_pass``, kivi).
    ``spec`` is the text the errors quote.
    """
    spec = spec or spec_text(methods)
    _check_each_once(methods, spec)
    _check_order(methods, spec)
    _check_prefill_shapers(methods, spec)
    movers = [m for m in methods if storage(m) is not None]
    for earlier, later in zip(movers, movers[1:]):
        if later.name not in ADOPTS.get(storage(earlier), ()):
            raise MethodParameterError(
                f"{spec!r}: {later.name} acts only on tokens in the dense store, but {earlier.name} moves them into "
                f"{storage(earlier)} storage first, so {later.name} would not act on them (while the memory estimate "
                "counts it); keep one of the two (the pairs that work: minicache+kivi, rocketkv+tokenquant, kvzip+kivi)"
            )
    for method in methods:
        for mover in movers:
            if mover is not method:
                _check_beside_mover(method, mover, spec)


def _check_beside_mover(method: Method, mover: Method, spec: str) -> None:
    """Refuse ``method`` beside ``mover``, which moves tokens out of the dense store, when they conflict."""
    kind = storage(mover)
    if evicts_while_decoding(method):
        raise MethodParameterError(
            f"{spec!r}: {method.spec()} evicts while decoding, but {mover.spec()} moves tokens into {kind} storage, "
            f"where eviction never reaches them, so the cache would outgrow its budget; with {mover.name}, evict "
            f"at the prefill instead (e.g. snapkv:ratio=0.5 or window:ratio=0.5), or use {method.name} alone"
        )
    if method.ranks_layers_together and mover is not method:
        raise MethodParameterError(
            f"{spec!r}: {method.spec()} compresses every layer together once the prefill's last layer has scored, "
            f"but {mover.spec()} moves each layer's tokens into {kind} storage as soon as the layer is computed; "
            f"use {method.name} alone, or adakv or kvzip with {mover.name}"
        )
    if method.needs_prefill_pass and not mover.waits_for_prompt_pass:
        raise MethodParameterError(
            f"{spec!r}: {method.spec()} acts on the whole prompt in full precision after the prefill, but "
            f"{mover.spec()} moves tokens into {kind} storage during it; use {method.name} alone, with kivi, or with other "
            "eviction methods"
        )
    if kind == "merged" and evicts(method) and method.selects_per_head:
        raise MethodParameterError(
            f"{spec!r}: {mover.name} merges a layer pair only where both layers hold the same tokens, but "
            f"{method.spec()} chooses tokens per layer and KV head, so no pair would merge; with {mover.name}, "
            "evict the same tokens in every layer (e.g. window:ratio=0.5), or use one of them"
        )


def _check_each_once(methods: Sequence[Method], spec: str) -> None:
    """A method that evicts or moves tokens appears once (its per-layer state is keyed by its name)."""
    seen: dict[str, Method] = {}
    for method in methods:
        if _stage(method) is None:
            continue  # a method that only observes (full, a probe) may appear twice
        if method.name in seen:
            raise MethodParameterError(
                f"{spec!r}: {method.name} appears twice, but a method acts once per cache (its state is kept under "
                f"its name, so the second would never act on its own); keep one, e.g. {seen[method.name].spec()}"
            )
        seen[method.name] = method


def _check_prefill_shapers(methods: Sequence[Method], spec: str) -> None:
    """A method that chooses which prompt tokens the later layers compute (FastKV) chooses among all of them:
    no method before it may have dropped or moved any."""
    for index, method in enumerate(methods):
        earlier = [m for m in methods[:index] if _stage(m) is not None]
        if method.shapes_prefill and earlier:
            ordered = [method, *(m for m in methods if m is not method)]
            raise MethodParameterError(
                f"{spec!r}: {method.name} selects among the whole prompt's tokens, but {earlier[0].spec()} acts "
                f"first; put {method.name} first: {spec_text(ordered)!r}"
            )


def _stage(method: Method) -> int | None:
    """The method's place in :data:`STAGES`; None for methods that neither evict nor move tokens."""
    if storage(method) is None and not evicts(method):
        return None
    return STAGES[storage(method)]


def _check_order(methods: Sequence[Method], spec: str) -> None:
    staged = [m for m in methods if _stage(m) is not None]
    for earlier, later in zip(staged, staged[1:]):
        if _stage(later) < _stage(earlier):
            ordered = sorted(methods, key=lambda m: _stage(m) or 0)
            raise MethodParameterError(
                f"{spec!r}: {later.spec()} must come before {earlier.spec()}, which has already moved tokens "
                f"into {storage(earlier)} storage by the time {later.name} acts; order the spec as "
                f"{spec_text(ordered)!r} (evict, then merge, then quantize)"
            )
