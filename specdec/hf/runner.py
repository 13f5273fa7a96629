"""Run an unmodified HF causal LM over the shared paged cache: one call = one forward of n tokens.

The same runner serves the target (prefill, verification of a chain or tree) and a model drafter
(catch-up, one drafting step per depth). Callers must be inside `specdec_attention(model)`.
"""
from __future__ import annotations

import torch

from ..cache.paged import PagedKV
from ..cache.pool import BlockTable, PagePool
from .attention import check_supported
from .cache import PagedCache, StepMeta


def num_layers_of(model) -> int:
    return model.config.get_text_config().num_hidden_layers


def max_positions_of(model) -> int | None:
    cfg = model.config.get_text_config()
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        v = getattr(cfg, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def causal_mask(n: int, device) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril_()


class ModelRunner:
    """One model, its page tensors on `pool`, addressed through the shared `table`."""

    def __init__(self, model, pool: PagePool, table: BlockTable, kernel: bool = False):
        check_supported(model)
        self.model = model
        self.device = next(model.parameters()).device
        self.table = table
        self.kv = PagedKV(pool, num_layers_of(model), self.device)
        self.cache = PagedCache(self.kv)
        self.kernel = kernel
        self.num_layers = self.kv.num_layers

    @property
    def valid(self) -> int:
        """Leading positions of the sequence holding this model's KV."""
        return self.kv.valid

    def rollback(self, length: int) -> None:
        self.kv.valid = min(self.kv.valid, length)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None, logits_rows=None) -> torch.Tensor:
        """Run n new tokens written at sequence positions valid..valid+n-1.

        tokens [n] int64; positions [n] int64 (RoPE / learned positions; default valid + arange(n), a
        tree passes valid + depth); tree_mask [n, n] bool (default causal); logits_rows: None (all), an
        int r (last r rows) or an index tensor. Returns logits [r, V] float32. Advances `valid` by n.
        """
        n = tokens.numel()
        start = self.kv.valid
        self.table.reserve(start + n)
        if positions is None:
            positions = torch.arange(start, start + n, device=self.device)
        if tree_mask is None:
            tree_mask = causal_mask(n, self.device)
        meta = StepMeta(prefix_len=start, write_slots=self.table.slots(start, start + n),
                        read_slots=self.table.slots(0, start + n), tree_mask=tree_mask, q_pos=positions,
                        kernel=self.kernel,
                        block_table=self.table.block_table_tensor() if self.kernel else None)
        self.cache.meta = meta
        keep = 0 if logits_rows is None else logits_rows
        out = self.model(input_ids=tokens[None], position_ids=positions[None], cache=self.cache, use_cache=True,
                         specdec_meta=meta, logits_to_keep=keep)
        if meta.calls != self.num_layers:
            raise RuntimeError(
                f"{type(self.model).__name__}: specdec attention ran in {meta.calls} of {self.num_layers} layers; "
                "this model computes attention outside transformers' AttentionInterface and cannot use the paged cache")
        self.kv.valid = start + n
        self.cache.meta = None
        return out.logits[0].float()
