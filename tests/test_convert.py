"""lily.checkpoint.convert: Hugging Face -> MLX layout (docs/model.md sections 4 and 5) on the tiny synthetic checkpoint."""

import json
import shutil

import numpy as np
import pytest


from lily.checkpoint import convert
from lily.checkpoint import dtypes
from lily.checkpoint import quant
from lily.checkpoint import safetensors_io as sio
from lily.checkpoint import synthetic
from lily.checkpoint.tensors import is_router_gate
from checks import read_dir
from lily import errors

P = "language_model.model."
SMALL_VOCAB = {**synthetic.TINY_TEXT_CONFIG, "vocab_size": 1024}


def as_f32(entry) -> np.ndarray:
    return dtypes.decode_float(*entry)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return synthetic.make_checkpoint(tmp_path_factory.mktemp("hf"), "tiny", layout="hf", with_tokenizer=False)


@pytest.fixture(scope="module")
def mlx_dir(hf_dir, tmp_path_factory):
    return convert.convert_hf_to_mlx(hf_dir, tmp_path_factory.mktemp("mlx"))


def _quantized(shape_packed, shape_groups):
    groups = ("BF16", shape_groups)
    return {"weight": ("U32", shape_packed), "scales": groups, "biases": groups}


def _expected_tiny_layers() -> dict[str, tuple[str, tuple]]:
    """Spec 4.2 / 5 tables at the tiny dims: H=128, conv 256, value_dim 128, q_proj 512, E=8, I=64."""
    expected = {}

    def add(module, packed, groups):
        for part, spec in _quantized(packed, groups).items():
            expected[f"{module}.{part}"] = spec

    gdn, attn = P + "layers.0.", P + "layers.3."
    for layer in (gdn, attn):
        expected[layer + "input_layernorm.weight"] = ("BF16", (128,))
        expected[layer + "post_attention_layernorm.weight"] = ("BF16", (128,))
        add(layer + "mlp.gate", (8, 32), (8, 2))  # 8-bit
        add(layer + "mlp.shared_expert_gate", (1, 32), (1, 2))  # 8-bit
        add(layer + "mlp.shared_expert.gate_proj", (64, 16), (64, 2))
        add(layer + "mlp.shared_expert.up_proj", (64, 16), (64, 2))
        add(layer + "mlp.shared_expert.down_proj", (128, 8), (128, 1))
        add(layer + "mlp.switch_mlp.gate_proj", (8, 64, 16), (8, 64, 2))
        add(layer + "mlp.switch_mlp.up_proj", (8, 64, 16), (8, 64, 2))
        add(layer + "mlp.switch_mlp.down_proj", (8, 128, 8), (8, 128, 1))
    a = gdn + "linear_attn."
    add(a + "in_proj_qkv", (256, 16), (256, 2))
    add(a + "in_proj_z", (128, 16), (128, 2))
    add(a + "in_proj_b", (4, 16), (4, 2))
    add(a + "in_proj_a", (4, 16), (4, 2))
    add(a + "out_proj", (128, 16), (128, 2))
    expected[a + "conv1d.weight"] = ("BF16", (256, 4, 1))
    expected[a + "A_log"] = ("F32", (4,))
    expected[a + "dt_bias"] = ("BF16", (4,))
    expected[a + "norm.weight"] = ("BF16", (32,))
    s = attn + "self_attn."
    add(s + "q_proj", (512, 16), (512, 2))
    add(s + "k_proj", (128, 16), (128, 2))
    add(s + "v_proj", (128, 16), (128, 2))
    add(s + "o_proj", (128, 32), (128, 4))
    expected[s + "q_norm.weight"] = ("BF16", (64,))
    expected[s + "k_norm.weight"] = ("BF16", (64,))
    add(P + "embed_tokens", (248320, 16), (248320, 2))
    add("language_model.lm_head", (248320, 16), (248320, 2))
    expected[P + "norm.weight"] = ("BF16", (128,))
    return expected


def test_specs_match_spec_tables_at_tiny_dims():
    specs = convert.mlx_tensor_specs(synthetic.TINY_TEXT_CONFIG)
    expected = _expected_tiny_layers()
    for name, spec in expected.items():
        assert specs[name] == spec, name

    def layer_of(name):
        return name.split(".")[3] if name.startswith(P + "layers.") else None

    assert {n for n in specs if layer_of(n) in (None, "0", "3")} == set(expected)
    assert sum(layer_of(n) == "0" for n in specs) == 45  # spec: 45 tensors per GDN layer
    assert sum(layer_of(n) == "3" for n in specs) == 40  # and 40 per attention layer
    assert len(specs) == 3 * 45 + 40 + 7


def test_specs_match_spec_tables_at_real_dims():
    specs = convert.mlx_tensor_specs(synthetic.QWEN36_35B_A3B_TEXT_CONFIG)
    assert len(specs) == 1757  # spec 4.2: text tensors of mlx-community/Qwen3.6-35B-A3B-4bit
    table = {  # spec 5: packed weight and scales shapes
        P + "embed_tokens": ((248320, 256), (248320, 32)),
        "language_model.lm_head": ((248320, 256), (248320, 32)),
        P + "layers.0.linear_attn.in_proj_qkv": ((8192, 256), (8192, 32)),
        P + "layers.3.self_attn.q_proj": ((8192, 256), (8192, 32)),
        P + "layers.0.linear_attn.in_proj_z": ((4096, 256), (4096, 32)),
        P + "layers.0.linear_attn.in_proj_b": ((32, 256), (32, 32)),
        P + "layers.0.linear_attn.in_proj_a": ((32, 256), (32, 32)),
        P + "layers.0.linear_attn.out_proj": ((2048, 512), (2048, 64)),
        P + "layers.3.self_attn.o_proj": ((2048, 512), (2048, 64)),
        P + "layers.3.self_attn.k_proj": ((512, 256), (512, 32)),
        P + "layers.3.self_attn.v_proj": ((512, 256), (512, 32)),
        P + "layers.0.mlp.gate": ((256, 512), (256, 32)),
        P + "layers.0.mlp.shared_expert_gate": ((1, 512), (1, 32)),
        P + "layers.0.mlp.shared_expert.gate_proj": ((512, 256), (512, 32)),
        P + "layers.0.mlp.shared_expert.down_proj": ((2048, 64), (2048, 8)),
        P + "layers.0.mlp.switch_mlp.gate_proj": ((256, 512, 256), (256, 512, 32)),
        P + "layers.0.mlp.switch_mlp.up_proj": ((256, 512, 256), (256, 512, 32)),
        P + "layers.0.mlp.switch_mlp.down_proj": ((256, 2048, 64), (256, 2048, 8)),
    }
    for module, (packed, groups) in table.items():
        assert specs[module + ".weight"] == ("U32", packed), module
        assert specs[module + ".scales"] == specs[module + ".biases"] == ("BF16", groups), module
    assert specs[P + "layers.0.linear_attn.conv1d.weight"] == ("BF16", (8192, 4, 1))
    assert specs[P + "layers.39.self_attn.q_norm.weight"] == ("BF16", (256,))


def test_converted_files_match_specs(mlx_dir):
    tensors = read_dir(mlx_dir)
    specs = convert.mlx_tensor_specs(synthetic.TINY_TEXT_CONFIG)
    assert {n: (d, a.shape) for n, (d, a) in tensors.items()} == specs
    assert sio.SafetensorsFile(mlx_dir / "model.safetensors").metadata == {"format": "mlx"}


def test_quantization_block(hf_dir, mlx_dir):
    config = json.loads((mlx_dir / "config.json").read_text())
    expected = {"group_size": 64, "bits": 4, "mode": "affine"}
    for i in range(4):
        expected[f"{P}layers.{i}.mlp.gate"] = {"group_size": 64, "bits": 8}
        expected[f"{P}layers.{i}.mlp.shared_expert_gate"] = {"group_size": 64, "bits": 8}
    assert config["quantization"] == expected
    assert config["quantization_config"] == expected
    source = json.loads((hf_dir / "config.json").read_text())
    assert {k: v for k, v in config.items() if not k.startswith("quantization")} == source


def test_unquantized_fp32_conversion_is_an_exact_relayout(hf_dir, tmp_path):
    out = convert.convert_hf_to_mlx(hf_dir, tmp_path / "f32", quantize=False, dtype="float32")
    hf, mlx = read_dir(hf_dir), read_dir(out)
    assert "quantization" not in json.loads((out / "config.json").read_text())
    assert {d for d, _ in mlx.values()} == {"F32"}
    assert len(mlx) == len(hf) + 4  # each fused gate_up_proj became two stacks
    H = "model.language_model."
    for name, entry in hf.items():
        w = as_f32(entry)
        rest = name.removeprefix(H)
        if name == "lm_head.weight":
            np.testing.assert_array_equal(mlx["language_model.lm_head.weight"][1], w)
        elif rest.endswith("experts.gate_up_proj"):
            base = P + rest.removesuffix("experts.gate_up_proj") + "switch_mlp."
            np.testing.assert_array_equal(mlx[base + "gate_proj.weight"][1], w[:, :64])
            np.testing.assert_array_equal(mlx[base + "up_proj.weight"][1], w[:, 64:])
        elif rest.endswith("experts.down_proj"):
            np.testing.assert_array_equal(mlx[P + rest.replace("experts.", "switch_mlp.") + ".weight"][1], w)
        elif rest.endswith("conv1d.weight"):
            np.testing.assert_array_equal(mlx[P + rest][1], w.transpose(0, 2, 1))
        elif rest.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")) or rest == "norm.weight":
            np.testing.assert_array_equal(mlx[P + rest][1], w + np.float32(1))
        else:  # includes linear_attn.norm (plain w, never shifted), A_log and dt_bias
            np.testing.assert_array_equal(mlx[P + rest][1], w)


def test_unquantized_bf16_conversion(hf_dir, tmp_path):
    out = convert.convert_hf_to_mlx(hf_dir, tmp_path / "bf16", quantize=False)
    mlx = read_dir(out)
    a_logs = {P + f"layers.{i}.linear_attn.A_log" for i in range(3)}
    assert {n for n, (d, _) in mlx.items() if d != "BF16"} == a_logs
    hf_norm = as_f32(read_dir(hf_dir)["model.language_model.layers.3.self_attn.q_norm.weight"])
    shifted = dtypes.f32_to_bf16_bits(hf_norm + 1)  # 1 + w computed exactly, then rounded once
    np.testing.assert_array_equal(mlx[P + "layers.3.self_attn.q_norm.weight"][1], shifted)


def test_quantized_weights_reproduce_hf_weights(hf_dir, mlx_dir, tmp_path):
    hf, mlx = read_dir(hf_dir), read_dir(mlx_dir)
    floats = read_dir(convert.convert_hf_to_mlx(hf_dir, tmp_path, quantize=False, dtype="float32"))
    checked = 0
    for name, (dtype, packed) in mlx.items():
        if not name.endswith(".weight") or dtype != "U32":
            continue
        module = name.removesuffix(".weight")
        w = floats[name][1]
        bits = 8 if is_router_gate(module) else 4
        codes, scales, biases = quant.quantize(w, bits, 64)
        # Same codes as quantizing the bf16 weights directly; scales and biases narrowed to bf16.
        np.testing.assert_array_equal(packed, codes)
        np.testing.assert_array_equal(mlx[module + ".scales"][1], dtypes.f32_to_bf16_bits(scales))
        np.testing.assert_array_equal(mlx[module + ".biases"][1], dtypes.f32_to_bf16_bits(biases))
        s, b = as_f32(mlx[module + ".scales"]), as_f32(mlx[module + ".biases"])
        error = np.abs(quant.dequantize(packed, s, b, bits, 64) - w).reshape(*s.shape, 64)
        bound = 1.5 * np.abs(s) + 2.0**-8 * (np.abs(b) + ((1 << bits) - 1) * np.abs(s))
        assert np.all(error <= bound[..., None]), module
        relative = np.sqrt(np.mean(error**2) / np.mean(w**2))
        assert relative < (0.01 if bits == 8 else 0.15), (module, relative)
        checked += 1
    assert checked == 3 * 13 + 12 + 2  # per GDN layer 5 projections + 8 MoE; per attention layer 4 + 8
    assert len(hf) == 3 * 18 + 15 + 3


def test_dropped_tensors_and_tokenizer_files(hf_dir, mlx_dir, tmp_path):
    source = tmp_path / "with_extras"
    shutil.copytree(hf_dir, source)
    sio.save_file(source / "extras.safetensors", {
        "mtp.fc.weight": ("BF16", np.zeros((128, 256), np.uint16)),
        "mtp.layers.0.mlp.experts.gate_up_proj": ("BF16", np.zeros((8, 128, 128), np.uint16)),
    })
    (source / "tokenizer.json").write_text('{"tok": 1}')
    (source / "chat_template.jinja").write_text("{{ x }}")
    out = convert.convert_hf_to_mlx(source, tmp_path / "out")
    assert (out / "tokenizer.json").read_text() == '{"tok": 1}'
    assert (out / "chat_template.jinja").exists()
    assert (out / "model.safetensors").read_bytes() == (mlx_dir / "model.safetensors").read_bytes()


def test_checkpoint_saved_by_transformers_converts_the_same(tmp_path):
    import torch
    import transformers
    hf = synthetic.make_checkpoint(tmp_path / "hf", SMALL_VOCAB, layout="hf", with_tokenizer=False)
    loaded = transformers.Qwen3_5MoeForCausalLM.from_pretrained(hf, dtype=torch.bfloat16)
    # A model loaded from a checkpoint saves back in that checkpoint's layout; a fresh model saves
    # in transformers' own: CausalLM prefix `model.` and one tensor per expert (transformers 5.24).
    fresh = transformers.Qwen3_5MoeForCausalLM(loaded.config).to(torch.bfloat16)
    fresh.load_state_dict(loaded.state_dict())
    fresh.save_pretrained(tmp_path / "saved")
    saved_names = set(read_dir(tmp_path / "saved"))
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in saved_names
    assert not any(n.startswith("model.language_model.") or n.endswith("gate_up_proj") for n in saved_names)

    ours = read_dir(convert.convert_hf_to_mlx(hf, tmp_path / "a"))
    theirs = read_dir(convert.convert_hf_to_mlx(tmp_path / "saved", tmp_path / "b"))
    assert set(ours) == set(theirs)
    for name, (dtype, array) in ours.items():
        if name.endswith("A_log"):  # the bf16 model rounds A_log, which the real checkpoint keeps in fp32
            np.testing.assert_array_equal(theirs[name][1], dtypes.round_to("BF16", array))
        else:
            np.testing.assert_array_equal(theirs[name][1], array, err_msg=name)


def test_malformed_sources(hf_dir, mlx_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(hf_dir / "config.json", broken)
    tensors = read_dir(hf_dir)
    del tensors["model.language_model.layers.2.linear_attn.dt_bias"]
    sio.save_file(broken / "model.safetensors", tensors)
    with pytest.raises(errors.CheckpointError, match=r"broken.*missing.*layers\.2\.linear_attn\.dt_bias"):
        convert.convert_hf_to_mlx(broken, tmp_path / "out1")

    sio.save_file(broken / "more.safetensors", {"lm_head.weight": read_dir(hf_dir)["lm_head.weight"]})
    with pytest.raises(errors.CheckpointError, match="lm_head.weight.*another file"):
        convert.convert_hf_to_mlx(broken, tmp_path / "out2")

    with pytest.raises(errors.CheckpointError, match="already in MLX layout"):
        convert.convert_hf_to_mlx(mlx_dir, tmp_path / "out3")

    (broken / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(errors.ConfigError, match="llama"):
        convert.convert_hf_to_mlx(broken, tmp_path / "out4")


def test_other_group_sizes_and_bits():
    specs = convert.mlx_tensor_specs(synthetic.TINY_TEXT_CONFIG, bits=8, group_size=128)
    # Inputs of 64 do not divide into groups of 128: mlx-lm leaves those Linear layers unquantized.
    assert specs[P + "layers.0.mlp.shared_expert.down_proj.weight"] == ("BF16", (128, 64))
    assert specs[P + "layers.0.mlp.switch_mlp.down_proj.weight"] == ("BF16", (8, 128, 64))
    assert specs[P + "layers.0.linear_attn.in_proj_qkv.weight"] == ("U32", (256, 32))
    assert specs[P + "layers.0.linear_attn.in_proj_qkv.scales"] == ("BF16", (256, 1))
    assert specs[P + "layers.0.mlp.gate.scales"] == ("BF16", (8, 2))  # the gates keep group 64
    block = convert.quantization_config(synthetic.TINY_TEXT_CONFIG, bits=2, group_size=32)
    assert block[P + "layers.1.mlp.gate"] == {"group_size": 64, "bits": 8}
    assert convert.mlx_tensor_specs(synthetic.TINY_TEXT_CONFIG, bits=2, group_size=32)[
        P + "layers.3.self_attn.o_proj.scales"
    ] == ("BF16", (128, 8))


@pytest.mark.parametrize("bits,group_size", [(8, 32), (2, 128)])
def test_convert_other_settings(hf_dir, tmp_path, bits, group_size):
    out = convert.convert_hf_to_mlx(hf_dir, tmp_path / "o", bits=bits, group_size=group_size)
    tensors = read_dir(out)
    specs = convert.mlx_tensor_specs(synthetic.TINY_TEXT_CONFIG, bits=bits, group_size=group_size)
    assert {n: (d, a.shape) for n, (d, a) in tensors.items()} == specs
    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == bits


def test_quantize_at_load_is_the_converted_checkpoint(hf_dir, mlx_dir):
    # Model.load(float checkpoint, quantize=4) computes what `lily convert` writes, without the files
    import lily

    ids = [1, 2, 3, 40, 500, 77]
    at_load = lily.Model.load(hf_dir, device="cpu", quantize=4)
    converted = lily.Model.load(mlx_dir, device="cpu")
    assert at_load.layout == "hf" and at_load._engine.weight_bytes == converted._engine.weight_bytes
    np.testing.assert_array_equal(at_load.new_session().prefill(ids, all_logits=True),
                                  converted.new_session().prefill(ids, all_logits=True))
    eight = lily.Model.load(hf_dir, device="cpu", quantize=8)
    assert eight._engine.weight_bytes > at_load._engine.weight_bytes


@pytest.mark.parametrize("bad", [3, True, "4", 16])
def test_quantize_at_load_rejects_bad_values(hf_dir, bad):
    import lily

    with pytest.raises(lily.LilyError, match="quantize must be 4, 8 or None"):
        lily.Model.load(hf_dir, device="cpu", quantize=bad)


def test_quantize_at_load_refuses_a_quantized_checkpoint(mlx_dir):
    import lily

    with pytest.raises(lily.LilyError, match="quantize=4 applies to float"):
        lily.Model.load(mlx_dir, device="cpu", quantize=4)


# The vision tower (issue 17): copied as stored, under the names the loader reads in both layouts.

@pytest.fixture(scope="module")
def vision_dirs(tmp_path_factory):
    hf = synthetic.make_checkpoint(tmp_path_factory.mktemp("hfv"), "tiny", layout="hf", vision=True)
    # Small images stay small: 32 x 32 pixels at least (one merge block); the converter copies this file.
    (hf / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 1024, "max_pixels": 16384}))
    return hf, convert.convert_hf_to_mlx(hf, tmp_path_factory.mktemp("mlxv"))


def test_vision_tower_is_copied_as_stored(vision_dirs):
    hf, mlx = vision_dirs
    source, out = read_dir(hf), read_dir(mlx)
    visual = {n for n in source if n.startswith("model.visual.")}
    assert visual == set(convert.vision_tensor_shapes(json.loads((hf / "config.json").read_text())))
    assert visual == {n for n in out if n.startswith("model.visual.")}
    for name in visual:
        assert out[name][0] == source[name][0] == "BF16"
        np.testing.assert_array_equal(out[name][1], source[name][1], err_msg=name)
    assert set(out) - visual == set(convert.mlx_tensor_specs(synthetic.TINY_TEXT_CONFIG))
    assert (mlx / "preprocessor_config.json").read_text() == (hf / "preprocessor_config.json").read_text()
    config = json.loads((mlx / "config.json").read_text())
    assert config["vision_config"] == json.loads((hf / "config.json").read_text())["vision_config"]
    assert not any(k.startswith("model.visual") for k in config["quantization"])


def test_converted_tower_encodes_images_exactly_as_the_original(vision_dirs):
    import lily

    hf, mlx = vision_dirs
    original, converted = lily.Model.load(hf, device="cpu"), lily.Model.load(mlx, device="cpu")
    assert converted.config.vision == original.config.vision is not None
    signature = converted._engine.weight_signature().splitlines()
    assert any(line.startswith("visual.") for line in signature)
    assert not [line for line in signature if line.startswith("visual.") and "affine" in line]
    pixels = np.random.default_rng(1).uniform(-1, 1, (24 + 8, 1536)).astype(np.float32)
    grids = np.array([[1, 4, 6], [1, 2, 4]], np.int32)
    np.testing.assert_array_equal(converted._engine.encode_images(pixels, grids),
                                  original._engine.encode_images(pixels, grids))


def test_converted_checkpoint_answers_an_image_prompt_as_the_original(vision_dirs):
    """The converted (4-bit) checkpoint against the original quantized at load, which equals it."""
    import lily

    hf, mlx = vision_dirs
    image = np.random.default_rng(2).integers(0, 256, (48, 80, 3), dtype=np.uint8)
    messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": "What is this?"}]}]
    answers = []
    for model in (lily.Model.load(hf, device="cpu", quantize=4), lily.Model.load(mlx, device="cpu")):
        r = model.chat(messages, temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
        answers.append((r.token_ids, [lp.logprob for lp in r.logprobs], r.usage.prompt_tokens))
    assert answers[0] == answers[1]


def test_incomplete_or_unexpected_vision_tensors_are_refused(vision_dirs, tmp_path):
    hf, _ = vision_dirs
    tensors = read_dir(hf)
    broken = tmp_path / "incomplete"
    broken.mkdir()
    shutil.copy(hf / "config.json", broken)
    sio.save_file(broken / "model.safetensors",
                  {n: t for n, t in tensors.items() if n != "model.visual.blocks.1.attn.qkv.bias"})
    with pytest.raises(errors.CheckpointError,
                       match=r"missing tensor 'model\.visual\.blocks\.1\.attn\.qkv\.bias' \(the vision tower is incomplete\)"):
        convert.convert_hf_to_mlx(broken, tmp_path / "out1")

    config = json.loads((hf / "config.json").read_text())
    del config["vision_config"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(errors.CheckpointError, match="holds vision tensors .* but config.json has no vision_config"):
        convert.convert_hf_to_mlx(broken, tmp_path / "out2")

    shutil.copy(hf / "config.json", broken)
    wrong = dict(tensors, **{"model.visual.pos_embed.weight": ("BF16", np.zeros((3, 64), np.uint16))})
    sio.save_file(broken / "model.safetensors", wrong)
    with pytest.raises(errors.CheckpointError, match=r"model\.visual\.pos_embed\.weight is BF16 \(3, 64\), expected"):
        convert.convert_hf_to_mlx(broken, tmp_path / "out3")

    integer = dict(tensors, **{"model.visual.pos_embed.weight": ("I32", np.zeros((64, 64), np.int32))})
    sio.save_file(broken / "model.safetensors", integer)
    with pytest.raises(errors.CheckpointError, match=r"'model\.visual\.pos_embed\.weight': dtype I32"):
        convert.convert_hf_to_mlx(broken, tmp_path / "out4")


def test_mlx_checkpoint_with_an_incomplete_tower_is_refused_at_load(vision_dirs, tmp_path):
    import lily

    _, mlx = vision_dirs
    shutil.copy(mlx / "config.json", tmp_path)
    sio.save_file(tmp_path / "model.safetensors",
                  {n: t for n, t in read_dir(mlx).items() if n != "model.visual.merger.linear_fc1.weight"})
    with pytest.raises(errors.CheckpointError, match="missing tensor 'model.visual.merger.linear_fc1.weight'"):
        lily.Model.load(tmp_path, device="cpu")
