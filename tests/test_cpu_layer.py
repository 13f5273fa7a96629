"""specdec's CPU decoder-layer kernel (kernels/cpu_layer.py): one Llama-family layer of a step (and Qwen3's and
Gemma 3's forms of it) to float32 rounding of its torch reference (HF's modules' arithmetic), bfloat16 rounded
where they round; the page write; biases and GQA; clear errors naming the weight, written nothing."""
import pytest
import torch

from specdec.kernels import cpu_layer, cpu_library

pytestmark = pytest.mark.skipif(not cpu_library.cpu_supports(), reason="the kernel needs an x86 CPU with AVX2 and FMA")


@pytest.fixture(scope="module", autouse=True)
def loaded():
    assert cpu_library.load() is None


def _layer(n, dtype, H=96, Hq=6, Hkv=2, D=16, I=200, prefix=40, biases=True, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g) / 10

    weights = [torch.rand(H, generator=g) + 0.5, r(Hq * D, H), r(Hkv * D, H), r(Hkv * D, H), r(H, Hq * D),
               torch.rand(H, generator=g) + 0.5, r(I, H), r(I, H), r(H, I)]
    bias = [r(Hq * D), None, r(Hkv * D)] if biases else [None, None, None]
    pos = torch.arange(n) + prefix
    freqs = torch.outer(pos.float(), 1 / 10000 ** (torch.arange(0, D, 2).float() / D))
    emb = torch.cat([freqs, freqs], -1)
    sin = torch.cat([-emb.sin()[:, :D // 2], emb.sin()[:, D // 2:]], -1)
    read = torch.randperm(128, generator=g)[:prefix + n]
    mask = None if n == 1 else torch.cat([torch.ones(n, prefix, dtype=torch.bool),
                                          torch.tril(torch.ones(n, n, dtype=torch.bool))], 1)
    to = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    return dict(x=torch.randn(n, H, generator=g).to(dtype), weights=[to(w) for w in weights],
                qkv_bias=[to(b) for b in bias], cos=emb.cos().to(dtype), sin=sin.to(dtype),
                k_pages=torch.randn(128, Hkv, D, generator=g).to(dtype),
                v_pages=torch.randn(128, Hkv, D, generator=g).to(dtype), write_slots=read[prefix:], read_slots=read,
                mask=mask, scale=D ** -0.5, eps=1e-5, heads=Hq, kv_heads=Hkv)


def _own_pages(args: dict) -> dict:
    """args with pages of its own (copies): the reference writes its keys and values apart from the kernel's."""
    return dict(args, k_pages=args["k_pages"].clone(), v_pages=args["v_pages"].clone())


@pytest.mark.parametrize("n", [1, 2, 5, 16, 17, 32])
@pytest.mark.parametrize("dtype, dot", [
    (torch.float32, False), (torch.bfloat16, False),
    pytest.param(torch.bfloat16, True, marks=pytest.mark.skipif(not cpu_library.bf16_dot_here(),
                                                                reason="no AVX512-BF16 path here (CPU or compiler)"))])
@pytest.mark.parametrize("biases", [True, False])
def test_the_layer_is_its_reference_to_rounding(n, dtype, dot, biases):
    """bfloat16 products on AVX2 and (where the CPU has them) on AVX512-BF16 dot products."""
    args = _layer(n, dtype, biases=biases, seed=n)
    ref_args = _own_pages(args)
    ref = cpu_layer.decoder_layer_ref(**ref_args)
    with cpu_library.bf16_dot(dot):
        got = cpu_layer.decoder_layer(**args)
    assert got.shape == args["x"].shape and got.dtype == dtype
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.05, rtol=0.02)
    assert torch.allclose(got.float(), ref.float(), **tol)
    for name in ("k_pages", "v_pages"):  # the new keys and values written to their slots
        assert torch.allclose(args[name].float(), ref_args[name].float(), **tol)
        untouched = torch.ones(args[name].shape[0], dtype=torch.bool)
        untouched[args["write_slots"]] = False
        assert torch.equal(args[name][untouched], ref_args[name][untouched])
    if dtype == torch.bfloat16:  # rounded where HF rounds: nearly always the very same bfloat16 values
        assert (got == ref).float().mean() > 0.95


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_widths_off_the_vector_lanes_take_the_scalar_tails(dtype):
    """A head dimension whose half is not a multiple of 8 (RoPE one lane at a time), hidden and MLP widths
    that are not multiples of 8 (norm, residual, SiLU x up and rounding tails): still the reference."""
    args = _layer(3, dtype, H=100, D=24, I=203, seed=5)
    ref = cpu_layer.decoder_layer_ref(**_own_pages(args))
    got = cpu_layer.decoder_layer(**args)
    if dtype == torch.float32:
        assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5)
    else:
        assert torch.allclose(got.float(), ref.float(), atol=0.05, rtol=0.02) and (got == ref).float().mean() > 0.95


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_given_qkv_input_replaces_the_input_norm(dtype):
    """EAGLE-3's midlayer: q, k, v multiply a caller's [n, 2H] input (its embedding and hidden normalised side by
    side), the residual is x: the reference's layer with that input, and not the layer over x's own norm."""
    H = 96
    args = _layer(4, dtype, seed=9)
    g = torch.Generator().manual_seed(3)
    for j in (1, 2, 3):  # q, k, v over 2H
        args["weights"][j] = (torch.randn(args["weights"][j].shape[0], 2 * H, generator=g) / 10).to(dtype)
    args["qkv_input"] = torch.randn(4, 2 * H, generator=g).to(dtype)
    ref = cpu_layer.decoder_layer_ref(**_own_pages(args))
    got = cpu_layer.decoder_layer(**args)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.05, rtol=0.02)
    assert torch.allclose(got.float(), ref.float(), **tol)
    halved = dict(args, qkv_input=args["qkv_input"][:, :H].contiguous(),
                  weights=[w[:, :H].contiguous() if j in (1, 2, 3) else w for j, w in enumerate(args["weights"])])
    assert not torch.allclose(cpu_layer.decoder_layer(**halved).float(), ref.float(), **tol)
    with pytest.raises(RuntimeError, match="the q weight should be \\[96, 96\\]"):
        cpu_layer.decoder_layer(**dict(args, qkv_input=None))


def _with_form(args, form: str, seed: int):
    """args given Qwen3's parts (q/k norms) or Gemma 3's (q/k norms, sandwich and (1 + w) norms, GELU tanh)."""
    g = torch.Generator().manual_seed(seed)
    dtype, D, H = args["x"].dtype, args["k_pages"].shape[2], args["x"].shape[1]
    norm = lambda size: (torch.rand(size, generator=g) + 0.5).to(dtype)  # noqa: E731
    extra = dict(q_norm=norm(D), k_norm=norm(D))
    if form == "gemma3":
        extra.update(attn_out_norm=norm(H), mlp_out_norm=norm(H), offset_norms=True, activation="gelu_pytorch_tanh")
    return dict(args, **extra)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nan_or_inf_input_spreads_as_the_reference_spreads_it(dtype, bad):
    """A broken hidden state must not come out as numbers: a NaN or an infinity in one row's input gives NaN
    exactly where the reference gives it (no max, exp or rounding step of the kernel's turns it back into
    numbers), in the output and in the keys written to the pages."""
    args = _layer(4, dtype, seed=2)
    args["x"][1, 5] = bad
    ref_args = _own_pages(args)
    ref = cpu_layer.decoder_layer_ref(**ref_args)
    got = cpu_layer.decoder_layer(**args)
    assert torch.isnan(got).any() and torch.equal(torch.isnan(got), torch.isnan(ref))
    assert torch.equal(torch.isnan(args["k_pages"]), torch.isnan(ref_args["k_pages"]))
    prefix = args["read_slots"][:-len(args["write_slots"])]
    assert not torch.isnan(args["k_pages"][prefix]).any()  # the prefix's pages untouched


@pytest.mark.parametrize("n", [1, 5, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", ["qwen3", "gemma3"])
def test_qwen3_and_gemma3_layers_are_their_reference_to_rounding(n, dtype, form):
    """The parts Qwen3 and Gemma 3 add: the reference's layer to rounding (bfloat16 rounded where HF rounds),
    and each part changes the result (dropping one is caught)."""
    args = _with_form(_layer(n, dtype, biases=False, seed=20 + n), form, seed=n)
    ref = cpu_layer.decoder_layer_ref(**_own_pages(args))
    got = cpu_layer.decoder_layer(**_own_pages(args))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.05, rtol=0.02)
    assert torch.allclose(got.float(), ref.float(), **tol)
    if dtype == torch.bfloat16:
        assert (got == ref).float().mean() > 0.9
    parts = [dict(q_norm=None, k_norm=None)]
    if form == "gemma3":
        parts += [dict(attn_out_norm=None, mlp_out_norm=None), dict(offset_norms=False), dict(activation="silu")]
    for part in parts:
        assert not torch.allclose(cpu_layer.decoder_layer(**_own_pages(dict(args, **part))).float(), ref.float(), **tol), part


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(q_norm=torch.ones(16)), "q_norm and k_norm both or neither"),
    (lambda a: a.update(q_norm=torch.ones(8), k_norm=torch.ones(8)), "q_norm should be \\[16\\]"),
    (lambda a: a.update(attn_out_norm=torch.ones(96)), "attn_out_norm and mlp_out_norm both or neither"),
    (lambda a: a.update(activation="relu"), 'activation "silu" or "gelu_pytorch_tanh", got "relu"'),

    (lambda a: a["weights"].__setitem__(6, a["weights"][6][:, :10]), "the gate weight should be \\[200, 96\\]"),
    (lambda a: a["weights"].pop(), "9 weights and 3 q/k/v biases"),
    (lambda a: a["weights"].__setitem__(4, a["weights"][4].t().contiguous().t()), "o weight should be contiguous"),
    (lambda a: a["qkv_bias"].__setitem__(0, torch.zeros(5)), "the q bias should be \\[96\\]"),
    (lambda a: a.update(cos=a["cos"][:, :8]), "cos, sin \\[n, D\\]"),
    (lambda a: a.update(x=a["x"].half()), "float32 or bfloat16"),
    (lambda a: a.update(kv_heads=4), "heads a multiple of kv_heads"),
    (lambda a: a.update(read_slots=a["read_slots"] + 1000), "read slot 10[0-9][0-9] outside the pages"),
])
def test_bad_input_gets_an_error_naming_it_and_writes_nothing(change, message):
    args = _layer(2, torch.float32)
    change(args)
    before = args["k_pages"].clone()
    with pytest.raises(RuntimeError, match=message):
        cpu_layer.decoder_layer(**args)
    assert torch.equal(args["k_pages"], before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [False, True])
def test_the_final_norm_op_is_hfs_norm_to_rounding(dtype, offset):
    """rms_norm_rows (the compiled step's final norm) against transformers' own RMSNorm modules: Llama's (the row
    rounded, then times w) and Gemma 3's ((1 + w) in float32, rounded once); a norm without its weight fails."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 100, generator=g) * 3).to(dtype)  # 100: the scalar tail after 96 vector lanes
    norm = Gemma3RMSNorm(100, eps=1e-6) if offset else LlamaRMSNorm(100, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(100, generator=g) / 4 + (0 if offset else 1))
    norm = norm.to(dtype)
    eps = norm.eps if offset else norm.variance_epsilon
    with torch.no_grad():
        ref = norm(x)
    got = cpu_layer.rms_norm_rows(x, norm.weight, eps, offset)
    assert got.dtype == dtype and got.shape == x.shape
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1 / 64, atol=1e-3)  # bf16: 1-2 ulp
    torch.testing.assert_close(got.float(), ref.float(), **tol)
    unweighted = cpu_layer.rms_norm_rows(x, torch.zeros(100, dtype=dtype) if offset else torch.ones(100, dtype=dtype),
                                         eps, offset)
    assert not torch.allclose(unweighted.float(), ref.float(), **tol)


def test_the_final_norm_op_names_a_bad_weight():
    with pytest.raises(RuntimeError, match=r"weight \[8\], contiguous, of x's dtype"):
        cpu_layer.rms_norm_rows(torch.randn(2, 8), torch.ones(9), 1e-5)
    with pytest.raises(RuntimeError, match=r"weight \[8\], contiguous, of x's dtype"):
        cpu_layer.rms_norm_rows(torch.randn(2, 8), torch.ones(8, dtype=torch.bfloat16), 1e-5)
