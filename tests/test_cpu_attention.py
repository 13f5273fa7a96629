"""specdec's CPU attention kernel (kernels/cpu_attention.py): the page write and the attention to float32
rounding of its SDPA reference, for every query count of a step, GQA groups, head sizes, masks and slots
out of order; masked keys weigh nothing; clear errors that write nothing; the compiled step's use of it."""
import pytest
import torch

from specdec.kernels import cpu_attention, cpu_library

pytestmark = pytest.mark.skipif(not cpu_library.cpu_supports(), reason="the kernel needs an x86 CPU with AVX2 and FMA")


@pytest.fixture(scope="module", autouse=True)
def loaded():
    assert cpu_library.load() is None


def _case(n, Hq, Hkv, D, prefix, dtype, seed=0, slots=64 * 8):
    g = torch.Generator().manual_seed(seed)
    pages = [torch.randn(slots, Hkv, D, generator=g).to(dtype) for _ in range(2)]
    q, k, v = (torch.randn(n, h, D, generator=g).to(dtype) for h in (Hq, Hkv, Hkv))
    order = torch.randperm(slots, generator=g)  # slots out of order, as pages handed out from a free list are
    read = order[:prefix + n]
    write = read[prefix:]
    return q, k, v, pages, write, read


def _tree_mask(n, prefix, g):
    """Each new token sees the prefix, itself and a random subset of the earlier new tokens (a tree)."""
    block = torch.tril(torch.rand(n, n, generator=g) < 0.6) | torch.eye(n, dtype=torch.bool)
    return torch.cat([torch.ones(n, prefix, dtype=torch.bool), block], dim=1)


@pytest.mark.parametrize("n", [1, 2, 3, 8, 16, 32])
@pytest.mark.parametrize("Hq, Hkv, D", [(9, 3, 64), (4, 4, 32), (8, 2, 136)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_is_sdpa_to_rounding(n, Hq, Hkv, D, dtype):
    """D = 136: two register blocks of lanes (64 + 64 + 8); prefixes not a multiple of the 8-key and 32-key
    blocks; a tree mask past one token, none for one."""
    prefix = 37 + 5 * n
    q, k, v, (kp, vp), write, read = _case(n, Hq, Hkv, D, prefix, dtype, seed=n)
    mask = None if n == 1 else _tree_mask(n, prefix, torch.Generator().manual_seed(n))
    kr, vr = kp.clone(), vp.clone()
    ref = cpu_attention.attend_pages_ref(q, k, v, kr, vr, write, read, mask, D ** -0.5)
    got = cpu_attention.attend_pages(q, k, v, kp, vp, write, read, mask, D ** -0.5)
    assert torch.equal(kp, kr) and torch.equal(vp, vr)  # the new keys and values in their slots, nothing else
    assert got.shape == (n, Hq * D) and got.dtype == dtype
    if dtype == torch.float32:
        assert torch.allclose(got, ref, atol=2e-6, rtol=1e-5)
    else:  # both float32 inside, rounded once to bfloat16: at most one bfloat16 step apart
        assert ((got.float() - ref.float()).abs() <= ref.float().abs() * 2 ** -7 + 1e-3).all()


def test_a_masked_key_weighs_nothing_and_threads_change_nothing():
    """A key the mask hides, however large its score and value, does not reach the output; each query row
    sees only what its own mask row allows; 1, 2 and 3 threads give the same numbers (work split by heads)."""
    n, Hq, Hkv, D, prefix = 4, 6, 2, 64, 300
    q, k, v, (kp, vp), write, read = _case(n, Hq, Hkv, D, prefix, torch.float32, seed=3)
    hidden = read[10]
    kp[hidden], vp[hidden] = q[0, :Hkv] * 1e3, 1e6
    mask = torch.ones(n, prefix + n, dtype=torch.bool)
    mask[:, 10] = False
    mask[:, prefix:] = torch.tril(torch.ones(n, n, dtype=torch.bool))
    ref = cpu_attention.attend_pages_ref(q, k, v, kp.clone(), vp.clone(), write, read, mask, 0.125)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(cpu_attention.attend_pages(q, k, v, kp, vp, write, read, mask, 0.125))
    finally:
        torch.set_num_threads(before)
    assert outs[0].abs().max() < 10  # the 1e6 value never weighed in
    for out in outs:
        assert torch.allclose(out, ref, atol=2e-6, rtol=1e-5)
        assert torch.equal(out, outs[0])


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_long_context_split_into_parts_is_sdpa_to_rounding_on_any_thread_count(masked, dtype):
    """One query row over 700 keys: its keys are attended in parts of 256 on the threads and merged (the
    last part short); with a mask hiding every key of the middle part and a few more, that part weighs
    nothing; 1, 2 and 3 threads give the same numbers (the parts depend on the shapes, not the threads)."""
    n, Hq, Hkv, D, prefix = 1, 9, 3, 64, 700
    q, k, v, (kp, vp), write, read = _case(n, Hq, Hkv, D, prefix, dtype, seed=7, slots=1024)
    mask = None
    if masked:
        mask = torch.ones(n, prefix + n, dtype=torch.bool)
        mask[:, 256:512] = False
        mask[:, 3:700:50] = False
        kp[read[300]], vp[read[300]] = (q[0, :Hkv] * 1e3).to(dtype), 1e6  # a hidden key that would dominate
    ref = cpu_attention.attend_pages_ref(q, k, v, kp.clone(), vp.clone(), write, read, mask, D ** -0.5)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(cpu_attention.attend_pages(q, k, v, kp, vp, write, read, mask, D ** -0.5))
    finally:
        torch.set_num_threads(before)
    for out in outs:
        assert torch.equal(out, outs[0])
    got, ref = outs[0].float(), ref.float()
    if dtype == torch.float32:
        assert torch.allclose(got, ref, atol=2e-6, rtol=1e-5)
    else:
        assert ((got - ref).abs() <= ref.abs() * 2 ** -7 + 1e-3).all()


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update({name: a[name][..., :60].contiguous() for name in ("q", "k_new", "v_new", "k_pages", "v_pages")}),
     "a head dimension that is a multiple of 8"),
    (lambda a: a.update(k_new=a["k_new"][:, :1]), "shapes disagree"),
    (lambda a: a.update(k_pages=a["k_pages"].bfloat16()), "every tensor float32, or every tensor bfloat16"),
    (lambda a: a.update(q=a["q"].half(), k_new=a["k_new"].half(), v_new=a["v_new"].half(),
                        k_pages=a["k_pages"].half(), v_pages=a["v_pages"].half()), "every tensor float32"),
    (lambda a: a.update(read_slots=a["read_slots"].int()), "int64"),
    (lambda a: a.update(mask=torch.ones(2, 3, dtype=torch.bool)), "mask \\[n, T\\] bool"),
    (lambda a: a.update(read_slots=torch.tensor([0, 1, 10_000])), "read slot 10000 outside the pages"),
    (lambda a: a.update(write_slots=torch.tensor([-1])), "write slot -1 outside the pages"),
])
def test_bad_input_gets_an_error_naming_it_and_writes_nothing(change, message):
    q, k, v, (kp, vp), write, read = _case(1, 4, 2, 64, 20, torch.float32)
    args = dict(q=q, k_new=k, v_new=v, k_pages=kp, v_pages=vp, write_slots=write, read_slots=read, mask=None,
                scale=0.125)
    change(args)
    before = (args["k_pages"].clone(), args["v_pages"].clone())
    with pytest.raises(RuntimeError, match=message):
        cpu_attention.attend_pages(**args)
    assert torch.equal(args["k_pages"], before[0]) and torch.equal(args["v_pages"], before[1])
