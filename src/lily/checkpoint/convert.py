"""Hugging Face -> MLX checkpoint conversion for Qwen3.5/3.6 MoE text models, as mlx-lm writes it.

Accepted sources (docs/model.md section 4.2, and what transformers 5.24 `save_pretrained` writes):
  - prefix `model.language_model.` (multimodal class) or `model.` (Qwen3_5MoeForCausalLM), `lm_head.`;
  - experts fused (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) or
    per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`, what transformers 5.24 saves);
  - `mtp.*` is dropped; the vision tower (`model.visual.*`) is copied as stored: same names (the
    loader reads the tower under them in either layout), float dtype and shapes, never quantized, and
    `preprocessor_config.json` with it. A source without the tower converts text-only.
The MLX layout (docs/model.md sections 4.2 and 5): names `language_model.model.*` / `language_model.lm_head.*`,
experts as `mlp.switch_mlp.{gate,up,down}_proj` stacks, conv1d weight [C, K, 1], zero-centred norms
stored as 1 + w (not `linear_attn.norm`), A_log in fp32, the rest in bf16. Quantized, every
Linear / Embedding / SwitchLinear weight whose input dim divides by the group size becomes
`weight` (uint32 codes) + `scales` + `biases`; the router `mlp.gate` and `mlp.shared_expert_gate`
use 8 bits, group 64 (mlx-lm's `quant_predicate` for this model). Names, shapes and that rule come
from `lily.checkpoint.tensors`.

As in mlx-lm, weights are first rounded to the output float dtype and then quantized, so a bf16
source converts byte-exactly to what MLX's CPU `quantize` would produce.
"""

from __future__ import annotations

import argparse

import json
import os
import re
import shutil
import threading
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from ..errors import CheckpointError, ConfigError
from . import quant
from .config import parse_config
from .dtypes import FLOAT_DTYPE_NAMES, LOADABLE_FLOAT_DTYPES, decode_float, encode_float, round_to
from .safetensors_io import DEFAULT_SHARD_SIZE, LazyTensor, SafetensorsFile, find_shards, save_sharded
from .tensors import (
    ROUTER_GATE_QUANTIZATION,
    VISION_PREFIX,
    is_router_gate,
    is_vision,
    is_zero_centred_norm,
    model_tensors,
    quantization_of,
    stored_name,
    vision_stored_name,
)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
COPIED_FILES = (*TOKENIZER_FILES, "preprocessor_config.json")
HF_PREFIX = "model.language_model."
MLX_PREFIX = "language_model.model."
MLX_LM_HEAD = "language_model.lm_head.weight"

_DROPPED_PREFIXES = ("mtp.",)
_SOURCE_PREFIXES = (HF_PREFIX, "model.")
_PER_EXPERT = re.compile(r"(.*\.mlp)\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_FLOAT_SOURCES = ("BF16", "F16", "F32", "F64")


def read_config(path: str | os.PathLike) -> dict:
    """Load a config.json as a dict; ConfigError naming the file if it is unreadable."""
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot read config: {e}") from e
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: config is not a JSON object")
    return config


def text_config_of(config: Mapping) -> dict:
    """The text hyper-parameters: `text_config` of a nested `qwen3_5_moe` config, or a flat
    `qwen3_5_moe_text` config itself."""
    model_type = config.get("model_type")
    if model_type == "qwen3_5_moe" and isinstance(config.get("text_config"), Mapping):
        return dict(config["text_config"])
    if model_type == "qwen3_5_moe_text":
        return dict(config)
    raise ConfigError(f"model_type {model_type!r} is not qwen3_5_moe (with text_config) or qwen3_5_moe_text")


def hf_tensor_shapes(text_config: Mapping) -> dict[str, tuple[int, ...]]:
    """Every text tensor of the Hugging Face checkpoint (spec 4.1 names: `model.language_model.`
    prefix, fused experts) -> its shape."""
    config = parse_config({**text_config, "model_type": "qwen3_5_moe_text"}, "text config")
    shapes = {}
    for spec in model_tensors(config):
        if spec.name == "lm_head":
            if not text_config.get("tie_word_embeddings", False):
                shapes["lm_head.weight"] = spec.shape
        elif spec.name.endswith("experts.gate_proj"):
            E, I, H = spec.shape
            shapes[HF_PREFIX + spec.name.removesuffix("gate_proj") + "gate_up_proj"] = (E, 2 * I, H)
        elif spec.name.endswith("experts.down_proj"):
            shapes[HF_PREFIX + spec.name] = spec.shape
        elif spec.name.endswith("conv1d"):
            C, K = spec.shape
            shapes[HF_PREFIX + stored_name(spec.name)] = (C, 1, K)
        elif not spec.name.endswith("experts.up_proj"):  # the up stack is the second half of gate_up_proj
            shapes[HF_PREFIX + stored_name(spec.name)] = spec.shape
    return shapes


def vision_tensor_shapes(config: Mapping) -> dict[str, tuple[int, ...]]:
    """The vision tower's stored tensors (`model.visual.*`, the same in both layouts) -> shapes for
    config.json's `vision_config` (empty without one); the patch embedding is the Conv3d [W, C, tp, p, p]."""
    cfg = parse_config(dict(config), "config.json")
    v = cfg.vision
    shapes = {}
    for spec in model_tensors(cfg) if v is not None else ():
        if is_vision(spec.name):
            conv3d = (spec.shape[0], v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
            shapes[vision_stored_name(spec.name)] = conv3d if spec.name == "visual.patch_embed.proj" else spec.shape
    return shapes


def _mlx_name(hf_name: str) -> str:
    if hf_name == "lm_head.weight":
        return MLX_LM_HEAD
    if hf_name.startswith("language_model."):
        raise CheckpointError(f"tensor {hf_name!r} is already in MLX layout")
    for prefix in _SOURCE_PREFIXES:
        if hf_name.startswith(prefix):
            return MLX_PREFIX + hf_name[len(prefix) :]
    raise CheckpointError(f"tensor {hf_name!r} is not a Qwen3.5/3.6 MoE text tensor")


def _sliced(t: LazyTensor, rows: slice) -> LazyTensor:
    shape = (t.shape[0], len(range(t.shape[1])[rows]), *t.shape[2:])
    return LazyTensor(t.dtype, shape, lambda: t.load()[:, rows])


def _conv_to_mlx(name: str, t: LazyTensor) -> LazyTensor:
    if len(t.shape) != 3 or t.shape[1] != 1:
        raise CheckpointError(f"tensor {name!r}: conv1d weight {t.shape} is not Hugging Face [C, 1, K]")
    return LazyTensor(t.dtype, (t.shape[0], t.shape[2], 1), lambda: np.moveaxis(t.load(), 2, 1))


def _stacked(name: str, experts: dict[int, LazyTensor]) -> LazyTensor:
    num = len(experts)
    if sorted(experts) != list(range(num)):
        raise CheckpointError(f"{name}: expert indices {sorted(experts)} are not 0..{num - 1}")
    first = experts[0]
    if any(t.shape != first.shape or t.dtype != first.dtype for t in experts.values()):
        raise CheckpointError(f"{name}: experts differ in shape or dtype")
    return LazyTensor(
        first.dtype, (num, *first.shape), lambda: np.stack([experts[e].load() for e in range(num)])
    )


def mlx_float_tensors(hf: Mapping[str, LazyTensor]) -> dict[str, LazyTensor]:
    """Rename Hugging Face tensors to MLX names and layouts, still unquantized and in source dtype:
    experts split or stacked into `switch_mlp` stacks, conv1d [C, 1, K] -> [C, K, 1]; mtp dropped, the
    vision tower's tensors passed through under their own names."""
    out: dict[str, LazyTensor] = {}
    per_expert: dict[str, dict[int, LazyTensor]] = {}
    for hf_name, t in hf.items():
        if hf_name.startswith(_DROPPED_PREFIXES):
            continue
        if hf_name.startswith(VISION_PREFIX):
            out[hf_name] = t
            continue
        name = _mlx_name(hf_name)
        if m := _PER_EXPERT.fullmatch(name):
            per_expert.setdefault(f"{m[1]}.switch_mlp.{m[3]}_proj.weight", {})[int(m[2])] = t
        elif name.endswith(".mlp.experts.gate_up_proj"):
            base = name.removesuffix("experts.gate_up_proj") + "switch_mlp."
            half = t.shape[-2] // 2  # rows [0, I) are the gate projection, [I, 2I) the up projection
            out[base + "gate_proj.weight"] = _sliced(t, slice(0, half))
            out[base + "up_proj.weight"] = _sliced(t, slice(half, None))
        elif name.endswith(".mlp.experts.down_proj"):
            out[name.removesuffix("experts.down_proj") + "switch_mlp.down_proj.weight"] = t
        elif name.endswith(".conv1d.weight"):
            out[name] = _conv_to_mlx(name, t)
        else:
            out[name] = t
    for name, experts in per_expert.items():
        out[name] = _stacked(name, experts)
    return out


def mlx_float_shapes(text_config: Mapping) -> dict[str, tuple[int, ...]]:
    """MLX tensor names -> shapes before quantization, for this text config."""
    placeholders = {n: LazyTensor("BF16", s, lambda: None) for n, s in hf_tensor_shapes(text_config).items()}
    return {name: t.shape for name, t in mlx_float_tensors(placeholders).items()}


def quantization_config(text_config: Mapping, bits: int = 4, group_size: int = 64) -> dict:
    """The config.json "quantization" block: defaults plus one entry per 8-bit gate module path."""
    block: dict = {"group_size": group_size, "bits": bits, "mode": "affine"}
    for name, shape in mlx_float_shapes(text_config).items():
        module = name.removesuffix(".weight")
        if is_router_gate(module) and quantization_of(name, shape[-1], bits, group_size):
            block[module] = dict(ROUTER_GATE_QUANTIZATION)
    return block


def mlx_tensor_specs(
    text_config: Mapping,
    *,
    bits: int = 4,
    group_size: int = 64,
    quantize: bool = True,
    dtype: str = "bfloat16",
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor of the MLX checkpoint -> (safetensors dtype, shape): weight U32
    [..., in*bits/32] and scales/biases [..., in/group] for quantized modules."""
    float_dtype = FLOAT_DTYPE_NAMES[dtype]
    specs: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, shape in mlx_float_shapes(text_config).items():
        q = quantize and quantization_of(name, shape[-1], bits, group_size)
        if q:
            q_bits, q_group = q
            module = name.removesuffix(".weight")
            specs[module + ".weight"] = ("U32", (*shape[:-1], shape[-1] * q_bits // 32))
            specs[module + ".scales"] = (float_dtype, (*shape[:-1], shape[-1] // q_group))
            specs[module + ".biases"] = (float_dtype, (*shape[:-1], shape[-1] // q_group))
        else:
            specs[name] = ("F32" if name.endswith(".A_log") else float_dtype, shape)
    return specs


class _QuantizedModule:
    """One weight quantized once, handed out as its three tensors (thread-safe, each taken once)."""

    def __init__(self, source: LazyTensor, float_dtype: str, bits: int, group_size: int):
        self.source, self.float_dtype, self.bits, self.group_size = source, float_dtype, bits, group_size
        self._lock = threading.Lock()
        self._parts: dict[str, np.ndarray] = {}

    def take(self, part: str) -> np.ndarray:
        with self._lock:
            if part not in self._parts:
                self._parts = self._quantize()
            return self._parts.pop(part)

    def _quantize(self) -> dict[str, np.ndarray]:
        stored = self.source.load()  # [..., rows, n]
        *lead, rows, n = self.source.shape
        weight = np.empty((*lead, rows, n * self.bits // 32), dtype=np.uint32)
        scales = np.empty((*lead, rows, n // self.group_size), dtype=np.float32)
        biases = np.empty_like(scales)
        # Decode block by block so a [256, 512, 2048] expert stack never exists in fp32 at once.
        step = max(1, (1 << 20) // n)
        for idx in np.ndindex(*lead):
            for r in range(0, rows, step):
                block = round_to(self.float_dtype, decode_float(self.source.dtype, stored[idx][r : r + step]))
                out = quant.quantize(block, self.bits, self.group_size)
                weight[idx][r : r + step], scales[idx][r : r + step], biases[idx][r : r + step] = out
        return {
            "weight": weight,
            "scales": encode_float(self.float_dtype, scales),
            "biases": encode_float(self.float_dtype, biases),
        }


def _recast(t: LazyTensor, dtype: str, offset: float = 0.0) -> LazyTensor:
    if t.dtype == dtype and offset == 0.0:
        return t
    shift = np.float32(offset)
    return LazyTensor(dtype, t.shape, lambda: encode_float(dtype, decode_float(t.dtype, t.load()) + shift))


def hf_to_mlx_tensors(
    hf: Mapping[str, LazyTensor],
    *,
    bits: int = 4,
    group_size: int = 64,
    quantize: bool = True,
    dtype: str = "bfloat16",
) -> dict[str, LazyTensor]:
    """The MLX checkpoint's tensors, computed lazily from Hugging Face tensors (any accepted naming)."""
    if quantize:
        quant.check_supported(bits, group_size)
    if dtype not in FLOAT_DTYPE_NAMES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(FLOAT_DTYPE_NAMES)}")
    float_dtype = FLOAT_DTYPE_NAMES[dtype]
    out: dict[str, LazyTensor] = {}
    for name, t in mlx_float_tensors(hf).items():
        if name.startswith(VISION_PREFIX):  # copied as stored: never quantized, never recast
            if t.dtype not in LOADABLE_FLOAT_DTYPES:
                raise CheckpointError(f"tensor {name!r}: dtype {t.dtype}; the vision tower is copied as stored and "
                                      f"must be one of {', '.join(LOADABLE_FLOAT_DTYPES)}")
            out[name] = t
            continue
        if t.dtype not in _FLOAT_SOURCES:
            raise CheckpointError(f"tensor {name!r}: dtype {t.dtype} is not a float type lily can convert")
        q = quantize and quantization_of(name, t.shape[-1], bits, group_size)
        if q:
            q_bits, q_group = q
            module = _QuantizedModule(t, float_dtype, q_bits, q_group)
            base = name.removesuffix(".weight")
            *lead, n = t.shape
            packed, grouped = (*lead, n * q_bits // 32), (*lead, n // q_group)
            out[base + ".weight"] = LazyTensor("U32", packed, lambda m=module: m.take("weight"))
            out[base + ".scales"] = LazyTensor(float_dtype, grouped, lambda m=module: m.take("scales"))
            out[base + ".biases"] = LazyTensor(float_dtype, grouped, lambda m=module: m.take("biases"))
        elif name.endswith(".A_log"):
            out[name] = _recast(t, "F32")
        else:
            shift = 1.0 if is_zero_centred_norm(name.removeprefix(MLX_PREFIX)) else 0.0
            out[name] = _recast(t, float_dtype, shift)
    return out


def _check_against(tensors: Mapping[str, LazyTensor], specs: Mapping[str, tuple], where: Path) -> None:
    problems = []
    if missing := sorted(set(specs) - set(tensors)):
        problems.append(f"missing {missing[:5]}")
    if unexpected := sorted(set(tensors) - set(specs)):
        problems.append(f"unexpected {unexpected[:5]}")
    for name in sorted(set(specs) & set(tensors)):
        if (tensors[name].dtype, tensors[name].shape) != specs[name]:
            problems.append(f"{name} is {tensors[name].dtype} {tensors[name].shape}, expected {specs[name]}")
    if problems:
        raise CheckpointError(f"{where}: tensors do not match config.json: " + "; ".join(problems[:8]))


def _vision_specs(config: Mapping, tensors: Mapping[str, LazyTensor], where: Path) -> dict[str, tuple]:
    """(dtype, shape) of each vision tensor the output must hold: none when the source has no tower,
    else every one of `vision_config`'s, in its stored dtype."""
    present = {name: t for name, t in tensors.items() if name.startswith(VISION_PREFIX)}
    if not present:
        return {}
    shapes = vision_tensor_shapes(config)
    if not shapes:
        raise CheckpointError(f"{where}: holds vision tensors ({sorted(present)[0]!r}, ...) but config.json "
                              f"has no vision_config")
    if missing := [name for name in shapes if name not in present]:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise CheckpointError(f"{where}: missing tensor {missing[0]!r}{more} (the vision tower is incomplete)")
    return {name: (present[name].dtype, shape) for name, shape in shapes.items()}


def convert_hf_to_mlx(
    hf_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    bits: int = 4,
    group_size: int = 64,
    quantize: bool = True,
    dtype: str = "bfloat16",
    *,
    shard_size: int = DEFAULT_SHARD_SIZE,
    workers: int | None = None,
    progress: bool = False,
) -> Path:
    """Convert the Hugging Face checkpoint in `hf_dir` into an MLX-layout checkpoint in `out_dir`.

    Unquantized float tensors are written as `dtype` ("bfloat16", "float16" or "float32"); A_log stays
    fp32; the vision tower, when the source has one, is copied as stored. config.json gains
    "quantization" == "quantization_config" when `quantize`. Tokenizer, generation and
    preprocessor files are copied. `progress` shows a bar of bytes written. Returns `out_dir`.
    """
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if out_dir.resolve() == hf_dir.resolve():
        raise CheckpointError(f"{out_dir}: output directory must differ from the source")
    config = read_config(hf_dir / "config.json")
    text_config = text_config_of(config)

    sources: dict[str, LazyTensor] = {}
    for file in find_shards(hf_dir):
        st = SafetensorsFile(file)
        for name in st.names():
            if name in sources:
                raise CheckpointError(f"{file}: tensor {name!r} also appears in another file")
            sources[name] = st.lazy(name)
    try:
        tensors = hf_to_mlx_tensors(sources, bits=bits, group_size=group_size, quantize=quantize, dtype=dtype)
    except CheckpointError as e:
        raise CheckpointError(f"{hf_dir}: {e}") from e
    specs = mlx_tensor_specs(text_config, bits=bits, group_size=group_size, quantize=quantize, dtype=dtype)
    specs.update(_vision_specs(config, tensors, hf_dir))
    _check_against(tensors, specs, hf_dir)

    workers = workers or os.cpu_count() or 1
    from tqdm.auto import tqdm

    with tqdm(total=sum(t.nbytes for t in tensors.values()), desc=f"converting {hf_dir.name}", unit="B",
              unit_scale=True, disable=not progress) as bar:
        save_sharded(out_dir, tensors, shard_size=shard_size, metadata={"format": "mlx"}, workers=workers,
                     on_write=bar.update)
    quantization = quantization_config(text_config, bits, group_size) if quantize else None
    write_mlx_config(out_dir, config, quantization)
    for name in COPIED_FILES:
        if (hf_dir / name).is_file():
            shutil.copyfile(hf_dir / name, out_dir / name)
    return out_dir


def write_mlx_config(out_dir: Path, config: Mapping, quantization: dict | None) -> None:
    """Write config.json as mlx-lm does: top-level keys sorted, the quantization block twice."""
    config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    if quantization is not None:
        config["quantization"] = quantization
        config["quantization_config"] = quantization
    (out_dir / "config.json").write_text(json.dumps(dict(sorted(config.items())), indent=4) + "\n")


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `lily convert`."""
    parser.add_argument("source", help="Hugging Face checkpoint: a local folder or a repo id (downloaded)")
    parser.add_argument("output", type=Path, help="output folder (created; must be empty unless --overwrite)")
    parser.add_argument("--bits", type=int, choices=(4, 8), default=4, help="bits per weight (default 4)")
    parser.add_argument("--group-size", type=int, choices=(32, 64, 128), default=64,
                        help="weights per scale and bias (default 64, as mlx-community's Qwen3.6 4-bit)")
    parser.add_argument("--no-quantize", action="store_true", help="keep every matrix as floats (MLX layout only)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                        help="storage of the tensors left unquantized (default bfloat16)")
    parser.add_argument("--revision", help="Hugging Face revision of a repo id")
    parser.add_argument("--workers", type=int, default=None, help="tensors prepared in parallel (default: CPUs)")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into a non-empty output folder (replaces its checkpoint files)")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress bar")


def run_cli(args: argparse.Namespace) -> int:
    """Run `lily convert` with parsed `args`; returns the exit status."""
    from .hub import resolve_path

    if args.workers is not None and args.workers < 1:
        raise CheckpointError(f"--workers must be >= 1, got {args.workers}")
    out = Path(args.output)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out}: output exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not args.overwrite:
        raise CheckpointError(f"{out}: output folder is not empty (pass --overwrite to replace its checkpoint)")
    source = resolve_path(args.source, args.revision)
    path = convert_hf_to_mlx(source, out, bits=args.bits, group_size=args.group_size, quantize=not args.no_quantize,
                             dtype=args.dtype, workers=args.workers, progress=not args.quiet)
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    kind = "unquantized" if args.no_quantize else f"{args.bits}-bit, group {args.group_size}"
    print(f"wrote {path} ({kind}, {size / 1e9:.2f} GB of weights)")
    return 0
