"""vLLM CPU loads a head specdec exported (an oracle no one here wrote): its greedy output with the head
equals its own target-only output, and its acceptance by position is specdec's with the same head.

vLLM lives in its own venv (it pins an older transformers): this test runs it through the interpreter
named by SPECDEC_VLLM_PYTHON (default .venv-vllm/bin/python) and skips, naming the install line, where
there is none. Minutes: it trains a small eagle3 head for the zoo target first."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import specdec
from specdec.drafters import FeatureHead
from specdec.drafters.eagle_format import export_eagle3
from specdec.training.head_trainer import train_head

from test_head_trainer import args as trainer_args

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("SPECDEC_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
pytestmark = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=(
    f"no vLLM interpreter at {VLLM_PYTHON}: bash benchmarks/peers/make_vllm_venv.sh .venv-vllm "
    "(or set SPECDEC_VLLM_PYTHON)"))


def _run(cmd: list[str], cwd: Path) -> None:
    """Run an engine's script; on failure, fail with the engine's own error lines (vLLM's workers print theirs
    to stdout, in the middle of the output) and the end of its stderr."""
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=1200, stdin=subprocess.DEVNULL)
    errors = [line for line in (done.stdout + done.stderr).splitlines() if "Error" in line or "ERROR" in line]
    assert done.returncode == 0, (f"{Path(cmd[1]).name} exited {done.returncode}:\n" + "\n".join(errors[-12:])
                                  + f"\n... {done.stderr[-3000:]}")


def test_vllm_drafts_with_an_exported_head_exactly_and_accepts_what_specdec_accepts(tmp_path):
    target, tok = specdec.zoo.load("target")
    a = trainer_args(tmp_path, "e3", arch="eagle3", steps=200, num_prompts=60, max_new_tokens=48, lr=3e-3,
                     eval_every=100, threads=2)
    head_dir = train_head(a, target, tok, progress=False)
    exported = export_eagle3(FeatureHead.from_pretrained(head_dir, target).net.float(), target, tmp_path / "exported")
    script = ROOT / "benchmarks" / "peers" / "vllm_eagle3.py"
    common = ["--target", str(specdec.zoo.path("target")), "--head", str(exported), "--k", "3",
              "--num-prompts", "4", "--max-new-tokens", "48"]
    _run([str(VLLM_PYTHON), str(script), *common, "--out", str(tmp_path / "vllm.json")], cwd=tmp_path)
    _run([sys.executable, str(script), "--specdec", *common, "--out", str(tmp_path / "specdec.json")], cwd=tmp_path)
    vllm = json.loads((tmp_path / "vllm.json").read_text())
    ours = json.loads((tmp_path / "specdec.json").read_text())
    assert all(vllm["greedy_equal"])  # vLLM's own target-only greedy, token for token
    assert ours["accept_by_position"][0] > 0.1  # the head learned something: the comparison has power
    for i, (v, s) in enumerate(zip(vllm["accept_by_position"], ours["accept_by_position"])):
        # binomial noise over the drafting steps, both sides: 3 standard errors
        se = (s * (1 - s) / max(1, ours["drafting_steps"]) + v * (1 - v) / max(1, vllm["drafting_steps"])) ** 0.5
        assert abs(v - s) <= 3 * se + 0.02, (i, v, s)
