"""specdec's CPU row kernel (kernels/cpu_rows.py): the product to float32 rounding for every row count,
shape and dtype it takes; clear errors; hf/linear.py's rule puts short blocks on it, and off it with one
warning where it cannot load (the build itself: tests/test_cpu_library.py)."""
import warnings

import pytest
import torch
import torch.nn.functional as F

from specdec.hf import linear
from specdec.kernels import cpu_library, cpu_rows

pytestmark = pytest.mark.skipif(not cpu_library.cpu_supports(), reason="the row kernel needs an x86 CPU with AVX2 and FMA")


@pytest.fixture(scope="module", autouse=True)
def loaded():
    assert cpu_library.load() is None  # builds here: a compiler is present wherever inductor runs


# bfloat16's two paths: AVX2 (bfloat16 widened, float32 FMAs) everywhere, AVX512-BF16 dot products where the CPU
# has them (cpu_rows_bf16.h; on by default there)
needs_bf16_dot = pytest.mark.skipif(not cpu_library.bf16_dot_here(), reason="no AVX512-BF16 path here (CPU or compiler)")
BF16_PATHS = [pytest.param(False, id="avx2"), pytest.param(True, id="avx512-bf16", marks=needs_bf16_dot)]


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 17])
@pytest.mark.parametrize("dtype, dot", [(torch.float32, False), (torch.bfloat16, False),
                                        pytest.param(torch.bfloat16, True, marks=needs_bf16_dot)])
def test_the_kernel_is_the_product_to_rounding_for_every_row_count(rows, dtype, dot):
    g = torch.Generator().manual_seed(rows)
    # 203 output rows: blocks of 4 and 64 with remainders; 100 inputs: 12 vectors of 8 and a tail of 4 (3 steps
    # of 32 bfloat16 and a masked tail of 4 on AVX512-BF16)
    w, x, b = (torch.randn(203, 100, generator=g).to(dtype), torch.randn(rows, 100, generator=g).to(dtype),
               torch.randn(203, generator=g).to(dtype))
    ref = cpu_rows.rows_linear_ref(x, w, b)
    with cpu_library.bf16_dot(dot):
        got = cpu_rows.rows_linear(x, w, b)
    assert got.dtype == dtype and got.shape == (rows, 203)
    if dtype == torch.float32:
        assert torch.allclose(got, ref, atol=2e-5, rtol=1e-5)
    else:  # the same float32 sum rounded once to bfloat16: at most one bfloat16 step apart
        assert ((got.float() - ref.float()).abs() <= ref.float().abs() * 2 ** -7 + 1e-6).all()
    with cpu_library.bf16_dot(dot):
        no_bias = cpu_rows.rows_linear(x, w)
    assert torch.allclose(no_bias.float(), cpu_rows.rows_linear_ref(x, w).float(),
                          atol=2e-5 if dtype == torch.float32 else 0.1, rtol=1e-2)


@pytest.mark.parametrize("inputs", [8, 31, 32, 33, 64, 576])
@needs_bf16_dot
def test_the_bf16_dot_path_is_the_product_for_every_input_width(inputs):
    """Widths below, at and past one 32-wide step (masked tails of 8, 31 and 1): the exact product of the
    bfloat16 values (float64) rounded once, to within one bfloat16 step; bit for bit the AVX2 path's result
    wherever that one is exact too, which is nearly everywhere."""
    g = torch.Generator().manual_seed(inputs)
    w, x = torch.randn(37, inputs, generator=g).bfloat16(), torch.randn(11, inputs, generator=g).bfloat16()
    exact = (x.double() @ w.double().t()).float()
    with cpu_library.bf16_dot(True):
        dot = cpu_rows.rows_linear(x, w)
    with cpu_library.bf16_dot(False):
        avx2 = cpu_rows.rows_linear(x, w)
    assert ((dot.float() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-6).all()
    assert (dot == avx2).float().mean() > 0.97


def test_bf16_dot_runs_where_the_cpu_has_it_unless_turned_off():
    flags = "fpu avx2 fma avx512f avx512bw avx512vl avx512_bf16"
    assert cpu_library.bf16_dot_wanted(flags, None) and cpu_library.bf16_dot_wanted(flags, "1")
    assert not cpu_library.bf16_dot_wanted(flags, "0")
    assert not cpu_library.bf16_dot_wanted("fpu avx2 fma avx512f avx512bw avx512vl", "1")  # 1 cannot force it
    assert not cpu_library.bf16_dot_wanted("fpu avx2 fma", None)
    assert cpu_library.bf16_dot_on() == (cpu_library.bf16_dot_here() and cpu_library.BF16_DOT_OVERRIDE != "0")
    with cpu_library.bf16_dot(False):
        assert not cpu_library.bf16_dot_on() and "AVX512-BF16 dot" not in linear.machine()
    if not cpu_library.bf16_dot_here():
        with pytest.raises(RuntimeError, match="AVX512-BF16"):  # the CPU lacks it, or the compiler the path
            with cpu_library.bf16_dot(True):
                pass


def test_every_output_row_is_computed_whatever_the_thread_count():
    """Each thread's share of the weight rows is written (an output left as uninitialised memory would show
    as a mismatch), on one thread and on several."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(1030, 64, generator=g), torch.randn(5, 64, generator=g)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            assert torch.allclose(cpu_rows.rows_linear(x, w), F.linear(x, w), atol=2e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(before)


def test_strided_and_empty_inputs():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 24, generator=g)
    x = torch.randn(24, 3, generator=g).t()  # [3, 24], not contiguous
    assert torch.allclose(cpu_rows.rows_linear(x, w), F.linear(x, w), atol=1e-5)
    assert cpu_rows.rows_linear(torch.empty(0, 24), w).shape == (0, 40)


@pytest.mark.parametrize("x, w, b, message", [
    (torch.randn(2, 8), torch.randn(4, 9), None, "x \\[n, in\\] and weight \\[out, in\\]"),
    (torch.randn(2, 8), torch.randn(4, 8).bfloat16(), None, "both float32 or both bfloat16"),
    (torch.randn(2, 8).half(), torch.randn(4, 8).half(), None, "both float32 or both bfloat16"),
    (torch.randn(2, 8), torch.randn(8, 4).t(), None, "the weight must be contiguous"),
    (torch.randn(2, 8), torch.randn(4, 8), torch.randn(5), "bias \\[out\\]"),
])
def test_bad_input_gets_an_error_naming_it(x, w, b, message):
    with pytest.raises(RuntimeError, match=message):
        cpu_rows.rows_linear(x, w, b)


def test_compiled_graphs_call_the_kernel():
    """torch.compile sees the op through its fake implementation and calls the kernel: the same numbers
    as eager, fused arithmetic around it included."""
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(48, 32, generator=g), torch.randn(4, 32, generator=g)
    fn = torch.compile(lambda x, w: F.silu(cpu_rows.rows_linear(x, w)) * 2, dynamic=False)
    assert torch.allclose(fn(x, w), F.silu(cpu_rows.rows_linear(x, w)) * 2, atol=1e-6)


def _count_kernel_calls(monkeypatch) -> list:
    calls = []
    real = cpu_rows.rows_linear
    monkeypatch.setattr(cpu_rows, "rows_linear", lambda x, w, b=None: calls.append(x.shape[0]) or real(x, w, b))
    return calls


@pytest.mark.parametrize("long_bf16", [False, True])
@pytest.mark.parametrize("override, weight_first_rule, takes", [
    ("", 6, True), ("", 0, False), ("0", 6, False), ("1", 0, True)])
def test_short_blocks_take_the_kernel_where_the_rule_says(monkeypatch, override, weight_first_rule, takes, long_bf16):
    """On where the weight-first rule is (MKL off Intel), or SPECDEC_ROW_KERNEL=1; off with =0. Up to
    FLOAT32_KERNEL_ROWS rows float32, MAX_ROWS bfloat16 (any number where the BLAS has no bfloat16
    instructions: LONG_BF16_BLOCKS), through linear_rows and the lean loop's short_blocks_linear; longer
    blocks and float16 weights never."""
    monkeypatch.setattr(linear, "ROW_KERNEL_OVERRIDE", override)
    monkeypatch.setattr(linear, "WEIGHT_FIRST_MAX_ROWS", weight_first_rule)
    monkeypatch.setattr(linear, "LONG_BF16_BLOCKS", long_bf16)
    calls = _count_kernel_calls(monkeypatch)
    expected = []
    for dtype, limit in ((torch.float32, linear.FLOAT32_KERNEL_ROWS),
                         (torch.bfloat16, 300 if long_bf16 else cpu_rows.MAX_ROWS)):
        w = torch.randn(16, 8).to(dtype)
        for rows in (1, limit, limit + 1):
            x = torch.randn(rows, 8).to(dtype)
            for y in (linear.linear_rows(x, w), linear.short_blocks_linear(w)(x)):
                assert torch.allclose(y.float(), F.linear(x, w).float(), atol=1e-5 if dtype == torch.float32 else 0.1)
        expected += [1, 1, limit, limit] + ([limit + 1] * 2 if dtype == torch.bfloat16 and long_bf16 else [])
    linear.linear_rows(torch.randn(2, 8).half(), torch.randn(16, 8).half())
    assert calls == (expected if takes else [])


def test_under_bfloat16_autocast_a_float32_weight_multiplies_as_autocast_says(monkeypatch):
    """A head trained under bfloat16 autocast (--precision auto where bfloat16 is native: an AMD EPYC with
    AVX512-BF16 took the kernel for its float32 weights) hands linear_rows bfloat16 rows and a float32
    weight: the product is F.linear's under autocast, not the kernel's refusal of mixed dtypes."""
    monkeypatch.setattr(linear, "ROW_KERNEL_OVERRIDE", "1")
    calls = _count_kernel_calls(monkeypatch)
    w = torch.randn(16, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x = F.linear(torch.randn(3, 8), torch.randn(8, 8))  # bfloat16, as autocast's own products give
        y = linear.linear_rows(x, w)
        ref = F.linear(x, w)
    assert x.dtype == torch.bfloat16 and y.dtype == ref.dtype and torch.equal(y, ref) and calls == []
    assert linear.linear_rows(x.float(), w).dtype == torch.float32 and calls == [3]  # outside autocast: the kernel


def test_long_bfloat16_blocks_take_the_kernel_only_where_the_cpu_lacks_bfloat16_instructions():
    assert linear.bf16_gemm_emulated("fpu sse2 avx2 fma")
    assert not linear.bf16_gemm_emulated("avx2 avx512f avx512_bf16")
    assert not linear.bf16_gemm_emulated("avx2 avx512f amx_tile amx_bf16")
    assert linear.bf16_gemm_emulated("")


def test_where_the_kernel_cannot_load_one_warning_names_why_and_weight_first_serves(monkeypatch):
    monkeypatch.setattr(linear, "ROW_KERNEL_OVERRIDE", "1")
    monkeypatch.setattr(cpu_library, "load", lambda: "no C++ compiler ('c++' not found; set CXX)")
    linear._loaded.cache_clear()
    try:
        with pytest.warns(UserWarning, match="row kernel is off.*no C\\+\\+ compiler"):
            assert not linear.row_kernel_ready()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once
            w, x = torch.randn(16, 8), torch.randn(3, 8)
            assert torch.allclose(linear.linear_rows(x, w), F.linear(x, w), atol=1e-5)
            assert "row kernel off: no C++ compiler" in linear.machine()
    finally:
        linear._loaded.cache_clear()


def test_the_override_must_be_0_or_1():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import specdec.hf.linear"], capture_output=True, text=True,
                          env={"SPECDEC_ROW_KERNEL": "yes", "PATH": "/usr/bin:/bin"})
    assert done.returncode != 0 and "SPECDEC_ROW_KERNEL must be 0 or 1, got 'yes'" in done.stderr
