"""Tree attention for the rows of a batch in one launch: each row's nodes over that row's own pages.

A packed batch (hf/batch_runner.py) runs B rows' new tokens as one sequence of N = sum n_b queries. Row
b's n_b nodes were written to its own block table at logical positions prefix_b .. prefix_b + n_b - 1;
node i of row b attends to the row's prefix keys and to the row's tree keys that tree_mask_b marks (its
ancestors-or-self), never to another row's. The same Triton kernel as one sequence's
(kernels/tree_attention.py) with a row axis in its grid: program (tile, kv head, row x split) reads
its row's bounds from `KernelRows`.

    q:           [N, Hq, D]                     the rows' nodes, row after row
    k/v_pages:   [num_pages, page_size, Hkv, D] one layer's paged cache (every row's pages)
    rows:        KernelRows (below), built once per forward for every layer
    out:         [N, Hq, D]

`tree_attention_rows_ref` is the torch reference: tree_attention_ref row by row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..transfer import to_device
from .tree_attention import _interpreting, launch, triton
from .tree_attention_ref import _DTYPES, _check_args, tree_attention_ref


@dataclass
class KernelRows:
    """The rows of a packed forward as the kernel reads them.

    block_tables [B, P] int32 (each row's pages, zero padded); prefix_lens [B] int32 and starts [B + 1]
    int32 (row b's nodes are q[starts[b]:starts[b + 1]]) on the device; tree_masks [B, n_max, n_max]
    bool (row b's in the top-left [n_b, n_b]); node_pos [N] int64 positions (for sliding windows); and
    the same lengths on the host: prefix [B], sizes [B]."""

    block_tables: torch.Tensor
    prefix_lens: torch.Tensor
    starts: torch.Tensor
    tree_masks: torch.Tensor
    node_pos: torch.Tensor
    prefix: list[int]
    sizes: list[int]

    @staticmethod
    def build(block_tables: list, prefix: list[int], tree_masks: list[torch.Tensor], node_pos: torch.Tensor,
              device) -> "KernelRows":
        """block_tables: each row's page ids (a list of ints, as BlockTable.pages, or a [P_b] tensor);
        prefix: committed KV lengths; tree_masks: [n_b, n_b] bool each; node_pos [N] int64."""
        B = len(block_tables)
        if not B or len(prefix) != B or len(tree_masks) != B:
            raise ValueError(f"KernelRows: {len(block_tables)} block tables, {len(prefix)} prefix lengths and "
                             f"{len(tree_masks)} tree masks: one of each per row, at least one row")
        sizes = [int(m.shape[0]) for m in tree_masks]
        if any(tuple(m.shape) != (n, n) or m.dtype != torch.bool for m, n in zip(tree_masks, sizes)):
            raise ValueError("KernelRows: every tree mask must be a square [n_b, n_b] bool tensor")
        if node_pos.shape != (sum(sizes),):
            raise ValueError(f"KernelRows: node_pos must be [{sum(sizes)}], got {tuple(node_pos.shape)}")
        pages = [t.tolist() if isinstance(t, torch.Tensor) else list(t) for t in block_tables]
        width = max(1, max(len(p) for p in pages))
        tables = to_device([p + [0] * (width - len(p)) for p in pages], torch.int32, device)  # one copy
        n_max = max(sizes)
        masks = torch.zeros(B, n_max, n_max, dtype=torch.bool, device=device)
        for b, m in enumerate(tree_masks):
            masks[b, :sizes[b], :sizes[b]] = m.to(device)
        starts = [0]
        for n in sizes:
            starts.append(starts[-1] + n)
        return KernelRows(tables, to_device(prefix, torch.int32, device), to_device(starts, torch.int32, device),
                          masks, node_pos.to(device=device, dtype=torch.long), list(prefix), sizes)


def _check_rows(q, k_pages, v_pages, rows: KernelRows, scale, sliding_window, softcap, fn, dtypes=None):
    if q.dim() != 3 or q.shape[0] != sum(rows.sizes):
        raise ValueError(f"{fn}: q must be [N = {sum(rows.sizes)}, num_q_heads, head_dim], got {tuple(q.shape)}")
    page_size = k_pages.shape[1] if k_pages.dim() == 4 else 1
    for b, (p, n) in enumerate(zip(rows.prefix, rows.sizes)):
        if rows.block_tables.shape[1] * page_size < p + n:
            raise ValueError(f"{fn}: row {b}'s block table covers {rows.block_tables.shape[1]} pages of {page_size} "
                             f"slots, fewer than its prefix + nodes = {p + n}")
    # the per-tensor checks, on row 0's view
    n0 = rows.sizes[0]
    _check_args(q[:n0], k_pages, v_pages, rows.block_tables[0], rows.prefix[0], rows.tree_masks[0, :n0, :n0], scale,
                sliding_window, softcap, rows.node_pos[:n0], fn, dtypes)


def tree_attention_rows_ref(q, k_pages, v_pages, rows: KernelRows, scale: float, sliding_window: int | None = None,
                            softcap: float | None = None):
    """Torch reference of `tree_attention_rows`: one tree_attention_ref per row."""
    _check_rows(q, k_pages, v_pages, rows, scale, sliding_window, softcap, "tree_attention_rows_ref")
    outs, start = [], 0
    for b, (p, n) in enumerate(zip(rows.prefix, rows.sizes)):
        outs.append(tree_attention_ref(q[start:start + n], k_pages, v_pages, rows.block_tables[b], p,
                                       rows.tree_masks[b, :n, :n], scale, sliding_window, softcap,
                                       rows.node_pos[start:start + n]))
        start += n
    return torch.cat(outs)


def tree_attention_rows(q, k_pages, v_pages, rows: KernelRows, scale: float, sliding_window: int | None = None,
                        softcap: float | None = None, *, num_splits: int | None = None, block_m: int | None = None,
                        block_n: int | None = None):
    """Triton tree attention over a batch's rows in one launch (module docstring); tuning knobs as
    tree_attention's."""
    fn = "tree_attention_rows"
    if triton is None:
        raise RuntimeError(f"{fn}: triton is not installed; use tree_attention_rows_ref")
    _check_rows(q, k_pages, v_pages, rows, scale, sliding_window, softcap, fn, _DTYPES)
    if q.device.type != "cuda" and not _interpreting():
        raise ValueError(f"{fn}: tensors are on {q.device}; the Triton kernel needs CUDA tensors "
                         "(or TRITON_INTERPRET=1 for CPU tensors). Use tree_attention_rows_ref on CPU.")
    if any(t.stride(-1) != 1 for t in (q, k_pages, v_pages)):
        raise ValueError(f"{fn}: q, k_pages and v_pages must be contiguous in their last (head_dim) dim")
    return launch(q, k_pages, v_pages, rows.block_tables, rows.tree_masks, rows.node_pos, rows.starts,
                  rows.prefix_lens, max(rows.prefix), max(rows.sizes), scale, sliding_window, softcap, num_splits,
                  block_m, block_n)
