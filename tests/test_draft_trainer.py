"""The plain-draft trainer: a few of the target's layers, its embedding shared, distilled on the head
trainer's data; saved without the shared tensors, materialised back into a complete HF model that specdec
and HF's assisted generation both run, exactly."""
import hashlib
import json

import pytest
import torch

import specdec
from specdec.training.draft_trainer import (DraftTrainArgs, build_draft, init_layers, loss_and_agreement,
                                            make_batch, train_draft)
from specdec.training.head_trainer import HeadTrainArgs, train_head
from specdec.zoo import derived


@pytest.fixture(scope="module")
def zoo_target():
    return specdec.zoo.load("target")


@pytest.fixture(scope="module")
def head_work(tmp_path_factory, zoo_target):
    """A head trainer's data (one training step is enough to build it)."""
    target, tok = zoo_target
    root = tmp_path_factory.mktemp("headdata")
    train_head(HeadTrainArgs(target="target", out=root / "head", work=root / "work", steps=1, batch=2, seq_len=32,
                             num_prompts=12, max_new_tokens=24, num_text_chunks=8, text_tokens=48, gen_batch=6,
                             draft_vocab=256, eval_every=100, threads=1), target, tok, progress=False)
    return root / "work"


def dargs(tmp_path, data, name, **kw):
    base = dict(target="target", data=data, out=tmp_path / f"{name}-out", work=tmp_path / f"{name}-work", layers=2,
                steps=6, batch=3, seq_len=32, lr=3e-3, warmup=1, threads=1, log_every=1, eval_every=3)
    base.update(kw)
    return DraftTrainArgs(**base)


def logged(work):
    return {r["step"]: r["loss"] for r in map(json.loads, (work / "log.jsonl").read_text().splitlines()) if "loss" in r}


def test_the_draft_starts_from_the_targets_layers_and_shares_its_embedding(zoo_target):
    target, _ = zoo_target
    assert init_layers(6, 2) == [0, 5] and init_layers(30, 3) == [0, 14, 29] and init_layers(6, 1) == [5]
    with pytest.raises(ValueError, match="fewer than its target"):
        init_layers(6, 6)
    draft = build_draft(target, 2)
    assert draft.config.num_hidden_layers == 2
    assert draft.get_input_embeddings().weight is target.get_input_embeddings().weight
    assert torch.equal(draft.model.layers[1].mlp.up_proj.weight, target.model.layers[5].mlp.up_proj.weight)


def test_distillation_learns_resumes_exactly_and_the_draft_is_exact_in_specdec_and_hf(tmp_path, head_work,
                                                                                      zoo_target, monkeypatch):
    from specdec.training import head_data

    target, tok = zoo_target
    whole = dargs(tmp_path, head_work, "whole")
    out = train_draft(whole, target, tok, progress=False)
    part = dargs(tmp_path, head_work, "part", stop_at=2)
    assert train_draft(part, target, tok, progress=False) is None and not part.out.exists()
    part.stop_at = None
    train_draft(part, target, tok, progress=False)
    assert logged(part.work) == logged(whole.work)  # the interrupted run logged exactly the same losses
    files = sorted(p.name for p in out.iterdir())
    assert files == ["draft.safetensors", "draft_config.json"]  # no copy of the shared embedding
    # it learned: the distillation loss on a fixed batch fell from the initial draft's
    data = head_data.Dataset(sorted((head_work / "data").glob("*.safetensors")))
    batch = make_batch(data, 10_000, whole)
    head_w = target.get_output_embeddings().weight
    before, _ = loss_and_agreement(build_draft(target, 2), head_w, *batch)
    # materialise as the zoo does, into a private SPECDEC_HOME, and run it both ways
    folder = derived.materialise(out, specdec.zoo.path("target"), tmp_path / "home" / "draft")
    from transformers import AutoModelForCausalLM
    draft = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        after, _ = loss_and_agreement(draft, head_w, *batch)
    assert after < before
    assert torch.equal(draft.get_input_embeddings().weight, target.get_input_embeddings().weight)
    ids = tok(specdec.zoo.prompts(2)[1], return_tensors="pt").input_ids
    want = target.generate(ids, max_new_tokens=24, do_sample=False)
    assert torch.equal(specdec.generate(target, ids, drafter=draft, max_new_tokens=24), want)
    assert torch.equal(target.generate(ids, assistant_model=draft, max_new_tokens=24, do_sample=False), want)


def test_draft_trainer_and_materialiser_errors_name_the_problem(tmp_path, head_work, zoo_target):
    target, tok = zoo_target
    with pytest.raises(ValueError, match="no training shards"):
        train_draft(dargs(tmp_path, tmp_path / "nothing", "n"), target, tok, progress=False)
    taken = dargs(tmp_path, head_work, "taken")
    taken.out.mkdir()
    with pytest.raises(FileExistsError, match="exists"):
        train_draft(taken, target, tok, progress=False)
    other, _ = specdec.zoo.load("draft-wide")  # same tokenizer, other weights: its data is not this target's
    with pytest.raises(ValueError, match="another target"):
        train_draft(dargs(tmp_path, head_work, "o"), other, tok, progress=False)
    out = train_draft(dargs(tmp_path, head_work, "ok", steps=1), target, tok, progress=False)
    wrong = tmp_path / "wrong-target"
    target.save_pretrained(wrong)
    from safetensors.torch import load_file, save_file
    w = load_file(str(wrong / "model.safetensors"))
    w["model.norm.weight"] = w["model.norm.weight"] * 1.5
    save_file(w, str(wrong / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="fingerprint"):
        derived.materialise(out, wrong, tmp_path / "m")
    assert not (tmp_path / "m").exists() and not list(tmp_path.glob(".tmp-*"))


def test_the_zoo_serves_a_derived_draft_by_name_and_rematerialises_a_retrained_one(tmp_path, head_work, zoo_target,
                                                                                   monkeypatch):
    import shutil

    target, tok = zoo_target
    models = tmp_path / "models"
    models.mkdir()
    (models / "target").symlink_to(specdec.zoo.path("target"))
    monkeypatch.setattr(specdec.zoo, "MODELS_DIR", models)
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    first = train_draft(dargs(tmp_path, head_work, "z1", steps=1), target, tok, progress=False)
    shutil.copytree(first, models / "target-draft")
    assert specdec.zoo.drafts() == ["target-draft"] and specdec.zoo.draft_for("target") == "target-draft"
    assert "target-draft" in specdec.zoo.names() and specdec.zoo.status("target-draft") == "shipped"
    draft, dtok = specdec.zoo.load("target-draft")  # materialised on first use, into SPECDEC_HOME
    assert specdec.zoo.status("target-draft") == "materialised"
    assert specdec.zoo.path("target-draft") == tmp_path / "home" / "models" / "target-draft"
    assert dtok.get_vocab() == tok.get_vocab()
    ids = tok(specdec.zoo.prompts(1)[0], return_tensors="pt").input_ids
    assert torch.equal(specdec.generate(target, ids, drafter=draft, max_new_tokens=16),
                       target.generate(ids, max_new_tokens=16, do_sample=False))
    # a retrained draft replaces the shipped one: the old materialised copy is not served
    second = train_draft(dargs(tmp_path, head_work, "z2", steps=3), target, tok, progress=False)
    shutil.rmtree(models / "target-draft")
    shutil.copytree(second, models / "target-draft")
    assert specdec.zoo.status("target-draft") == "shipped"
    again, _ = specdec.zoo.load("target-draft")
    w = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(again.state_dict()[w], draft.state_dict()[w])


def test_a_saved_draft_continues_on_a_new_machine(tmp_path, head_work, zoo_target):
    """--resume-from: no checkpoint in the (new) work folder; the saved fp16 draft gives its layers and step,
    and training continues from there (AdamW afresh). A draft of another target or depth is refused."""
    from safetensors.torch import load_file

    from specdec.training.draft_trainer import body, load_saved_draft

    target, tok = zoo_target
    first = train_draft(dargs(tmp_path, head_work, "d1", steps=3), target, tok, progress=False)
    loaded = build_draft(target, 2)
    assert load_saved_draft(first, loaded, specdec.drafters.head_model.fingerprint(target))[0] == 3
    saved = load_file(str(first / "draft.safetensors"))
    assert all(torch.equal(v.float(), saved[f"model.{k}"].float()) for k, v in body(loaded).state_dict().items())
    moved = dargs(tmp_path, head_work, "d2", steps=5, resume_from=first)
    out = train_draft(moved, target, tok, progress=False)
    assert sorted(logged(moved.work)) == [4, 5]  # steps 1-3 were the first machine's
    trained = json.loads((out / "draft_config.json").read_text())["specdec"]["trained"]
    assert trained["steps"] == 5 and trained["continued_from"]["draft"] == first.name
    assert trained["continued_from"]["steps"] == 3
    assert trained["continued_from"]["weights_sha256"] == \
        hashlib.sha256((first / "draft.safetensors").read_bytes()).hexdigest()[:16]
    with pytest.raises(ValueError, match="has 2 layers, this run builds 1"):
        train_draft(dargs(tmp_path, head_work, "d3", layers=1, resume_from=first), target, tok, progress=False)
    other = tmp_path / "other"
    other.mkdir()
    (other / "draft.safetensors").write_bytes((first / "draft.safetensors").read_bytes())
    cfg = json.loads((first / "draft_config.json").read_text())
    cfg["specdec"]["target_fingerprint"] = "0" * 16
    (other / "draft_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="another target"):
        train_draft(dargs(tmp_path, head_work, "d4", resume_from=other), target, tok, progress=False)
    assert not (tmp_path / "d3-out").exists() and not (tmp_path / "d4-out").exists()
