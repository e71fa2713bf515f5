"""The model's tensors are described once, by the core (csrc/engine/tensors.cpp): the engine resolves
its weights against the same table the loader, the converter and the synthetic checkpoints read
(lily.checkpoint.tensors.model_tensors), so a name or shape cannot differ between them."""
from __future__ import annotations

import numpy as np
import pytest

from lily import _core
from lily.checkpoint import synthetic
from lily.checkpoint.config import parse_config
from lily.checkpoint.tensors import MATRIX_LEAVES, model_tensors
from lily.errors import LilyError


@pytest.fixture(scope="module", params=["text", "vision"])
def cfg(request):
    text = dict(synthetic.TINY_TEXT_CONFIG, vocab_size=256)
    if request.param == "text":
        return parse_config(text)
    return parse_config(synthetic.full_config(text, synthetic.VISION_CONFIGS["tiny"]))


def store_of(cfg, shapes: dict[str, tuple[int, ...]]):
    """A CPU WeightStore holding zeros of the given canonical names and shapes (the table's kinds)."""
    kinds = {spec.name: spec.is_matrix for spec in model_tensors(cfg)}
    store = _core.WeightStore("cpu")
    for name, shape in shapes.items():
        a = np.zeros(shape, np.float32)
        if kinds[name]:
            store.set_matrix(name, a, "F32", shape[0] if len(shape) == 3 else 1, shape[-2], shape[-1])
        else:
            store.set_vector(name, a)
    return store


def test_the_engine_resolves_exactly_the_listed_tensors(cfg):
    specs = model_tensors(cfg)
    shapes = {spec.name: spec.shape for spec in specs}
    assert len(shapes) == len(specs)  # no name twice
    _core.Engine.create(cfg.to_core(), store_of(cfg, shapes))
    for spec in specs:  # each listed tensor is needed, with its listed shape
        with pytest.raises(LilyError, match=f"missing tensor '{spec.name}'"):
            _core.Engine.create(cfg.to_core(), store_of(cfg, {n: s for n, s in shapes.items() if n != spec.name}))
        wrong = spec.shape[:-1] + (spec.shape[-1] + 1,)
        with pytest.raises(LilyError, match=f"tensor '{spec.name}' has shape"):
            _core.Engine.create(cfg.to_core(), store_of(cfg, {**shapes, spec.name: wrong}))


def test_the_table_matches_the_model_description(cfg):
    """docs/model.md section 4.1 for one layer of each kind, in Hugging Face checkpoint order."""
    H, V, E, I = cfg.hidden_size, cfg.vocab_size, cfg.num_experts, cfg.moe_intermediate_size
    table = {spec.name: spec.shape for spec in model_tensors(cfg)}
    gdn, attn = cfg.layer_types.index("linear_attention"), cfg.layer_types.index("full_attention")
    assert list(table)[:5] == ["embed_tokens", "norm", "lm_head", "layers.0.input_layernorm",
                               "layers.0.post_attention_layernorm"]
    assert table["embed_tokens"] == table["lm_head"] == (V, H)
    assert table[f"layers.{gdn}.linear_attn.in_proj_qkv"] == (cfg.conv_dim, H)
    assert table[f"layers.{gdn}.linear_attn.conv1d"] == (cfg.conv_dim, cfg.linear_conv_kernel_dim)
    assert table[f"layers.{attn}.self_attn.q_proj"] == (2 * cfg.num_attention_heads * cfg.head_dim, H)
    assert table[f"layers.{attn}.mlp.experts.down_proj"] == (E, H, I)
    per_layer = {"linear_attention": 2 + 9 + 8, "full_attention": 2 + 6 + 8}
    vision = 0
    if cfg.vision is not None:  # section 8: patch embedding (2), positions, 12 per block, merger (6)
        v = cfg.vision
        vision = 2 + 1 + 12 * v.depth + 6
        assert list(table)[-vision:][:3] == ["visual.patch_embed.proj", "visual.patch_embed.proj.bias", "visual.pos_embed"]
        assert table["visual.patch_embed.proj"] == (v.hidden_size, v.patch_dim)
        assert table["visual.blocks.0.attn.qkv"] == (3 * v.hidden_size, v.hidden_size)
        assert table["visual.merger.linear_fc1"] == (4 * v.hidden_size, 4 * v.hidden_size)
        assert table["visual.merger.linear_fc2"] == (H, 4 * v.hidden_size)
    assert len(table) == 3 + sum(per_layer[t] for t in cfg.layer_types) + vision


def test_matrix_leaves_name_the_tables_matrices(cfg):
    """quantization_of decides by leaf name (stored names include switch_mlp and per-expert ones):
    its set of matrix leaves is exactly the table's matrices."""
    specs = [s for s in model_tensors(cfg) if not s.name.startswith("visual.")]  # never quantized
    assert {s.name.rpartition(".")[2] for s in specs if s.is_matrix} == MATRIX_LEAVES
    assert not {s.name.rpartition(".")[2] for s in specs if not s.is_matrix} & MATRIX_LEAVES
