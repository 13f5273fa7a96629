"""Sequence-dependent processors (repetition_penalty, no_repeat_ngram_size, ...) and the later warpers
(min_p, typical_p, epsilon, eta) are applied losslessly: every verification and draft row is processed
with its own prefix, as a plain decode would process that position."""
import pytest
import torch

import specdec

from conftest import VOCAB, build, hf_greedy, tiny_vocab_model

CASES = {
    "repetition_penalty": dict(repetition_penalty=1.8),
    "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
    "bad_words_ids": dict(bad_words_ids=[[5], [7, 8]]),
    "sequence_bias": dict(sequence_bias={(9,): 4.0, (10, 11): -3.0}),
    "suppress_tokens": dict(suppress_tokens=[4, 12]),
    "begin_suppress_tokens": dict(begin_suppress_tokens=[13, 14]),
    "all at once": dict(repetition_penalty=1.3, no_repeat_ngram_size=3, suppress_tokens=[4]),
}


@pytest.fixture(scope="module")
def models():
    return build("llama", seed=0, scale=3.0), build("llama", seed=3, scale=3.0)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_with_sequence_dependent_processors_equals_hf(models, case):
    target, draft = models
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        ids = torch.randint(3, VOCAB, (1, 6), generator=g)
        ref = hf_greedy(target, ids, 24, eos_token_id=None, **CASES[case])
        for kw in (dict(drafter="ngram", draft_length=3), dict(drafter=draft, draft_length=4), dict(drafter=target),
                   dict(drafter=draft, tree=specdec.TreeSpec.dynamic(nodes=6, depth=3, topk=2))):
            out = specdec.generate(target, ids, max_new_tokens=24, eos_token_id=None, **CASES[case], **kw)
            assert torch.equal(out, ref), (case, kw)


def test_stop_strings_need_the_tokenizer_and_stop_where_hf_stops():
    target, tok = specdec.zoo.load("target")
    ids = tok(specdec.zoo.prompts(1)[0], return_tensors="pt").input_ids
    plain = target.generate(ids, max_new_tokens=40, do_sample=False)
    text = tok.decode(plain[0, ids.shape[1]:])
    stop = text.strip().split()[2]  # a word the continuation reaches
    ref = target.generate(ids, max_new_tokens=40, do_sample=False, stop_strings=[stop], tokenizer=tok)
    out = specdec.generate(target, ids, drafter="ngram", max_new_tokens=40, stop_strings=[stop], tokenizer=tok)
    assert torch.equal(out, ref) and out.shape[1] < plain.shape[1]
    with pytest.raises(ValueError, match="needs the tokenizer"):
        specdec.generate(target, ids, max_new_tokens=5, stop_strings=["x"])


# -- sampling: goodness of fit with a prefix-dependent processor and top-p ----------------------------------
V, NEW = 4, 3
PROMPT = torch.tensor([[0]])  # tokens 1-3 are penalised only once generated: the draft path matters
KW = dict(do_sample=True, temperature=0.9, top_p=0.95, repetition_penalty=2.0)


def _exact(target):
    import itertools

    out = {}
    for seq in itertools.product(range(V), repeat=NEW):
        prob = 1.0
        for i, tok in enumerate(seq):
            prefix = torch.cat([PROMPT, torch.tensor([seq[:i]], dtype=torch.long)], 1)
            with torch.no_grad():
                scores = target(prefix).logits[:, -1].float()
            # HF's processing of this position: repetition penalty over the prefix, then the warpers
            from transformers import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                      TopPLogitsWarper)

            lp = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(2.0), TemperatureLogitsWarper(0.9),
                                      TopPLogitsWarper(0.95)])
            prob *= torch.softmax(lp(prefix, scores), -1)[0, tok].item()
        out[seq] = prob
    return out


class WrongPrefix(specdec.processing.LogitsPipeline):
    """Lossy on purpose: every row is processed with the committed context only (its draft path ignored)."""

    def __call__(self, scores, context, paths):
        return super().__call__(scores, context, [[] for _ in paths])


def _pvalue(spec, exact, n, **kw):
    from scipy.stats import chisquare

    counts = {}
    torch.manual_seed(7)
    for _ in range(n):
        seq = spec.generate(PROMPT, max_new_tokens=NEW, **KW, **kw)
        key = tuple(seq[0, PROMPT.shape[1]:].tolist())
        counts[key] = counts.get(key, 0) + 1
    keys = [k for k, p in exact.items() if p > 0]
    if sum(counts.get(k, 0) for k in keys) != n:
        return 0.0  # a sequence the target can never produce (top-p excludes it) came out
    exp = [exact[k] * n for k in keys]
    s = sum(exp)
    return chisquare([counts.get(k, 0) for k in keys], [e * n / s for e in exp]).pvalue


@pytest.mark.parametrize("shape, lossy", [("chain", False), ("tree", False), ("chain", True)],
                         ids=["chain", "tree", "wrong prefix (control)"])
def test_sampling_with_repetition_penalty_follows_the_target(shape, lossy, monkeypatch):
    # the target drafts for itself: its drafts are mostly accepted, so later rows' processing decides tokens
    target = tiny_vocab_model(V, 0, 8.0)
    draft = target
    if lossy:
        monkeypatch.setattr(specdec.engine, "LogitsPipeline", WrongPrefix)
    tree = specdec.TreeSpec.static([3, 2]) if shape == "tree" else None
    spec = specdec.wrap(target, drafter=draft, draft_length=2 if tree is None else "adaptive", tree=tree)
    p = _pvalue(spec, _exact(target), 1500)  # the control's p-value at this n underflows to 0
    assert (p < 1e-6) if lossy else (p > 1e-3)


@pytest.mark.parametrize("kw", [dict(min_p=0.1), dict(typical_p=0.8), dict(epsilon_cutoff=3e-2), dict(eta_cutoff=3e-2),
                                dict(repetition_penalty=1.5, top_k=5, top_p=0.9, min_p=0.05)])
def test_the_pipeline_processes_scores_exactly_as_hfs_processor_list(models, kw):
    """specdec's processing of one row (HF's processors from the config, its own temperature / top-k / top-p,
    then the later warpers) equals HF's whole processor list for the same config, element for element."""
    from specdec.generation_config import config_processors, limits_and_sampling, resolve_config
    from specdec.processing import LogitsPipeline

    target, _ = models
    cfg = resolve_config(target, None, {"do_sample": True, "temperature": 0.8, "top_k": 0, "max_new_tokens": 10,
                                            "eos_token_id": None, **kw})[0]
    ids = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    scores = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3)) * 3
    target._prepare_special_tokens(cfg, True, device="cpu")
    want = target._get_logits_processor(cfg, 5, device="cpu")(ids, scores.clone())
    _, sampling = limits_and_sampling(cfg, 5, None, target, False)
    before, after = config_processors(target, cfg, 5, None, "cpu")
    got = LogitsPipeline(sampling, 5, 0, [], before, after)(scores.clone(), ids[0, :7], [ids[0, 7:].tolist()])
    assert torch.equal(got, want)
