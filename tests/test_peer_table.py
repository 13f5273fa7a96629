"""benchmarks/peers/vllm_peer.py's side-by-side table (no vLLM needed): tokens/s, greedy agreement with HF,
and tau / acceptance by position counted alike for both engines (per step that drafted)."""
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("vllm_peer", ROOT / "benchmarks" / "peers" / "vllm_peer.py")
vllm_peer = importlib.util.module_from_spec(spec)
spec.loader.exec_module(vllm_peer)


def _run(tmp_path, name, engine, modes):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"engine": engine, "args": {}, "modes": modes}))
    return str(path)


def test_table_counts_acceptance_per_drafting_step_and_flags_a_token_that_differs(tmp_path):
    hf = [{"tokens": [1, 2, 3, 4], "seconds": 1.0}, {"tokens": [5, 6], "seconds": 1.0}]
    head = [{"tokens": [1, 2, 3, 4], "seconds": 0.5, "step": "lean",
             "acceptance": {"drafting_steps": 10, "accepted_by_position": [8, 4]}},
            {"tokens": [5, 6], "seconds": 0.5, "step": "lean",
             "acceptance": {"drafting_steps": 10, "accepted_by_position": [6, 2, 1]}}]
    wrong = [{"tokens": [1, 2, 9, 4], "seconds": 2.0}, {"tokens": [5, 6], "seconds": 2.0}]
    table = vllm_peer.compare([_run(tmp_path, "s", "specdec", {"HF generate": hf, "specdec head": head}),
                               _run(tmp_path, "v", "vllm", {"vLLM ngram": wrong})])
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines()[2:]]
    rows = {c[0]: c for c in cells}
    assert rows["specdec head [ran: lean]"][2:7] == ["6.0", "2.00", "yes", "2.05", "0.70, 0.30, 0.05"]
    assert rows["vLLM ngram"][2:7] == ["1.5", "0.50", "**no**", "-", "-"]
    assert rows["HF generate"][4] == "yes"
