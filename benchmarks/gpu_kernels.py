"""GPU check and timing of the specdec Triton kernels (run on a CUDA machine; exits cleanly without one).

    python benchmarks/gpu_kernels.py [--quick]

1. Correctness on the GPU, compiled (not interpreted): tree_attention vs an fp64 torch reference for
   fp32/fp16/bf16, random trees, GQA, page sizes 1/3/16, sliding window, softcap, split-K; the kernel may
   be at most 2x worse than the torch path in the same dtype plus 2 ulps at the output's scale (the
   rule of tests/test_kernels.py). compact_kv vs compact_kv_ref bit for bit, overlapping src/dst included.
2. Timing of a verification-shaped call: prefix 4k and 16k tokens, 64 tree nodes, 32 q heads, 8 kv
   heads, head_dim 128, bf16, page_size 16, shuffled pages. Reports ms for the Triton kernel (auto
   config, plus a small sweep of split counts and tile sizes) and for the torch reference path, and the
   achieved bandwidth = bytes of K/V read once (prefix + tree, K and V) / time.

Exit status: 0 when everything is correct (or there is no CUDA), 1 when a correctness check failed.
"""
from __future__ import annotations

import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_kernels: no CUDA device here; nothing to check (run this on a GPU machine).")
        return 0
    try:
        import triton  # noqa: F401
        from triton.testing import do_bench
    except ImportError:
        print("gpu_kernels: triton is not installed; nothing to check.")
        return 0
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("gpu_kernels: unset TRITON_INTERPRET to check the compiled kernels.")
        return 0
    from specdec.kernels import compact_kv, compact_kv_ref, slots_for, tree_attention, tree_attention_ref

    quick = "--quick" in sys.argv
    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(dev)}  torch {torch.__version__}  triton {triton.__version__}")
    failures = []

    # ------------------------------------------------------------------ helpers
    def ancestor_mask(parents):
        n = len(parents)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            j = i
            while j >= 0:
                mask[i, j] = True
                j = parents[j]
        return mask.to(dev)

    def paged(g, length, page_size, num_kv_heads, head_dim, dtype):
        needed = -(-length // page_size)
        num_pages = needed + 4
        k = torch.full((num_pages, page_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=dev)
        v = torch.full_like(k, float("nan"))
        block_table = torch.randperm(num_pages, generator=g)[:needed].to(torch.int32).to(dev)
        slots = slots_for(block_table, torch.arange(length, device=dev), page_size)
        shape = (length, num_kv_heads, head_dim)
        k.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(shape, generator=g).to(dev, dtype)
        v.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(shape, generator=g).to(dev, dtype)
        return k, v, block_table

    def err(x, ref64):
        return (x.double() - ref64).abs().max().item()

    # ------------------------------------------------------------------ 1a. tree attention correctness
    rnd = random.Random(0)
    g = torch.Generator().manual_seed(0)
    cases = 12 if quick else 48
    worst = {}
    for c in range(cases):
        n = rnd.choice([1, 5, 12, 64])
        prefix = rnd.choice([0, 17, 300, 2000])
        page_size = rnd.choice([1, 3, 16])
        num_q_heads, num_kv_heads = rnd.choice([(4, 4), (8, 2), (32, 8)])
        head_dim = rnd.choice([64, 80, 128])
        parents = [-1] + [rnd.randrange(i) for i in range(1, n)]
        mask = ancestor_mask(parents)
        kw = {}
        if rnd.random() < 0.3:
            kw["softcap"] = 50.0
        if rnd.random() < 0.3:
            kw["sliding_window"] = rnd.choice([1, 64, 1000])
            kw["node_pos"] = prefix + mask.sum(1) - 1
        tuning = rnd.choice([{}, {"num_splits": 1}, {"num_splits": 5}, {"block_m": 128, "block_n": 32}])
        k64, v64, bt = paged(g, prefix + n, page_size, num_kv_heads, head_dim, torch.float64)
        q64 = torch.randn(n, num_q_heads, head_dim, generator=g, dtype=torch.float64).to(dev)
        scale = head_dim ** -0.5
        ref64 = tree_attention_ref(q64, k64, v64, bt, prefix, mask, scale, **kw)
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            args = (q64.to(dtype), k64.to(dtype), v64.to(dtype), bt, prefix, mask, scale)
            out = tree_attention(*args, **kw, **tuning)
            out_torch = tree_attention_ref(*args, **kw)
            e_k, e_t = err(out, ref64), err(out_torch, ref64)
            eps = 2 * torch.finfo(dtype).eps * max(1.0, ref64.abs().max().item())
            ok = bool(torch.isfinite(out).all()) and e_k <= 2 * e_t + eps
            worst[dtype] = max(worst.get(dtype, 0.0), e_k / (2 * e_t + eps))
            if not ok:
                failures.append(f"tree_attention case {c} {dtype} n={n} prefix={prefix} page={page_size} "
                                f"heads={num_q_heads}/{num_kv_heads} d={head_dim} {kw.keys()} {tuning}: "
                                f"kernel err {e_k:.3e} vs torch {e_t:.3e}")
    for dtype, w in worst.items():
        print(f"tree_attention {str(dtype):15s} worst err / allowed = {w:.2f}  ({cases} cases)")

    # ------------------------------------------------------------------ 1b. compaction correctness
    for c in range(20):
        page_size = rnd.choice([1, 3, 16])
        length = rnd.randint(1, 200)
        layers = rnd.choice([None, 4])
        m = rnd.randint(0, min(length, 40))
        dst = rnd.sample(range(length), m)
        src = [rnd.randrange(length) for _ in range(m)] if c % 2 else sorted(rnd.sample(range(length), m))
        num_pages = -(-length // page_size) + 2
        bt = torch.randperm(num_pages, generator=g)[: -(-length // page_size)].to(torch.int32).to(dev)
        lead = () if layers is None else (layers,)
        bits = torch.randint(-2 ** 15, 2 ** 15 - 1, lead + (num_pages, page_size, 8, 128), generator=g,
                             dtype=torch.int32).to(torch.int16).to(dev)
        k, v = bits.view(torch.bfloat16), bits.flip(-1).contiguous().view(torch.bfloat16)
        src_t, dst_t = torch.tensor(src, device=dev), torch.tensor(dst, device=dev)
        k1, v1, k2, v2 = k.clone(), v.clone(), k.clone(), v.clone()
        compact_kv(k1, v1, bt, src_t, dst_t)
        compact_kv_ref(k2, v2, bt, src_t, dst_t)
        if not (torch.equal(k1.view(torch.int16), k2.view(torch.int16))
                and torch.equal(v1.view(torch.int16), v2.view(torch.int16))):
            failures.append(f"compact_kv case {c}: page_size={page_size} length={length} m={m} layers={layers}")
    print("compact_kv: 20 cases checked bit for bit")

    # ------------------------------------------------------------------ 2. timing
    num_q_heads, num_kv_heads, head_dim, page_size, n = 32, 8, 128, 16, 64
    dtype = torch.bfloat16
    parents = [-1] + [rnd.randrange(max(0, i - 8), i) for i in range(1, n)]  # bushy, depth ~ 10
    mask = ancestor_mask(parents)
    scale = head_dim ** -0.5
    print(f"\ntiming: {n} tree nodes, {num_q_heads} q heads / {num_kv_heads} kv heads, head_dim {head_dim}, "
          f"{dtype}, page_size {page_size}")
    print(f"{'prefix':>7s} {'path':28s} {'ms':>8s} {'GB/s':>8s}")
    for prefix in (4096, 16384):
        k, v, bt = paged(g, prefix + n, page_size, num_kv_heads, head_dim, dtype)
        q = torch.randn(n, num_q_heads, head_dim, generator=g).to(dev, dtype)
        kv_bytes = 2 * (prefix + n) * num_kv_heads * head_dim * k.element_size()

        ref = tree_attention_ref(q, k, v, bt, prefix, mask, scale)
        out = tree_attention(q, k, v, bt, prefix, mask, scale)
        diff = (out.float() - ref.float()).abs().max().item()
        if not diff < 2e-2:
            failures.append(f"timing shape prefix={prefix}: kernel vs torch max diff {diff:.3e}")

        def report(name, fn):
            ms = do_bench(fn, warmup=25, rep=100 if not quick else 30)
            print(f"{prefix:7d} {name:28s} {ms:8.3f} {kv_bytes / ms / 1e6:8.1f}")
            return ms

        t_ref = report("torch reference", lambda: tree_attention_ref(q, k, v, bt, prefix, mask, scale))
        t_auto = report("triton (auto)", lambda: tree_attention(q, k, v, bt, prefix, mask, scale))
        best = ("auto", t_auto)
        sweep = [(s, bm, bn) for s in (1, 4, 8, 16) for bm, bn in ((64, 64), (128, 64), (64, 32))]
        for splits, bm, bn in (sweep[:4] if quick else sweep):
            name = f"triton splits={splits} m{bm} n{bn}"
            try:
                ms = report(name, lambda: tree_attention(q, k, v, bt, prefix, mask, scale, num_splits=splits,
                                                         block_m=bm, block_n=bn))
            except Exception as exc:  # e.g. out of shared memory for a large tile: report, keep going
                print(f"{prefix:7d} {name:28s} failed: {type(exc).__name__}: {str(exc)[:80]}")
                continue
            if ms < best[1]:
                best = (name, ms)
        print(f"{prefix:7d} speedup of triton (auto) over torch: {t_ref / t_auto:.2f}x; best config: "
              f"{best[0]} {best[1]:.3f} ms")

    if failures:
        print("\nFAILED:")
        for f in failures:
            print("  " + f)
        return 1
    print("\nall correctness checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
