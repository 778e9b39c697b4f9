"""``fastkv``: token-selective propagation, so the prefill itself gets cheaper, not only the cache.

FastKV (Jo et al., arXiv 2502.01068): token importance settles in the later layers, so the
layers up to the selection (TSP) layer run on the whole prompt and, at the TSP layer, SnapKV's
pooled window scores summed over all KV heads pick the ``tsp_rate`` share of the prompt (the
observation window always among them); only those tokens' hidden states, RoPE positions and
padding bits flow on. The later layers compute queries, keys, values and MLPs for them alone,
through the model's own decoder layers: forward pre-hooks (:func:`install`) slice what the
model hands each later layer, and the cache stores those tokens at their original sequence
indices (:class:`Propagated`), so decoding continues at the right positions.

The KV budget is decoupled from the propagation, per layer as in the paper's proportional mode:
every layer keeps ``ratio``'s share of the *prompt* (``budget``: that many tokens), the layers
after the TSP layer out of the tokens propagated to them (the paper's ``retain_rate / tsp_rate``
of the reduced length). Defaults are the paper's: window 8, max pooling with kernel 7, TSP at the
middle layer (15 of 32), ``tsp_rate=0.2``. Prefill cost is about ``(tsp + 1) / L`` of the full
one plus ``tsp_rate`` of the rest (its attention ``tsp_rate^2``).

Deviations: scores are averaged over the GQA group (the paper sums: the same ranking); with a
``budget``, the propagated share never falls below it (the paper's constant mode sets both).
The prefill's output holds the propagated tokens only (its last one is the prompt's last): pass
``logits_to_keep=1`` or read ``logits[:, -1]`` (``generate`` does). A prompt fed in several
forwards propagates its first one only. A recorded lossless prefill cannot stand for it
(``shapes_prefill``): the evaluation grid prefills it on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import ClassVar

import torch

from kvopt.errors import CacheUsageError, MethodParameterError
from kvopt.methods.base import register
from kvopt.methods.eviction import keep_top
from kvopt.methods.snapkv import SnapKV

#: Set on a decoder layer once :func:`narrow_inputs` is registered on it.
HOOKED = "_kvopt_propagation"


@dataclass
class Propagated:
    """Which tokens of the next forward reach a layer, set as the layer's :attr:`~kvopt.cache.layer.KVLayer.mode`
    for that forward: :func:`narrow_inputs` hands the layer only those tokens, and its attention stores them at
    their sequence indices (chunk blending recomputes some tokens the same way, :mod:`kvopt.chunks.blend`)."""

    #: ``[batch, kept]`` columns of the forward's tokens that reach the layer, ascending per row.
    columns: torch.Tensor
    #: Tokens in the forward: the sequence indices it consumes, whatever reaches the layer.
    width: int
    #: Real (non-padding) tokens of the forward, summed over the batch: the tokens the layer has seen.
    real: int
    #: The first layer they reach, whose input hidden states are narrowed to them (later ones get them narrowed).
    first_layer: int
    purpose: ClassVar[str] = "a forward only some of whose tokens reach the layer (fastkv, chunk blending)"
    forgets_tokens: ClassVar[bool] = False

    def positions(self, seen: int) -> torch.Tensor:
        """Sequence indices of the tokens reaching the layer: ``[kept]`` if the rows agree, else ``[batch, kept]``."""
        positions = (self.columns + seen).to(torch.int32)
        return positions[0] if bool((positions == positions[:1]).all()) else positions

    def hand_to(self, layers) -> None:
        """Become the mode of ``layers`` for their next attention call."""
        for layer in layers:
            if layer.mode is not None:
                raise CacheUsageError(f"token-selective propagation cannot run during {layer.mode.purpose}")
            layer.mode = self

    def attend(self, layer, module, query, key, value, padding, scaling, sliding_window, softcap) -> torch.Tensor:
        """Store the tokens that reached ``layer`` at their sequence indices, counting the whole forward as seen;
        attend as usual. The layer leaves this mode."""
        layer.mode = None
        is_prefill, positions = layer.seen == 0, self.positions(layer.seen)
        valid = padding[:, -key.shape[-2] :] if padding is not None else None
        layer.store.append(key, value, layer.seen, valid, positions)
        layer.seen += self.width
        layer.seen_real += self.real
        return layer.attend_stored(module, query, positions, scaling, sliding_window, softcap, is_prefill)


@register
@dataclass
class FastKV(SnapKV):
    """SnapKV in every layer; past the TSP layer only the top ``tsp_rate`` of the prompt is computed at all."""

    name = "fastkv"
    summary = "token-selective propagation: later layers prefill only the tokens a middle layer ranks highest (FastKV)"
    shapes_prefill = True
    runs_in_engine = False  # the engine's runner feeds every prompt token to every layer

    window: int = field(default=8, metadata={"help": "observation window (last prompt tokens), always kept"})
    kernel: int = field(default=7, metadata={"help": "pooling kernel over tokens"})
    pooling: str = field(default="max", metadata={"help": "avg or max"})
    tsp_layer: int | None = field(
        default=None, metadata={"help": "last layer run on the whole prompt (default: the middle one, 15 of 32)"}
    )
    tsp_rate: float = field(default=0.2, metadata={"help": "share of the prompt's tokens propagated past tsp_layer"})

    def validate(self) -> None:
        super().validate()
        if not 0.0 < self.tsp_rate <= 1.0:
            raise MethodParameterError(f"fastkv: tsp_rate={self.tsp_rate} must lie in (0, 1], e.g. fastkv:tsp_rate=0.2")
        if self.tsp_layer is not None and self.tsp_layer < 0:
            raise MethodParameterError(f"fastkv: tsp_layer={self.tsp_layer} must be >= 0, e.g. fastkv:tsp_layer=15")

    def check_model(self, model) -> None:
        super().check_model(model)
        if self.tsp_layer is not None and self.tsp_layer >= model.num_layers - 1:
            raise MethodParameterError(
                f"fastkv: tsp_layer={self.tsp_layer} leaves no later layer to propagate to (the model has "
                f"{model.num_layers}); choose at most {model.num_layers - 2}, or leave it out for the middle layer"
            )

    def prepare(self, model, calibration_text) -> None:
        super().prepare(model, calibration_text)  # budgets=xkv's layer sensitivity
        install(model)

    def selection_layer(self, layers: int) -> int:
        """Index of the TSP layer in a model of ``layers`` layers."""
        return self.tsp_layer if self.tsp_layer is not None else max(0, layers // 2 - 1)

    def prompt_tokens(self, layer) -> torch.Tensor:
        """The prompt's real tokens per row, also in the later layers, which store only the propagated ones."""
        return layer.state.get(f"{self.name}.prompt", super().prompt_tokens(layer))

    def after_attention(self, layer, step) -> None:
        if not step.is_prefill or layer.index != self.selection_layer(len(layer.siblings)):
            super().after_attention(layer, step)
            return
        assert len(layer.store) == step.query.shape[-2], "fastkv acts first (see spec._check_prefill_shapers)"
        scores = self.score(layer, step).float()
        targets = self.targets(layer, step)
        self._propagate(layer, scores, targets)
        if len(layer.store) > int(targets.max()):
            keep_top(layer, scores, targets, self.window)

    def _propagate(self, layer, scores: torch.Tensor, targets: torch.Tensor) -> None:
        """Pick each row's propagated tokens from ``scores [B, H_kv, T]`` and hand them to the later layers.

        Rows carry as many places as the batch's largest count; a row with fewer fills the rest with its
        padding (the last such columns: a padded row has enough, as counts grow by at most one per token),
        so its tokens stay a run at the end, as a left-padded prompt's do.
        """
        valid = layer.store.valid[:, 0]
        real = valid.sum(dim=-1)
        counts = torch.maximum((real.double() * self.tsp_rate).long(), targets).minimum(real)
        places = int(counts.max())
        width = valid.shape[-1]
        if places >= width:
            return  # every token flows on: nothing to gain
        ranked = scores.sum(dim=1).masked_fill(~valid, float("-inf"))  # summed over the KV heads, as the paper
        slots = torch.arange(width, device=ranked.device)
        window = (slots >= width - counts.clamp(max=self.window)[:, None]) & valid
        best = ranked.masked_fill(window, float("inf")).topk(places, dim=-1).indices
        chosen = torch.zeros_like(valid).scatter_(-1, best, slots[:places] < counts[:, None])
        padding_after = (~valid).flip(-1).cumsum(-1).flip(-1)  # padding columns at or after each column
        chosen |= ~valid & (padding_after <= (places - counts)[:, None])
        columns = chosen.nonzero()[:, 1]
        assert columns.numel() == places * valid.shape[0], "a row lacks the padding to fill its places"
        later = layer.siblings[layer.index + 1 :]
        Propagated(columns.view(-1, places), width, int(real.sum()), layer.index + 1).hand_to(later)
        for each in later:
            each.state[f"{self.name}.prompt"] = real


def decoder_layers(model, method: str) -> torch.nn.ModuleList:
    """The decoder layers of a llama / qwen2 / mistral / gemma family model, which ``method`` hooks."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise MethodParameterError(
            f"{method} hooks the decoder layers at `model.model.layers`, which {type(model).__name__} lacks; "
            "use a llama, qwen2, mistral or gemma family model"
        )
    return layers


def install(model) -> None:
    """Register :func:`narrow_inputs` on each of ``model``'s decoder layers, once however often it is called."""
    for index, module in enumerate(decoder_layers(model, "fastkv")):
        if not getattr(module, HOOKED, False):
            module.register_forward_pre_hook(partial(narrow_inputs, index), with_kwargs=True)
            setattr(module, HOOKED, True)


def narrow_inputs(index: int, module, args: tuple, kwargs: dict):
    """Forward pre-hook of decoder layer ``index``: when the cache says only some tokens reach it, keep
    those of the hidden states (unless an earlier layer did), RoPE tables, position ids and padding mask."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    layers = getattr(cache, "layers", ())
    propagated = getattr(layers[index], "mode", None) if index < len(layers) else None
    if not isinstance(propagated, Propagated):
        return None
    columns = propagated.columns
    batch = columns.shape[0]

    def along_tokens(tensor: torch.Tensor) -> torch.Tensor:  # [1 or B, width, ...] -> [B, kept, ...]
        tensor = tensor.expand(batch, *tensor.shape[1:])
        index = columns.view(*columns.shape, *(1,) * (tensor.ndim - 2)).expand(-1, -1, *tensor.shape[2:])
        return tensor.gather(1, index)

    hidden = args[0] if args else kwargs["hidden_states"]
    if index == propagated.first_layer:
        hidden = along_tokens(hidden)
    args, kwargs = (hidden, *args[1:]) if args else (), dict(kwargs)
    if not args:
        kwargs["hidden_states"] = hidden
    if kwargs.get("position_embeddings") is not None:
        kwargs["position_embeddings"] = tuple(along_tokens(table) for table in kwargs["position_embeddings"])
    if kwargs.get("position_ids") is not None:
        kwargs["position_ids"] = along_tokens(kwargs["position_ids"])
    kwargs["attention_mask"] = _narrow_mask(kwargs.get("attention_mask"), columns, layers[index].seen)
    return args, kwargs


def _narrow_mask(mask: torch.Tensor | None, columns: torch.Tensor, seen: int) -> torch.Tensor | None:
    """The 2-D padding mask ``[B, seen + width]`` for the propagated tokens: ``[B, seen + kept]`` (None: all real)."""
    if mask is None:
        return None
    mask = mask.expand(columns.shape[0], -1)
    return torch.cat([mask[:, :seen], mask[:, seen:].gather(1, columns)], dim=1)
