"""benchmarks/server_ttft.py end to end on the tiny model (CPU, small sizes, one round): it starts
`lily serve`, the follow-up turn reuses the history's snapshot, and the table comes last."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "server_ttft.py"
ENV = dict(os.environ, OMP_NUM_THREADS="1")  # the server inherits it: no OpenMP spinning on shared cores


def test_server_ttft_small(tmp_path):
    out = tmp_path / "ttft.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--rounds", "1", "--warmup", "1",
                        "--history-tokens", "200", "--new-tokens", "40", "--max-context", "1024",
                        "--max-seconds", "120", "--json", str(out)],
                       capture_output=True, text=True, timeout=180, env=ENV)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[-5].startswith("| case | prompt tokens | cached tokens | TTFT median ms")
    assert [line.split("|")[1].strip() for line in lines[-3:]] == ["short", "follow-up", "cold-long"]
    cases = json.loads(out.read_text())["cases"]
    assert cases["short"]["prompt_tokens"] == 11 and cases["short"]["cached_tokens"] == 0
    assert cases["follow-up"]["prompt_tokens"] == 240 and cases["follow-up"]["cached_tokens"] == 200
    assert cases["cold-long"]["prompt_tokens"] == 240 and cases["cold-long"]["cached_tokens"] == 0
    for s in cases.values():
        assert s["rounds"] == 1 and s["failed"] == 0 and s["ttft_ms_min"] > 0


def test_server_ttft_start_failure(tmp_path):
    """A server that cannot start: a clear error with its stderr, no hang."""
    r = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tmp_path / "missing"), "--device", "cpu",
                        "--max-seconds", "60"], capture_output=True, text=True, timeout=120, env=ENV)
    assert r.returncode == 1
    assert "lily serve exited with status" in r.stderr and "server stderr" in r.stderr


def test_bench_server_host_small():
    """benchmarks/bench_server_host.py: the host's steps of a streamed chat in order, both cases."""
    script = SCRIPT.parent / "bench_server_host.py"
    for case in ("short", "follow-up"):
        r = subprocess.run([sys.executable, str(script), "--requests", "6", "--case", case],
                           capture_output=True, text=True, timeout=180, env=ENV)
        assert r.returncode == 0, r.stdout + r.stderr
        rows = dict(line.strip("|").split("|") for line in r.stdout.strip().splitlines()[-10:])
        ms = {k.strip(): float(v) for k, v in rows.items()}
        assert list(ms) == ["read", "app", "prepare", "submit", "start", "role", "event", "first",
                            "client: role chunk", "client: first token chunk"], r.stdout
        assert 0 < ms["read"] < ms["app"] < ms["prepare"] < ms["submit"] < ms["role"] < ms["first"]
        assert ms["submit"] < ms["event"] and ms["role"] <= ms["client: role chunk"]
    r = subprocess.run([sys.executable, str(script), "--requests", "6", "--engine-ms", "5"],
                       capture_output=True, text=True, timeout=180, env=ENV)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = dict(line.strip("|").split("|") for line in r.stdout.strip().splitlines()[-11:])
    ms = {k.strip(): float(v) for k, v in rows.items()}
    assert ms["role"] < ms["event"] and ms["client: first token chunk"] > 5  # the token after the role chunk
    assert ms["host share of the TTFT (first token chunk less 5 ms)"] == pytest.approx(
        ms["client: first token chunk"] - 5, abs=2e-3)
