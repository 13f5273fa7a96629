"""Chat: every turn equals a fresh specdec.generate over the same history, while reusing the history's KV.

Driven three ways: the Python session, piped stdin, and a pseudo-terminal with Ctrl-C during an answer.
"""
import os
import pty
import select
import signal
import subprocess
import sys
import time

import pytest
import torch

import specdec
from specdec.chat import ChatSession

TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def zoo_pair():
    target, tok = specdec.zoo.load("target")
    draft, _ = specdec.zoo.load("draft-tiny")
    return target, draft, tok


@pytest.mark.parametrize("templated", [False, True])
def test_turns_equal_fresh_generation_and_reuse_the_history(zoo_pair, templated):
    target, draft, tok = zoo_pair
    if templated:
        tok = type(tok).from_pretrained(specdec.zoo.path("target"))
        tok.chat_template = TEMPLATE
    chat = ChatSession(target, tok, drafter=draft, draft_length=3)
    turns = ["def parse(line):\n", "    if not line:\n", "class Reader:\n"]
    for i, text in enumerate(turns):
        if i == 2:
            chat.reset()
        prompt = chat._prompt_ids(text)
        before = len(chat.history)
        want = specdec.generate(target, torch.tensor([prompt]), max_new_tokens=12)
        answer = chat.send(text, max_new_tokens=12)
        assert chat.history == want[0].tolist()
        assert answer == tok.decode(want[0, len(prompt):], skip_special_tokens=True)
        s = chat.last_stats
        if i == 1:  # the second turn reused the whole history's KV and prefilled only the new turn
            assert s.reused_prompt_tokens >= before - 1 > 0
            assert s.prompt_tokens - s.reused_prompt_tokens <= len(prompt) - before + 1
        else:
            assert s.reused_prompt_tokens == 0
    chat.reset()
    assert chat.model.engine.pool.num_used == 0


def _expected_answers(lines, n):
    target, tok = specdec.zoo.load("target")
    history, out = [], []
    for line in lines:
        if line == "/reset":
            history = []
            continue
        ids = history + tok(line + "\n", add_special_tokens=False).input_ids
        seq = specdec.generate(target, torch.tensor([ids]), max_new_tokens=n)[0].tolist()
        out.append(tok.decode(seq[len(ids):], skip_special_tokens=True))
        history = seq
    return out


def test_an_interrupt_inside_the_drafters_begin_keeps_the_session(zoo_pair, monkeypatch):
    """Ctrl-C in the first moments of an answer lands in the drafter's own prefill (begin): the interrupt
    reaches the caller as itself, and the next turn answers as a fresh generation would."""
    from specdec.drafters import ModelDrafter

    target, draft, tok = zoo_pair
    chat = ChatSession(target, tok, drafter=draft, draft_length=3)
    chat.send("def parse(line):\n", max_new_tokens=6)
    begin = ModelDrafter.begin

    def interrupted(self, setup):
        self.runner = None  # as if stopped before binding its pages
        raise KeyboardInterrupt

    monkeypatch.setattr(ModelDrafter, "begin", interrupted)
    with pytest.raises(KeyboardInterrupt):
        chat.send("    if not line:\n", max_new_tokens=6)
    monkeypatch.setattr(ModelDrafter, "begin", begin)
    text = "class Reader:\n"
    prompt = chat._prompt_ids(text)
    want = specdec.generate(target, torch.tensor([prompt]), max_new_tokens=8)
    chat.send(text, max_new_tokens=8)
    assert chat.history == want[0].tolist()


def test_piped_stdin_multi_turn_with_reset():
    lines = ["def area(r):", "    return", "/reset", "import os"]
    r = subprocess.run([sys.executable, "-m", "specdec.cli", "chat", "--target", "target", "--drafter", "draft-tiny",
                        "--max-new-tokens", "10", "--threads", "1"], input="\n".join(lines + ["/stats", "/quit"]) + "\n",
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    for answer in _expected_answers(lines, 10):
        assert answer in r.stdout
    assert "[conversation reset]" in r.stdout and "tok/s" in r.stdout


def _read_some(fd, timeout: float) -> bytes:
    ready, _, _ = select.select([fd], [], [], timeout)
    return os.read(fd, 4096) if ready else b""


def _read_until(fd, needle, timeout=120, stop=None):
    """What the terminal shows until `needle` (or `stop`) appears, EOF or the timeout."""
    buf = b""
    end = time.time() + timeout
    while needle not in buf and (stop is None or stop not in buf) and time.time() < end:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            buf += chunk
    return buf


def test_ctrl_c_stops_the_answer_and_keeps_the_session():
    pid, fd = pty.fork()
    if pid == 0:  # child: the chat on a real terminal
        # an ignored or blocked SIGINT survives exec (an ignored one makes Python install no KeyboardInterrupt
        # handler), and the test process may have either (seen inside a pytest-xdist worker): give the chat
        # what a shell gives it
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        os.execvp(sys.executable, [sys.executable, "-m", "specdec.cli", "chat", "--target", "target", "--drafter",
                                   "draft-tiny", "--max-new-tokens", "400", "--threads", "1", "--no-status"])
    try:
        assert b"> " in _read_until(fd, b"> ")
        for line in (b"def main():\n", b"class Parser:\n", b"import os\n"):
            os.write(fd, line)
            _read_until(fd, b"\n", timeout=60)  # the echo of our line
            _read_some(fd, timeout=60)  # the answer has started streaming
            os.write(fd, b"\x03")  # Ctrl-C
            seen = _read_until(fd, b"[interrupted]", stop=b"\n> ")
            if b"[interrupted]" in seen:
                break
            # on a loaded machine the answer may have reached its EOS before the signal: ask again
        assert b"[interrupted]" in seen, (f"SIGINT in the test process: {signal.getsignal(signal.SIGINT)}, blocked "
                                          f"{signal.pthread_sigmask(signal.SIG_BLOCK, [])}", seen[-400:])
        os.write(fd, b"/stats\n")  # the session is alive and answers commands (no finished answer yet)
        assert b"[no answer yet]" in _read_until(fd, b"[no answer yet]")
        os.write(fd, b"/quit\n")
        _read_until(fd, b"never", timeout=20)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    finally:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
