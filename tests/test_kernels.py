"""Kernels == references: tree attention (floats, calibrated tolerance) and KV compaction (bit-exact).

The Triton kernels run on CPU tensors in Triton's interpreter. triton.jit decides between compiling and
interpreting when a kernel is *defined*, so TRITON_INTERPRET=1 is set here before anything imports
triton; if some earlier test module already imported specdec.kernels without it, the kernel tests skip
(run `TRITON_INTERPRET=1 pytest tests/test_kernels.py`). The interpreter takes CPU tensors as they are
(no device handling needed); it stores bf16 as raw uint16, so the kernel upcasts after loading (see
specdec/kernels/tree_attention.py).

Float tolerance, calibrated against an fp64 reference: the kernel may be at most 2x worse than the torch
path in the same dtype, plus 2 ulps of the dtype at the output's scale (the kernel rounds the softmax
probabilities to V's dtype before P @ V, as a GPU flash kernel does; torch's CPU SDPA keeps them in fp32).
"""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before any import of triton

import random  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

try:
    import specdec  # noqa: F401
except ImportError:  # not installed: run from the checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import importlib  # noqa: E402

from specdec import kernels  # noqa: E402
from specdec.kernels import (  # noqa: E402
    compact_kv, compact_kv_ref, on_triton, slots_for, tree_attention, tree_attention_ref,
)

# the package exports functions named like their modules: fetch the modules themselves
ta_mod = importlib.import_module("specdec.kernels.tree_attention")
comp_mod = importlib.import_module("specdec.kernels.compaction")

INTERPRETED = getattr(ta_mod, "triton", None) is not None and \
    type(ta_mod._tree_attn_kernel).__name__ == "InterpretedFunction" and \
    type(comp_mod._copy_rows_kernel).__name__ == "InterpretedFunction"
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="triton missing, or imported before TRITON_INTERPRET=1 was set: "
                            "run TRITON_INTERPRET=1 pytest tests/test_kernels.py")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FAST = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------------------------------- builders


def ancestor_mask(parents):
    """parents[i] < i (parents[0] = -1, node 0 is the root) -> [n, n] ancestor-or-self mask."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def random_parents(rnd, n, kind):
    if kind == "chain":
        return [i - 1 for i in range(n)]
    if kind == "star":
        return [-1] + [0] * (n - 1)
    return [-1] + [rnd.randrange(i) for i in range(1, n)]


@dataclass
class Paged:
    k: torch.Tensor            # [P, S, Hkv, D]
    v: torch.Tensor
    block_table: torch.Tensor  # [max_pages] int32
    length: int                # positions 0..length-1 hold data; every other slot is NaN


def random_paged(g, length, page_size, num_kv_heads, head_dim, dtype=torch.float64, spare_pages=3):
    """Shuffled page ids, foreign pages and unwritten slots full of NaN (reading them would show)."""
    needed = -(-length // page_size)
    num_pages = needed + spare_pages
    k = torch.full((num_pages, page_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v = torch.full_like(k, float("nan"))
    block_table = torch.randperm(num_pages, generator=g)[: needed + 1].to(torch.int32)
    slots = slots_for(block_table, torch.arange(length), page_size)
    flat_k, flat_v = k.view(-1, num_kv_heads, head_dim), v.view(-1, num_kv_heads, head_dim)
    flat_k[slots] = torch.randn(length, num_kv_heads, head_dim, generator=g, dtype=torch.float64).to(dtype)
    flat_v[slots] = torch.randn(length, num_kv_heads, head_dim, generator=g, dtype=torch.float64).to(dtype)
    return Paged(k, v, block_table, length)


def dense_from_pages(pages, block_table, length):
    """Rebuild [length, ...] rows position by position with plain Python indexing."""
    page_size = pages.shape[-3]
    rows = []
    for p in range(length):
        page, off = int(block_table[p // page_size]), p % page_size
        rows.append(pages[..., page, off, :, :])
    return torch.stack(rows, dim=-3)


def naive_tree_attention(q, k_pages, v_pages, block_table, prefix_len, tree_mask, scale,
                         sliding_window=None, softcap=None, node_pos=None):
    """Dense, loop-per-(node, head), fp64: the definition, independent of both implementations."""
    n, num_q_heads, head_dim = q.shape
    T = prefix_len + n
    K = dense_from_pages(k_pages, block_table, T).double()   # [T, Hkv, D]
    V = dense_from_pages(v_pages, block_table, T).double()
    G = num_q_heads // K.shape[1]
    if node_pos is None:
        node_pos = torch.arange(prefix_len, prefix_len + n)
    key_pos = torch.cat([torch.arange(prefix_len), node_pos.long()])
    out = torch.zeros(n, num_q_heads, head_dim, dtype=torch.float64)
    for i in range(n):
        visible = torch.cat([torch.ones(prefix_len, dtype=torch.bool), tree_mask[i]])
        if sliding_window is not None:
            visible &= (node_pos[i] - key_pos) < sliding_window
        if not visible.any():
            continue
        for h in range(num_q_heads):
            s = K[visible, h // G] @ q[i, h].double() * scale
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            p = torch.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ V[visible, h // G]
    return out


@dataclass
class AttnCase:
    q: torch.Tensor
    paged: Paged
    prefix_len: int
    tree_mask: torch.Tensor
    scale: float
    kwargs: dict

    def args(self, dtype):
        return (self.q.to(dtype), self.paged.k.to(dtype), self.paged.v.to(dtype), self.paged.block_table,
                self.prefix_len, self.tree_mask, self.scale)


def make_case(seed, n, prefix_len, page_size, heads, head_dim, kind, window, softcap):
    rnd, g = random.Random(seed), torch.Generator().manual_seed(seed)
    num_q_heads, num_kv_heads = heads
    parents = random_parents(rnd, n, kind)
    tree_mask = ancestor_mask(parents)
    paged = random_paged(g, prefix_len + n, page_size, num_kv_heads, head_dim)
    q = torch.randn(n, num_q_heads, head_dim, generator=g, dtype=torch.float64) * rnd.choice([0.5, 1.0, 3.0])
    kwargs = {}
    if window is not None:
        kwargs["sliding_window"] = window
        kwargs["node_pos"] = prefix_len + tree_mask.sum(1) - 1  # prefix_len + depth
    if softcap is not None:
        kwargs["softcap"] = softcap
    return AttnCase(q, paged, prefix_len, tree_mask, head_dim ** -0.5, kwargs)


HEADS = [(1, 1), (2, 2), (4, 4), (2, 1), (4, 2), (4, 1)]  # (num_q_heads, num_kv_heads): MHA and GQA


@st.composite
def attn_cases(draw):
    case = make_case(
        seed=draw(st.integers(0, 2 ** 31 - 1)),
        n=draw(st.integers(1, 12)),
        prefix_len=draw(st.integers(0, 70)),
        page_size=draw(st.sampled_from([1, 3, 4, 16])),
        heads=draw(st.sampled_from(HEADS)),
        head_dim=draw(st.sampled_from([16, 32, 24])),  # 24: head_dim padded to a power of two
        kind=draw(st.sampled_from(["tree", "chain", "star"])),
        window=draw(st.one_of(st.none(), st.integers(1, 40))),
        softcap=draw(st.one_of(st.none(), st.sampled_from([2.0, 30.0]))),
    )
    tuning = dict(num_splits=draw(st.sampled_from([None, 1, 2, 3])),
                  block_m=draw(st.sampled_from([None, 16, 32])),
                  block_n=draw(st.sampled_from([16, 32, 64])))
    return case, tuning


def max_err(x, ref64):
    return (x.double() - ref64).abs().max().item()


# ------------------------------------------------------------------------- reference vs definition


def test_reference_matches_dense_naive():
    rnd = random.Random(0)
    for seed in range(40):
        case = make_case(seed, n=rnd.randint(1, 12), prefix_len=rnd.randint(0, 70),
                         page_size=rnd.choice([1, 3, 4, 16]), heads=rnd.choice(HEADS),
                         head_dim=rnd.choice([16, 32]), kind=rnd.choice(["tree", "chain", "star"]),
                         window=rnd.choice([None, None, 1, 5, 30]), softcap=rnd.choice([None, 5.0]))
        want = naive_tree_attention(*case.args(torch.float64), **case.kwargs)
        got = tree_attention_ref(*case.args(torch.float64), **case.kwargs)
        assert got.dtype == torch.float64 and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10, msg=f"seed {seed}")
        got32 = tree_attention_ref(*case.args(torch.float32), **case.kwargs)
        assert got32.dtype == torch.float32
        torch.testing.assert_close(got32.double(), want, rtol=0, atol=2e-5, msg=f"seed {seed} fp32")


def test_reference_tree_node_equals_its_path_as_a_chain():
    """A node's output depends only on its ancestors: run the path alone as a chain, same result."""
    g = torch.Generator().manual_seed(1)
    parents = [-1, 0, 0, 1, 2, 3, 3]
    n, prefix_len, page_size, heads, head_dim = len(parents), 9, 4, (4, 2), 16
    tree_mask = ancestor_mask(parents)
    paged = random_paged(g, prefix_len + n, page_size, heads[1], head_dim)
    q = torch.randn(n, heads[0], head_dim, dtype=torch.float64, generator=g)
    tree_out = tree_attention_ref(q, paged.k, paged.v, paged.block_table, prefix_len, tree_mask, 0.3)
    path = [0, 1, 3, 6]  # node 6's ancestors-or-self
    dense_k = dense_from_pages(paged.k, paged.block_table, prefix_len + n)
    dense_v = dense_from_pages(paged.v, paged.block_table, prefix_len + n)
    rows = list(range(prefix_len)) + [prefix_len + j for j in path]
    chain_k = dense_k[rows].reshape(-1, 1, heads[1], head_dim)  # page_size 1, identity block table
    chain_v = dense_v[rows].reshape(-1, 1, heads[1], head_dim)
    chain_mask = torch.ones(len(path), len(path), dtype=torch.bool).tril()
    chain_out = tree_attention_ref(q[path], chain_k, chain_v, torch.arange(len(rows), dtype=torch.int32),
                                   prefix_len, chain_mask, 0.3)
    torch.testing.assert_close(tree_out[path], chain_out, rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------- kernel vs reference


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@FAST
@given(data=attn_cases())
def test_tree_attention_kernel_matches_reference(dtype, data):
    case, tuning = data
    ref64 = tree_attention_ref(*case.args(torch.float64), **case.kwargs)
    out_torch = tree_attention_ref(*case.args(dtype), **case.kwargs)
    out = tree_attention(*case.args(dtype), **case.kwargs, **tuning)
    assert out.dtype == dtype and out.shape == case.q.shape and out.is_contiguous()
    assert torch.isfinite(out).all()
    eps = 2 * torch.finfo(dtype).eps * max(1.0, ref64.abs().max().item())
    assert max_err(out, ref64) <= 2 * max_err(out_torch, ref64) + eps


@needs_interpreter
def test_tree_attention_kernel_splits_agree():
    """Split-K over the prefix (any number of splits) gives the unsplit result."""
    case = make_case(7, n=6, prefix_len=70, page_size=3, heads=(4, 2), head_dim=16, kind="tree",
                     window=None, softcap=None)
    args = case.args(torch.float32)
    ref64 = tree_attention_ref(*case.args(torch.float64))
    one = tree_attention(*args, num_splits=1, block_n=16)
    for splits in (2, 3, 5, 70):
        many = tree_attention(*args, num_splits=splits, block_n=16)
        torch.testing.assert_close(many, one, rtol=0, atol=1e-6)
    assert max_err(one, ref64) < 1e-5


@needs_interpreter
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_fully_masked_row_gives_zero(softcap):
    """A node with no visible key (window excludes the prefix, mask excludes itself) outputs 0."""
    case = make_case(3, n=4, prefix_len=10, page_size=4, heads=(2, 1), head_dim=16, kind="chain",
                     window=None, softcap=None)
    case.tree_mask = case.tree_mask.clone()
    case.tree_mask[2] = False
    node_pos = torch.tensor([10, 11, 30, 13])  # node 2 far from every key: window 1 hides them
    kw = dict(sliding_window=1, node_pos=node_pos, softcap=softcap)
    ref = tree_attention_ref(*case.args(torch.float32), **kw)
    out = tree_attention(*case.args(torch.float32), **kw, block_n=16)
    naive = naive_tree_attention(*case.args(torch.float64), **kw)
    assert torch.equal(ref[2], torch.zeros_like(ref[2]))
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    assert ref[[0, 1, 3]].abs().amin(dim=-1).gt(0).all()  # the other rows do see keys
    torch.testing.assert_close(ref.double(), naive, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.double(), naive, rtol=0, atol=1e-5)


@needs_interpreter
def test_tanh_helper_is_accurate():
    import triton
    import triton.language as tl

    @triton.jit
    def _tanh_kernel(X, Y, N, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        ok = offs < N
        tl.store(Y + offs, ta_mod._tanh(tl.load(X + offs, mask=ok, other=0.0)), mask=ok)

    x = torch.cat([torch.linspace(-12, 12, 401), torch.tensor([0.0, 1e-6, -1e-6, 0.6249, 0.6251, 80.0, -80.0])])
    y = torch.empty_like(x)
    _tanh_kernel[(1,)](x, y, x.numel(), BLOCK=512)
    want = torch.tanh(x.double())
    rel = ((y.double() - want).abs() / want.abs().clamp_min(1e-30)).max().item()
    assert rel < 4e-7


# ------------------------------------------------------------------ the real compiler, no GPU needed

# The interpreter does not type-check like the compiler does. Compile every kernel for sm_90 (Hopper)
# through Triton's real pipeline down to a cubin (ptxas ships with triton; no GPU is needed), in a
# subprocess because this module runs triton in interpreter mode. Pointer and stride arguments get the
# divisible-by-16 hint the JIT gives them at launch, and the tiles are the launcher's own choice.
COMPILE_SCRIPT = r"""
import importlib, torch, triton
import triton.backends
if "nvidia" not in triton.backends.backends:
    print("SKIP: triton has no nvidia backend here"); raise SystemExit(0)
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
ta = importlib.import_module("specdec.kernels.tree_attention")
cp = importlib.import_module("specdec.kernels.compaction")
assert type(ta._tree_attn_kernel).__name__ == "JITFunction"
DIV16 = set("Q K_pages V_pages BlockTable TreeMask NodePos Out Lse Part src_k src_v dst_k dst_v src_rows "
            "dst_rows stride_qn stride_qh stride_kp stride_ks stride_kh stride_vp stride_vs stride_vh "
            "stride_os stride_on stride_oh stride_ps stride_src_l stride_dst_l".split())

def build(fn, types, consts, num_warps=4):
    sig = {a: types.get(a, "i32") for a in fn.arg_names}
    sig.update({c: "constexpr" for c in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if a in DIV16 and a not in consts}
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=num_warps, num_stages=2))
    assert k.asm["cubin"]

TT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
for dtype, rows, head_dim, split, window, softcap, batch in [
        (torch.bfloat16, 256, 128, True, False, False, False),  # the benchmark shape: 64 nodes x G=4
        (torch.bfloat16, 8, 64, False, True, True, False),      # small chain, Gemma-2 style options
        (torch.float16, 64, 80, True, True, False, False),      # head_dim padded 80 -> 128
        (torch.float32, 64, 128, True, False, True, False),     # exact-fp32 dots
        (torch.bfloat16, 32, 128, True, True, False, True),     # a batch's packed rows (tree_rows.py)
        (torch.float16, 8, 64, False, False, True, True)]:
    BLOCK_M, BLOCK_N, BLOCK_D, num_warps = ta._pick_tiles(dtype, rows, head_dim)
    t, o = TT[dtype], "fp32" if split else TT[dtype]
    types = dict(Q="*" + t, K_pages="*" + t, V_pages="*" + t, BlockTable="*i32", TreeMask="*u8",
                 NodePos="*i64", Out="*" + o, Lse="*" + o, RowStart="*i32", PrefixLen="*i32", qk_scale="fp32",
                 softcap="fp32")
    consts = dict(GROUP=4, PAGE_SIZE=16, HEAD_DIM=head_dim, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                  HAS_SOFTCAP=softcap, HAS_WINDOW=window, SPLIT=split, DOT_FP32=False,
                  DOT_IEEE=dtype == torch.float32, ROWS=batch)
    build(ta._tree_attn_kernel, types, consts, num_warps)
build(ta._combine_splits_kernel, dict(Part="*fp32", Lse="*fp32", Out="*bf16"),
      dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=8))
for src_identity in (False, True):
    build(cp._copy_rows_kernel, dict(src_k="*i16", src_v="*i16", dst_k="*i16", dst_v="*i16",
                                     src_rows="*i64", dst_rows="*i64"),
          dict(ROW_NUMEL=1024, SRC_IDENTITY=src_identity, DST_IDENTITY=not src_identity, BLOCK=1024))
print("OK")
"""


@pytest.mark.skipif(getattr(ta_mod, "triton", None) is None, reason="triton is not installed")
def test_kernels_compile_for_sm90():
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    res = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], cwd=root, env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    if res.stdout.startswith("SKIP"):
        pytest.skip(res.stdout.strip())
    assert res.stdout.strip().endswith("OK")


# --------------------------------------------------------------------------------- launcher errors


def _good_args():
    case = make_case(0, n=3, prefix_len=5, page_size=4, heads=(4, 2), head_dim=16, kind="tree",
                     window=None, softcap=None)
    return list(case.args(torch.float32))


@needs_interpreter
@pytest.mark.parametrize("mutate, match", [
    (lambda a: a.__setitem__(0, a[0].double()), "dtype"),
    (lambda a: [a.__setitem__(i, a[i].to(torch.float16)) for i in (0,)], "share a dtype"),
    (lambda a: a.__setitem__(0, a[0][0]), r"q must be \[n, num_q_heads, head_dim\]"),
    (lambda a: a.__setitem__(0, a[0][:, :3]), "multiple of num_kv_heads"),
    (lambda a: a.__setitem__(0, a[0][..., :8]), "head_dim"),
    (lambda a: a.__setitem__(2, a[2][..., :8]), "k_pages and v_pages"),
    (lambda a: a.__setitem__(5, a[5].int()), "tree_mask"),
    (lambda a: a.__setitem__(5, a[5][:2, :2]), "tree_mask"),
    (lambda a: a.__setitem__(3, a[3][:1]), "block_table covers"),
    (lambda a: a.__setitem__(3, a[3].float()), "block_table"),
    (lambda a: a.__setitem__(0, a[0].transpose(0, 2).contiguous().transpose(0, 2)), "contiguous"),
], ids=["fp64", "mixed", "q-2d", "gqa", "head-dim", "kv-shapes", "mask-dtype", "mask-shape",
        "short-table", "table-dtype", "q-stride"])
def test_launcher_rejects_bad_inputs(mutate, match):
    args = _good_args()
    mutate(args)
    with pytest.raises(ValueError, match=match):
        tree_attention(*args)


@needs_interpreter
def test_launcher_rejects_bad_options_and_cpu_without_interpreter(monkeypatch):
    args = _good_args()
    with pytest.raises(ValueError, match="sliding_window"):
        tree_attention(*args, sliding_window=0)
    with pytest.raises(ValueError, match="softcap"):
        tree_attention(*args, softcap=-1.0)
    with pytest.raises(ValueError, match="node_pos"):
        tree_attention(*args, node_pos=torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="block_m and block_n"):
        tree_attention(*args, block_n=24)
    monkeypatch.setattr(ta_mod, "_interpreting", lambda: False)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        tree_attention(*args)
    monkeypatch.setattr(comp_mod, "_interpreting", lambda: False)
    k = torch.zeros(4, 3, 2, 8)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        compact_kv(k, k.clone(), torch.arange(4, dtype=torch.int32), torch.tensor([1]), torch.tensor([0]))


# ------------------------------------------------------------------------------------ compaction


def test_slots_for_matches_python():
    g = torch.Generator().manual_seed(0)
    for page_size in (1, 3, 16):
        block_table = torch.randperm(9, generator=g).to(torch.int32)
        positions = torch.randint(0, 9 * page_size, (20,), generator=g)
        want = [int(block_table[p // page_size]) * page_size + p % page_size for p in positions.tolist()]
        got = slots_for(block_table, positions, page_size)
        assert got.dtype == torch.int64 and got.tolist() == want


def random_bits_pages(g, shape, dtype):
    """Random raw bit patterns (NaNs with payloads included): copies must preserve every bit."""
    bits = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[dtype]
    info = torch.iinfo(bits)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(bits).view(dtype)


def as_bits(t):
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def expected_after_compact(pages, block_table, src, dst):
    """Definition: read every source row (dense rebuild), then write every destination."""
    page_size = pages.shape[-3]
    out = pages.clone()
    rows = [pages[..., int(block_table[p // page_size]), p % page_size, :, :].clone() for p in src.tolist()]
    for p, row in zip(dst.tolist(), rows):
        out[..., int(block_table[p // page_size]), p % page_size, :, :] = row
    return out


def _run_compaction(impl, k, v, block_table, src, dst):
    k2, v2 = k.clone(), v.clone()
    impl(k2, v2, block_table, src, dst)
    return k2, v2


@needs_interpreter
@pytest.mark.parametrize("impl", [compact_kv, compact_kv_ref], ids=["triton", "torch"])
@pytest.mark.parametrize("src, dst", [([5, 7, 8], [4, 5, 6]), ([4, 5, 6], [5, 6, 7]), ([6, 2, 9], [2, 9, 6])],
                         ids=["slide-down", "shift-up", "cycle"])
def test_compaction_overlapping_examples(impl, src, dst):
    """Every read happens before any write, whatever order rows are processed in."""
    g = torch.Generator().manual_seed(0)
    block_table = torch.tensor([3, 0, 2, 1], dtype=torch.int32)
    k = random_bits_pages(g, (4, 3, 2, 8), torch.bfloat16)
    v = random_bits_pages(g, (4, 3, 2, 8), torch.bfloat16)
    src, dst = torch.tensor(src), torch.tensor(dst)
    k2, v2 = _run_compaction(impl, k, v, block_table, src, dst)
    assert torch.equal(as_bits(k2), as_bits(expected_after_compact(k, block_table, src, dst)))
    assert torch.equal(as_bits(v2), as_bits(expected_after_compact(v, block_table, src, dst)))


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layers", [None, 3], ids=["one-layer", "layer-dim"])
@settings(max_examples=15, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2 ** 31 - 1), page_size=st.sampled_from([1, 3, 4, 16]),
       length=st.integers(1, 60), m=st.integers(0, 12), commit_like=st.booleans())
def test_compaction_kernel_equals_reference(dtype, layers, seed, page_size, length, m, commit_like):
    rnd, g = random.Random(seed), torch.Generator().manual_seed(seed)
    num_pages = -(-length // page_size) + 2
    block_table = torch.randperm(num_pages, generator=g)[: -(-length // page_size)].to(torch.int32)
    m = min(m, length)
    if commit_like:  # tree commit: accepted nodes (increasing) slide down to the start of the tree
        start = rnd.randrange(length - m + 1)
        src = sorted(rnd.sample(range(start, length), m))
        dst = list(range(start, start + m))
    else:            # arbitrary: distinct destinations, sources anywhere (overlap, repeats allowed)
        dst = rnd.sample(range(length), m)
        src = [rnd.randrange(length) for _ in range(m)]
    src, dst = torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long)
    lead = () if layers is None else (layers,)
    k = random_bits_pages(g, lead + (num_pages, page_size, 2, 16), dtype)
    v = random_bits_pages(g, lead + (num_pages, page_size, 2, 16), dtype)

    k_t, v_t = _run_compaction(compact_kv, k, v, block_table, src, dst)
    k_r, v_r = _run_compaction(compact_kv_ref, k, v, block_table, src, dst)
    assert torch.equal(as_bits(k_t), as_bits(k_r)) and torch.equal(as_bits(v_t), as_bits(v_r))
    assert torch.equal(as_bits(k_r), as_bits(expected_after_compact(k, block_table, src, dst)))
    assert torch.equal(as_bits(v_r), as_bits(expected_after_compact(v, block_table, src, dst)))


@pytest.mark.parametrize("impl", [compact_kv, compact_kv_ref], ids=["triton", "torch"])
def test_compaction_rejects_bad_inputs(impl):
    k = torch.zeros(4, 3, 2, 8)
    bt = torch.arange(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="entries"):
        impl(k, k.clone(), bt, torch.tensor([1, 2]), torch.tensor([0]))
    with pytest.raises(ValueError, match="same shape and dtype"):
        impl(k, k.half(), bt, torch.tensor([1]), torch.tensor([0]))
    with pytest.raises(ValueError, match="integer"):
        impl(k, k.clone(), bt, torch.tensor([1.0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="pages must be"):
        impl(k[0], k[0].clone(), bt, torch.tensor([1]), torch.tensor([0]))


# ------------------------------------------------------------------------------- backend choice


def test_on_triton_follows_device_and_env(monkeypatch):
    monkeypatch.delenv("SPECDEC_KERNELS", raising=False)
    assert on_triton("cpu") is False
    assert on_triton(torch.device("cuda", 0)) is kernels._triton_importable()
    monkeypatch.setenv("SPECDEC_KERNELS", "torch")
    assert on_triton("cuda") is False
    monkeypatch.setenv("SPECDEC_KERNELS", "triton")
    assert on_triton("cpu") is True
    monkeypatch.setenv("SPECDEC_KERNELS", "cuda")
    with pytest.raises(ValueError, match="SPECDEC_KERNELS"):
        on_triton("cpu")
