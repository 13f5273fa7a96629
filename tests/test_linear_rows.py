"""Short blocks multiplied weight-first (hf/linear.py): F.linear's numbers to rounding, on the path it claims."""
import pytest
import torch
import torch.nn.functional as F

from specdec.hf import linear
from specdec.hf.linear import linear_rows


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 12])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_rows_equals_f_linear_to_rounding_for_any_row_count(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(rows, 40, generator=g)
    got = linear_rows(x, w, b)
    assert got.shape == (rows, 96) and got.is_contiguous()
    assert torch.allclose(got, F.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_linear_rows_keeps_leading_dimensions_and_reads_strided_input():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 24, generator=g)
    x = torch.randn(24, 4, generator=g).t()  # [4, 24], not contiguous
    assert torch.allclose(linear_rows(x, w), F.linear(x, w), atol=1e-5)
    x3 = torch.randn(1, 3, 24, generator=g)
    assert linear_rows(x3, w).shape == (1, 3, 32)
    assert torch.allclose(linear_rows(x3, w), F.linear(x3, w), atol=1e-5)


def test_the_weight_first_path_is_taken_for_short_float32_blocks_only(monkeypatch):
    calls = []
    real_mm = torch.mm
    monkeypatch.setattr(linear.torch, "mm", lambda a, b: calls.append(tuple(b.shape)) or real_mm(a, b))
    w = torch.randn(16, 8)
    linear_rows(torch.randn(1, 8), w)
    linear_rows(torch.randn(6, 8), w)
    assert calls == [(8, 2), (8, 6)]  # one row doubled to two; xᵀ is [in, n]
    linear_rows(torch.randn(7, 8), w)  # past WEIGHT_FIRST_MAX_ROWS
    linear_rows(torch.randn(2, 8, dtype=torch.bfloat16), w.bfloat16())  # not float32
    monkeypatch.setattr(linear, "WEIGHT_FIRST_MAX_ROWS", 0)  # the switch
    linear_rows(torch.randn(2, 8), w)
    assert len(calls) == 2
