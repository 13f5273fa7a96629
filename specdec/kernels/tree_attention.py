"""Attention of n tree (or chain) nodes over a paged KV cache: the target's verification forward.

The tree's n nodes have already been written to the sequence's pages at logical positions
prefix_len .. prefix_len+n-1 (node i at prefix_len + i). Node 0 is the root (the pending token). Node i
attends to every prefix key and to the tree keys of its ancestors-or-self (tree_mask[i, j]).

    q:           [n, Hq, D]                   queries of the n nodes
    k/v_pages:   [num_pages, page_size, Hkv, D] one layer's paged cache (DESIGN.md section 3)
    block_table: [max_pages] int32            the sequence's pages; slot = page * page_size + offset
    tree_mask:   [n, n] bool                  True = node j is an ancestor-or-self of node i
    node_pos:    [n] int64                    absolute positions (prefix_len + depth); default
                                              prefix_len + arange(n); used only by the sliding window
    out:         [n, Hq, D]                   q's dtype; accumulation in fp32

Options: GQA (Hq = G * Hkv, q head h reads kv head h // G); `scale` (use the model's own, Gemma-2's is
not D^-0.5); `sliding_window` W (a query at position qp sees a key at kp only if qp - kp < W; prefix
keys sit at their logical position, tree key j at node_pos[j]); `softcap` c (Gemma-2:
s = c * tanh(s * scale / c), before masking). A node that can see no key at all gets a zero output
(both paths; torch SDPA does the same).

Two implementations with one signature: `tree_attention_ref` (kernels/tree_attention_ref.py; torch:
gather the pages, one SDPA call or an fp32 softmax when softcapping; the CPU path of the engine) and
`tree_attention` (Triton,
flash-attention style; the CUDA path). `tree_attention` takes extra keyword-only tuning knobs
(num_splits, block_m, block_n) that default to a heuristic.

Kernel layout: the G query heads that share one kv head are packed into the rows of one tile (row r =
node r // G, head r % G), so each K/V block is loaded once for all of them. The grid is
(row blocks, kv heads, splits): the prefix is cut into `num_splits` key ranges (flash-decoding split-K,
so a 64-node tree over a long prefix still fills the GPU); each split keeps an online softmax over its
keys, the last split also takes the tree block, and a small combine kernel merges the splits by their
log-sum-exp. With one split the kernel writes the output directly.

Precision: on a GPU, fp16/bf16 dots use tensor cores with fp32 accumulation (the softmax
probabilities are cast to V's dtype for P @ V, as flash-attention does); fp32 dots use
input_precision="ieee" (no TF32). The softmax state (running max, sum, accumulator) is fp32.

Triton interpreter (TRITON_INTERPRET=1): it runs these kernels on CPU tensors as they are, no device
handling needed. One limitation: it stores bf16 as raw uint16 and its tl.dot is a numpy matmul, so bf16
arithmetic and bf16 dots give garbage there (fp16/fp32 are fine). Under the interpreter the launcher
therefore sets DOT_FP32 for bf16: operands are upcast to fp32 after loading (exact) and the
probabilities are rounded to bf16 first, so the numerics match the GPU path up to summation order.
The real compiler is checked separately: tests compile every kernel for sm_90 without a GPU.
"""
from __future__ import annotations

import torch

from .compaction import _interpreting
from .tree_attention_ref import _DTYPES, _check_args

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch reference path works without triton
    triton = None
    tl = None

_LOG2E = 1.4426950408889634


# ------------------------------------------------------------------------------------------ kernel

if triton is not None:

    _LOG2E_C = tl.constexpr(_LOG2E)

    @triton.jit
    def _tanh(x):
        """fp32 tanh to ~1 ulp. tl.math has no tanh and libdevice does not run in the interpreter.
        |x| >= 0.625: 1 - 2 / (exp(2x) + 1) (saturates to +-1); below, where that form loses relative
        accuracy (softcap multiplies the error by c ~ 30-50), the odd Taylor series to x^17."""
        e = tl.exp2(tl.minimum(tl.maximum(x, -20.0), 20.0) * 2.8853900817779268)  # exp(2x); tanh(20) == 1.0f
        big = 1.0 - 2.0 / (e + 1.0)
        x2 = x * x
        p = 6404582.0 / 10854718875.0
        p = p * x2 - 929569.0 / 638512875.0
        p = p * x2 + 21844.0 / 6081075.0
        p = p * x2 - 1382.0 / 155925.0
        p = p * x2 + 62.0 / 2835.0
        p = p * x2 - 17.0 / 315.0
        p = p * x2 + 2.0 / 15.0
        p = p * x2 - 1.0 / 3.0
        small = x + x * x2 * p
        return tl.where(tl.abs(x) < 0.625, small, big)

    @triton.jit
    def _attend(acc, m_i, l_i, q, k, v, visible, qk_scale, softcap,
                HAS_SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr, DOT_IEEE: tl.constexpr):
        """One online-softmax step. q: [BLOCK_M, BLOCK_D], k/v: [BLOCK_N, BLOCK_D] in storage dtype,
        visible: [BLOCK_M, BLOCK_N]; acc fp32 [BLOCK_M, BLOCK_D], m_i/l_i fp32 [BLOCK_M] (log2 domain)."""
        if DOT_FP32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        elif DOT_IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if HAS_SOFTCAP:
            s = (softcap * _LOG2E_C) * _tanh(s * qk_scale)  # qk_scale = scale / softcap
        else:
            s = s * qk_scale                                # qk_scale = scale * log2(e)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet stay at 0
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(v.dtype)  # the GPU path feeds P to the tensor cores in V's dtype
        if DOT_FP32:
            pv = tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee")
        elif DOT_IEEE:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p, v)
        acc = acc * alpha[:, None] + pv
        return acc, m_new, l_i

    @triton.jit
    def _tree_attn_kernel(
        Q, K_pages, V_pages, BlockTable, TreeMask, NodePos, Out, Lse, RowStart, PrefixLen,
        prefix_len, n_nodes, keys_per_split, num_splits, qk_scale, softcap, sliding_window,
        stride_qn, stride_qh,
        stride_kp, stride_ks, stride_kh,
        stride_vp, stride_vs, stride_vh,
        stride_bb,                         # BlockTable: [B, pages] (ROWS) or [pages]
        stride_mb, stride_mn, stride_mk,   # TreeMask: [B, n_max, n_max] (ROWS) or [n, n]
        stride_os, stride_on, stride_oh,   # Out: [splits, N, Hq, D] partials (SPLIT) or [N, Hq, D]
        stride_ls, stride_ln,              # Lse: [splits, N, Hq] (SPLIT only)
        GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, SPLIT: tl.constexpr,
        DOT_FP32: tl.constexpr, DOT_IEEE: tl.constexpr, ROWS: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        kv_head = tl.program_id(1)
        # axis 2: (row, split) pairs; one sequence (ROWS False) is row 0 with its lengths passed as scalars
        split = tl.program_id(2) % num_splits
        first = 0  # the row's first node in the packed Q / NodePos / Out
        if ROWS:
            row = tl.program_id(2) // num_splits
            first = tl.load(RowStart + row)
            n_nodes = tl.load(RowStart + row + 1) - first
            prefix_len = tl.load(PrefixLen + row)
            BlockTable += row.to(tl.int64) * stride_bb
            TreeMask += row.to(tl.int64) * stride_mb

        # rows of this tile: (node, q head) pairs that share kv_head
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        node = offs_m // GROUP
        q_head = kv_head * GROUP + offs_m % GROUP
        row_ok = node < n_nodes
        packed = (first + node).to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        offs_n = tl.arange(0, BLOCK_N)

        q_ptrs = Q + packed[:, None] * stride_qn + q_head[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        q_pos = tl.zeros([BLOCK_M], dtype=tl.int32)
        if HAS_WINDOW:
            q_pos = tl.load(NodePos + packed, mask=row_ok, other=0).to(tl.int32)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        k_head = K_pages + kv_head.to(tl.int64) * stride_kh
        v_head = V_pages + kv_head.to(tl.int64) * stride_vh

        # ---- prefix keys [lo, hi) of this split, read through the block table
        lo = split * keys_per_split
        hi = tl.minimum(lo + keys_per_split, prefix_len)
        hi = tl.where(pid_m * BLOCK_M < n_nodes * GROUP, hi, lo)  # a tile past a short row's nodes: idle
        if HAS_WINDOW:
            # keys older than the window of the tile's earliest query are invisible to all its rows
            q_min = tl.min(tl.where(row_ok, q_pos, 2147483647), 0)
            lo = tl.maximum(lo, q_min - sliding_window + 1)
        for start_n in range(lo, hi, BLOCK_N):
            pos = start_n + offs_n
            key_ok = pos < hi
            page = tl.load(BlockTable + pos // PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)
            slot_in_page = (pos % PAGE_SIZE).to(tl.int64)
            k = tl.load(k_head + page[:, None] * stride_kp + slot_in_page[:, None] * stride_ks + offs_d[None, :],
                        mask=key_ok[:, None] & d_ok[None, :], other=0.0)
            v = tl.load(v_head + page[:, None] * stride_vp + slot_in_page[:, None] * stride_vs + offs_d[None, :],
                        mask=key_ok[:, None] & d_ok[None, :], other=0.0)
            visible = row_ok[:, None] & key_ok[None, :]
            if HAS_WINDOW:
                visible = visible & ((q_pos[:, None] - pos[None, :]) < sliding_window)
            acc, m_i, l_i = _attend(acc, m_i, l_i, q, k, v, visible, qk_scale, softcap,
                                    HAS_SOFTCAP, DOT_FP32, DOT_IEEE)

        # ---- tree keys (node j at logical position prefix_len + j), under the ancestor mask
        if split == num_splits - 1:
            for start_t in range(0, n_nodes, BLOCK_N):
                j = start_t + offs_n
                key_ok = j < n_nodes
                pos = prefix_len + j
                page = tl.load(BlockTable + pos // PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)
                slot_in_page = (pos % PAGE_SIZE).to(tl.int64)
                k = tl.load(k_head + page[:, None] * stride_kp + slot_in_page[:, None] * stride_ks + offs_d[None, :],
                            mask=key_ok[:, None] & d_ok[None, :], other=0.0)
                v = tl.load(v_head + page[:, None] * stride_vp + slot_in_page[:, None] * stride_vs + offs_d[None, :],
                            mask=key_ok[:, None] & d_ok[None, :], other=0.0)
                both_ok = row_ok[:, None] & key_ok[None, :]
                tm = tl.load(TreeMask + node[:, None] * stride_mn + j[None, :] * stride_mk, mask=both_ok, other=0)
                visible = both_ok & (tm != 0)
                if HAS_WINDOW:
                    k_pos = tl.load(NodePos + first + j, mask=key_ok, other=0).to(tl.int32)
                    visible = visible & ((q_pos[:, None] - k_pos[None, :]) < sliding_window)
                acc, m_i, l_i = _attend(acc, m_i, l_i, q, k, v, visible, qk_scale, softcap,
                                        HAS_SOFTCAP, DOT_FP32, DOT_IEEE)

        # ---- epilogue: a row that saw no key gets 0 (and lse = -inf, so the combine ignores it)
        seen = l_i > 0.0
        o = acc / tl.where(seen, l_i, 1.0)[:, None]
        out_mask = row_ok[:, None] & d_ok[None, :]
        o_ptrs = Out + split.to(tl.int64) * stride_os + packed[:, None] * stride_on + q_head[:, None] * stride_oh \
            + offs_d[None, :]
        if SPLIT:
            tl.store(o_ptrs, o, mask=out_mask)
            lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
            tl.store(Lse + split * stride_ls + packed * stride_ln + q_head, lse, mask=row_ok)
        else:
            tl.store(o_ptrs, o.to(Out.dtype.element_ty), mask=out_mask)

    @triton.jit
    def _combine_splits_kernel(
        Part, Lse, Out,                    # Part [S, rows, D] fp32, Lse [S, rows] fp32, Out [rows, D]
        num_splits, stride_ps, stride_ls,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    ):
        """Merge split-K partial outputs of one (node, q head) row by their log2-sum-exp."""
        row = tl.program_id(0).to(tl.int64)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        s_ok = offs_s < num_splits
        d_ok = offs_d < HEAD_DIM
        lse = tl.load(Lse + offs_s * stride_ls + row, mask=s_ok, other=float("-inf"))
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp2(lse - m)                                                # 0 for empty splits
        part = tl.load(Part + offs_s[:, None] * stride_ps + row * HEAD_DIM + offs_d[None, :],
                       mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        total = tl.sum(w, 0)
        o = tl.sum(part * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
        tl.store(Out + row * HEAD_DIM + offs_d, o.to(Out.dtype.element_ty), mask=d_ok)


_SM_COUNT: dict = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _pick_tiles(dtype, rows: int, head_dim: int, block_m=None, block_n=None):
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps) for `rows` = n * G (node, q head) pairs per kv head.

    Chosen so that ptxas (sm_90) reports no register spills: fp16/bf16 dots use tensor cores; fp32
    dots are exact-fp32 FMA loops, register hungry, so fp32 takes small tiles (a correctness path).
    """
    BLOCK_D = max(16, triton.next_power_of_2(head_dim))
    fp32 = dtype == torch.float32
    BLOCK_M = block_m or (16 if rows <= 16 else 32 if (rows <= 32 or fp32) else 64)
    BLOCK_N = block_n or (16 if fp32 else 64 if BLOCK_D <= 128 else 32)
    if BLOCK_M < 16 or BLOCK_N < 16 or BLOCK_M & (BLOCK_M - 1) or BLOCK_N & (BLOCK_N - 1):
        raise ValueError(f"tree_attention: block_m and block_n must be powers of two >= 16, got {BLOCK_M}, {BLOCK_N}")
    num_warps = 8 if BLOCK_M * BLOCK_D > 64 * 128 or (fp32 and BLOCK_D > 64) else 4
    return BLOCK_M, BLOCK_N, BLOCK_D, num_warps


def tree_attention(q, k_pages, v_pages, block_table, prefix_len: int, tree_mask, scale: float,
                   sliding_window: int | None = None, softcap: float | None = None, node_pos=None, *,
                   num_splits: int | None = None, block_m: int | None = None, block_n: int | None = None):
    """Triton tree attention; shapes and semantics in the module docstring.

    Keyword-only tuning knobs (None = heuristic): num_splits (prefix key ranges processed by separate
    programs, then merged), block_m (rows = (node, q head) pairs per tile, >= 16), block_n (keys per
    step, >= 16). Runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1.
    """
    fn = "tree_attention"
    if triton is None:
        raise RuntimeError(f"{fn}: triton is not installed; use tree_attention_ref")
    _check_args(q, k_pages, v_pages, block_table, prefix_len, tree_mask, scale, sliding_window, softcap,
                node_pos, fn, dtypes=_DTYPES)
    for name, t in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
        if t.stride(-1) != 1:
            raise ValueError(f"{fn}: {name} must be contiguous in its last (head_dim) dim, got strides {t.stride()}")
    if q.device.type != "cuda" and not _interpreting():
        raise ValueError(f"{fn}: tensors are on {q.device}; the Triton kernel needs CUDA tensors "
                         "(or TRITON_INTERPRET=1 for CPU tensors). Use tree_attention_ref on CPU.")
    n = q.shape[0]
    if n == 0:
        return torch.empty_like(q, memory_format=torch.contiguous_format)
    if node_pos is None:
        node_pos = torch.arange(prefix_len, prefix_len + n, device=q.device, dtype=torch.int64)
    return launch(q, k_pages, v_pages, block_table, tree_mask, node_pos, None, None, prefix_len, n, scale,
                  sliding_window, softcap, num_splits, block_m, block_n)


def launch(q, k_pages, v_pages, block_table, tree_mask, node_pos, row_start, prefix_lens, max_prefix: int,
           n_max: int, scale: float, sliding_window, softcap, num_splits=None, block_m=None, block_n=None):
    """Run the kernel over checked arguments: one sequence (row_start None: block_table [pages], tree_mask
    [n, n], prefix_len = max_prefix, n = n_max) or B packed rows (kernels/tree_rows.py: row_start [B + 1]
    and prefix_lens [B] int32, block_table [B, pages], tree_mask [B, n_max, n_max]; max_prefix and n_max
    their largest values, known on the host)."""
    N, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    G = num_q_heads // num_kv_heads
    rows = row_start is not None
    B = row_start.numel() - 1 if rows else 1
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if block_table.dtype != torch.int32:
        block_table = block_table.to(torch.int32)
    tree_mask_u8 = tree_mask.view(torch.uint8)
    mask3 = tree_mask_u8 if rows else tree_mask_u8[None]

    BLOCK_M, BLOCK_N, BLOCK_D, num_warps = _pick_tiles(q.dtype, n_max * G, head_dim, block_m, block_n)
    m_blocks = triton.cdiv(n_max * G, BLOCK_M)

    # split-K over the prefix so that the grid fills the GPU (about 2 programs per SM)
    if num_splits is None:
        want = triton.cdiv(2 * _sm_count(q.device), m_blocks * num_kv_heads * B)
        num_splits = max(1, min(want, max_prefix // 256))  # >= 256 prefix keys per split
    num_splits = max(1, min(int(num_splits), max(1, max_prefix)))
    keys_per_split = triton.cdiv(triton.cdiv(max(max_prefix, 1), num_splits), BLOCK_N) * BLOCK_N
    num_splits = max(1, triton.cdiv(max_prefix, keys_per_split))

    if softcap is not None:
        qk_scale, softcap_arg = float(scale) / float(softcap), float(softcap)
    else:
        qk_scale, softcap_arg = float(scale) * _LOG2E, 1.0
    dot_fp32 = q.dtype == torch.bfloat16 and _interpreting()  # interpreter cannot multiply bf16
    dot_ieee = q.dtype == torch.float32

    split = num_splits > 1
    if split:
        part = torch.empty((num_splits, N, num_q_heads, head_dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((num_splits, N, num_q_heads), dtype=torch.float32, device=q.device)
        dst, stride_os, stride_ls = part, part.stride(0), lse.stride(0)
    else:
        lse = out  # unused
        dst, stride_os, stride_ls = out, 0, 0
    grid = (m_blocks, num_kv_heads, B * num_splits)
    _tree_attn_kernel[grid](
        q, k_pages, v_pages, block_table, mask3, node_pos, dst, lse,
        row_start if rows else block_table, prefix_lens if rows else block_table,  # unread without ROWS
        max_prefix, n_max, keys_per_split, num_splits, qk_scale, softcap_arg,
        min(int(sliding_window or 0), 1 << 30),
        q.stride(0), q.stride(1),
        k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2),
        block_table.stride(0) if rows else 0,
        mask3.stride(0), mask3.stride(1), mask3.stride(2),
        stride_os, dst.stride(-3), dst.stride(-2),
        stride_ls, num_q_heads,
        GROUP=G, PAGE_SIZE=page_size, HEAD_DIM=head_dim, BLOCK_D=BLOCK_D,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        HAS_SOFTCAP=softcap is not None, HAS_WINDOW=sliding_window is not None, SPLIT=split,
        DOT_FP32=dot_fp32, DOT_IEEE=dot_ieee, ROWS=rows,
        num_warps=num_warps, num_stages=2,
    )
    if split:
        _combine_splits_kernel[(N * num_q_heads,)](
            part, lse, out, num_splits, part.stride(0), lse.stride(0),
            HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
            BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
        )
    return out
