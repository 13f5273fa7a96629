"""SamplingParams validation, warp_logits == HF's warpers bit for bit, and the sync-free sampler."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specdec.verifiers import SamplingParams, probs_from_scores, sample, warp_logits


def hf_warp(scores: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """What HF generate(do_sample=True) applies, built the way _get_logits_processor builds it."""
    scores = scores.float()
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k != 0:
        scores = TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1)(None, scores)
    return scores


# ----------------------------------------------------------------------------- SamplingParams


def test_defaults_are_greedy():
    params = SamplingParams()
    assert (params.do_sample, params.temperature, params.top_k, params.top_p) == (False, 1.0, 0, 1.0)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(do_sample=True, temperature=0.0), "temperature"),
        (dict(do_sample=True, temperature=-1.0), "temperature"),
        (dict(do_sample=True, temperature=float("nan")), "temperature"),
        (dict(do_sample=True, temperature=float("inf")), "temperature"),
        (dict(temperature="hot"), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=-0.1), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(do_sample="yes"), "do_sample"),
    ],
)
def test_bad_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_zero_temperature_is_allowed_for_greedy_and_params_are_frozen():
    params = SamplingParams(do_sample=False, temperature=0.0)
    with pytest.raises(Exception):
        params.temperature = 1.0  # frozen
    assert SamplingParams(do_sample=True, temperature=1).temperature == 1.0  # int coerced to float


# ----------------------------------------------------------------------------- warp_logits == HF

CASES = [
    (1.0, 0, 1.0),
    (0.7, 0, 1.0),
    (1.3, 5, 1.0),
    (1.0, 1, 1.0),
    (1.0, 0, 0.9),
    (0.5, 0, 0.3),
    (0.8, 10, 0.95),
    (2.0, 3, 0.5),
    (1.0, 1000, 0.999),  # top_k > V is clamped
    (1.0, 0, 1e-6),  # keeps exactly the top token (or its ties)
]


@pytest.mark.parametrize("temperature, top_k, top_p", CASES)
@pytest.mark.parametrize("ties", [False, True])
def test_warp_logits_matches_hf(temperature, top_k, top_p, ties):
    gen = torch.Generator().manual_seed(hash((temperature, top_k, top_p, ties)) % 2**31)
    scores = torch.randn(16, 50, generator=gen) * 3
    if ties:  # few distinct values: many ties at the top-k and top-p boundaries
        scores = torch.randint(-3, 4, (16, 50), generator=gen).float()
    params = SamplingParams(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)
    ours = warp_logits(scores, params)
    ref = hf_warp(scores, temperature, top_k, top_p)
    assert ours.dtype == torch.float32
    assert torch.equal(ours, ref)


def test_warp_logits_top_k_keeps_ties():
    scores = torch.tensor([[3.0, 1.0, 3.0, 3.0, 0.0]])
    out = warp_logits(scores, SamplingParams(do_sample=True, top_k=2))
    assert torch.isfinite(out).tolist() == [[True, False, True, True, False]]


def test_warp_logits_low_precision_input_and_1d():
    scores = (torch.randn(4, 33, generator=torch.Generator().manual_seed(1)) * 4).to(torch.bfloat16)
    params = SamplingParams(do_sample=True, temperature=0.6, top_k=7, top_p=0.8)
    assert torch.equal(warp_logits(scores, params), hf_warp(scores, 0.6, 7, 0.8))
    assert torch.equal(warp_logits(scores[2], params), hf_warp(scores[2:3], 0.6, 7, 0.8)[0])


def test_greedy_params_return_float32_scores_unchanged():
    scores = torch.randn(3, 10, dtype=torch.float16)
    out = warp_logits(scores, SamplingParams(do_sample=False, temperature=0.5, top_k=2, top_p=0.5))
    assert out.dtype == torch.float32 and torch.equal(out, scores.float())


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    vocab=st.integers(1, 40),
    temperature=st.floats(0.05, 5.0),
    top_k=st.integers(0, 45),
    top_p=st.floats(1e-3, 1.0),
    levels=st.sampled_from([0, 2, 5]),
)
def test_warp_logits_matches_hf_property(seed, vocab, temperature, top_k, top_p, levels):
    gen = torch.Generator().manual_seed(seed)
    if levels:
        scores = torch.randint(0, levels, (3, vocab), generator=gen).float()
    else:
        scores = torch.randn(3, vocab, generator=gen) * 5
    params = SamplingParams(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)
    assert torch.equal(warp_logits(scores, params), hf_warp(scores, temperature, top_k, top_p))


def test_probs_from_scores():
    scores = torch.tensor([[0.0, -float("inf"), 1.0], [2.0, 2.0, 2.0]], dtype=torch.float16)
    probs = probs_from_scores(scores)
    assert probs.dtype == torch.float32
    assert probs[0, 1] == 0
    torch.testing.assert_close(probs.sum(-1), torch.ones(2))
    torch.testing.assert_close(probs[1], torch.full((3,), 1 / 3))


# ----------------------------------------------------------------------------- sample


def test_sample_follows_probs_and_never_draws_zero_mass():
    probs = torch.tensor([0.1, 0.0, 0.4, 0.2, 0.0, 0.3])
    n = 40_000
    gen = torch.Generator().manual_seed(0)
    draws = sample(probs.expand(n, -1), gen)
    assert draws.shape == (n,) and draws.dtype == torch.int64
    counts = np.bincount(draws.numpy(), minlength=6)
    assert counts[1] == 0 and counts[4] == 0
    keep = probs.numpy() > 0
    assert chisquare(counts[keep], probs.numpy()[keep] * n).pvalue > 1e-3


def test_sample_unnormalised_weights_and_seeding():
    weights = torch.tensor([[2.0, 6.0], [0.0, 5.0]])
    draws = torch.stack([sample(weights, torch.Generator().manual_seed(s)) for s in range(4000)])
    assert (draws[:, 1] == 1).all()
    assert abs((draws[:, 0] == 1).float().mean().item() - 0.75) < 0.03
    probs = torch.rand(5, 100, generator=torch.Generator().manual_seed(3))
    a = sample(probs, torch.Generator().manual_seed(7))
    b = sample(probs.clone(), torch.Generator().manual_seed(7))
    assert a.shape == (5,) and torch.equal(a, b)
