"""Left-padded batches through generate() (specdec/rows.py): every row is its own unpadded generation token
for token, laid out like HF's batched output; sampled rows follow the target's distribution (a lossy
control fails); no pages leak whatever ends the batch; what cannot work with B > 1 is refused."""
import pytest
import torch

import specdec
from specdec import TreeSpec

from conftest import build, hf_greedy, tiny_vocab_model
from test_engine_greedy import prompts
from test_trees import TEMPERATURE, TOP_K, exact_joint, gof

PAD = 0
NEW = 14


def left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, T_i] rows -> input_ids [B, T] left-padded with PAD and the attention_mask [B, T]."""
    T = max(r.shape[1] for r in rows)
    ids = torch.full((len(rows), T), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, T - r.shape[1]:] = r[0]
        mask[i, T - r.shape[1]:] = 1
    return ids, mask


@pytest.fixture(scope="module")
def pair():
    return build("llama", seed=0), build("llama", seed=1, layers=1)


@pytest.mark.parametrize("options", [dict(drafter="ngram", draft_length=3), dict(drafter="draft"),
                                     dict(drafter="draft", tree=TreeSpec.dynamic(nodes=6, depth=3, topk=2)),
                                     dict(drafter=None)], ids=["ngram", "model", "tree", "plain"])
def test_every_row_is_its_own_unpadded_greedy_generation(pair, options):
    target, draft = pair
    options = dict(options, drafter=draft if options["drafter"] == "draft" else options["drafter"])
    rows = [p for p in prompts(4, seed=11, length=(3, 12))]
    ids, mask = left_padded(rows)
    out = specdec.generate(target, ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=None, **options)
    assert out.shape == (4, ids.shape[1] + NEW)
    assert torch.equal(out[:, :ids.shape[1]], ids)  # the prompts as given, padding included
    for i, r in enumerate(rows):
        own = hf_greedy(target, r, NEW, eos_token_id=None)[0, r.shape[1]:]
        assert torch.equal(out[i, ids.shape[1]:], own), i


def test_rows_that_end_early_are_padded_after_their_eos_like_hf(pair):
    target, draft = pair
    rows = prompts(3, seed=12, length=(4, 9))
    ids, mask = left_padded(rows)
    first = hf_greedy(target, rows[0], NEW, eos_token_id=None)[0, rows[0].shape[1]:]
    eos = int(first[3])  # row 0 ends at its 4th new token (the others maybe later or never)
    out = specdec.generate(target, ids, attention_mask=mask, drafter=draft, max_new_tokens=NEW, eos_token_id=eos,
                           pad_token_id=PAD, return_dict_in_generate=True)
    want = target.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                           pad_token_id=PAD)
    assert out.sequences.shape == want.shape and out.sequences[0, ids.shape[1] + 4:].eq(PAD).all()
    for i, r in enumerate(rows):  # HF's batched rows agree with their own unpadded runs on this model too
        own = hf_greedy(target, r, NEW, eos_token_id=eos, pad_token_id=PAD)[0, r.shape[1]:]
        got = out.sequences[i, ids.shape[1]:ids.shape[1] + own.numel()]
        assert torch.equal(got, own) and torch.equal(out.sequences[i], want[i]), i
    assert len(out.stats) == 3 and out.stats[0].new_tokens == 4


def test_num_return_sequences_over_a_batch_is_row_by_row_in_hfs_order(pair):
    target, draft = pair
    rows = prompts(2, seed=13, length=(3, 7))
    ids, mask = left_padded(rows)
    out = specdec.generate(target, ids, attention_mask=mask, drafter=draft, max_new_tokens=6, eos_token_id=None,
                           do_sample=True, num_return_sequences=3)
    assert out.shape == (6, ids.shape[1] + 6)
    assert torch.equal(out[:3, :ids.shape[1]], ids[:1].expand(3, -1)) and torch.equal(out[3:, :ids.shape[1]],
                                                                                      ids[1:].expand(3, -1))


def test_no_pages_leak_when_a_row_fails_in_the_middle(pair):
    from transformers import StoppingCriteria

    target, draft = pair
    calls = []

    class Boom(StoppingCriteria):
        def __call__(self, input_ids, scores, **kw):
            calls.append(1)
            if len(calls) == 9:
                raise RuntimeError("boom")
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    model = specdec.wrap(target, drafter=draft)
    ids, mask = left_padded(prompts(3, seed=14, length=(3, 8)))
    with pytest.raises(RuntimeError, match="boom"):
        model.generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=None, stopping_criteria=[Boom()])
    assert model.engine.pool.num_used == 0


def test_what_needs_one_sequence_is_refused_for_a_batch(pair):
    from transformers import TextStreamer

    target, _ = pair
    ids, mask = left_padded(prompts(2, seed=15, length=(3, 6)))
    with pytest.raises(ValueError, match="streamer"):
        specdec.generate(target, ids, attention_mask=mask, max_new_tokens=3, streamer=TextStreamer(None))
    with pytest.raises(ValueError, match="hf_custom_generate runs one sequence"):
        target.generate(ids, attention_mask=torch.ones_like(ids), custom_generate=specdec.hf_custom_generate,
                        max_new_tokens=3)


@pytest.mark.parametrize("acceptance, lossless", [("exact", True), ("typical", False)])
def test_sampled_rows_follow_the_target(acceptance, lossless):
    """Two prompts of different lengths in one padded batch: each row's joint distribution of 4 sampled
    tokens is the target's for that prompt (the lossy typical acceptance fails the same test)."""
    target, draft = tiny_vocab_model(4, 0, 4.0), tiny_vocab_model(4, 7, 4.0)
    prompts_ = [torch.tensor([[0, 1, 2]]), torch.tensor([[3, 1]])]
    exact = [exact_joint(target, p) for p in prompts_]
    ids, mask = torch.tensor([[0, 1, 2], [0, 3, 1]]), torch.tensor([[1, 1, 1], [0, 1, 1]])
    model = specdec.wrap(target, drafter=draft, draft_length=2, acceptance=acceptance)
    counts, n = [{}, {}], 600
    torch.manual_seed(4321)
    for _ in range(n):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=True, temperature=TEMPERATURE,
                             top_k=TOP_K)
        for i in range(2):
            key = tuple(out[i, 3:].tolist())
            counts[i][key] = counts[i].get(key, 0) + 1
    p = [gof(exact[i], counts[i], n) for i in range(2)]
    assert min(p) > 1e-3 if lossless else min(p) < 1e-6, p


def test_left_pad_is_the_inverse_of_split_rows():
    from specdec.rows import left_pad, split_rows

    rows = [[5, 6, 7], [8], [9, 10]]
    ids, mask = left_pad(rows, pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 9, 10]] and mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]
    assert [r.tolist() for r in split_rows(ids, mask)] == rows
