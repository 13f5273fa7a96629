"""Pool and block-table invariants under random append/rollback, and paged KV == dense KV."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.cache.paged import PagedKV
from specdec.cache.pool import BlockTable, PagePool, PoolExhausted


@settings(max_examples=60, deadline=None)
@given(page_size=st.integers(1, 8), ops=st.lists(st.tuples(st.booleans(), st.integers(0, 20)), max_size=40))
def test_block_tables_never_leak_or_share_pages(page_size, ops):
    pool = PagePool(64, page_size)
    tables = [BlockTable(pool), BlockTable(pool)]
    for i, (grow, amount) in enumerate(ops):
        t = tables[i % 2]
        try:
            if grow:
                t.reserve(t.length + amount)
            else:
                t.truncate(max(0, t.length - amount))
        except PoolExhausted:
            pass
        # every held page is distinct, pages cover exactly ceil(length / page_size), and counts add up
        held = tables[0].pages + tables[1].pages
        assert len(held) == len(set(held))
        for tt in tables:
            assert len(tt.pages) == -(-tt.length // page_size)
        assert pool.num_free + len(held) == pool.num_pages
    for t in tables:
        t.release()
    assert pool.num_free == pool.num_pages


def test_exhaustion_is_a_clear_error_and_changes_nothing():
    pool = PagePool(2, 4)
    t = BlockTable(pool)
    t.reserve(8)
    with pytest.raises(PoolExhausted, match="KV cache budget exceeded"):
        t.reserve(9)
    assert t.length == 8 and len(t.pages) == 2 and pool.num_free == 0


def test_slots_follow_the_block_table():
    pool = PagePool(8, 3)
    other = BlockTable(pool)
    t = BlockTable(pool)
    other.reserve(3)  # so t's pages are not 0, 1, 2...
    t.reserve(7)
    expected = [t.pages[p // 3] * 3 + p % 3 for p in range(7)]
    assert t.slots(0, 7).tolist() == expected


@settings(max_examples=30, deadline=None)
@given(page_size=st.integers(1, 5), chunks=st.lists(st.integers(1, 6), min_size=1, max_size=6),
       cut=st.integers(0, 10), seed=st.integers(0, 10**6))
def test_paged_kv_matches_a_dense_cache(page_size, chunks, cut, seed):
    """Write chunks, roll back, write again, move rows: gathering equals the dense reference exactly."""
    g = torch.Generator().manual_seed(seed)
    pool = PagePool(32, page_size)
    table = BlockTable(pool)
    kv = PagedKV(pool, num_layers=2)
    dense = [torch.zeros(0, 2, 4), torch.zeros(0, 2, 4)]
    for n in chunks:
        start = kv.valid
        table.reserve(start + n)
        for layer in range(2):
            k = torch.randn(1, 2, n, 4, generator=g)
            kv.write(layer, table.slots(start, start + n), k, k * 2)
            dense[layer] = torch.cat([dense[layer][:start], k[0].transpose(0, 1)])
        kv.valid = start + n
        keep = max(0, kv.valid - cut)
        kv.valid = keep
        table.truncate(keep)
    for layer in range(2):
        if kv.k[layer] is None or kv.valid == 0:
            continue
        k, v = kv.gather(layer, table.slots(0, kv.valid))
        assert torch.equal(k[0].transpose(0, 1), dense[layer][:kv.valid])
        assert torch.equal(v, 2 * k)
    # move overlapping rows: result equals reading every source before writing
    if kv.valid >= 3 and kv.k[0] is not None:
        src = table.slots(1, kv.valid)[torch.tensor([1, 0])] if kv.valid >= 3 else None
        dst = table.slots(0, 2)
        before = kv.k[0][src].clone()
        kv.move(src, dst)
        assert torch.equal(kv.k[0][dst], before)
    table.release()
    assert pool.num_free == pool.num_pages


def test_span_is_the_slots_as_a_slice_only_where_the_pages_are_consecutive():
    pool = PagePool(8, 4)
    a = BlockTable(pool)
    a.reserve(10)  # pages 0, 1, 2
    assert a.span(0, 10) == slice(0, 10) and a.span(5, 9) == slice(5, 9)
    other, b = BlockTable(pool), BlockTable(pool)
    other.reserve(4)  # page 3
    b.reserve(4)  # page 4
    other.release()
    a.reserve(14)  # page 3: a is 0, 1, 2, 3, still consecutive
    b.reserve(9)  # pages 4, 5, 6
    a.reserve(17)  # page 7
    assert a.pages == [0, 1, 2, 3, 7] and a.span(0, 16) == slice(0, 16)
    assert a.span(0, 17) is None and a.span(15, 17) is None and a.span(16, 17) == slice(28, 29)
    for table in (a, b):  # wherever a span is given, it addresses the very slots the tensor does
        for start in range(table.length):
            for end in range(start + 1, table.length + 1):
                span = table.span(start, end)
                if span is not None:
                    assert torch.equal(torch.arange(span.start, span.stop), table.slots(start, end))
    kv = PagedKV(pool, 1)
    k, v = torch.randn(1, 2, 17, 3), torch.randn(1, 2, 17, 3)
    kv.write(0, a.slots(0, 16), k[:, :, :16], v[:, :, :16], a.span(0, 16))  # a plain copy
    kv.write(0, a.slots(16, 17), k[:, :, 16:], v[:, :, 16:])  # index_copy_
    got_k, got_v = kv.gather(0, a.slots(0, 17))
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    view_k, view_v = kv.gather(0, a.slots(0, 16), a.span(0, 16))
    assert torch.equal(view_k, k[:, :, :16]) and torch.equal(view_v, v[:, :, :16])
    with pytest.raises(ValueError, match="reserved"):
        a.span(0, 21)
