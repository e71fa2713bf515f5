"""lily.checkpoint.synthetic: layouts, conditioning (checked by running transformers), direct codes, shards, CLI."""

import argparse
import json
import math

import numpy as np
import pytest


from lily.checkpoint import convert
from lily.checkpoint import dtypes
from lily.checkpoint import quant
from lily.checkpoint import safetensors_io as sio
from lily.checkpoint import synthetic
from lily.checkpoint.tensors import is_zero_centred_norm
from checks import read_dir
from lily import errors

P = "language_model.model."
SMALL_VOCAB = {**synthetic.TINY_TEXT_CONFIG, "vocab_size": 4096}
# Real widths (hidden 2048, heads, GDN and expert dims) with few experts, layers and tokens.
REAL_WIDTHS = {**synthetic.QWEN36_35B_A3B_TEXT_CONFIG, "num_experts": 16, "vocab_size": 4096}


def dequantized(tensors: dict) -> dict[str, np.ndarray]:
    """MLX tensors as float32 weights under their MLX names (quantized modules dequantized)."""
    out = {}
    for name, (dtype, array) in tensors.items():
        if name.endswith((".scales", ".biases")):
            continue
        if dtype == "U32":
            module = name.removesuffix(".weight")
            scales = dtypes.decode_float(*tensors[module + ".scales"])
            biases = dtypes.decode_float(*tensors[module + ".biases"])
            bits = array.shape[-1] * 32 // (scales.shape[-1] * 64)
            out[name] = quant.dequantize(array, scales, biases, bits, 64)
        else:
            out[name] = dtypes.decode_float(dtype, array)
    return out


def causal_lm_state_dict(mlx_tensors: dict) -> dict:
    """Undo the MLX layout into transformers Qwen3_5MoeForCausalLM parameter names."""
    import torch
    floats = dequantized(mlx_tensors)
    state = {}
    for name, w in floats.items():
        hf = name.replace(P, "model.").replace("language_model.lm_head", "lm_head")
        if is_zero_centred_norm(name.removeprefix(P)):
            w = w - np.float32(1)
        if name.endswith("conv1d.weight"):
            w = w.transpose(0, 2, 1)
        if name.endswith("switch_mlp.gate_proj.weight"):
            up = floats[name.replace("gate_proj", "up_proj")]
            hf = hf.replace("switch_mlp.gate_proj.weight", "experts.gate_up_proj")
            w = np.concatenate([w, up], axis=1)  # gate rows first
        elif name.endswith("switch_mlp.up_proj.weight"):
            continue
        elif name.endswith("switch_mlp.down_proj.weight"):
            hf = hf.replace("switch_mlp.down_proj.weight", "experts.down_proj")
        state[hf] = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
    return state


def logit_stats(model, vocab_size: int, num_tokens: int = 80):
    """(finite, mean per-token logit std, mean top-1 probability) over a random prompt."""
    import torch
    ids = torch.randint(0, vocab_size, (1, num_tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    top1 = logits.softmax(-1).max(-1).values.mean().item()
    return bool(torch.isfinite(logits).all()), logits.std(-1).mean().item(), top1


def assert_informative(stats, vocab_size):
    finite, std, top1 = stats
    assert finite
    assert 1 <= std <= 20
    assert top1 > 100 / vocab_size  # far from uniform


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    return synthetic.make_checkpoint(tmp_path_factory.mktemp("hf"), "tiny", layout="hf", with_tokenizer=False)


@pytest.fixture(scope="module")
def tiny_mlx(tmp_path_factory):
    return synthetic.make_checkpoint(tmp_path_factory.mktemp("mlx"), "tiny", with_tokenizer=False)


def test_mlx_layout(tiny_mlx):
    tensors = read_dir(tiny_mlx)
    specs = convert.mlx_tensor_specs(synthetic.TINY_TEXT_CONFIG)
    assert {n: (d, a.shape) for n, (d, a) in tensors.items()} == specs
    assert sio.SafetensorsFile(tiny_mlx / "model.safetensors").metadata == {"format": "mlx"}
    config = json.loads((tiny_mlx / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    assert config["model_type"] == "qwen3_5_moe" and config["tie_word_embeddings"] is False
    assert config["text_config"] == synthetic.TINY_TEXT_CONFIG
    assert config["quantization"] == config["quantization_config"] == convert.quantization_config(
        synthetic.TINY_TEXT_CONFIG
    )
    norm = dtypes.decode_float(*tensors[P + "layers.0.input_layernorm.weight"])
    assert abs(norm.mean() - 1) < 0.05  # stored as 1 + w


def test_mlx_equals_conversion_of_hf(tiny_hf, tiny_mlx, tmp_path):
    converted = convert.convert_hf_to_mlx(tiny_hf, tmp_path)
    assert (converted / "model.safetensors").read_bytes() == (tiny_mlx / "model.safetensors").read_bytes()
    assert (converted / "config.json").read_text() == (tiny_mlx / "config.json").read_text()


def test_hf_layout_and_initial_values(tiny_hf):
    tensors = read_dir(tiny_hf)
    shapes = convert.hf_tensor_shapes(synthetic.TINY_TEXT_CONFIG)
    assert {n: a.shape for n, (_, a) in tensors.items()} == shapes
    assert {n for n, (d, _) in tensors.items() if d != "BF16"} == {
        f"model.language_model.layers.{i}.linear_attn.A_log" for i in range(3)
    }
    assert tensors["model.language_model.layers.0.mlp.experts.gate_up_proj"][1].shape == (8, 128, 128)
    assert tensors["model.language_model.layers.0.mlp.experts.down_proj"][1].shape == (8, 128, 64)
    assert tensors["model.language_model.layers.0.linear_attn.conv1d.weight"][1].shape == (256, 1, 4)

    def value(name):
        return dtypes.decode_float(*tensors["model.language_model." + name])

    assert abs(value("norm.weight").mean()) < 0.05 and 0.05 < value("norm.weight").std() < 0.2
    assert abs(value("layers.0.linear_attn.norm.weight").mean() - 1) < 0.1
    a_log = value("layers.0.linear_attn.A_log")
    assert np.all((a_log >= 0) & (a_log <= math.log(16)))
    dt = np.log1p(np.exp(value("layers.1.linear_attn.dt_bias")))
    assert np.all((dt > 0.9e-3) & (dt < 0.11))
    assert abs(value("embed_tokens.weight").std() - 1) < 0.01


def test_tiny_hf_runs_in_transformers(tiny_hf):
    import torch
    import transformers
    model = transformers.Qwen3_5MoeForCausalLM.from_pretrained(tiny_hf, dtype=torch.float32)
    assert_informative(logit_stats(model, 248077), 248320)


def test_forty_layers_stay_conditioned(tmp_path):
    import torch
    import transformers
    path = synthetic.make_checkpoint(tmp_path, SMALL_VOCAB, layout="hf", with_tokenizer=False, num_layers=40)
    model = transformers.Qwen3_5MoeForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model.config.num_hidden_layers == 40 and model.config.layer_types[39] == "full_attention"
    assert_informative(logit_stats(model, 4096), 4096)


def test_direct_codes_at_real_widths_run_in_transformers(tmp_path):
    import transformers
    path = synthetic.make_checkpoint(
        tmp_path, REAL_WIDTHS, with_tokenizer=False, num_layers=4, direct_codes=True
    )
    tensors = read_dir(path)
    text_config = synthetic.resolve_text_config(REAL_WIDTHS, 4)
    assert {n: (d, a.shape) for n, (d, a) in tensors.items()} == convert.mlx_tensor_specs(text_config)

    state = causal_lm_state_dict(tensors)
    for name, weight in state.items():
        if weight.ndim >= 2 and "conv1d" not in name:
            std = synthetic.weight_std(name, weight.shape[-1], text_config)
            assert abs(weight.std().item() / std - 1) < 0.05, name
            assert abs(weight.mean().item()) < 0.05 * std, name
    config = transformers.Qwen3_5MoeTextConfig(**text_config)
    model = transformers.Qwen3_5MoeForCausalLM(config).float()
    model.load_state_dict(state, strict=True, assign=True)
    assert_informative(logit_stats(model, 4096), 4096)


def test_direct_codes_match_quantized_float_statistics(tmp_path):
    direct = dequantized(read_dir(synthetic.make_checkpoint(
        tmp_path / "d", SMALL_VOCAB, with_tokenizer=False, direct_codes=True)))
    floats = dequantized(read_dir(synthetic.make_checkpoint(
        tmp_path / "f", SMALL_VOCAB, with_tokenizer=False, direct_codes=False)))
    assert direct.keys() == floats.keys()
    for name, w in direct.items():
        if w.size < 4096 or name.endswith(("A_log", "dt_bias")):  # too few samples to compare
            continue
        assert abs(w.std() / floats[name].std() - 1) < 0.15, name
        assert abs(w.mean() - floats[name].mean()) < 0.2 * floats[name].std() + 0.02, name


def test_sharded_output(tmp_path):
    single = read_dir(synthetic.make_checkpoint(tmp_path / "one", SMALL_VOCAB, with_tokenizer=False))
    path = synthetic.make_checkpoint(tmp_path / "many", SMALL_VOCAB, with_tokenizer=False, shard_size=200_000)
    files = sorted(path.glob("*.safetensors"))
    assert len(files) > 3 and files[0].name == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((path / "model.safetensors.index.json").read_text())
    sharded = read_dir(path)
    assert set(index["weight_map"]) == set(sharded) == set(single)
    assert index["metadata"]["total_size"] == sum(a.nbytes for _, a in sharded.values())
    for name, (dtype, array) in single.items():
        assert sharded[name][0] == dtype
        np.testing.assert_array_equal(sharded[name][1], array)


def test_seed_determines_the_weights(tmp_path):
    def make(name, seed, workers):
        return synthetic.make_checkpoint(
            tmp_path / name, SMALL_VOCAB, layout="hf", seed=seed, with_tokenizer=False, workers=workers
        )

    a, b, c = make("a", 1, workers=1), make("b", 1, workers=4), make("c", 2, workers=2)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_cli(tmp_path, capsys):
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(synthetic.full_config(SMALL_VOCAB)))
    parser = argparse.ArgumentParser()
    synthetic.add_cli_arguments(parser)
    args = parser.parse_args(
        [str(tmp_path / "out"), "--config", str(config_file), "--layout", "hf", "--seed", "3"]
        + ["--layers", "8", "--no-tokenizer"]
    )
    assert synthetic.run_cli(args) == 0
    assert "wrote" in capsys.readouterr().out
    text_config = json.loads((tmp_path / "out" / "config.json").read_text())["text_config"]
    assert text_config["num_hidden_layers"] == 8
    assert [i for i, t in enumerate(text_config["layer_types"]) if t == "full_attention"] == [3, 7]
    assert "model.language_model.layers.7.self_attn.q_proj.weight" in read_dir(tmp_path / "out")


def test_cli_vision(tmp_path):
    parser = argparse.ArgumentParser()
    synthetic.add_cli_arguments(parser)
    assert synthetic.run_cli(parser.parse_args([str(tmp_path / "v"), "--layout", "hf", "--no-tokenizer", "--vision"])) == 0
    assert json.loads((tmp_path / "v" / "config.json").read_text())["vision_config"]["depth"] == 2
    assert "model.visual.merger.linear_fc2.weight" in read_dir(tmp_path / "v")


def test_unknown_config_and_layout(tmp_path):
    with pytest.raises(errors.ConfigError, match="nope"):
        synthetic.make_checkpoint(tmp_path, "nope")
    with pytest.raises(ValueError, match="layout"):
        synthetic.make_checkpoint(tmp_path, "tiny", layout="gguf")
    with pytest.raises(errors.ConfigError, match="llama"):
        synthetic.make_checkpoint(tmp_path, {"model_type": "llama"})


def test_tokenizer_files_are_written(tmp_path):
    path = synthetic.make_checkpoint(tmp_path, SMALL_VOCAB, num_layers=1, layout="hf")
    assert (path / "tokenizer.json").is_file() and (path / "tokenizer_config.json").is_file()
    assert (path / "generation_config.json").is_file()


def test_vision_tower_hf(tmp_path):
    """--vision: the HF layout carries the tiny tower (bf16, the Conv3d patch embedding), lily loads it and
    its merged tokens come out at about unit RMS, like the text embeddings."""
    import lily

    path = synthetic.make_checkpoint(tmp_path, "tiny", layout="hf", with_tokenizer=False, vision=True)
    config = json.loads((path / "config.json").read_text())
    assert config["vision_config"]["out_hidden_size"] == 128
    tensors = read_dir(path)
    assert tensors["model.visual.patch_embed.proj.weight"][1].shape == (64, 3, 2, 16, 16)
    assert {d for n, (d, _) in tensors.items() if n.startswith("model.visual.")} == {"BF16"}
    m = lily.Model.load(path, device="cpu")
    pixels = np.random.default_rng(0).uniform(-1, 1, (24, 1536)).astype(np.float32)
    out = m._engine.encode_images(pixels, np.array([[1, 4, 6]], np.int32))
    assert out.shape == (6, 128) and 0.3 < np.sqrt((out ** 2).mean()) < 3


def test_vision_tower_mlx(tmp_path):
    """--vision in the MLX layout: the same bf16 tower as the HF layout (as `lily convert` copies it), loaded
    with the checkpoint; its merged tokens equal the HF checkpoint's."""
    import lily

    hf = synthetic.make_checkpoint(tmp_path / "hf", "tiny", layout="hf", with_tokenizer=False, vision=True)
    mlx = synthetic.make_checkpoint(tmp_path / "mlx", "tiny", with_tokenizer=False, vision=True)
    assert "vision_config" in json.loads((mlx / "config.json").read_text())
    hf_tensors, mlx_tensors = read_dir(hf), read_dir(mlx)
    visual = {n for n in hf_tensors if n.startswith("model.visual.")}
    assert visual == {n for n in mlx_tensors if n.startswith("model.visual.")}
    for name in visual:
        assert mlx_tensors[name][0] == "BF16"
        np.testing.assert_array_equal(mlx_tensors[name][1], hf_tensors[name][1])
    m = lily.Model.load(mlx, device="cpu")
    assert m.config.vision is not None
    pixels = np.random.default_rng(0).uniform(-1, 1, (24, 1536)).astype(np.float32)
    grids = np.array([[1, 4, 6]], np.int32)
    want = lily.Model.load(hf, device="cpu")._engine.encode_images(pixels, grids)
    np.testing.assert_array_equal(m._engine.encode_images(pixels, grids), want)


def test_mlx_layout_with_vision_equals_the_conversion(tmp_path):
    from lily.checkpoint import convert

    hf = synthetic.make_checkpoint(tmp_path / "hf", "tiny", layout="hf", with_tokenizer=False, vision=True)
    mlx = synthetic.make_checkpoint(tmp_path / "mlx", "tiny", with_tokenizer=False, vision=True)
    converted = convert.convert_hf_to_mlx(hf, tmp_path / "converted")
    assert (mlx / "model.safetensors").read_bytes() == (converted / "model.safetensors").read_bytes()


def test_full_size_vision_tower_shapes():
    tensors = synthetic.vision_tensors(synthetic.QWEN36_35B_A3B_TEXT_CONFIG, synthetic.VISION_CONFIGS["qwen3.6-35b-a3b"])
    assert tensors["model.visual.patch_embed.proj.weight"].shape == (1152, 3, 2, 16, 16)
    assert tensors["model.visual.pos_embed.weight"].shape == (2304, 1152)
    assert tensors["model.visual.blocks.26.attn.qkv.weight"].shape == (3456, 1152)
    assert tensors["model.visual.blocks.26.mlp.linear_fc1.weight"].shape == (4304, 1152)
    assert tensors["model.visual.merger.linear_fc1.weight"].shape == (4608, 4608)
    assert tensors["model.visual.merger.linear_fc2.weight"].shape == (2048, 4608)
    assert sum(math.prod(t.shape) for t in tensors.values()) == pytest.approx(4.3e8, rel=0.05)
