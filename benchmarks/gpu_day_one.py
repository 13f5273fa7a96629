"""The first GPU, in one command: everything specdec has only ever run on a CPU, checked and timed on CUDA.

    python benchmarks/gpu_day_one.py [--out benchmarks/results/gpu_day_one.md] [--budget-s 420]
    python benchmarks/gpu_day_one.py --dry --out /tmp/day_one.md     # CPU: the same code, tiny (CI runs it)

A GPU is lent for minutes, so this is one script with a time budget: every section checks the clock and
is skipped (and says so) when the budget is spent, and the results file is rewritten after each section
(to a temporary name, then renamed), so a run cut short still leaves what it measured.

1. kernels: benchmarks/gpu_kernels.py (Triton tree attention and KV compaction compiled for the device,
   against their torch references; timing of a verification-shaped call). Dry: one interpreted case.
2. greedy: every drafter kind (none, n-gram, draft model chain and tree, feature head chain and tree,
   early exit) against the target's own `generate(do_sample=False)` on the same device and dtype: the zoo
   target (trained weights, float32 and bfloat16) and, with random weights since no real checkpoint fits
   the device's upload, SmolLM2-135M's and Qwen2.5-Coder-1.5B's architectures in bfloat16. A difference
   is reported with the target's top-2 logit gap where it happened (a numerical tie, or a bug).
3. sampling: the chain verifier's rejection sampling on device tensors, chi-square against the target's
   distribution, with a lossy control (always accepting the draft) that must fail.
4. batches: three left-padded rows in one call equal the target's batched greedy.
5. device map: the zoo target split by accelerate across the GPU and the CPU (its own hooks).
6. timing: the target's forward cost by token count (what verification pays for k drafted tokens),
   and tokens/s of HF greedy, HF assisted / prompt lookup and specdec's modes, on each target; and the
   1.5B architecture with half its layers offloaded to the CPU.

Random-weight targets are for exactness and step costs only: their acceptance says nothing about a real
model's, so no speedup from drafting is claimed for them. Exit status 1 when a correctness check failed.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
               max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
               rope_parameters={"rope_theta": 100000.0, "rope_type": "default"})
QWEN_1_5B = dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                 rms_norm_eps=1e-6, tie_word_embeddings=True,
                 rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"})


class Report:
    """Markdown sections written after each one (temporary name, then rename); failures counted."""

    def __init__(self, out: Path, budget_s: float, header: str):
        self.out, self.deadline, self.lines, self.failures = out, time.monotonic() + budget_s, [header], []

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def add(self, *lines: str) -> None:
        for line in lines:
            print(line, flush=True)
            self.lines.append(line)

    def fail(self, what: str) -> None:
        self.failures.append(what)
        self.add(f"**FAILED**: {what}")

    def flush(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_name(self.out.name + ".tmp")
        tmp.write_text("\n".join(self.lines) + "\n")
        tmp.replace(self.out)

    def section(self, title: str, fn, need_s: float) -> None:
        self.add("", f"## {title}", "")
        if self.left() < need_s:
            self.add(f"skipped: {self.left():.0f} s of the budget left, this section needs about {need_s:.0f} s")
        else:
            t0 = time.monotonic()
            try:
                fn()
            except Exception as exc:  # one section's crash is a result, not the end of the run
                self.fail(f"{title} raised {type(exc).__name__}: {str(exc)[:300]}")
                self.add("```", traceback.format_exc()[-3000:], "```")
            self.add(f"\n({time.monotonic() - t0:.0f} s)")
        self.flush()


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_model(config: dict, dtype, device, layers: int | None = None):
    """A model of that architecture with HF's random initialisation (seed 0), no EOS (it runs to length)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(config)
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def zoo_target(dtype, device):
    import specdec

    model, tok = specdec.zoo.load("target", dtype=dtype, device=str(device))
    return model, tok


def prompt_ids(tok, n: int, device, vocab: int | None = None) -> list[torch.Tensor]:
    """Zoo prompts (held-out stdlib code) through the zoo tokenizer, or random tokens for random models."""
    import specdec

    if tok is None:
        g = torch.Generator().manual_seed(1)
        return [torch.randint(3, vocab, (1, 24 + 8 * i), generator=g).to(device) for i in range(n)]
    return [tok(p, return_tensors="pt").input_ids[:, -96:].to(device) for p in specdec.zoo.prompts(n)]


def tie_gap(model, ids: torch.Tensor) -> float:
    """Relative top-2 gap of the target's next-token logits after ids [1, T] (small = a numerical tie)."""
    with torch.no_grad():
        logits = model(ids).logits[0, -1].float()
    top = logits.topk(2).values
    return float((top[0] - top[1]) / top[0].abs().clamp_min(1e-6))


def drafter_cases(target, name: str, device, dtype) -> dict:
    """label -> specdec.generate keywords for every drafter kind that applies to this target."""
    import specdec
    from specdec.drafters import EarlyExit, FeatureHead

    n = target.config.num_hidden_layers
    cases = {"plain": dict(draft_length=0), "ngram": dict(drafter="ngram"),
             "early exit k=2": dict(drafter=EarlyExit(target, exit_layer=max(1, n // 2)), draft_length=2)}
    if name == "zoo target":
        draft, _ = specdec.zoo.load("draft-small", dtype=dtype, device=str(device))
        head = FeatureHead.from_pretrained(specdec.zoo.path("target-head"), target)
        cases.update({"draft k=4": dict(drafter=draft, draft_length=4),
                      "draft dynamic tree": dict(drafter=draft, tree=specdec.TreeSpec.dynamic(nodes=16, depth=5, topk=4)),
                      "head adaptive": dict(drafter=head),
                      "head dynamic tree": dict(drafter=head, tree=specdec.TreeSpec.dynamic(nodes=16, depth=5, topk=4))})
    elif name.startswith("SmolLM2"):  # the shipped head's shapes, on random target weights
        head = FeatureHead.from_pretrained(specdec.zoo.path("smollm2-135m-instruct-head"), target,
                                           check_fingerprint=False)
        cases.update({"head k=3 (random target)": dict(drafter=head, draft_length=3),
                      "head static tree [2,2,1]": dict(drafter=head, tree=specdec.TreeSpec.static([2, 2, 1]))})
    return cases


def greedy_rows(rep: Report, name: str, target, tok, device, new: int, prompts: int) -> None:
    import specdec

    rep.add(f"**{name}**, {next(target.parameters()).dtype}, {new} new tokens x {prompts} prompts", "",
            "| drafter | output == greedy | step | tau | top-2 gap at a difference |", "|---|---|---|---|---|")
    ids_list = prompt_ids(tok, prompts, device, target.config.vocab_size)
    # a numerical tie: top-2 within 1e-5 relative (issue 45's float32 rule) or two ulps of the weights' dtype
    # (bfloat16's eps is 7.8e-3: another valid attention kernel can flip a 1-ulp gap)
    dtype = next(target.parameters()).dtype
    tie = max(1e-5, 2 * torch.finfo(dtype).eps)
    refs = [target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
            for ids in ids_list]
    for label, kw in drafter_cases(target, name, device, next(target.parameters()).dtype).items():
        if rep.left() < 20:
            rep.add(f"| {label} | not run (budget) | | | |")
            continue
        same, gaps, taus, step = 0, [], [], ""
        for ids, ref in zip(ids_list, refs):
            out = specdec.generate(target, ids, max_new_tokens=new, do_sample=False, return_dict_in_generate=True,
                                   **kw)
            seq = out.sequences
            taus.append(out.stats.mean_accepted_length)
            step = out.stats.step
            if torch.equal(seq, ref):
                same += 1
                continue
            m = min(seq.shape[1], ref.shape[1])
            diff = (seq[0, :m] != ref[0, :m]).nonzero()
            at = int(diff[0]) if len(diff) else m
            gaps.append(tie_gap(target, ref[:, :at]))
        verdict = "yes" if same == len(ids_list) else f"**{same}/{len(ids_list)}**"
        gap = ", ".join(f"{g:.1e}" for g in gaps)
        rep.add(f"| {label} | {verdict} | {step} | {sum(taus) / len(taus):.2f} | {gap} |")
        if gaps and max(gaps) > tie:  # a clear winner the engine missed: a bug, not a tie
            rep.fail(f"{name} {label}: greedy output differs where the target's top-2 gap is {max(gaps):.1e} "
                     f"(a tie is <= {tie:.1e} in {dtype})")


def check_greedy(rep: Report, device, dry: bool) -> None:
    new = 2 if dry else 32
    for dtype in (torch.float32,) if dry else (torch.float32, torch.bfloat16):
        target, tok = zoo_target(dtype, device)
        greedy_rows(rep, "zoo target", target, tok, device, new, 1 if dry else 2)
    rep.add("")
    dtype = torch.float32 if dry else torch.bfloat16
    greedy_rows(rep, "SmolLM2-135M architecture, random weights", random_model(SMOLLM2, dtype, device),
                None, device, new, 1 if dry else 2)
    rep.add("")
    if not dry:
        greedy_rows(rep, "Qwen2.5-Coder-1.5B architecture, random weights", random_model(QWEN_1_5B, dtype, device),
                    None, device, new, 2)


def check_sampling(rep: Report, device, dry: bool) -> None:
    from scipy.stats import chisquare

    from specdec.verifiers.chain import sample_chain

    g = torch.Generator(device=device).manual_seed(0)
    V, k, trials = 6, 3, 2000 if dry else 20000
    p = torch.softmax(torch.randn(k + 1, V, generator=torch.Generator().manual_seed(2)) * 1.5, -1).to(device)
    q = torch.softmax(torch.randn(k, V, generator=torch.Generator().manual_seed(3)) * 1.5, -1).to(device)
    counts = {"exact": torch.zeros(V), "lossy (always accept)": torch.zeros(V)}
    for _ in range(trials):
        x = torch.multinomial(q, 1, generator=g).squeeze(1)  # [k], each position from its own draft row
        res = sample_chain(x, p, q, g)
        first = int(x[0]) if res.path else res.next_token
        counts["exact"][first] += 1
        counts["lossy (always accept)"][int(x[0])] += 1
    rep.add(f"{trials} verifications of a {k}-token chain over {V} tokens on {device}; first emitted token vs p[0]:",
            "", "| verifier | chi-square p-value | verdict |", "|---|---|---|")
    p0 = p[0].cpu().double()
    expected = p0 / p0.sum() * trials
    for label, c in counts.items():
        pv = float(chisquare(c.double().numpy(), expected.numpy()).pvalue)
        exact = label == "exact"
        ok = pv > 1e-3 if exact else pv < 1e-3
        rep.add(f"| {label} | {pv:.3g} | {'as expected' if ok else 'UNEXPECTED'} |")
        if not ok:
            rep.fail(f"sampling: {label} p-value {pv:.3g}")


def check_batches(rep: Report, device, dry: bool) -> None:
    import specdec

    target, tok = zoo_target(torch.float32, device)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    texts = [p[-200 + 60 * i:] for i, p in enumerate(specdec.zoo.prompts(3))]
    enc = tok(texts, return_tensors="pt", padding=True).to(device)
    new = 2 if dry else 32
    ref = target.generate(**enc, max_new_tokens=new, do_sample=False)
    rep.add("| drafter | rows equal to the batched greedy |", "|---|---|")
    for label, kw in {"plain": dict(draft_length=0), "ngram": dict(drafter="ngram"),
                      "draft k=3": dict(drafter=specdec.zoo.load("draft-small", device=str(device))[0],
                                        draft_length=3)}.items():
        out = specdec.generate(target, enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=new,
                               do_sample=False, **kw)
        rows = sum(torch.equal(a, b) for a, b in zip(out, ref))
        rep.add(f"| {label} | {rows}/{len(texts)} |")
        if rows != len(texts):
            rep.fail(f"batches {label}: {rows}/{len(texts)} rows equal")


def split_map(model, device, offload_from: int) -> dict:
    """accelerate device map: embeddings and layers < offload_from on `device`, the rest on the CPU."""
    n = model.config.num_hidden_layers
    dmap = {"model.embed_tokens": str(device), "model.rotary_emb": str(device)}
    dmap.update({f"model.layers.{i}": (str(device) if i < offload_from else "cpu") for i in range(n)})
    dmap.update({"model.norm": "cpu", "lm_head": "cpu"})
    return dmap


def check_device_map(rep: Report, device, dry: bool) -> None:
    import accelerate

    import specdec

    target, tok = zoo_target(torch.float32, "cpu")
    n = target.config.num_hidden_layers
    target = accelerate.dispatch_model(target, split_map(target, device, n // 2))
    ids = prompt_ids(tok, 1, device)[0]
    new = 2 if dry else 24
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
    rep.add(f"zoo target, layers 0-{n // 2 - 1} on {device}, {n // 2}-{n - 1} and the LM head on the CPU "
            "(accelerate.dispatch_model)", "", "| drafter | result |", "|---|---|")
    for label, kw in {"plain": dict(draft_length=0), "ngram": dict(drafter="ngram")}.items():
        try:
            out = specdec.generate(target, ids, max_new_tokens=new, do_sample=False, return_dict_in_generate=True,
                                   **kw)
            same = torch.equal(out.sequences.to(ref.device), ref)
            rep.add(f"| {label} | {'equal to greedy' if same else '**differs**'}, step {out.stats.step} |")
            if not same:
                rep.fail(f"device map {label}: output differs from the target's greedy")
        except Exception as exc:  # the device-map engine is issue 43's work: record what happens today
            rep.add(f"| {label} | raised {type(exc).__name__}: {str(exc)[:160]} |")


def forward_costs(model, device, tokens=(1, 2, 4, 8, 16, 32, 64), prefix: int = 128, reps: int = 10) -> dict:
    """ms of one forward of n new tokens over a prefix in HF's DynamicCache (cropped back each time)."""
    from transformers import DynamicCache

    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (1, prefix + max(tokens)), generator=torch.Generator().manual_seed(4)).to(device)
    out = {}
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(ids[:, :prefix], past_key_values=cache, use_cache=True)
        for n in tokens:
            times = []
            for r in range(reps + 2):
                sync(device)
                t0 = time.perf_counter()
                model(ids[:, prefix:prefix + n], past_key_values=cache, use_cache=True)
                sync(device)
                times.append(time.perf_counter() - t0)
                cache.crop(-n)  # negative: drop the last n (the one form every transformers 5 reads)
            out[n] = 1000 * sorted(times[2:])[len(times[2:]) // 2]
    return out


def tokens_per_s(fn, ids_list, device) -> tuple[float, float]:
    """(new tokens per second over all prompts, tau or 0), after one untimed warm-up call."""
    fn(ids_list[0])
    new, taus = 0, []
    sync(device)
    t0 = time.perf_counter()
    for ids in ids_list:
        seq, tau = fn(ids)
        new += seq.shape[1] - ids.shape[1]
        taus.append(tau)
    sync(device)
    return new / (time.perf_counter() - t0), sum(taus) / len(taus)


def timing_modes(target, draft, head, new: int) -> dict:
    import specdec

    def hf(**kw):
        def run(ids):
            seq = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, **kw)
            return seq, 0.0
        return run

    def spec(**kw):
        def run(ids):
            out = specdec.generate(target, ids, max_new_tokens=new, do_sample=False, return_dict_in_generate=True,
                                   **kw)
            return out.sequences, out.stats.mean_accepted_length
        return run

    modes = {"HF greedy": hf(), "HF prompt lookup": hf(prompt_lookup_num_tokens=10),
             "specdec plain": spec(draft_length=0), "specdec ngram": spec(drafter="ngram")}
    if draft is not None:
        modes.update({"HF assisted (draft)": hf(assistant_model=draft), "specdec draft": spec(drafter=draft)})
    if head is not None:
        modes.update({"specdec head": spec(drafter=head),
                      "specdec head dynamic tree": spec(drafter=head,
                                                        tree=specdec.TreeSpec.dynamic(nodes=16, depth=5, topk=4))})
    return modes


def time_target(rep: Report, name: str, target, ids_list, device, new: int, draft=None, head=None,
                reps: int = 10, only: tuple[str, ...] = ()) -> None:
    """Forward costs, then tokens/s of each mode (all of timing_modes', or those named in `only`)."""
    rep.add(f"**{name}**, {next(target.parameters()).dtype}")
    if reps:
        c = forward_costs(target, device, tokens=(1, 2) if new <= 2 else (1, 2, 4, 8, 16, 32, 64),
                          reps=1 if new <= 2 else reps)
        rep.add("", "forward of n tokens over a 128-token prefix (HF modules, median ms): " +
                ", ".join(f"{n}: {ms:.2f}" for n, ms in c.items()) +
                f"; n = {max(c)} costs {c[max(c)] / c[1]:.2f}x n = 1")
    rep.add("", "| mode | tokens/s | vs HF greedy | tau |", "|---|---|---|---|")
    base = None
    for label, fn in timing_modes(target, draft, head, new).items():
        if only and label not in only:
            continue
        if rep.left() < 15:
            rep.add(f"| {label} | not run (budget) | | |")
            continue
        tps, tau = tokens_per_s(fn, ids_list, device)
        base = base or tps
        rep.add(f"| {label} | {tps:.1f} | {tps / base:.2f}x | {tau:.2f} |")
    rep.add("")


def timing(rep: Report, device, dry: bool) -> None:
    import accelerate

    import specdec
    from specdec.drafters import FeatureHead

    new, n_prompts = (2, 1) if dry else (64, 2)
    dtype = torch.float32 if dry else torch.bfloat16
    target, tok = zoo_target(dtype, device)
    draft, _ = specdec.zoo.load("draft-small", dtype=dtype, device=str(device))
    head = FeatureHead.from_pretrained(specdec.zoo.path("target-head"), target)
    rep.add("Trained zoo weights: the one target here whose acceptance is real (held-out stdlib prompts).", "")
    time_target(rep, "zoo target", target, prompt_ids(tok, n_prompts, device), device, new, draft, head)
    smol = random_model(SMOLLM2, dtype, device)
    rand_ids = prompt_ids(None, n_prompts, device, SMOLLM2["vocab_size"])
    rep.add("Random weights from here on: step costs and target-only speed; drafting speedups not claimed.", "")
    time_target(rep, "SmolLM2-135M architecture", smol, rand_ids, device, new)
    del smol
    if dry:
        return
    qwen = random_model(QWEN_1_5B, dtype, device)
    q_ids = prompt_ids(None, n_prompts, device, QWEN_1_5B["vocab_size"])
    time_target(rep, "Qwen2.5-Coder-1.5B architecture", qwen, q_ids, device, new)
    qwen = accelerate.dispatch_model(qwen.cpu(), split_map(qwen, device, QWEN_1_5B["num_hidden_layers"] // 2))
    time_target(rep, "Qwen2.5-Coder-1.5B architecture, layers 14-27 and the LM head offloaded to the CPU", qwen,
                q_ids[:1], device, 24, reps=3, only=("HF greedy", "specdec plain", "specdec ngram"))


def check_kernels(rep: Report, device, dry: bool) -> None:
    if not dry:
        proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_kernels.py"), "--quick"],
                              capture_output=True, text=True, timeout=max(30, rep.left() - 240))
        rep.add("`python benchmarks/gpu_kernels.py --quick`:", "", "```", (proc.stdout + proc.stderr)[-4000:], "```")
        if proc.returncode != 0:
            rep.fail(f"gpu_kernels.py exited {proc.returncode}")
        return
    # dry: one small case through Triton's interpreter (set before triton is imported, in main)
    from specdec.kernels import tree_attention, tree_attention_ref

    g = torch.Generator().manual_seed(0)
    page, kv_heads, d, prefix, n = 4, 2, 16, 9, 3
    k = torch.randn(8, page, kv_heads, d, generator=g)
    v = torch.randn(8, page, kv_heads, d, generator=g)
    bt = torch.tensor([5, 1, 7], dtype=torch.int32)
    q = torch.randn(n, 4, d, generator=g)
    mask = torch.tril(torch.ones(n, n, dtype=torch.bool))
    args = (q, k, v, bt, prefix, mask, d ** -0.5)
    err = (tree_attention(*args) - tree_attention_ref(*args)).abs().max().item()
    rep.add(f"tree_attention (Triton interpreter) vs tree_attention_ref: max |diff| {err:.2e}")
    if not err < 1e-4:
        rep.fail(f"interpreted tree_attention differs from its reference by {err:.2e}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry", action="store_true", help="CPU, tiny: the script's own code paths, in seconds")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_day_one.md"))
    ap.add_argument("--budget-s", type=float, default=420.0)
    a = ap.parse_args(argv)
    if a.dry:
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["SPECDEC_COMPILE"] = "0"  # the CPU's compiled step has tests of its own; seconds, not a minute
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("gpu_day_one: no CUDA device here; run it on a GPU machine, or with --dry for the CPU pass")
        return 0
    else:
        device = torch.device("cuda")
    import transformers

    transformers.utils.logging.disable_progress_bar()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry pass)"
    header = (f"# GPU day one\n\n`python benchmarks/gpu_day_one.py{' --dry' if a.dry else ''}`\n\n{name}; torch "
              f"{torch.__version__}, transformers {transformers.__version__}; {time.strftime('%Y-%m-%d')}")
    rep = Report(Path(a.out), a.budget_s, header)
    dry = a.dry
    rep.section("1. Triton kernels", lambda: check_kernels(rep, device, dry), 60)
    rep.section("2. Greedy equality, every drafter kind", lambda: check_greedy(rep, device, dry), 60)
    rep.section("3. Sampling goodness of fit (chain verifier)", lambda: check_sampling(rep, device, dry), 20)
    rep.section("4. Batches", lambda: check_batches(rep, device, dry), 20)
    rep.section("5. Device map across the GPU and the CPU", lambda: check_device_map(rep, device, dry), 20)
    rep.section("6. Timing", lambda: timing(rep, device, dry), 40)
    rep.add("", f"failures: {len(rep.failures)}" + "".join(f"\n- {f}" for f in rep.failures))
    rep.flush()
    return 1 if rep.failures else 0


if __name__ == "__main__":
    sys.exit(main())
