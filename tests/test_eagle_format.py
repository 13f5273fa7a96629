"""EAGLE-3 heads in and out (drafters/eagle_format.py): the export loads back computing the same draft
logits bit for bit, published layouts load, bad checkpoints are refused by name and leave nothing
behind, and `specdec train-head --arch eagle3` trains a head that exports."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import specdec
from specdec.cli import main as cli_main
from specdec.drafters import FeatureHead
from specdec.drafters.eagle_format import export_eagle3, load_eagle3
from specdec.training.head_data import target_features
from specdec.training.head_trainer import save_head

from conftest import VOCAB, build, hf_greedy
from test_feature_head import random_head
from test_head_trainer import args as trainer_args


def draft_logits(head: FeatureHead, target, seq: torch.Tensor, steps: int = 3) -> list[torch.Tensor]:
    """The head's draft logits [T, N] for `steps` unrolled steps over the target's features of seq [T+1]."""
    f = target_features(target, seq, head.feature_layers)
    with torch.no_grad():
        return [head.net.logits(o[0]) for o in head.net.unroll(f[None, :-1], seq[None, 1:], steps)]


@pytest.mark.parametrize("draft_vocab", [0, 40], ids=["full vocabulary", "reduced vocabulary"])
def test_export_then_import_computes_the_same_draft_logits_bit_for_bit(tmp_path, draft_vocab):
    target = build("llama", seed=0, layers=5)
    head = random_head(target, seed=1, draft_vocab=draft_vocab, arch="eagle3")
    out = export_eagle3(head.net, target, tmp_path / "eagle3")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(head.net.config.fused_layers)
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * target.config.hidden_size
    assert tensors["fc.weight"].shape == (target.config.hidden_size, 3 * target.config.hidden_size)
    assert int(tensors["t2d"].sum()) == head.net.vocab_ids.numel()
    assert torch.equal(torch.arange(head.net.vocab_ids.numel()) + tensors["d2t"], head.net.vocab_ids)
    loaded = FeatureHead.from_pretrained(out, target)
    assert loaded.net.config.arch == "eagle3" and loaded.feature_layers == head.feature_layers
    seq = torch.randint(3, VOCAB, (24,), generator=torch.Generator().manual_seed(2))
    for a, b in zip(draft_logits(head, target, seq), draft_logits(loaded, target, seq)):
        assert torch.equal(a, b)
    ids = seq[None, :7]
    for kw in (dict(draft_length=3), dict(tree=specdec.TreeSpec.dynamic(nodes=6, depth=3, topk=2))):
        got = specdec.generate(target, ids, drafter=loaded, max_new_tokens=16, eos_token_id=None, **kw)
        assert torch.equal(got, hf_greedy(target, ids, 16, eos_token_id=None))


def _rewrite(src, dst, tensors=None, config=None):
    """A copy of the checkpoint in src with its tensors and / or config changed (a published variant)."""
    dst.mkdir()
    t = load_file(str(src / "model.safetensors"))
    save_file(tensors(t) if tensors else t, str(dst / "model.safetensors"))
    c = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config(c) if config else c))
    return dst


def test_published_layouts_load_and_bad_checkpoints_are_refused_by_name(tmp_path):
    target = build("llama", seed=0, layers=5)
    head = random_head(target, seed=1, draft_vocab=40, arch="eagle3")
    out = export_eagle3(head.net, target, tmp_path / "eagle3")
    seq = torch.randint(3, VOCAB, (20,), generator=torch.Generator().manual_seed(3))
    want = draft_logits(head, target, seq)
    # vLLM's own names ("model." prefix, "layers.0." for "midlayer."), sharded, no t2d, no specdec record
    def vllm_names(t):
        return {("" if k in ("d2t", "lm_head.weight") else "model.") + k.replace("midlayer.", "layers.0."): v
                for k, v in t.items() if k != "t2d"}
    renamed = _rewrite(out, tmp_path / "renamed", vllm_names, lambda c: {k: v for k, v in c.items() if k != "specdec"})
    moved = renamed / "model.safetensors"
    part = load_file(str(moved))
    moved.unlink()
    keys = sorted(part)
    save_file({k: part[k] for k in keys[:5]}, str(renamed / "model-00001-of-00002.safetensors"))
    save_file({k: part[k] for k in keys[5:]}, str(renamed / "model-00002-of-00002.safetensors"))
    got = draft_logits(FeatureHead.from_pretrained(renamed, target), target, seq)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    # speculators' layout: the layer's sizes nested in transformer_layer_config, the layer ids at the top,
    # "layers.0." names and a copy of the target's embedding
    def nested(c):
        layer_keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                      "rms_norm_eps", "rope_theta", "rope_parameters", "vocab_size", "max_position_embeddings")
        return {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
                "draft_vocab_size": c["draft_vocab_size"], "target_hidden_size": c["target_hidden_size"],
                "eagle_aux_hidden_state_layer_ids": c["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
                "norm_before_residual": False, "transformer_layer_config": {k: c[k] for k in layer_keys}}
    embed = target.get_input_embeddings().weight.detach().clone()
    spec = _rewrite(out, tmp_path / "speculators",
                    lambda t: {**{k.replace("midlayer.", "layers.0."): v for k, v in t.items()}, "embed_tokens.weight": embed},
                    nested)
    got = draft_logits(FeatureHead.from_pretrained(spec, target), target, seq)
    assert all(torch.equal(a, b) for a, b in zip(want, got))

    def refused(name, match, tensors=None, config=None, on=target):
        with pytest.raises(ValueError, match=match):
            load_eagle3(_rewrite(out, tmp_path / name, tensors, config), on)

    refused("missing", r"missing \['norm.weight'\]", tensors=lambda t: {k: v for k, v in t.items() if k != "norm.weight"})
    refused("surplus", r"not part of an EAGLE-3 head \['midlayer.extra.weight'\]",
            tensors=lambda t: {**t, "midlayer.extra.weight": torch.zeros(3)})
    refused("shape", r"fc.weight has shape", tensors=lambda t: {**t, "fc.weight": t["fc.weight"][:, :-1].contiguous()})
    refused("flag", r"norm_before_fc=true", config=lambda c: {**c, "norm_before_fc": True})
    refused("layers", r"num_hidden_layers 2", config=lambda c: {**c, "num_hidden_layers": 2})
    def twice(t):  # draft ids 0 and 1 both mapped to target token vocab_ids[0]
        d2t = t["d2t"].clone()
        d2t[1] = d2t[0] - 1
        return {**t, "d2t": d2t}
    refused("d2t", r"two to one token", tensors=twice)
    refused("embedding", r"embedding of its own", tensors=lambda t: {
        **t, "embed_tokens.weight": torch.zeros_like(target.get_input_embeddings().weight.detach())})
    refused("hidden", r"hidden_size 64 \(target: 32\)", config=lambda c: {**c, "hidden_size": 64})
    with pytest.raises(ValueError, match="vocab_size"):
        load_eagle3(_rewrite(out, tmp_path / "vocab", config=lambda c: {**c, "vocab_size": VOCAB + 1}), target)
    with pytest.raises(ValueError, match="weights fingerprint"):  # exported by specdec for another target
        load_eagle3(out, build("llama", seed=7, layers=5))


def test_an_eagle_head_is_refused_by_the_export_and_a_failed_export_leaves_nothing(tmp_path):
    target = build("llama", seed=0, layers=5)
    with pytest.raises(ValueError, match="only an eagle3 head"):
        export_eagle3(random_head(target, draft_vocab=40).net, target, tmp_path / "x")
    assert not list(tmp_path.iterdir())
    head = random_head(target, draft_vocab=40, arch="eagle3")
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError):
        export_eagle3(head.net, target, tmp_path / "taken")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_an_eagle3_heads_training_labels_are_the_targets_own_logits():
    """The trainer's distribution to match (HeadNet.target_logits) is the target's LM head over its top
    feature, not the eagle3 head's own norm and lm_head (which training moves)."""
    target = build("llama", seed=0, layers=5)
    head = random_head(target, seed=1, draft_vocab=40, arch="eagle3")
    seq = torch.randint(3, VOCAB, (12,), generator=torch.Generator().manual_seed(5))
    top = target_features(target, seq, head.feature_layers)[:, -target.config.hidden_size:]
    with torch.no_grad():
        want = target(seq[None]).logits[0][:, head.net.vocab_ids]
        got = head.net.target_logits(top)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(head.net.logits(top), want, atol=1e-3)  # the head's own lm_head: another thing


def test_train_head_arch_eagle3_trains_and_the_command_line_exports_it(tmp_path, capsys):
    target, tok = specdec.zoo.load("target")
    a = trainer_args(tmp_path, "e3", arch="eagle3", steps=6)
    out = specdec.training.head_trainer.train_head(a, target, tok, progress=False)
    rows = [r for r in map(json.loads, (a.work / "log.jsonl").read_text().splitlines()) if "loss" in r]
    assert rows[0]["steps"][0]["reg"] == 0.0 and rows[-1]["loss"] < rows[0]["loss"]  # no regression term; it learns
    folder = tmp_path / "target-folder"
    target.save_pretrained(folder)
    tok.save_pretrained(folder)
    cli_main(["export-head", str(out), "--target", str(folder), "--out", str(tmp_path / "exported")])
    assert "speculative_config" in capsys.readouterr().out
    head = FeatureHead.from_pretrained(tmp_path / "exported", target)
    ids = tok(specdec.zoo.prompts(1)[0], return_tensors="pt").input_ids[:, -40:]
    got = specdec.generate(target, ids, drafter=head, max_new_tokens=12)
    assert torch.equal(got, target.generate(ids, max_new_tokens=12, do_sample=False))
    with pytest.raises(SystemExit, match="EAGLE-1"):
        cli_main(["export-head", str(out), "--target", str(folder), "--format", "eagle", "--out",
                  str(tmp_path / "e1")])
