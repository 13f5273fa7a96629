"""The feature-head trainer: it learns, it resumes exactly, and its bad inputs get clear errors."""
import hashlib
import json
import shutil

import pytest
import torch

import specdec
from specdec.drafters import FeatureHead
from specdec.training.head_trainer import HeadTrainArgs, train_head

from conftest import build


def args(tmp_path, name, **kw):
    base = dict(target="target", out=tmp_path / f"{name}-out", work=tmp_path / f"{name}-work", steps=8, batch=4,
                seq_len=32, lr=2e-3, warmup=2, num_prompts=12, max_new_tokens=16, num_text_chunks=4, text_tokens=32,
                gen_batch=6, draft_vocab=512, eval_every=4, log_every=1, threads=1)
    base.update(kw)
    return HeadTrainArgs(**base)


def losses(work):
    rows = [json.loads(l) for l in (work / "log.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def zoo_target():
    return specdec.zoo.load("target")


def test_interrupted_run_resumes_with_the_same_losses_and_head(tmp_path, zoo_target):
    target, tok = zoo_target
    whole = args(tmp_path, "whole")
    out = train_head(whole, target, tok, progress=False)
    part = args(tmp_path, "part", stop_at=3)
    assert train_head(part, target, tok, progress=False) is None  # stopped at step 3, checkpoint kept
    assert not part.out.exists() and sorted(losses(part.work)) == [1, 2, 3]
    part.stop_at = None
    train_head(part, target, tok, progress=False)
    assert losses(part.work) == losses(whole.work)
    a = FeatureHead.from_pretrained(out, target).net.state_dict()
    b = FeatureHead.from_pretrained(part.out, target).net.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    cfg = json.loads((out / "head_config.json").read_text())
    assert cfg["trained"]["steps"] == 8 and len(cfg["trained"]["heldout"]["accept"]) == 5
    # periodic evaluations read the first heldout_seqs held-out answers; the saved record reads all of them
    one = args(tmp_path, "one", steps=4, heldout_seqs=1, num_prompts=30)  # held out: prompts 0 and 25
    train_head(one, target, tok, progress=False)
    evals = [json.loads(l)["heldout"] for l in (one.work / "log.jsonl").read_text().splitlines() if "heldout" in l]
    final = json.loads((one.out / "head_config.json").read_text())["trained"]["heldout"]
    assert 0 < evals[-1]["positions"] < final["positions"]
    ids = tok(specdec.zoo.prompts(1)[0], return_tensors="pt").input_ids
    got = specdec.generate(target, ids, drafter=FeatureHead.from_pretrained(out, target), max_new_tokens=12)
    assert torch.equal(got, target.generate(ids, max_new_tokens=12, do_sample=False))


def test_interrupted_data_build_resumes_to_the_same_shards(tmp_path, zoo_target):
    target, tok = zoo_target
    a = args(tmp_path, "a", steps=1)
    train_head(a, target, tok, progress=False)
    shards = sorted((a.work / "data").glob("*.safetensors"))
    assert len(shards) >= 2
    b = args(tmp_path, "b", steps=1)
    shutil.copytree(a.work / "data", b.work / "data")
    (b.work / "data" / shards[-1].name).unlink()  # as if killed while writing the last shard
    train_head(b, target, tok, progress=False)
    for s in shards:
        assert (b.work / "data" / s.name).read_bytes() == s.read_bytes()


def test_a_build_asked_for_more_data_keeps_its_full_shards_and_rebuilds_the_partial_one(tmp_path, zoo_target):
    from specdec.training import head_data

    target, tok = zoo_target
    small = args(tmp_path, "g", steps=1, num_prompts=9, gen_batch=6)  # chat-00000 full (6), chat-00001 partial (3)
    train_head(small, target, tok, progress=False)
    data = small.work / "data"
    before = {p.name: p.read_bytes() for p in data.glob("*.safetensors")}
    assert head_data.shard_items(data / "chat-00001.safetensors") == 3
    grown = args(tmp_path, "g", steps=1, num_prompts=18, gen_batch=6, num_text_chunks=8, out=tmp_path / "g2")
    train_head(grown, target, tok, progress=False)
    after = {p.name: p.read_bytes() for p in data.glob("*.safetensors")}
    assert after["chat-00000.safetensors"] == before["chat-00000.safetensors"]  # kept, not regenerated
    assert after["chat-00001.safetensors"] != before["chat-00001.safetensors"]  # 3 -> 6 prompts: rebuilt
    assert head_data.shard_items(data / "chat-00001.safetensors") == 6 and "chat-00002.safetensors" in after
    fresh = args(tmp_path, "f", steps=1, num_prompts=18, gen_batch=6, num_text_chunks=8)
    train_head(fresh, target, tok, progress=False)  # the grown data is exactly what a fresh build writes
    assert {p.name: p.read_bytes() for p in (fresh.work / "data").glob("*.safetensors")} == after
    assert json.loads((small.work / "manifest.json").read_text())["num_prompts"] == 18


def test_a_run_resumed_on_grown_data_keeps_its_vocabulary_and_the_lm_head_rows_it_trains_against(tmp_path,
                                                                                                   zoo_target):
    """The draft vocabulary is chosen from the data's token counts at the start; a checkpoint resumed after
    the data grew keeps its own ids, and the head must be trained (and measured) against the target's
    LM-head rows of those ids. The heldout acceptance the trainer records with its in-memory head must
    equal a fresh measurement of the saved head (which binds the rows of its saved ids)."""
    from safetensors.torch import load_file

    from specdec.training import head_data
    from specdec.training.head_trainer import heldout_acceptance

    target, tok = zoo_target
    first = args(tmp_path, "v", steps=6, stop_at=2, num_prompts=12, draft_vocab=256)
    assert train_head(first, target, tok, progress=False) is None
    kept = load_file(str(first.work / "checkpoint.safetensors"))["net.vocab_ids"]
    grown = args(tmp_path, "v", steps=6, num_prompts=36, num_text_chunks=12, draft_vocab=256)
    out = train_head(grown, target, tok, progress=False)
    data = first.work / "data"
    paths = sorted(data.glob("chat-*.safetensors")) + sorted(data.glob("text-*.safetensors"))
    dataset = head_data.Dataset(paths)
    fresh = torch.sort(torch.topk(dataset.token_counts(len(tok)), 256, sorted=True).indices).values
    assert not torch.equal(fresh, kept)  # the grown data would pick another vocabulary: the case under test
    head = FeatureHead.from_pretrained(out, target)
    assert torch.equal(head.net.vocab_ids, kept)
    recorded = json.loads((out / "head_config.json").read_text())["trained"]["heldout"]
    with torch.no_grad():
        assert heldout_acceptance(head.net, target, dataset) == recorded


def test_trainer_errors_name_the_problem(tmp_path, zoo_target):
    target, tok = zoo_target
    a = args(tmp_path, "x")
    a.out.mkdir()
    with pytest.raises(FileExistsError, match="exists"):
        train_head(a, target, tok, progress=False)
    with pytest.raises(ValueError, match="prompt set is empty"):
        train_head(args(tmp_path, "empty", num_prompts=0), target, tok, progress=False)
    with pytest.raises(ValueError, match="model.layers"):
        train_head(args(tmp_path, "gpt2"), build("gpt2"), tok, progress=False)
    first = args(tmp_path, "s", steps=1)
    train_head(first, target, tok, progress=False)
    with pytest.raises(ValueError, match="other settings"):
        train_head(args(tmp_path, "s", steps=1, max_new_tokens=8, out=tmp_path / "s2"), target, tok, progress=False)


def test_a_saved_head_continues_on_a_new_machine(tmp_path, zoo_target):
    """--resume-from: no checkpoint in the (new) work folder; the saved fp16 head gives weights, step and the
    draft vocabulary, and training continues from there (AdamW afresh)."""
    target, tok = zoo_target
    first = args(tmp_path, "first", steps=4)
    train_head(first, target, tok, progress=False)
    moved = args(tmp_path, "moved", steps=6, resume_from=first.out)
    train_head(moved, target, tok, progress=False)
    assert sorted(losses(moved.work)) == [5, 6]  # steps 1-4 were the first machine's
    cfg = json.loads((moved.out / "head_config.json").read_text())
    assert cfg["trained"]["steps"] == 6
    # train_tokens counts this run's data; what the first head had seen is kept beside it, and the card says so
    first_trained = json.loads((first.out / "head_config.json").read_text())["trained"]
    digest = hashlib.sha256((first.out / "head.safetensors").read_bytes()).hexdigest()[:16]
    assert cfg["trained"]["continued_from"] == {"head": first.out.name, "weights_sha256": digest, "steps": 4,
                                                "train_tokens": first_trained["train_tokens"]}
    from specdec.training.head_card import to_markdown

    text = to_markdown({"head": "h", "trained": cfg["trained"], "draft_vocab": 0, "feature_layers": [2], "params": 1,
                        "measured_on": "-", "modes": {}, "sample": ""})
    assert f"its first 4 steps were a head trained on {first_trained['train_tokens']} tokens" in text
    a = FeatureHead.from_pretrained(first.out, target).net
    b = FeatureHead.from_pretrained(moved.out, target).net
    assert torch.equal(a.vocab_ids, b.vocab_ids) and not torch.equal(a.fc.weight, b.fc.weight)


def test_a_top_only_head_continues_as_a_fusion_head_computing_the_same_function_at_first(tmp_path, zoo_target):
    """--resume-from a top-only head with --fusion: the fusion projection starts as [0 | 0 | I], so the
    widened head predicts exactly what the saved one did from the same top feature, whatever the low and
    middle layers hold; training then moves the low and middle blocks. A fusion head does not load into a
    top-only run."""
    from specdec.drafters.head_model import HeadConfig, HeadNet
    from specdec.training.head_trainer import _load_saved_head

    target, tok = zoo_target
    first = args(tmp_path, "top", steps=4)
    train_head(first, target, tok, progress=False)
    top = FeatureHead.from_pretrained(first.out, target).net.float()
    config = HeadConfig.for_target(target, fusion=True, draft_vocab=512)
    wide = HeadNet(config)
    assert _load_saved_head(first.out, wide) == (4, pytest.approx(json.loads(
        (first.out / "head_config.json").read_text())["trained"]["train_seconds"]))
    wide.bind(target)
    H = config.hidden_size
    feats = torch.randn(2, 9, 3 * H)
    tokens = torch.randint(0, 100, (2, 9))
    for a, b in zip(top.unroll(feats[..., -H:], tokens, 3), wide.unroll(feats, tokens, 3)):
        assert torch.allclose(a, b, atol=1e-5)
    fused = args(tmp_path, "fused", steps=6, fusion=True, resume_from=first.out)
    train_head(fused, target, tok, progress=False)
    assert sorted(losses(fused.work)) == [5, 6]
    moved = FeatureHead.from_pretrained(fused.out, target).net
    assert moved.fuse.weight[:, :2 * H].abs().sum() > 0  # the low and middle layers now feed the head
    with pytest.raises(ValueError, match="other settings"):
        train_head(args(tmp_path, "back", steps=8, resume_from=fused.out), target, tok, progress=False)


def test_a_one_layer_head_continues_as_a_two_layer_head_computing_the_same_function_at_first(tmp_path,
                                                                                           zoo_target):
    """--resume-from a 1-layer head with --num-layers 2: the new layer's o_proj and down_proj start at zero
    (its residual branches add nothing), so the deepened head predicts exactly what the saved one did;
    training then grows the new layer. A 2-layer head does not load into a 1-layer run."""
    from specdec.drafters.head_model import HeadConfig, HeadNet
    from specdec.training.head_trainer import _load_saved_head

    target, tok = zoo_target
    first = args(tmp_path, "one", steps=4)
    train_head(first, target, tok, progress=False)
    one = FeatureHead.from_pretrained(first.out, target).net.float()
    deep = HeadNet(HeadConfig.for_target(target, draft_vocab=512, num_layers=2))
    deep.init_from_target(target)
    assert _load_saved_head(first.out, deep)[0] == 4
    deep.bind(target)
    assert deep.layers[1].q_proj.weight.abs().sum() > 0 and deep.layers[1].o_proj.weight.abs().sum() == 0
    H = one.config.hidden_size
    feats, tokens = torch.randn(2, 9, H), torch.randint(0, 100, (2, 9))
    for a, b in zip(one.unroll(feats, tokens, 3), deep.unroll(feats, tokens, 3)):
        assert torch.allclose(a, b, atol=1e-5)
    two = args(tmp_path, "two", steps=6, num_layers=2, resume_from=first.out)
    train_head(two, target, tok, progress=False)
    assert sorted(losses(two.work)) == [5, 6]
    grown = FeatureHead.from_pretrained(two.out, target).net
    assert grown.config.num_layers == 2 and grown.layers[1].o_proj.weight.abs().sum() > 0
    with pytest.raises(ValueError, match="other settings"):
        train_head(args(tmp_path, "back1", steps=8, resume_from=two.out), target, tok, progress=False)


def test_the_prompt_set_is_varied_prefix_stable_and_never_overlaps_the_benchmark():
    """The composed prompt set draws from five families (everyday requests in many forms, task x topic,
    wider everyday requests, code writing and editing); build(n) is a prefix of build(m) for n < m (a grown
    data build keeps its shards); no prompt shares a five-word run with a benchmark prompt; a few percent
    are held out; past the chat families' pools the set grows with code only."""
    from specdec.training import prompts

    many = prompts.build(1200, seed=3)
    assert prompts.build(300, seed=3) == many[:300] and prompts.build(300, seed=4) != many[:300]
    users = [p["user"] for p in many]
    assert len(set(users)) == len(users)
    everyday, wider = set(prompts.everyday_requests()), set(prompts.wider_requests())
    templated = {t.format(t=topic) for t in prompts.TASKS for topic in prompts.TOPICS}
    edits = [u for u in users if "```python" in u]
    shares = [sum(u in family for u in users) / len(users) for family in (everyday, templated, wider)]
    assert 0.1 < shares[0] < 0.2 and 0.2 < shares[1] < 0.3 and 0.3 < shares[2] < 0.4, shares
    assert 0.08 < len(edits) / len(users) < 0.17
    assert all(p["kind"] == "code" for p in many if "```python" in p["user"])
    assert all(p["kind"] == "chat" for p in many if p["user"] in wider)
    chat_pool = len(everyday | templated | wider)
    grown = prompts.build(chat_pool + 4000, seed=3)
    tail = grown[-1500:]  # every chat pool is used up by then
    assert sum(p["kind"] == "chat" for p in grown) <= chat_pool and all(p["kind"] == "code" for p in tail)
    bench = prompts.benchmark_shingles()
    assert bench and not any(prompts._shingles(u) & bench for u in users)
    # the filter has power: a benchmark prompt itself would be dropped
    import json
    from pathlib import Path
    first = json.loads((Path(prompts.__file__).parents[2] / "benchmarks/prompts/chat.jsonl").read_text().splitlines()[0])
    assert prompts._shingles(first["prompt"]) & bench
    held = sum(prompts.is_heldout(p) for p in many) / len(many)
    assert 0.01 < held < 0.08


def test_batched_features_equal_each_sequence_alone(zoo_target):
    """Right-padded batches give every sequence the features a forward of it alone gives (HF's hidden
    states: layer l's output for l < L, the final norm's output for L)."""
    from specdec.training import head_data

    target, tok = zoo_target
    L = target.config.num_hidden_layers
    layers = (1, L // 2, L)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, len(tok), (n,), generator=g) for n in (5, 17, 9, 1)]
    got = head_data.batch_features(target, seqs, layers)
    for s, f in zip(seqs, got):
        with torch.no_grad():
            hs = target(input_ids=s[None], output_hidden_states=True).hidden_states
        want = torch.cat([hs[l][0] for l in layers], dim=-1)
        assert f.shape == want.shape and torch.allclose(f, want, atol=1e-4, rtol=1e-4)


def test_a_shard_keeps_its_sequences_in_order_with_their_own_features(tmp_path, zoo_target, monkeypatch):
    from safetensors.torch import load_file

    from specdec.training import head_data

    target, tok = zoo_target
    monkeypatch.setattr(head_data, "FEATURE_BATCH_TOKENS", 40)  # several length groups out of order
    g = torch.Generator().manual_seed(1)
    seqs = [(torch.randint(0, len(tok), (n,), generator=g).tolist(), i, i % 2 == 0)
            for i, n in enumerate((12, 3, 30, 7, 12, 21))]
    path = tmp_path / "chat-00000.safetensors"
    layers = (target.config.num_hidden_layers,)
    assert head_data.write_shard(path, seqs, target, layers, items=6) == sum(len(s) for s, _, _ in seqs)
    d = load_file(str(path))
    off = d["offsets"].tolist()
    assert d["loss_from"].tolist() == list(range(6)) and d["heldout"].tolist() == [s[2] for s in seqs]
    for i, (ids, _, _) in enumerate(seqs):
        assert d["tokens"][off[i]:off[i + 1]].tolist() == ids
        want = head_data.target_features(target, torch.tensor(ids), layers)
        assert torch.allclose(d["features"][off[i]:off[i + 1]].float(), want, atol=2e-2, rtol=1e-2)


def test_precision_picks_the_dtype_and_refuses_an_unknown_one():
    from specdec.training import loop

    cpu = torch.device("cpu")
    assert loop.compute_dtype("fp32", cpu) == torch.float32 and loop.compute_dtype("bf16", cpu) == torch.bfloat16
    assert loop.compute_dtype("auto", cpu) == (torch.bfloat16 if loop.bf16_is_native(cpu) else torch.float32)
    with pytest.raises(ValueError, match="precision must be one of"):
        loop.compute_dtype("fp8", cpu)


def test_bf16_answers_leave_the_target_in_fp32_and_features_come_from_it(tmp_path, zoo_target):
    """--precision bf16: a bf16 copy answers the prompts (the manifest says so, and a resume with fp32
    answers is refused); the target itself stays fp32 and the stored features are its own; the first loss
    under autocast is the fp32 loss to bf16 accuracy."""
    from safetensors.torch import load_file

    from specdec.training import head_data

    target, tok = zoo_target
    half = args(tmp_path, "h", steps=1, precision="bf16")
    train_head(half, target, tok, progress=False)
    assert all(p.dtype == torch.float32 for p in target.parameters())
    assert json.loads((half.work / "manifest.json").read_text())["answer_dtype"] == "bfloat16"
    d = load_file(str(half.work / "data" / "chat-00000.safetensors"))
    off = d["offsets"].tolist()
    ids = d["tokens"][off[0]:off[1]].long()
    want = head_data.target_features(target, ids, (target.config.num_hidden_layers,))
    assert torch.allclose(d["features"][off[0]:off[1]].float(), want, atol=2e-2, rtol=1e-2)
    full = args(tmp_path, "f32", steps=1, precision="fp32")
    train_head(full, target, tok, progress=False)
    assert "answer_dtype" not in json.loads((full.work / "manifest.json").read_text())
    with pytest.raises(ValueError, match="other settings"):
        train_head(args(tmp_path, "h", steps=1, precision="fp32", out=tmp_path / "h2"), target, tok, progress=False)
    shutil.rmtree(full.work / "data")
    shutil.copytree(half.work / "data", full.work / "data")  # the same data, trained in fp32 and in bf16
    (full.work / "log.jsonl").unlink()
    (full.work / "checkpoint.json").unlink()
    shutil.rmtree(full.out)
    train_head(full, target, tok, progress=False)
    a, b = losses(half.work)[1], losses(full.work)[1]
    assert a != b and abs(a - b) < 0.05 * abs(b)


def test_the_head_card_measures_every_mode_against_plain_decoding_on_the_same_prompts(zoo_target):
    """head-card: per mode, tau and acceptance by position from the engine's counts (at k = 1 a step emits
    1 + its one accepted-or-not token, so tau = 1 + the position-1 acceptance up to the last, cut step)
    and c as a ratio of the draft's time per drafted token to plain decoding's on the same prompt."""
    from specdec.training.head_card import measure_head, to_markdown

    target, tok = zoo_target
    card = measure_head(specdec.zoo.path("target-head"), target, tok, num_prompts=1, new_tokens=24, ks=(1, 3))
    assert list(card["modes"]) == ["k=1", "k=3", "adaptive", "tree dynamic(16, 5, 4), 16 nodes",
                                   "tree dynamic(16, 5, 4), adaptive"]
    one, three = card["modes"]["k=1"], card["modes"]["k=3"]
    assert len(one["accept_by_position"]) == 1 and len(three["accept_by_position"]) == 3
    assert abs(one["tau"] - (1 + one["accept_by_position"][0])) < 0.1
    assert all(0 <= a <= 1 for r in card["modes"].values() for a in r["accept_by_position"])
    assert all(r["c"] > 0 for r in card["modes"].values()) and three["tau"] >= 1
    assert "| k=3 |" in to_markdown(card) and card["sample"]


def test_shards_built_from_other_prompts_or_text_are_refused_and_growing_is_not(tmp_path, zoo_target, monkeypatch):
    """data/source.json keeps hashes of the first prompts and chunks: a rerun whose prompt set or text
    differs (another standard library, tokenizer or prompts.build) would mix its items with the old shards'
    silently (a shard records only how many items it holds); it is refused. A grown set is not (prefix-stable)."""
    from specdec.training import head_data

    target, tok = zoo_target
    first = args(tmp_path, "src", steps=1)
    train_head(first, target, tok, progress=False)
    record = json.loads((first.work / "data" / "source.json").read_text())
    assert len(record["prompts"]) == 12 and len(record["text"]) == 4
    grown = args(tmp_path, "src", steps=1, num_prompts=30, out=tmp_path / "src-grown")
    train_head(grown, target, tok, progress=False)
    assert len(json.loads((first.work / "data" / "source.json").read_text())["prompts"]) == 30
    chunks = head_data.text_chunks

    def other_text(tok, n, tokens, seed):  # as another machine's standard library would give
        return [c[1:] + c[:1] for c in chunks(tok, n, tokens, seed)]

    monkeypatch.setattr(head_data, "text_chunks", other_text)
    kept = {name: (first.work / name).read_text() for name in ("manifest.json", "data/source.json")}
    with pytest.raises(ValueError, match="built from other prompts"):  # grown as well: refused all the same
        train_head(args(tmp_path, "src", steps=1, num_prompts=40, out=tmp_path / "src-other"), target, tok, progress=False)
    assert not (tmp_path / "src-other").exists()
    assert kept == {name: (first.work / name).read_text() for name in kept}  # the refused run changed nothing


def test_a_continued_run_warms_its_fresh_optimiser_up_again_and_resumes_with_the_same_losses(tmp_path, zoo_target):
    """--resume-from starts AdamW afresh at the saved head's step: the rate ramps up again from there over
    `warmup` steps instead of jumping to the schedule's value, and the run, interrupted and resumed from its
    own checkpoint, keeps that ramp (the same losses as uninterrupted)."""
    from specdec.training.loop import cosine_lr

    assert cosine_lr(5, 1.0, 4, 20, since=0) == cosine_lr(5, 1.0, 4, 20)
    ramp = [cosine_lr(i, 1.0, 4, 20, since=10) / cosine_lr(i, 1.0, 4, 20) for i in range(10, 16)]
    assert ramp == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
    target, tok = zoo_target
    first = args(tmp_path, "first", steps=4)
    train_head(first, target, tok, progress=False)

    def lrs(work):
        rows = [json.loads(l) for l in (work / "log.jsonl").read_text().splitlines()]
        return {r["step"]: r["lr"] for r in rows if "lr" in r}

    whole = args(tmp_path, "whole", steps=10, warmup=4, resume_from=first.out)
    train_head(whole, target, tok, progress=False)
    got = lrs(whole.work)
    assert got[5] == pytest.approx(cosine_lr(4, 2e-3, 4, 10) / 4, rel=1e-5)  # step 5 trains batch 4, AdamW's first
    assert got[6] == pytest.approx(cosine_lr(5, 2e-3, 4, 10) * 2 / 4, rel=1e-5)
    assert got[8] == pytest.approx(cosine_lr(7, 2e-3, 4, 10), rel=1e-5)
    # interrupted inside the ramp: the resumed run must know where its AdamW began
    part = args(tmp_path, "part", steps=10, warmup=4, resume_from=first.out, stop_at=5)
    assert train_head(part, target, tok, progress=False) is None
    part.stop_at = None
    train_head(part, target, tok, progress=False)
    assert lrs(part.work) == got and losses(part.work) == losses(whole.work)


def test_the_loop_carries_a_runs_seconds_and_since_through_its_checkpoint(tmp_path):
    """loop.run continues the clocks it is handed (a resumed run's CPU and wall seconds count from the
    checkpoint's, not from zero) and its checkpoint gives back the same Progress, `since` included."""
    from specdec.training import loop

    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    x = torch.randn(8, 4)
    start = loop.Progress(step=3, seconds=50.0, cpu_seconds=100.0, since=2)
    step, seconds = loop.run(tmp_path, net, opt, start, 5, None, lambda i: 1e-2, lambda i: (net(x).square().mean(), {}, {}),
                             lambda: {"evaluated": True}, 1, 5, 5.0, "t", False)
    assert step == 5 and 50.0 <= seconds < 50.0 + 60
    evals = [json.loads(l) for l in (tmp_path / "log.jsonl").read_text().splitlines() if "evaluated" in l]
    assert evals[-1]["step"] == 5 and 100.0 <= evals[-1]["cpu_seconds"] < 100.0 + 60
    back = loop.load_checkpoint(tmp_path, torch.nn.Linear(4, 1), torch.optim.AdamW(net.parameters(), lr=1e-2))
    assert back.step == 5 and back.since == 2 and back.cpu_seconds >= 100.0 and back.seconds >= 50.0
    assert loop.load_checkpoint(tmp_path / "none", net, opt) == loop.Progress()
