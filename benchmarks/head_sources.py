"""Which training data pays per CPU-hour: one head per `--data` source, trained side by side, measured alike.

    python benchmarks/head_sources.py --root /work/headwork/sources [--sources chitchat,answers,answers@eagle3] \
        [--until 3000] [--chunk 250]

A run is named SOURCE[@ARCH]: SOURCE one `--data` source or a mix joined by '+' (answers+chitchat), ARCH the
head's architecture (eagle, the default, or eagle3), so data paths and training paths are measured alike.
Each run is its own `specdec train-head` (root/RUN.work), all with the same optimiser and schedule; the
runs advance in turns, `--chunk` steps each (stop_at), so wherever the script is stopped every run has
trained about as long, and rerunning it resumes every run where it stopped. Every run
measures held-out acceptance on the same sequences: the target's answers to the held-out composed prompts
(training/head_sources.py), which no source trains on. Cost is CPU time (all threads, so core-seconds):
the data's from data/costs.json (answering and features, per shard), the training's from the log.
Acceptance only, no timing: the machine need not be quiet, though CPU time grows somewhat under load.
Writes benchmarks/results/head_sources.md (and .png with matplotlib) after every turn, from the curves in
head_sources.json beside it: a source this run trains replaces its curve there, the others stay, so sources
measured in other sessions (other work folders, other machines of the same class) share one table.
"""
import argparse
import json
import sys
from pathlib import Path

import torch

from specdec.files import write_text
from specdec.kernels.cpu_info import cpu_name
from specdec.training.head_sources import parse as parse_sources
from specdec.training.head_trainer import HeadTrainArgs, load_target, train_head

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = dict(batch=8, seq_len=256, lr=2e-3, warmup=100, ttt=3, ce_weight=1.0, draft_vocab=8192, num_prompts=1200,
                max_new_tokens=160, gen_batch=64, eval_every=250, heldout_seqs=24, threads=2, precision="fp32")
PER_SOURCE = {"answers": dict(num_text_chunks=200), "chitchat": dict(num_text_chunks=0, num_conversations=1000),
              "random": dict(num_text_chunks=0, num_random=1200)}

LEGACY_MACHINE = {"chitchat": "AMD EPYC 2-core", "answers": "AMD EPYC 2-core"}  # runs stored before runs named theirs
READING = "## Reading"  # a section written by hand below the table, kept when the table is rewritten
ap = argparse.ArgumentParser()
ap.add_argument("--target", default="smollm2-135m-instruct")
ap.add_argument("--root", required=True, type=Path, help="the runs' work folders go here (resumable)")
ap.add_argument("--sources", default="chitchat,answers")
ap.add_argument("--until", type=int, default=3000, help="training steps per source (the cosine schedule's length)")
ap.add_argument("--chunk", type=int, default=250, help="steps a source trains before the next one's turn")
ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "head_sources")
a = ap.parse_args()
sources = a.sources.split(",")
ARCHS = ("eagle", "eagle3")


def run_settings(run: str) -> dict:
    """'answers+chitchat@eagle3' -> the HeadTrainArgs fields that name it (data, arch, per-source sizes)."""
    data, _, arch = run.partition("@")
    try:
        parts = parse_sources(data)
    except ValueError as e:
        raise SystemExit(f"head_sources: run {run!r}: {e}") from None
    if arch and arch not in ARCHS:
        raise SystemExit(f"head_sources: run {run!r}: architecture {arch!r} is not one of {ARCHS}")
    sizes = {}
    for part in parts:  # a mix reads each part as much as it would alone; text chunks are the answers source's
        sizes.update({k: max(v, sizes.get(k, 0)) for k, v in PER_SOURCE[part].items()})
    return dict(data=data, arch=arch or "eagle", **sizes)


for run in sources:
    run_settings(run)  # refuse a bad name before loading anything
target, tok = load_target(a.target)


def run_args(source: str, stop_at: int) -> HeadTrainArgs:
    return HeadTrainArgs(target=a.target, out=a.root / f"{source}.head", work=a.root / f"{source}.work", steps=a.until,
                         stop_at=stop_at, **SETTINGS, **run_settings(source))


def curve(source: str) -> tuple[dict, list[dict]]:
    """(the data's cost, the evaluations: step, core-hours of data + training, acceptance by position, tau)."""
    work = a.root / f"{source}.work"
    costs_path = work / "data" / "costs.json"
    costs = json.loads(costs_path.read_text()) if costs_path.exists() else {}
    data_cpu = sum(c["cpu_seconds"] for name, c in costs.items() if not name.startswith("eval"))
    data = {"positions": sum(c["positions"] for name, c in costs.items() if not name.startswith("eval")),
            "core_hours": data_cpu / 3600}
    log = work / "log.jsonl"
    rows = [json.loads(l) for l in log.read_text().splitlines()] if log.exists() else []
    evals = [{"step": r["step"], "core_hours": (data_cpu + r["cpu_seconds"]) / 3600, **r["heldout"]}
             for r in rows if "heldout" in r and "cpu_seconds" in r]
    return data, evals


def merged_series() -> dict:
    """{source: {"data": ..., "evals": [...]}}: the stored curves, with this run's sources measured anew."""
    store = a.out.with_suffix(".json")
    series = json.loads(store.read_text()) if store.exists() else {}
    for source in sources:
        data, evals = curve(source)
        if evals:
            series[source] = {"data": data, "evals": evals, "until": a.until, "machine": cpu_name()}
    write_text(store, json.dumps(series, indent=1) + "\n")
    return series


def report() -> None:
    lines = [f"# Head training data per CPU-hour ({a.target}, feature head, batch {SETTINGS['batch']} x "
             f"{SETTINGS['seq_len']}, {a.until}-step cosine)", "",
             "```", f"python benchmarks/head_sources.py --root ROOT --sources SOURCE --until {a.until} "
             f"--chunk {a.chunk}", "```", "",
             "Runs are named SOURCE[@ARCH] (the head's architecture; eagle where not named). fp32 training on 2 "
             "cores; core-hours are process CPU time (all threads), data (answering + features, data/costs.json) "
             "plus training, on the machine named beside each run (core-hours compare within a machine; steps and "
             "positions across machines). Acceptance: greedy chain acceptance by position on the target's answers "
             "to the held-out composed prompts, the same 24 answers for every run.", "",
             "| run | machine | data positions | data core-h | step | total core-h | accept@1 | @2 | @3 | tau |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    series = merged_series()
    for source, run in series.items():
        data, evals = run["data"], run["evals"]
        for e in evals:
            acc = e["accept"]
            machine = run.get("machine", LEGACY_MACHINE.get(source, "not recorded"))
            lines.append(f"| {source} | {machine} | {data['positions']} | {data['core_hours']:.2f} | {e['step']} | "
                         f"{e['core_hours']:.2f} | {acc[0]:.3f} | {acc[1]:.3f} | {acc[2]:.3f} | {e['tau']:.2f} |")
    md = a.out.with_suffix(".md")
    kept = md.read_text().partition(READING)[2] if md.exists() else ""  # the written reading stays
    write_text(md, "\n".join(lines) + "\n" + (f"\n{READING}{kept}" if kept else ""))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    from specdec.files import save_figure

    fig, ax = plt.subplots(figsize=(6, 4))
    for source, run in series.items():
        ax.plot([e["core_hours"] for e in run["evals"]], [e["accept"][0] for e in run["evals"]], marker="o",
                label=source)
    ax.set_xlabel("core-hours (data + training)")
    ax.set_ylabel("held-out acceptance at position 1")
    ax.legend()
    ax.grid(alpha=0.3)
    save_figure(fig, a.out.with_suffix(".png"), dpi=100, bbox_inches="tight")
    plt.close(fig)


for stop in range(a.chunk, a.until + a.chunk, a.chunk):
    for source in sources:
        stop_at = min(stop, a.until)
        if (a.root / f"{source}.head").exists():
            continue
        print(f"{source}: to step {stop_at}", file=sys.stderr, flush=True)
        train_head(run_args(source, stop_at if stop_at < a.until else None), target, tok, progress=False)
        report()
        torch.set_num_threads(SETTINGS["threads"])
report()
