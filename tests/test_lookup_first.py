"""LookupFirst: prompt lookup where the context repeats itself, another drafter elsewhere. Exact output
(greedy and sampled), which source proposes when, the per-source plans of the adaptive policy, what
the wrapped drafter brings through, and its refusals."""

import pytest
import torch

import specdec
from specdec.drafters import Draft, DraftContext, DraftSetup, FeatureHead, ModelDrafter, PromptLookup
from specdec.drafters.lookup_first import LookupFirst
from specdec.policy import AdaptivePolicy
from specdec.verifiers.sampling import SamplingParams

from conftest import VOCAB, build, hf_greedy, tiny_vocab_model


class Scripted:
    """A drafter that proposes [90, 91, ...] and records what it is asked and told."""

    def __init__(self):
        self.proposed, self.accepted = [], []

    def begin(self, setup):
        pass

    def propose(self, ctx, budget):
        self.proposed.append(ctx.tokens.tolist())
        return Draft.from_lists([90 + i for i in range(budget)], None, ctx.tokens.device)

    def accept(self, n):
        self.accepted.append(n)

    def end(self):
        pass


def _ctx(tokens):
    return DraftContext(tokens=torch.tensor(tokens), sampling=SamplingParams())


def test_the_lookup_proposes_where_the_context_repeats_and_the_drafter_elsewhere():
    inner = Scripted()
    drafter = LookupFirst(inner, min_match=2)
    drafter.begin(DraftSetup(table=None, prompt=torch.tensor([5, 6, 7, 8, 9])))
    # "8 9" never occurred before (only "9" alone would match nothing either): the drafter proposes
    assert drafter.source(torch.tensor([5, 6, 7, 8, 9])) == "drafter"
    assert drafter.propose(_ctx([5, 6, 7, 8, 9]), 3).host.tokens == [90, 91, 92]
    drafter.accept(7)
    # the context now ends in "5 6", seen before: the lookup copies what followed it; the drafter is not asked
    assert drafter.source(torch.tensor([5, 6, 7, 8, 9, 5, 6])) == "lookup"
    assert drafter.propose(_ctx([5, 6, 7, 8, 9, 5, 6]), 3).host.tokens == [7, 8, 9]
    assert len(inner.proposed) == 1
    drafter.accept(9)
    # a 1-token match ("6") is below min_match 2: the drafter again; with min_match 1 the lookup
    ctx = [5, 6, 7, 8, 9, 5, 6, 7, 6]
    assert drafter.propose(_ctx(ctx), 2).host.tokens == [90, 91]
    assert inner.accepted == [7, 9]  # told every accepted length, also after the lookup's steps
    loose = LookupFirst(Scripted(), min_match=1)
    loose.begin(DraftSetup(table=None, prompt=torch.tensor(ctx)))
    assert loose.propose(_ctx(ctx), 2).host.tokens == [7, 6]


def test_a_drafters_chain_is_continued_by_the_lookup_where_its_end_matches():
    """The drafter's chain [90, 91] makes the text end in "90 91", seen before: the lookup continues it
    with what followed then, as free tokens (Draft.free_from) up to the step's room; not without room,
    not with extend=False (the default), not for a sampled chain (its q rows stay its own)."""
    prompt = [5, 90, 91, 92, 93, 94, 95, 6, 7, 8]
    for extend, room, want in ((True, 6, [90, 91, 92, 93, 94, 95]), (True, 4, [90, 91, 92, 93]),
                               (True, 2, [90, 91]), (True, 0, [90, 91]), (False, 6, [90, 91]), (None, 6, [90, 91])):
        drafter = LookupFirst(Scripted(), min_match=2, **({} if extend is None else dict(extend=extend)))
        drafter.begin(DraftSetup(table=None, prompt=torch.tensor(prompt)))
        ctx = DraftContext(tokens=torch.tensor(prompt), sampling=SamplingParams(), room=room)
        draft = drafter.propose(ctx, 2)
        assert draft.host.tokens == want and draft.tokens.tolist() == want, (extend, room)
        assert draft.free_from == (2 if len(want) > 2 else None) and drafter.extensions == (len(want) > 2)
    no_match = LookupFirst(Scripted(), min_match=2, extend=True)
    no_match.begin(DraftSetup(table=None, prompt=torch.tensor([5, 6, 7, 8])))
    assert no_match.propose(DraftContext(tokens=torch.tensor([5, 6, 7, 8]), sampling=SamplingParams(), room=6),
                            2).host.tokens == [90, 91]

    class Sampled(Scripted):
        def propose(self, ctx, budget):
            draft = super().propose(ctx, budget)
            draft.q_probs = torch.full((budget, 100), 0.01)
            return draft

    sampled = LookupFirst(Sampled(), min_match=2, extend=True)
    sampled.begin(DraftSetup(table=None, prompt=torch.tensor(prompt)))
    draft = sampled.propose(DraftContext(tokens=torch.tensor(prompt), sampling=SamplingParams(), room=6), 2)
    assert len(draft) == 2 and draft.free_from is None


def test_tokens_past_the_budget_must_be_free_deterministic_and_within_room():
    from specdec.drafters.base import check_draft

    def chain(n, free_from=None, q=False):
        d = Draft.from_lists(list(range(n)), None, None, q_probs=torch.full((n, 10), 0.1) if q else None)
        d.free_from = free_from
        return d

    assert check_draft("d", chain(5, free_from=2), 2, 10, room=6)[0] == [0, 1, 2, 3, 4]
    for draft, room, match in ((chain(5), 6, "budget was 2$"), (chain(5, free_from=2), 4, "room 4"),
                               (chain(5, free_from=3), 6, "free from 3"), (chain(5, free_from=2, q=True), 6, "free from 2")):
        with pytest.raises(ValueError, match=match):
            check_draft("d", draft, 2, 10, room=room)


def test_the_engine_verifies_the_free_tokens_and_plans_from_the_drafters_own():
    """Adaptive (room up to max_draft_length, a plan of 3), every step the drafter's (an oracle of the target's greedy
    text; the lookup only continues its chains): the target's greedy output, chains continued by the
    lookup, and the policy told only the drafted part of each step: what it saw plus the free tokens is
    what the stats count as drafted."""
    from specdec.policy.adaptive import AdaptivePolicy as Adaptive

    target = build("llama", seed=0, layers=3, scale=2.0)
    base = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(4))
    ref = hf_greedy(target, base, 40, eos_token_id=None)  # the random target falls into a loop: matches

    class Oracle(Scripted):
        def propose(self, ctx, budget):
            n = ctx.tokens.numel()
            return Draft.from_lists(ref[0, n:n + budget].tolist(), None, ctx.tokens.device)

    class ExtendOnly(LookupFirst):
        free = 0

        def lookup_serves(self, lookup, tokens, budget):
            return False

        def extended(self, ctx, draft):
            out = super().extended(ctx, draft)
            self.free += len(out) - len(draft)
            return out

    drafter = ExtendOnly(Oracle(), extend=True)
    seen = []
    observe = Adaptive.observe

    def spy(self, k, n, *args, **kwargs):
        seen.append(k)
        return observe(self, k, n, *args, **kwargs)

    plan = Adaptive.next_length
    Adaptive.observe = spy
    # the plan is fixed short of the room (8): the adaptive plan follows measured timings, and one that
    # reached the room under load left no place for free tokens (the test failed once that way)
    Adaptive.next_length = lambda self: 3
    try:
        out = specdec.wrap(target, drafter=drafter).generate(base, max_new_tokens=40, eos_token_id=None,
                                                             do_sample=False, return_dict_in_generate=True)
    finally:
        Adaptive.observe, Adaptive.next_length = observe, plan
    assert torch.equal(out.sequences, ref)
    assert drafter.extensions > 0 and drafter.free > 0 and drafter.lookup_steps == 0
    assert seen and max(seen) <= 3 and sum(seen) + drafter.free == out.stats.drafted_tokens


@pytest.mark.parametrize("inner", ["model", "head", "early exit"])
def test_greedy_output_equals_the_targets_own(inner):
    """Chains at a fixed k and adaptive, dynamic trees: the target's own greedy output, with both sources
    proposing in the same generations (a repetitive prompt makes the lookup match)."""
    target = build("llama", seed=0, layers=3, scale=2.0)
    if inner == "model":
        wrapped = ModelDrafter(build("llama", seed=0, layers=1, scale=2.0))
    elif inner == "early exit":  # its KV shared with the target's pages: a lookup step verifies every layer
        from specdec.drafters import EarlyExit

        wrapped = EarlyExit(target, exit_layer=2)
    else:
        from test_feature_head import random_head

        wrapped = random_head(target)
    drafter = LookupFirst(wrapped)
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        base = torch.randint(3, VOCAB, (1, 6), generator=g)
        ids = torch.cat([base, base, base[:, :3]], 1)  # repeats: the lookup has matches from the start
        ref = hf_greedy(target, ids, 30, eos_token_id=None)
        for kw in [dict(draft_length=3), dict(draft_length="adaptive"),
                   dict(tree=specdec.TreeSpec.dynamic(nodes=6, depth=3, topk=2))]:
            spec = specdec.wrap(target, drafter=drafter, **kw)
            out = spec.generate(ids, max_new_tokens=30, eos_token_id=None, do_sample=False)
            assert torch.equal(out, ref), kw
            assert spec.engine.pool.num_used == 0
    assert drafter.lookup_steps > 0 and drafter.drafter_steps > 0


def test_each_source_plans_its_own_length():
    """for_source: a cheap, well-accepted lookup plans long drafts while a dearer, poorly accepted model
    plans short ones; both price the target's forwards from one set of timings, and the parent's tracker
    (what stats report) sees every step."""
    policy = AdaptivePolicy(max_length=8)
    lookup, model = policy.for_source("lookup"), policy.for_source("drafter")
    assert policy.for_source("lookup") is lookup and lookup is not model
    for _ in range(30):
        lookup.observe(6, 6, 0.0001, 0.012)
        model.observe(2, 0, 0.004, 0.011)
        model.observe(1, 0, 0.002, 0.0105)
        lookup.observe(0, 0, 0.0, 0.010)
    assert lookup.next_length() >= 6
    assert model.next_length() <= 1
    assert lookup.costs.t_verify(3) == model.costs.t_verify(3) == policy.costs.t_verify(3)
    assert lookup.costs.t_draft < model.costs.t_draft
    assert policy.tracker.steps == lookup.tracker.steps + model.tracker.steps
    # one plan over the same mix of steps plans the model's short drafts for the lookup too
    mixed = AdaptivePolicy(max_length=8)
    for _ in range(30):
        mixed.observe(6, 6, 0.0001, 0.012)
        mixed.observe(2, 0, 0.004, 0.011)
        mixed.observe(1, 0, 0.002, 0.0105)
        mixed.observe(0, 0, 0.0, 0.010)
    assert mixed.next_length() < lookup.next_length()


def test_the_engine_plans_each_source_with_its_own_policy():
    target = build("llama", seed=0, layers=3, scale=2.0)
    drafter = LookupFirst(ModelDrafter(build("llama", seed=0, layers=1, scale=2.0)))
    spec = specdec.wrap(target, drafter=drafter)
    base = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(4))
    out = spec.generate(torch.cat([base, base], 1), max_new_tokens=30, eos_token_id=None, do_sample=False,
                        return_dict_in_generate=True)
    plans = spec.engine.policy._sources
    assert set(plans) == {"lookup", "drafter"}
    # every step was planned by one of them; the stats report the parent's tracker, which saw them all
    assert plans["lookup"].tracker.steps > 0 and plans["drafter"].tracker.steps > 0
    assert out.stats.tracker["steps"] == plans["lookup"].tracker.steps + plans["drafter"].tracker.steps
    # a constant k has no per-source plans: both sources draft k
    fixed = specdec.wrap(target, drafter=drafter, draft_length=2)
    fixed.generate(torch.cat([base, base], 1), max_new_tokens=10, eos_token_id=None, do_sample=False)


def test_chat_turns_keep_the_heads_entries_and_leak_no_pages():
    """keep_cache (chat): the second turn prefills only what follows the kept prefix; the lookup re-reads
    the conversation and the head keeps its entries; the output is the target's own greedy one."""
    from test_feature_head import random_head

    target = build("llama", seed=0, layers=3, scale=2.0)
    drafter = LookupFirst(random_head(target))
    spec = specdec.wrap(target, drafter=drafter, keep_cache=True)
    base = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(6))
    first = spec.generate(torch.cat([base, base], 1), max_new_tokens=12, eos_token_id=None, do_sample=False)
    more = torch.cat([first, base[:, :3]], 1)
    second = spec.generate(more, max_new_tokens=12, eos_token_id=None, do_sample=False)
    assert torch.equal(second, hf_greedy(target, more, 12, eos_token_id=None))
    assert drafter.lookup_steps > 0
    spec.engine.release_cache()
    assert spec.engine.pool.num_used == 0


V = 4


class ClaimsUniformQ(LookupFirst):
    """The control: the lookup's proposals claim a uniform q instead of their one-hot q."""

    def propose(self, ctx, budget):
        draft = super().propose(ctx, budget)
        if draft.q_probs is None and len(draft):
            draft.q_probs = torch.full((len(draft), V), 1.0 / V)
        return draft


@pytest.mark.parametrize("lossy", [False, True], ids=["exact", "lookup claims a uniform q (control)"])
def test_sampling_follows_the_target(lossy):
    """min_match 1 on a 4-token vocabulary: the lookup and the draft model take turns within generations;
    the joint distribution of the new tokens fits the target's (test_engine_sampling's harness)."""
    from test_engine_sampling import empirical, exact_joint, gof

    target, draft = tiny_vocab_model(V, seed=0, scale=4.0), tiny_vocab_model(V, seed=7, scale=4.0)
    drafter = (ClaimsUniformQ if lossy else LookupFirst)(ModelDrafter(draft), min_match=1)
    n = 800 if lossy else 1500
    p = gof(exact_joint(target), empirical(specdec.wrap(target, drafter=drafter, draft_length=2), n), n)
    assert drafter.lookup_steps > 100 and drafter.drafter_steps > 100
    if lossy:
        assert p < 1e-6
    else:
        assert p > 1e-3


def test_what_the_wrapped_drafter_brings_passes_through():
    target = build("llama", seed=0, layers=3)
    model = build("llama", seed=1, layers=1)
    assert LookupFirst(ModelDrafter(model)).model is model
    from test_feature_head import random_head

    head = random_head(target, fusion=True)
    wrapped = LookupFirst(head)
    assert wrapped.feature_layers == head.feature_layers and wrapped.model is None
    row = wrapped.for_row()
    assert isinstance(row, LookupFirst) and row.drafter is not head and row.lookup is not wrapped.lookup
    other = build("llama", seed=1, layers=1)
    other.resize_token_embeddings(VOCAB + 5)
    with pytest.raises(ValueError, match="vocabulary size"):
        specdec.generate(target, torch.tensor([[3, 4, 5]]), drafter=LookupFirst(ModelDrafter(other)), max_new_tokens=4)


def test_a_batch_keeps_every_rows_greedy_output():
    from test_batches import left_padded
    from test_engine_greedy import prompts

    target = build("llama", seed=0, layers=3, scale=2.0)
    drafter = LookupFirst(ModelDrafter(build("llama", seed=0, layers=1, scale=2.0)))
    rows = [torch.cat([r, r], 1) for r in prompts(3, seed=5, length=(3, 8))]
    ids, mask = left_padded(rows)
    out = specdec.generate(target, ids, attention_mask=mask, drafter=drafter, draft_length=3, max_new_tokens=16,
                           eos_token_id=None)
    for i, r in enumerate(rows):
        want = hf_greedy(target, r, 16, eos_token_id=None)[0, r.shape[1]:]
        assert torch.equal(out[i, ids.shape[1]:], want), i


@pytest.mark.parametrize("kw", [dict(draft_length=3), dict(tree=specdec.TreeSpec.dynamic(nodes=6, depth=3, topk=2))],
                         ids=["chains", "trees"])
def test_a_batch_drafts_the_rows_without_a_match_together(monkeypatch, kw):
    """The zoo's head behind the lookup over 4 left-padded prompts: every row keeps its own greedy
    output, both sources propose, and the head drafts the rows the lookup leaves in shared forwards."""
    import specdec.drafters.head_rows as head_rows
    from specdec.drafters.lookup_first import LookupFirstRows

    target, tok = specdec.zoo.load("target")
    tok.padding_side = "left"
    texts = specdec.zoo.prompts(4)
    enc = tok(texts, return_tensors="pt", padding=True)
    drafter = LookupFirst(FeatureHead.from_pretrained(specdec.zoo.path("target-head"), target))
    assert isinstance(drafter.for_batch(None), LookupFirstRows)
    rows_per_call = []  # how many rows the head was asked to draft at once
    for name in ("propose", "propose_trees"):
        method = getattr(head_rows.HeadRows, name)
        monkeypatch.setattr(head_rows.HeadRows, name,
                            lambda self, requests, method=method: rows_per_call.append(len(requests)) or method(self, requests))
    out = specdec.generate(target, enc.input_ids, attention_mask=enc.attention_mask, drafter=drafter,
                           max_new_tokens=32, eos_token_id=None, **kw)
    for i, text in enumerate(texts):
        ids = tok(text, return_tensors="pt").input_ids
        want = target.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None)[0, ids.shape[1]:]
        assert torch.equal(out[i, enc.input_ids.shape[1]:], want), i
    assert drafter.lookup_steps > 0 and drafter.drafter_steps > 0
    assert max(rows_per_call) > 1 and sum(rows_per_call) == drafter.drafter_steps


@pytest.mark.parametrize("bad,match", [(lambda: PromptLookup(), "other than a lookup"),
                                       (lambda: "ngram", "other than a lookup"),
                                       (lambda: LookupFirst(Scripted()), "other than a lookup")])
def test_refuses_a_lookup_to_wrap(bad, match):
    with pytest.raises(ValueError, match=match):
        LookupFirst(bad())


@pytest.mark.parametrize("kw", [dict(min_match=0), dict(min_match=2.0), dict(min_match=True),
                                dict(min_match=4, lookup=PromptLookup(max_n=3))])
def test_refuses_a_min_match_the_lookup_cannot_find(kw):
    with pytest.raises(ValueError, match="min_match"):
        LookupFirst(Scripted(), **kw)
