"""The engine's kernel path (used on CUDA) run on the CPU through Triton's interpreter: the real tree
attention and KV compaction kernels inside whole generations give the target's greedy output."""
import pytest
import torch

import specdec

from conftest import VOCAB, build, hf_greedy


@pytest.mark.parametrize("tree", [None, "static", "dynamic"])
def test_kernel_path_generation_equals_target_greedy(tree, monkeypatch):
    import specdec.kernels as kernels

    calls = {"attention": 0, "compaction": 0}
    real_attention, real_compact = kernels.tree_attention, kernels.compact_kv

    def attention(*a, **k):
        calls["attention"] += 1
        return real_attention(*a, **k)

    def compact(*a, **k):
        calls["compaction"] += 1
        return real_compact(*a, **k)

    monkeypatch.setattr(kernels, "tree_attention", attention)
    monkeypatch.setattr(kernels, "compact_kv", compact)
    target = build("llama", seed=0)
    ids = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(0))
    ref = hf_greedy(target, ids, 14, eos_token_id=None)
    spec = {None: {"draft_length": 3}, "static": {"tree": specdec.TreeSpec.static([2, 1])},
            "dynamic": {"tree": specdec.TreeSpec.dynamic(nodes=4, depth=3, topk=2)}}[tree]
    for drafter in (target, build("llama", seed=1, layers=1)):
        model = specdec.wrap(target, drafter=drafter, **spec)
        model.engine.kernel = True  # what a CUDA device selects
        out = model.generate(ids, max_new_tokens=14, eos_token_id=None, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref)
        assert model.engine.pool.num_used == 0
    assert calls["attention"] > 0  # the kernels really ran
    if tree == "static":  # with the target drafting for itself, a 2-wide tree accepts [0, 2]: moved KV
        assert calls["compaction"] > 0


@pytest.mark.parametrize("arch", ["gemma2"])  # sliding windows and soft-capping: every kernel option
def test_a_batch_on_the_kernel_path_gives_every_row_its_own_greedy_output(arch, monkeypatch):
    """Left-padded rows through the batched engine with the Triton kernels (what CUDA selects): one
    tree_attention_rows launch per layer and forward serves every row (prefill, chains and trees, sliding
    windows and soft-capping included), and each row equals its own unpadded greedy generation."""
    import specdec.kernels as kernels
    from test_batches import left_padded
    from test_engine_greedy import prompts

    launches = []
    real = kernels.tree_attention_rows

    def rows_attention(q, k, v, rows, *a, **kw):
        launches.append(len(rows.sizes))
        return real(q, k, v, rows, *a, **kw)

    monkeypatch.setattr(kernels, "tree_attention_rows", rows_attention)
    target = build(arch, seed=0, scale=2.0)
    rows = prompts(3, seed=31, length=(3, 14))
    ids, mask = left_padded(rows)
    want = [hf_greedy(target, r, 10, eos_token_id=None)[0, r.shape[1]:] for r in rows]
    for spec in ({"draft_length": 3}, {"tree": specdec.TreeSpec.static([2, 1])}):
        model = specdec.wrap(target, drafter=target, **spec)  # the target drafting for itself: long accepts
        model.engine.kernel = True
        launches.clear()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=None)
        for i, w in enumerate(want):
            assert torch.equal(out[i, ids.shape[1]:], w), (spec, i)
        assert launches and launches[0] == 3  # the prefill: every row in one launch per layer
        assert model.engine.pool.num_used == 0


def test_the_cache_goes_under_the_keyword_this_transformers_reads(monkeypatch):
    """transformers renamed forward's past_key_values= to cache= within 5.x (5.17 reads only the first, 5.25
    only the second): under the other name our paged cache lands in **kwargs unread and the model keeps its
    keys in a DynamicCache of its own (seen on the first GPU, transformers 5.17: the kernel was handed that
    cache's [1, H, T, D] keys for pages). The keyword follows the model's signature, and a forward whose
    layers did not write through our cache stops with an error naming it instead of running on."""
    import inspect

    from specdec.hf import cache as hf_cache

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, **kwargs):
            pass

    assert hf_cache.cache_keyword(Old()) == "past_key_values"
    target = build("llama", seed=0)
    want = "cache" if "cache" in inspect.signature(type(target).forward).parameters else "past_key_values"
    assert hf_cache.cache_keyword(target) == want
    ids = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(0))
    ref = hf_greedy(target, ids, 6, eos_token_id=None)
    model = specdec.wrap(target, drafter="ngram", draft_length=2)
    model.engine.kernel = True
    assert torch.equal(model.generate(ids, max_new_tokens=6, eos_token_id=None), ref)
    # a name the forward does not read (5.25 still maps the old one): the model builds its own cache,
    # and the engine must notice rather than decode from it
    wrong = "a_cache_nobody_reads"
    monkeypatch.setattr(hf_cache, "cache_keyword", lambda model: wrong)
    monkeypatch.setattr("specdec.hf.runner.cache_keyword", lambda model: wrong)
    model = specdec.wrap(target, drafter="ngram", draft_length=2, step="bitwise")
    model.engine.lean = False  # through the HF modules, the path that reads the keyword
    with pytest.raises(RuntimeError, match="wrote their keys through specdec's paged cache"):
        model.generate(ids, max_new_tokens=6, eos_token_id=None)
    assert model.engine.pool.num_used == 0
