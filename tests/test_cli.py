"""The lily command end to end on synthetic checkpoints."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import lily


def run(*args, cache, stdin=None):
    env = dict(os.environ, LILY_CACHE_DIR=str(cache))
    return subprocess.run([sys.executable, "-m", "lily.cli", *args], capture_output=True, text=True,
                          env=env, input=stdin, timeout=600)


def test_generate_on_builtin_tiny(tmp_path):
    r = run("generate", "Hello, world", "--max-tokens", "5", cache=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "prompt tokens: 3" in r.stderr
    ids = json.loads(r.stderr.split("generated token ids: ")[1].splitlines()[0])
    assert len(ids) == 5 and all(0 <= i < 248320 for i in ids)
    # The same checkpoint through the Python API gives the same greedy tokens.
    model = lily.Model.load(tmp_path / "checkpoints" / "tiny-mlx-4bit-seed0", device="cpu")
    assert model.generate("Hello, world", max_tokens=5).token_ids == ids
    assert model.tokenizer.encode("Hello, world", add_special_tokens=False).ids == [9419, 11, 1814]
    q = run("generate", "-q", "--max-tokens", "3", cache=tmp_path, stdin="Hello")
    assert q.returncode == 0 and q.stderr == "" and q.stdout.strip()


def test_generate_bad_model_is_a_clear_error(tmp_path):
    r = run("generate", "hi", "--model", str(tmp_path / "nope" / "x"), cache=tmp_path)
    assert r.returncode == 2
    assert "lily: error:" in r.stderr and "no such folder" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("layout", ["mlx", "hf"])
def test_make_checkpoint_loads_and_runs(tmp_path, layout):
    out = tmp_path / layout
    r = run("make-checkpoint", str(out), "--config", "tiny", "--layout", layout, "--seed", "3", cache=tmp_path)
    assert r.returncode == 0, r.stderr
    model = lily.Model.load(out, device="cpu")
    assert model.layout == layout
    logits = model.prefill(model.tokenizer.encode("The quick brown fox").ids)
    assert np.isfinite(logits).all() and logits.std() > 0.5
