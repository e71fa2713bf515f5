"""Which lily errors reach Python on this machine: each probe runs in its own process (a crash is
reported, not fatal). On the GPU host (2026-12-01: GCC 13.3, Python 3.12, the image's nanobind,
--no-build-isolation) every probe died with SIGSEGV (rc -11), CPU ops included, while CI builds
(nanobind from PyPI) raise LilyError. Usage: python3 benchmarks/probe_errors.py [tests folder]"""
import subprocess
import sys

PROBES = {
    "cpu op, bad shape": "ops.rms_norm('cpu', np.ones((2, 4), np.float32), np.ones(3, np.float32), 1e-6)",
    "cuda op, bad shape": "ops.rms_norm('cuda', np.ones((2, 4), np.float32), np.ones(3, np.float32), 1e-6)",
    "cpu linear, group 256": "ops.linear(ops.QMatrix('cpu', **m), 0, x)",
    "cuda linear, group 256": "ops.linear(ops.QMatrix('cuda', **m), 0, x)",
    "cuda linear, bad stack": "ops.linear(ops.QMatrix('cuda', **m64), 5, x)",
}
SETUP = """
import numpy as np, sys
sys.path.insert(0, '{tests}'); sys.path.insert(0, '{tests}/gpu')
from lily import _core
from test_linear import random_matrix
ops = _core.ops
rng = np.random.default_rng(0)
m = random_matrix(rng, 1, 32, 512, 4, 256, 'BF16')
m64 = random_matrix(rng, 1, 32, 512, 4, 64, 'BF16')
x = rng.standard_normal((1, 512)).astype(np.float32)
try:
    {probe}
    print('no error')
except Exception as e:
    print(type(e).__name__, str(e)[:80])
"""
tests = sys.argv[1] if len(sys.argv) > 1 else "tests"
for name, probe in PROBES.items():
    r = subprocess.run([sys.executable, "-c", SETUP.format(tests=tests, probe=probe)], capture_output=True, text=True)
    err = r.stderr.strip().splitlines()
    print(f"{name:26s} rc={r.returncode:4d} {r.stdout.strip()[:100]} {err[-1][:80] if r.returncode and err else ''}")
