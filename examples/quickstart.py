"""Quickstart: load a checkpoint, step through a prompt, keep two conversations apart.

    python examples/quickstart.py [CHECKPOINT]      # default: the tiny built-in synthetic model
"""
import sys

import numpy as np

import lily
from lily.cli import tiny_checkpoint

path = sys.argv[1] if len(sys.argv) > 1 else tiny_checkpoint()
model = lily.Model.load(path)
print(model)

ids = model.tokenizer.encode("The capital of France is")
logits = model.prefill(ids)                      # [vocab] float32, last prompt token
out = []
for _ in range(8):                               # greedy, step by step
    tok = int(np.argmax(logits))
    out.append(tok)
    logits = model.decode_step(tok)
print("greedy ids:", out, "->", repr(model.tokenizer.decode(out)))

a, b = model.new_session(max_context=1024), model.new_session(max_context=1024)
a.prefill(ids)
snap = a.snapshot()                              # cheap resume point at a message boundary
b.prefill(model.tokenizer.encode("Another, unrelated conversation"))
a.decode_step(out[0])
a.restore(snap)                                  # back to the end of the prompt, exactly
print(a, b, snap)
