"""benchmarks/peers/vllm_peer.py's side-by-side table (no vLLM needed): tokens/s, greedy agreement with HF,
and tau / acceptance by position counted alike for both engines (per step that drafted)."""
import importlib.util
import json
from pathlib import Path

import pytest

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


class _Tokenizer:
    """Just what vllm_peer.prompts reads: a chat template (or none), the template's rendering, plain encoding."""

    def __init__(self, chat_template):
        self.chat_template = chat_template

    def __call__(self, text):
        return {"input_ids": [7] + [len(w) for w in text.split()]}

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
        assert add_generation_prompt and tokenize and return_dict
        return {"input_ids": [1, 2] + self(messages[0]["content"])["input_ids"] + [3]}


def test_prompts_use_the_chat_template_and_plain_text_where_the_tokenizer_has_none():
    plain = vllm_peer.prompts(_Tokenizer(None), 2)
    chat = vllm_peer.prompts(_Tokenizer("{{ messages }}"), 2)
    assert len(plain) == len(chat) == 2
    assert all(c == [1, 2] + p + [3] for c, p in zip(chat, plain))


def test_compare_refuses_runs_of_different_targets(tmp_path, monkeypatch):
    hf = [{"tokens": [1], "seconds": 1.0}]
    runs = []
    for name, target in (("a", "smollm2-135m-instruct"), ("b", "gemma3-270m")):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"engine": "specdec", "args": {"target": target}, "modes": {"HF generate": hf}}))
        runs.append(str(path))
    monkeypatch.setattr("sys.argv", ["vllm_peer.py", "--compare", *runs, "--out", str(tmp_path / "t.md")])
    with pytest.raises(SystemExit, match="targets.*gemma3-270m"):
        vllm_peer.main()
    assert not (tmp_path / "t.md").exists()


ttft_spec = importlib.util.spec_from_file_location("vllm_ttft", ROOT / "benchmarks" / "peers" / "vllm_ttft.py")
vllm_ttft = importlib.util.module_from_spec(ttft_spec)
ttft_spec.loader.exec_module(vllm_ttft)


def test_ttft_table_takes_medians_over_runs_and_flags_a_first_token_that_differs(tmp_path):
    def row(kind, tokens, seconds, first):
        return {"kind": kind, "tokens": tokens, "seconds": seconds, "first_token": first}

    spec1 = {"HF generate": [row("chat", 40, [1.0, 1.2], 7), row("long", 700, [8.0], 9)],
             "specdec": [row("chat", 40, [0.25, 0.3], 7), row("long", 700, [2.0], 9)]}
    spec2 = {"HF generate": [row("chat", 40, [1.4], 7), row("long", 700, [8.0], 9)],
             "specdec": [row("chat", 40, [0.2], 7), row("long", 700, [1.0], 9)]}
    vllm = {"vLLM": [row("chat", 40, [2.0], 7), row("long", 700, [16.0], 3)]}
    table = vllm_ttft.compare([_run(tmp_path, "s1", "specdec", spec1), _run(tmp_path, "v", "vllm", vllm),
                               _run(tmp_path, "s2", "specdec", spec2)])
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines()[2:]]
    # HF: median of 1.0, 1.2, 1.4 = 1.2 s; specdec: median of 0.25, 0.3, 0.2 = 0.25 s
    assert cells[0] == ["chat", "40", "1200", "250", "2000", "4.80x", "0.60x", "yes"]
    assert cells[1][:7] == ["long", "700", "8000", "1500", "16000", "5.33x", "0.50x"] and cells[1][7] == "**no**"
    with pytest.raises(SystemExit, match="HF generate"):
        vllm_ttft.compare([_run(tmp_path, "v2", "vllm", vllm)])
