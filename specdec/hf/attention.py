"""The attention function specdec registers with transformers, and the switch that selects it.

transformers 5 lets a third party supply attention: `AttentionInterface.register(name, fn)` and
`model.set_attn_implementation(name)`. Layers then call our `paged_attention` with keys/values that our
cache's `update` returned. We also register a mask function returning None, so transformers builds no
mask of its own: the engine owns masking (prefix fully visible + causal or tree-ancestor block).

Shapes (HF layout): query [1, Hq, n, D]; key/value [1, Hkv, T, D] (T = prefix + n) on the torch path,
or the page tensors [num_pages, page_size, Hkv, D] on the Triton path. Output [1, n, Hq, D].
"""
from __future__ import annotations

import contextlib
import threading
import weakref

import torch
import torch.nn.functional as F

NAME = "specdec"


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    sliding_window=None, softcap=None, specdec_meta=None, **kwargs):
    meta = specdec_meta
    if meta is None:
        raise RuntimeError("specdec attention was called outside a specdec forward (no specdec_meta); "
                           "restore the model's attention implementation before calling it directly")
    meta.calls += 1
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if meta.kernel and meta.kernel_rows is not None:  # a packed batch: every row over its own pages
        from ..kernels import tree_attention_rows

        out = tree_attention_rows(query[0].transpose(0, 1), key, value, meta.kernel_rows, scale,
                                  sliding_window=sliding_window, softcap=softcap)
        return out.unsqueeze(0), None
    if meta.kernel:
        from ..kernels import tree_attention

        q, tree_mask = query[0].transpose(0, 1), meta.tree_mask  # [n, Hq, D], [n, m + n]
        m = tree_mask.shape[1] - tree_mask.shape[0]
        if m:  # the kernel's tree block is square: idle query rows for the m nodes written earlier
            q = torch.cat([q.new_zeros(m, *q.shape[1:]), q])
            idle = torch.zeros(m, tree_mask.shape[1], dtype=torch.bool, device=q.device)
            idle[:, :m] = torch.eye(m, dtype=torch.bool, device=q.device)
            tree_mask = torch.cat([idle, tree_mask])
        out = tree_attention(q, key, value, meta.block_table, meta.prefix_len, tree_mask, scale,
                             sliding_window=sliding_window, softcap=softcap, node_pos=meta.key_pos)
        return out[m:].unsqueeze(0), None
    if meta.rows is not None:  # a packed batch laid out padded: key/value are [B, Hkv, T_max, D]
        rows = meta.rows
        B, Hq, D = key.shape[0], query.shape[1], query.shape[-1]
        qb = query[0].transpose(0, 1)[rows.q_index].view(B, -1, Hq, D).transpose(1, 2)  # [B, Hq, n_max, D]
        out = _attend(qb, key, value, rows.mask_for(sliding_window), scale, softcap)  # [B, Hq, n_max, D]
        return out.transpose(1, 2).reshape(-1, Hq, D)[rows.out_index].unsqueeze(0), None
    out = _attend(query, key, value, meta.mask_for(sliding_window), scale, softcap)
    return out.transpose(1, 2).contiguous(), None


def _attend(query, key, value, mask, scale, softcap):
    """query [b, Hq, n, D], key/value [b, Hkv, T, D], mask broadcastable to [b, Hq, n, T] bool (True = may
    attend) -> [b, Hq, n, D]."""
    if softcap is None:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                             enable_gqa=query.shape[1] != key.shape[1])
    else:  # Gemma-2 style logit soft-capping: SDPA has none
        groups = query.shape[1] // key.shape[1]
        k = key.repeat_interleave(groups, dim=1)
        v = value.repeat_interleave(groups, dim=1)
        scores = torch.matmul(query, k.transpose(-1, -2)) * scale
        scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        out = torch.matmul(probs, v)
    return out


def _no_mask(*args, **kwargs):
    return None


_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, paged_attention)
    AttentionMaskInterface.register(NAME, _no_mask)
    _registered = True


def check_supported(model) -> None:
    """Refuse, clearly, a model whose attention does not go through transformers' AttentionInterface."""
    if not getattr(model, "_supports_attention_backend", False):
        raise ValueError(
            f"{type(model).__name__} does not route attention through transformers' AttentionInterface, so "
            "specdec cannot run it over its paged KV cache; use a model class that supports custom attention "
            "backends (Llama, Mistral, Qwen2/3, Gemma, Phi-3, GPT-2, ...)")
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(f"{type(model).__name__} is an encoder-decoder model; specdec supports causal LMs only")


# model -> [number of generations inside specdec_attention, the implementation to restore]; one lock for all
_active: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def _enter(model) -> None:
    with _lock:
        entry = _active.get(model)
        if entry is None:
            _active[model] = [1, model.config._attn_implementation]
            model.set_attn_implementation(NAME)
        else:
            entry[0] += 1


def _exit(model) -> None:
    with _lock:
        entry = _active[model]
        entry[0] -= 1
        if entry[0] == 0:
            del _active[model]
            model.set_attn_implementation(entry[1])


@contextlib.contextmanager
def specdec_attention(*models):
    """Select our attention on `models` for the duration, restoring each one's own afterwards (also on error).

    Reference-counted per model under a lock: threads generating with the same model share the switch,
    and the last one out restores the model's own implementation."""
    register()
    entered = []
    try:
        for m in models:
            if m is None or any(m is e for e in entered):
                continue
            _enter(m)
            entered.append(m)
        yield
    finally:
        for m in reversed(entered):
            _exit(m)
