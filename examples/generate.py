"""Generate text: blocking, streaming, sampled, with stop strings and logprobs, and a batch of prompts.

    python examples/generate.py [CHECKPOINT]      # default: the tiny built-in synthetic model (gibberish)
"""
import sys

import lily
from lily.cli import tiny_checkpoint

path = sys.argv[1] if len(sys.argv) > 1 else tiny_checkpoint()
model = lily.Model.load(path)

r = model.generate("The capital of France is", max_tokens=12)          # greedy
print(repr(r.text), r.finish_reason, r.usage)

params = lily.SamplingParams(temperature=0.8, top_p=0.95, seed=42, max_tokens=32, stop=["\n\n"])
for event in model.generate("Once upon a time", params, stream=True):
    print(event.text, end="", flush=True)
print()

r = model.generate("1, 2, 3,", max_tokens=4, logprobs=3)
for lp in r.logprobs:
    alternatives = ", ".join(f"{model.tokenizer.decode([i])!r} {p:.2f}" for i, p in lp.top)
    print(f"{model.tokenizer.decode([lp.token_id])!r} {lp.logprob:.2f}   [{alternatives}]")

# Prompts sharing a prefix: the prefix is prefilled once (usage.cached_tokens).
few_shot = "Translate to French.\nsea -> mer\nsky -> ciel\n"
for r in model.generate([few_shot + "sun ->", few_shot + "moon ->"], max_tokens=4):
    print(repr(r.text), "reused", r.usage.cached_tokens, "prompt tokens")
