"""Short blocks multiplied weight-first (hf/linear.py): F.linear's numbers to rounding, on the path it claims,
where the machine's rule puts it."""
import pytest
import torch
import torch.nn.functional as F

from specdec.hf import linear
from specdec.hf.linear import linear_rows, short_block_rows, weight_first_rows


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 12])
@pytest.mark.parametrize("bias", [False, True])
def test_weight_first_rows_equal_f_linear_to_rounding_for_any_row_count(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(rows, 40, generator=g)
    got = weight_first_rows(x, w, b)
    assert got.shape == (rows, 96) and got.is_contiguous()
    assert torch.allclose(got, F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    assert torch.allclose(linear_rows(x, w, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_weight_first_rows_keep_leading_dimensions_and_read_strided_input():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 24, generator=g)
    x = torch.randn(24, 4, generator=g).t()  # [4, 24], not contiguous
    assert torch.allclose(weight_first_rows(x, w), F.linear(x, w), atol=1e-5)
    x3 = torch.randn(1, 3, 24, generator=g)
    assert weight_first_rows(x3, w).shape == (1, 3, 32)
    assert torch.allclose(weight_first_rows(x3, w), F.linear(x3, w), atol=1e-5)


def _count_mm(monkeypatch) -> list:
    calls = []
    real_mm = torch.mm
    monkeypatch.setattr(linear.torch, "mm", lambda a, b: calls.append(tuple(b.shape)) or real_mm(a, b))
    return calls


def test_the_weight_first_path_is_taken_for_short_float32_blocks_only(monkeypatch):
    calls = _count_mm(monkeypatch)
    w = torch.randn(16, 8)
    weight_first_rows(torch.randn(1, 8), w)
    weight_first_rows(torch.randn(6, 8), w)
    assert calls == [(8, 2), (8, 6)]  # one row doubled to two; xᵀ is [in, n]
    weight_first_rows(torch.randn(7, 8), w)  # past SHORT_BLOCK_ROWS
    weight_first_rows(torch.randn(2, 8, dtype=torch.bfloat16), w.bfloat16())  # not float32
    weight_first_rows(torch.randn(3, 8), w, max_rows=2)
    assert len(calls) == 2


@pytest.mark.parametrize("rows_on_this_machine", [0, 6])
def test_linear_rows_follows_the_machine_rule(monkeypatch, rows_on_this_machine):
    monkeypatch.setattr(linear, "WEIGHT_FIRST_MAX_ROWS", rows_on_this_machine)
    monkeypatch.setattr(linear, "ROW_KERNEL_OVERRIDE", "0")  # the row kernel's own rule: tests/test_cpu_rows.py
    calls = _count_mm(monkeypatch)
    w = torch.randn(16, 8)
    linear_rows(torch.randn(2, 8), w)
    assert len(calls) == (1 if rows_on_this_machine else 0)
    assert linear.weight_first(w) == bool(rows_on_this_machine)


def test_the_rule_turns_weight_first_on_only_for_mkl_off_intel_and_obeys_the_override():
    six = linear.SHORT_BLOCK_ROWS
    assert short_block_rows("AuthenticAMD", blas_is_mkl=True) == six  # MKL's generic paths
    assert short_block_rows("GenuineIntel", blas_is_mkl=True) == 0  # MKL's own kernels are fast
    assert short_block_rows("AuthenticAMD", blas_is_mkl=False) == 0  # another BLAS: not measured, keep F.linear
    assert short_block_rows("", blas_is_mkl=True) == 0  # vendor unknown
    assert short_block_rows("GenuineIntel", True, "1") == six
    assert short_block_rows("AuthenticAMD", True, "0") == 0
    assert short_block_rows("AuthenticAMD", True, "") == six
    with pytest.raises(ValueError, match="SPECDEC_WEIGHT_FIRST must be 0 or 1"):
        short_block_rows("GenuineIntel", True, "yes")


@pytest.mark.parametrize("step", ["auto", "bitwise"])
def test_a_model_through_its_own_modules_takes_the_short_block_products_except_bitwise(monkeypatch, step):
    """Gemma 2 (no lean loop: the HF modules run it): with the machine's short-block rule on, its nn.Linear
    modules multiply through linear_rows during specdec's forwards, the greedy output stays HF's, and every
    module's own forward is back afterwards; step="bitwise" keeps F.linear (HF's logits bit for bit)."""
    import specdec
    from conftest import build, hf_greedy

    model = build("gemma2", seed=1, scale=3.0)
    monkeypatch.setattr(linear, "short_blocks_on", lambda: True)
    calls = []
    real = linear.linear_rows
    monkeypatch.setattr(linear, "linear_rows", lambda *a: calls.append(a[1].shape) or real(*a))
    prompt = torch.tensor([[3, 17, 22, 5, 9]])
    out = specdec.generate(model, prompt, drafter="ngram", max_new_tokens=16, step=step,
                           return_dict_in_generate=True)
    assert out.stats.step == "hf"
    assert torch.equal(out.sequences, hf_greedy(model, prompt, 16))
    lm_head = model.get_output_embeddings().weight.shape
    assert (lm_head in calls) == (step == "auto")  # the LM head among the products
    assert not any("forward" in vars(m) for m in model.modules())
