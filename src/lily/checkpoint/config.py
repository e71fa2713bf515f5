"""config.json of a qwen3_5_moe checkpoint -> a validated TextConfig (Hugging Face field names).

The multimodal config nests every text hyper-parameter under ``text_config`` and the vision tower's
under ``vision_config`` (VisionConfig, docs/model.md section 8); mlx-lm also accepts a flat layout
(text only). Both are read here; anything missing or inconsistent raises ConfigError naming the key.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
from pathlib import Path

from ..errors import ConfigError

SUPPORTED_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")

# Upper bounds of the integer hyper-parameters: far above any Qwen3.5/3.6 model (the 35B-A3B has 40
# layers, hidden 2048, vocab 248320, 256 experts), low enough that nothing sized from them overflows
# or allocates absurd memory before a later check (docs/checkpoints.md, "What the loader refuses").
INT_LIMITS = {"num_hidden_layers": 1024, "vocab_size": 1 << 22, "hidden_size": 1 << 16, "head_dim": 1024,
              "num_attention_heads": 1024, "num_key_value_heads": 1024, "linear_num_key_heads": 1024,
              "linear_num_value_heads": 1024, "linear_key_head_dim": 1024, "linear_value_head_dim": 1024,
              "linear_conv_kernel_dim": 64, "num_experts": 4096, "num_experts_per_tok": 4096,
              "moe_intermediate_size": 1 << 18, "shared_expert_intermediate_size": 1 << 18,
              "full_attention_interval": 1024, "max_position_embeddings": 1 << 24,
              # vision_config
              "depth": 1024, "intermediate_size": 1 << 18, "num_heads": 1024, "in_channels": 16, "patch_size": 1024,
              "temporal_patch_size": 16, "spatial_merge_size": 16, "out_hidden_size": 1 << 16,
              "num_position_embeddings": 1 << 20}
MAX_CONFIG_BYTES = 16 << 20  # config.json larger than this is refused unread


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The vision tower's hyper-parameters (``vision_config``; docs/model.md section 8)."""
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    rope_theta: float

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    def to_core(self):
        from .. import _core

        v = _core.VisionConfig()
        for f in dataclasses.fields(self):
            setattr(v, f.name, getattr(self, f.name))
        return v


@dataclasses.dataclass(frozen=True)
class TextConfig:
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    partial_rotary_factor: float
    rope_theta: float
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    eos_token_id: tuple[int, ...]
    # The vision tower: None when config.json has no vision_config, or (set by the loader) when the
    # checkpoint's files hold no vision tensors, as in mlx-lm conversions.
    vision: VisionConfig | None = None
    mrope_section: tuple[int, int, int] = (11, 11, 10)  # multimodal RoPE's (t, h, w) frequency split
    image_token_id: int = 248056  # <|image_pad|>: the tokens whose embeddings the vision tower replaces

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.value_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    def is_full_attention(self, layer: int) -> bool:
        return self.layer_types[layer] == "full_attention"

    def to_core(self):
        """The same config as the native lily._core.ModelConfig."""
        from .. import _core

        c = _core.ModelConfig()
        for f in ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "rope_theta", "linear_num_key_heads",
                  "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                  "linear_conv_kernel_dim", "num_experts", "num_experts_per_tok",
                  "moe_intermediate_size", "shared_expert_intermediate_size", "rms_norm_eps"):
            setattr(c, f, getattr(self, f))
        c.rotary_dim = self.rotary_dim
        c.is_full_attention = [int(self.is_full_attention(i)) for i in range(self.num_hidden_layers)]
        c.mrope_section = list(self.mrope_section)
        if self.vision is not None:
            c.vision = self.vision.to_core()
        c.validate()
        return c


def _int(d: dict, key: str, where: str) -> int:
    if key not in d:
        raise ConfigError(f"{where}: missing required key '{key}'")
    v = d[key]
    hi = INT_LIMITS.get(key, 1 << 24)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= hi:
        raise ConfigError(f"{where}: '{key}' must be a positive integer <= {hi}, got {_short(v)}")
    return v


def _float(d: dict, key: str, where: str, default: float | None = None, hi: float = 1e30) -> float:
    v = d.get(key, default)
    if v is None:
        raise ConfigError(f"{where}: missing required key '{key}'")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v <= hi and math.isfinite(v)):
        raise ConfigError(f"{where}: '{key}' must be a finite number in (0, {hi:g}], got {_short(v)}")
    return float(v)


def _short(v) -> str:
    """A config value for an error message, cut short (a hostile config may hold anything)."""
    try:
        text = repr(v)
    except Exception:  # noqa: BLE001 - e.g. a RecursionError on deep nesting
        text = f"a {type(v).__name__}"
    return text if len(text) <= 80 else text[:77] + "..."


def parse_config(raw: dict, where: str = "config.json") -> TextConfig:
    """Validate a config dict (nested ``text_config`` or flat) and return its TextConfig."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"{where}: unsupported model_type {model_type!r}; lily runs "
                          f"{' / '.join(SUPPORTED_MODEL_TYPES)} (Qwen3.5/3.6 MoE) checkpoints")
    text = raw.get("text_config", raw)
    if not isinstance(text, dict):
        raise ConfigError(f"{where}: 'text_config' must be an object")
    w = f"{where} (text_config)" if "text_config" in raw else where
    n_layers = _int(text, "num_hidden_layers", w)
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = _int(text, "full_attention_interval", w)
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                       for i in range(n_layers)]
    if not isinstance(layer_types, list) or len(layer_types) != n_layers:
        raise ConfigError(f"{w}: 'layer_types' must list {n_layers} entries (num_hidden_layers)")
    bad = [t for t in layer_types if not isinstance(t, str) or t not in ("full_attention", "linear_attention")]
    if bad:
        raise ConfigError(f"{w}: unknown layer_types {_short(sorted(set(map(str, bad))))}")
    rope = text.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{w}: 'rope_parameters' must be an object")
    theta = rope.get("rope_theta", text.get("rope_theta"))
    prf = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))
    eos = text.get("eos_token_id", raw.get("eos_token_id"))
    eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    vocab = _int(text, "vocab_size", w)
    # Not bounded by vocab_size: small synthetic models keep the real tokenizer's end ids.
    if any(isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < 2**31 for e in eos):
        raise ConfigError(f"{w}: 'eos_token_id' must be a token id or a list of token ids in [0, 2^31), "
                          f"got {_short(text.get('eos_token_id', raw.get('eos_token_id')))}")
    max_pos = _int({"max_position_embeddings": text.get("max_position_embeddings", 262144)},
                   "max_position_embeddings", w)
    cfg = TextConfig(
        hidden_size=_int(text, "hidden_size", w),
        num_hidden_layers=n_layers,
        vocab_size=vocab,
        layer_types=tuple(layer_types),
        num_attention_heads=_int(text, "num_attention_heads", w),
        num_key_value_heads=_int(text, "num_key_value_heads", w),
        head_dim=_int(text, "head_dim", w),
        partial_rotary_factor=_float({"partial_rotary_factor": prf}, "partial_rotary_factor", w, hi=1.0),
        rope_theta=_float({"rope_theta": theta}, "rope_theta", w, hi=1e12),
        linear_num_key_heads=_int(text, "linear_num_key_heads", w),
        linear_num_value_heads=_int(text, "linear_num_value_heads", w),
        linear_key_head_dim=_int(text, "linear_key_head_dim", w),
        linear_value_head_dim=_int(text, "linear_value_head_dim", w),
        linear_conv_kernel_dim=_int(text, "linear_conv_kernel_dim", w),
        num_experts=_int(text, "num_experts", w),
        num_experts_per_tok=_int(text, "num_experts_per_tok", w),
        moe_intermediate_size=_int(text, "moe_intermediate_size", w),
        shared_expert_intermediate_size=_int(text, "shared_expert_intermediate_size", w),
        rms_norm_eps=_float(text, "rms_norm_eps", w, 1e-6, hi=1.0),
        max_position_embeddings=max_pos,
        eos_token_id=eos,
        vision=parse_vision_config(raw, where),
        mrope_section=_mrope_section(rope, w),
        image_token_id=_int({"image_token_id": raw.get("image_token_id", 248056)}, "image_token_id", where),
    )
    _check_consistent(cfg, w)
    return cfg


def _mrope_section(rope: dict, w: str) -> tuple[int, int, int]:
    section = rope.get("mrope_section", [11, 11, 10])
    if not isinstance(section, list) or len(section) != 3 or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 1 << 16 for v in section):
        raise ConfigError(f"{w}: 'rope_parameters.mrope_section' must be 3 non-negative integers, got {_short(section)}")
    return tuple(section)


def parse_vision_config(raw: dict, where: str = "config.json") -> VisionConfig | None:
    """The ``vision_config`` block of a nested config, validated; None without one."""
    v = raw.get("vision_config")
    if v is None or "text_config" not in raw:
        return None
    w = f"{where} (vision_config)"
    if not isinstance(v, dict):
        raise ConfigError(f"{w}: must be an object")
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"{w}: hidden_act {_short(act)} is not supported (lily runs 'gelu_pytorch_tanh')")
    if v.get("deepstack_visual_indexes"):
        raise ConfigError(f"{w}: deepstack_visual_indexes is not supported (Qwen3.5/3.6 has none)")
    rope = v.get("rope_parameters") or {}
    theta = rope.get("rope_theta", v.get("rope_theta", 10000.0)) if isinstance(rope, dict) else None
    ints = {k: _int({k: v.get(k, default)} if default is not None else v, k, w) for k, default in (
        ("depth", None), ("hidden_size", None), ("intermediate_size", None), ("num_heads", None), ("in_channels", 3),
        ("patch_size", None), ("temporal_patch_size", 2), ("spatial_merge_size", 2), ("out_hidden_size", None),
        ("num_position_embeddings", None))}
    cfg = VisionConfig(**ints, rope_theta=_float({"rope_theta": theta}, "rope_theta", w, hi=1e12))
    head = cfg.hidden_size // cfg.num_heads
    if cfg.hidden_size % cfg.num_heads or head % 4:
        raise ConfigError(f"{w}: hidden_size {cfg.hidden_size} does not split into num_heads {cfg.num_heads} heads "
                          f"of a multiple of 4 dims")
    if math.isqrt(cfg.num_position_embeddings) ** 2 != cfg.num_position_embeddings:
        raise ConfigError(f"{w}: num_position_embeddings {cfg.num_position_embeddings} is not a square")
    return cfg


def _check_consistent(c: TextConfig, w: str) -> None:
    if c.num_attention_heads % c.num_key_value_heads:
        raise ConfigError(f"{w}: num_attention_heads ({c.num_attention_heads}) is not a multiple of "
                          f"num_key_value_heads ({c.num_key_value_heads})")
    if c.linear_num_value_heads % c.linear_num_key_heads:
        raise ConfigError(f"{w}: linear_num_value_heads ({c.linear_num_value_heads}) is not a multiple "
                          f"of linear_num_key_heads ({c.linear_num_key_heads})")
    if c.num_experts_per_tok > c.num_experts:
        raise ConfigError(f"{w}: num_experts_per_tok ({c.num_experts_per_tok}) exceeds num_experts "
                          f"({c.num_experts})")
    if c.vision is not None and c.vision.out_hidden_size != c.hidden_size:
        raise ConfigError(f"{w}: vision_config.out_hidden_size ({c.vision.out_hidden_size}) differs from "
                          f"hidden_size ({c.hidden_size})")
    if c.partial_rotary_factor > 1 or c.rotary_dim % 2:
        raise ConfigError(f"{w}: partial_rotary_factor {c.partial_rotary_factor} gives "
                          f"{c.rotary_dim} rotary dims of head_dim {c.head_dim}; need an even count <= head_dim")


def load_config(model_dir: Path) -> tuple[TextConfig, dict]:
    """Read ``model_dir/config.json``; return the TextConfig and the raw dict."""
    path = Path(model_dir) / "config.json"
    try:
        st = os.stat(path)
    except OSError:
        raise ConfigError(f"{path}: not found (a checkpoint folder needs config.json)") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{path}: not a regular file")
    if st.st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: {st.st_size} bytes; a config.json over {MAX_CONFIG_BYTES} bytes is refused")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ConfigError(f"{path}: unreadable JSON ({type(e).__name__}: {str(e)[:200]})") from None
    return parse_config(raw, str(path)), raw
