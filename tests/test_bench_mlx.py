"""lily bench against real MLX-LM on the CPU (skipped where mlx-lm is not installed, as in CI): MLX-LM
loads lily's synthetic checkpoint bytes, its fp32 run matches lily's fp32 CPU reference, and its timed
arm runs inside the sweep."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("mlx_lm")

from lily.bench import micro_checkpoint  # noqa: E402
from lily.bench.numerics import run_numerics  # noqa: E402

ENV = dict(os.environ, OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    return micro_checkpoint(tmp_path_factory.mktemp("micro") / "ckpt", num_layers=8)


def test_mlx_fp32_matches_lily_cpu_on_the_same_bytes(micro, tmp_path):
    # 4 layers: mlx-lm's qwen3_5 needs at least one full_attention_interval (its layer 3 is attention).
    with pytest.raises(ValueError, match="at least full_attention_interval = 4 layers"):
        run_numerics(micro, tmp_path / "x.json", device="cpu", cpu_layers=2, reduced_engines=["mlx"])
    res = run_numerics(micro, tmp_path / "n.json", device="cpu", cpu_layers=4, reduced_engines=["lily-cpu", "mlx-fp32"],
                       full_engines=["lily-cpu", "mlx", "mlx-fp32"], hash_checkpoint=False, log=lambda m: None)
    for run in ("reduced", "full"):
        pairs = {(p["ref"], p["test"]): p for p in res["runs"][run]["pairs"]}
        same = pairs[("lily-cpu", "mlx-fp32")]  # two fp32 implementations of one model: rounding only
        assert same["top1_agreement"] == 1.0, run
        assert same["max_rel_dlogit"] < 1e-4 and abs(same["ppl_rel_diff"]) < 1e-4 and same["mean_kl"] < 1e-6, same
    full = {(p["ref"], p["test"]): p for p in res["runs"]["full"]["pairs"]}
    assert {("mlx-fp32", "mlx"), ("lily-cpu", "mlx")} <= set(full)
    mlx = res["runs"]["full"]["engines"]["mlx"]
    assert mlx["status"] == "ok" and mlx["shape"] == [192, 4096] and mlx["versions"]["mlx_lm"]
    assert json.loads((tmp_path / "n.json").read_text())["runs"]["reduced"]["layers"] == 4


def test_sweep_times_mlx_lm(micro, tmp_path):
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "lily.cli", "bench", "sweep", "--model", str(micro), "--engines",
                        "lily,mlx", "--device", "cpu", "--contexts", "64", "--rounds", "1", "--no-hash", "--out",
                        str(out)], capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    lily_arm, mlx_arm = res["arms"]
    assert mlx_arm["status"] == "ok", mlx_arm
    assert mlx_arm["decode_steps"] == 64 and len(mlx_arm["first_tokens"]) == 8
    assert mlx_arm["versions"]["mlx"] and "cpu" in mlx_arm["device"]
    assert res["engine_versions"]["mlx"]["mlx_lm"] == mlx_arm["versions"]["mlx_lm"]
    ratio = res["summary"]["ratios"]["by_context"]["64"]
    assert ratio["prefill"] > 0 and ratio["decode"] > 0


def test_mlx_on_cpu_is_no_baseline_for_cuda():
    import mlx.core as mx

    from lily.bench import mlx_arm

    if "gpu" in str(mx.default_device()).lower():
        pytest.skip("MLX has a GPU here")
    with pytest.raises(mlx_arm.Unavailable, match="MLX has no GPU here"):
        mlx_arm.require_gpu_if("cuda")
    mlx_arm.require_gpu_if("cpu")
