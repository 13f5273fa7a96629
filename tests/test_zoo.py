"""The shipped zoo: loadable through the public loaders, sane on held-out text, reproducible to train."""
import json
import math

import numpy as np
import pytest
import torch

import specdec
from specdec.zoo import corpus


def test_zoo_lists_a_target_and_several_drafts_then_the_real_models():
    names = specdec.zoo.names()
    shipped = specdec.zoo.shipped()
    assert names[0] == "target" and names[:len(shipped)] == shipped
    drafts = [n for n in shipped if n.startswith("draft")]
    assert len(drafts) >= 3 and len(shipped) == len(drafts) + 1
    heads = specdec.zoo.heads()
    assert names[len(shipped):len(shipped) + len(heads)] == heads and "target-head" in heads
    derived = specdec.zoo.drafts()  # drafts that borrow a real target's embedding, named '<target>-draft'
    assert names[len(shipped) + len(heads):len(shipped) + len(heads) + len(derived)] == derived
    assert "smollm2-135m-instruct-draft" in derived
    assert names[len(shipped) + len(heads) + len(derived):] == ["smollm2-135m-instruct", "gemma3-270m",
                                                                "qwen2.5-coder-1.5b-instruct"]
    assert all(specdec.zoo.status(n) == "shipped" for n in shipped)


@pytest.fixture(scope="module")
def heldout_text():
    return "".join(corpus.read_texts("heldout")[:3])


@pytest.mark.parametrize("name", ["target", "draft-tiny", "draft-small", "draft-wide"])
def test_every_model_loads_and_scores_heldout_text_within_its_card(name, heldout_text):
    model, tok = specdec.zoo.load(name)
    from transformers import AutoModelForCausalLM

    same = AutoModelForCausalLM.from_pretrained(specdec.zoo.path(name), dtype=torch.float32)
    assert torch.equal(same.model.embed_tokens.weight, model.model.embed_tokens.weight)
    ids = tok(heldout_text, return_tensors="pt").input_ids[:, :4 * 256]
    with torch.no_grad():
        loss = sum(float(model(w, labels=w).loss) for w in ids.split(256, dim=1)) / 4
    card = specdec.zoo.card(name)
    # a broken checkpoint lands far above its card's held-out loss; the bound leaves room for window choice
    assert loss < card["heldout_loss"] + 0.5, (name, loss, card["heldout_loss"])
    assert loss < card["unigram_loss"] - 1.0  # far below a unigram model


def test_tokenizer_round_trips_heldout_text(heldout_text):
    _, tok = specdec.zoo.load("draft-tiny")
    ids = tok(heldout_text, add_special_tokens=False).input_ids
    assert tok.decode(ids) == heldout_text
    assert len(ids) < len(heldout_text) / 2.5  # BPE actually compresses code


def test_cards_show_the_target_best_and_drafts_that_differ():
    cards = {n: specdec.zoo.card(n) for n in specdec.zoo.shipped()}
    t = cards.pop("target")
    assert all(t["heldout_loss"] < c["heldout_loss"] for c in cards.values())
    accs = sorted(c["acceptance_k4"] for c in cards.values())
    cs = sorted(c["c"] for c in cards.values())
    assert accs[-1] - accs[0] > 0.05 and cs[-1] - cs[0] > 0.02  # a real choice between drafts
    assert max(cs) < 0.6  # every draft is clearly cheaper than the target


def test_heldout_split_is_whole_modules_never_trained_on():
    train = {p.as_posix() for p in corpus.module_files("train")}
    held = {p.as_posix() for p in corpus.module_files("heldout")}
    assert held and train and not (train & held)
    assert all("site-packages" not in p for p in train | held)
    assert 0.02 < len(held) / (len(held) + len(train)) < 0.1


def test_zoo_greedy_speculation_is_lossless_for_every_drafter():
    from specdec.drafters import EarlyExit

    target, tok = specdec.zoo.load("target")
    draft, _ = specdec.zoo.load("draft-small")
    ids = tok(specdec.zoo.prompts(2)[1], return_tensors="pt").input_ids
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
    for drafter, opts in [(draft, dict(draft_length=4)), (draft, {}), ("ngram", {}), (EarlyExit(target, 2), {}),
                          (draft, dict(tree=specdec.TreeSpec.dynamic(nodes=8, depth=4, topk=2)))]:
        out = specdec.generate(target, ids, drafter=drafter, max_new_tokens=40, return_dict_in_generate=True, **opts)
        assert torch.equal(out.sequences, ref), (drafter if isinstance(drafter, str) else type(drafter).__name__, opts)
        if drafter is draft:  # speculation ran; for the adaptive default whatever this machine's timings: a
            # fresh policy drafts until 4 tokens are judged, and the draft's guess at the 3rd new token is right
            assert out.stats.accepted_tokens > 0


def test_training_is_reproducible(tmp_path):
    """Same seed -> the same tokenizer as shipped, and the same first logged losses as the shipped log."""
    from transformers import AutoTokenizer

    from specdec.zoo.tokenizer import train_tokenizer
    from specdec.zoo.train import TrainArgs, batch_at, batch_loss, initial_model, prepare_corpus, train

    retrained = train_tokenizer(tmp_path / "tokenizer")
    shipped = AutoTokenizer.from_pretrained(specdec.zoo.path("target"))
    assert retrained.get_vocab() == shipped.get_vocab()
    a = json.loads(retrained.backend_tokenizer.to_str())["model"]["merges"]
    b = json.loads(shipped.backend_tokenizer.to_str())["model"]["merges"]
    assert a == b
    prepare_corpus(tmp_path)
    want = [json.loads(line) for line in (specdec.zoo.path("target") / "training_log.jsonl").read_text().splitlines()]
    want = {r["step"]: r["loss"] for r in want}
    # the trainer computes under bfloat16 autocast (as the shipped run did): 10 steps take ~20 s on a CPU
    # with AVX512; on an AVX2-only one (an EPYC, seen here) bf16 is emulated and one step takes ~90 s, so
    # there the first batch's loss is computed by the trainer's own functions, without the backward pass
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        args = TrainArgs(name="target", work=tmp_path, out=tmp_path / "out", tokens=16 * 256)
        data = np.load(tmp_path / "train.npy", mmap_mode="r")
        with torch.no_grad():
            loss, _ = batch_loss(initial_model(args), batch_at(data, 0, args.seed, args.batch))
        assert math.isclose(loss.item(), want[1], abs_tol=2e-3), (loss.item(), want[1])
        return
    train(TrainArgs(name="target", work=tmp_path, out=tmp_path / "out", tokens=10 * 16 * 256, log_every=10))
    got = [json.loads(line) for line in (tmp_path / "target" / "log.jsonl").read_text().splitlines()]
    assert [rec["step"] for rec in got] == [1, 10]
    for rec in got:
        assert math.isclose(rec["loss"], want[rec["step"]], abs_tol=2e-3), rec


def test_shipped_heads_load_for_their_targets_and_not_as_models():
    from specdec.drafters import FeatureHead

    heads = specdec.zoo.heads()
    assert "target-head" in heads and specdec.zoo.head_for("target") == "target-head"
    assert specdec.zoo.status("target-head") == "shipped" and "target-head" in specdec.zoo.names()
    with pytest.raises(ValueError, match="is a feature head"):
        specdec.zoo.load("target-head")
    target, tok = specdec.zoo.load("target")
    head = FeatureHead.from_pretrained(specdec.zoo.path("target-head"), target)
    ids = tok(specdec.zoo.prompts(1)[0], return_tensors="pt").input_ids
    out = specdec.generate(target, ids, drafter=head, draft_length=4, max_new_tokens=32, return_dict_in_generate=True)
    assert torch.equal(out.sequences, target.generate(ids, max_new_tokens=32, do_sample=False))
    assert out.stats.mean_accepted_length > 1.3
    card = specdec.zoo.card("target-head")
    assert card["modes"]["adaptive"]["tau"] > 1 and card["trained"]["train_tokens"] > 0
    total = sum(f.stat().st_size for h in heads for f in specdec.zoo.path(h).iterdir())
    assert total <= 40 * 2 ** 20  # every shipped head together (fp16): at most 40 MB (the EAGLE-3 SmolLM2 head is 20)
