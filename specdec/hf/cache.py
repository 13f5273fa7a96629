"""The transformers `Cache` subclass that makes an unmodified HF model read and write our pages.

Before each forward the runner sets `cache.meta` (a StepMeta): where the n new tokens' KV goes
(write_slots [n]), which slots the queries read (read_slots [T]), the positions, and the mask. Layers
call `update(k [1, Hkv, n, D], v, layer_idx, ...)`; we write the pages and return the keys/values the
attention function needs (dense [1, Hkv, T, D] on the torch path, the page tensors on the kernel path).
"""
from __future__ import annotations

import functools
import inspect

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..cache.paged import PagedKV


@dataclass
class RowLayout:
    """A packed batch's rows laid out padded, for one batched attention call (hf/lean.py): B rows, each
    at most n_max new tokens and T_max keys.

    q_index [B * n_max] int64: the packed token behind each padded query (pads repeat a row's first);
    out_index [sum n] int64: the padded query behind each packed token (b * n_max + j);
    k_slots [B, T_max] int64: each row's read slots (pads: slot 0, masked); k_pos [B, T_max] positions;
    q_pos [B, n_max]; mask [B, n_max, T_max] bool (pad queries see their row's first key: no empty row)."""

    q_index: torch.Tensor
    out_index: torch.Tensor
    k_slots: torch.Tensor
    k_pos: torch.Tensor
    q_pos: torch.Tensor
    mask: torch.Tensor
    _masks: dict = field(default_factory=dict)

    def mask_for(self, sliding_window: int | None) -> torch.Tensor:
        """[B, 1, n_max, T_max] bool, the window applied; built once per forward per window size."""
        key = sliding_window or 0
        mask = self._masks.get(key)
        if mask is None:
            mask = self.mask
            if sliding_window:
                mask = mask & (self.q_pos[:, :, None] - self.k_pos[:, None, :] < sliding_window)
                mask[:, :, 0] |= ~mask.any(-1)  # a pad query keeps one key
            mask = self._masks[key] = mask[:, None]
        return mask


@dataclass
class StepMeta:
    """One forward's addressing. n new tokens written after `prefix_len` positions.

    The keys are the prefix (always visible) then a *tree block* of b = m + n nodes: m written by earlier
    forwards (a model drafter growing a tree one depth per forward; m = 0 otherwise), then the n new ones.

    write_slots: [n] int64; read_slots: [prefix_len + m + n] int64
    tree_mask: [n, m + n] bool (True = block column is ancestor-or-self of row); q_pos: [n] positions of
    the new tokens; block_pos: [m + n] positions of the block's keys (None: the block is the n new tokens)

    A packed batch (hf/batch_runner.py) gives the whole mask instead: full_mask [n, T] bool over every
    row's read slots, with read_pos [T] the position of each key (for sliding windows); prefix_len and
    tree_mask are then unused by the mask. `rows` lays the same batch out padded, for a loop that runs
    attention row by row in one call (hf/lean.py) instead of over the block-diagonal mask.
    """

    prefix_len: int
    write_slots: torch.Tensor
    read_slots: torch.Tensor
    tree_mask: torch.Tensor
    q_pos: torch.Tensor
    kernel: bool = False
    block_table: torch.Tensor | None = None
    block_pos: torch.Tensor | None = None
    full_mask: torch.Tensor | None = None
    read_pos: torch.Tensor | None = None
    rows: RowLayout | None = None
    kernel_rows: object = None  # a packed batch on the kernel path: kernels.tree_rows.KernelRows
    # write_slots / read_slots as slices where they are consecutive (BlockTable.span), else None
    write_span: slice | None = None
    read_span: slice | None = None
    calls: int = 0
    writes: int = 0  # PagedCache.update calls: a model that kept its keys in a cache of its own wrote none
    _masks: dict = field(default_factory=dict)
    _causal: bool | None = None

    @property
    def key_pos(self) -> torch.Tensor:
        """[m + n] positions of the tree block's keys."""
        return self.q_pos if self.block_pos is None else self.block_pos

    def unmasked(self, sliding_window: int | None) -> bool:
        """Does the mask_for(sliding_window) let every query see every key? (One new token after the prefix,
        no earlier block nodes, no window; a packed batch never.)"""
        return self.full_mask is None and tuple(self.tree_mask.shape) == (1, 1) and not sliding_window

    def causal_from_zero(self, sliding_window: int | None) -> bool:
        """Is mask_for(sliding_window) exactly SDPA's is_causal mask: a chain of n > 1 new tokens from
        position 0 (a first prefill), no earlier block nodes, no window that would cut it? Then attention
        may skip the masked half instead of computing and masking it (what HF's SDPA path does there too);
        the outputs are bit for bit the same (tests/test_lean.py)."""
        n = self.tree_mask.shape[0]
        if (self.full_mask is not None or self.prefix_len or self.block_pos is not None or n < 2
                or (sliding_window and n > sliding_window)):
            return False
        if self._causal is None:  # once per forward: a default chain's tree mask is causal_mask(n)
            self._causal = bool(torch.equal(self.tree_mask, torch.ones_like(self.tree_mask).tril_()))
        return self._causal

    def mask_for(self, sliding_window: int | None) -> torch.Tensor:
        """[n, prefix_len + m + n] bool; built once per forward per window size."""
        key = sliding_window or 0
        mask = self._masks.get(key)
        if mask is None and self.full_mask is not None:
            mask = self.full_mask
            if sliding_window:
                mask = mask & (self.q_pos[:, None] - self.read_pos[None, :] < sliding_window)
            self._masks[key] = mask
        if mask is None:
            n, dev = self.q_pos.numel(), self.q_pos.device
            mask = torch.cat([torch.ones(n, self.prefix_len, dtype=torch.bool, device=dev), self.tree_mask], dim=1)
            if sliding_window:
                k_pos = torch.cat([torch.arange(self.prefix_len, device=dev), self.key_pos])
                mask = mask & (self.q_pos[:, None] - k_pos[None, :] < sliding_window)
            self._masks[key] = mask
        return mask


class _PagedLayer(CacheLayerMixin):
    """Per-layer shim so transformers' Cache bookkeeping sees a layer; the data lives in PagedKV."""

    is_sliding = False

    def __init__(self, owner: "PagedCache"):
        super().__init__()
        self.owner = owner
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states):
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError  # PagedCache.update handles every layer

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.meta.read_slots.numel(), 0

    def get_seq_length(self) -> int:
        return self.owner.meta.prefix_len if self.owner.meta is not None else 0

    def get_max_length(self) -> int:
        return -1


class PagedCache(Cache):
    def __init__(self, kv: PagedKV):
        self.kv = kv
        self.meta: StepMeta | None = None
        super().__init__(layers=[_PagedLayer(self) for _ in range(kv.num_layers)])

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        meta = self.meta
        meta.writes += 1
        self.kv.write(layer_idx, meta.write_slots, key_states, value_states, meta.write_span)
        if meta.kernel:
            return self.kv.pages_view(layer_idx)
        if meta.rows is not None:  # a packed batch laid out padded: [B, Hkv, T_max, D]
            return self.kv.gather_rows(layer_idx, meta.rows.k_slots)
        return self.kv.gather(layer_idx, meta.read_slots, meta.read_span)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.meta.prefix_len if self.meta is not None else 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length()


def cache_keyword(model) -> str:
    """The forward keyword that takes our Cache: 'cache' (newer transformers 5 releases) or
    'past_key_values' (earlier ones, e.g. 5.17). Passed under the other name it lands in **kwargs unread
    and the model silently builds a DynamicCache of its own."""
    return _cache_keyword(type(model))


@functools.cache
def _cache_keyword(model_class) -> str:
    params = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def check_cache_used(model, meta: "StepMeta", layers: int) -> None:
    """After a forward through the HF modules: every layer's attention ran ours and wrote through our cache."""
    if meta.calls != layers:
        raise RuntimeError(
            f"{type(model).__name__}: specdec attention ran in {meta.calls} of {layers} layers; "
            "this model computes attention outside transformers' AttentionInterface and cannot use the paged cache")
    if meta.writes != layers:
        raise RuntimeError(
            f"{type(model).__name__}: {meta.writes} of {layers} layers wrote their keys through specdec's paged "
            f"cache (passed as {cache_keyword(model)}=); this transformers version's forward keeps them elsewhere")
