"""The torch reference of the tree attention kernel (kernels/tree_attention.py), and the engine's CPU path.

`tree_attention_ref` has the kernel's signature and shapes (see tree_attention.py's docstring): gather
the sequence's keys from its pages, one SDPA call (or, with a softcap, scores, tanh and softmax in
fp32). `_check_args` is both paths' argument check, so a bad call gets the same error from either.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .compaction import slots_for

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------- reference


def _visible_mask(prefix_len, lo, tree_mask, sliding_window, node_pos):
    """[n, prefix_len - lo + n] bool: which of keys lo .. prefix_len+n-1 each node may see."""
    n = tree_mask.shape[0]
    device = tree_mask.device
    prefix_part = torch.ones((n, prefix_len - lo), dtype=torch.bool, device=device)
    mask = torch.cat([prefix_part, tree_mask.to(torch.bool)], dim=1)
    if sliding_window is not None:
        q_pos = node_pos
        k_pos = torch.cat([torch.arange(lo, prefix_len, device=device, dtype=torch.long), node_pos])
        mask &= (q_pos[:, None] - k_pos[None, :]) < sliding_window
    return mask


def tree_attention_ref(q, k_pages, v_pages, block_table, prefix_len: int, tree_mask, scale: float,
                       sliding_window: int | None = None, softcap: float | None = None, node_pos=None):
    """Torch reference (and CPU path) of `tree_attention`; see the module docstring for shapes."""
    _check_args(q, k_pages, v_pages, block_table, prefix_len, tree_mask, scale, sliding_window, softcap,
                node_pos, "tree_attention_ref")
    n, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    G = num_q_heads // num_kv_heads
    if node_pos is None:
        node_pos = torch.arange(prefix_len, prefix_len + n, device=q.device)
    node_pos = node_pos.long()

    # prefix keys older than the window of the earliest query are invisible to every node: skip them
    lo = 0
    if sliding_window is not None and prefix_len > 0:
        q_min = int(node_pos.min()) if n > 0 else prefix_len
        lo = min(prefix_len, max(0, q_min - sliding_window + 1))
    slots = slots_for(block_table, torch.arange(lo, prefix_len + n, device=q.device), page_size)
    k = k_pages.reshape(num_pages * page_size, num_kv_heads, head_dim).index_select(0, slots)
    v = v_pages.reshape(num_pages * page_size, num_kv_heads, head_dim).index_select(0, slots)
    mask = _visible_mask(prefix_len, lo, tree_mask, sliding_window, node_pos)  # [n, T]

    if softcap is None:
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask, scale=scale, enable_gqa=G > 1)  # [1, Hq, n, D]; fully masked row -> 0
        return out[0].transpose(0, 1).contiguous()

    # softcap: SDPA has none; scores, tanh and softmax in fp32 (fp64 stays fp64)
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    qg = q.to(acc_dtype).reshape(n, num_kv_heads, G, head_dim).permute(1, 0, 2, 3)  # [Hkv, n, G, D]
    qg = qg.reshape(num_kv_heads, n * G, head_dim)
    s = torch.bmm(qg, k.to(acc_dtype).permute(1, 2, 0))                         # [Hkv, n*G, T]
    s = softcap * torch.tanh(s * (scale / softcap))
    visible = mask.repeat_interleave(G, dim=0)                                   # [n*G, T]
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1).masked_fill(~visible, 0.0)
    o = torch.bmm(p, v.to(acc_dtype).transpose(0, 1))                            # [Hkv, n*G, D]
    return o.reshape(num_kv_heads, n, G, head_dim).permute(1, 0, 2, 3).reshape(n, num_q_heads, head_dim).to(q.dtype)


# ------------------------------------------------------------------------------------------ checks


def _check_args(q, k_pages, v_pages, block_table, prefix_len, tree_mask, scale, sliding_window, softcap,
                node_pos, fn, dtypes=None):
    if q.dim() != 3:
        raise ValueError(f"{fn}: q must be [n, num_q_heads, head_dim], got shape {tuple(q.shape)}")
    if k_pages.dim() != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(
            f"{fn}: k_pages and v_pages must both be [num_pages, page_size, num_kv_heads, head_dim], "
            f"got {tuple(k_pages.shape)} and {tuple(v_pages.shape)}")
    n, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, kv_dim = k_pages.shape
    if kv_dim != head_dim:
        raise ValueError(f"{fn}: q head_dim {head_dim} != k/v head_dim {kv_dim}")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(f"{fn}: num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if dtypes is not None and q.dtype not in dtypes:
        raise ValueError(f"{fn}: dtype {q.dtype} not supported; use one of {[str(d) for d in dtypes]}")
    if not (q.dtype == k_pages.dtype == v_pages.dtype):
        raise ValueError(f"{fn}: q, k_pages, v_pages must share a dtype, got {q.dtype}, "
                         f"{k_pages.dtype}, {v_pages.dtype}")
    if tree_mask.shape != (n, n) or tree_mask.dtype != torch.bool:
        raise ValueError(f"{fn}: tree_mask must be a [{n}, {n}] bool tensor, got {tree_mask.dtype} "
                         f"of shape {tuple(tree_mask.shape)}")
    if block_table.dim() != 1 or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{fn}: block_table must be a 1-D int32 tensor, got {block_table.dtype} "
                         f"of shape {tuple(block_table.shape)}")
    if int(prefix_len) != prefix_len or prefix_len < 0:
        raise ValueError(f"{fn}: prefix_len must be a non-negative int, got {prefix_len!r}")
    if block_table.numel() * page_size < prefix_len + n:
        raise ValueError(f"{fn}: block_table covers {block_table.numel()} pages of {page_size} slots, "
                         f"fewer than prefix_len + n = {prefix_len + n} positions")
    if node_pos is not None and (node_pos.shape != (n,) or node_pos.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"{fn}: node_pos must be a [{n}] integer tensor, got {node_pos.dtype} "
                         f"of shape {tuple(node_pos.shape)}")
    if sliding_window is not None and (int(sliding_window) != sliding_window or sliding_window < 1):
        raise ValueError(f"{fn}: sliding_window must be None or a positive int, got {sliding_window!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"{fn}: softcap must be None or > 0, got {softcap!r}")
    if not math.isfinite(float(scale)):
        raise ValueError(f"{fn}: scale must be a finite float, got {scale!r}")
    tensors = [q, k_pages, v_pages, block_table, tree_mask] + ([node_pos] if node_pos is not None else [])
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{fn}: all tensors must be on one device, got {sorted(map(str, devices))}")
