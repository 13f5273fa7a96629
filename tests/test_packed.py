"""Weights packed once for oneDNN (hf/packed.py): F.linear's numbers to rounding, short blocks left to the
short path, each weight packed once and again when it changes, the machine rule, the lean loop's use
of it (greedy tokens kept), and an int8 draft's long blocks through its weights dequantized and packed."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from specdec.cache.pool import BlockTable, PagePool
from specdec.hf import packed
from specdec.hf.lean import LeanRunner
from specdec.hf.packed import (FROM_ROWS, PackedQuantizedLinear, PackedLinear, packed_dequantized, packed_rule,
                               packed_weight)
from specdec.hf.runner import ModelRunner
from specdec.quantize import Int4Linear, Int8Linear, int4_draft, int8_draft

from conftest import VOCAB, build
from test_lean import _logits

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
# oneDNN packs bfloat16 only on CPUs with AVX512 (BW, VL, DQ) or AVX-NE-CONVERT (not an AVX2-only EPYC)
BF16 = packed.onednn_packs(torch.bfloat16)
needs_bf16_packing = pytest.mark.skipif(not BF16, reason="this CPU's oneDNN does not pack bfloat16 weights "
                                                         "(needs AVX512 BW/VL/DQ or AVX-NE-CONVERT)")


def _linear(out_f: int, in_f: int, bias: bool, dtype, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_f, out_f, bias=bias).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16_packing)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_gives_f_linears_numbers_for_every_block_length(dtype, bias):
    lin = _linear(96, 40, bias, dtype)
    short_calls = []

    def short(x):
        short_calls.append(x.shape[0])
        return F.linear(x, lin.weight, lin.bias)

    fast = PackedLinear(lin, short)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for rows in (1, 2, 3, 4, 5, 8, 17):
        x = torch.randn(rows, 40, generator=torch.Generator().manual_seed(rows)).to(dtype)
        got = fast(x)
        assert got.shape == (rows, 96) and got.dtype == dtype
        assert torch.allclose(got.float(), F.linear(x, lin.weight, lin.bias).float(), atol=tol, rtol=tol), rows
    # blocks shorter than FROM_ROWS go through the short path, the rest through the packed weight
    assert short_calls == [r for r in (1, 2, 3, 4, 5, 8, 17) if r < FROM_ROWS[dtype]]


def test_packed_linear_reads_strided_rows():
    lin = _linear(32, 24, True, torch.float32)
    x = torch.randn(24, 6).t()  # [6, 24], not contiguous
    assert torch.allclose(PackedLinear(lin, F.linear)(x), F.linear(x, lin.weight, lin.bias), atol=1e-5)


def test_a_weight_is_packed_once_and_again_when_it_changes():
    lin = _linear(48, 16, False, torch.float32)
    first = packed_weight(lin)
    assert packed_weight(lin) is first  # a second runner reuses it
    x = torch.randn(6, 16)
    with torch.no_grad():
        lin.weight.mul_(2)  # changed in place: the version counter moves
    second = packed_weight(lin)
    assert second is not first
    assert torch.allclose(PackedLinear(lin, F.linear)(x), F.linear(x, lin.weight), atol=1e-5)
    lin.weight = nn.Parameter(torch.randn(48, 16))  # replaced
    assert packed_weight(lin) is not second
    assert torch.allclose(PackedLinear(lin, F.linear)(x), F.linear(x, lin.weight), atol=1e-5)


def test_weights_it_cannot_pack_are_refused_by_name():
    with pytest.raises(ValueError, match="float16"):
        packed_weight(_linear(8, 8, False, torch.float16))
    assert not packed.can_pack(torch.zeros(8, 8, dtype=torch.float16))
    assert not packed.can_pack(torch.zeros(8))
    assert packed.can_pack(torch.zeros(8, 8)) and packed.can_pack(torch.zeros(8, 8, dtype=torch.bfloat16)) == BF16


def test_the_rule_packs_on_intel_with_onednn_and_obeys_the_override():
    assert packed_rule("GenuineIntel", onednn=True)
    assert not packed_rule("AuthenticAMD", onednn=True)  # not measured there
    assert not packed_rule("", onednn=True)
    assert not packed_rule("GenuineIntel", onednn=False)
    assert packed_rule("AuthenticAMD", True, "1") and not packed_rule("GenuineIntel", True, "0")
    assert not packed_rule("AuthenticAMD", False, "1")  # nothing to pack with
    assert packed_rule("GenuineIntel", True, "")
    with pytest.raises(ValueError, match="SPECDEC_PACKED_WEIGHTS must be 0 or 1"):
        packed_rule("GenuineIntel", True, "yes")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_lean_loop_through_packed_weights_keeps_the_hf_modules_numbers_and_tokens(arch):
    """Blocks of 1, 4 and 13 rows (a decode step, a verification, a prefill) through packed weights: the
    HF modules' logits to rounding and the same greedy tokens; packed=False keeps F.linear everywhere."""
    model = build(arch, seed=1, scale=3.0)
    tokens = torch.randint(3, VOCAB, (24,), generator=torch.Generator().manual_seed(5))
    chunks = [13, 1, 4, 1, 5]
    ref = _logits(ModelRunner, model, tokens, chunks)
    got = _logits(lambda *a: LeanRunner(*a, short_blocks=False, packed=True), model, tokens, chunks)
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4) and torch.equal(got.argmax(-1), ref.argmax(-1))
    for packed_on in (True, False):
        pool = PagePool(8, 8)
        runner = LeanRunner(model, pool, BlockTable(pool), short_blocks=False, packed=packed_on)
        linears = (runner.layers[0].o, runner.layers[-1].down, runner.head)
        assert all(isinstance(lin, PackedLinear) == packed_on for lin in linears)
        # float32 q/k/v and gate/up: joined for blocks of FROM_ROWS rows or more, part by part below
        assert all((L.qkv_long is not None and L.gate_up_long is not None) == packed_on for L in runner.layers)
        assert all(not isinstance(f, PackedLinear) for f in (runner.layers[0].q, runner.layers[0].up))


def test_the_lean_loop_follows_the_machine_rule(monkeypatch):
    model = build("llama", seed=1)
    for rule in (False, True):
        monkeypatch.setattr(packed, "PACKED", rule)
        pool = PagePool(4, 8)
        runner = LeanRunner(model, pool, BlockTable(pool))
        assert isinstance(runner.layers[0].down, PackedLinear) == rule
        assert (runner.layers[0].gate_up_long is not None) == rule
        for quantized in (int8_draft(model), int4_draft(model)):
            runner = LeanRunner(quantized, pool, BlockTable(pool))  # computes in bfloat16: packs where it can
            assert isinstance(runner.layers[0].up, PackedQuantizedLinear) == (rule and BF16)


def test_the_packed_weights_switch_overrides_the_rule_for_runners_made_inside_and_restores_it(monkeypatch):
    """packed_weights() (the head trainer's answer batches): runners made inside pack whatever the machine's rule,
    runners made after follow the rule again, also when the block raised."""
    model = build("llama", seed=1)
    pool = PagePool(4, 8)
    monkeypatch.setattr(packed, "PACKED", False)
    with packed.packed_weights():
        inside = LeanRunner(model, pool, BlockTable(pool))
    assert isinstance(inside.layers[0].down, PackedLinear) == torch.backends.mkldnn.is_available()
    assert packed.PACKED is False and not isinstance(LeanRunner(model, pool, BlockTable(pool)).layers[0].down,
                                                     PackedLinear)
    with pytest.raises(RuntimeError), packed.packed_weights():
        raise RuntimeError("inside")
    assert packed.PACKED is False


def test_a_cpu_that_cannot_pack_bfloat16_keeps_those_weights_on_f_linear(monkeypatch):
    monkeypatch.setattr(packed, "onednn_packs", lambda dtype: dtype == torch.float32)
    assert not packed.can_pack(_linear(8, 8, False, torch.bfloat16).weight)
    assert packed.can_pack(_linear(8, 8, False, torch.float32).weight)
    assert not packed.can_pack_quantized(_int8_linear(16, 16, False))
    with pytest.raises(ValueError, match="bfloat16"):
        packed_weight(_linear(8, 8, False, torch.bfloat16))


def _int8_linear(out_f: int, in_f: int, bias: bool, dtype=torch.bfloat16) -> Int8Linear:
    return Int8Linear(_linear(out_f, in_f, bias, torch.float32, seed=3), dtype, fused=True)


def _int4_linear(out_f: int, in_f: int, bias: bool) -> Int4Linear:
    return Int4Linear(_linear(out_f, in_f, bias, torch.float32, seed=3), group_size=32)


@needs_bf16_packing
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_a_quantized_linear_multiplies_long_blocks_through_its_dequantized_weight(bias, bits, monkeypatch):
    """Short blocks: the int8 / int4 kernel's own numbers, bit for bit. From FROM_ROWS_QUANTIZED rows (int8:
    FROM_ROWS_INT8, int4: FROM_ROWS_INT4): x @ W.T with W dequantized once to bfloat16, not the kernel
    (counted)."""
    lin = _int8_linear(96, 64, bias) if bits == 8 else _int4_linear(96, 64, bias)
    from_rows = packed.FROM_ROWS_INT8 if bits == 8 else packed.FROM_ROWS_INT4
    kernel_rows = []
    own = lin.forward_2d
    kernel = lin.bound_forward()

    def counted(x):
        kernel_rows.append(x.shape[0])
        return kernel(x)

    monkeypatch.setattr(lin, "bound_forward", lambda: counted)
    fast = PackedQuantizedLinear(lin)
    dequantized = lin.dequantized().float()
    sizes = (1, 4, from_rows - 1, from_rows, from_rows + 4, 17)
    for rows in sizes:
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        got = fast(x)
        assert got.shape == (rows, 96) and got.dtype == torch.bfloat16
        ref = x.float() @ dequantized.T + (lin.bias.float() if bias else 0)
        assert torch.allclose(got.float(), ref, atol=3e-2, rtol=2e-2), rows
        if rows < from_rows:
            assert torch.equal(got, own(x))
    assert kernel_rows == [r for r in sizes if r < from_rows]


@needs_bf16_packing
def test_an_int8_weight_is_dequantized_once_and_again_when_it_changes():
    lin = _int8_linear(48, 16, False)
    first = packed_dequantized(lin)
    assert packed_dequantized(lin) is first
    with torch.no_grad():
        lin.qweight.neg_()  # changed in place
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    assert packed_dequantized(lin) is not first
    assert torch.allclose(PackedQuantizedLinear(lin)(x).float(), lin.forward_2d(x).float(), atol=3e-2, rtol=2e-2)


def test_int8_linears_computing_in_float16_stay_on_their_kernel():
    lin = _int8_linear(16, 16, False, dtype=torch.float16)
    assert not packed.can_pack_quantized(lin)
    with pytest.raises(ValueError, match="float16"):
        packed_dequantized(lin)


@needs_bf16_packing
@pytest.mark.parametrize("quantize", [int8_draft, int4_draft])
def test_a_quantized_draft_prefills_through_dequantized_weights_with_the_hf_modules_tokens(quantize, monkeypatch):
    """An int8 / int4 draft's lean loop (prefill of 13, then 1, 4, 1 and 6 tokens: blocks on both sides of
    its FROM_ROWS_QUANTIZED, set to 5 here for int4 as well) keeps the logits (to bfloat16 rounding) and
    greedy tokens of the same draft through HF's modules."""
    monkeypatch.setitem(packed.FROM_ROWS_QUANTIZED, Int4Linear, 5)
    q8 = quantize(build("llama", seed=1, scale=3.0))
    tokens = torch.randint(3, VOCAB, (25,), generator=torch.Generator().manual_seed(5))
    chunks = [13, 1, 4, 1, 6]
    ref = _logits(ModelRunner, q8, tokens, chunks)
    got = _logits(lambda *a: LeanRunner(*a, packed=True), q8, tokens, chunks)
    tol = 2e-2 * ref.abs().max().item()  # bfloat16 rounding, summed in another order
    assert torch.allclose(got, ref, atol=tol)
    top2 = ref.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 2 * tol  # rows without a near-tie (bfloat16 may swap those)
    assert clear.sum() >= 20 and torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])


@needs_bf16_packing
@pytest.mark.parametrize("bias", [False, True])
def test_joined_linears_give_each_parts_numbers_in_one_product(bias):
    """q, k and v (gate and up) of a bfloat16 model as one packed product (PackedJoined): each part's columns
    are that part's product to rounding (bit for bit on the Xeon measured, for blocks up to 64 rows), packed
    once; what cannot join is refused."""
    from specdec.hf.packed import PackedJoined, can_join

    parts = [_linear(o, 48, bias, torch.bfloat16, seed=o) for o in (48, 16, 16)]
    fast = PackedJoined(parts)
    assert PackedJoined(parts).packed is fast.packed  # packed once, reused
    for rows in (1, 3, 4, 17):
        x = torch.randn(rows, 48, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        got = fast(x)
        assert got.shape == (rows, 80)
        for part, cols in zip(parts, got.split([48, 16, 16], dim=1)):
            assert torch.allclose(cols.float(), F.linear(x, part.weight, part.bias).float(), atol=2e-2, rtol=2e-2)
    with torch.no_grad():
        parts[1].weight.mul_(2)  # changed in place: packed again
    again = PackedJoined(parts)
    assert again.packed is not fast.packed
    x = torch.randn(2, 48).to(torch.bfloat16)
    assert torch.allclose(again(x)[:, 48:64].float(), F.linear(x, parts[1].weight, parts[1].bias).float(),
                          atol=2e-2, rtol=2e-2)
    assert not can_join([parts[0], _linear(8, 48, bias, torch.float32)])  # another dtype
    assert not can_join([parts[0], _linear(8, 40, bias, torch.bfloat16)])  # another input width
    assert not can_join([parts[0], _linear(8, 48, not bias, torch.bfloat16)])  # a bias on one only
    with pytest.raises(ValueError, match="join"):
        PackedJoined([parts[0], _linear(8, 40, bias, torch.bfloat16)])


@needs_bf16_packing
def test_a_bfloat16_lean_loop_joins_its_products_and_keeps_the_hf_modules_tokens():
    model = build("qwen2", seed=4).to(torch.bfloat16)  # Qwen2: q/k/v with biases
    pool = PagePool(8, 8)
    runner = LeanRunner(model, pool, BlockTable(pool), short_blocks=False, packed=True)
    assert all(L.qkv is not None and L.gate_up is not None and L.q is None for L in runner.layers)
    tokens = torch.randint(3, VOCAB, (20,), generator=torch.Generator().manual_seed(3))
    chunks = [9, 1, 4, 1, 5]
    ref = _logits(ModelRunner, model, tokens, chunks)
    got = _logits(lambda *a: LeanRunner(*a, short_blocks=False, packed=True), model, tokens, chunks)
    assert torch.equal(ref.argmax(-1), got.argmax(-1))
    assert torch.allclose(ref, got, atol=5e-2, rtol=5e-2)
