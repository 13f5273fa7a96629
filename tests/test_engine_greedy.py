"""Greedy speculation is lossless: output == the target's own greedy generate(), token for token."""
import zlib

import pytest
import torch

import specdec

from conftest import ARCHS, VOCAB, build, hf_greedy

NEW = 24


def prompts(n, seed=0, length=(3, 14)):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        T = int(torch.randint(length[0], length[1], (1,), generator=g))
        out.append(torch.randint(3, VOCAB, (1, T), generator=g))
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_target_for_every_drafter_and_length(arch):
    target = build(arch, seed=0)
    random_draft = build(arch, seed=1, layers=1)
    lengths = range(1, 9) if arch == "llama" else (1, 3, 8)
    stats = {}
    for ids in prompts(3, seed=zlib.crc32(arch.encode()) % 1000):  # hash(str) changes per process
        ref = hf_greedy(target, ids, NEW, eos_token_id=None)
        for name, drafter in [("self", target), ("random", random_draft), ("ngram", "ngram")]:
            for k in lengths:
                out = specdec.generate(target, ids, drafter=drafter, draft_length=k, max_new_tokens=NEW,
                                       eos_token_id=None, return_dict_in_generate=True)
                assert torch.equal(out.sequences, ref), (arch, name, k, ids.tolist())
                stats.setdefault(name, []).append(out.stats.acceptance_rate)
    # the drafters really differ: the target drafting for itself is always right
    assert min(stats["self"]) == 1.0
    assert sum(stats["random"]) / len(stats["random"]) < 0.95


def test_adaptive_and_heuristic_policies_keep_greedy_output():
    target = build("llama", seed=0)
    for ids in prompts(4, seed=5):
        ref = hf_greedy(target, ids, 40, eos_token_id=None)
        for policy in ("adaptive", "heuristic", 0):
            for drafter in (target, "ngram", build("llama", seed=3, layers=1)):
                out = specdec.generate(target, ids, drafter=drafter, draft_length=policy, max_new_tokens=40,
                                       eos_token_id=None)
                assert torch.equal(out, ref), (policy, drafter if isinstance(drafter, str) else "model")


def test_long_generation_crosses_many_pages_and_sliding_windows():
    target = build("mistral", seed=0)
    ids = prompts(1, seed=9, length=(30, 31))[0]
    ref = hf_greedy(target, ids, 90, eos_token_id=None)
    out = specdec.generate(target, ids, drafter=build("mistral", seed=4, layers=1), draft_length=5,
                           max_new_tokens=90, eos_token_id=None)
    assert torch.equal(out, ref)


def test_a_draft_in_another_dtype_changes_speed_not_output():
    target = build("llama", seed=0, layers=2, scale=2.0)
    draft = build("llama", seed=0, layers=2, scale=2.0).to(torch.bfloat16)  # the target itself, rounded to bf16
    ids = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    out = specdec.generate(target, ids, drafter=draft, draft_length=3, max_new_tokens=24, eos_token_id=None,
                           return_dict_in_generate=True)
    assert torch.equal(out.sequences, hf_greedy(target, ids, 24, eos_token_id=None))
    assert out.stats.acceptance_rate > 0.5  # bf16 rounding rarely flips the argmax
