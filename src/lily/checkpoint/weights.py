"""Checkpoint folder -> canonical named tensors -> lily._core.WeightStore.

This is the one sanitize step. Two layouts are accepted (docs/model.md section 4):
- MLX (mlx-lm / mlx-vlm): ``language_model.model.*``, ``switch_mlp`` expert stacks, conv [C, K, 1],
  block norms already stored as 1+w, MLX affine quantization (``.weight`` U32 + ``.scales`` + ``.biases``);
- Hugging Face: ``model.language_model.*`` (or ``model.*``), experts fused (``experts.gate_up_proj``,
  ``experts.down_proj``) or per expert (``experts.{e}.{gate,up,down}_proj.weight``), conv [C, 1, K],
  norms stored as w (applied as 1+w).
Canonical form handed to the core: matrices in their stored precision ([stack, out, in]), norm
weights as the full multiplier (1+w), conv taps [C, K], every vector float32. ``mtp.*`` is skipped.
The vision tower's tensors (``model.visual.*`` in both layouts, canonical ``visual.*``) are indexed apart
from the text model's: they load in their stored float precision (never quantized, also with
quantize=4), the patch embedding's Conv3d [W, C, tp, p, p] as a matrix [W, C*tp*p*p]; a checkpoint
without them (an mlx-lm conversion; mlx-vlm's ``vision_tower.*`` is not read) loads text-only. Every
problem raises CheckpointError naming the file and tensor.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import CheckpointError
from .config import TextConfig
from .dtypes import LOADABLE_FLOAT_DTYPES, bf16_bits_to_f32
from .safetensors_io import LazyTensor, SafetensorsFile, find_shards, first_non_finite, produced_in_order
from .tensors import VISION_PREFIX, is_vision, is_zero_centred_norm, model_tensors, stored_name

FLOAT_DTYPES = LOADABLE_FLOAT_DTYPES
SKIPPED_PREFIXES = ("mtp.", "model.mtp.", "visual.", "vision_tower.", "model.vision_tower.")


@dataclass
class Source:
    """One stored tensor: where it lives and how to read it."""
    name: str  # as stored in the file
    file: SafetensorsFile
    path: Path
    check_finite: bool = True

    @property
    def info(self):
        return self.file.info(self.name)

    def where(self) -> str:
        return f"tensor '{self.name}' in {self.path.name}"

    def read(self) -> np.ndarray:
        a = self.file.get(self.name)
        if self.check_finite:
            at = first_non_finite(a, self.info.dtype)
            if at is not None:
                index = tuple(int(i) for i in np.unravel_index(at, a.shape)) if a.ndim else ()
                raise CheckpointError(f"{self.where()}: holds NaN or infinity (first at index {list(index)}); "
                                      f"the checkpoint is corrupt (load with check_weights=False to skip this check)")
        return a


def canonical_name(stored: str) -> tuple[str | None, str | None]:
    """(layout, name without the model prefix) of a stored tensor name; (None, None) if skipped.
    The vision tower's tensors have the layout 'vision'."""
    if stored.startswith(VISION_PREFIX):
        return "vision", stored[len("model."):]
    if stored.startswith(SKIPPED_PREFIXES):
        return None, None
    if stored.startswith("language_model.model."):
        return "mlx", stored[len("language_model.model."):]
    if stored.startswith("language_model.lm_head."):
        return "mlx", stored[len("language_model."):]
    if stored.startswith("model.language_model."):
        return "hf", stored[len("model.language_model."):]
    if stored.startswith("model."):
        return "hf", stored[len("model."):]
    if stored.startswith("lm_head."):
        return "hf", stored
    return None, None


@dataclass
class MemorySource:
    """A tensor computed at load time (e.g. quantized from a float checkpoint), read like a Source."""
    name: str
    tensor: LazyTensor
    origin: str

    @property
    def info(self) -> LazyTensor:  # .dtype and .shape, as a file's tensor info
        return self.tensor

    def where(self) -> str:
        return f"tensor '{self.name}' ({self.origin})"

    def read(self) -> np.ndarray:
        return self.tensor.load()


class CheckpointTensors:
    """Index of every tensor of a checkpoint by canonical name, with its layout."""

    def __init__(self, model_dir: Path, computed: dict[str, LazyTensor] | None = None, origin: str = "",
                 check_finite: bool = True):
        """The tensors of the files in ``model_dir``, or ``computed`` ones (stored names -> tensors).
        ``check_finite``: reading a float tensor that holds NaN or infinity raises CheckpointError."""
        self.dir = model_dir
        self.sources: dict[str, Source | MemorySource] = {}
        self.visual: dict[str, Source | MemorySource] = {}  # the vision tower's, by canonical name
        layouts = set()
        if computed is None:
            named = ((name, Source(name, f, path, check_finite)) for path in find_shards(model_dir)
                     for f in [SafetensorsFile(path)] for name in f.names())
        else:
            named = ((name, MemorySource(name, t, origin)) for name, t in computed.items())
        for name, src in named:
            layout, canon = canonical_name(name)
            if canon is None:
                continue
            index = self.visual if layout == "vision" else self.sources
            if layout != "vision":
                layouts.add(layout)
            if canon in index:
                raise CheckpointError(f"{src.where()} appears twice (also {index[canon].where()})")
            index[canon] = src
        if not self.sources:
            raise CheckpointError(f"{model_dir}: no text-model tensors found (expected names starting "
                                  f"'language_model.model.' (MLX) or 'model.language_model.' (Hugging Face))")
        if len(layouts) > 1:
            raise CheckpointError(f"{model_dir}: mixes MLX ('language_model.*') and Hugging Face ('model.*') names")
        self.layout = layouts.pop()

    def get(self, canon: str) -> Source:
        if canon.startswith("visual."):
            src = self.visual.get(canon)
            if src is None:
                raise CheckpointError(f"{self.dir}: missing tensor 'model.{canon}' (the vision tower is incomplete)")
            return src
        src = self.sources.get(canon)
        if src is None:
            prefix = "language_model.model." if self.layout == "mlx" else "model.language_model."
            if canon.startswith("lm_head"):
                prefix = "language_model." if self.layout == "mlx" else ""
            raise CheckpointError(f"{self.dir}: missing tensor '{prefix}{canon}'")
        return src

    def has(self, canon: str) -> bool:
        return canon in self.sources or canon in self.visual


def _as_f32(src: Source) -> np.ndarray:
    info = src.info
    if info.dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"{src.where()}: dtype {info.dtype}, expected one of {', '.join(FLOAT_DTYPES)}")
    a = src.read()
    if info.dtype == "BF16":
        return bf16_bits_to_f32(a)
    return np.ascontiguousarray(a, dtype=np.float32)


def _check_shape(src: Source, want: tuple) -> None:
    if tuple(src.info.shape) != tuple(want):
        raise CheckpointError(f"{src.where()}: shape {list(src.info.shape)}, expected {list(want)}")


class QuantSpec:
    """The MLX "quantization" block: defaults plus per-module overrides."""

    def __init__(self, raw_config: dict):
        text = raw_config.get("text_config") if isinstance(raw_config.get("text_config"), dict) else {}
        q = raw_config.get("quantization") or raw_config.get("quantization_config") or \
            text.get("quantization") or text.get("quantization_config") or {}
        if not isinstance(q, dict):
            raise CheckpointError("config.json: 'quantization' must be an object")
        method = q.get("quant_method")
        if method is not None and method not in ("mlx",):
            raise CheckpointError(f"config.json: quantization method {method!r} is not supported "
                                  f"(lily reads MLX affine 4/8-bit and bf16/fp16/fp32 weights)")
        mode = q.get("mode", "affine")
        if mode != "affine":
            raise CheckpointError(f"config.json: quantization mode {mode!r} is not supported (only 'affine')")
        self.raw = q

    def for_module(self, mlx_path: str) -> tuple[int | None, int | None]:
        entry = self.raw.get(mlx_path)
        if isinstance(entry, dict):
            return entry.get("bits"), entry.get("group_size")
        return self.raw.get("bits"), self.raw.get("group_size")


def matrix_args(tensors: CheckpointTensors, quant: QuantSpec, canon: str, stack: int, rows: int,
                cols: int) -> dict:
    """Arguments of WeightStore.set_matrix for stored module ``canon`` (no '.weight' suffix)."""
    wname = canon if tensors.has(canon) and not tensors.has(canon + ".weight") else canon + ".weight"
    w = tensors.get(wname)
    lead = (stack,) if stack > 1 else ()
    if not tensors.has(canon + ".scales"):
        _check_shape(w, lead + (rows, cols))
        if w.info.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{w.where()}: dtype {w.info.dtype} for an unquantized weight "
                                  f"(expected F32, F16 or BF16; or add .scales/.biases for MLX quantization)")
        return dict(weight=w.read(), dtype=w.info.dtype, num_stack=stack, rows=rows, cols=cols)
    s, b = tensors.get(canon + ".scales"), tensors.get(canon + ".biases")
    if w.info.dtype != "U32":
        raise CheckpointError(f"{w.where()}: quantized weight has dtype {w.info.dtype}, expected U32")
    shape = tuple(w.info.shape)
    if len(shape) != len(lead) + 2 or shape[:-1] != lead + (rows,) or (shape[-1] * 32) % cols:
        raise CheckpointError(f"{w.where()}: packed shape {list(shape)} does not fit a {list(lead + (rows, cols))} matrix")
    bits = shape[-1] * 32 // cols
    sshape = tuple(s.info.shape)
    if len(sshape) != len(shape) or sshape[:-1] != shape[:-1] or sshape[-1] == 0 or cols % sshape[-1]:
        raise CheckpointError(f"{s.where()}: shape {list(sshape)} does not fit {list(lead + (rows, cols))}")
    group = cols // sshape[-1]
    want_bits, want_group = quant.for_module("language_model.model." + canon if not canon.startswith("lm_head")
                                             else "language_model." + canon)
    if (want_bits is not None and want_bits != bits) or (want_group is not None and want_group != group):
        raise CheckpointError(f"{w.where()}: shapes imply {bits}-bit group {group} but config.json's quantization "
                              f"says {want_bits}-bit group {want_group}")
    if bits not in (2, 4, 8) or group not in (32, 64, 128):
        raise CheckpointError(f"{w.where()}: {bits}-bit group {group} quantization is not supported "
                              f"(bits 2/4/8, group 32/64/128)")
    if tuple(b.info.shape) != sshape:
        raise CheckpointError(f"{b.where()}: shape {list(b.info.shape)}, expected {list(sshape)} like its scales")
    for t in (s, b):
        if t.info.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{t.where()}: dtype {t.info.dtype}, expected a float dtype")
    if s.info.dtype != b.info.dtype:
        raise CheckpointError(f"{b.where()}: dtype {b.info.dtype} differs from its scales' {s.info.dtype}")
    return dict(weight=w.read(), dtype="U32", num_stack=stack, rows=rows, cols=cols, bits=bits,
                group_size=group, scales=s.read(), biases=b.read(), scale_dtype=s.info.dtype)


def _expert_args(t: CheckpointTensors, quant: QuantSpec, canon: str, E: int, rows: int, cols: int) -> dict:
    """Expert stacks in either layout -> set_matrix arguments for [E, rows, cols]."""
    layer, kind = canon.rsplit(".experts.", 1)  # kind: gate_proj | up_proj | down_proj
    if t.layout == "mlx":
        return matrix_args(t, quant, f"{layer}.switch_mlp.{kind}", E, rows, cols)
    if t.has(f"{layer}.experts.0.{kind}.weight"):  # per-expert tensors, as transformers saves them
        parts = [matrix_args(t, quant, f"{layer}.experts.{e}.{kind}", 1, rows, cols) for e in range(E)]
        dtypes = {p["dtype"] for p in parts}
        if len(dtypes) != 1 or any(p.get("bits") for p in parts):
            raise CheckpointError(f"{t.dir}: experts of '{layer}' mix dtypes {sorted(dtypes)} or are quantized")
        return dict(parts[0], weight=np.stack([p["weight"] for p in parts]), num_stack=E)
    if kind == "down_proj":
        return matrix_args(t, quant, f"{layer}.experts.down_proj", E, rows, cols)
    fused = matrix_args(t, quant, f"{layer}.experts.gate_up_proj", E, 2 * rows, cols)
    half = slice(0, rows) if kind == "gate_proj" else slice(rows, 2 * rows)  # gate rows come first
    return dict(fused, weight=np.ascontiguousarray(fused["weight"][:, half]), rows=rows)


def _vector(t: CheckpointTensors, canon: str, shape: tuple) -> np.ndarray:
    src = t.get(stored_name(canon))
    a = _as_f32(src)
    if canon.endswith("conv1d"):  # HF [C, 1, K], MLX [C, K, 1]: same element order as [C, K]
        C, K = shape
        if tuple(a.shape) not in ((C, 1, K), (C, K, 1), (C, K)):
            raise CheckpointError(f"{src.where()}: shape {list(a.shape)}, expected [{C}, 1, {K}] (Hugging Face) "
                                  f"or [{C}, {K}, 1] (MLX)")
        return np.ascontiguousarray(a.reshape(C, K))
    _check_shape(src, shape)
    if t.layout == "hf" and is_zero_centred_norm(canon):
        a = a + np.float32(1.0)  # HF stores w; the core takes the multiplier 1+w (MLX stores 1+w)
    return np.ascontiguousarray(a, dtype=np.float32)


def _vision_args(t: CheckpointTensors, spec) -> dict | np.ndarray:
    """The vision tower's tensor ``spec``: set_matrix arguments of a dense matrix in its stored float
    dtype (the patch embedding's Conv3d flattened to [W, C*tp*p*p]), or a float32 vector."""
    src = t.get(stored_name(spec.name))
    if src.info.dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"{src.where()}: dtype {src.info.dtype}, expected one of {', '.join(FLOAT_DTYPES)} "
                              f"(the vision tower is never quantized)")
    if not spec.is_matrix:
        _check_shape(src, spec.shape)
        return _as_f32(src)
    rows, cols = spec.shape
    shape = tuple(src.info.shape)
    if shape != (rows, cols) and not (spec.name.endswith("patch_embed.proj") and shape[0] == rows
                                      and math.prod(shape[1:]) == cols):
        raise CheckpointError(f"{src.where()}: shape {list(shape)}, expected {[rows, cols]}")
    weight = np.ascontiguousarray(src.read().reshape(rows, cols))
    return dict(weight=weight, dtype=src.info.dtype, num_stack=1, rows=rows, cols=cols)


def quantized_at_load(tensors: CheckpointTensors, raw_config: dict, bits: int) -> tuple[CheckpointTensors, dict]:
    """A float (Hugging Face layout) checkpoint's tensors as the MLX affine checkpoint `lily convert`
    would write (bits, group 64, router gates 8-bit), computed lazily, and the config that says so."""
    from .convert import hf_to_mlx_tensors, quantization_config, text_config_of

    if tensors.layout != "hf":
        raise CheckpointError(f"{tensors.dir}: quantize={bits} applies to float (Hugging Face) checkpoints; "
                              f"this one is already in the MLX layout")
    hf = {src.name: LazyTensor(src.info.dtype, tuple(src.info.shape), src.read) for src in tensors.sources.values()}
    try:
        mlx = hf_to_mlx_tensors(hf, bits=bits, group_size=64, quantize=True, dtype="bfloat16")
    except CheckpointError as e:
        raise CheckpointError(f"{tensors.dir}: {e}") from e
    config = dict(raw_config, quantization=quantization_config(text_config_of(raw_config), bits, 64))
    quantized = CheckpointTensors(tensors.dir, mlx, f"{bits}-bit, quantized at load")
    quantized.visual = tensors.visual  # the vision tower stays in its stored floats
    return quantized, config


def load_weights(model_dir: Path, cfg: TextConfig, raw_config: dict, store, progress: bool = False,
                 quantize: int | None = None, check_weights: bool = True) -> tuple[str, TextConfig]:
    """Fill ``store`` (a lily._core.WeightStore) from the checkpoint; returns the layout ('mlx' | 'hf')
    and the config of what was loaded: ``cfg``, with ``vision`` None when the files hold no vision
    tower. ``quantize`` (4 or 8): quantize a float checkpoint's text matrices as it loads (``lily
    convert``'s result). ``check_weights``: refuse float tensors (weights, scales, biases, norms)
    holding NaN or infinity."""
    tensors = CheckpointTensors(Path(model_dir), check_finite=check_weights)
    layout = tensors.layout
    if cfg.vision is not None and not tensors.visual:
        cfg = dataclasses.replace(cfg, vision=None)
    if quantize is not None:
        tensors, raw_config = quantized_at_load(tensors, raw_config, quantize)
    quant = QuantSpec(raw_config)
    tied = bool(raw_config.get("tie_word_embeddings", False)) and not tensors.has("lm_head.weight")
    specs = model_tensors(cfg)
    matrices = [spec for spec in specs if spec.is_matrix]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(matrices) + 1, desc=f"loading {Path(model_dir).name}", unit="tensor")
    def prepare(spec) -> dict:
        if is_vision(spec.name):
            return _vision_args(tensors, spec)
        rows, cols = spec.shape[-2:]
        if ".experts." in spec.name:
            return _expert_args(tensors, quant, spec.name, spec.num_stack, rows, cols)
        src = "embed_tokens" if spec.name == "lm_head" and tied else spec.name
        return matrix_args(tensors, quant, src, spec.num_stack, rows, cols)

    # Stored matrices are memory-mapped views: read in order. Quantizing is CPU work: a few threads
    # ahead (each holds up to two float32 matrices in flight, ~1 GB for a full-size expert stack).
    workers = min(8, os.cpu_count() or 1) if quantize is not None else 1
    try:
        for spec, args in zip(matrices, produced_in_order((lambda s=s: prepare(s) for s in matrices), workers)):
            store.set_matrix(spec.name, **args)
            if bar:
                bar.update(1)
        for spec in specs:
            if not spec.is_matrix:
                vector = _vision_args(tensors, spec) if is_vision(spec.name) else _vector(tensors, spec.name, spec.shape)
                store.set_vector(spec.name, vector)
        if bar:
            bar.update(1)
    finally:
        if bar:
            bar.close()
    return layout, cfg
