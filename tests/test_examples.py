"""Every example runs as a user would run it (small settings)."""
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent.parent / "examples"


@pytest.mark.parametrize("script, args", [
    ("generate_three_ways.py", ["--max-new-tokens", "16"]),
    ("streaming.py", ["--max-new-tokens", "16"]),
    ("sampling.py", ["--max-new-tokens", "12"]),
    ("select_draft.py", ["--max-new-tokens", "8", "--max-k", "2"]),
    ("lookup_first.py", ["--max-new-tokens", "24"]),
])
def test_example_runs(script, args, tmp_path):
    extra = ["--out", str(tmp_path)] if script == "select_draft.py" else []
    r = subprocess.run([sys.executable, str(EXAMPLES / script), *args, *extra], capture_output=True, text=True,
                       timeout=600, env={"OMP_NUM_THREADS": "1", **__import__("os").environ})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip()
