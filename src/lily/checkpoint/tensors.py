"""The model's tensors: names, shapes, matrix or vector, quantization rule.

The list itself is the core's (``csrc/engine/tensors.cpp``, read through ``lily._core.model_tensors``):
the engine resolves its weights against the same table that the loader (weights.py), the converter
(convert.py) and the synthetic generator (synthetic.py) read here, so they cannot disagree. A
checkpoint layout is a spelling of it (docs/model.md section 4). A canonical name has no model prefix
and no ``.weight`` suffix (``layers.3.mlp.experts.gate_proj``). Canonical shapes: matrices [out, in],
expert stacks [E, out, in] (gate and up apart; Hugging Face fuses them into ``experts.gate_up_proj``
[E, 2I, H], gate rows first), conv1d taps [C, K] (stored [C, 1, K] by Hugging Face, [C, K, 1] by MLX),
every other vector 1-D.
"""
from __future__ import annotations

from dataclasses import dataclass

from .config import TextConfig

# Leaf names of the nn.Linear / nn.Embedding / SwitchLinear modules: the matrices, which mlx-lm may
# quantize (the rule applies to stored names, switch_mlp and per-expert ones included; tests check it
# names exactly the core table's matrices).
MATRIX_LEAVES = frozenset(
    "embed_tokens lm_head in_proj_qkv in_proj_z in_proj_b in_proj_a out_proj q_proj k_proj v_proj "
    "o_proj gate gate_proj up_proj down_proj shared_expert_gate".split()
)
# Norms stored as w by Hugging Face and as 1 + w by MLX, besides the final `norm` (never linear_attn.norm).
ZERO_CENTRED_NORM_LEAVES = frozenset(("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm"))
# The vision tower's stored names, the same in both layouts: "model." + stored_name(canonical ``visual.*``)
# (Hugging Face's names; the loader, the converter and the synthetic generator read them here).
VISION_PREFIX = "model.visual."
# The router and the shared-expert gate: mlx-lm's quant_predicate for this model keeps them at 8 bits.
ROUTER_GATE_QUANTIZATION = {"group_size": 64, "bits": 8}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the model by canonical name and canonical shape."""
    name: str
    shape: tuple[int, ...]
    is_matrix: bool  # a (possibly quantized) matrix or expert stack, else a float vector

    @property
    def num_stack(self) -> int:
        return self.shape[0] if len(self.shape) == 3 else 1


def model_tensors(c: TextConfig) -> list[TensorSpec]:
    """Every tensor of the model in Hugging Face checkpoint order: the text model's (mtp excluded), then
    the vision tower's (``visual.*``) when ``c.vision`` is set."""
    from .. import _core

    return [TensorSpec(name, tuple(shape), is_matrix) for name, shape, is_matrix in _core.model_tensors(c.to_core())]


def stored_name(name: str) -> str:
    """The stored name of canonical `name` under the model prefix: module weights end in '.weight',
    the bare parameters A_log and dt_bias and the vision tower's biases (canonical names ending in
    '.bias') do not."""
    return name if name.endswith(("A_log", "dt_bias", ".bias")) else name + ".weight"


def is_vision(name: str) -> bool:
    """True for the vision tower's tensors (canonical ``visual.*``): kept in their stored float
    precision, never quantized (docs/model.md section 8)."""
    return name.startswith("visual.")


def vision_stored_name(name: str) -> str:
    """The stored name of the vision tower's canonical `name` (``visual.*``), in either layout."""
    return "model." + stored_name(name)


def is_zero_centred_norm(name: str) -> bool:
    """True for the RMSNorm weights stored as w by Hugging Face and as 1 + w by MLX; `name` is
    canonical or its stored name without the model prefix."""
    module = name.removesuffix(".weight")
    return module == "norm" or module.rpartition(".")[2] in ZERO_CENTRED_NORM_LEAVES


def is_router_gate(module: str) -> bool:
    """True for the modules mlx-lm quantizes at 8 bits: the router and the shared-expert gate."""
    return module.endswith(("mlp.gate", "shared_expert_gate"))


def quantization_of(name: str, in_features: int, bits: int, group_size: int) -> tuple[int, int] | None:
    """(bits, group_size) mlx-lm quantizes stored weight `name` with, or None when it stays float."""
    module, _, leaf = name.rpartition(".")
    if leaf != "weight" or module.rpartition(".")[2] not in MATRIX_LEAVES or in_features % group_size:
        return None
    if is_router_gate(module):
        gate_bits, gate_group = ROUTER_GATE_QUANTIZATION["bits"], ROUTER_GATE_QUANTIZATION["group_size"]
        return (gate_bits, gate_group) if in_features % gate_group == 0 else None
    return bits, group_size
