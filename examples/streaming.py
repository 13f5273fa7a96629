"""Stream a speculative generation with HF's TextIteratorStreamer: text arrives as drafts are accepted.

    python examples/streaming.py [--max-new-tokens 64]
"""
import argparse
import threading

from transformers import TextIteratorStreamer

import specdec

ap = argparse.ArgumentParser()
ap.add_argument("--max-new-tokens", type=int, default=64)
a = ap.parse_args()

target, tok = specdec.zoo.load("target")
draft, _ = specdec.zoo.load("draft-wide")
model = specdec.wrap(target, drafter=draft)
ids = tok(specdec.zoo.prompts(2)[1], return_tensors="pt").input_ids
streamer = TextIteratorStreamer(tok, skip_prompt=True)
worker = threading.Thread(target=model.generate, kwargs=dict(input_ids=ids, max_new_tokens=a.max_new_tokens,
                                                             streamer=streamer))
worker.start()
pieces = []
for text in streamer:  # each piece is what one verification step accepted (one or more tokens)
    pieces.append(text)
    print(text, end="", flush=True)
worker.join()
print(f"\n[{len(pieces)} streamed pieces]")
