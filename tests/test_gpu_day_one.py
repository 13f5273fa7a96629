"""benchmarks/gpu_day_one.py cannot rot between GPU loans: its dry pass (CPU, Triton's interpreter, two
tokens each) runs every section's code and must report every check passed."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_day_one_dry_pass_runs_every_section(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_day_one", ROOT / "benchmarks" / "gpu_day_one.py")
    day_one = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(day_one)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the dry pass sets both too; monkeypatch restores them after
    monkeypatch.setenv("SPECDEC_COMPILE", "0")
    out = tmp_path / "day_one.md"
    assert day_one.main(["--dry", "--out", str(out)]) == 0
    text = out.read_text()
    for title in ("1. Triton kernels", "2. Greedy equality", "3. Sampling goodness of fit", "4. Batches",
                  "5. Device map", "6. Timing"):
        assert f"## {title}" in text
    assert "skipped" not in text and "FAILED" not in text and "failures: 0" in text
    assert "| head dynamic tree | yes |" in text and "| lossy (always accept) |" in text
    assert "| specdec head | " in text  # the timing table ran its modes
    assert not list(tmp_path.glob("*.tmp"))  # written to a temporary name, then renamed
