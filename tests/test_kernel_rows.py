"""Tree attention for a batch's rows in one launch (kernels/tree_rows.py), on CPU through Triton's
interpreter: every row's nodes see that row's own pages only, and the kernel equals the torch reference
(row by row tree_attention_ref) for rows of different prefix lengths, tree shapes, GQA, sliding windows,
soft-capping, split-K and every dtype; the reference equals each row run alone."""
import random

import pytest
import torch

from specdec.kernels import (KernelRows, slots_for, tree_attention_ref, tree_attention_rows,
                             tree_attention_rows_ref)

from test_kernels import DTYPES, HEADS, ancestor_mask, max_err, needs_interpreter, random_parents


def random_rows(seed, B, page_size, heads, head_dim, window, dtype=torch.float64):
    """B rows on one set of shuffled pages (NaN wherever no row wrote: a row reading another's pages, or
    an unwritten slot, would show), each with its own prefix length and tree."""
    rnd, g = random.Random(seed), torch.Generator().manual_seed(seed)
    Hq, Hkv = heads
    prefix = [rnd.randint(0, 50) for _ in range(B)]
    sizes = [rnd.randint(1, 9) for _ in range(B)]
    needed = [-(-(p + n) // page_size) for p, n in zip(prefix, sizes)]
    pages = torch.randperm(sum(needed) + 4, generator=g)
    k = torch.full((pages.numel(), page_size, Hkv, head_dim), float("nan"), dtype=torch.float64)
    v = torch.full_like(k, float("nan"))
    tables, masks, node_pos, used = [], [], [], 0
    for p, n, m in zip(prefix, sizes, needed):
        table = pages[used:used + m].to(torch.int32)
        used += m
        slots = slots_for(table, torch.arange(p + n), page_size)
        k.view(-1, Hkv, head_dim)[slots] = torch.randn(p + n, Hkv, head_dim, generator=g, dtype=torch.float64)
        v.view(-1, Hkv, head_dim)[slots] = torch.randn(p + n, Hkv, head_dim, generator=g, dtype=torch.float64)
        mask = ancestor_mask(random_parents(rnd, n, rnd.choice(["tree", "chain", "star"])))
        tables.append(table)
        masks.append(mask)
        node_pos.append(p + mask.sum(1) - 1)  # prefix + depth
    q = torch.randn(sum(sizes), Hq, head_dim, generator=g, dtype=torch.float64)
    rows = KernelRows.build(tables, prefix, masks, torch.cat(node_pos), "cpu")
    kw = dict(sliding_window=window) if window else {}
    return q.to(dtype), k.to(dtype), v.to(dtype), rows, head_dim ** -0.5, kw


def test_the_reference_gives_every_row_what_it_gets_alone():
    q, k, v, rows, scale, kw = random_rows(0, 4, 4, (4, 2), 16, window=7)
    out = tree_attention_rows_ref(q, k, v, rows, scale, **kw)
    start = 0
    for b, (p, n) in enumerate(zip(rows.prefix, rows.sizes)):
        alone = tree_attention_ref(q[start:start + n], k, v, rows.block_tables[b], p, rows.tree_masks[b, :n, :n],
                                   scale, node_pos=rows.node_pos[start:start + n], **kw)
        torch.testing.assert_close(out[start:start + n], alone, rtol=0, atol=0)
        start += n
    assert torch.isfinite(out).all()


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seed", range(6))
def test_the_rows_kernel_matches_the_reference(dtype, seed):
    rnd = random.Random(100 + seed)
    B, page_size = rnd.randint(1, 5), rnd.choice([1, 3, 4, 16])
    heads, head_dim = rnd.choice(HEADS), rnd.choice([16, 24])
    window, softcap = rnd.choice([None, 5, 30]), rnd.choice([None, 30.0])
    q, k, v, rows, scale, kw = random_rows(seed, B, page_size, heads, head_dim, window)
    if softcap:
        kw["softcap"] = softcap
    ref64 = tree_attention_rows_ref(q, k, v, rows, scale, **kw)
    args = (q.to(dtype), k.to(dtype), v.to(dtype), rows, scale)
    out_torch = tree_attention_rows_ref(*args, **kw)
    for tuning in (dict(), dict(num_splits=3, block_n=16)):
        out = tree_attention_rows(*args, **kw, **tuning)
        assert out.dtype == dtype and out.shape == q.shape and torch.isfinite(out).all()
        eps = 2 * torch.finfo(dtype).eps * max(1.0, ref64.abs().max().item())
        assert max_err(out, ref64) <= 2 * max_err(out_torch, ref64) + eps, (tuning, max_err(out, ref64))


def test_bad_rows_are_refused_with_what_is_wrong():
    q, k, v, rows, scale, _ = random_rows(1, 3, 4, (4, 2), 16, window=None)
    with pytest.raises(ValueError, match="one of each per row"):
        KernelRows.build([rows.block_tables[0]], [1, 2], [torch.ones(1, 1, dtype=torch.bool)], torch.zeros(1), "cpu")
    with pytest.raises(ValueError, match="square"):
        KernelRows.build([rows.block_tables[0]], [1], [torch.ones(2, 3, dtype=torch.bool)], torch.zeros(2), "cpu")
    with pytest.raises(ValueError, match=r"q must be \[N = "):
        tree_attention_rows_ref(q[1:], k, v, rows, scale)
    short = KernelRows.build([t[:1] for t in rows.block_tables], [40] + rows.prefix[1:],
                             [rows.tree_masks[b, :n, :n] for b, n in enumerate(rows.sizes)], rows.node_pos, "cpu")
    with pytest.raises(ValueError, match="row 0's block table covers"):
        tree_attention_rows_ref(q, k, v, short, scale)
