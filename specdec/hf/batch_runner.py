"""One forward of an unmodified HF causal LM over several sequences of the shared paged cache.

The rows' new tokens are packed ragged into one sequence of sum(n_i) tokens (HF sees a batch of 1), each
token with its own row's position; the mask is block-diagonal: a row's tokens see that row's committed
KV (its own block table's slots) and the ancestors-or-self among its own new tokens, never another row.
One set of page tensors (PagedKV, indexed by page id) serves every row's table. Callers must be inside
`specdec_attention(model)`. On the kernel path (CUDA) the HF modules call the Triton tree attention
over every row's own pages in one launch per layer (kernels/tree_rows.py). On the torch path
attention runs through hf/lean.py's loop where the model passes its bit-exactness probe, else the HF
modules over a dense block-diagonal mask.

Cost on the torch path: below PADDED_FROM rows the dense mask is [sum n_i, sum T_i], so attention does
B times the work a per-row kernel would; from PADDED_FROM rows they are laid out padded instead
([B, n_max, T_max], RowLayout), through the lean loop and the HF modules alike. Weights are read once
for all rows, which is what a batch is for on memory-bound hardware.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.paged import PagedKV
from ..cache.pool import BlockTable, PagePool
from ..kernels.tree_rows import KernelRows
from ..transfer import to_device
from .attention import check_supported
from .cache import PagedCache, RowLayout, StepMeta, cache_keyword, check_cache_used
from .features import FeatureCapture
from .compiled import CompiledRunner, auto_compiles
from . import linear
from .lean import LeanRunner
from .linear import short_block_linears
from .runner import causal_mask, num_layers_of


# from this many rows the lean loop attends over the rows laid out padded (RowLayout) rather than over
# the block-diagonal mask: measured on this CPU, the padded call wins from about 4 rows (SmolLM2 and the
# zoo target) and loses below, where its layout and gather cost more than the masked work saved
PADDED_FROM = 4


@dataclass
class RowForward:
    """One row's part of a packed forward.

    table: the row's BlockTable; start: its committed KV length (the new tokens go to start .. start+n-1);
    tokens [n] int64; positions [n] int64 (None: start + arange(n)); tree_mask [n, b] bool (None: causal):
    which of the row's last b key positions (start + n - b .. start + n - 1) each new token sees, b >= n:
    b = n for a step's tokens, b > n for a draft model's tree grown one depth per forward (the m = b - n
    nodes written by earlier forwards sit right before these; the kernel path takes b = n only);
    block_pos [b] int64: the positions of those b keys (needed when b > n, for sliding windows);
    logits_rows: None (all n rows) or an int r (the last r)."""

    table: BlockTable
    start: int
    tokens: torch.Tensor
    positions: torch.Tensor | None = None
    tree_mask: torch.Tensor | None = None
    logits_rows: int | None = None
    block_pos: torch.Tensor | None = None


class BatchRunner:
    """One model's page tensors on `pool`, addressed through any number of rows' block tables."""

    def __init__(self, model, pool: PagePool, lean: bool = True, exact: bool = True, kernel: bool = False,
                 step: str = "bitwise", max_tokens: int = 1):
        """lean: run the lean loop where the model passes its probe, bit for bit (exact: a target's logits
        decide the output) or within rounding (a draft's only move acceptance). kernel: the HF modules
        with the Triton kernels (the lean loop is then never used). step: a target's step (hf/compiled.py;
        'auto' or 'compiled' run the compiled step where it applies, its buckets up to max_tokens packed
        tokens compiled now)."""
        check_supported(model)
        self.model = model
        self.device = next(model.parameters()).device
        self.kernel = kernel
        self.lean = None
        if lean and exact and not kernel and (step == "compiled" or (step == "auto" and auto_compiles(model, kernel))):
            self.lean = CompiledRunner.for_model(model, pool, None)
            if self.lean is not None:
                self.lean.prepare(max_tokens)
        if self.lean is None and lean and not kernel:
            self.lean = LeanRunner.for_model(model, pool, None, exact=exact)
        self.kv = self.lean.kv if self.lean is not None else PagedKV(pool, num_layers_of(model), self.device)
        # the HF modules' nn.Linear through this machine's short-block products (hf/linear.py), except where a
        # target's logits must be HF's bit for bit (step="bitwise")
        short = self.lean is None and not kernel and (not exact or step != "bitwise") and linear.short_blocks_on()
        self.linears = linear.plain_linears(model) if short else []
        self.cache = PagedCache(self.kv)
        self.num_layers = self.kv.num_layers
        # feature layers (hf/features.py) a feature-head drafter reads; each forward then leaves every
        # row's features, one per token it ran, in last_features: [n_i, F] per row
        self.capture: tuple[int, ...] = ()
        self.last_features: list[torch.Tensor] | None = None

    @torch.no_grad()
    def forward(self, rows: list[RowForward]) -> list[torch.Tensor]:
        """Run every row's new tokens in one forward; returns each row's logits [r_i, V] float32."""
        if not rows:
            return []
        dev = self.device
        writes, reads, q_pos, k_pos, keep, blocks, trees = [], [], [], [], [], [], []
        offset = 0
        dense = not self.kernel  # the kernel reads pages and tree masks itself: no dense key mask
        for row in rows:
            n, start = row.tokens.numel(), row.start
            if n == 0:
                raise ValueError("a row of a packed forward must run at least one token")
            row.table.reserve(start + n)
            pos = row.positions if row.positions is not None else torch.arange(start, start + n, device=dev)
            writes.append(row.table.slots(start, start + n))
            q_pos.append(pos)
            tree = row.tree_mask.to(dev) if row.tree_mask is not None else causal_mask(n, dev)
            b = tree.shape[1]
            if b < n or b > start + n or (self.kernel and b != n) or (b > n and row.block_pos is None):
                raise ValueError(f"a row's tree_mask must be [n, b] with n = {n} <= b <= start + n = {start + n}"
                                 f"{' and b = n on the kernel path' if self.kernel else ''}, and b > n needs "
                                 f"block_pos; got {tuple(tree.shape)}")
            trees.append(tree)
            if dense:
                reads.append(row.table.slots(0, start + n))
                block = pos if b == n else row.block_pos.to(dev)
                k_pos.append(torch.cat([torch.arange(start + n - b, device=dev), block]))
                blocks.append(torch.cat([torch.ones(n, start + n - b, dtype=torch.bool, device=dev), tree], dim=1))
            r = n if row.logits_rows is None else row.logits_rows
            keep.extend(range(offset + n - r, offset + n))
            offset += n
        positions = torch.cat(q_pos)
        if self.kernel:
            meta = StepMeta(prefix_len=0, write_slots=torch.cat(writes), read_slots=writes[0][:0],
                            tree_mask=trees[0][:, :0], q_pos=positions, kernel=True,
                            kernel_rows=KernelRows.build([row.table.pages for row in rows], [row.start for row in rows],
                                                         trees, positions, dev))
        else:
            # from PADDED_FROM rows attention runs row by row in one call (B x less work than the block
            # mask, which is then never built); otherwise every row's block goes on one mask's diagonal
            padded = len(rows) >= PADDED_FROM and not (self.lean is not None and self.lean.block_mask_batch(offset))
            meta = StepMeta(prefix_len=0, write_slots=torch.cat(writes), read_slots=torch.cat(reads),
                            tree_mask=torch.zeros(offset, 0, dtype=torch.bool, device=dev), q_pos=positions,
                            full_mask=None if padded else torch.block_diag(*blocks), read_pos=torch.cat(k_pos),
                            rows=_layout(reads, q_pos, k_pos, blocks, dev) if padded else None)
        tokens, keep = torch.cat([row.tokens.to(dev) for row in rows]), to_device(keep, torch.long, dev)
        sizes = [row.tokens.numel() if row.logits_rows is None else row.logits_rows for row in rows]
        ran = [row.tokens.numel() for row in rows]
        if self.lean is not None:
            need = max(row.start + row.tokens.numel() for row in rows) + 1
            self.lean.capture = self.capture
            logits = self.lean.run_meta(self.lean.embed(tokens), meta, need, keep)
            if self.capture:
                self.last_features = list(self.lean.last_features.split(ran))
            return list(logits.split(sizes))
        self.cache.meta = meta
        kwargs = {"input_ids": tokens[None], "position_ids": meta.q_pos[None], cache_keyword(self.model): self.cache,
                  "use_cache": True, "specdec_meta": meta, "logits_to_keep": keep}
        try:
            with short_block_linears(self.linears):
                if self.capture:
                    with FeatureCapture(self.model, self.capture) as cap:
                        out = self.model(**kwargs)
                    self.last_features = list(cap.features()[0].split(ran))
                else:
                    out = self.model(**kwargs)
        finally:
            self.cache.meta = None
        check_cache_used(self.model, meta, self.num_layers)
        return list(out.logits[0].float().split(sizes))


def _layout(reads: list, q_pos: list, k_pos: list, blocks: list, dev) -> RowLayout:
    """The rows of a packed forward laid out padded (see RowLayout): reads [T_b] slots, q_pos [n_b],
    k_pos [T_b], blocks [n_b, T_b] bool masks, one per row."""
    B = len(reads)
    ns, Ts = [p.numel() for p in q_pos], [r.numel() for r in reads]
    n_max, T_max = max(ns), max(Ts)
    q_index, out_index, offset = [], [], 0
    for b, n in enumerate(ns):
        q_index += list(range(offset, offset + n)) + [offset] * (n_max - n)
        out_index += range(b * n_max, b * n_max + n)
        offset += n
    k_slots = torch.zeros(B, T_max, dtype=torch.long, device=dev)
    kp = torch.zeros(B, T_max, dtype=torch.long, device=dev)
    qp = torch.zeros(B, n_max, dtype=torch.long, device=dev)
    mask = torch.zeros(B, n_max, T_max, dtype=torch.bool, device=dev)
    for b in range(B):
        k_slots[b, :Ts[b]] = reads[b]
        kp[b, :Ts[b]] = k_pos[b]
        qp[b, :ns[b]] = q_pos[b]
        mask[b, :ns[b], :Ts[b]] = blocks[b]
        mask[b, ns[b]:, 0] = True  # pad queries: one key, so no row of the softmax is empty
    return RowLayout(to_device(q_index, torch.long, dev), to_device(out_index, torch.long, dev), k_slots, kp, qp, mask)
