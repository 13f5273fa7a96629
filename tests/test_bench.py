"""`specdec bench` and `specdec select-draft` on a tiny configuration: the files and fields they promise."""
import json

import pytest
import torch

from specdec.cli import main


def test_bench_writes_json_and_markdown_with_every_mode(tmp_path):
    out = tmp_path / "bench"
    main(["bench", "--drafter", "draft-tiny", "--num-prompts", "1", "--repeats", "1", "--max-new-tokens", "8",
          "--out", str(out), "--threads", "1"])
    report = json.loads(out.with_suffix(".json").read_text())
    modes = report["modes"]
    for m in ("target-only", "specdec plain", "HF assisted k=4", "HF assisted heuristic", "HF prompt lookup",
              "specdec k=4", "specdec adaptive", "specdec ngram"):
        assert m in modes and modes[m]["tokens_per_s"] > 0
        assert modes[m]["mismatches"] == 0  # greedy modes reproduce target-only output
    for field in ("alpha", "tau", "draft_length", "ttft_s", "tpot_s", "prefill_s", "decode_s", "fraction_of_ideal"):
        assert field in modes["specdec k=4"]
    assert "| specdec adaptive |" in out.with_suffix(".md").read_text()
    assert modes["target-only"]["total_speedup"] == 1.0 and "all prompts: speedup" in out.with_suffix(".md").read_text()
    for r in modes.values():  # one prompt, one repeat: the whole set's throughput is that run's
        assert abs(r["total_tokens_per_s"] - r["tokens_per_s"]) < 1e-9 * r["tokens_per_s"]
    for m in ("HF assisted k=2", "HF assisted k=6", "specdec k=2", "specdec k=6"):  # the default k sweep
        assert modes[m]["mismatches"] == 0
    assert modes["specdec plain"]["draft_length"] == 0 and modes["specdec plain"]["fraction_of_ideal"] is None
    # which step ran the target, per mode: the zoo target is below step='auto's size, 'bitwise' is the lean loop
    assert modes["specdec plain"]["step"] == modes["specdec plain bitwise"]["step"] == "lean"
    assert "The target's step" in out.with_suffix(".md").read_text()
    best = report["best_with_draft"]
    assert best["mode"].startswith("specdec") and best["mode"] not in ("specdec ngram", "specdec plain")
    plain = modes["specdec plain"]["tokens_per_s"]
    assert abs(best["vs_specdec_plain"] - modes[best["mode"]]["tokens_per_s"] / plain) < 1e-9
    assert best["speedup"] == max(r["speedup"] for n, r in modes.items() if n.startswith("specdec k=") or
                                  n == "specdec adaptive")
    # the shipped zoo head joins by default: its modes, greedy-exact, and its own headline
    head = report["best_head"]
    head_modes = {n: r for n, r in modes.items() if n.startswith(("specdec head", "specdec ngram+head"))}
    assert "specdec ngram+head adaptive" in head_modes and head["mode"] in head_modes
    assert all(r["mismatches"] == 0 for r in head_modes.values())
    assert head["speedup"] == max(r["speedup"] for r in head_modes.values())
    assert "Best feature-head mode" in out.with_suffix(".md").read_text()


def test_an_early_exit_no_layer_of_which_pays_is_not_run(monkeypatch):
    """--early-exit auto where every candidate layer's predicted speedup is under 1 (a target whose LM head is
    most of its weights: Gemma 3 270M's best was 0.88): no early-exit mode, and the report says why."""
    import specdec.drafters.early_exit as early_exit
    from specdec.cli.bench import to_markdown
    from specdec.cli.run import _exit_layer
    from conftest import build

    rows = [{"layer": 1, "alpha": 0.1, "c": 0.8, "best_k": 1, "predicted_speedup": 0.6},
            {"layer": 2, "alpha": 0.7, "c": 0.95, "best_k": 1, "predicted_speedup": 0.88}]
    monkeypatch.setattr(early_exit, "choose_exit_layer", lambda target, seqs, lengths: (2, rows))
    target = build("llama", seed=0)
    prompts = [torch.tensor([[3, 4, 5]])]
    assert _exit_layer("auto", target, prompts, 4) == (None, rows)
    rows[1]["predicted_speedup"] = 1.2
    assert _exit_layer("auto", target, prompts, 4) == (2, rows)
    from specdec.cli.bench import ModeResult, summarise

    def report(*names):
        out = summarise({n: ModeResult(n, tokens_per_s=[10.0], tokens=[10], seconds=[1.0]) for n in names}, [2], True)
        return dict(out, exit_layer_choice=rows)

    assert "the early-exit mode was not run" in to_markdown(report("target-only"))
    assert "was not run" not in to_markdown(report("target-only", "specdec early exit L=2"))


def test_the_ideal_and_c_are_measured_against_specdecs_own_step():
    """A runtime twice HF's speed with nothing drafted must not count as speculation: a drafted mode's c and
    `% of ideal` divide by specdec plain's step, not HF target-only's (which once read 190-400 %)."""
    from types import SimpleNamespace

    from specdec.cli.bench import ModeResult, summarise
    from specdec.policy import ideal_speedup

    def mode(name, rate, stats=()):
        return ModeResult(name, tokens_per_s=[rate], tokens=[100], seconds=[100 / rate], stats=list(stats))

    step = SimpleNamespace(alpha=0.6, drafted_tokens=300, target_forwards=100, draft_s=0.3, acceptance_rate=0.6,
                           mean_accepted_length=2.0, ttft_s=0.1, tpot_s=0.02, prefill_s=0.1, decode_s=2.0,
                           verify_s=1.7, step="compiled")
    results = {"target-only": mode("target-only", 10.0), "specdec plain": mode("specdec plain", 20.0),
               "specdec k=3": mode("specdec k=3", 30.0, [step])}
    row = summarise(results, [3], greedy=True)["modes"]["specdec k=3"]
    c = (0.3 / 300) * 20.0  # a drafted token's time over specdec plain's time per token (1 / 20 s)
    assert row["c"] == pytest.approx(c)
    assert row["fraction_of_ideal"] == pytest.approx((30.0 / 20.0) / ideal_speedup(0.6, 3, c))
    assert row["speedup"] == pytest.approx(3.0)  # the headline speedup stays against HF target-only
    del results["specdec plain"]  # where plain did not run: against target-only, as before
    row = summarise(results, [3], greedy=True)["modes"]["specdec k=3"]
    assert row["fraction_of_ideal"] == pytest.approx(3.0 / ideal_speedup(0.6, 3, (0.3 / 300) * 10.0))


def test_select_draft_ranks_drafts_and_draws_plots(tmp_path):
    main(["select-draft", "--drafts", "draft-tiny", "draft-wide", "--num-prompts", "1", "--max-k", "2",
          "--max-new-tokens", "8", "--out", str(tmp_path), "--threads", "1"])
    report = json.loads((tmp_path / "report.json").read_text())
    assert sorted(report["ranking"]) == ["draft-tiny", "draft-wide"]
    for name in report["ranking"]:
        rec = report["drafts"][name]["0.0"]
        assert len(rec["per_position_acceptance"]) == 2 and 0 <= rec["alpha"] <= 1 and rec["c"] > 0
        assert set(rec["predicted_speedup"]) == {"0", "1", "2"}
    for png in ("acceptance_by_position.png", "speedup_vs_k.png"):
        data = (tmp_path / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "int4"])
def test_bench_with_a_low_precision_draft_keeps_the_float32_targets_output(tmp_path, dtype):
    out = tmp_path / "bench"
    main(["bench", "--drafter", "draft-tiny", "--draft-dtype", dtype, "--k", "2", "--num-prompts", "1",
          "--repeats", "1", "--max-new-tokens", "8", "--out", str(out), "--threads", "1"])
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["draft_dtype"] == dtype and f"({dtype}" in out.with_suffix(".md").read_text()
    assert all(r["mismatches"] == 0 for r in report["modes"].values())
    assert report["modes"]["specdec k=2"]["alpha"] > 0  # the low-precision draft still agrees with the target


def test_bench_runs_the_target_in_the_dtype_asked(tmp_path):
    out = tmp_path / "bench"
    main(["bench", "--drafter", "ngram", "--dtype", "bfloat16", "--k", "2", "--num-prompts", "1", "--repeats", "1",
          "--max-new-tokens", "8", "--no-hf", "--head", "none", "--out", str(out), "--threads", "1"])
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["dtype"] == "bfloat16" and "target target (bfloat16)" in out.with_suffix(".md").read_text()
    assert report["modes"]["specdec ngram k=2"]["tokens_per_s"] > 0


def test_bench_without_a_draft_model_runs_ngram_at_each_k_early_exit_and_the_decode_limit(tmp_path):
    out = tmp_path / "bench.v1"  # a dotted name keeps its dot: bench.v1.json, not bench.json
    main(["bench", "--drafter", "ngram", "--early-exit", "3", "--k", "2", "3", "--num-prompts", "1",
          "--repeats", "1", "--max-new-tokens", "8", "--out", str(out), "--threads", "1"])
    report = json.loads((tmp_path / "bench.v1.json").read_text())
    modes = report["modes"]
    exits = [m for m in modes if m.startswith("specdec early exit L=")]
    assert {"specdec ngram k=2", "specdec ngram k=3", "specdec ngram", "HF prompt lookup"} <= set(modes)
    assert exits == ["specdec early exit L=3"] and all(r["mismatches"] == 0 for r in modes.values())
    lim = report["decode_limit"]
    assert lim["weight_bytes"] > 1e7 and set(lim["bandwidth_bytes_per_s"]) == {"copy", "read", "matvec"}
    assert lim["tpot_over_limit"]["target-only"] * lim["limit_tpot_s"] == pytest.approx(
        1 / modes["target-only"]["tokens_per_s"])
    md = (tmp_path / "bench.v1.md").read_text()
    assert "Physical limit of a plain decode step" in md


def test_select_draft_ranks_drafters_that_are_not_models(tmp_path):
    main(["select-draft", "--drafts", "ngram", "early-exit:3", "ngram+target-head", "--num-prompts", "1", "--max-k",
          "2", "--max-new-tokens", "8", "--out", str(tmp_path), "--threads", "1"])
    report = json.loads((tmp_path / "report.json").read_text())
    assert sorted(report["ranking"]) == ["early-exit:3", "ngram", "ngram+target-head"] and not report["skipped"]


def test_load_prompts_reads_files_in_order_or_in_turn(tmp_path):
    from specdec.cli.bench import load_prompts

    class Chars:  # a tokenizer stand-in: one id per character
        def __call__(self, text, return_tensors=None):
            return type("Enc", (), {"input_ids": torch.tensor([[ord(c) for c in text]])})()

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("a1", "a2", "a3")))
    b.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("b1", "b2")))
    text = lambda ps: ["".join(map(chr, p[0].tolist())) for p in ps]  # noqa: E731
    assert text(load_prompts(Chars(), f"{a},{b}", 2)) == ["a1", "a2", "b1", "b2"]
    assert text(load_prompts(Chars(), f"{a},{b}", 3, alternate=True)) == ["a1", "b1", "a2", "b2"]


def test_the_whole_sets_throughput_weighs_every_prompts_tokens():
    """Median tokens/s ignores how much faster a mode is on the prompts that repeat themselves; the whole
    set's tokens over its seconds counts them: here the median says 1.0x and the set 1.5x."""
    from specdec.cli.bench import ModeResult, summarise

    def mode(name, runs):
        return ModeResult(name, [t / s for t, s in runs], [t for t, _ in runs], [s for _, s in runs])

    base = [(10, 1.0), (10, 1.0), (10, 1.0)]
    results = {"target-only": mode("target-only", base),
               "specdec ngram": mode("specdec ngram", [(10, 1.0), (10, 1.0), (10, 0.25)])}
    row = summarise(results, [2], True)["modes"]["specdec ngram"]
    assert row["speedup"] == 1.0
    assert abs(row["total_speedup"] - 30 / 2.25 / 10) < 1e-12


@pytest.mark.parametrize("drafter", ["draft-tiny", "ngram"])
def test_bench_runs_a_tree_mode_when_given_one(tmp_path, drafter):
    out = tmp_path / "bench"
    main(["bench", "--drafter", drafter, "--num-prompts", "1", "--repeats", "1", "--max-new-tokens", "8", "--k", "2",
          "--no-hf", "--head", "none", "--tree", "6", "3", "2", "--out", str(out), "--threads", "1"])
    modes = json.loads(out.with_suffix(".json").read_text())["modes"]
    name = "specdec tree" if drafter == "draft-tiny" else "specdec ngram tree"
    assert modes[name]["tokens_per_s"] > 0 and modes[name]["mismatches"] == 0
    with pytest.raises(SystemExit, match="nodes=40 is more than"):
        main(["bench", "--drafter", drafter, "--tree", "40", "3", "2", "--out", str(out)])
