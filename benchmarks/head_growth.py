"""How a feature head's acceptance grew with its training: every shipped version of a head, measured alike.

    python benchmarks/head_growth.py --data WORK/data [--head smollm2-135m-instruct-head] [--also DIR ...]

Each commit that changed the shipped head's weights is one version of it (git log); each is read from git
into a temporary folder and measured with the trainer's own `heldout_acceptance` (greedy chain acceptance
by position, drafting from every answer position, teacher-forced on the target's stored features) on the
SAME held-out answers: those of the data folder given (a `specdec train-head --work` folder's data/), split
by the prompt family they answer (`training/prompts.py`; held-out prompts are chosen by a hash of their
text, so no version of the head trained on any of them). `--also` adds heads from folders (a run not yet
shipped). No timing: acceptance only, so the machine need not be quiet.
"""
import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import specdec
from specdec.drafters import FeatureHead
from specdec.training import head_data, prompts
from specdec.training.head_trainer import heldout_acceptance

ROOT = Path(__file__).resolve().parent.parent

ap = argparse.ArgumentParser()
ap.add_argument("--target", default="smollm2-135m-instruct")
ap.add_argument("--head", default="smollm2-135m-instruct-head", help="zoo name of the shipped head")
ap.add_argument("--data", required=True, type=Path, help="a train-head work folder's data/ (its held-out answers)")
ap.add_argument("--also", nargs="*", default=[], type=Path, help="head folders measured after the shipped versions")
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "head_growth"))
a = ap.parse_args()
torch.set_num_threads(a.threads)

rel = Path(specdec.zoo.path(a.head)).resolve().relative_to(ROOT)
log = subprocess.run(["git", "log", "--format=%h %ad", "--date=short", "--", str(rel / "head.safetensors")],
                     cwd=ROOT, capture_output=True, text=True, check=True).stdout.split("\n")
versions = [line.split() for line in reversed(log) if line.strip()]  # oldest first

target, tok = specdec.zoo.load(a.target)
shards = sorted(a.data.glob("chat-*.safetensors"))
if not shards:
    sys.exit(f"{a.data} holds no chat-*.safetensors shards (give a train-head work folder's data/)")
source = json.loads((a.data.parent / "manifest.json").read_text())
wider = set(prompts.wider_requests())
family = {tuple(head_data.render(tok, p)): ("wider chat" if p["user"] in wider else
                                            "older chat" if p["kind"] == "chat" else "code")
          for p in prompts.build(source["num_prompts"], source["seed"]) if prompts.is_heldout(p)}
data = head_data.Dataset(shards)
split: dict[str, list] = {"older chat": [], "wider chat": [], "code": []}
for item in data.heldout:
    toks, _, loss_from = item
    split[family[tuple(toks[:loss_from].tolist())]].append(item)


def measure(folder: Path, label: str, date: str) -> dict:
    head = FeatureHead.from_pretrained(folder, target)
    trained = json.loads((folder / "head_config.json").read_text()).get("trained", {})
    row = {"version": label, "date": date, "steps": trained.get("steps"),
           "positions_seen": trained.get("positions_seen"),
           "run_tokens": trained.get("train_tokens"), "by_family": {}}
    head.net.eval()
    for name, items in split.items():
        data.heldout = items
        with torch.no_grad():
            row["by_family"][name] = heldout_acceptance(head.net, target, data)
    print(json.dumps(row), flush=True)
    return row


rows = []
with tempfile.TemporaryDirectory() as tmp:
    for rev, date in versions:
        folder = Path(tmp) / rev
        folder.mkdir()
        for name in ("head.safetensors", "head_config.json"):
            blob = subprocess.run(["git", "show", f"{rev}:{rel / name}"], cwd=ROOT, capture_output=True, check=True)
            (folder / name).write_bytes(blob.stdout)
        rows.append(measure(folder, rev, date))
for folder in a.also:
    rows.append(measure(folder, str(folder), "not shipped"))

cmd = "python benchmarks/head_growth.py " + " ".join(sys.argv[1:])
lines = ["# How the head's acceptance grew with training", "", f"`{cmd}`", "",
         f"Head `{a.head}` for `{a.target}`: every commit that changed its weights, measured on the same held-out "
         f"answers (data of {source['num_prompts']} prompts; "
         + ", ".join(f"{k}: {len(v)} answers" for k, v in split.items())
         + "), with the trainer's `heldout_acceptance` (greedy chain, acceptance of the first j drafted tokens "
           "all equal to the target's argmax; tau = 1 + the sum over 5 positions). Steps and positions are "
           "cumulative over continued runs; run tokens are the data of the version's last run.", "",
         "| version | date | steps | positions seen | last run's tokens | "
         + " | ".join(f"{k}: pos 1 / 2 / 3, tau" for k in split) + " |",
         "|---|---|---|---|---|" + "---|" * len(split)]
for r in rows:
    cells = [f"{f['accept'][0]:.3f} / {f['accept'][1]:.3f} / {f['accept'][2]:.3f}, {f['tau']:.2f}"
             for f in r["by_family"].values()]
    run_tokens = f"{r['run_tokens'] / 1e3:.0f} K" if r["run_tokens"] else "not recorded"
    seen = f"{r['positions_seen'] / 1e6:.1f} M" if r["positions_seen"] else "not recorded"
    lines.append(f"| {r['version']} | {r['date']} | {r['steps']} | {seen} | {run_tokens} | "
                 + " | ".join(cells) + " |")
specdec.files.write_text(Path(a.out + ".md"), "\n".join(lines) + "\n")
specdec.files.write_text(Path(a.out + ".json"), json.dumps(rows, indent=1))
print("\n".join(lines))
