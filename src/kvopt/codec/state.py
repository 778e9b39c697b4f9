"""A cache's layers as a JSON tree plus a list of tensors, and back: every kind of stored state.

What a layer holds -- the dense store (positions, validity and the methods' per-token extras
included), its compact parts (ragged, quantized, merged views of a shared pair) and the
methods' per-layer ``state`` -- is walked generically: parts are dataclasses of
:mod:`kvopt.cache`, so a new part kind is saved without code here. Objects are rebuilt only
from an allow-list (dataclasses defined in ``kvopt.cache``, never arbitrary classes: no pickle),
an object reached twice (MiniCache's pair, shared by two layers) is stored once and shared
again on loading, and a module a method keeps in its state (StreamingLLM's attention module)
is stored by its name in the model.

Tensors reached through a field named ``keys`` or ``values`` are tagged with that role: only
those may be encoded lossily (:mod:`kvopt.codec.encodings`).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field

import torch

from kvopt.cache.kv_cache import recorded_step
from kvopt.cache.storage import DenseKVStore
from kvopt.codec.encodings import DTYPES
from kvopt.codec.errors import CacheCorruptError
from kvopt.errors import CacheUsageError

ROLES = {"keys": "key", "values": "value"}
#: Modules whose dataclasses are rebuilt: cache storage, and the engine's compressed prompt states (kept in tiers).
ALLOWED_PREFIXES = ("kvopt.cache.", "kvopt.engine.kv.")


@dataclass
class Tensors:
    """The tensors a tree refers to by index, each with its role and the depth of its layer."""

    items: list[tuple[torch.Tensor, str | None, float]] = field(default_factory=list)

    def add(self, tensor: torch.Tensor, role: str | None, depth: float) -> dict:
        self.items.append((tensor, role, depth))
        return {"t": "tensor", "i": len(self.items) - 1}


class Dumper:
    """Turns layer objects into a JSON tree, collecting tensors (see the module docstring)."""

    def __init__(self, modules: dict[int, str], layers: int) -> None:
        self.tensors = Tensors()
        self.modules, self.layers = modules, layers
        self.memo: dict[int, int] = {}
        self.depth = 0.0

    def layer(self, layer, index: int) -> dict:
        if layer.mode is not None:
            raise CacheUsageError(f"cannot save layer {index} during {layer.mode.purpose}; let it finish first")
        if recorded_step(layer) is not None:
            raise CacheUsageError("a recording cache (record_prefill) cannot be saved; save the cache that replays it")
        self.depth = index / self.layers
        initialized = bool(layer.is_initialized)
        return {
            "seen": layer.seen, "seen_real": layer.seen_real, "initialized": initialized,
            "dtype": str(layer.dtype).removeprefix("torch.") if initialized else None,
            "store": self.store(layer.store), "parts": self.value(layer.parts), "state": self.value(layer.state),
        }  # fmt: skip

    def store(self, store: DenseKVStore) -> dict:
        buffers = {name: self.value(tensor, ROLES.get(name)) for name, tensor in store.live_buffers().items()}
        flags = {"first_position": store.first_position, "all_valid": store.all_valid, "heads_aligned": store.heads_aligned}
        return {"buffers": buffers, **flags}

    def value(self, obj, role: str | None = None):
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        if isinstance(obj, torch.Tensor):
            return self.tensors.add(obj, role, self.depth)
        if isinstance(obj, (list, tuple)):
            return {"t": type(obj).__name__, "v": [self.value(item) for item in obj]}
        if isinstance(obj, dict):
            return {"t": "dict", "v": [[key, self.value(item)] for key, item in obj.items()]}
        if isinstance(obj, torch.dtype):
            return {"t": "dtype", "v": str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.device):
            return {"t": "device"}
        if isinstance(obj, torch.nn.Module) and id(obj) in self.modules:
            return {"t": "module", "v": self.modules[id(obj)]}
        if isinstance(obj, DenseKVStore):
            return {"t": "store", "v": self.store(obj)}
        if dataclasses.is_dataclass(obj) and type(obj).__module__.startswith(ALLOWED_PREFIXES):
            return self.dataclass(obj)
        raise CacheUsageError(
            f"cannot save a cache holding a {type(obj).__module__}.{type(obj).__qualname__} in its state; "
            "the codec saves tensors, numbers, containers, kvopt.cache parts and the model's own modules"
        )

    def dataclass(self, obj) -> dict:
        if id(obj) in self.memo:
            return {"t": "ref", "v": self.memo[id(obj)]}
        self.memo[id(obj)] = len(self.memo)
        values = {item.name: self.value(getattr(obj, item.name), ROLES.get(item.name)) for item in dataclasses.fields(obj)}
        cls = type(obj)
        return {"t": "obj", "cls": f"{cls.__module__}:{cls.__qualname__}", "id": self.memo[id(obj)], "v": values}


class Loader:
    """Rebuilds what :class:`Dumper` wrote, with decoded ``tensors`` on ``model``'s device."""

    def __init__(self, tensors: list[torch.Tensor], model, source: str) -> None:
        self.tensors, self.model, self.source = tensors, model, source
        self.device = next(model.parameters()).device
        self.objects: dict[int, object] = {}

    def layer(self, layer, node: dict) -> None:
        layer.seen, layer.seen_real = node["seen"], node["seen_real"]
        if node["initialized"]:
            layer.dtype, layer.device, layer.is_initialized = DTYPES[node["dtype"]], self.device, True
        layer.store = self.store(node["store"])
        layer.parts = self.value(node["parts"])
        layer.state = self.value(node["state"])

    def store(self, node: dict) -> DenseKVStore:
        live = {name: self.value(value) for name, value in node["buffers"].items()}
        return DenseKVStore.restore(live, node["first_position"], node["all_valid"], node["heads_aligned"])

    def value(self, node):
        if not isinstance(node, dict):
            return node
        kind, value = node["t"], node.get("v")
        if kind == "tensor":
            return self.tensors[node["i"]]
        if kind in ("list", "tuple"):
            items = [self.value(item) for item in value]
            return items if kind == "list" else tuple(items)
        if kind == "dict":
            return {key: self.value(item) for key, item in value}
        if kind == "dtype":
            return DTYPES[value]
        if kind == "device":
            return self.device
        if kind == "module":
            return self.model.get_submodule(value)
        if kind == "store":
            return self.store(value)
        if kind == "ref":
            return self.objects[value]
        if kind == "obj":
            return self.dataclass(node)
        raise CacheCorruptError(f"{self.source}: unknown entry {kind!r} in the saved layers; the file is damaged")

    def dataclass(self, node: dict):
        module_name, _, name = node["cls"].partition(":")
        if not module_name.startswith(ALLOWED_PREFIXES):
            raise CacheCorruptError(f"{self.source} names the class {node['cls']}, which a cache never holds")
        cls = getattr(importlib.import_module(module_name), name, None)
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise CacheCorruptError(f"{self.source} names {node['cls']}, which is not a kvopt storage class")
        fields = {key: self.value(item) for key, item in node["v"].items()}
        obj = cls(**{key: item for key, item in fields.items() if _init_field(cls, key)})
        for key, item in fields.items():
            if not _init_field(cls, key):
                setattr(obj, key, item)
        self.objects[node["id"]] = obj
        return obj


def _init_field(cls, name: str) -> bool:
    return next(item.init for item in dataclasses.fields(cls) if item.name == name)
