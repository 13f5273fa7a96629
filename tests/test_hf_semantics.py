"""HF keyword semantics at the edges: generation_config merging, explicit None, min_new_tokens precedence,
`inputs=`, plain lists of processors, typical acceptance under greedy, EOS ids outside the vocabulary.
Each case is compared with what transformers' own generate() does with the same arguments."""
import pytest
import torch
from transformers import GenerationConfig, MaxLengthCriteria, TemperatureLogitsWarper

import specdec

from conftest import VOCAB, build, hf_greedy


@pytest.fixture(scope="module")
def target():
    model = build("llama", seed=0, scale=3.0)
    model.generation_config = GenerationConfig(eos_token_id=7, max_new_tokens=9, pad_token_id=0)
    return model


IDS = torch.tensor([[3, 4, 5, 6]])


def test_a_passed_generation_config_is_filled_from_the_models(target):
    """The model's eos_token_id and max_new_tokens survive a user config that leaves them unset."""
    user = GenerationConfig(do_sample=False)
    want = target.generate(IDS, attention_mask=torch.ones_like(IDS), generation_config=user)
    got = specdec.generate(target, IDS, drafter="ngram", generation_config=user)
    assert torch.equal(got, want)
    assert got.shape[1] - IDS.shape[1] <= 9


def test_explicit_top_k_none_disables_top_k(target):
    torch.manual_seed(0)
    out = specdec.generate(target, IDS, do_sample=True, top_k=None, max_new_tokens=3, eos_token_id=None,
                           return_dict_in_generate=True)
    cfg, _, _ = specdec.generation_config.resolve_config(target, None, dict(do_sample=True, top_k=None))
    assert cfg.top_k is None and out.sequences.shape[1] == IDS.shape[1] + 3
    cfg, _, _ = specdec.generation_config.resolve_config(target, None, dict(do_sample=True))
    assert cfg.top_k == 50  # HF's default when nobody says otherwise


def test_min_new_tokens_takes_precedence_over_min_length(target):
    kw = dict(min_new_tokens=6, min_length=2, max_new_tokens=8, do_sample=False)
    want = target.generate(IDS, attention_mask=torch.ones_like(IDS), **kw)
    got = specdec.generate(target, IDS, drafter="ngram", **kw)
    assert torch.equal(got, want)
    limits, _ = specdec.generation_config.limits_and_sampling(
        specdec.generation_config.resolve_config(target, None, kw)[0], IDS.shape[1], None, target, False)
    assert limits.min_new_tokens == 6


def test_inputs_keyword_and_plain_lists(target):
    want = hf_greedy(target, IDS, 6, eos_token_id=None)
    assert torch.equal(specdec.generate(target, inputs=IDS, max_new_tokens=6, eos_token_id=None), want)
    with pytest.raises(ValueError, match="not both"):
        specdec.generate(target, IDS, inputs=IDS, max_new_tokens=6)
    got = specdec.generate(target, IDS, drafter="ngram", max_new_tokens=20, eos_token_id=None,
                           stopping_criteria=[MaxLengthCriteria(IDS.shape[1] + 5)],
                           logits_processor=[TemperatureLogitsWarper(0.5)])
    assert torch.equal(got, want[:, :IDS.shape[1] + 5])  # temperature leaves the argmax alone


def test_typical_acceptance_with_greedy_decoding_emits_the_argmax(target):
    draft = build("llama", seed=5, scale=3.0)
    want = hf_greedy(target, IDS, 16, eos_token_id=None)
    for _ in range(3):
        got = specdec.generate(target, IDS, drafter=draft, acceptance="typical", draft_length=3, max_new_tokens=16,
                               eos_token_id=None)
        assert torch.equal(got, want)


def test_eos_outside_the_vocabulary_is_ignored_with_a_warning(target):
    with pytest.warns(UserWarning, match="outside the vocabulary"):
        got = specdec.generate(target, IDS, max_new_tokens=6, min_new_tokens=2, eos_token_id=[VOCAB + 5])
    assert torch.equal(got, hf_greedy(target, IDS, 6, eos_token_id=None))


class Recorder:
    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, ids):
        self.puts.append(ids.reshape(-1).tolist())

    def end(self):
        self.ended = True


def test_hf_custom_generate_streams_the_prompt_once_and_refuses_padding(target):
    """transformers keeps streamer= from a callable custom_generate; specdec_streamer= streams like HF's loop."""
    rec, ref = Recorder(), Recorder()
    kw = dict(attention_mask=torch.ones_like(IDS), max_new_tokens=6, eos_token_id=None, do_sample=False)
    out = target.generate(IDS, custom_generate=specdec.hf_custom_generate, drafter="ngram", specdec_streamer=rec,
                          **kw)
    target.generate(IDS, streamer=ref, **kw)
    assert rec.ended and sum(rec.puts, []) == sum(ref.puts, []) == out[0].tolist()
    padded = torch.tensor([[0, 0, 3, 4, 5, 6]])
    with pytest.raises(ValueError, match="padding"):
        target.generate(padded, attention_mask=(padded != 0).long(), custom_generate=specdec.hf_custom_generate,
                        max_new_tokens=4)


def test_threads_generating_with_one_model_all_finish_exactly_and_restore_attention():
    import threading

    target = build("llama", seed=0, scale=3.0)
    impl = target.config._attn_implementation
    prompts = [torch.randint(3, VOCAB, (1, 3 + i), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    refs = [hf_greedy(target, p, 24, eos_token_id=None) for p in prompts]
    spec = specdec.wrap(target, drafter="ngram")
    results, errors = {}, []

    def work(i):
        try:
            for _ in range(3):
                out = specdec.generate(target, prompts[i], drafter="ngram", max_new_tokens=24, eos_token_id=None)
                streamed = [t for chunk in spec.stream(prompts[i], max_new_tokens=24, eos_token_id=None)
                            if isinstance(chunk, list) for t in chunk]
                results.setdefault(i, []).append((out, streamed))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i, runs in results.items():
        for out, streamed in runs:
            assert torch.equal(out, refs[i])
            assert streamed == refs[i][0, prompts[i].shape[1]:].tolist()
    assert target.config._attn_implementation == impl


@pytest.mark.parametrize("do_sample", [False, True])
def test_return_dict_is_hfs_output_type_with_scores_and_logits(target, do_sample):
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    draft = build("llama", seed=5, scale=3.0)
    kw = dict(max_new_tokens=10, eos_token_id=None, return_dict_in_generate=True, output_scores=True,
              output_logits=True, do_sample=do_sample, repetition_penalty=1.2)
    if do_sample:
        kw.update(temperature=0.7, top_k=8)
    out = specdec.generate(target, IDS, drafter=draft, draft_length=3, **kw)
    assert isinstance(out, GenerateDecoderOnlyOutput) and out.stats.new_tokens == 10
    assert out[0] is out["sequences"] is out.sequences and len(out.scores) == len(out.logits) == 10
    new = out.sequences[0, IDS.shape[1]:]
    # HF's own loop, forced through specdec's tokens, returns the same per-token scores and logits
    forced = target.generate(out.sequences[:, :IDS.shape[1]], attention_mask=torch.ones_like(IDS), **{
        **kw, "do_sample": False, "temperature": None, "top_k": None}) if not do_sample else None
    for i in range(10):
        with torch.no_grad():
            raw = target(out.sequences[:, :IDS.shape[1] + i]).logits[:, -1].float()
        torch.testing.assert_close(out.logits[i], raw, rtol=1e-4, atol=1e-4)
        if not do_sample:
            assert int(out.scores[i].argmax()) == int(new[i])
    if forced is not None:
        assert torch.equal(forced.sequences, out.sequences)
        for a, b in zip(out.scores, forced.scores):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    else:  # sampled tokens lie in the processed support (top-k 8)
        assert all(torch.isfinite(out.scores[i][0, new[i]]) for i in range(10))
        assert all(int(torch.isfinite(s).sum()) <= 8 for s in out.scores)


def test_num_return_sequences_returns_that_many_independent_samples(target):
    torch.manual_seed(0)
    kw = dict(max_new_tokens=8, do_sample=True, temperature=1.5, num_return_sequences=5)
    out = specdec.generate(target, IDS, drafter="ngram", return_dict_in_generate=True, **kw)
    hf = target.generate(IDS, attention_mask=torch.ones_like(IDS), **kw)
    assert out.sequences.shape[0] == hf.shape[0] == 5 and len(out.stats) == 5
    assert torch.equal(out.sequences[:, :IDS.shape[1]], IDS.expand(5, -1))
    assert len({tuple(r.tolist()) for r in out.sequences}) > 1  # independent samples, not one repeated
    for row, st in zip(out.sequences, out.stats):  # EOS (7) ends a row; pad (0) after it
        gen = row[IDS.shape[1]:].tolist()
        if 7 in gen:
            assert all(t == 0 for t in gen[gen.index(7) + 1:])
        assert st.new_tokens == (gen.index(7) + 1 if 7 in gen else len(gen))
    with pytest.raises(ValueError, match="num_return_sequences"):  # as HF refuses it
        specdec.generate(target, IDS, max_new_tokens=4, num_return_sequences=2)


def test_kv_pages_grow_with_the_sequence_and_a_budget_is_enforced_cleanly():
    from specdec.cache.pool import PoolExhausted

    target = build("llama", seed=0, scale=3.0)  # 128 positions
    spec = specdec.wrap(target, drafter="ngram", keep_cache=True)  # chat: the pool spans every position
    spec.generate(IDS, max_new_tokens=6, eos_token_id=None)
    kept = spec.engine._kept
    assert spec.engine.pool.num_pages * spec.engine.page_size >= 128
    assert kept.target.kv.allocated_slots <= 4 * spec.engine.page_size  # ~10 positions used, not 128
    spec.engine.release_cache()
    with pytest.raises(PoolExhausted, match="max_kv_tokens"):
        specdec.generate(target, IDS, drafter="ngram", max_new_tokens=60, eos_token_id=None, max_kv_tokens=32)
    engine = specdec.api._make_engine(target, "ngram", max_kv_tokens=32)
    with pytest.raises(PoolExhausted):
        engine.generate(IDS[0], specdec.api.SamplingParams(), specdec.engine.Limits(60))
    assert engine.pool.num_used == 0  # nothing left behind
    ok = specdec.generate(target, IDS, max_new_tokens=20, eos_token_id=None, max_kv_tokens=32)
    assert torch.equal(ok, hf_greedy(target, IDS, 20, eos_token_id=None))
    with pytest.raises(ValueError, match="max_kv_tokens must be a positive int"):
        specdec.generate(target, IDS, max_new_tokens=2, max_kv_tokens=0)


@pytest.mark.parametrize("bad,match", [
    (lambda n: specdec.drafters.Draft.chain(torch.tensor([3] * (n + 1))), "budget"),
    (lambda n: specdec.drafters.Draft.chain(torch.tensor([-1])), "outside the vocabulary"),
    (lambda n: specdec.drafters.Draft.chain(torch.tensor([VOCAB])), "outside the vocabulary"),
    (lambda n: specdec.drafters.Draft(torch.tensor([3, 4]), torch.tensor([-1, 1])), "earlier node"),
    (lambda n: specdec.drafters.Draft.chain(torch.tensor([3]), torch.ones(1, 7)), "q_probs"),
])
def test_the_engine_checks_what_a_drafter_returns(bad, match):
    class Broken:

        def begin(self, setup):
            pass

        def propose(self, ctx, budget):
            return bad(budget)

        def accept(self, n):
            pass

        def end(self):
            pass

    target = build("llama", seed=0)
    engine = specdec.api._make_engine(target, Broken(), draft_length=2)
    with pytest.raises(ValueError, match=f"drafter Broken .*{match}|{match}"):
        engine.generate(IDS[0], specdec.api.SamplingParams(do_sample=True), specdec.engine.Limits(8))
    assert engine.pool.num_used == 0


def test_breaking_out_of_stream_stops_the_worker_and_frees_its_pages():
    import threading

    target = build("llama", seed=0, scale=3.0)
    spec = specdec.wrap(target, drafter="ngram")
    before = threading.active_count()
    for chunk in spec.stream(IDS, max_new_tokens=100, eos_token_id=None):
        break
    assert threading.active_count() == before and spec.engine.pool.num_used == 0
    full = list(spec.stream(IDS, max_new_tokens=10, eos_token_id=None))  # the engine is free again
    assert sum(full[:-1], []) == hf_greedy(target, IDS, 10, eos_token_id=None)[0, IDS.shape[1]:].tolist()


def test_heuristic_policy_without_a_bound():
    from specdec.policy import HeuristicPolicy

    target = build("llama", seed=0, scale=3.0)
    out = specdec.generate(target, IDS, drafter=target, draft_length=HeuristicPolicy(max_length=None),
                           max_new_tokens=60, eos_token_id=None, return_dict_in_generate=True)
    assert torch.equal(out.sequences, hf_greedy(target, IDS, 60, eos_token_id=None))
    assert max(out.stats.draft_lengths) > 8  # a self-draft is always accepted: the budget keeps growing


def test_the_kernel_path_follows_what_triton_can_run(monkeypatch):
    import specdec.kernels as K

    target = build("llama", seed=0)
    monkeypatch.setenv("SPECDEC_KERNELS", "auto")
    assert specdec.api._make_engine(target, "ngram").kernel is False  # CPU tensors: the torch path
    monkeypatch.setattr(K, "_triton_importable", lambda: False)
    assert K.on_triton("cuda") is False  # a CUDA machine without Triton keeps the torch path
    monkeypatch.setattr(K, "_triton_importable", lambda: True)
    monkeypatch.setenv("SPECDEC_KERNELS", "torch")
    assert K.on_triton("cuda") is False
    monkeypatch.setenv("SPECDEC_KERNELS", "triton")
    assert specdec.api._make_engine(target, "ngram").kernel is True  # forced (CPU tensors: the interpreter)
