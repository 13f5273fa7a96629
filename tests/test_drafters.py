"""Drafters that need no second model: early-exit self-speculation (the n-gram drafter has its own file)."""
import pytest
import torch

import specdec
from specdec.drafters import EarlyExit

from conftest import VOCAB, build, hf_greedy


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2", "gemma3", "phi3"])
def test_early_exit_keeps_greedy_output(arch):
    target = build(arch, seed=0, layers=4)
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        ids = torch.randint(3, VOCAB, (1, int(torch.randint(3, 12, (1,), generator=g))), generator=g)
        ref = hf_greedy(target, ids, 30, eos_token_id=None)
        for exit_layer in (1, 3):
            for k in (2, "adaptive"):
                out = specdec.generate(target, ids, drafter=EarlyExit(target, exit_layer), draft_length=k,
                                       max_new_tokens=30, eos_token_id=None)
                assert torch.equal(out, ref), (arch, exit_layer, k)


def test_early_exit_shares_the_targets_weights_and_leaves_it_whole():
    target = build("llama", seed=0, layers=4)
    d = EarlyExit(target, 2)
    assert len(target.model.layers) == 4 and target.config.num_hidden_layers == 4
    assert len(d.model.model.layers) == 2
    assert d.model.lm_head.weight.data_ptr() == target.lm_head.weight.data_ptr()
    assert d.model.model.layers[1].mlp.up_proj.weight.data_ptr() == target.model.layers[1].mlp.up_proj.weight.data_ptr()


def test_early_exit_errors_name_the_problem():
    target = build("llama", seed=0, layers=4)
    with pytest.raises(ValueError, match="exit_layer must be in"):
        EarlyExit(target, 4)
    with pytest.raises(ValueError, match="model.layers"):
        EarlyExit(build("gpt2"), 1)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"])
def test_entering_the_last_layers_with_the_first_layers_hidden_is_the_full_model(arch):
    """What makes KV sharing exact: last_layers(E) entered with first_layers(E)'s hidden states computes the
    full model bit for bit, and the probe says so."""
    from specdec.hf.layer_views import enters_hidden_exactly, first_layers, last_layers

    target = build(arch, seed=1, layers=4)
    ids = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = target(ids, use_cache=False).logits
        head = first_layers(target, 2)
        head.model.norm.recording = True
        head(ids, use_cache=False)
        tail = last_layers(target, 2)(inputs_embeds=head.model.norm.captured[0], use_cache=False).logits
    assert torch.equal(tail, full)
    assert enters_hidden_exactly(target, 2) and EarlyExit(target, 2).share_kv


def _scale_inputs_embeds(target):
    """Make the decoder transform inputs_embeds before layer 0 (as some families do): sharing is then inexact."""
    def hook(module, args, kwargs):
        if kwargs.get("inputs_embeds") is not None:
            kwargs["inputs_embeds"] = kwargs["inputs_embeds"] * 1.5
        return args, kwargs

    target.model.register_forward_pre_hook(hook, with_kwargs=True)
    return target


def test_the_probe_catches_a_decoder_that_transforms_inputs_embeds():
    from specdec.hf.layer_views import enters_hidden_exactly

    target = _scale_inputs_embeds(build("llama", seed=1, layers=4))
    assert not enters_hidden_exactly(target, 2)
    d = EarlyExit(target, 2)
    assert not d.share_kv  # falls back: own pages, full verification, output still the target's
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    out = specdec.generate(target, ids, drafter=d, draft_length=3, max_new_tokens=16, eos_token_id=None)
    assert torch.equal(out, hf_greedy(target, ids, 16, eos_token_id=None))
    with pytest.raises(ValueError, match="does not reproduce its full forward"):
        EarlyExit(target, 2, share_kv=True)


def _spy_runs(monkeypatch):
    """Records every forward; the lean loop (hf/lean.py, tested on its own) is off so all go through _run."""
    from specdec.hf.lean import LeanRunner
    from specdec.hf.runner import ModelRunner

    monkeypatch.setattr(LeanRunner, "for_model", classmethod(lambda cls, *a, **kw: None))
    calls = []
    real = ModelRunner._run

    def spy(self, tokens, start, positions, block_pos, tree_mask, logits_rows, hidden=None, start_layer=0):
        calls.append((self.model, tokens.numel(), hidden is not None, start_layer, id(self.kv.k)))
        return real(self, tokens, start, positions, block_pos, tree_mask, logits_rows, hidden, start_layer)

    monkeypatch.setattr(ModelRunner, "_run", spy)
    return calls


def test_early_exit_writes_layers_below_exit_once_and_verification_skips_them(monkeypatch):
    target = build("llama", seed=0, layers=4, scale=2.0)
    ids = torch.randint(3, VOCAB, (1, 10), generator=torch.Generator().manual_seed(5))
    ref = hf_greedy(target, ids, 24, eos_token_id=None)
    calls = _spy_runs(monkeypatch)
    d = EarlyExit(target, 3)
    out = specdec.generate(target, ids, drafter=d, draft_length=3, max_new_tokens=24, eos_token_id=None)
    assert torch.equal(out, ref)
    target_calls = [c for c in calls if c[0] is target]
    draft_calls = [c for c in calls if c[0] is d.model]
    prefill, verifies = target_calls[0], target_calls[1:]
    assert not prefill[2] and prefill[1] == ids.shape[1]  # the only full-depth target forward
    # every verification of a draft enters at layer 3; a step without a draft (the last token) runs them all
    assert len([c for c in verifies if c[1] > 1]) >= 4
    assert all(c[2] == (c[1] > 1) and c[3] == (3 if c[1] > 1 else 0) for c in verifies)
    assert all(c[1] == 1 for c in draft_calls)  # no draft prefill: one token per drafting forward
    assert {c[4] for c in draft_calls} == {prefill[4]}  # the drafter writes the target's own page tensors


def test_early_exit_without_sharing_keeps_its_own_pages(monkeypatch):
    target = build("llama", seed=0, layers=4, scale=2.0)
    ids = torch.randint(3, VOCAB, (1, 10), generator=torch.Generator().manual_seed(5))
    calls = _spy_runs(monkeypatch)
    d = EarlyExit(target, 3, share_kv=False)
    out = specdec.generate(target, ids, drafter=d, draft_length=3, max_new_tokens=24, eos_token_id=None)
    assert torch.equal(out, hf_greedy(target, ids, 24, eos_token_id=None))
    assert not any(c[2] for c in calls)
    assert {c[4] for c in calls if c[0] is d.model}.isdisjoint({c[4] for c in calls if c[0] is target})


def test_early_exit_sharing_with_trees_sampling_and_kept_chat_cache():
    target = build("qwen2", seed=0, layers=4, scale=2.0)
    ids = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(2))
    ref = hf_greedy(target, ids, 20, eos_token_id=None)
    tree = specdec.generate(target, ids, drafter=EarlyExit(target, 2), tree=specdec.TreeSpec.static([2, 2, 1]),
                            max_new_tokens=20, eos_token_id=None)
    assert torch.equal(tree, ref)
    chat = specdec.wrap(target, drafter=EarlyExit(target, 2), keep_cache=True)
    first = chat.generate(ids, max_new_tokens=10, eos_token_id=None, do_sample=False)
    second = chat.generate(torch.cat([first, ids], 1), max_new_tokens=10, eos_token_id=None, do_sample=False)
    assert torch.equal(second, hf_greedy(target, torch.cat([first, ids], 1), 10, eos_token_id=None))
    torch.manual_seed(0)
    sampled = specdec.generate(target, ids, drafter=EarlyExit(target, 2), max_new_tokens=20, do_sample=True,
                               eos_token_id=None)
    assert sampled.shape == (1, 28)


def test_choose_exit_layer_finds_the_cheapest_layer_that_already_predicts_like_the_target():
    from specdec.drafters.early_exit import choose_exit_layer

    target = build("llama", seed=0, layers=4, scale=3.0)
    with torch.no_grad():  # layers 2 and 3 add nothing to the residual stream: layer 2's state is the final one
        for layer in target.model.layers[2:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    seq = hf_greedy(target, ids, 24, eos_token_id=None)
    best, rows = choose_exit_layer(target, [seq], [ids.shape[1]], layers=[1, 2, 3])
    by_layer = {r["layer"]: r for r in rows}
    assert by_layer[2]["alpha"] == 1.0 and by_layer[3]["alpha"] == 1.0 and by_layer[1]["alpha"] < 1.0
    assert by_layer[2]["c"] < by_layer[3]["c"]
    assert best == 2
