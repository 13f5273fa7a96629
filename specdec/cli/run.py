"""The commands that measure: demo, bench, select-draft (chat is cli/chat.py)."""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from ..files import write_text
from .models import _drafter_arg, _load, _sampling_kwargs, _tree_spec

# the demo's request to a real chat model (also in benchmarks/prompts/demo.jsonl, so the head trainer's
# prompt filter keeps it out of training; no five-word run of it is in the shipped head's prompts)
DEMO_REQUEST = "My bicycle chain keeps slipping when I pedal hard. What could be wrong and how do I fix it?"


def cmd_demo(a) -> None:
    import torch
    from transformers import PreTrainedModel, TextStreamer

    from ..drafters import CrossTokenizerDrafter, LookupFirst, ModelDrafter

    import specdec

    from .. import zoo
    from . import DEMO_NEW_TOKENS, DEMO_REAL_NEW_TOKENS

    torch.set_num_threads(a.threads)
    tree = _tree_spec(a)
    target, tok = _load(a.target, "target", a.dtype)
    drafter = _drafter_arg(a.drafter, tok, a.draft_dtype, target)
    zoo_target = a.target == "target"
    new_tokens = a.max_new_tokens if a.max_new_tokens is not None else (DEMO_NEW_TOKENS if zoo_target else
                                                                         DEMO_REAL_NEW_TOKENS)
    prompt = a.prompt if a.prompt is not None else zoo.prompts()[a.prompt_index] if zoo_target else DEMO_REQUEST
    request = bool(getattr(tok, "chat_template", None))  # a chat model answers requests in its template
    if request:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tok(prompt, return_tensors="pt").input_ids
    draft_length = a.draft_length if a.draft_length in ("adaptive", "heuristic") else int(a.draft_length)
    model = specdec.wrap(target, drafter=drafter, draft_length=draft_length, tree=tree)
    kw = dict(max_new_tokens=new_tokens, **_sampling_kwargs(a))
    # warm up both paths (first calls pay one-off costs), then alternate target-only and specdec
    target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    first_compile = model.generate(ids, max_new_tokens=4, return_dict_in_generate=True).stats.compile_s
    base_times, spec_runs = [], []
    print(f"prompt ({ids.shape[1]} tokens{' in the chat template' if request else ''}"
          f"{', held-out' if a.prompt is None else ''}):\n{prompt}", end="\n\n" if request else "")
    for r in range(a.repeats):
        torch.manual_seed(a.seed)
        t0 = time.perf_counter()
        base = target.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        base_times.append((time.perf_counter() - t0, base.shape[1] - ids.shape[1]))
        torch.manual_seed(a.seed)
        streamer = TextStreamer(tok, skip_prompt=True) if (r == 0 and not a.no_stream) else None
        out = model.generate(ids, return_dict_in_generate=True, streamer=streamer, **kw)
        if streamer is None and r == 0:
            print(tok.decode(out.sequences[0, ids.shape[1]:]))
        spec_runs.append(out)
    base_tps = statistics.median(n / t for t, n in base_times)
    s = spec_runs[len(spec_runs) // 2].stats
    spec_tps = statistics.median(o.stats.tokens_per_s for o in spec_runs)
    same = torch.equal(spec_runs[0].sequences, base)
    mean_k = sum(s.draft_lengths) / max(1, len(s.draft_lengths))
    inner = drafter.drafter if isinstance(drafter, LookupFirst) else drafter  # the dtype names a draft model's
    runs_draft_model = isinstance(inner, (PreTrainedModel, ModelDrafter, CrossTokenizerDrafter))
    name = f"{a.drafter} ({a.draft_dtype})" if runs_draft_model else a.drafter
    print("\n" + "-" * 72)
    shape = f"tree {tree!r}  " if tree else ""
    print(f"target {a.target} ({a.dtype})  drafter {name}  draft_length {a.draft_length}  {shape}"
          f"{'sampling' if a.do_sample else 'greedy'}  ({a.repeats} runs each, alternating; medians)")
    print(f"  target only (HF generate): {base_tps:7.1f} tokens/s")
    print(f"  specdec                  : {spec_tps:7.1f} tokens/s   speedup x{spec_tps / base_tps:.2f}")
    compiling = spec_runs and max(o.stats.compile_s for o in spec_runs)
    warm = f", compiled in {first_compile:.1f} s before the first run" if first_compile else ""
    print(f"  target's step: {s.step}{warm}" + (f" (+{compiling:.1f} s compiling in a timed run)" if compiling else ""))
    print(f"  acceptance {s.acceptance_rate:.2f}   tau {s.mean_accepted_length:.2f} tokens/forward   "
          f"draft length used {mean_k:.1f} (mean)")
    # the drafter reads the prompt after the first token is out: prefill (both models) can exceed TTFT
    print(f"  TTFT {s.ttft_s * 1e3:.1f} ms   prefill {s.prefill_s * 1e3:.1f} ms (both models)   "
          f"TPOT {s.tpot_s * 1e3:.2f} ms   decode {s.decode_s:.2f} s (draft {s.draft_s:.2f} s, verify {s.verify_s:.2f} s)")
    if not a.do_sample:
        verdict = "yes" if same else _greedy_difference(target, base, spec_runs[0].sequences, ids.shape[1])
        print(f"  output identical to target-only greedy: {verdict}")


def _greedy_difference(target, base, got, prompt_len: int) -> str:
    """Why greedy output got [1, T'] left HF's base [1, T] (prompt_len prompt tokens): in bfloat16, where HF's own
    top-2 logits at the first differing token are a near-tie (within 4 bfloat16 epsilons of the top logit),
    another valid kernel's rounding decides it, which is said; anything else is a bug to report."""
    import torch

    from .bench import first_difference, top2_gap

    at = first_difference(got[0, prompt_len:].tolist(), base[0, prompt_len:].tolist())
    if at is None:  # one is a prefix of the other: a length difference, no token differs
        return "NO (please report a bug)"
    gap, relative = top2_gap(target, base, prompt_len + at)
    eps = torch.finfo(target.dtype).eps
    if target.dtype == torch.bfloat16 and relative <= 4 * eps:
        return (f"no, from token {at}, where HF's own top-2 logits are {gap:.3g} apart "
                f"(relative {relative:.2g}; bfloat16's epsilon {eps:.2g}): a near-tie another valid kernel breaks "
                "either way")
    return f"NO (please report a bug): from token {at}, HF's top-2 logits {relative:.2g} apart (relative)"


def cmd_bench(a) -> None:
    import json

    import torch

    from ..hf.linear import machine
    from .bench import load_prompts, run_bench, to_markdown

    torch.set_num_threads(a.threads)
    tree = _tree_spec(a)
    target, tok = _load(a.target, "target", a.dtype)
    if a.drafter.startswith("early-exit:"):
        raise SystemExit("specdec: bench runs early exit as a mode of its own: pass --early-exit LAYER (or auto)")
    draft = _drafter_arg(a.drafter, tok, a.draft_dtype, target)
    from transformers import PreTrainedModel

    if not (draft == "ngram" or isinstance(draft, PreTrainedModel)):
        raise SystemExit("specdec: bench's --drafter is a draft model or ngram (HF assisted runs it too); pass a "
                         "feature head as --head")
    chat = bool(getattr(tok, "chat_template", None)) if a.chat == "auto" else a.chat == "yes"
    prompts = load_prompts(tok, a.prompts, a.num_prompts, chat=chat)
    exit_layer, exit_rows = _exit_layer(a.early_exit, target, prompts, a.max_new_tokens)
    from .. import zoo

    head_name = zoo.head_for(a.target) if a.head == "auto" else None if a.head == "none" else a.head
    head = _drafter_arg(head_name, tok, target=target) if head_name else None
    report = run_bench(target, None if draft == "ngram" else draft, prompts, a.max_new_tokens, a.k, a.repeats,
                       _sampling_kwargs(a), tree=tree, include_hf=not a.no_hf, exit_layer=exit_layer, head=head)
    report.update(target=a.target, dtype=a.dtype, drafter=a.drafter, draft_dtype=a.draft_dtype,
                  prompts=a.prompts or "zoo held-out",
                  num_prompts=len(prompts), new_tokens=a.max_new_tokens, repeats=a.repeats, chat_template=chat,
                  exit_layer_choice=exit_rows, head=head_name)
    md = to_markdown(report)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stem = out.with_suffix("") if out.suffix in (".md", ".json") else out  # a dotted name (qwen2.5) keeps its dot
    out_json, out_md = stem.parent / (stem.name + ".json"), stem.parent / (stem.name + ".md")
    write_text(out_json, json.dumps(report, indent=2))
    cmd = "specdec bench " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else "specdec bench"
    drafter = (f"drafter ngram (prompt lookup; HF prompt lookup at k = {max(a.k)})" if draft == "ngram" else
               f"drafter {a.drafter} ({a.draft_dtype}, the same for HF assisted)")
    write_text(out_md, f"# specdec bench\n\n`{cmd}`\n\ntarget {a.target} ({a.dtype}), {drafter}"
                      f"{', chat template' if chat else ''}, "
                      f"{len(prompts)} prompts x {a.repeats} repeats, {a.max_new_tokens} new tokens, "
                      f"k = {', '.join(map(str, a.k))}, {'sampling' if a.do_sample else 'greedy'}, "
                      f"{torch.get_num_threads()} threads.\n\nMachine: {machine()}.\n\n{md}\n")
    print(md)
    bad = [m for m, r in report["modes"].items() if r["mismatches"]]
    if bad:
        print(f"\nWARNING: greedy output differs from target-only in: {', '.join(bad)}" +
              ("\n(a bfloat16 target: where HF's own top-2 logits are a near-tie, another valid kernel's rounding "
               "breaks it either way; demo names the gap, benchmarks/peers/greedy_ties.py measures it)"
               if a.dtype == "bfloat16" else ""))


def _exit_layer(choice: str, target, prompts, new_tokens: int):
    """--early-exit: 'none', a layer number, or 'auto' (drafters.early_exit.choose_exit_layer on the target's
    greedy continuations of the first two prompts; None where no layer's predicted speedup reaches 1, as on a
    target whose LM head is most of its weights). Returns (layer or None, the candidates' rows)."""
    if choice == "none":
        return None, []
    if choice != "auto":
        return int(choice), []
    import specdec
    from ..drafters.early_exit import choose_exit_layer

    seqs = [specdec.generate(target, ids, max_new_tokens=min(new_tokens, 64), draft_length=0) for ids in prompts[:2]]
    best, rows = choose_exit_layer(target, seqs, [ids.shape[1] for ids in prompts[:2]])
    pays = max((r["predicted_speedup"] for r in rows), default=0.0) >= 1.0
    return (best if pays else None), rows


def cmd_select(a) -> None:
    import torch

    from .. import zoo
    from .bench import load_prompts
    from .select import select_draft, write_report

    torch.set_num_threads(a.threads)
    target, tok = _load(a.target, "target", a.dtype)
    layers = target.config.get_text_config().num_hidden_layers
    names = a.drafts or ([n for n in zoo.shipped() if n.startswith("draft")] if a.target == "target" else
                         ["ngram", f"early-exit:{layers // 2}", f"early-exit:{3 * layers // 4}"])
    if not a.drafts and zoo.draft_for(a.target):
        names = names + [zoo.draft_for(a.target)]
    if not a.drafts and zoo.head_for(a.target):
        names = names + [zoo.head_for(a.target), "ngram+" + zoo.head_for(a.target)]
    drafts = {n: _drafter_arg(n, tok, a.draft_dtype, target) for n in names}
    temps = [float(t) for t in a.temperatures.split(",")]
    report = select_draft(target, drafts, load_prompts(tok, a.prompts, a.num_prompts), temps, a.max_k,
                          a.max_new_tokens)
    cmd = "specdec " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["select-draft"] else None
    files = write_report(report, Path(a.out), temps, cmd)
    print((Path(a.out) / "report.md").read_text())
    print("wrote " + ", ".join(str(f) for f in files))
