"""Random Qwen3.5/3.6 MoE checkpoints with the real file layout, for tests and benchmarks.

`make_checkpoint` writes config.json (the real nested form), the weights in Hugging Face layout
(bf16, `model.language_model.*`, fused experts, conv [C, 1, K], norms stored as w) or in MLX layout
(byte-compatible with mlx-lm: 4-bit group-64 affine, 8-bit router gates; docs/model.md sections 4-5), and
optionally the real tokenizer files.

Conditioning. The weights are random but chosen so that a forward pass stays finite and its logits
are informative, also at the real dims and depth (40 layers):
  - embeddings ~ N(0, 1): the residual stream starts at unit RMS;
  - projections reading a normalised input (q/k/v, in_proj_*, expert gate/up, shared-expert gate)
    ~ N(0, 1/in): their outputs have unit variance;
  - projections writing into the residual stream (out_proj, o_proj, expert and shared down_proj)
    ~ N(0, 1/(in * 2L)): each of the 2L sublayers adds a few percent to the residual stream (its
    RMS grows from 1.0 to ~1.14 over 40 tiny layers), so depth never blows it up, yet every layer
    visibly moves the logits;
  - router ~ N(0, (3/sqrt(in))^2): logits of std ~3 give clear top-k margins, not near ties;
  - lm_head ~ N(0, (4/sqrt(in))^2): logits of std ~4, i.e. peaked next-token distributions;
  - zero-centred norms (applied as 1 + w): w with std 0.1 around 0; the gated norm: std 0.1 around 1;
  - conv1d ~ N(0, 1/K); A_log = log U[1, 16] (fp32); dt_bias = softplus^-1(dt), dt log-uniform on
    [1e-3, 1e-1] (Mamba's init), so the per-step decay exp(-exp(A_log) dt) spans ~0.2..0.999 and
    some heads keep a long memory.
Every tensor has its own random stream, seeded from (seed, tensor name), so results do not depend
on the order or thread in which tensors are generated.

The vision tower (``vision=True``; docs/model.md section 8) is drawn the same
way: matrices reading a LayerNorm'd input (qkv, fc1, the merger's two) and the patch embedding ~ N(0, 1/in);
the blocks' attn.proj and fc2, writing into the ViT residual stream, ~ N(0, 1/(in * 2 depth)); the
position table ~ N(0, 0.5^2); LayerNorm weights 1 + 0.1 N, their biases and every linear bias 0.1 N, so the
merged tokens reach the text model at about unit RMS, like its embeddings. Both layouts store it the same
way, bf16 under ``model.visual.*`` (the MLX one as `lily convert` writes it: copied, never quantized).

Two ways to make the MLX layout. Small models draw float weights as above, round them to bf16 and
quantize them with `lily.checkpoint.quant` exactly as `convert_hf_to_mlx` would (so the MLX checkpoint equals the
conversion of the HF one with the same seed). Big models (the full 35B-A3B is 19.5 GB) skip the
floats: their packed codes are raw random bits (codes uniform on 0..2^b-1, mean m = (2^b-1)/2, std
s_q = sqrt((4^b-1)/12), 4.61 for 4 bits) and each group draws scale = std/s_q * (1 + U(-0.1, 0.1))
and bias = -scale * (m + U(-0.25, 0.25)), so the dequantized weights have the intended std and
~zero mean, like the quantized floats.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import zlib
from collections.abc import Mapping
from functools import partial
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from .convert import (
    MLX_PREFIX,
    hf_tensor_shapes,
    hf_to_mlx_tensors,
    mlx_float_shapes,
    quantization_config,
    read_config,
    text_config_of,
    vision_tensor_shapes,
    write_mlx_config,
)
from .dtypes import encode_float, f32_to_bf16_bits
from .safetensors_io import DEFAULT_SHARD_SIZE, LazyTensor, save_sharded
from .tensors import is_zero_centred_norm, quantization_of


# generation_config.json's max_new_tokens in synthetic checkpoints: the default max_tokens of lily's
# API, CLI and server, so that random weights (which rarely sample an end token) finish in seconds.
SYNTHETIC_MAX_NEW_TOKENS = 32


def _text_config(**dims: object) -> dict:
    num_layers = dims["num_hidden_layers"]
    return {
        "model_type": "qwen3_5_moe_text",
        **dims,
        "layer_types": _layer_types(num_layers),
        "full_attention_interval": 4,
        "attn_output_gate": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "linear_conv_kernel_dim": 4,
        "mamba_ssm_dtype": "float32",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "vocab_size": 248320,
        "tie_word_embeddings": False,
        "max_position_embeddings": 262144,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        "partial_rotary_factor": 0.25,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "bos_token_id": 248044,
        "eos_token_id": 248044,
        "pad_token_id": None,
        "dtype": "bfloat16",
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
        "use_cache": True,
        "initializer_range": 0.02,
    }


def _layer_types(num_layers: int) -> list[str]:
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)]


# Exercises every tensor kind and quantizes at group 64; the vocabulary is the real one so the real
# tokenizer works with it.
TINY_TEXT_CONFIG = _text_config(
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
)

# docs/model.md section 1.
QWEN36_35B_A3B_TEXT_CONFIG = _text_config(
    hidden_size=2048,
    num_hidden_layers=40,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    num_experts=256,
    num_experts_per_tok=8,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
)

CONFIGS = {"tiny": TINY_TEXT_CONFIG, "qwen3.6-35b-a3b": QWEN36_35B_A3B_TEXT_CONFIG}


def _vision_config(**dims: object) -> dict:
    return {"model_type": "qwen3_5_moe", "hidden_act": "gelu_pytorch_tanh", "in_channels": 3, "patch_size": 16,
            "temporal_patch_size": 2, "spatial_merge_size": 2, "deepstack_visual_indexes": [],
            "initializer_range": 0.02, **dims}


# The vision tower of each preset: the real one (Qwen3.6-35B-A3B's vision_config), and a tiny one with the
# real patch geometry (16-pixel patches, 2x2 merge) so real images run through it.
VISION_CONFIGS = {
    "tiny": _vision_config(depth=2, hidden_size=64, intermediate_size=96, num_heads=4,
                           num_position_embeddings=64, out_hidden_size=TINY_TEXT_CONFIG["hidden_size"]),
    "qwen3.6-35b-a3b": _vision_config(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                                      num_position_embeddings=2304, out_hidden_size=2048),
}
POS_EMBED_STD = 0.5
VISION_BIAS_STD = 0.1

# Models with more weights than this get their MLX codes drawn directly (see the module docstring).
DIRECT_CODES_MIN_PARAMS = 1_000_000_000

LOGIT_STD = 4.0
ROUTER_LOGIT_STD = 3.0
NORM_STD = 0.1
SCALE_JITTER = 0.1
BIAS_JITTER = 0.25


def full_config(text_config: Mapping, vision_config: Mapping | None = None) -> dict:
    """The nested config.json of a Qwen3.6 MoE checkpoint around `text_config`, with `vision_config`
    when given."""
    vision = {"vision_config": dict(vision_config)} if vision_config is not None else {}
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "dtype": "bfloat16",
        "image_token_id": 248056,
        "video_token_id": 248057,
        "vision_start_token_id": 248053,
        "vision_end_token_id": 248054,
        "tie_word_embeddings": bool(text_config.get("tie_word_embeddings", False)),
        "text_config": dict(text_config),
        **vision,
    }


def vision_tensors(text_config: Mapping, vision_config: Mapping, seed: int = 0) -> dict[str, LazyTensor]:
    """The vision tower's tensors in the Hugging Face layout (``model.visual.*``, bf16), lazily drawn
    (see the module docstring); names and shapes from the core's table."""
    config = full_config({**text_config, "model_type": "qwen3_5_moe_text"}, vision_config)
    depth = vision_config["depth"]
    return {name: LazyTensor("BF16", shape, partial(_vision_value, name, shape, depth, seed))
            for name, shape in vision_tensor_shapes(config).items()}


def _vision_value(name: str, shape: tuple[int, ...], depth: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(_seed_sequence(seed, name))
    normal = rng.standard_normal(shape, dtype=np.float32)
    if name.endswith("pos_embed.weight"):
        values = POS_EMBED_STD * normal
    elif name.endswith(".bias"):
        values = VISION_BIAS_STD * normal
    elif ".norm" in name:  # LayerNorm weights: norm1, norm2, merger.norm
        values = 1 + NORM_STD * normal
    elif name.endswith(("attn.proj.weight", "mlp.linear_fc2.weight")):
        values = normal / np.float32(math.sqrt(math.prod(shape[1:]) * 2 * depth))
    else:  # in = the product of the trailing dims (C*tp*p*p for the Conv3d patch embedding)
        values = normal / np.float32(math.sqrt(math.prod(shape[1:])))
    return f32_to_bf16_bits(values)


def resolve_text_config(config: str | os.PathLike | Mapping, num_layers: int | None = None) -> dict:
    """A text config from a preset name, a config.json path or a dict (nested or flat), optionally
    cut or extended to `num_layers` layers (every 4th one full attention)."""
    if isinstance(config, Mapping):
        text_config = text_config_of(config)
    elif str(config) in CONFIGS:
        text_config = dict(CONFIGS[str(config)])
    elif Path(config).is_file():
        text_config = text_config_of(read_config(config))
    else:
        raise ConfigError(f"config {config!r} is neither one of {sorted(CONFIGS)} nor a config.json file")
    if num_layers is not None:
        if num_layers < 1:
            raise ConfigError(f"num_layers={num_layers} must be at least 1")
        text_config["num_hidden_layers"] = num_layers
        text_config["layer_types"] = _layer_types(num_layers)
    return text_config


def _seed_sequence(seed: int, name: str) -> np.random.SeedSequence:
    return np.random.SeedSequence([seed, zlib.crc32(name.encode())])


def weight_std(name: str, in_features: int, text_config: Mapping) -> float:
    """Standard deviation of weight matrix `name` (HF or MLX name) with `in_features` inputs; see the
    module docstring."""
    if name.endswith("embed_tokens.weight"):
        return 1.0
    if name.endswith("lm_head.weight"):
        return LOGIT_STD / math.sqrt(in_features)
    if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight", "experts.down_proj")):
        return 1.0 / math.sqrt(in_features * 2 * text_config["num_hidden_layers"])
    if name.endswith("mlp.gate.weight"):
        return ROUTER_LOGIT_STD / math.sqrt(in_features)
    return 1.0 / math.sqrt(in_features)


def _sample(name: str, shape: tuple[int, ...], text_config: Mapping, seed: int) -> np.ndarray:
    """Float32 values of tensor `name` as Hugging Face stores it (norms as w, not 1 + w)."""
    rng = np.random.default_rng(_seed_sequence(seed, name))
    if name.endswith("A_log"):
        return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
    if name.endswith("dt_bias"):
        dt = np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), shape))
        return (dt + np.log(-np.expm1(-dt))).astype(np.float32)  # softplus(dt_bias) == dt
    normal = rng.standard_normal(shape, dtype=np.float32)
    if name.endswith("conv1d.weight"):
        return normal / np.float32(math.sqrt(text_config["linear_conv_kernel_dim"]))
    if name.endswith("linear_attn.norm.weight"):
        return 1 + NORM_STD * normal
    if name.endswith("norm.weight"):
        return NORM_STD * normal
    return normal * np.float32(weight_std(name, shape[-1], text_config))


def _hf_value(name: str, shape: tuple[int, ...], text_config: Mapping, seed: int, dtype: str) -> np.ndarray:
    return encode_float(dtype, _sample(name, shape, text_config, seed))


def hf_tensors(text_config: Mapping, seed: int = 0) -> dict[str, LazyTensor]:
    """The Hugging Face layout's tensors (bf16; A_log fp32 as in the real checkpoint), lazily drawn."""
    tensors = {}
    for name, shape in hf_tensor_shapes(text_config).items():
        dtype = "F32" if name.endswith("A_log") else "BF16"
        tensors[name] = LazyTensor(dtype, shape, partial(_hf_value, name, shape, text_config, seed, dtype))
    return tensors


def _direct_codes(seed: int, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Uniformly random packed codes: every bit of every uint32 word is a fair coin. [*shape] uint32"""
    count = math.prod(shape)
    raw = np.random.SFC64(_seed_sequence(seed, name)).random_raw((count + 1) // 2)
    return raw.view(np.uint32)[:count].reshape(shape)


def _direct_scales_biases(seed: int, module: str, std: float, bits: int, shape: tuple[int, ...]):
    """(scales, biases) bf16 bits [*shape] for uniform codes, so that scale * q + bias has std `std`."""
    bit_generator = np.random.SFC64(_seed_sequence(seed, module + ".scales"))
    rng = np.random.Generator(bit_generator)
    levels = (1 << bits) - 1
    code_mean, code_std = levels / 2, math.sqrt(((levels + 1) ** 2 - 1) / 12)
    # Groups pick (scale, bias) pairs from a pool: a gather is much cheaper than fresh draws per group.
    pool = 1 << 16
    scale = std / code_std * (1 + SCALE_JITTER * rng.uniform(-1, 1, pool))
    bias = -scale * (code_mean + BIAS_JITTER * rng.uniform(-1, 1, pool))
    count = math.prod(shape)
    pick = bit_generator.random_raw((count + 3) // 4).view(np.uint16)[:count].reshape(shape)
    return f32_to_bf16_bits(scale)[pick], f32_to_bf16_bits(bias)[pick]


def _mlx_float_value(name: str, shape: tuple[int, ...], text_config: Mapping, seed: int, dtype: str):
    values = _sample(name, shape, text_config, seed)
    shifted = is_zero_centred_norm(name.removeprefix(MLX_PREFIX))
    return encode_float(dtype, values + np.float32(1.0) if shifted else values)


def direct_mlx_tensors(text_config: Mapping, seed: int = 0) -> dict[str, LazyTensor]:
    """The MLX layout's tensors (4-bit g64, 8-bit gates) with codes, scales and biases drawn directly."""
    tensors: dict[str, LazyTensor] = {}
    for name, shape in mlx_float_shapes(text_config).items():
        q = quantization_of(name, shape[-1], 4, 64)
        if q is None:
            dtype = "F32" if name.endswith(".A_log") else "BF16"
            value = partial(_mlx_float_value, name, shape, text_config, seed, dtype)
            tensors[name] = LazyTensor(dtype, shape, value)
            continue
        q_bits, q_group = q
        module = name.removesuffix(".weight")
        std = weight_std(name, shape[-1], text_config)
        packed = (*shape[:-1], shape[-1] * q_bits // 32)
        grouped = (*shape[:-1], shape[-1] // q_group)
        pair = partial(_direct_scales_biases, seed, module, std, q_bits, grouped)
        tensors[name] = LazyTensor("U32", packed, partial(_direct_codes, seed, name, packed))
        tensors[module + ".scales"] = LazyTensor("BF16", grouped, lambda pair=pair: pair()[0])
        tensors[module + ".biases"] = LazyTensor("BF16", grouped, lambda pair=pair: pair()[1])
    return tensors


def make_checkpoint(
    path: str | os.PathLike,
    config: str | os.PathLike | Mapping = "tiny",
    layout: str = "mlx",
    seed: int = 0,
    with_tokenizer: bool = True,
    *,
    num_layers: int | None = None,
    shard_size: int = DEFAULT_SHARD_SIZE,
    direct_codes: bool | None = None,
    workers: int | None = None,
    vision: bool | Mapping = False,
) -> Path:
    """Write a random checkpoint into directory `path` and return it.

    config: "tiny", "qwen3.6-35b-a3b", a config.json path or a config dict; num_layers overrides its
    depth. layout: "mlx" (4-bit g64, 8-bit gates) or "hf" (bf16). direct_codes: draw MLX codes
    directly instead of quantizing floats; default when the model has more than 1e9 weights.
    Shards of at most `shard_size` bytes, with model.safetensors.index.json when there are several.
    vision: add the preset's vision tower (`VISION_CONFIGS`; "tiny" for a config file or dict) to
    config.json and its weights (bf16, `model.visual.*`, also in the MLX layout, as `lily convert` writes);
    a mapping adds that tower with these keys replaced (e.g. {"depth": 3, "hidden_size": 1152, ...}).
    """
    if layout not in ("mlx", "hf"):
        raise ValueError(f"layout {layout!r} is not 'mlx' or 'hf'")
    if direct_codes and layout == "hf":
        raise ValueError("direct_codes applies to the quantized MLX layout only")
    text_config = resolve_text_config(config, num_layers)
    vision_config = None
    if vision or isinstance(vision, Mapping):
        preset = str(config) if isinstance(config, (str, os.PathLike)) and str(config) in VISION_CONFIGS else "tiny"
        overrides = dict(vision) if isinstance(vision, Mapping) else {}
        vision_config = {**VISION_CONFIGS[preset], **overrides, "out_hidden_size": text_config["hidden_size"]}
    path = Path(path)
    vision = vision_tensors(text_config, vision_config, seed) if vision_config is not None else {}
    if layout == "hf":
        tensors = {**hf_tensors(text_config, seed), **vision}
    else:
        if direct_codes is None:
            num_params = sum(math.prod(s) for s in hf_tensor_shapes(text_config).values())
            direct_codes = num_params > DIRECT_CODES_MIN_PARAMS
        if direct_codes:
            tensors = {**direct_mlx_tensors(text_config, seed), **vision}
        else:
            tensors = hf_to_mlx_tensors({**hf_tensors(text_config, seed), **vision})

    metadata = {"format": "mlx" if layout == "mlx" else "pt"}
    workers = workers or os.cpu_count() or 1
    save_sharded(path, tensors, shard_size=shard_size, metadata=metadata, workers=workers)
    if layout == "hf":
        (path / "config.json").write_text(json.dumps(full_config(text_config, vision_config), indent=2) + "\n")
    else:
        write_mlx_config(path, full_config(text_config, vision_config), quantization_config(text_config))
    if with_tokenizer:
        from ..tokenizer_files import write_tokenizer_files

        write_tokenizer_files(path, max_new_tokens=SYNTHETIC_MAX_NEW_TOKENS)
    return path


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `lily make-checkpoint`."""
    parser.add_argument("path", type=Path, help="output directory")
    parser.add_argument("--config", default="tiny", help="tiny | qwen3.6-35b-a3b | path/to/config.json")
    parser.add_argument("--layout", choices=("mlx", "hf"), default="mlx", help="mlx (4-bit) or hf (bf16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    parser.add_argument("--no-tokenizer", action="store_true", help="skip the tokenizer files")
    parser.add_argument("--vision", action="store_true",
                        help="add the preset's vision tower (bf16 weights, never quantized, in either layout)")
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty folder (default: refuse)")


def run_cli(args: argparse.Namespace) -> int:
    """Run `lily make-checkpoint` with parsed `args`; returns the exit status."""
    from ..errors import LilyError

    out = Path(args.path)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.overwrite:
        raise LilyError(f"{out} exists and is not an empty folder; use --overwrite to write into it anyway "
                        f"(as 'lily convert' does)")
    path = make_checkpoint(
        args.path, args.config, args.layout, args.seed, not args.no_tokenizer, num_layers=args.layers,
        vision=args.vision,
    )
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(f"wrote {path} ({size / 1e9:.2f} GB of weights)")
    return 0
