"""vLLM CPU drafting with an EAGLE-3 head specdec exported, beside specdec drafting with the same head.

Run in vLLM's venv (benchmarks/peers/make_vllm_venv.sh), after `specdec export-head`:

    .venv-vllm/bin/python benchmarks/peers/vllm_eagle3.py --target DIR --head EXPORTED --out /tmp/vllm_e3.json
    python benchmarks/peers/vllm_eagle3.py --specdec --target DIR --head EXPORTED --out /tmp/specdec_e3.json

Each side: greedy, chain of --k drafts, the prompts of benchmarks/prompts/chat.jsonl in the target's chat
template (or its plain text where the tokenizer has no template). vLLM's side also runs the target alone
and checks that drafting changed no token; both write acceptance by position (accepted drafts at
position i / drafting steps), which tests/test_vllm_peer.py compares.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# this script's folder: one reading of the counters, one KV budget
from vllm_peer import KV_CACHE_BYTES, specdec_acceptance, vllm_acceptance

ROOT = Path(__file__).resolve().parents[2]


def prompt_ids(tok, n: int) -> list[list[int]]:
    rows = [json.loads(line) for line in (ROOT / "benchmarks/prompts/chat.jsonl").read_text().splitlines() if line]
    out = []
    for r in rows[:n]:
        if tok.chat_template:
            out.append(tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                               tokenize=True, return_dict=True)["input_ids"])
        else:
            out.append(tok(r["prompt"]).input_ids)
    return out


def run_vllm(a) -> dict:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    ids = prompt_ids(AutoTokenizer.from_pretrained(a.target), a.num_prompts)
    params = SamplingParams(temperature=0, max_tokens=a.max_new_tokens)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in ids]
    texts = {}
    for mode, spec in (("target-only", None),
                       ("eagle3", {"method": "eagle3", "model": a.head, "num_speculative_tokens": a.k})):
        llm = LLM(model=a.target, dtype="float32", max_model_len=1024, max_num_seqs=1, seed=0,
                  kv_cache_memory_bytes=KV_CACHE_BYTES,
                  speculative_config=spec, disable_log_stats=False)
        texts[mode] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        if spec is not None:
            drafts, per_pos = vllm_acceptance(llm)
            accept = [v / max(1, drafts) for v in per_pos]
        del llm
    same = [a_ == b for a_, b in zip(texts["target-only"], texts["eagle3"])]
    return {"engine": "vllm", "greedy_equal": same, "accept_by_position": accept, "drafting_steps": drafts,
            "tokens": texts["eagle3"]}


def run_specdec(a) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(ROOT))
    import specdec
    from specdec.drafters import FeatureHead

    target = AutoModelForCausalLM.from_pretrained(a.target, dtype=torch.float32).eval()
    ids = prompt_ids(AutoTokenizer.from_pretrained(a.target), a.num_prompts)
    head = FeatureHead.from_pretrained(a.head, target)
    hits, steps, tokens = [0] * a.k, 0, []
    for p in ids:
        out = specdec.generate(target, torch.tensor([p]), drafter=head, draft_length=a.k, max_new_tokens=a.max_new_tokens,
                               return_dict_in_generate=True)
        tokens.append(out.sequences[0, len(p):].tolist())
        counted = specdec_acceptance(out.stats)  # as vLLM counts: accepted at position i / steps that drafted
        for i, v in enumerate(counted["accepted_by_position"][:a.k]):
            hits[i] += v
        steps += counted["drafting_steps"]
    return {"engine": "specdec", "accept_by_position": [h / max(1, steps) for h in hits], "drafting_steps": steps,
            "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--head", required=True, help="an EAGLE-3 folder written by `specdec export-head`")
    ap.add_argument("--specdec", action="store_true", help="run specdec's side (else vLLM's)")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    result = run_specdec(a) if a.specdec else run_vllm(a)
    Path(a.out).write_text(json.dumps(result))
    print(json.dumps({k: v for k, v in result.items() if k != "tokens"}))


if __name__ == "__main__":
    main()
