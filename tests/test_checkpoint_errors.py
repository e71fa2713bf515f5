"""Bad checkpoints raise a clear lily error naming the file, tensor or config key."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import lily
from hf_reference import build_model, save_hf
from lily.checkpoint.safetensors_io import SafetensorsFile, save_file

Q = "model.layers.0.linear_attn.in_proj_qkv.weight"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return save_hf(build_model(seed=5), tmp_path_factory.mktemp("hf-good"))


@pytest.fixture
def ckpt(good, tmp_path):
    dest = tmp_path / "ckpt"
    shutil.copytree(good, dest)
    return dest


def rewrite(path, edit):
    """Apply edit(dict name -> (dtype, array)) to model.safetensors."""
    f = SafetensorsFile(path / "model.safetensors")
    tensors = {n: (f.info(n).dtype, np.array(f.get(n))) for n in f.names()}
    f.close()
    edit(tensors)
    save_file(path / "model.safetensors", tensors)


def edit_config(path, edit):
    raw = json.loads((path / "config.json").read_text())
    edit(raw)
    (path / "config.json").write_text(json.dumps(raw))


def load(path):
    return lily.Model.load(path, device="cpu", max_context=64)


def test_good_checkpoint_loads(good):
    assert load(good).config.num_hidden_layers == 4


def test_missing_tensor(ckpt):
    rewrite(ckpt, lambda t: t.pop(Q))
    with pytest.raises(lily.CheckpointError, match="missing tensor 'model.language_model.layers.0.linear_attn.in_proj_qkv"):
        load(ckpt)


def test_missing_expert(ckpt):
    rewrite(ckpt, lambda t: t.pop("model.layers.1.mlp.experts.2.up_proj.weight"))
    with pytest.raises(lily.CheckpointError, match=r"layers\.1\.mlp\.experts\.2\.up_proj"):
        load(ckpt)


def test_wrong_shape(ckpt):
    rewrite(ckpt, lambda t: t.__setitem__(Q, ("F32", np.zeros((160, 63), np.float32))))
    with pytest.raises(lily.CheckpointError, match=rf"tensor '{Q}' in model.safetensors: shape \[160, 63\], expected \[160, 64\]"):
        load(ckpt)


def test_wrong_vector_shape(ckpt):
    name = "model.layers.0.linear_attn.A_log"
    rewrite(ckpt, lambda t: t.__setitem__(name, ("F32", np.zeros(5, np.float32))))
    with pytest.raises(lily.CheckpointError, match=rf"'{name}'.*shape \[5\], expected \[4\]"):
        load(ckpt)


def test_wrong_dtype(ckpt):
    rewrite(ckpt, lambda t: t.__setitem__(Q, ("I32", np.zeros((160, 64), np.int32))))
    with pytest.raises(lily.CheckpointError, match=rf"'{Q}'.*dtype I32"):
        load(ckpt)


def test_quantized_without_biases(ckpt):
    def edit(t):
        t[Q] = ("U32", np.zeros((160, 8), np.uint32))
        t[Q.replace(".weight", ".scales")] = ("F32", np.ones((160, 1), np.float32))
    rewrite(ckpt, edit)
    with pytest.raises(lily.CheckpointError, match="in_proj_qkv.biases"):
        load(ckpt)


def test_truncated_file(ckpt):
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(lily.CheckpointError, match="model.safetensors"):
        load(ckpt)


def test_garbage_file(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all")
    with pytest.raises(lily.CheckpointError, match="model.safetensors"):
        load(ckpt)


def test_index_names_missing_shard(ckpt):
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {Q: "model-00002-of-00002.safetensors"}}))
    with pytest.raises(lily.CheckpointError, match="model-00002-of-00002.safetensors"):
        load(ckpt)


def test_no_weights(tmp_path, good):
    shutil.copy(good / "config.json", tmp_path / "config.json")
    with pytest.raises(lily.CheckpointError, match="no .safetensors files"):
        load(tmp_path)


def test_no_config(tmp_path):
    with pytest.raises(lily.ConfigError, match="config.json: not found"):
        load(tmp_path)


def test_not_a_folder_nor_repo(tmp_path):
    with pytest.raises(lily.CheckpointError, match="no such folder"):
        load(tmp_path / "missing" / "deeper")


@pytest.mark.parametrize("edit, match", [
    (lambda r: r.__setitem__("model_type", "llama"), "unsupported model_type 'llama'"),
    (lambda r: r["text_config"].__setitem__("num_key_value_heads", 3), "not a multiple of num_key_value_heads"),
    (lambda r: r["text_config"].__setitem__("layer_types", ["linear_attention"] * 3), "must list 4 entries"),
    (lambda r: r["text_config"].pop("hidden_size"), "missing required key 'hidden_size'"),
    (lambda r: r["text_config"].__setitem__("num_experts_per_tok", 99), "exceeds num_experts"),
    (lambda r: r["text_config"].__setitem__("head_dim", -2), "'head_dim' must be a positive integer"),
    (lambda r: r["text_config"].__setitem__("layer_types", ["linear_attention"] * 3 + ["sliding"]), "unknown layer_types"),
    (lambda r: r.__setitem__("quantization", {"quant_method": "fp8"}), "'fp8' is not supported"),
])
def test_bad_config(ckpt, edit, match):
    edit_config(ckpt, edit)
    with pytest.raises(lily.CheckpointError, match=match):
        load(ckpt)


def test_config_disagrees_with_tensors(ckpt):
    edit_config(ckpt, lambda r: r["text_config"].__setitem__("moe_intermediate_size", 41))
    with pytest.raises(lily.CheckpointError, match=r"experts\.0\.gate_proj.*expected \[41, 64\]"):
        load(ckpt)


def test_unreadable_config(ckpt):
    (ckpt / "config.json").write_text("{ nope")
    with pytest.raises(lily.ConfigError, match="unreadable JSON"):
        load(ckpt)


# --- issue 14: hostile checkpoints (rows 8-11) ---------------------------------------------------------

@pytest.mark.parametrize("edit, match", [
    (lambda r: r["text_config"].__setitem__("num_hidden_layers", 10**6), "'num_hidden_layers' must be a positive integer <= 1024"),
    (lambda r: r["text_config"].__setitem__("hidden_size", 2**62), "'hidden_size' must be a positive integer"),
    (lambda r: r["text_config"].__setitem__("max_position_embeddings", "abc"), "'max_position_embeddings' must be"),
    (lambda r: r["text_config"].__setitem__("eos_token_id", ["abc"]), "'eos_token_id' must be a token id"),
    (lambda r: r["text_config"].__setitem__("eos_token_id", 2**40), "'eos_token_id' must be a token id"),
    (lambda r: r["text_config"].__setitem__("rms_norm_eps", float("inf")), "'rms_norm_eps' must be a finite number"),
    (lambda r: r["text_config"].__setitem__("rms_norm_eps", 5.0), "'rms_norm_eps' must be a finite number in"),
    (lambda r: r["text_config"].setdefault("rope_parameters", {}).__setitem__("rope_theta", float("nan")),
     "'rope_theta' must be a finite number"),
    (lambda r: r["text_config"].__setitem__("layer_types", [{"a": 1}] * 4), "unknown layer_types"),
])
def test_absurd_config_values_are_lily_errors(ckpt, edit, match):
    edit_config(ckpt, edit)
    with pytest.raises(lily.ConfigError, match=match):
        load(ckpt)


def test_deeply_nested_config_is_a_lily_error(ckpt):
    (ckpt / "config.json").write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(lily.ConfigError, match="unreadable JSON"):
        load(ckpt)


@pytest.mark.parametrize("ctx", [2**55 + 1, 2**31, 0, -3, 1.5])
def test_absurd_max_context_is_refused_before_any_allocation(good, ctx):
    with pytest.raises(lily.LilyError, match="max_context must be an integer in"):
        lily.Model.load(good, device="cpu", max_context=ctx)
    model = load(good)
    with pytest.raises(lily.LilyError, match="max_context must be an integer in"):
        model.new_session(ctx)
    assert model.new_session(8).max_context == 8  # the model is unharmed


def test_native_session_refuses_overflowing_sizes(good):
    from lily import _core

    model = load(good)
    with pytest.raises(lily.LilyError, match="max_context must be at most"):
        _core.Session(model._engine, 2**55 + 1, 16, False)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_weights_are_refused(ckpt, value):
    def poison(t):
        dtype, a = t[Q]
        a = a.copy()
        a.reshape(-1)[7] = np.float32(value).view(np.uint32) >> 16 if dtype == "BF16" else value
        t[Q] = (dtype, a)

    rewrite(ckpt, poison)
    with pytest.raises(lily.CheckpointError, match=r"in_proj_qkv.*holds NaN or infinity"):
        load(ckpt)
    lily.Model.load(ckpt, device="cpu", max_context=64, check_weights=False).close()  # the opt-out


def test_fifo_weights_file_is_refused_without_blocking(ckpt):
    import os

    (ckpt / "model.safetensors").unlink()
    os.mkfifo(ckpt / "model.safetensors")
    with pytest.raises(lily.CheckpointError, match="not a regular file"):
        load(ckpt)


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors", "a\\..\\b"])
def test_index_entries_outside_the_folder_are_refused(ckpt, name):
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {Q: name}}))
    with pytest.raises(lily.CheckpointError, match="is not a file name inside the checkpoint folder"):
        load(ckpt)


def test_overlapping_tensor_offsets_are_refused(ckpt):
    import struct

    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    names = [k for k in header if k != "__metadata__"]
    a, b = sorted(names, key=lambda k: header[k]["data_offsets"][0])[:2]
    size_b = header[b]["data_offsets"][1] - header[b]["data_offsets"][0]
    start = header[a]["data_offsets"][0]
    header[b]["data_offsets"] = [start, start + size_b]  # b now aliases a's bytes
    text = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(text) == n
    path.write_bytes(data[:8] + text + data[8 + n:])
    with pytest.raises(lily.CheckpointError, match="overlap"):
        load(ckpt)
