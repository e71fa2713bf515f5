"""lily bench (issue 6) on the CPU: the real sweep on a micro checkpoint, the MLX-missing path, the time
budget and arm timeouts, medians and ratios, the report, identity, numerics metrics, reduced copies."""
from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import lily
from lily.bench import (CONTEXTS, RESULT_PREFIX, format_context, micro_checkpoint, parse_contexts, prompt_ids)
from lily.bench import numerics, report, sweep
from lily.bench.identity import checkpoint_hash, identity

ENV = dict(os.environ, OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    return micro_checkpoint(tmp_path_factory.mktemp("micro") / "ckpt")


@pytest.fixture(scope="module")
def no_mlx(tmp_path_factory):
    """A PYTHONPATH entry on which `import mlx` fails as if MLX were not installed (also where it is)."""
    d = tmp_path_factory.mktemp("no-mlx")
    for pkg in ("mlx", "mlx_lm"):
        (d / pkg).mkdir()
        (d / pkg / "__init__.py").write_text(f"raise ImportError(\"No module named '{pkg}'\")\n")
    return str(d)


def bench(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "lily.cli", "bench", *args], capture_output=True, text=True,
                          env=env or ENV, timeout=timeout)


def test_prompt_formula_and_contexts():
    ids = prompt_ids(300, 248320)
    assert ids.dtype == np.int32
    assert [int(x) for x in ids[:4]] == [((i * 2654435761) % 2**32) % 248320 for i in range(4)]
    assert int(ids[299]) == ((299 * 2654435761) % 2**32) % 248320
    big = prompt_ids(131072, 248320)  # no overflow at the largest context
    assert int(big[-1]) == ((131071 * 2654435761) % 2**32) % 248320
    assert parse_contexts("512,256,1K,4k,256") == [256, 512, 1024, 4096]
    assert parse_contexts(None) == list(CONTEXTS) and CONTEXTS[-1] == 128 * 1024
    assert [format_context(c) for c in (256, 1024, 131072)] == ["256", "1K", "128K"]
    with pytest.raises(ValueError):
        parse_contexts("12x")


def test_sweep_lily_on_cpu_with_mlx_missing(micro, no_mlx, tmp_path):
    """The real sweep: lily measured at 256 and 512 in 2 rounds (fresh processes), the MLX arms report
    'not installed' once and are skipped after that; medians, table and PNG."""
    out = tmp_path / "r.json"
    env = dict(ENV, PYTHONPATH=os.pathsep.join([no_mlx, ENV.get("PYTHONPATH", "")]))
    r = bench("sweep", "--model", str(micro), "--engines", "lily,mlx", "--device", "cpu", "--contexts", "256,512",
              "--rounds", "2", "--out", str(out), "--markdown", str(tmp_path / "r.md"), "--plot",
              str(tmp_path / "r.png"), env=env)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["finished"] and res["schema"] == sweep.SCHEMA
    order = [(a["engine"], a["context"], a["round"], a["status"]) for a in res["arms"]]
    assert order == [("lily", 256, 1, "ok"), ("mlx", 256, 1, "unavailable"), ("mlx", 256, 2, "skipped"),
                     ("lily", 256, 2, "ok"), ("lily", 512, 1, "ok"), ("mlx", 512, 1, "skipped"),
                     ("mlx", 512, 2, "skipped"), ("lily", 512, 2, "ok")]
    mlx = res["arms"][1]
    assert "MLX-LM is not installed" in mlx["reason"] and mlx["returncode"] == 3
    assert all("MLX-LM is not installed" in a["reason"] for a in res["arms"] if a["status"] == "skipped")
    for a in (a for a in res["arms"] if a["engine"] == "lily"):
        assert a["decode_steps"] == 64 and a["device"] == "cpu" and len(a["first_tokens"]) == 8
        assert math.isclose(a["prefill_tok_s"], a["context"] / a["prefill_s"])
        assert math.isclose(a["decode_tok_s"], 64 / a["decode_s"])
        assert a["wall_s"] > a["prefill_s"] + a["decode_s"] and a["load_s"] >= 0
        assert Path(a["log"]).is_file()
    for c in (256, 512):
        arms = [a for a in res["arms"] if a["engine"] == "lily" and a["context"] == c]
        cell = res["summary"]["engines"]["lily"][str(c)]
        assert cell["n"] == 2 and cell["tokens_repeat"]  # greedy: both rounds generate the same tokens
        assert math.isclose(cell["prefill_tok_s"], np.median([a["prefill_tok_s"] for a in arms]))
        assert math.isclose(cell["decode_tok_s"], np.median([a["decode_tok_s"] for a in arms]))
        assert res["summary"]["engines"]["mlx"][str(c)]["n"] == 0
        assert res["summary"]["ratios"]["by_context"][str(c)] == {"prefill": None, "decode": None}
    ident = res["identity"]
    assert ident["checkpoint"]["sha256"] == checkpoint_hash(micro)["sha256"]
    assert ident["lily"]["version"] == lily.__version__ and ident["python"]
    md = (tmp_path / "r.md").read_text()
    assert "| 256 |" in md and "| 512 |" in md and "— [1]" in md and "MLX-LM is not installed" in md
    assert "![throughput](r.png)" in md
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| context | lily prefill tok/s | mlx prefill tok/s | prefill lily/mlx |" in r.stdout


def test_arm_says_when_mlx_is_missing(micro, no_mlx):
    env = dict(ENV, PYTHONPATH=no_mlx)
    r = subprocess.run([sys.executable, "-m", "lily.bench.arm", "--engine", "mlx", "--model", str(micro),
                        "--context", "16"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 3
    assert "MLX-LM is not installed" in r.stderr and "pip install mlx-lm" in r.stderr
    result = json.loads(r.stdout.splitlines()[-1][len(RESULT_PREFIX):])
    assert result["status"] == "unavailable"


def test_arm_timeout_kills_the_arm_and_skips_larger_contexts(micro, tmp_path):
    out = tmp_path / "t.json"
    r = bench("sweep", "--model", str(micro), "--engines", "lily", "--device", "cpu", "--contexts", "256,512",
              "--rounds", "2", "--arm-timeout", "0.05", "--no-hash", "--out", str(out))
    assert r.returncode == 0, r.stderr
    arms = json.loads(out.read_text())["arms"]
    assert [a["status"] for a in arms] == ["timeout", "skipped", "skipped", "skipped"]
    assert arms[0]["limit_s"] == 0.05 and arms[0]["wall_s"] < 30
    assert all("timed out at 256" in a["reason"] for a in arms[1:])
    md = report.render_markdown(json.loads(out.read_text()))
    assert "timeout (killed after 0 s)" in md


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def fake_runner(clock, rates, fail=None):
    """Arms that 'take' start-up 2 s + 2 prefills at rates[engine] tok/s + 64 steps at 100 tok/s."""
    calls = []

    def run(engine, context, rnd, timeout):
        calls.append((engine, context, rnd, timeout))
        prefill = context / rates[engine]
        wall = 2 + 2 * prefill + 0.64
        if fail and fail(engine, context):
            return {"status": "error", "error": "boom", "returncode": 1}
        if timeout is not None and wall > timeout:
            clock.t += timeout
            return {"status": "timeout", "limit_s": timeout}
        clock.t += wall
        decode_s = 64 / (100 if engine == "lily" else 50)
        return {"status": "ok", "engine": engine, "context": context, "prefill_s": prefill, "decode_s": decode_s,
                "prefill_tok_s": context / prefill, "decode_tok_s": 64 / decode_s, "decode_ms": decode_s / 64 * 1e3,
                "load_s": 1.0, "first_tokens": [1, 2, 3], "versions": {engine: "x"}, "device": "cpu"}

    return run, calls


def test_budget_skips_predicted_overruns_and_ratios(micro, tmp_path):
    clock = FakeClock()
    runner, calls = fake_runner(clock, {"lily": 1000.0, "mlx": 100.0})
    cfg = sweep.SweepConfig(model=str(micro), out=str(tmp_path / "b.json"), engines=["lily", "mlx"],
                            contexts=[1024, 256, 512, 2048], rounds=2, time_budget_s=120, arm_timeout_s=100,
                            hash_checkpoint=False)
    res = sweep.run_sweep(cfg, runner=runner, clock=clock, log=lambda m: None)
    arms = {(a["engine"], a["context"], a["round"]): a for a in res["arms"]}
    # Contexts ascending; round 1 lily first, round 2 mlx first.
    assert [(e, c, r) for e, c, r, _ in calls[:4]] == [("lily", 256, 1), ("mlx", 256, 1), ("mlx", 256, 2),
                                                        ("lily", 256, 2)]
    # mlx at 2048: predicted from 1024 (2 + 2*10.24 + 0.64 = 23.1 s) -> 2 + 2*20.48 + 0.64 = 43.6 s.
    m2k = arms[("mlx", 2048, 1)]
    assert m2k["status"] == "skipped" and "remaining budget" in m2k["reason"]
    assert math.isclose(m2k["predicted_s"], 2.64 + 2 * 20.48, abs_tol=0.01)
    assert arms[("lily", 2048, 1)]["status"] == "ok"  # lily's own prediction still fits
    assert all(t is not None and t <= 100 for *_, t in calls)
    s = res["summary"]
    assert math.isclose(s["ratios"]["by_context"]["512"]["prefill"], 10.0)
    assert math.isclose(s["ratios"]["by_context"]["512"]["decode"], 2.0)
    assert s["ratios"]["by_context"]["2048"]["prefill"] is None
    assert s["ratios"]["label"] == "lily/mlx"
    md = report.render_markdown(res)
    assert "| 512 | 1,000 | 100 | 10.00x | 100 | 50.0 | 2.00x |" in md
    assert "| 2K | 1,000 (1/2) | — [1] | — | 100 (1/2) | — [1] | — |" in md  # lily's round 2 did not fit either
    assert "mlx at 2K: predicted" in md
    # The results file holds the same thing (written after every arm).
    assert json.loads(Path(cfg.out).read_text())["arms"] == json.loads(json.dumps(res["arms"]))


def test_prediction_is_at_least_linear_and_follows_superlinear_growth():
    def arm(c, p, wall):
        return {"engine": "e", "context": c, "status": "ok", "prefill_s": p, "wall_s": wall}

    linear = sweep.predict_seconds([arm(1000, 1.0, 5.0)], "e", 4000)
    assert math.isclose(linear[0], 3.0 + 8.0)
    quad = sweep.predict_seconds([arm(1000, 1.0, 5.0), arm(2000, 4.0, 11.0)], "e", 4000)
    assert math.isclose(quad[0], 3.0 + 2 * 4.0 * 4)  # exponent 2 from 1K -> 2K
    sub = sweep.predict_seconds([arm(1000, 1.0, 5.0), arm(2000, 1.2, 5.4)], "e", 4000)
    assert math.isclose(sub[0], 3.0 + 2 * 1.2 * 2)  # never below linear
    assert sweep.predict_seconds([arm(1000, 1.0, 5.0)], "e", 1000)[0] == 5.0
    assert sweep.predict_seconds([], "e", 1000) is None


def test_errors_resume_and_max_context(micro, tmp_path):
    clock = FakeClock()
    runner, calls = fake_runner(clock, {"lily": 1000.0, "mlx": 100.0}, fail=lambda e, c: e == "mlx" and c == 256)
    cfg = sweep.SweepConfig(model=str(micro), out=str(tmp_path / "e.json"), engines=["lily", "mlx"],
                            contexts=[256, 512], rounds=1, max_context={"mlx": 256}, hash_checkpoint=False)
    res = sweep.run_sweep(cfg, runner=runner, clock=clock, log=lambda m: None)
    st = {(a["engine"], a["context"]): a for a in res["arms"]}
    assert st[("mlx", 256)]["status"] == "error" and st[("mlx", 512)]["reason"] == "above --max-context mlx=256"
    assert "error: boom" in report.throughput_table(res)
    # Resume: measured arms kept, the rest (and a new context) run.
    runner2, calls2 = fake_runner(clock, {"lily": 1000.0, "mlx": 100.0})
    cfg2 = sweep.SweepConfig(model=str(micro), out=cfg.out, engines=["lily", "mlx"], contexts=[1024], rounds=1,
                             hash_checkpoint=False, resume=True)
    res2 = sweep.run_sweep(cfg2, runner=runner2, clock=clock, log=lambda m: None)
    assert res2["config"]["contexts"] == [256, 512, 1024]
    assert [(e, c) for e, c, _, _ in calls2] == [("mlx", 256), ("mlx", 512), ("lily", 1024), ("mlx", 1024)]
    assert all(a["status"] == "ok" for a in res2["arms"]) and len(res2["arms"]) == 6
    assert sweep.parse_max_context(["mlx=16K"]) == {"mlx": 16384}


def test_report_from_json_and_plot_with_missing_engine(micro, tmp_path):
    clock = FakeClock()
    runner, _ = fake_runner(clock, {"lily": 1000.0, "mlx": 100.0}, fail=lambda e, c: e == "mlx")
    cfg = sweep.SweepConfig(model=str(micro), out=str(tmp_path / "m.json"), engines=["lily", "mlx"],
                            contexts=[256, 512], rounds=2, hash_checkpoint=False)
    sweep.run_sweep(cfg, runner=runner, clock=clock, log=lambda m: None)
    r = bench("report", cfg.out, "--markdown", str(tmp_path / "m.md"), "--plot", str(tmp_path / "m.png"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "m.png").stat().st_size > 10_000
    md = (tmp_path / "m.md").read_text()
    assert "| 256 | 1,000 | — [1] | — | 100 | — [1] | — |" in md and "[1] mlx at 256: error: boom" in md


def test_checkpoint_hash_matches_sha256sum_layout(micro):
    h = checkpoint_hash(micro)
    names = sorted(p.name for p in micro.iterdir())
    assert list(h["files"]) == names
    for n in names:
        assert h["files"][n] == hashlib.sha256((micro / n).read_bytes()).hexdigest()
    lines = "".join(f"{h['files'][n]}  {n}\n" for n in names)
    assert h["sha256"] == hashlib.sha256(lines.encode()).hexdigest()
    assert h["bytes"] == sum((micro / n).stat().st_size for n in names)
    ident = identity(None)
    assert {"gpu", "driver", "cuda_driver", "cuda_toolkit", "cpu", "host", "lily", "packages"} <= set(ident)
    assert ident["lily"]["source_tree_sha256"] is None or len(ident["lily"]["source_tree_sha256"]) == 64


def test_numerics_metrics_on_known_values():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 7)).astype(np.float32)
    t = np.array([0, 3, 6, 2, 1])
    same = numerics.compare(x, x, t)
    assert same["ppl_rel_diff"] == 0 and same["top1_agreement"] == 1 and abs(same["mean_kl"]) < 1e-12
    assert same["max_rel_dlogit"] == 0
    # Row 0: ref uniform over 2 tokens, test p = (3/4, 1/4); row 1: ref (e/(1+e), 1/(1+e)), test its mirror.
    ref = np.array([[0.0, 0.0], [1.0, 0.0]])
    test = np.array([[math.log(3), 0.0], [0.0, 1.0]])
    m = numerics.compare(ref, test, np.array([0, 0]))
    p = math.e / (1 + math.e)
    nll_ref = [math.log(2), -math.log(p)]
    nll_test = [-math.log(0.75), -math.log(1 - p)]
    assert math.isclose(m["ppl_ref"], math.exp(sum(nll_ref) / 2))
    assert math.isclose(m["ppl_test"], math.exp(sum(nll_test) / 2))
    assert math.isclose(m["ppl_rel_diff"], m["ppl_test"] / m["ppl_ref"] - 1)
    kl0 = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)
    kl1 = p * math.log(p / (1 - p)) + (1 - p) * math.log((1 - p) / p)
    assert math.isclose(m["mean_kl"], (kl0 + kl1) / 2)
    assert m["top1_agreement"] == 0.5  # row 0: both argmax 0 (tie -> first); row 1: 0 vs 1
    assert math.isclose(m["max_rel_dlogit"], math.log(3))  # row 0: |log 3 - 0| / max |ref| (= 1)
    assert math.isclose(numerics.perplexity(ref, np.array([0, 0])), m["ppl_ref"])
    # Shift invariance: adding a constant per row changes no metric.
    m2 = numerics.compare(ref, test + 5.0, np.array([0, 0]))
    assert math.isclose(m2["mean_kl"], m["mean_kl"]) and math.isclose(m2["ppl_test"], m["ppl_test"])


def test_keep_tensor_rule():
    keep = numerics.keep_tensor
    assert keep("language_model.model.layers.1.mlp.gate.weight", 2)
    assert not keep("language_model.model.layers.2.mlp.gate.weight", 2)
    assert not keep("model.language_model.layers.12.linear_attn.A_log", 4)
    assert keep("language_model.lm_head.weight", 2) and keep("language_model.model.embed_tokens.scales", 1)
    assert not keep("mtp.layers.0.mlp.gate.weight", 4) and not keep("mtp.fc.weight", 4)
    assert not keep("model.visual.blocks.0.attn.qkv.weight", 4)


def test_reduced_copy_loads_and_matches_the_first_layers(micro, tmp_path):
    dst = numerics.reduce_checkpoint(micro, tmp_path / "r2", 2)
    cfg = json.loads((dst / "config.json").read_text())
    tc = cfg["text_config"]
    assert tc["num_hidden_layers"] == 2 and len(tc["layer_types"]) == 2 and tc["mtp_num_hidden_layers"] == 0
    q = cfg["quantization"]
    assert "language_model.model.layers.1.mlp.gate" in q and "language_model.model.layers.2.mlp.gate" not in q
    assert q["bits"] == 4 and cfg["quantization_config"] == q
    from lily.checkpoint.safetensors_io import SafetensorsFile

    full, red = SafetensorsFile(micro / "model.safetensors"), SafetensorsFile(dst / "model.safetensors")
    assert set(red.names()) == {n for n in full.names() if numerics.keep_tensor(n, 2)}
    assert any(".layers.3." in n for n in full.names()) and not any(".layers.2." in n for n in red.names())
    for n in red.names():
        assert np.array_equal(red.get(n), full.get(n)), n
    assert red.metadata == full.metadata
    ids = prompt_ids(24, 4096)
    big = lily.Model.load(micro, device="cpu").new_session(64).trace(ids)
    small = lily.Model.load(dst, device="cpu").new_session(64).trace(ids)
    for i in range(2):
        np.testing.assert_array_equal(small[f"layers.{i}.residual"], big[f"layers.{i}.residual"])
    assert "layers.2.residual" not in small and small["logits"].shape == (24, 4096)
    r = bench("reduce", str(micro), str(tmp_path / "r1"), "--layers", "1")
    assert r.returncode == 0 and "1 layers" in r.stdout
    bad = bench("reduce", str(micro), str(tmp_path / "r9"), "--layers", "9")
    assert bad.returncode == 2 and "has 4 layers" in bad.stderr


def test_numerics_command_with_lily_only(micro, tmp_path):
    """The numerics flow on the CPU with lily only (reduced copy + full): logits files, ppl, JSON."""
    out = tmp_path / "n.json"
    r = bench("numerics", "--model", str(micro), "--device", "cpu", "--cpu-layers", "2", "--reduced-engines",
              "lily-cpu", "--full-engines", "lily-cpu", "--no-hash", "--out", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert set(res["runs"]) == {"reduced", "full"}
    assert res["runs"]["reduced"]["layers"] == 2 and res["runs"]["full"]["layers"] == 4
    rec = res["runs"]["full"]["engines"]["lily-cpu"]
    assert rec["status"] == "ok" and rec["shape"] == [192, 4096] and rec["finite"]
    # The logits are the model's own teacher-forced logits.
    want = lily.Model.load(micro, device="cpu").new_session(256).prefill(prompt_ids(193, 4096)[:192], all_logits=True)
    assert math.isclose(rec["ppl"], numerics.perplexity(want, prompt_ids(193, 4096)[1:]), rel_tol=1e-9)
    assert "no pair to compare" in r.stdout


def test_cli_rejects_bad_arguments(micro):
    r = bench("sweep", "--model", str(micro), "--engines", "lily,vllm")
    assert r.returncode == 2 and "--engines" in r.stderr
    r = bench("sweep", "--model", str(micro), "--contexts", "12x")
    assert r.returncode == 2 and "12x" in r.stderr
    r = bench("sweep", "--model", "/nonexistent")
    assert r.returncode == 2 and "no config.json" in r.stderr
    r = subprocess.run([sys.executable, "-m", "lily.bench.arm", "--engine", "lily", "--model", str(micro)],
                       capture_output=True, text=True, env=ENV, timeout=60)
    assert r.returncode == 2 and "exactly one of --context" in r.stderr
