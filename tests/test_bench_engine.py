"""benchmarks/bench_engine.py on the CPU with the tiny checkpoint: its table, the --sampling option (the decode
and generate rows under a sampler, as a chat user runs them) and a clear error for an unknown sampler key."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from lily.checkpoint.tiny import tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_engine.py"), "--device", "cpu", *args],
                          capture_output=True, text=True, timeout=300)


def test_bench_engine_sampling(tmp_path):
    out = tmp_path / "r.json"
    r = bench("--model", str(tiny_checkpoint()), "--contexts", "32", "--decode", "4", "--generate", "4",
              "--sampling", "temperature=0.7,top_p=0.8,top_k=20,seed=3", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "sampling temperature=0.7,top_p=0.8,top_k=20,seed=3;" in r.stdout
    res = json.loads(out.read_text())
    assert res["sampling"] == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "seed": 3}
    row = res["rows"][0]
    assert row["context"] == 32 and row["decode_tok_s"] > 0 and row["generate_tok_s"] > 0


def test_bench_engine_refuses_unknown_sampling_keys():
    r = bench("--model", "unused", "--sampling", "temp=1")
    assert r.returncode != 0 and "--sampling takes temperature, top_k, top_p, min_p, seed" in r.stderr
    r = bench("--model", "unused", "--sampling", "top_k=0.5")
    assert r.returncode != 0 and "top_k needs an integer" in r.stderr
