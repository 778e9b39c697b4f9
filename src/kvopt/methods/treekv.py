"""``treekv``: smooth tree-structured eviction, sparse far away and dense near, at every step.

TreeKV (He et al., arXiv 2501.04987, IJCAI'25): a Haar-wavelet analysis of ``a^T o V`` shows
contributions growing, and differing more between neighbours, toward the end of the sequence;
so the retained density should rise smoothly from far to near, like the leaves of a tree,
with decisions made *locally* rather than by one global ranking (H2O, TOVA), which creates
regional biases.

The cache holds the first ``sinks`` tokens, a *tree* region, and the ``window`` most recent
tokens: ``budget`` in all. Each stored token carries its accumulated attention S (the sum over
the queries that saw it, averaged over the GQA group, per KV head) and the number N of real
queries that saw it; its importance is the *average* S/N, not H2O's sum that favours old tokens.

Decoding (Algorithm 1, as ALGORITHMS.md §8 describes it): the token leaving the recent window
joins the right end of the tree region, which then holds one token over its capacity ``m``.
The eviction scope is the adjacent pair at ranks ``idx, idx + 1`` of the region; its less
important token is evicted (the older one on a tie), and ``idx <- (idx + 1) mod m``. Each
decision compares one pair, O(1); repeated sweeps of the cyclic pointer thin older regions
more often than newer ones, the coarse-to-fine density of the paper.

Prefilling (block level): the last ``block`` prompt tokens are the observation window, whose
attention gives S and N. The tree region's candidates are cut into blocks of ``block`` tokens,
each scored by the mean S/N of its tokens, and the same pairwise rule runs over blocks as they
arrive from left to right, the region holding ``m // block`` whole blocks; the fewer than
``block`` slots left go to the most recent candidates not kept. The decode pointer starts at
the token where the block pointer stopped.

Deviations and choices (the paper's code is not public; the algorithm comes from the abstract
and a secondary description of Algorithm 1, ALGORITHMS.md §8):

* The pointer wraps modulo the region's capacity ``m``, so a pair may include the token that
  just entered; ties evict the older token. Both are our reading of the description.
* Keys keep their absolute positions (post-RoPE, as H2O and TOVA); the paper re-assigns
  positions by order in the cache, needed to stream past the trained context (streamingllm's
  ``read_keys`` does that re-rotation and could serve here).
* S and N start from the observation window at the prefill (not from every prompt query); N is
  not stored but derived from positions (every query from the window on is real).
* Scores and selection are per KV head (the GQA group's mean), with one pointer per sequence.
* Storage: the survivors are compacted by the shared mechanism (:func:`keep_top`), a copy of the
  kept tokens per compaction; ``compress_every=k`` makes ``k`` pair decisions per compaction
  and amortises it (the cache then holds up to ``k - 1`` tokens over budget).
* Defaults: 4 sinks and a window of half the budget minus the sinks (the paper's language-model
  setting, 4 + 508 recent + 512 tree tokens for a 1K cache); ``block=32`` is ours.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from kvopt.errors import CacheUsageError, MethodParameterError
from kvopt.methods.base import register
from kvopt.methods.eviction import Eviction
from kvopt.methods.scores import accumulate_attention, attention_probs


@register
@dataclass
class TreeKV(Eviction):
    """Sinks + a tree region thinned pairwise by a cyclic pointer on average attention + a recent window."""

    name = "treekv"
    summary = "pairwise cyclic eviction on average attention: sparse far, dense near; every step (TreeKV)"
    schedule = "decode"

    window: int | None = field(
        default=None,
        metadata={"help": "recent tokens always kept, in the budget (default: half of it minus the sinks)"},
    )
    sinks: int = field(default=4, metadata={"help": "first tokens always kept (attention sinks), in the budget"})
    block: int = field(default=32, metadata={"help": "prefill: tokens per block; the last block observes"})

    def validate(self) -> None:
        if self.window is None:  # the default (half the kept tokens) always fits; check the rest
            dataclasses.replace(self, window=0)
        else:
            super().validate()
        if self.sinks < 0 or self.block < 1:
            raise MethodParameterError(f"treekv: sinks={self.sinks} must be >= 0 and block={self.block} >= 1")
        if self.budget is not None and self.sinks + (self.window or 0) >= self.budget:
            raise MethodParameterError(
                f"treekv: sinks={self.sinks} + window={self.window} must leave room for the tree in "
                f"budget={self.budget}, e.g. treekv:budget={max(2 * self.budget, 64)}"
            )

    def regions(self, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sinks, recent window and tree capacity per batch row (they add up to ``targets``)."""
        sinks = targets.clamp(max=self.sinks)
        if self.window is None:
            recent = (targets // 2 - self.sinks).clamp(min=0)
        else:
            recent = torch.full_like(targets, self.window)
        recent = torch.minimum(recent, targets - sinks)
        return sinks, recent, targets - sinks - recent

    # -- scores: S accumulated per token, N derived from positions ----------------------------------
    def after_attention(self, layer, step) -> None:
        if step.is_prefill:
            self._observe(layer, step)
        else:
            accumulate_attention(layer, step, self.name)
        super().after_attention(layer, step)

    def _observe(self, layer, step) -> None:
        """S from the observation window (the prompt's last ``block`` queries); where its real queries start."""
        store = layer.store
        observed = max(1, min(self.block, step.query.shape[-2]))
        if not store.has_extra(self.name):
            store.add_extra(self.name)
        store.extra(self.name)[...] = attention_probs(layer, step, last=observed).sum(dim=3).mean(dim=2)
        first_real = (~store.valid[:, 0]).sum(dim=-1)  # left padding
        layer.state[f"{self.name}.observed_from"] = first_real.clamp(min=layer.seen - observed)

    def importance(self, layer) -> torch.Tensor:
        """Average attention S/N of each stored token, ``[batch, kv_heads, tokens]``.

        N counts the real queries that saw a token: every query from the observation window on.
        """
        store = layer.store
        observed_from = layer.state[f"{self.name}.observed_from"][:, None, None]
        seen_by = layer.seen - torch.maximum(store.positions.long(), observed_from)
        return store.extra(self.name) / seen_by.clamp(min=1)

    # -- the tree rule ------------------------------------------------------------------------------
    def score(self, layer, step) -> torch.Tensor:
        """1 for the tokens the tree rule keeps, 0 for those it evicts (``keep_top`` keeps the ones)."""
        targets = self.targets(layer, step)
        if step.is_prefill:
            return self._prefill_survivors(layer, targets).float()
        return self._decode_survivors(layer, targets).float()

    def _pointer(self, layer, batch: int) -> torch.Tensor:
        key = f"{self.name}.pointer"
        pointer = layer.state.setdefault(key, torch.zeros(batch, dtype=torch.long, device=layer.store.valid.device))
        if pointer.shape[0] != batch:
            raise CacheUsageError("treekv does not support reordering the batch (beam search) yet")
        return pointer

    def _decode_survivors(self, layer, targets: torch.Tensor) -> torch.Tensor:
        """Token-level pairs at the cyclic pointer, one decision per token over budget (a budget always
        leaves a tree; a ratio never evicts while decoding)."""
        alive = layer.store.valid.clone()
        importance = self.importance(layer)
        sinks, _, tree = self.regions(targets.to(alive.device))
        pointer = self._pointer(layer, alive.shape[0])
        excess = alive[:, 0].sum(dim=-1) - targets
        for decision in range(int(excess.max())):
            active = excess > decision
            evict_pair(alive, importance, (sinks + pointer)[:, None], active)
            pointer = torch.where(active, (pointer + 1) % tree.clamp(min=1), pointer)
        layer.state[f"{self.name}.pointer"] = pointer
        return alive

    def _prefill_survivors(self, layer, targets: torch.Tensor) -> torch.Tensor:
        """Block-level pairs over each row's real prompt tokens; sets the decode pointer."""
        store = layer.store
        importance = self.importance(layer)
        kept = torch.zeros_like(store.valid)
        pointer = self._pointer(layer, kept.shape[0])
        for row, regions in enumerate(zip(*(r.tolist() for r in self.regions(targets)))):
            slots = torch.nonzero(store.valid[row, 0]).squeeze(-1)
            kept[row][:, slots], pointer[row] = tree_blocks(importance[row][:, slots], *regions, self.block)
        return kept


def evict_pair(alive: torch.Tensor, importance: torch.Tensor, first: torch.Tensor, active: torch.Tensor) -> None:
    """In place, where ``active``: of the alive slots at ranks ``first`` and ``first + 1`` (along the last
    axis), evict the less important one, the older on a tie.

    ``alive``/``importance`` are ``[rows, heads, slots]``; ``first`` is ``[rows, 1]`` (one pointer per row);
    ``active`` is ``[rows]``.
    """
    rank = alive.cumsum(dim=-1) - 1
    left = ((rank == first[..., None]) & alive).to(torch.uint8).argmax(dim=-1)
    right = ((rank == first[..., None] + 1) & alive).to(torch.uint8).argmax(dim=-1)
    lose_left = (importance.gather(-1, left[..., None]) <= importance.gather(-1, right[..., None])).squeeze(-1)
    loser = torch.where(lose_left, left, right)
    evicted = alive.scatter(-1, loser[..., None], False)
    alive.copy_(torch.where(active[:, None, None], evicted, alive))


def tree_blocks(scores: torch.Tensor, sinks: int, recent: int, tree: int, block: int) -> tuple[torch.Tensor, int]:
    """The tree rule over blocks of one row's real tokens: ``(kept [heads, tokens], decode pointer)``.

    ``scores [heads, tokens]`` are the tokens' S/N. Candidates lie between the sinks and the recent
    window; the region keeps ``tree // block`` whole blocks, then the most recent unkept candidates
    fill it to ``tree`` tokens.
    """
    heads, tokens = scores.shape
    kept = torch.ones(heads, tokens, dtype=torch.bool, device=scores.device)
    if tokens <= sinks + recent + tree:
        return kept, 0
    candidates = tokens - sinks - recent
    block_of = torch.arange(candidates, device=scores.device) // block
    blocks = int(block_of[-1]) + 1
    block_scores = scores.new_zeros(heads, blocks).index_add_(1, block_of, scores[:, sinks : tokens - recent])
    block_scores /= torch.bincount(block_of, minlength=blocks)
    capacity = tree // block
    alive = torch.zeros(heads, 1, blocks, dtype=torch.bool, device=scores.device)
    alive[..., :capacity] = True
    pointer = torch.zeros(heads, 1, dtype=torch.long, device=scores.device)
    everywhere = torch.ones(heads, dtype=torch.bool, device=scores.device)
    for arriving in range(capacity, blocks if capacity else 0):
        alive[..., arriving] = True
        evict_pair(alive, block_scores[:, None], pointer, everywhere)
        pointer = (pointer + 1) % capacity
    in_tree = alive[:, 0, block_of]  # [heads, candidates]
    shortfall = tree - in_tree.sum(dim=-1, keepdim=True)
    newest_first = (~in_tree).flip(-1).cumsum(dim=-1).flip(-1)  # unkept candidates at or after each one
    kept[:, sinks : tokens - recent] = in_tree | (~in_tree & (newest_first <= shortfall))
    return kept, int(pointer[0, 0]) * block % tree if tree else 0
