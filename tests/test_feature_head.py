"""Feature heads (EAGLE family): exact output, the features the engine hands over, the paged forward
against the training unroll, loading checks, and sampling that follows the target."""
import json

import pytest
import torch

import specdec
from specdec.cache.pool import BlockTable, PagePool
from specdec.drafters import DraftSetup, FeatureHead
from specdec.drafters.head_model import HeadConfig, HeadNet
from specdec.hf.features import FeatureLog
from specdec.training.head_data import target_features
from specdec.training.head_trainer import save_head

from conftest import VOCAB, build, hf_greedy, tiny_vocab_model


def random_head(target, seed=0, fusion=False, draft_vocab=0, num_layers=1, scale=1.0, arch="eagle"):
    torch.manual_seed(seed)
    net = HeadNet(HeadConfig.for_target(target, fusion=fusion, draft_vocab=draft_vocab, num_layers=num_layers,
                                        arch=arch))
    if draft_vocab:
        net.vocab_ids.copy_(torch.randperm(net.config.vocab_size)[:draft_vocab].sort().values)
    if net.lm_head is not None:  # eagle3's own LM head: some rows of the target's, scaled (not the target's)
        with torch.no_grad():
            net.lm_head.weight.copy_(target.get_output_embeddings().weight[net.vocab_ids] * 0.5)
    with torch.no_grad():
        for p in net.parameters():
            if p.dim() >= 2:
                p.mul_(scale)
    return FeatureHead(net, target)


class Recording(FeatureHead):
    """Keeps the feature log the engine attached, to compare it with a teacher-forced forward."""

    def end(self):
        self.seen = self.features.rows(0, self.features.valid).clone()
        super().end()


KINDS = {"top": dict(fusion=False), "fusion": dict(fusion=True), "eagle3": dict(arch="eagle3")}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("kind", KINDS)
def test_head_keeps_greedy_output_chains_and_trees(arch, kind):
    target = build(arch, seed=0, layers=4)
    head = random_head(target, draft_vocab=40, **KINDS[kind])
    g = torch.Generator().manual_seed(5)
    trees = [specdec.TreeSpec.dynamic(nodes=6, depth=3, topk=2), specdec.TreeSpec.static([2, 2])]
    for _ in range(2):
        ids = torch.randint(3, VOCAB, (1, int(torch.randint(3, 12, (1,), generator=g))), generator=g)
        ref = hf_greedy(target, ids, 24, eos_token_id=None)
        for kw in [dict(draft_length=3), dict(draft_length="adaptive")] + [dict(tree=t) for t in trees]:
            out = specdec.generate(target, ids, drafter=head, max_new_tokens=24, eos_token_id=None,
                                   return_dict_in_generate=True, **kw)
            assert torch.equal(out.sequences, ref), (arch, kind, kw)
            assert out.stats.drafted_tokens > 0


@pytest.mark.parametrize("lean", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_engine_hands_the_head_the_targets_own_features(lean, kind):
    """The log after a generation holds, for every position the target ran, what a teacher-forced
    forward computes there (lean loop and HF hooks alike), so the head catches up on exactly these."""
    target = build("llama", seed=1, layers=4)
    head = Recording(random_head(target, **KINDS[kind]).net, target)
    ids = torch.randint(3, VOCAB, (1, 7), generator=torch.Generator().manual_seed(2))
    for kw in [dict(draft_length=3), dict(tree=specdec.TreeSpec.dynamic(nodes=6, depth=3, topk=2))]:
        engine = specdec.api._make_engine(target, head, **kw)
        engine.lean = lean
        seq, _ = engine.generate(ids[0], specdec.api.SamplingParams(), specdec.engine.Limits(20))
        want = target_features(target, seq, head.feature_layers)
        got = head.seen
        assert got.shape[0] == seq.numel() - 1  # every position but the last token's (never run)
        torch.testing.assert_close(got, want[:-1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["torch", "layer kernel"])
@pytest.mark.parametrize("kind", ["top", "eagle3"])
def test_paged_forward_equals_the_training_unroll(kind, path, monkeypatch):
    """The drafter's catch-up and draft steps over pages compute what HeadNet.unroll trains: step 1 on
    true features, step 2 on the head's own predicted feature (eagle3: its pre-norm hidden); through the
    torch modules and through the CPU layer kernel (drafters/head_forward.py) alike."""
    from specdec.drafters import head_forward
    from specdec.kernels import cpu_library

    calls = []
    if path == "torch":
        monkeypatch.setenv("SPECDEC_HEAD_KERNEL", "0")
    elif not cpu_library.cpu_supports():
        pytest.skip("the layer kernel needs an x86 CPU with AVX2 and FMA")
    real = head_forward.cpu_layer.decoder_layer
    monkeypatch.setattr(head_forward.cpu_layer, "decoder_layer", lambda *a, **k: calls.append(1) or real(*a, **k))
    target = build("llama", seed=2, layers=3 if kind == "top" else 4)
    head = random_head(target, seed=3, draft_vocab=30, **KINDS[kind])
    seq = torch.randint(3, VOCAB, (20,), generator=torch.Generator().manual_seed(4))
    f = target_features(target, seq, head.feature_layers)
    with torch.no_grad():
        outs = head.net.unroll(f[None, :-1], seq[None, 1:], 2)
        log = FeatureLog()
        log.write(0, f[:15])
        table = BlockTable(PagePool(8, 4))
        head.attach(log)
        head.begin(DraftSetup(table, seq[:10]))
        feat, scores = head._catch_up(seq[:16])  # entries 0..14; the last predicts position 15's feature
        torch.testing.assert_close(feat[0], outs[0][0, 14], rtol=1e-5, atol=1e-5)
        sub = head.net.logits(outs[0][0, 14])
        assert int(scores.argmax()) == int(head.net.vocab_ids[sub.argmax()])
        assert torch.isinf(scores).sum() == VOCAB - 30  # tokens outside the draft vocabulary: never drafted
        # step 2 at position 15: its own predicted feature with the true token 16 (as training-time test)
        pos = torch.tensor([15])
        table.reserve(16)
        slots = table.slots(0, 16)
        out = head._run(feat, seq[16:17], pos, slots[-1:], slots, None)
        torch.testing.assert_close(out[0], outs[1][0, 15], rtol=1e-5, atol=1e-5)
        table.release()
    assert bool(calls) == (path == "layer kernel")  # which path ran the layers


def test_from_pretrained_round_trip_and_refusals(tmp_path):
    target = build("llama", seed=0, layers=4)
    head = random_head(target, draft_vocab=40)
    save_head(head.net, tmp_path / "h")
    loaded = FeatureHead.from_pretrained(tmp_path / "h", target)
    assert torch.equal(loaded.net.vocab_ids, head.net.vocab_ids)
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    a = specdec.generate(target, ids, drafter=loaded, draft_length=3, max_new_tokens=12, eos_token_id=None)
    assert torch.equal(a, hf_greedy(target, ids, 12, eos_token_id=None))
    with pytest.raises(ValueError, match="trained for another target: layers 4"):
        FeatureHead.from_pretrained(tmp_path / "h", build("llama", seed=0, layers=3))
    with pytest.raises(ValueError, match="architecture LlamaForCausalLM"):
        FeatureHead.from_pretrained(tmp_path / "h", build("qwen2", seed=0, layers=4))
    with pytest.raises(ValueError, match="weights fingerprint"):
        FeatureHead.from_pretrained(tmp_path / "h", build("llama", seed=9, layers=4))
    with pytest.raises(ValueError, match="not a feature head folder"):
        FeatureHead.from_pretrained(tmp_path, target)
    with pytest.raises(FileExistsError, match="exists"):
        save_head(head.net, tmp_path / "h")
    cfg = json.loads((tmp_path / "h" / "head_config.json").read_text())
    assert cfg["target_architecture"] == "LlamaForCausalLM" and cfg["draft_vocab"] == 40


def test_no_pages_leak_and_chat_keeps_the_heads_entries():
    target = build("llama", seed=0, layers=4)
    head = random_head(target)
    spec = specdec.wrap(target, drafter=head, draft_length=3, keep_cache=True)
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(1))
    first = spec.generate(ids, max_new_tokens=10, eos_token_id=None)
    more = torch.cat([first, torch.tensor([[5, 6, 7]])], 1)
    second = spec.generate(more, max_new_tokens=10, eos_token_id=None)
    assert torch.equal(second, hf_greedy(target, more, 10, eos_token_id=None))
    spec.engine.release_cache()
    assert spec.engine.pool.num_used == 0


# -- sampling: the head's q is its distribution over the draft vocabulary, zero elsewhere ------------------
V = 5


class ForgetsTheSubset(FeatureHead):
    """Lossy on purpose: drafts from its draft vocabulary but reports q over the whole vocabulary (the
    head's unrestricted distribution), the mistake a reduced vocabulary invites."""

    unrestricted: list = []

    def full_scores(self, feat):
        self.unrestricted = self.unrestricted + [torch.nn.functional.linear(feat, self.target.lm_head.weight).float()]
        return super().full_scores(feat)

    def propose(self, ctx, budget):
        from specdec.verifiers.sampling import probs_from_scores

        self.unrestricted = []
        draft = super().propose(ctx, budget)
        if draft.q_probs is not None:
            toks = draft.tokens.tolist()
            draft.q_probs = torch.cat([probs_from_scores(ctx.process(s, ctx.tokens, [toks[:i]]))
                                       for i, s in enumerate(self.unrestricted[:len(toks)])])
        return draft


def _joint(target):
    import itertools

    from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                        TopKLogitsWarper)

    warp = LogitsProcessorList([TemperatureLogitsWarper(0.9), TopKLogitsWarper(4)])
    prompt = torch.tensor([[0, 1, 2]])
    out = {}
    for seq in itertools.product(range(V), repeat=3):
        ids = torch.cat([prompt, torch.tensor([seq])], 1)
        with torch.no_grad():
            logits = target(ids).logits[0, 2:-1]
        prob = 1.0
        for i, tok in enumerate(seq):
            prob *= torch.softmax(warp(ids[:, :3 + i], logits[i:i + 1].clone()), -1)[0, tok].item()
        out[seq] = prob
    return out


def _counts(spec, n):
    counts = {}
    torch.manual_seed(99)
    prompt = torch.tensor([[0, 1, 2]])
    for _ in range(n):
        seq = spec.generate(prompt, max_new_tokens=3, do_sample=True, temperature=0.9, top_k=4)
        key = tuple(seq[0, 3:].tolist())
        counts[key] = counts.get(key, 0) + 1
    return counts


def _pvalue(exact, counts, n):
    from scipy.stats import chisquare

    keys = [k for k, p in exact.items() if p > 0]
    assert sum(counts.get(k, 0) for k in keys) == n
    exp = [exact[k] * n for k in keys]
    s = sum(exp)
    return chisquare([counts.get(k, 0) for k in keys], [e * n / s for e in exp]).pvalue


@pytest.mark.parametrize("lossy,tree", [(False, None), (False, specdec.TreeSpec.dynamic(nodes=4, depth=2, topk=2)),
                                        (True, None)])
def test_sampling_with_a_reduced_vocabulary_head_follows_the_target(lossy, tree):
    target = tiny_vocab_model(V, seed=0, scale=4.0)
    cls = ForgetsTheSubset if lossy else FeatureHead
    head = cls(random_head(target, seed=1, draft_vocab=3, scale=3.0).net, target)
    exact = _joint(target)
    n = 1500  # the lossy control's p-value at this n: ~1e-77
    p = _pvalue(exact, _counts(specdec.wrap(target, drafter=head, draft_length=2 if tree is None else "adaptive", tree=tree), n), n)
    if lossy:
        assert p < 1e-6  # the test has the power to see a wrong q
    else:
        assert p > 1e-3


# -- batches: every row's chain in one head forward per draft step ----------------------------------------
def _left_padded_zoo(n):
    target, tok = specdec.zoo.load("target")
    tok.padding_side = "left"
    texts = specdec.zoo.prompts(n)
    return target, tok, texts, tok(texts, return_tensors="pt", padding=True)


@pytest.mark.parametrize("kw", [dict(draft_length=4), dict(tree=specdec.TreeSpec.dynamic(nodes=8, depth=4, topk=2))],
                         ids=["chains", "trees"])
def test_a_shipped_head_drafts_a_batch_and_every_row_keeps_its_own_greedy_output(monkeypatch, kw):
    """The zoo's trained head over 4 left-padded prompts: each row equals its own HF greedy generation,
    the head's drafts are accepted, and every drafting row is drafted in one head forward per draft
    position (the catch-up, then each further chain token or tree depth), not one per row."""
    import specdec.drafters.head_rows as head_rows

    target, tok, texts, enc = _left_padded_zoo(4)
    head = FeatureHead.from_pretrained(specdec.zoo.path("target-head"), target)
    calls = []
    run = head_rows.run_head
    monkeypatch.setattr(head_rows, "run_head", lambda *a: calls.append(a[2].shape[0]) or run(*a))
    out = specdec.generate(target, enc.input_ids, attention_mask=enc.attention_mask, drafter=head,
                           max_new_tokens=24, eos_token_id=None, return_dict_in_generate=True, **kw)
    for i, text in enumerate(texts):
        ids = tok(text, return_tensors="pt").input_ids
        want = target.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None)[0, ids.shape[1]:]
        assert torch.equal(out.sequences[i, enc.input_ids.shape[1]:], want), i
    assert all(s.accepted_tokens > 0 for s in out.stats)
    # per step one catch-up (the first: every row's whole prompt) and at most 3 more forwards for all rows
    steps = out.batch_stats.target_forwards
    assert calls and calls[0] > 4 and len(calls) <= 4 * steps


@pytest.mark.parametrize("arch", ["llama", "gemma2"], ids=["lean loop", "HF modules"])
def test_a_batch_hands_every_rows_head_that_rows_own_features(monkeypatch, arch):
    """Each row's FeatureLog after a batch holds what a teacher-forced forward of that row alone computes
    at every position the target ran, from the packed forwards (lean loop and HF hooks)."""
    import specdec.drafters.head_rows as head_rows
    from test_batches import left_padded
    from test_engine_greedy import prompts

    target = build(arch, seed=1, layers=4)
    head = random_head(target)
    seen = []
    end = head_rows.HeadRows.end
    monkeypatch.setattr(head_rows.HeadRows, "end",
                        lambda self: seen.extend(f.rows(0, f.valid).clone() for f in self.features) or end(self))
    rows = prompts(4, seed=3, length=(3, 12))
    ids, mask = left_padded(rows)
    out = specdec.generate(target, ids, attention_mask=mask, drafter=head, draft_length=3, max_new_tokens=10,
                           eos_token_id=None)
    assert len(seen) == len(rows)
    for row, got, seq in zip(rows, seen, out):
        full = torch.cat([row[0], seq[ids.shape[1]:]])
        want = target_features(target, full, head.feature_layers)
        assert got.shape[0] == full.numel() - 1
        torch.testing.assert_close(got, want[:-1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lossy", [False, True], ids=["exact", "draws argmax, reports q (control)"])
def test_sampling_a_batch_with_a_head_follows_the_target(monkeypatch, lossy):
    """Two rows of the same prompt drafted by HeadRows: every row's tokens fit the target's joint
    distribution; a variant whose head picks its argmax but reports its sampled q fails."""
    import specdec.drafters.model_rows as model_rows  # the batched pick HeadRows and ModelRows share

    target = tiny_vocab_model(V, seed=0, scale=4.0)
    head = FeatureHead(random_head(target, seed=1, draft_vocab=3, scale=3.0).net, target)
    if lossy:
        monkeypatch.setattr(model_rows, "sample", lambda q, generator=None: q.argmax(-1))
    exact = _joint(target)
    spec = specdec.wrap(target, drafter=head, draft_length=2)
    prompt = torch.tensor([[0, 1, 2]]).repeat(2, 1)
    n = 500 if lossy else 1200
    counts = {}
    torch.manual_seed(98)
    for _ in range(n):
        seq = spec.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=True,
                            temperature=0.9, top_k=4)
        for row in seq:
            key = tuple(row[3:].tolist())
            counts[key] = counts.get(key, 0) + 1
    p = _pvalue(exact, counts, 2 * n)
    if lossy:
        assert p < 1e-6
    else:
        assert p > 1e-3
