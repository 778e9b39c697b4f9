"""The method contract and the registry.

A method is a dataclass whose fields are its hyper-parameters (validated on construction,
like a kvpress press) and which acts on one layer's storage after each attention call.
Adding a method is one small file: subclass :class:`Method`, decorate with :func:`register`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvopt.errors import MethodParameterError, UnknownMethodError

if TYPE_CHECKING:
    from kvopt.cache.layer import AttentionStep, KVLayer
    from kvopt.models.info import ModelInfo


@dataclass(frozen=True)
class LayerContext:
    """What a theoretical-size computation knows about one layer (see :meth:`Method.layer_bytes`)."""

    index: int
    #: Every method of the spec, in order (a method may defer to another one's storage).
    methods: tuple
    #: Whether an earlier method chose tokens per KV head (positions are then stored per head).
    per_head: bool
    #: Whether an earlier method dropped tokens (positions are then no longer a run: stored per token).
    evicted: bool = False


@dataclass
class Method:
    """Base class of cache policies.

    Subclasses set ``name`` and ``summary`` and may override the hooks below; the defaults
    describe a lossless cache.
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    #: How the method's budget is expressed, shown by ``kvopt methods``.
    budget_convention: ClassVar[str] = "keeps every token"
    #: True when attention uses positions within the cache (StreamingLLM), so a sequence may run
    #: past the model's trained context; the cache then does not enforce ``max_positions``.
    extends_context: ClassVar[bool] = False
    #: True when the method acts after the prefill with the prompt's token ids in hand (KVzip's
    #: reconstruction); callers then prefill through :meth:`KVCache.prefill`.
    needs_prefill_pass: ClassVar[bool] = False
    #: True for a method that moves tokens (a quantizer) but may share a spec with one that needs the prefill pass:
    #: it leaves the prompt at full precision until that pass is done, then acts on what the pass kept (kivi).
    waits_for_prompt_pass: ClassVar[bool] = False
    #: True when the method compresses every layer together once the prefill's last layer has scored (lava): a
    #: method that moves a layer's tokens as soon as the layer is computed would take them from under it.
    ranks_layers_together: ClassVar[bool] = False
    #: True when the method changes the prefill's forward itself (FastKV passes only selected tokens to the
    #: later layers), so a recorded lossless prefill cannot stand for it (:meth:`KVCache.replay_prefill`).
    shapes_prefill: ClassVar[bool] = False
    #: True when the method reads the prompt's final hidden states (``cache.prompt_states``) in
    #: :meth:`after_prefill`, which :meth:`KVCache.prefill` then captures during the forward.
    reads_prompt_states: ClassVar[bool] = False
    #: True when :meth:`after_prefill` needs the tokenizer (KVzip's reconstruction prompt, EpiCache's turns):
    #: an engine without one refuses the spec when a request asks for it, rather than failing mid-prompt.
    needs_tokenizer: ClassVar[bool] = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check hyper-parameters on their own; raise :class:`MethodParameterError`."""

    def check_model(self, model: ModelInfo) -> None:
        """Check hyper-parameters against the model they will run on."""

    def after_attention(self, layer: KVLayer, step: AttentionStep) -> None:
        """Act on ``layer``'s storage once the new tokens are stored and attended to."""

    def idle_after_attention(self, state: dict, held: int) -> bool:
        """Whether :meth:`after_attention` would leave a layer as it is on a decode step after which its dense store
        holds ``held`` tokens (``state``: the layer's method state): the engine then skips building the layer for the
        methods (a compressed sequence's decode step). False, the safe answer, unless the method knows."""
        return False

    def after_prefill(self, cache, model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, tokenizer) -> None:
        """Act once the whole prompt is cached, with the model and the prompt's ids in hand."""

    def read_keys(self, layer: KVLayer, keys: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
        """The keys attention reads this step (e.g. re-rotated for positions within the cache)."""
        return keys

    def kept_tokens(self, seen_tokens: int) -> int:
        """Tokens one sequence keeps per layer after ``seen_tokens`` tokens (theoretical size)."""
        return seen_tokens

    #: True when the method keeps a different token set per KV head (so positions are per head).
    selects_per_head: ClassVar[bool] = False
    #: True when eviction only ever drops the oldest tokens, so the kept ones stay a run of positions held as
    #: its first; any other eviction keeps an int32 position per token and KV head (``kvopt memory`` counts them).
    evicts_oldest_only: ClassVar[bool] = False
    #: True when the serving engine's block layouts can hold what the method keeps: tokens at full precision or
    #: in one quantized format, layer by layer (no ranking across layers), and attention reads the keys as stored.
    #: The engine serves every method either way; the others run in each sequence's own cache
    #: (:mod:`kvopt.engine.kv.cache_backed`), which reads nothing in place.
    runs_in_engine: ClassVar[bool] = False
    #: False when layers or KV heads keep different numbers of tokens (the engine then stores the
    #: sequence in head blocks, :mod:`kvopt.engine.kv.headwise`).
    uniform_budgets: ClassVar[bool] = True

    #: True when, once the prompt is cached, :meth:`after_attention` reads only the stored tokens (never
    #: the queries) and acts at most after the last token of a block within :meth:`speculation_limit`:
    #: a speculative block is then verified in one attention call (see :func:`kvopt.speculative.restore.speculate`);
    #: otherwise (decode-time eviction scores queries) its tokens are attended one at a time.
    verifies_at_once: ClassVar[bool] = False

    def speculation_limit(self, layer: KVLayer) -> int | None:
        """Most tokens the next speculative block may hold on ``layer`` for this method to act only after
        its last token (None: it never acts while decoding, or acts per token anyway)."""
        return None

    def owns_layer(self, index: int) -> bool:
        """True when this method stores layer ``index``'s tokens its own way (cross-layer merging)."""
        return False

    def stores_quantized(self, quantizer: Method, kept_tokens: int, model: ModelInfo, layer: LayerContext) -> bool:
        """True when this method stores ``quantizer``'s tokens of a layer in its own quantized layout and counts
        their bytes (a cross-layer merge, for the layers it owns)."""
        return self.owns_layer(layer.index)

    def layer_bytes(self, kept_tokens: int, model: ModelInfo, element_bytes: int, layer: LayerContext) -> int | None:
        """Bytes one sequence's ``kept_tokens`` take in a (full-attention) layer when this method
        changes how tokens are stored (quantization, merging); None leaves the full-precision size."""
        return None

    def prepare(self, model, calibration_text: Callable[[], str]) -> None:
        """One-time set-up with the model in hand, when a cache is built (e.g. a calibration).

        ``calibration_text()`` returns the text to calibrate on; the caller decides where it comes
        from (methods import nothing above themselves), and a method that needs none never calls it.
        """

    def needs_preparation(self) -> bool:
        """Whether :meth:`prepare` may still take long (a calibration, loading or training one): the serving engine
        then runs it off its step. By default, whenever the method has a :meth:`prepare` of its own."""
        return type(self).prepare is not Method.prepare

    def spec(self) -> str:
        """The spec string that rebuilds this method (parameters left at their default are omitted)."""
        params = ",".join(
            f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self) if getattr(self, f.name) != f.default
        )
        return f"{self.name}:{params}" if params else self.name

    @classmethod
    def parameters(cls) -> list[dataclasses.Field[Any]]:
        return list(dataclasses.fields(cls))


_REGISTRY: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    """Class decorator adding a method to the registry under ``cls.name``."""
    if not cls.name:
        raise TypeError(f"{cls.__qualname__} must set a non-empty `name`")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise TypeError(f"method name {cls.name!r} is already registered by {_REGISTRY[cls.name].__qualname__}")
    _REGISTRY[cls.name] = cls
    return cls


def get(name: str) -> type[Method]:
    """The method class registered under ``name``."""
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise UnknownMethodError(
            f"unknown method {name!r}; choose one of: {known} (run `kvopt methods` for details)"
        ) from None


def available() -> list[type[Method]]:
    """Registered method classes, sorted by name."""
    return [_REGISTRY[name] for name in sorted(_REGISTRY)]


def require_ratio(method: Method, field_name: str) -> None:
    """Shared check for a fraction of tokens removed, which must lie strictly between 0 and 1."""
    value = getattr(method, field_name)
    if not 0.0 < value < 1.0:
        raise MethodParameterError(
            f"{method.name}: {field_name}={value} is outside (0, 1); it is the fraction of tokens removed, "
            f"e.g. {method.name}:{field_name}=0.5"
        )


def require_positive(method: Method, field_name: str) -> None:
    value = getattr(method, field_name)
    if value < 1:
        raise MethodParameterError(
            f"{method.name}: {field_name}={value} must be a positive integer, e.g. {method.name}:{field_name}=1024"
        )
