"""Bad checkpoints raise a clear lily error naming the file, tensor or config key."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import lily
from hf_reference import build_model, save_hf
from lily.safetensors_io import SafetensorsFile, save_file

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
