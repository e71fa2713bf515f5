"""benchmarks/sweep_host.sh in its dry mode (micro checkpoint, CPU, contexts 256 and 512, lily only):
the same script the GPU host runs, end to end."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_sweep_host_dry_run(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", DRY="1", ENGINES="lily", NUMERICS_REDUCED="lily-cpu", CPU_LAYERS="2",
               NUMERICS_FULL="lily-cpu", OUT=str(tmp_path / "out"), LILY_COMMIT="0123abc",
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))  # python3 = ours
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "sweep_host.sh")], capture_output=True, text=True,
                       env=env, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    out = tmp_path / "out"
    for name in ("results.json", "results.md", "numerics.json", "sweep.log", "numerics.log"):
        assert (out / name).is_file(), (name, r.stdout)
    res = json.loads((out / "results.json").read_text())
    assert res["finished"] and [a["status"] for a in res["arms"]] == ["ok"] * 4
    assert res["config"]["contexts"] == [256, 512] and res["config"]["device"] == "cpu"
    assert 0 < res["config"]["time_budget_s"] <= 540
    assert res["identity"]["lily"]["commit"] and res["identity"]["checkpoint"]["sha256"]
    assert "| context | lily prefill tok/s | lily decode tok/s |" in r.stdout
    assert "| 256 |" in r.stdout and "| 512 |" in r.stdout and "numerics: exit 0" in r.stdout
    assert "reduced checkpoint (2 layers" in r.stdout and "total:" in r.stdout.splitlines()[-1]
    num = json.loads((out / "numerics.json").read_text())
    assert num["runs"]["full"]["engines"]["lily-cpu"]["status"] == "ok"


def test_host_scripts_parse():
    for script in ("gpu_host.sh", "sweep_host.sh", "host_lib.sh", "install_mlx.sh"):
        r = subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / script)], capture_output=True, text=True)
        assert r.returncode == 0, (script, r.stderr)
