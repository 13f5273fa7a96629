"""Measure the zoo and write one model card per model (README.md + card.json beside the weights).

For every model: parameters, training tokens and time, held-out loss and perplexity (64 fixed windows of
256 tokens over the held-out modules), the unigram baseline. For every draft against the target, on
held-out prompts: greedy acceptance rate and tau at k = 4 through the specdec engine, teacher-forced
per-token agreement, and the per-token latency ratio c (plain decoding in the same engine, alternated).
"""
from __future__ import annotations

import copy
import json
import math
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from ..files import write_text
from . import MODELS_DIR, load, prompts, shipped
from .corpus import EOS, read_texts
from .train import heldout_loss


def _tokens(tok, split: str) -> np.ndarray:
    eos = tok.convert_tokens_to_ids(EOS)
    ids: list[int] = []
    for enc in tok(read_texts(split), add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(eos)
    return np.asarray(ids, dtype=np.int64)


def unigram_loss(train: np.ndarray, heldout: np.ndarray, vocab: int) -> float:
    counts = np.bincount(train, minlength=vocab).astype(np.float64) + 1.0  # add-one smoothing
    logp = np.log(counts / counts.sum())
    return float(-logp[heldout].mean())


def _tpot(model, ids, n=48) -> float:
    import specdec

    out = specdec.generate(model, ids, drafter=None, draft_length=0, max_new_tokens=n, eos_token_id=None,
                           return_dict_in_generate=True)
    return out.stats.tpot_s


def _speculate_k4(target, draft, prompt_ids, continuations, new_tokens: int, name: str) -> tuple[int, int, int, int]:
    """Greedy specdec at k = 4 over the prompts, checked against the target's own continuations.
    Returns (drafted, accepted, target forwards, tokens emitted after the first), summed."""
    import specdec

    drafted = accepted = forwards = emitted = 0
    for ids, cont in zip(prompt_ids, continuations):
        out = specdec.generate(target, ids, drafter=draft, draft_length=4, max_new_tokens=new_tokens,
                               return_dict_in_generate=True)
        assert torch.equal(out.sequences, cont), f"{name}: speculative output differs from target greedy"
        s = out.stats
        drafted += s.drafted_tokens
        accepted += s.accepted_tokens
        forwards += s.target_forwards
        emitted += s.new_tokens - 1
    return drafted, accepted, forwards, emitted


def measure(num_prompts: int = 16, new_tokens: int = 64, work: Path | None = None) -> dict:
    import specdec

    torch.set_num_threads(2)
    target, tok = load("target")
    ps = prompts(num_prompts)
    prompt_ids = [tok(p, return_tensors="pt").input_ids for p in ps]
    heldout = _tokens(tok, "heldout")
    train_path = (work / "train.npy") if work else None
    train = np.load(train_path) if train_path and train_path.exists() else _tokens(tok, "train")
    vocab = target.config.vocab_size
    results = {"unigram_loss": unigram_loss(train, heldout, vocab), "models": {}}
    results["unigram_ppl"] = math.exp(results["unigram_loss"])
    # target greedy continuations, reused for teacher-forced agreement
    continuations = [specdec.generate(target, ids, max_new_tokens=new_tokens, draft_length=0) for ids in prompt_ids]
    sample = tok.decode(continuations[0][0, prompt_ids[0].shape[1]:])
    for name in shipped():
        model, _ = (target, tok) if name == "target" else load(name)
        training = json.loads((MODELS_DIR / name / "training.json").read_text())
        loss = heldout_loss(model, heldout)
        rec = {"name": name, "params": sum(p.numel() for p in model.parameters()),
               "layers": model.config.num_hidden_layers, "hidden": model.config.hidden_size,
               "train_tokens": training["train_tokens"], "train_seconds": training["train_seconds"],
               "teacher": training.get("teacher"), "heldout_loss": round(loss, 4),
               "heldout_ppl": round(math.exp(loss), 2)}
        if name != "target":
            drafted, accepted, forwards, emitted = _speculate_k4(target, model, prompt_ids, continuations, new_tokens, name)
            agree = total = 0
            for ids, cont in zip(prompt_ids, continuations):
                with torch.no_grad():
                    lg = model(cont).logits[0, ids.shape[1] - 1:-1].argmax(-1)
                agree += int((lg == cont[0, ids.shape[1]:]).sum())
                total += cont.shape[1] - ids.shape[1]
            # the same weights run cheaper (the target stays float32): bfloat16, and int8 weight-only
            from ..quantize import int8_draft

            variants = {"bf16": copy.deepcopy(model).to(torch.bfloat16), "int8": int8_draft(model)}
            low = {v: _speculate_k4(target, m, prompt_ids, continuations, new_tokens, f"{name} ({v})")
                   for v, m in variants.items()}
            times = {v: [] for v in ("fp32", *variants, "target")}
            for i in range(6):  # alternate, side by side
                ids = prompt_ids[i % min(2, len(prompt_ids))]
                for v, m in (("fp32", model), *variants.items(), ("target", target)):
                    times[v].append(_tpot(m, ids))
            t_t = statistics.median(times["target"])
            rec.update(acceptance_k4=round(accepted / max(1, drafted), 4), tau_k4=round(emitted / max(1, forwards), 3),
                       token_agreement=round(agree / max(1, total), 4),
                       c=round(statistics.median(times["fp32"]) / t_t, 3),
                       **{f"acceptance_k4_{v}": round(low[v][1] / max(1, low[v][0]), 4) for v in variants},
                       **{f"c_{v}": round(statistics.median(times[v]) / t_t, 3) for v in variants},
                       sample=tok.decode(specdec.generate(model, prompt_ids[0], max_new_tokens=new_tokens,
                                                          draft_length=0)[0, prompt_ids[0].shape[1]:]))
        else:
            rec["sample"] = sample
        results["models"][name] = rec
    results["prompt"] = ps[0]
    results["num_prompts"], results["new_tokens"] = num_prompts, new_tokens
    results["measured"] = time.strftime("%Y-%m-%d")
    return results


def _agreement_curve(log: Path, points: int = 8) -> list[tuple[int, float]]:
    """(tokens, agreement) at about `points` evenly spaced checks of a training log, the last one included."""
    if not log.exists():
        return []
    rows = [r for r in map(json.loads, log.read_text().splitlines()) if "agree" in r]
    if not rows:
        return []
    step = max(1, len(rows) // points)
    picked = rows[step - 1::step]
    if picked[-1] is not rows[-1]:
        picked.append(rows[-1])
    return [(r["tokens"], r["agree"]) for r in picked]


def write_cards(results: dict) -> None:
    for name, rec in results["models"].items():
        d = MODELS_DIR / name
        write_text(d / "card.json", json.dumps({**rec, "unigram_loss": results["unigram_loss"]}, indent=2))
        lines = [f"# specdec zoo: {name}", "",
                 f"Llama architecture, {rec['layers']} layer(s), hidden {rec['hidden']}, {rec['params'] / 1e6:.2f}M "
                 f"parameters (tied embeddings), byte-level BPE vocabulary of 4096, trained on the CPython "
                 f"standard library source (held-out modules excluded; see specdec/zoo/corpus.py).", "",
                 "| fact | value |", "|---|---|",
                 f"| training tokens | {rec['train_tokens']:,} |",
                 f"| training time (CPU, 2 cores) | {rec['train_seconds'] / 60:.1f} min |",
                 f"| teacher | {rec['teacher'] or 'none (next-token cross-entropy)'} |",
                 f"| held-out loss | {rec['heldout_loss']:.3f} nats/token |",
                 f"| held-out perplexity | {rec['heldout_ppl']:.1f} (unigram baseline "
                 f"{results['unigram_ppl']:.0f}) |"]
        if name != "target":
            lines += [f"| greedy acceptance vs target, k = 4 | {rec['acceptance_k4']:.3f} |",
                      f"| tau (tokens per target forward), k = 4 | {rec['tau_k4']:.2f} |",
                      f"| teacher-forced per-token agreement | {rec['token_agreement']:.3f} |",
                      f"| c = per-token latency / target's (this machine) | {rec['c']:.3f} |",
                      f"| the draft in bfloat16 (target float32): acceptance, k = 4 / c | "
                      f"{rec['acceptance_k4_bf16']:.3f} / {rec['c_bf16']:.3f} |"]
            if "c_int8" in rec:
                lines.append(f"| the draft int8 weight-only (`specdec.int8_draft`): acceptance, k = 4 / c | "
                             f"{rec['acceptance_k4_int8']:.3f} / {rec['c_int8']:.3f} |")
        curve = _agreement_curve(d / "training_log.jsonl")
        if curve:
            lines += ["", "Agreement with the target during training (teacher-forced top-1 on 8 fixed held-out "
                      "windows of 256 tokens: real text, so lower than the agreement on the target's own "
                      "continuations above):", "", "| training tokens | agreement |", "|---|---|"]
            lines += [f"| {tokens:,} | {agree:.3f} |" for tokens, agree in curve]
        lines += ["", f"Measured {results['measured']} over {results['num_prompts']} held-out prompts, "
                  f"{results['new_tokens']} new tokens each, by `specdec zoo card`.", "",
                  "Greedy continuation of the first held-out prompt:", "", "```python", results["prompt"] + rec["sample"],
                  "```", ""]
        write_text(d / "README.md", "\n".join(lines))
