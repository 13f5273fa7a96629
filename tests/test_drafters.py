"""Drafters that need no second model: early-exit self-speculation (the n-gram drafter has its own file)."""
import pytest
import torch

import specdec
from specdec.drafters import EarlyExit

from conftest import VOCAB, build, hf_greedy


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2", "phi3"])
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
