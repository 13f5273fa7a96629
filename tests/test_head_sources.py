"""The head trainer's data sources beyond self-distillation (--data chitchat / random): deterministic,
resumable, refused when mismatched, never overlapping a benchmark prompt, measured on the same held-out
answers as the answers source, and a head trained on them drafts exactly."""
import copy
import json
import shutil

import pytest
import torch

import specdec
from specdec.drafters import FeatureHead
from specdec.training import head_data, head_sources, prompts
from specdec.training.head_trainer import HeadTrainArgs, train_head

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant> {% endif %}")


@pytest.fixture(scope="module")
def chat_target():
    """The zoo target with a chat template on a copy of its tokenizer (a chat model's shape, in seconds)."""
    target, tok = specdec.zoo.load("target")
    tok = copy.deepcopy(tok)
    tok.chat_template = TEMPLATE
    return target, tok


def args(tmp_path, name, **kw):
    base = dict(target="target", out=tmp_path / f"{name}-out", work=tmp_path / f"{name}-work", steps=6, batch=4,
                seq_len=32, lr=2e-3, warmup=2, num_prompts=30, max_new_tokens=12, num_text_chunks=0, text_tokens=32,
                gen_batch=4, draft_vocab=512, eval_every=3, log_every=1, threads=1, data="chitchat",
                num_conversations=10, num_random=6)
    base.update(kw)
    return HeadTrainArgs(**base)


def shards(work):
    return {p.name: p.read_bytes() for p in sorted((work / "data").glob("*.safetensors"))}


def losses(work):
    rows = [json.loads(l) for l in (work / "log.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_data_spec_is_parsed_and_refused_by_name():
    assert head_sources.parse("random+chitchat") == ("chitchat", "random")
    assert head_sources.parse("answers") == ("answers",)
    with pytest.raises(ValueError, match="unknown: books"):
        head_sources.parse("chitchat+books")
    with pytest.raises(ValueError, match="expected one or more"):
        head_sources.parse("+")


def test_conversations_are_rendered_turn_by_turn_seeded_and_prefix_stable(chat_target):
    _, tok = chat_target
    a = head_sources.conversations(tok, 8, seed=0)
    assert a == head_sources.conversations(tok, 8, seed=0)
    assert head_sources.conversations(tok, 4, seed=0) == a[:4]  # asking for more keeps the first
    assert head_sources.conversations(tok, 8, seed=1) != a
    text = tok.decode(a[0][0])
    assert text.startswith("<user> ") and "\n<assistant> " in text
    assert all(len(ids) <= head_sources.CONVERSATION_TOKENS for ids, _ in a)


def test_a_conversation_sharing_five_words_with_a_benchmark_prompt_is_dropped(chat_target, monkeypatch):
    _, tok = chat_target
    first = head_sources.conversations(tok, 3, seed=0)
    turns = list(head_sources._chitchat_turns())
    import random
    random.Random(0).shuffle(turns)
    leaked = next(t for _, t in turns[0] if len(prompts._shingles(t)) > 0)  # a turn of five words or more
    monkeypatch.setattr(prompts, "benchmark_shingles", lambda root=None: prompts._shingles(leaked))
    kept = head_sources.conversations(tok, 3, seed=0)
    assert kept[0] != first[0] and kept[:2] == first[1:3]  # the first conversation is gone, the rest move up


def test_random_prompts_are_ordinary_tokens_in_the_template_and_seeded(chat_target):
    _, tok = chat_target
    a = head_sources.random_prompts(tok, 5, seed=3)
    assert a == head_sources.random_prompts(tok, 5, seed=3) and a != head_sources.random_prompts(tok, 5, seed=4)
    assert all(tok.decode(ids).startswith("<user> ") and tok.decode(ids).endswith("<assistant> ") for ids in a)
    assert len({tuple(ids) for ids in a}) == 5


def test_chitchat_needs_a_chat_template_and_says_so(tmp_path):
    target, tok = specdec.zoo.load("target")  # a plain LM: no template
    with pytest.raises(ValueError, match="has none"):
        train_head(args(tmp_path, "plain"), target, tok, progress=False)
    assert not (tmp_path / "plain-out").exists()


@pytest.mark.parametrize("source, prefix", [("chitchat", "conv-"), ("random", "rand-")])
def test_a_run_is_deterministic_resumes_exactly_and_refuses_another_folder(tmp_path, chat_target, source, prefix):
    target, tok = chat_target
    whole = args(tmp_path, "whole", data=source)
    out = train_head(whole, target, tok, progress=False)
    names = list(shards(whole.work))
    assert any(n.startswith(prefix) for n in names) and "eval-00000.safetensors" in names
    assert not any(n.startswith("chat-") for n in names)  # no composed prompt answered but the held-out ones
    # the same data, built again from a folder that lost its last shard of the source (killed while writing)
    part = args(tmp_path, "part", stop_at=2, data=source)
    shutil.copytree(whole.work / "data", part.work / "data")
    built = sorted(n for n in names if n.startswith(prefix))
    (part.work / "data" / built[-1]).unlink()
    assert train_head(part, target, tok, progress=False) is None
    assert shards(part.work) == shards(whole.work)
    part.stop_at = None
    train_head(part, target, tok, progress=False)
    assert losses(part.work) == losses(whole.work)
    a = FeatureHead.from_pretrained(out, target).net.state_dict()
    b = FeatureHead.from_pretrained(part.out, target).net.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="other settings"):  # another data mix into the same work folder
        train_head(args(tmp_path, "whole", data="chitchat+random", out=tmp_path / "mix"), target, tok, progress=False)
    with pytest.raises(ValueError, match="other settings"):
        train_head(args(tmp_path, "whole", data=source, seed=1, out=tmp_path / "seed1"), target, tok, progress=False)
    # the head drafts exactly
    ids = tok(specdec.zoo.prompts(1)[0], return_tensors="pt").input_ids
    got = specdec.generate(target, ids, drafter=FeatureHead.from_pretrained(out, target), max_new_tokens=12)
    assert torch.equal(got, target.generate(ids, max_new_tokens=12, do_sample=False))


def test_every_source_is_measured_on_the_answers_sources_held_out_answers(tmp_path, chat_target):
    """eval-00000 holds the target's answers to the held-out composed prompts: the very sequences the answers
    source holds out, so acceptance curves of different sources are read on the same text."""
    target, tok = chat_target
    layers = (target.config.num_hidden_layers,)
    answers = head_data.Dataset(head_data.build(target, tok, tmp_path / "a", layers, 30, 12, 0, 32, 4, 0))
    rand = head_data.Dataset(head_data.build(target, tok, tmp_path / "r", layers, 30, 12, 0, 32, 4, 0,
                                             sources=("random",), num_random=6))
    assert len(answers.heldout) >= 1 and len(rand.heldout) == len(answers.heldout)
    for (ta, fa, la), (tr, fr, lr) in zip(answers.heldout, rand.heldout):
        assert torch.equal(ta, tr) and la == lr and torch.equal(fa, fr)
    assert len(rand.train) == 6 and all(lf > 0 for _, _, lf in rand.train)  # answers: loss from the answer on
    prompt = tok.decode(rand.train[0][0][:rand.train[0][2]])
    assert prompt.startswith("<user> ") and prompt.endswith("<assistant> ")
