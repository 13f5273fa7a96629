"""HF keyword semantics, the three API forms, clear errors, and no leaked pages."""
import pytest
import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

import specdec

from conftest import VOCAB, build, hf_greedy


@pytest.fixture(scope="module")
def target():
    return build("llama", seed=0)


@pytest.fixture(scope="module")
def draft():
    return build("llama", seed=1, layers=1)


IDS = torch.tensor([[5, 9, 13, 17, 21, 8]])


def test_max_length_and_max_new_tokens_are_exact(target, draft):
    for k in (1, 4, 8):
        out = specdec.generate(target, IDS, drafter=target, draft_length=k, max_new_tokens=7, eos_token_id=None)
        assert out.shape[1] == IDS.shape[1] + 7
        out = specdec.generate(target, IDS, drafter=target, draft_length=k, max_length=10, eos_token_id=None)
        assert out.shape[1] == 10
    # HF's default max_length (20) applies when neither is given, as in HF
    out = specdec.generate(target, IDS, drafter=draft, eos_token_id=None)
    assert torch.equal(out, target.generate(IDS, attention_mask=torch.ones_like(IDS), eos_token_id=None))


def test_eos_inside_an_accepted_chunk_ends_generation_there(target):
    ref = hf_greedy(target, IDS, 30, eos_token_id=None)[0, IDS.shape[1]:].tolist()
    eos = ref[9]  # a token the greedy continuation emits mid-way
    stop = ref.index(eos)
    want = hf_greedy(target, IDS, 30, eos_token_id=eos, pad_token_id=0)
    out = specdec.generate(target, IDS, drafter=target, draft_length=8, max_new_tokens=30, eos_token_id=eos,
                           return_dict_in_generate=True)
    assert out.sequences.shape[1] == IDS.shape[1] + stop + 1
    assert torch.equal(out.sequences, want[:, :out.sequences.shape[1]])
    assert out.stats.new_tokens == stop + 1


def test_min_new_tokens_suppresses_eos_like_hf(target, draft):
    ref = hf_greedy(target, IDS, 30, eos_token_id=None)[0, IDS.shape[1]:].tolist()
    eos = ref[2]
    want = hf_greedy(target, IDS, 30, eos_token_id=eos, pad_token_id=0, min_new_tokens=12)
    for drafter in (target, draft):
        out = specdec.generate(target, IDS, drafter=drafter, draft_length=4, max_new_tokens=30, eos_token_id=eos,
                               min_new_tokens=12)
        assert torch.equal(out, want[:, :out.shape[1]])
        assert out.shape[1] >= IDS.shape[1] + 12


class StopAfter(StoppingCriteria):
    def __init__(self, n):
        self.n = n

    def __call__(self, input_ids, scores, **kw):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.n, dtype=torch.bool)


def test_stopping_criteria_stop_at_the_exact_token(target):
    crit = StoppingCriteriaList([StopAfter(IDS.shape[1] + 5)])
    out = specdec.generate(target, IDS, drafter=target, draft_length=8, max_new_tokens=30, eos_token_id=None,
                           stopping_criteria=crit)
    assert out.shape[1] == IDS.shape[1] + 5
    assert torch.equal(out, hf_greedy(target, IDS, 5, eos_token_id=None))


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.flatten().tolist())

    def end(self):
        self.ended = True


def test_streamer_gets_prompt_then_accepted_chunks(target):
    s = Collect()
    out = specdec.generate(target, IDS, drafter=target, draft_length=4, max_new_tokens=13, eos_token_id=None,
                           streamer=s)
    assert s.ended and s.chunks[0] == IDS[0].tolist()
    assert sum(s.chunks[1:], []) == out[0, IDS.shape[1]:].tolist()
    assert max(len(c) for c in s.chunks[1:]) > 1  # several tokens arrive per step when drafts are accepted


def test_generation_config_and_kwargs_override_like_hf(target, draft):
    cfg = GenerationConfig(max_new_tokens=9, do_sample=False, eos_token_id=None)
    out = specdec.generate(target, IDS, drafter=draft, generation_config=cfg)
    assert out.shape[1] == IDS.shape[1] + 9
    out = specdec.generate(target, IDS, drafter=draft, generation_config=cfg, max_new_tokens=4)
    assert out.shape[1] == IDS.shape[1] + 4


def test_wrap_generate_stream_and_fallthrough(target, draft):
    model = specdec.wrap(target, drafter=draft, draft_length=3)
    assert model.config is target.config  # attribute access falls through
    ref = hf_greedy(target, IDS, 12, eos_token_id=None)
    assert torch.equal(model.generate(IDS, max_new_tokens=12, eos_token_id=None), ref)
    items = list(model.stream(IDS, max_new_tokens=12, eos_token_id=None))
    stats = items.pop()
    assert isinstance(stats, specdec.SpecStats) and stats.new_tokens == 12
    assert sum(items, []) == ref[0, IDS.shape[1]:].tolist()
    assert model.engine.pool.num_used == 0


def test_hf_custom_generate_inside_hf_generate(target, draft):
    ref = hf_greedy(target, IDS, 15, eos_token_id=None)
    out = target.generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=15, do_sample=False,
                          eos_token_id=None, custom_generate=specdec.hf_custom_generate, drafter=draft,
                          draft_length=3)
    assert torch.equal(out, ref)


def test_stats_are_consistent(target, draft):
    out = specdec.generate(target, IDS, drafter=draft, draft_length=3, max_new_tokens=20, eos_token_id=None,
                           return_dict_in_generate=True)
    s = out.stats
    assert s.new_tokens == 20 and s.prompt_tokens == IDS.shape[1]
    assert s.drafted_tokens == sum(s.draft_lengths)
    assert 0 <= s.accepted_tokens <= s.drafted_tokens
    assert s.new_tokens - 1 == s.accepted_tokens + s.target_forwards  # each step: accepted + one token
    assert s.prefill_s > 0 and s.ttft_s > 0 and s.decode_s > 0  # prefill_s also holds the drafter's prefill
    assert s.total_s >= s.prefill_s + s.decode_s and s.total_s >= s.ttft_s + s.decode_s
    assert abs(s.tokens_per_s - s.new_tokens / s.total_s) < 1e-9
    assert 1.0 <= s.mean_accepted_length <= 4.0


@pytest.mark.parametrize("kwargs, match", [
    (dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), "empty prompt"),
    (dict(input_ids=torch.randint(3, VOCAB, (1, 128))), "does not fit"),
    (dict(input_ids=torch.randint(3, VOCAB, (2, 5)), attention_mask=torch.tensor([[1, 1, 1, 0, 0], [1] * 5])),
     "not left-padded"),
    (dict(input_ids=torch.randint(3, VOCAB, (2, 5)), attention_mask=torch.tensor([[0] * 5, [1] * 5])), "no tokens"),
    (dict(num_beams=2), "num_beams"),
    (dict(draft_length=-1), "draft_length"),
    (dict(draft_length="sometimes"), "draft_length"),
    (dict(frobnicate=True), "frobnicate"),
    (dict(renormalize_logits=True), "renormalize_logits"),
    (dict(acceptance="approximately"), "acceptance"),
    (dict(drafter="telepathy"), "telepathy"),
])
def test_bad_input_is_a_clear_error(target, draft, kwargs, match):
    kw = dict(input_ids=IDS, drafter=draft, max_new_tokens=5)
    kw.update(kwargs)
    with pytest.raises(ValueError, match=match):
        specdec.generate(target, kw.pop("input_ids"), **kw)


def test_vocabulary_mismatch_names_both_sizes(target):
    from transformers import LlamaConfig, LlamaForCausalLM

    other = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB + 3, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ValueError, match=f"{VOCAB + 3}.*{VOCAB}"):
        specdec.generate(target, IDS, drafter=other, max_new_tokens=5)


class Boom(StoppingCriteria):
    def __call__(self, input_ids, scores, **kw):
        if input_ids.shape[1] > IDS.shape[1] + 3:
            raise RuntimeError("boom")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_pages_and_attention_come_back_after_an_exception(target, draft):
    model = specdec.wrap(target, drafter=draft, draft_length=4)
    impl_t, impl_d = target.config._attn_implementation, draft.config._attn_implementation
    with pytest.raises(RuntimeError, match="boom"):
        model.generate(IDS, max_new_tokens=20, eos_token_id=None, stopping_criteria=StoppingCriteriaList([Boom()]))
    assert model.engine.pool.num_used == 0
    assert target.config._attn_implementation == impl_t and draft.config._attn_implementation == impl_d
    # and the same wrapper works normally afterwards
    assert torch.equal(model.generate(IDS, max_new_tokens=8, eos_token_id=None),
                       hf_greedy(target, IDS, 8, eos_token_id=None))


def test_generate_keeps_a_named_policy_from_call_to_call(target):
    """'adaptive' / 'heuristic' carry their estimates over between generate calls for the same target, drafter
    object and options (as HF keeps its heuristic's budget); other drafters, options, ints and policy
    instances do not share them, and a kept policy holds no drafter alive."""
    import gc

    from specdec.api import _kept_policies

    def run(drafter, **options):
        return specdec.generate(target, IDS, drafter=drafter, max_new_tokens=12, eos_token_id=None,
                                return_dict_in_generate=True, **options).stats

    drafter = build("llama", seed=1, layers=1)
    first = run(drafter).tracker["steps"]  # drafting steps the policy has observed in its life
    kept = _kept_policies[target]
    n = len(kept)
    second = run(drafter, draft_length="Adaptive").tracker["steps"]
    assert 0 < first < second and len(kept) == n  # the same policy, learning on
    run(drafter, max_draft_length=3)
    assert len(kept) == n + 1  # other options: a policy of their own
    other = build("llama", seed=1, layers=1)
    run(other)
    assert len(kept) == n + 2  # another drafter object
    fresh = specdec.policy.make_policy("adaptive")
    run(drafter, draft_length=fresh)
    run(drafter, draft_length=3)
    assert len(kept) == n + 2 and all(policy is not fresh for _, policy in kept.values())
    del other
    gc.collect()
    run(drafter)
    assert len(kept) == n + 1  # the dead drafter's policy is dropped, and it was not kept alive
    run(drafter, draft_length="heuristic")
    heuristic = next(p for _, p in kept.values() if isinstance(p, specdec.policy.HeuristicPolicy))
    heuristic.budget = 6  # as if the last call had ended on a long accepted run
    assert run(drafter, draft_length="heuristic").draft_lengths[0] == 6  # as HF: not reset to 4


def test_warm_up_pays_the_first_generations_one_off_costs_and_leaves_nothing_behind(monkeypatch):
    """After warm_up(): the target's and the draft's lean-loop probes are done (a second probe would fail
    here), no page is in use, no KV is kept, the engine's own policy has learnt nothing, and the next
    generation is the target's greedy output."""
    from specdec.hf import lean

    target, draft = build("llama", seed=3), build("llama", seed=4, layers=1)
    model = specdec.wrap(target, drafter=draft, keep_cache=True)
    policy = model.engine.policy
    model.warm_up()
    assert target in lean._verdicts and draft in lean._verdicts

    def probed_again(_model):
        raise AssertionError("probed after warm_up")

    monkeypatch.setattr(lean, "_probe", probed_again)
    engine = model.engine
    assert engine.policy is policy and policy.tracker.steps == 0
    assert engine.cached_tokens == [] and engine.pool.num_used == 0
    out = model.generate(IDS, max_new_tokens=10, eos_token_id=None)
    assert torch.equal(out, hf_greedy(target, IDS, 10))


@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_warm_up_runs_without_a_draft_model(drafter):
    target = build("llama", seed=5)
    model = specdec.wrap(target, drafter=drafter)
    model.warm_up(new_tokens=3)
    assert model.engine.pool.num_used == 0
    assert torch.equal(model.generate(IDS, max_new_tokens=6, eos_token_id=None), hf_greedy(target, IDS, 6))


def test_ttft_counts_the_first_generations_setup(monkeypatch):
    """A model's first generation probes its lean loop before the prefill: the caller waits for it, so it
    is in setup_s, ttft_s and total_s (not prefill_s); warm_up() takes it out of the next generation."""
    import time as _time

    from specdec.hf import lean

    real_probe = lean._probe

    def slow_probe(model):
        _time.sleep(0.3)
        return real_probe(model)

    monkeypatch.setattr(lean, "_probe", slow_probe)
    target = build("llama", seed=6)
    first = specdec.generate(target, IDS, max_new_tokens=4, eos_token_id=None, return_dict_in_generate=True).stats
    assert first.setup_s >= 0.3 and first.prefill_s < first.setup_s
    assert first.ttft_s >= first.setup_s + first.prefill_s and first.total_s >= first.ttft_s + first.decode_s
    assert "first-use setup" in first.summary()
    batch_target = build("llama", seed=8)  # a batch of two rows in one forward per step (specdec/batch.py)
    ids = torch.tensor([[0, 5, 9, 13], [7, 8, 9, 10]])
    rows = specdec.generate(batch_target, ids, attention_mask=torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]),
                            max_new_tokens=3, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True).stats
    assert len(rows) == 2 and all(r.setup_s >= 0.3 and r.ttft_s >= r.setup_s + r.prefill_s for r in rows)
    other = build("llama", seed=7)
    model = specdec.wrap(other)
    model.warm_up()
    after = model.generate(IDS, max_new_tokens=4, eos_token_id=None, return_dict_in_generate=True).stats
    assert after.setup_s < 0.3 and after.ttft_s < first.ttft_s
