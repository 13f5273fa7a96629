"""Sampled speculation follows the target's distribution exactly (goodness of fit on a tiny vocabulary).

The whole engine runs many seeded generations; the empirical joint distribution of the new tokens is
tested against the target's distribution, enumerated exactly with dense forwards and HF's own warpers.
The lossy `acceptance="typical"` mode must fail the same test: that shows the test has power.
"""
import itertools

import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                    TopKLogitsWarper)

import specdec

from conftest import tiny_vocab_model

V = 4
PROMPT = torch.tensor([[0, 1, 2]])
NEW = 3
TEMPERATURE, TOP_K = 0.9, 3


def tiny(seed, scale):
    return tiny_vocab_model(V, seed, scale)


def exact_joint(model):
    """P(x1..xNEW | PROMPT) under temperature + top-k, enumerated: {tuple: prob}."""
    warp = LogitsProcessorList([TemperatureLogitsWarper(TEMPERATURE), TopKLogitsWarper(TOP_K)])
    out = {}
    for seq in itertools.product(range(V), repeat=NEW):
        ids = torch.cat([PROMPT, torch.tensor([seq])], 1)
        with torch.no_grad():
            logits = model(ids).logits[0, PROMPT.shape[1] - 1:-1]
        prob = 1.0
        for i, tok in enumerate(seq):
            scores = warp(ids[:, :PROMPT.shape[1] + i], logits[i:i + 1].clone())
            prob *= torch.softmax(scores, -1)[0, tok].item()
        out[seq] = prob
    return out


def empirical(model, n, **kw):
    counts = {}
    torch.manual_seed(1234)
    for _ in range(n):
        seq = model.generate(PROMPT, max_new_tokens=NEW, do_sample=True, temperature=TEMPERATURE, top_k=TOP_K, **kw)
        key = tuple(seq[0, PROMPT.shape[1]:].tolist())
        counts[key] = counts.get(key, 0) + 1
    return counts


def gof(exact, counts, n):
    keys = [k for k, p in exact.items() if p > 0]
    assert sum(counts.get(k, 0) for k in keys) == n, "a token outside the target's support was emitted"
    obs = [counts.get(k, 0) for k in keys]
    exp = [exact[k] * n for k in keys]
    s = sum(exp)
    return chisquare(obs, [e * n / s for e in exp]).pvalue


@pytest.fixture(scope="module")
def models():
    return tiny(0, 4.0), tiny(7, 4.0)


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_engine_sampling_matches_target_distribution(models, drafter):
    target, draft = models
    exact = exact_joint(target)
    spec = specdec.wrap(target, drafter=draft if drafter == "model" else "ngram", draft_length=2)
    n = 1500  # the lossy control below fails at this n with p ~2e-15
    counts = empirical(spec, n)
    assert gof(exact, counts, n) > 1e-3
    assert spec.engine.pool.num_used == 0


def test_typical_acceptance_is_lossy_and_the_test_sees_it(models):
    target, draft = models
    exact = exact_joint(target)
    spec = specdec.wrap(target, drafter=draft, draft_length=2, acceptance="typical")
    n = 1500
    assert gof(exact, empirical(spec, n), n) < 1e-6
