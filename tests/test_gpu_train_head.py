"""benchmarks/gpu_train_head.py runs unchanged on a CPU (its dry pass: the zoo target, three steps), and
the command it prints resumes that checkpoint on the CPU to a head that drafts exactly; train-head's time
limit stops a run with its checkpoint written."""
import json
import runpy
import shlex
import sys
from pathlib import Path

import torch

import specdec
from specdec.cli import main
from specdec.drafters import FeatureHead
from specdec.training.head_trainer import HeadTrainArgs, train_head

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_train_head.py"


def test_the_dry_pass_leaves_a_checkpoint_the_printed_command_resumes(tmp_path, capsys, monkeypatch):
    work, out = tmp_path / "w", tmp_path / "h"
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--dry", "--work", str(work), "--out", str(out)])
    try:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    except SystemExit as e:
        assert e.code == 0
    printed = capsys.readouterr().out
    assert json.loads((work / "checkpoint.json").read_text())["step"] == 3 and not out.exists()
    manifest = json.loads((work / "manifest.json").read_text())
    assert manifest["num_prompts"] == 8  # two rounds of answering: 4 prompts, then 8
    command = printed.strip().splitlines()[-1].strip()
    assert command.startswith("specdec train-head") and "--precision bf16" in command
    main(shlex.split(command)[1:] + ["--threads", "1"])
    assert "head saved" in capsys.readouterr().out
    rows = [json.loads(l) for l in (work / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 9))  # resumed at 4, not restarted
    target, tok = specdec.zoo.load("target")
    ids = tok(specdec.zoo.prompts(1)[0], return_tensors="pt").input_ids
    got = specdec.generate(target, ids, drafter=FeatureHead.from_pretrained(out, target), max_new_tokens=12)
    assert torch.equal(got, target.generate(ids, max_new_tokens=12, do_sample=False))


def test_a_time_limit_stops_training_with_its_checkpoint(tmp_path):
    target, tok = specdec.zoo.load("target")
    args = HeadTrainArgs(target="target", out=tmp_path / "o", work=tmp_path / "w", steps=500, batch=2, seq_len=16,
                         num_prompts=4, max_new_tokens=8, num_text_chunks=0, gen_batch=4, draft_vocab=256,
                         eval_every=1000, threads=1, stop_after_s=0.0)
    assert train_head(args, target, tok, progress=False) is None
    assert json.loads((tmp_path / "w" / "checkpoint.json").read_text())["step"] == 1  # one step, then the clock
