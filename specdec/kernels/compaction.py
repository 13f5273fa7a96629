"""Move KV rows inside the paged cache: the commit step after tree verification.

Tree verification writes the n tree nodes' K/V at logical positions L..L+n-1. Once the verifier has
picked the accepted path (nodes a_0, a_1, ... at positions L+a_0, L+a_1, ...), their K/V are copied to
L, L+1, ... (keys were rotated at position L+depth, which is exactly their final slot, so the rows are
moved bit for bit, never recomputed) and the sequence is truncated to L+m.

Layout (DESIGN.md section 3): one layer's pages are [num_pages, page_size, num_kv_heads, head_dim];
a sequence's block table is [max_pages] int32; logical position p lives in page block_table[p // page_size]
at offset p % page_size, i.e. at flat "slot" block_table[p // page_size] * page_size + p % page_size.

Sources and destinations may overlap (src=[5, 7, 8], dst=[4, 5, 6]): the result is always the one you
get by reading every source row before writing any destination. The Triton path does it in two launches
of one row-copy kernel (pages -> a small temp, temp -> pages); the torch reference materialises the
gathered rows first. Destination positions must be distinct (as with any scatter, duplicates leave an
unspecified winner). Both paths copy raw bits, so any dtype (fp32, fp16, bf16, fp8 ...) is exact.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch reference path works without triton
    triton = None
    tl = None


def slots_for(block_table: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Logical positions -> flat slots (page_id * page_size + offset).

    block_table: [max_pages] int32 page ids of one sequence
    positions:   [m] integer logical positions (each < max_pages * page_size)
    returns:     [m] int64 flat slots, on positions' device
    """
    positions = positions.long()
    pages = block_table.index_select(0, torch.div(positions, page_size, rounding_mode="floor"))
    return pages.long() * page_size + positions.remainder(page_size)


def _interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_compact_args(k_pages, v_pages, block_table, src_pos, dst_pos):
    if k_pages.shape != v_pages.shape or k_pages.dtype != v_pages.dtype:
        raise ValueError(
            f"compact_kv: k_pages and v_pages must have the same shape and dtype, got "
            f"{tuple(k_pages.shape)} {k_pages.dtype} and {tuple(v_pages.shape)} {v_pages.dtype}"
        )
    if k_pages.dim() not in (4, 5):
        raise ValueError(
            "compact_kv: pages must be [num_pages, page_size, num_kv_heads, head_dim] or "
            f"[num_layers, num_pages, page_size, num_kv_heads, head_dim], got shape {tuple(k_pages.shape)}"
        )
    if not (k_pages.is_contiguous() and v_pages.is_contiguous()):
        raise ValueError("compact_kv: k_pages and v_pages must be contiguous")
    if block_table.dim() != 1 or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"compact_kv: block_table must be a 1-D int32 tensor, got {block_table.dtype} "
            f"of shape {tuple(block_table.shape)}"
        )
    for name, t in (("src_pos", src_pos), ("dst_pos", dst_pos)):
        if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"compact_kv: {name} must be a 1-D integer tensor, got {t.dtype} {tuple(t.shape)}")
    if src_pos.numel() != dst_pos.numel():
        raise ValueError(f"compact_kv: src_pos has {src_pos.numel()} entries but dst_pos has {dst_pos.numel()}")
    devices = {t.device for t in (k_pages, v_pages, block_table, src_pos, dst_pos)}
    if len(devices) != 1:
        raise ValueError(f"compact_kv: all tensors must be on one device, got {sorted(map(str, devices))}")


def _flat_rows(pages: torch.Tensor) -> torch.Tensor:
    """[(L,) P, S, H, D] -> [L, P*S, H*D] view (L = 1 when there is no layer dim)."""
    if pages.dim() == 4:
        pages = pages.unsqueeze(0)
    L, P, S, H, D = pages.shape
    return pages.view(L, P * S, H * D)


def compact_kv_ref(k_pages, v_pages, block_table, src_pos, dst_pos) -> None:
    """Torch reference of `compact_kv` (same signature, same in-place semantics).

    k_pages, v_pages: [num_pages, page_size, Hkv, D] or [num_layers, num_pages, page_size, Hkv, D]
    block_table: [max_pages] int32;  src_pos, dst_pos: [m] int64 logical positions
    """
    _check_compact_args(k_pages, v_pages, block_table, src_pos, dst_pos)
    if src_pos.numel() == 0:
        return
    page_size = k_pages.shape[-3]
    src = slots_for(block_table, src_pos, page_size)
    dst = slots_for(block_table, dst_pos, page_size)
    for pages in (k_pages, v_pages):
        rows = _flat_rows(pages)
        rows.index_copy_(1, dst, rows.index_select(1, src))  # RHS is a new tensor: overlap-safe


if triton is not None:

    @triton.jit
    def _copy_rows_kernel(
        src_k, src_v, dst_k, dst_v,      # row tensors viewed as [L, rows, ROW_NUMEL]
        src_rows, dst_rows,              # [m] int64 row indices (ignored when *_IDENTITY)
        stride_src_l, stride_dst_l,      # elements between layers
        ROW_NUMEL: tl.constexpr,
        SRC_IDENTITY: tl.constexpr,
        DST_IDENTITY: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """Copy K and V row src_rows[i] -> dst_rows[i] of one layer; grid (m, L, cdiv(ROW_NUMEL, BLOCK))."""
        i = tl.program_id(0)
        layer = tl.program_id(1).to(tl.int64)
        offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
        in_row = offs < ROW_NUMEL
        if SRC_IDENTITY:
            src_row = i.to(tl.int64)
        else:
            src_row = tl.load(src_rows + i).to(tl.int64)
        if DST_IDENTITY:
            dst_row = i.to(tl.int64)
        else:
            dst_row = tl.load(dst_rows + i).to(tl.int64)
        src_off = layer * stride_src_l + src_row * ROW_NUMEL + offs
        dst_off = layer * stride_dst_l + dst_row * ROW_NUMEL + offs
        tl.store(dst_k + dst_off, tl.load(src_k + src_off, mask=in_row), mask=in_row)
        tl.store(dst_v + dst_off, tl.load(src_v + src_off, mask=in_row), mask=in_row)


_BITS_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def compact_kv(k_pages, v_pages, block_table, src_pos, dst_pos) -> None:
    """In place: K/V at logical positions src_pos -> logical positions dst_pos (Triton path).

    k_pages, v_pages: [num_pages, page_size, Hkv, D] (one layer) or [num_layers, num_pages, page_size,
                      Hkv, D] (all layers at once: one launch pair for the whole model)
    block_table:      [max_pages] int32
    src_pos, dst_pos: [m] int64; overlap allowed (all reads happen before any write); dst distinct
    """
    _check_compact_args(k_pages, v_pages, block_table, src_pos, dst_pos)
    if triton is None:
        raise RuntimeError("compact_kv needs triton; use compact_kv_ref on this machine")
    if k_pages.device.type != "cuda" and not _interpreting():
        raise ValueError(f"compact_kv: tensors are on {k_pages.device}; the Triton kernel needs CUDA tensors "
                         "(or TRITON_INTERPRET=1 for CPU tensors). Use compact_kv_ref on CPU.")
    m = src_pos.numel()
    if m == 0:
        return
    page_size = k_pages.shape[-3]
    src = slots_for(block_table, src_pos, page_size)
    dst = slots_for(block_table, dst_pos, page_size)
    bits = _BITS_VIEW[k_pages.element_size()]  # copy raw bits: exact for every dtype
    k_rows = _flat_rows(k_pages).view(bits)
    v_rows = _flat_rows(v_pages).view(bits)
    L, _, row_numel = k_rows.shape
    tmp_k = torch.empty((L, m, row_numel), dtype=bits, device=k_rows.device)
    tmp_v = torch.empty_like(tmp_k)
    block = min(1024, triton.next_power_of_2(row_numel))
    grid = (m, L, triton.cdiv(row_numel, block))
    # phase 1: gather every source row into the temp; phase 2: scatter the temp to the destinations.
    # Stream order makes phase 2 start after phase 1 has finished, so overlapping sets are safe.
    _copy_rows_kernel[grid](k_rows, v_rows, tmp_k, tmp_v, src, src, k_rows.stride(0), tmp_k.stride(0),
                            ROW_NUMEL=row_numel, SRC_IDENTITY=False, DST_IDENTITY=True, BLOCK=block)
    _copy_rows_kernel[grid](tmp_k, tmp_v, k_rows, v_rows, dst, dst, tmp_k.stride(0), k_rows.stride(0),
                            ROW_NUMEL=row_numel, SRC_IDENTITY=True, DST_IDENTITY=False, BLOCK=block)
