"""`specdec serve` (specdec/serve/): the official openai client against a server started here on a free
loopback port; streamed == non-streamed == specdec.generate == HF greedy; OpenAI-style errors that leak
no KV pages; 429 from a full queue; a client that leaves mid-stream stops its generation; prefix reuse;
metrics; a bounded load test; the chat page in headless Chromium (skips where it is absent)."""
import json
import shutil
import socket
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi", reason='pip install -e ".[serve]"')
openai = pytest.importorskip("openai", reason='pip install openai')
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

import specdec  # noqa: E402
from specdec import zoo  # noqa: E402
from specdec.serve import build_app, check_port  # noqa: E402
from specdec.serve.protocol import Request, render  # noqa: E402

NAME = "zoo-target"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """uvicorn serving the app in a thread of this process (stopped by the fixture)."""

    def __init__(self, max_queue: int = 8, max_batch: int = 1):
        self.target, self.tok = zoo.load("target")
        self.app, self.worker = build_app(self.target, self.tok, drafter="ngram", model_name=NAME,
                                          max_queue=max_queue, warm_up=False, max_batch=max_batch)
        self.port = _free_port()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)

    def greedy(self, messages=None, prompt=None, max_tokens=24):
        """HF's own greedy continuation of the same rendered prompt, as text."""
        req = Request("chat" if messages else "completion", NAME, messages, prompt, max_tokens, 0, 1, [], None,
                      False, False)
        ids = torch.tensor([render(self.tok, req)])
        out = self.target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False)
        spec = specdec.generate(self.target, ids, drafter="ngram", max_new_tokens=max_tokens, do_sample=False)
        assert torch.equal(out, spec)
        return self.tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.fixture(scope="module")
def server():
    s = Server(max_queue=8)
    yield s
    s.stop()


MESSAGES = [{"role": "user", "content": "def fibonacci(n):"}]


def _settle(worker, seconds: float = 20) -> None:
    """Wait until no generation runs or waits (a worker thread leaves just after its last event)."""
    deadline = time.time() + seconds
    while worker.queued and time.time() < deadline:
        time.sleep(0.05)
    assert worker.queued == 0


def test_chat_streamed_equals_non_streamed_equals_hf_greedy(server):
    c = server.client
    assert [m.id for m in c.models.list().data] == [NAME]
    whole = c.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=24, temperature=0)
    text = whole.choices[0].message.content
    pieces, final = [], None
    for chunk in c.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=24, temperature=0, stream=True,
                                           stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        final = chunk
    assert "".join(pieces) == text == server.greedy(MESSAGES)
    assert final.usage.completion_tokens == whole.usage.completion_tokens == 24
    ext = whole.model_extra["specdec"]  # provenance: one flag per token, the prefill's token the target's
    assert len(ext["drafted"]) == 24 and ext["drafted"][0] is False and "".join(ext["tokens"]) == text
    assert ext["tau"] >= 1 and 0 <= ext["acceptance_rate"] <= 1 and ext["ttft_s"] > 0


def test_completions_stop_and_prefix_reuse(server):
    c = server.client
    prompt = "import os\nimport sys\n\n\ndef main("
    out = c.completions.create(model=NAME, prompt=prompt, max_tokens=20, temperature=0)
    full = server.greedy(prompt=prompt, max_tokens=20)
    assert out.choices[0].text == full and out.choices[0].finish_reason == "length"
    stop = full[5:8]
    cut = c.completions.create(model=NAME, prompt=prompt, max_tokens=20, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[:full.index(stop)] and cut.choices[0].finish_reason == "stop"
    # the next turn extends this conversation: only its new tokens are prefilled
    first = c.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=8, temperature=0)
    turn2 = MESSAGES + [{"role": "assistant", "content": first.choices[0].message.content},
                        {"role": "user", "content": "    return n"}]
    second = c.chat.completions.create(model=NAME, messages=turn2, max_tokens=8, temperature=0)
    assert second.model_extra["specdec"]["reused_prompt_tokens"] > 0
    assert second.choices[0].message.content == server.greedy(turn2, max_tokens=8)


BAD = [
    (b"{not json", 400, None), (json.dumps({"model": "gpt-4", "messages": MESSAGES}), 404, "model"),
    (json.dumps({"model": NAME, "messages": []}), 400, "messages"),
    (json.dumps({"model": NAME, "messages": [{"role": "wizard", "content": "hi"}]}), 400, "messages[0].role"),
    (json.dumps({"model": NAME, "messages": [{"role": "user", "content": 5}]}), 422, "messages[0].content"),
    (json.dumps({"model": NAME, "messages": "hello"}), 422, "messages"),
    (json.dumps({"model": NAME, "messages": MESSAGES, "stream": "yes"}), 422, "stream"),
    (json.dumps({"model": NAME, "messages": MESSAGES, "max_tokens": "ten"}), 422, "max_tokens"),
    (json.dumps({"model": NAME, "messages": MESSAGES, "max_tokens": -3}), 400, "max_tokens"),
    (json.dumps({"model": NAME, "messages": MESSAGES, "max_tokens": 10 ** 9}), 400, "max_tokens"),
    (json.dumps({"model": NAME, "messages": MESSAGES, "temperature": "hot"}), 422, "temperature"),
    (json.dumps({"model": NAME, "messages": MESSAGES, "temperature": 7}), 400, "temperature"),
    (json.dumps({"model": NAME, "messages": MESSAGES, "n": 3}), 400, "n"),
    (json.dumps({"model": NAME, "messages": [{"role": "user", "content": "word " * 3000}]}), 400, "messages"),
    (json.dumps({"model": NAME, "messages": [{"role": "user", "content": "x" * (2 << 20)}]}), 413, None),
]


def test_bad_requests_get_openai_errors_and_leak_nothing(server):
    pages = server.worker.pages_in_use
    for body, status, param in BAD:
        r = httpx.post(server.url + "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == status, (body[:80], r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["param"] == param
    assert server.worker.pages_in_use == pages and server.worker.queued == 0
    with pytest.raises(openai.NotFoundError):
        server.client.chat.completions.create(model="nope", messages=MESSAGES)
    ok = server.client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=4, temperature=0)
    assert ok.choices[0].message.content == server.greedy(MESSAGES, max_tokens=4)


def test_a_client_that_leaves_mid_stream_stops_its_generation(server):
    body = {"model": NAME, "messages": [{"role": "user", "content": "class Parser:"}], "max_tokens": 400,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = 0
        for line in r.iter_lines():
            lines += line.startswith("data:")
            if lines == 3:
                break
    _settle(server.worker)
    kept = len(server.worker.model.engine.cached_tokens)  # the partial answer's KV only
    prompt = len(render(server.tok, Request("chat", NAME, body["messages"], None, 1, 0, 1, [], None, False, False)))
    assert kept < prompt + 200
    page = server.worker.model.engine.page_size
    assert server.worker.pages_in_use <= -(-(kept + 16) // page) + 1


def test_metrics(server):
    server.client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=4, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    for name in ("specdec_requests_total", "specdec_ttft_seconds_bucket", "specdec_tpot_seconds_count",
                 "specdec_acceptance_rate", "specdec_tau", "specdec_draft_length_bucket", "specdec_kv_pages_in_use",
                 "specdec_generated_tokens_total"):
        assert name in text, name
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_full_queue_answers_429_and_a_bounded_load_loses_nothing():
    """max_queue 1: one running, one waiting. Six clients, two requests each, at once: every request is
    answered with its own greedy text or refused with 429; nothing is lost or mixed up; no pages leak."""
    s = Server(max_queue=1)
    try:
        prompts = [f"def task_{i}(x):" for i in range(6)]
        refs = {p: s.greedy(prompt=p, max_tokens=12) for p in prompts}
        results, errors = [], []

        def client(p):
            for _ in range(2):
                try:
                    out = s.client.completions.create(model=NAME, prompt=p, max_tokens=12, temperature=0)
                    results.append((p, out.choices[0].text))
                except openai.RateLimitError:
                    results.append((p, 429))
                except Exception as e:  # noqa: BLE001
                    errors.append(e)

        threads = [threading.Thread(target=client, args=(p,)) for p in prompts]
        t0 = time.time()
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert time.time() - t0 < 120 and not errors and len(results) == 12
        refused = sum(r == 429 for _, r in results)
        assert 0 < refused < 12  # the queue filled, and some got through
        assert all(r == refs[p] for p, r in results if r != 429)
        _settle(s.worker)
        s.worker.model.engine.release_cache()
        assert s.worker.pages_in_use == 0
    finally:
        s.stop()


def test_port_in_use_is_a_clear_error():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            check_port("127.0.0.1", port)


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium: apt-get install -y chromium")
def test_chat_page_in_a_real_browser(server, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        try:
            page = browser.new_page()
            page.goto(server.url + "/")
            page.fill("#input", "def fibonacci(n):")
            page.click("#send")
            page.wait_for_function("document.querySelector('#stats').textContent.includes('tau')", timeout=60000)
            spans = page.eval_on_selector_all(".assistant span", "els => els.map(e => [e.className, e.textContent])")
            assert spans and {c for c, _ in spans} <= {"drafted", "target"} and spans[0][0] == "target"
            assert "".join(t for _, t in spans) == server.greedy(MESSAGES, max_tokens=256)
            shot = tmp_path / "chat.png"
            page.screenshot(path=str(shot))
        finally:
            browser.close()
    from PIL import Image

    pixels = Image.open(shot).convert("L").getextrema()
    assert pixels[1] - pixels[0] > 50  # not blank


def test_conversations_keep_their_kv_side_by_side_within_slots_and_a_page_budget():
    """Prefix reuse across conversations (serve/worker.py ConversationCache): A, then B, then A's next turn
    prefills only A's new tokens; a third conversation takes the least recently used slot (B's KV goes);
    each slot drafts with its own copy of the head; a page budget drops older conversations' KV."""
    import asyncio

    from specdec.drafters import FeatureHead
    from specdec.serve.worker import GenerationWorker

    target, tok = zoo.load("target")
    head = FeatureHead.from_pretrained(zoo.path("target-head"), target)
    worker = GenerationWorker(target, tok, head, max_conversations=2)

    def run(w, prompt, n=10):
        async def go():
            toks, stats = [], None
            async for ev in w.generate(prompt, threading.Event(), max_new_tokens=n, do_sample=False):
                toks += ev.tokens
                stats = ev.stats or stats
            return toks, stats
        return asyncio.run(go())

    def greedy(prompt, n=10):
        ids = torch.tensor([prompt])
        return target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)[0, len(prompt):].tolist()

    a, b, c = (tok(p).input_ids[-30:] for p in zoo.prompts(3))
    assert a[0] != b[0] != c[0]
    ta, _ = run(worker, a)
    tb, _ = run(worker, b)
    a2 = a + ta + tok("\n    return").input_ids
    t, stats = run(worker, a2)
    assert t == greedy(a2) and stats.reused_prompt_tokens >= len(a) + len(ta) - 1
    assert worker.conversations.slots[0].engine.drafter is not worker.conversations.slots[1].engine.drafter
    run(worker, c)  # a third conversation: B's slot (least recently used) is dropped and reused
    b2 = b + tb + tok("\n    return").input_ids
    t, stats = run(worker, b2)
    assert t == greedy(b2) and stats.reused_prompt_tokens < len(b)
    # a page budget of one conversation's worth: the older one's KV goes after each generation
    small = GenerationWorker(target, tok, head, max_conversations=3, max_kv_pages=1)
    run(small, a)
    run(small, b)
    kept = [len(m.engine.cached_tokens) for m in small.conversations.slots]
    assert kept[0] == 0 and kept[-1] > 0 and small.pages_in_use == small.conversations.pages(small.model)


def test_requests_waiting_together_run_as_one_batch_each_streamed_with_its_own_answer():
    """max_batch 4: five requests wait while the model is busy (the test holds it); they run as batches
    (four rows, then one alone), streamed and not, and every answer is its own greedy text; a seeded
    request is never batched; no pages are left behind."""
    s = Server(max_queue=8, max_batch=4)
    try:
        prompts = [f"def task_{i}(x):" for i in range(5)]
        refs = {p: s.greedy(prompt=p, max_tokens=16) for p in prompts}
        results, errors = {}, []

        def client(i, p):
            try:
                if i % 2:
                    chunks = s.client.completions.create(model=NAME, prompt=p, max_tokens=16, temperature=0, stream=True)
                    results[p] = "".join(c.choices[0].text for c in chunks if c.choices)
                else:
                    results[p] = s.client.completions.create(model=NAME, prompt=p, max_tokens=16,
                                                             temperature=0).choices[0].text
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=client, args=(i, p)) for i, p in enumerate(prompts)]
        with s.worker._lock:  # the model is busy: every request waits
            for t in threads:
                t.start()
            deadline = time.time() + 30
            while s.worker.queued < 5:
                assert time.time() < deadline, "the requests did not arrive"
                time.sleep(0.02)
        for t in threads:
            t.join(120)
        assert not errors and results == refs
        assert s.worker.batches_run == 1  # four together, the fifth alone (max_batch 4)
        assert "specdec_batches_run 1.0" in httpx.get(s.url + "/metrics").text
        seeded = s.client.completions.create(model=NAME, prompt=prompts[0], max_tokens=16, temperature=0, seed=3)
        assert seeded.choices[0].text == refs[prompts[0]] and s.worker.batches_run == 1
        _settle(s.worker)
        s.worker.model.engine.release_cache()
        assert s.worker.pages_in_use == 0
    finally:
        s.stop()


def test_a_batch_the_engine_cannot_run_is_refused_at_start():
    from specdec.serve.worker import GenerationWorker

    from specdec.drafters.base import Draft

    class OneSequenceOnly:  # a drafter with no per-row copies (not a RowDrafter)
        def begin(self, setup): ...
        def propose(self, ctx, budget): return Draft.empty()
        def accept(self, n): ...
        def end(self): ...

    target, tok = zoo.load("target")
    with pytest.raises(ValueError, match="cannot run as one batch .OneSequenceOnly cannot serve"):
        GenerationWorker(target, tok, OneSequenceOnly(), max_batch=2)
    with pytest.raises(ValueError, match="max_batch must be"):
        GenerationWorker(target, tok, "ngram", max_batch=0)


def test_a_model_that_does_not_load_is_a_clear_error_before_the_server_listens(tmp_path):
    """`specdec serve --target DIR` with a broken model folder: one line naming the folder and the cause, and
    the port never claimed (the model loads before uvicorn starts)."""
    from specdec.cli import main

    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4}')  # no weights
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(SystemExit, match=f"the target '{tmp_path}' does not load"):
        main(["serve", "--target", str(tmp_path), "--drafter", "none", "--port", str(port), "--threads", "1"])
    check_port("127.0.0.1", port)  # still free: nothing listened
