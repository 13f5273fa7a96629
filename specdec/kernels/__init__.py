"""Triton kernels and their torch references (same signatures).

tree_attention / tree_attention_ref   attention of n tree nodes over a paged KV cache (verification)
tree_attention_rows / ..._rows_ref    the same for a batch's rows in one launch (KernelRows)
compact_kv / compact_kv_ref           move accepted rows' K/V into place, overlap-safe (commit)
slots_for                             logical positions -> flat page slots, through a block table
on_triton(device)                     which of the two a caller should use for tensors on `device`

The backend is chosen per call from the device, never by an import-time global: CUDA tensors and an
importable triton -> the kernels; anything else -> the torch references. The environment variable
SPECDEC_KERNELS=torch|triton overrides the choice (auto when unset or "auto"); "triton" on CPU tensors
only works under TRITON_INTERPRET=1 (Triton's CPU interpreter, used by the tests).

Note: `specdec.kernels.tree_attention` is the function (it shadows its module as a package attribute);
reach the module, e.g. for its `_tree_attn_kernel`, with importlib.import_module("specdec.kernels.tree_attention").
"""
from __future__ import annotations

import os

import torch

from .compaction import compact_kv, compact_kv_ref, slots_for
from .tree_attention import tree_attention
from .tree_attention_ref import tree_attention_ref
from .tree_rows import KernelRows, tree_attention_rows, tree_attention_rows_ref

__all__ = [
    "KernelRows", "compact_kv", "compact_kv_ref", "on_triton", "slots_for", "tree_attention", "tree_attention_ref",
    "tree_attention_rows", "tree_attention_rows_ref",
]


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def on_triton(device) -> bool:
    """Whether the Triton kernels should serve tensors on `device` (a torch.device or a string)."""
    choice = os.environ.get("SPECDEC_KERNELS", "auto").strip().lower()
    if choice not in ("auto", "", "torch", "triton"):
        raise ValueError(f"SPECDEC_KERNELS must be 'torch', 'triton' or 'auto', got {choice!r}")
    if choice == "torch":
        return False
    if choice == "triton":
        if not _triton_importable():
            raise RuntimeError("SPECDEC_KERNELS=triton but triton cannot be imported")
        return True
    return torch.device(device).type == "cuda" and _triton_importable()
