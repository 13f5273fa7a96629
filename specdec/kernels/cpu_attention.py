"""One layer's attention for the few query rows of a decode or verification step, over the paged KV, in one
call on x86 CPUs with AVX2 and FMA (cpu_attention.cpp): the new keys and values written to their slots,
then each query head attends over the slots the step reads, under the step's mask.

Why: between two of the compiled step's graphs (hf/compiled.py) a layer's attention was a dozen small torch
ops (the page write, views, transposes, the mask, SDPA, reshapes): on an AMD EPYC about 100-150 us a layer
for a few microseconds of arithmetic, 3-4 ms of a 32 ms SmolLM2 step. The kernel does it in one call, in
float32 (bfloat16 widened once a block of 32 keys): items of up to 4 query rows, each block's key and value
rows read from the pages once for every head of those rows (four keys of two queries, or four queries' value
sums, a register tile), the next block asked for ahead; where the items are fewer than 4 (a decode step) the
keys split into parts too, attended on the threads and merged (flash-decoding). Measured when it replaced the
SDPA ops (the compiled step through its graphs; commit c608de1's compiled_step_amd_epyc.md): a bfloat16
one-token step 29.4 ms against 39.0 (SDPA on one bfloat16 query costs about 190 us), a float32 8-token one
42.7 against 51.0; the row items and tiles against its first form (a (row, KV group) pair an item, a key row
read per head): benchmarks/results/kernels_ab_attention_amd_epyc_zen4.md. kernels/cpu_layer.py's layer kernel
runs the same attention inside its layer. Its result differs from SDPA's in the last bits (another summation
order and exp), like the compiled graphs' own arithmetic.

Built and loaded with the other CPU kernels (kernels/cpu_library.py: call its `load()` first). The op is
`torch.ops.specdec_cpu.attend_pages`; it mutates the page tensors it is given (declared in its schema).

Shapes: q [n, Hq, D], k_new, v_new [n, Hkv, D] (D a multiple of 8); k_pages, v_pages [S, Hkv, D]
contiguous (PagedKV's flat slots); write_slots [n], read_slots [T] int64; mask [n, T] bool (may row i see
key t) or None (every key) -> [n, Hq * D] in q's dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def attend_pages(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_pages: torch.Tensor,
                 v_pages: torch.Tensor, write_slots: torch.Tensor, read_slots: torch.Tensor,
                 mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Write k_new, v_new at write_slots, then attend (module docstring; call cpu_library.load() first)."""
    return torch.ops.specdec_cpu.attend_pages(q, k_new, v_new, k_pages, v_pages, write_slots, read_slots, mask,
                                              scale)


def attend_pages_ref(q, k_new, v_new, k_pages, v_pages, write_slots, read_slots, mask, scale) -> torch.Tensor:
    """The kernel's reference in torch: the same write, then SDPA in float32 over the gathered keys."""
    k_pages[write_slots] = k_new
    v_pages[write_slots] = v_new
    n, Hq, D = q.shape
    keys, vals = (t[read_slots].float().transpose(0, 1)[None] for t in (k_pages, v_pages))
    att = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], keys, vals, attn_mask=mask, scale=scale,
                                         enable_gqa=Hq != k_pages.shape[1])
    return att[0].transpose(0, 1).reshape(n, Hq * D).to(q.dtype)
