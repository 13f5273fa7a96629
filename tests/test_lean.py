"""The lean draft forward (hf/lean.py): same logits as the HF modules, used only where its probe passes."""
import pytest
import torch

import specdec
from specdec.cache.pool import BlockTable, PagePool
from specdec.drafters.model import ModelDrafter
from specdec.hf.attention import specdec_attention
from specdec.hf.lean import LeanRunner
from specdec.hf.runner import ModelRunner
from specdec.quantize import int8_draft

from conftest import VOCAB, build, hf_greedy


def _logits(cls, model, tokens, chunks):
    pool = PagePool(8, 8)
    runner = cls(model, pool, BlockTable(pool))
    out, at = [], 0
    with specdec_attention(model):
        for size in chunks:
            out.append(runner.forward(tokens[at:at + size], logits_rows=None))
            at += size
    return torch.cat(out)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_lean_forward_matches_the_hf_modules_past_the_sliding_window(arch):
    model = build(arch, seed=1)
    tokens = torch.randint(3, VOCAB, (30,), generator=torch.Generator().manual_seed(2))
    chunks = [13, 1, 1, 4, 1, 10]  # a prefill, single drafting steps, catch-up forwards; past mistral's window 9
    ref, got = _logits(ModelRunner, model, tokens, chunks), _logits(LeanRunner, model, tokens, chunks)
    assert torch.allclose(ref, got, atol=1e-5, rtol=1e-4)
    pool = PagePool(4, 8)
    assert isinstance(LeanRunner.for_model(model, pool, BlockTable(pool)), LeanRunner)


@pytest.mark.parametrize("arch", ["gemma2", "phi3", "qwen3", "gpt2"])
def test_unsupported_architectures_keep_the_hf_path_and_the_output(arch):
    pool = PagePool(4, 8)
    draft_model = build(arch, seed=3, layers=1)
    assert LeanRunner.for_model(draft_model, pool, BlockTable(pool)) is None
    target = build(arch, seed=0)
    ids = torch.randint(3, VOCAB, (1, 7), generator=torch.Generator().manual_seed(1))
    drafter = ModelDrafter(draft_model)
    out = specdec.generate(target, ids, drafter=drafter, draft_length=3, max_new_tokens=20, eos_token_id=None)
    assert torch.equal(out, hf_greedy(target, ids, 20, eos_token_id=None))
    assert drafter._lean is False


def test_the_probe_refuses_a_model_the_lean_loop_does_not_reproduce():
    model = build("llama", seed=1)
    # a forward hook changes what the HF modules compute; the lean loop reads weights and never sees it
    model.model.layers[0].mlp.register_forward_hook(lambda mod, inp, out: out * 1.5)
    pool = PagePool(4, 8)
    assert LeanRunner.for_model(model, pool, BlockTable(pool)) is None
    assert isinstance(LeanRunner.for_model(build("llama", seed=1), pool, BlockTable(pool)), LeanRunner)


@pytest.mark.parametrize("quantized", [False, True])
def test_model_drafter_drafts_through_the_lean_loop_and_keeps_greedy_output(monkeypatch, quantized):
    calls = []
    real = LeanRunner._run

    def spy(self, tokens, start, positions, block_pos, *a, **kw):
        calls.append(block_pos is None)
        return real(self, tokens, start, positions, block_pos, *a, **kw)

    monkeypatch.setattr(LeanRunner, "_run", spy)
    target = build("llama", seed=0, layers=3)
    draft = build("llama", seed=4, layers=1)
    draft = int8_draft(draft) if quantized else draft
    ids = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(6))
    ref = hf_greedy(target, ids, 30, eos_token_id=None)
    for kw in (dict(draft_length=4), dict(draft_length="adaptive"), dict(draft_length=6, do_sample=False)):
        drafter = ModelDrafter(draft)
        assert torch.equal(specdec.generate(target, ids, drafter=drafter, max_new_tokens=30, eos_token_id=None,
                                            **kw), ref)
        assert drafter._lean is True
    assert calls and all(calls)
    off = ModelDrafter(draft, lean=False)
    calls.clear()
    assert torch.equal(specdec.generate(target, ids, drafter=off, draft_length=4, max_new_tokens=30,
                                        eos_token_id=None), ref)
    assert not calls and not isinstance(off.runner, LeanRunner)
