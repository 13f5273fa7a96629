"""An unmodified HF model runs over our paged cache: same logits as its own dense forward, any chunking."""
import pytest
import torch

from specdec.cache.pool import BlockTable, PagePool
from specdec.hf.attention import specdec_attention
from specdec.hf.runner import ModelRunner
from specdec.tree import ancestor_mask_with_root

from conftest import ARCHS, VOCAB, build


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_paged_forward_equals_dense(arch):
    model = build(arch)
    ids = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        dense = model(ids, use_cache=False).logits[0]
    impl = model.config._attn_implementation
    pool = PagePool(16, 4)
    table = BlockTable(pool)
    runner = ModelRunner(model, pool, table)
    got = []
    with specdec_attention(model):
        for a, b in [(0, 13), (13, 14), (14, 22), (22, 40)]:  # chunks longer than the sliding windows
            got.append(runner.forward(ids[0, a:b]))
    assert model.config._attn_implementation == impl  # restored
    assert torch.allclose(torch.cat(got), dense, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2"])
def test_tree_forward_gives_each_node_its_path_logits(arch):
    """One tree forward == running each root-to-node path as a chain (positions = prefix + depth)."""
    model = build(arch)
    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(3, VOCAB, (20,), generator=g)
    parents = torch.tensor([-1, -1, 0, 0, 1, 2, 5])
    nodes = torch.randint(3, VOCAB, (7,), generator=g)
    from specdec.tree import depths, path_to

    pool = PagePool(16, 4)
    table = BlockTable(pool)
    runner = ModelRunner(model, pool, table)
    with specdec_attention(model):
        runner.forward(prefix[:-1])
        L = runner.valid
        pos = torch.cat([torch.tensor([L]), L + depths(parents)])
        logits = runner.forward(torch.cat([prefix[-1:], nodes]), pos, ancestor_mask_with_root(parents))
    for i in range(7):
        path = torch.cat([prefix, nodes[path_to(parents.tolist(), i)]])
        with torch.no_grad():
            want = model(path[None], use_cache=False).logits[0, -1]
        assert torch.allclose(logits[i + 1], want, atol=1e-5, rtol=1e-4), i


def test_model_outside_the_attention_interface_is_refused():
    model = build("llama")
    model._supports_attention_backend = False
    pool = PagePool(4, 4)
    with pytest.raises(ValueError, match="AttentionInterface"):
        ModelRunner(model, pool, BlockTable(pool))


def test_attention_restored_after_an_exception():
    model = build("llama")
    impl = model.config._attn_implementation
    with pytest.raises(RuntimeError, match="boom"):
        with specdec_attention(model):
            assert model.config._attn_implementation == "specdec"
            raise RuntimeError("boom")
    assert model.config._attn_implementation == impl
