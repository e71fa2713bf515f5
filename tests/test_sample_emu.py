"""The CUDA sampler's own source (csrc/cuda/kernels/sample.cuh) run on the host by benchmarks/sample_emu.cpp (every
thread a fiber, warp collectives, __syncthreads, cluster barriers and distributed shared memory emulated; random
schedules), against the CPU reference sampler (csrc/cpu/sample.cpp through lily's CPU backend). Where the GPU
sums as the CPU does (greedy; the candidate path, at most 1,024 ids after top_k) and expf is the host's, the token
must be the CPU's exactly; the full passes sum in another order, so their cases are chosen away from boundaries
(equal e: every sum exact). Needs g++ (C++20) and lily's CPU backend; no GPU."""
from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
REAL_V = 248320


def prepare_source(dst: Path, src: Path = ROOT / "csrc") -> Path:
    """A copy of the sampler's headers for the emulator: sample.cuh's one `__shared__ SampleShared sh;` becomes the
    emulated CTA's shared memory; common.cuh and cooperative_groups.h are stubs (sample_emu.cpp defines the API)."""
    kernels = dst / "cuda" / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    (dst / "ops").mkdir(exist_ok=True)
    (dst / "stub").mkdir(exist_ok=True)
    text = (src / "cuda/kernels/sample.cuh").read_text()
    decl = "__shared__ SampleShared sh;"
    assert text.count(decl) == 1, "sample_kernel's shared memory declaration changed: update prepare_source"
    (kernels / "sample.cuh").write_text(text.replace(decl, "SampleShared& sh = emu::cta_shared<SampleShared>();"))
    shutil.copy(src / "cuda/kernels/sample_cluster.cuh", kernels / "sample_cluster.cuh")
    (kernels / "common.cuh").write_text("#pragma once\n")
    shutil.copy(src / "ops/sample_rng.h", dst / "ops" / "sample_rng.h")
    (dst / "stub" / "cooperative_groups.h").write_text("#pragma once\n")
    return dst


def build(tmp: Path, src: Path = ROOT / "csrc") -> Path:
    inc = prepare_source(tmp / "src", src)
    exe = tmp / "sample_emu"
    subprocess.run(["g++", "-O2", "-std=c++20", "-ffp-contract=off", "-I", str(inc), "-I", str(inc / "stub"), "-o",
                    str(exe), str(ROOT / "benchmarks/sample_emu.cpp")], check=True, capture_output=True, timeout=600)
    return exe


def encode(V, ctas, logits, counts, seen, step, temperature=0.0, top_p=1.0, min_p=0.0, presence_penalty=0.0,
           frequency_penalty=0.0, repetition_penalty=1.0, top_k=0, num_logprobs=-1, seed=0) -> bytes:
    return (struct.pack("<2i6f2i2Q", V, ctas, temperature, top_p, min_p, presence_penalty, frequency_penalty,
                        repetition_penalty, top_k, num_logprobs, seed, step)
            + logits.astype("<f4").tobytes() + counts.astype("<i4").tobytes() + seen.astype("<i4").tobytes())


def emulate(exe: Path, cases, schedule_seed: int = 1) -> list[tuple[int, list[int], list[float], str]]:
    """Runs the cases ((logits, counts, seen, step, ctas, params) each) in one process: (token, logprob ids,
    logprob values, changed state) each."""
    data = b"".join(encode(l.size, ctas, l, c, s, step, **p) for l, c, s, step, ctas, p in cases)
    r = subprocess.run([str(exe), str(schedule_seed)], input=data, capture_output=True, timeout=1800)
    out = r.stdout.decode()
    assert r.returncode == 0 and "ERROR" not in out, out[-2000:] + r.stderr.decode()[-2000:]
    rows = []
    for line in out.splitlines():
        head, state = line.split("|")
        f = head.split()
        vals = [struct.unpack("<f", bytes.fromhex(x)[::-1])[0] for x in f[22:43]]
        rows.append((int(f[0]), [int(x) for x in f[1:22]], vals, state.strip()))
    assert len(rows) == len(cases)
    return rows


def reference(logits, counts, seen, step, params):
    from lily import _core

    return _core.ops.sample("cpu", logits, counts.copy(), seen.copy(), step, **params)


def peaked(rng, V):
    logits = (rng.standard_normal(V) - 8.0).astype(np.float32)
    head = rng.choice(V, min(64, V), replace=False)
    logits[head] = (rng.standard_normal(head.size) * 2.0 + 4.0).astype(np.float32)
    return logits


CHAT = dict(temperature=0.7, top_p=0.8, top_k=20)
PEN = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3)


def cases():
    """(name, logits, counts, seen, step, ctas, params, exact): exact = the token must equal the CPU's."""
    rng = np.random.default_rng(2026)
    out = []
    for V in (7, 1000, 40000, REAL_V):
        z = np.zeros(V, np.int32)
        cnt, sn = rng.integers(0, 3, V).astype(np.int32), rng.integers(0, 2, V).astype(np.int32)
        l = peaked(rng, V)
        out.append((f"greedy V={V}", l, z, z, 0, 8, dict(num_logprobs=5), True))
        out.append((f"greedy penalised V={V}", l, cnt, sn, 0, 8, dict(**PEN), True))
        for ctas in (16, 8):
            for seed in range(2):
                out.append((f"chat V={V} ctas={ctas} seed={seed}", peaked(rng, V), z, z, seed, ctas,
                            dict(CHAT, seed=seed), True))
        out.append((f"top_k 100 penalised V={V}", l, cnt, sn, 3, 16, dict(temperature=1.3, top_k=100, top_p=0.95,
                                                                            min_p=0.01, seed=5, **PEN), True))
        out.append((f"chat logprobs V={V}", l, z, z, 1, 16, dict(CHAT, seed=9, num_logprobs=20), True))
    V = REAL_V
    z = np.zeros(V, np.int32)
    for spread in (5000, 200000):  # the select goes past the 12-bit level
        l = (rng.standard_normal(V) - 8.0).astype(np.float32)
        ids = rng.choice(V, spread, replace=False)
        l[ids] = rng.uniform(2.0, 4.0, spread).astype(np.float32)
        out.append((f"spread {spread}", l, z, z, 2, 16, dict(temperature=1.0, top_k=20, top_p=0.93, seed=2), True))
    l = (rng.standard_normal(V) * 0.3 + 30.0).astype(np.float32)  # a narrow band: resumed 8-bit levels
    out.append(("narrow band", l, z, z, 4, 16, dict(temperature=1.0, top_k=40, seed=4), True))
    for ties in (1000, 1100):  # either side of the candidate list's cap; equal e: exact sums on both paths
        l = (rng.standard_normal(V) * 3.0).astype(np.float32)
        l[rng.choice(V, ties, replace=False)] = l.max() + 1.0
        out.append((f"{ties} ties", l, z, z, 1, 16, dict(temperature=0.8, top_k=20, top_p=0.9, seed=1), True))
    l = (rng.standard_normal(V) * 3.0).astype(np.float32)
    l[::2] = -np.inf
    out.append(("masked, top_k 5", l, z, z, 6, 16, dict(temperature=1.2, top_k=5, top_p=0.99, seed=17), True))
    l2 = l.copy()
    l2[1::2][20:] = -np.inf  # top_k past the finite ids: threshold -inf, the full passes; every finite id equal
    l2[np.isfinite(l2)] = 1.0
    out.append(("top_k past the finite ids", l2, z, z, 3, 16, dict(temperature=1.0, top_k=40, seed=3), True))
    out.append(("all -inf", np.full(V, -np.inf, np.float32), z, z, 0, 16, dict(CHAT, seed=5), False))
    l = (rng.standard_normal(V) * 3.0).astype(np.float32)
    l[V - 3] = np.nan
    out.append(("one NaN, chat", l, z, z, 0, 16, dict(CHAT, seed=5), True))
    out.append(("one NaN, greedy", l, z, z, 0, 8, dict(num_logprobs=3), True))
    return out


CASES = cases()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
def test_sampler_source_on_the_host_equals_the_cpu(tmp_path):
    pytest.importorskip("lily._core")
    exe = build(tmp_path)
    rows = emulate(exe, [c[1:7] for c in CASES])
    for (name, logits, counts, seen, step, _, params, exact), (token, ids, vals, state) in zip(CASES, rows):
        cpu = reference(logits, counts, seen, step, params)
        if np.isnan(logits).any():
            assert token == -1 and cpu[0] == -1 and state == "", name
            continue
        assert 0 <= token < logits.size and np.isfinite(logits[token]) or not np.isfinite(logits).any(), name
        if exact:
            assert token == cpu[0], f"{name}: token {token} != cpu {cpu[0]}"
        want = f"{token}:{int(counts[token]) + 1}:1"
        assert state == want, f"{name}: state {state!r} != {want!r}"
        if params.get("num_logprobs", -1) >= 0:  # unused entries: id -1, value -inf
            used = cpu[3] >= 0
            assert ids == list(cpu[3]), name
            assert np.abs(np.array(vals)[used] - cpu[4][used]).max() <= 1e-5, name
            assert np.isneginf(np.array(vals)[~used]).all(), name
