"""Disk-offloaded weights read through memory maps made once (hf/mapped_offload.py): the bytes accelerate's
own loading gives, no accelerate load inside a generation, the hooks handed back after, and every way
accelerate stores offloaded weights (its .dat files, by reference to a safetensors checkpoint, in memory)."""
import threading

import pytest
import torch
from accelerate.utils import OffloadedWeightsLoader, PrefixedDataset, offload
from safetensors.torch import save_file

import specdec
from specdec.hf import mapped_offload as mo, packed
from specdec.hf.offload import _align_hooks

from conftest import offloaded


def weight_maps(model) -> list:
    return [h.weights_map for m in model.modules() for h in _align_hooks(m) if h.weights_map is not None]


@pytest.fixture
def counted_loads(monkeypatch):
    """How many weights accelerate's own disk loader copied out of its files."""
    calls = []
    real = offload.load_offloaded_weight

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(offload, "load_offloaded_weight", counting)
    return calls


def test_a_generation_reads_the_offloaded_weights_through_maps_and_hands_the_hooks_back(tmp_path, counted_loads,
                                                                                           monkeypatch):
    target, tok = specdec.zoo.load("target")
    target = offloaded(target, tmp_path, 1)
    before = weight_maps(target)
    ids = tok(specdec.zoo.prompts(1)[0], return_tensors="pt").input_ids[:, -30:]
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    assert counted_loads  # control: HF's generate loads through accelerate on every forward
    counted_loads.clear()
    seen = []
    target.model.layers[-1].register_forward_hook(lambda *a: seen.append(mo.is_mapped(target)))
    out = specdec.generate(target, ids, drafter="ngram", max_new_tokens=8)
    assert torch.equal(out, ref)
    assert seen and all(seen) and not counted_loads  # mapped for every forward: nothing copied by accelerate
    assert [id(w) for w in weight_maps(target)] == [id(w) for w in before] and not mo.is_mapped(target)
    # SPECDEC_MAPPED_OFFLOAD=0: accelerate's own loading, the same output
    monkeypatch.setenv("SPECDEC_MAPPED_OFFLOAD", "0")
    out = specdec.generate(target, ids, drafter="ngram", max_new_tokens=8, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref) and out.stats.offload == "copied"
    assert counted_loads
    monkeypatch.setenv("SPECDEC_MAPPED_OFFLOAD", "yes")
    with pytest.raises(ValueError, match="SPECDEC_MAPPED_OFFLOAD must be 0 or 1"):
        specdec.generate(target, ids, max_new_tokens=2)


def test_mapped_weights_hold_the_bytes_accelerate_loads(tmp_path):
    target, _ = specdec.zoo.load("target")
    target = offloaded(target, tmp_path, 0)
    maps = [w for w in weight_maps(target) if isinstance(w, PrefixedDataset)]
    assert maps
    checked = 0
    for inner in maps:
        mapped = mo.MappedWeights(inner)
        assert sorted(mapped) == sorted(inner)
        for key in inner:
            key = key[len(inner.prefix):]
            a, b = inner[key], mapped[key]
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), key
            assert mapped[key] is b  # mapped once
            checked += 1
    assert checked >= 9 * target.config.num_hidden_layers


def test_checkpoint_references_map_in_place_and_what_cannot_stays_on_accelerate(tmp_path):
    tensors = {"a.weight": torch.randn(5, 7), "b.weight": torch.randn(3).to(torch.bfloat16),
               "c.bias": torch.arange(6, dtype=torch.int64).view(2, 3)}
    path = str(tmp_path / "model.safetensors")
    save_file(tensors, path)
    index = {k: {"safetensors_file": path, "weight_name": k} for k in tensors}
    index["converted"] = {"safetensors_file": path, "weight_name": "a.weight", "dtype": "float64"}
    in_memory = torch.ones(2)
    loader = OffloadedWeightsLoader(state_dict={"held": in_memory}, index=index)
    mapped = mo.MappedWeights(PrefixedDataset(loader, ""))
    for k, t in tensors.items():
        got = mapped[k]
        assert got.dtype == t.dtype and torch.equal(got, t), k
        assert got.untyped_storage().data_ptr() == mapped[k].untyped_storage().data_ptr()
    # one map per checkpoint file, shared by its tensors
    assert len({mapped[k].untyped_storage().data_ptr() for k in tensors}) == 1
    conv = mapped["converted"]  # accelerate converts it on loading: its own loader, its own result
    assert conv.dtype == torch.float64 and torch.equal(conv, tensors["a.weight"].double())
    assert mapped["held"] is in_memory
    with pytest.raises(KeyError):
        mapped["missing"]


def test_nested_and_concurrent_generations_share_one_swap(tmp_path):
    target, tok = specdec.zoo.load("target")
    target = offloaded(target, tmp_path, 1)
    before = [id(w) for w in weight_maps(target)]
    with mo.mapped_offload(target):
        inside = weight_maps(target)
        assert all(isinstance(w, mo.MappedWeights) for w in inside)
        with mo.mapped_offload(target):
            assert [id(w) for w in weight_maps(target)] == [id(w) for w in inside]
        assert mo.is_mapped(target)  # the inner exit hands nothing back while the outer runs
        done = threading.Event()
        ids = tok(specdec.zoo.prompts(1)[0], return_tensors="pt").input_ids[:, -20:]
        worker = threading.Thread(target=lambda: (specdec.generate(target, ids, max_new_tokens=3), done.set()))
        worker.start()
        worker.join()
        assert done.is_set() and mo.is_mapped(target)
    assert [id(w) for w in weight_maps(target)] == before and not mo.is_mapped(target)
    with mo.mapped_offload(target):  # entered again: the same maps, made once
        assert [id(w) for w in weight_maps(target)] == [id(w) for w in inside]


def test_mapped_layers_run_in_the_lean_loop_without_packed_copies_and_go_back_to_meta(tmp_path):
    target, tok = specdec.zoo.load("target")
    ids = tok(specdec.zoo.prompts(1)[0], return_tensors="pt").input_ids[:, -30:]
    in_memory = specdec.generate(target, ids, max_new_tokens=2, return_dict_in_generate=True)
    assert in_memory.stats.offload == "" and "offloaded" not in in_memory.stats.summary()
    target = offloaded(target, tmp_path, 1)
    last = target.model.layers[-1].mlp.down_proj
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    out = specdec.generate(target, ids, drafter="ngram", draft_length=3, max_new_tokens=8,
                           return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.stats.step == "lean"  # the modules held their mapped weights: the lean loop bound them
    assert out.stats.offload == "mapped" and "offloaded weights mapped" in out.stats.summary()
    assert last.weight.device.type == "meta"  # handed back: the hook loads them per forward again
    with mo.mapped_offload(target):
        w = last.weight
        assert w.device.type == "cpu" and mo.is_mapped_tensor(w)
        assert not packed.can_pack(w)  # never copied into oneDNN's layout: that would hold in memory what is on disk
        assert packed.can_pack(w.clone()) or not packed.onednn_packs(w.dtype)
        inside = target(ids).logits  # HF's modules over the held weights: what accelerate's loading gives
    assert torch.equal(inside, target(ids).logits)
    assert last.weight.device.type == "meta"
