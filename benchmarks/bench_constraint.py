"""Per-token cost of structured output: decode speed with and without a JSON schema, and the host
time of the constraint alone (llguidance's mask + advancing the matcher), on one checkpoint.

    python benchmarks/bench_constraint.py [--model tiny] [--device auto] [--tokens 64] [--rounds 3]

The schema is an object with one long string field, so a model keeps writing inside it until
max_tokens (ignore_eos on both runs): both runs decode the same number of tokens. The host time is
measured by replaying the constrained run's ids through a fresh Guide (mask, then advance, per
token), which is what the generation loop adds per step besides applying the mask on the device.
"""
from __future__ import annotations

import argparse
import statistics
import time

import lily
from lily import constraints

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
          "additionalProperties": False}


def decode_tps(model: lily.Model, n: int, **kw) -> tuple[float, list[int]]:
    r = model.generate("Write a long answer in JSON:", max_tokens=n, ignore_eos=True, temperature=1.0, seed=1,
                       session=model.new_session(), **kw)
    return r.usage.decode_tokens_per_second, r.token_ids


def host_us_per_token(model: lily.Model, ids: list[int]) -> float:
    guide = constraints.Guide(model, constraints.json_schema(SCHEMA), thinking=False)
    t0 = time.perf_counter()
    n = 0
    for t in ids:
        guide.mask()
        guide.advance(t)
        n += 1
        if guide.done:
            break
    return (time.perf_counter() - t0) / max(n, 1) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    model = lily.load(a.model, a.device)
    constraints.ll_tokenizer(model)  # built once per model (~1 s), not per request
    decode_tps(model, 4)
    plain, constrained, host = [], [], []
    for _ in range(a.rounds):
        plain.append(decode_tps(model, a.tokens)[0])
        tps, ids = decode_tps(model, a.tokens, json_schema=SCHEMA)
        constrained.append(tps)
        host.append(host_us_per_token(model, ids))
    p, c = statistics.median(plain), statistics.median(constrained)
    print(f"model {a.model} on {model.device}, {a.tokens} tokens, median of {a.rounds} rounds")
    print(f"  no constraint:   {p:8.2f} tok/s  ({1e3 / p:.3f} ms/token)")
    print(f"  JSON schema:     {c:8.2f} tok/s  ({1e3 / c:.3f} ms/token)  slowdown {(p / c - 1) * 100:+.1f}%")
    print(f"  host mask+advance: {statistics.median(host):.1f} us/token")


if __name__ == "__main__":
    main()
