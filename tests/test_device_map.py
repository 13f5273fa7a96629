"""Targets loaded with accelerate device maps (hf/offload.py): part of the layers and the LM head offloaded
to disk, the rest in CPU memory, run through accelerate's own hooks. Every drafter kind keeps the target's
greedy output (chains, trees, a batch), the feature head reads the offloaded LM head and fingerprint, pages
go back after, and a map onto a device the engine cannot use is refused before any forward."""
import pytest
import torch

import specdec
from specdec.drafters import FeatureHead
from specdec.drafters.head_model import fingerprint
from specdec.zoo import real

from conftest import offloaded


def test_every_drafter_keeps_greedy_output_on_a_disk_offloaded_target(tmp_path):
    target, tok = specdec.zoo.load("target")
    in_memory = fingerprint(target)
    target = offloaded(target, tmp_path, target.config.num_hidden_layers // 2)
    # really offloaded: accelerate's hooks load these per forward (the zoo target ties its LM head to the
    # embedding, which stays in memory)
    assert target.model.layers[-1].mlp.down_proj.weight.device.type == "meta"
    assert fingerprint(target) == in_memory  # read through the hooks: the head's check still recognises it
    head = FeatureHead.from_pretrained(specdec.zoo.path("target-head"), target)
    draft, _ = specdec.zoo.load("draft-small")
    tree = specdec.TreeSpec.dynamic(nodes=8, depth=4, topk=2)
    ids = tok(specdec.zoo.prompts(1)[0], return_tensors="pt").input_ids[:, -40:]
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    for kw in (dict(), dict(drafter="ngram"), dict(drafter=draft, draft_length=3), dict(drafter=draft, tree=tree),
               dict(drafter=head), dict(drafter=head, tree=tree)):
        model = specdec.wrap(target, **kw)
        out = model.generate(ids, max_new_tokens=16, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref), kw
        assert model.engine.pool.num_used == 0
    # a batch: two left-padded rows, each its own greedy output
    tok.padding_side = "left"
    tok.pad_token = tok.pad_token or tok.eos_token
    enc = tok([p[-150:] for p in specdec.zoo.prompts(2)], return_tensors="pt", padding=True)
    want = target.generate(**enc, max_new_tokens=10, do_sample=False)
    got = specdec.generate(target, enc.input_ids, attention_mask=enc.attention_mask, drafter=head, max_new_tokens=10)
    assert torch.equal(got, want)


def test_an_offloaded_target_pays_no_lean_loop_probe(tmp_path, monkeypatch):
    """With accelerate's own loading (SPECDEC_MAPPED_OFFLOAD=0), the lean loop cannot read module weights,
    which an offloaded layer's hooks hold instead: the engine goes straight to the HF modules, one forward a
    step (the probe's extra forwards would each pay the offload). Mapped, the lean loop runs:
    tests/test_mapped_offload.py."""
    monkeypatch.setenv("SPECDEC_MAPPED_OFFLOAD", "0")
    target, tok = specdec.zoo.load("target")
    target = offloaded(target, tmp_path, target.config.num_hidden_layers // 2)
    calls = []
    target.model.register_forward_hook(lambda *a: calls.append(1))
    ids = tok(specdec.zoo.prompts(1)[0], return_tensors="pt").input_ids[:, -30:]
    out = specdec.generate(target, ids, max_new_tokens=6, return_dict_in_generate=True)
    assert out.stats.step == "hf" and len(calls) == 6  # the prefill and five decode forwards, no probe


def test_a_device_map_onto_a_device_the_engine_cannot_use_is_refused_before_any_forward():
    target, tok = specdec.zoo.load("target")
    ids = tok(specdec.zoo.prompts(1)[0], return_tensors="pt").input_ids[:, -20:]
    calls = []
    target.model.embed_tokens.register_forward_hook(lambda *a: calls.append(1))
    target.hf_device_map = {"model.embed_tokens": "cpu", "model.layers.0": "mps"}
    with pytest.raises(ValueError, match="places 'model.layers.0' on 'mps'"):
        specdec.generate(target, ids, drafter="ngram", max_new_tokens=4)
    if not torch.cuda.is_available():
        target.hf_device_map = {"model.embed_tokens": 0}
        with pytest.raises(ValueError, match="no CUDA device"):
            specdec.generate(target, ids, max_new_tokens=4)
    assert not calls


@pytest.mark.real
def test_smollm2_with_half_its_layers_on_disk_keeps_greedy_output_with_its_head(tmp_path):
    if specdec.zoo.status("smollm2-135m-instruct") == "not installed":
        pytest.skip(f"smollm2-135m-instruct is not installed: {real.MODELS['smollm2-135m-instruct'].pip_line()}")
    target, tok = specdec.zoo.load("smollm2-135m-instruct")
    target = offloaded(target, tmp_path, 15)
    head = FeatureHead.from_pretrained(specdec.zoo.path("smollm2-135m-instruct-head"), target)
    ids = torch.tensor([tok.apply_chat_template([{"role": "user", "content": "Name three uses of a paperclip."}],
                                                add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]])
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    for kw in (dict(drafter="ngram"), dict(drafter=head, draft_length=3)):
        assert torch.equal(specdec.generate(target, ids, max_new_tokens=12, **kw), ref), kw
