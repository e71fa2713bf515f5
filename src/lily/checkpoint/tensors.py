"""The one description of the model's tensors: names, shapes, matrix or vector, quantization rule.

The loader (weights.py), the converter (convert.py) and the synthetic generator (synthetic.py) all
read this list; a checkpoint layout is a spelling of it (docs/model.md section 4). A canonical name has no
model prefix and no ``.weight`` suffix (``layers.3.mlp.experts.gate_proj``). Canonical shapes:
matrices [out, in], expert stacks [E, out, in] (gate and up apart; Hugging Face fuses them into
``experts.gate_up_proj`` [E, 2I, H], gate rows first), conv1d taps [C, K] (stored [C, 1, K] by
Hugging Face, [C, K, 1] by MLX), every other vector 1-D.
"""
from __future__ import annotations

from dataclasses import dataclass

from .config import TextConfig

# Leaf names of the nn.Linear / nn.Embedding / SwitchLinear modules: the matrices, which mlx-lm may quantize.
MATRIX_LEAVES = frozenset(
    "embed_tokens lm_head in_proj_qkv in_proj_z in_proj_b in_proj_a out_proj q_proj k_proj v_proj "
    "o_proj gate gate_proj up_proj down_proj shared_expert_gate".split()
)
# Norms stored as w by Hugging Face and as 1 + w by MLX, besides the final `norm` (never linear_attn.norm).
ZERO_CENTRED_NORM_LEAVES = frozenset(("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm"))
# The router and the shared-expert gate: mlx-lm's quant_predicate for this model keeps them at 8 bits.
ROUTER_GATE_QUANTIZATION = {"group_size": 64, "bits": 8}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the model by canonical name and canonical shape."""
    name: str
    shape: tuple[int, ...]

    @property
    def is_matrix(self) -> bool:
        return self.name.rpartition(".")[2] in MATRIX_LEAVES

    @property
    def num_stack(self) -> int:
        return self.shape[0] if len(self.shape) == 3 else 1


def model_tensors(c: TextConfig) -> list[TensorSpec]:
    """Every tensor of the text model (mtp and vision excluded), in Hugging Face checkpoint order."""
    H, V = c.hidden_size, c.vocab_size
    E, I, Is = c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
    shapes = {"embed_tokens": (V, H), "norm": (H,), "lm_head": (V, H)}
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        shapes[p + "input_layernorm"] = (H,)
        shapes[p + "post_attention_layernorm"] = (H,)
        if c.is_full_attention(i):
            q_dim, kv_dim, D = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.head_dim
            shapes.update({
                p + "self_attn.q_proj": (2 * q_dim, H),  # query and output gate, interleaved per head
                p + "self_attn.k_proj": (kv_dim, H),
                p + "self_attn.v_proj": (kv_dim, H),
                p + "self_attn.o_proj": (H, q_dim),
                p + "self_attn.q_norm": (D,),
                p + "self_attn.k_norm": (D,),
            })
        else:
            Hv, C = c.linear_num_value_heads, c.conv_dim  # conv channels: q | k | v
            shapes.update({
                p + "linear_attn.in_proj_qkv": (C, H),
                p + "linear_attn.in_proj_z": (c.value_dim, H),
                p + "linear_attn.in_proj_b": (Hv, H),
                p + "linear_attn.in_proj_a": (Hv, H),
                p + "linear_attn.conv1d": (C, c.linear_conv_kernel_dim),
                p + "linear_attn.A_log": (Hv,),
                p + "linear_attn.dt_bias": (Hv,),
                p + "linear_attn.norm": (c.linear_value_head_dim,),
                p + "linear_attn.out_proj": (H, c.value_dim),
            })
        shapes.update({
            p + "mlp.gate": (E, H),
            p + "mlp.experts.gate_proj": (E, I, H),
            p + "mlp.experts.up_proj": (E, I, H),
            p + "mlp.experts.down_proj": (E, H, I),
            p + "mlp.shared_expert.gate_proj": (Is, H),
            p + "mlp.shared_expert.up_proj": (Is, H),
            p + "mlp.shared_expert.down_proj": (H, Is),
            p + "mlp.shared_expert_gate": (1, H),
        })
    return [TensorSpec(name, shape) for name, shape in shapes.items()]


def stored_name(name: str) -> str:
    """The stored name of canonical `name` under the model prefix: module weights end in '.weight',
    the bare parameters A_log and dt_bias do not."""
    return name if name.endswith(("A_log", "dt_bias")) else name + ".weight"


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
