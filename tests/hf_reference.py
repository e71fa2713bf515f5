"""Tiny random Qwen3_5Moe models from transformers (the external truth), saved as checkpoints.

Weights are drawn so every path matters: norm weights away from their neutral value, A_log and
dt_bias varied, router logits spread. Built in float32 with eager attention and eager experts.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig


def text_config(**overrides) -> dict:
    cfg = dict(
        vocab_size=313, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=24, linear_conv_kernel_dim=4, num_experts=6, num_experts_per_tok=3,
        moe_intermediate_size=40, shared_expert_intermediate_size=48, rms_norm_eps=1e-6,
        max_position_embeddings=4096, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    )
    cfg.update(overrides)
    n = cfg["num_hidden_layers"]
    cfg.setdefault("layer_types", ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)])
    return cfg


def init_params(model, seed: int):
    """Random weights in the ranges a trained model has (decays, gates, norms around their identity), drawn
    in parameter order from one generator; the vision tower's biases, norms and positions included."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(1, 16, generator=g)))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif ".visual." in f".{name}" and (name.endswith(".bias") or "norm" in name):
                base = 1.0 if "norm" in name and name.endswith(".weight") else 0.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("pos_embed.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif "norm" in name:  # zero-centred norms store w (applied 1+w); linear_attn.norm is plain
                base = 1.0 if name.endswith("linear_attn.norm.weight") else 0.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            else:
                fan_in = p[0].numel() if p.dim() == 5 else p.shape[-1]  # the Conv3d patch embedding: C tp p p
                p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(fan_in))
    return model


def build_model(seed: int = 0, **overrides) -> Qwen3_5MoeForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3_5MoeTextConfig(**text_config(**overrides))
    config._attn_implementation = "eager"
    model = Qwen3_5MoeForCausalLM(config).float().eval()
    return init_params(model, seed)


def save_hf(model: Qwen3_5MoeForCausalLM, path: Path) -> Path:
    """Save as transformers does, plus a nested multimodal-style config.json like Qwen publishes."""
    model.save_pretrained(path, safe_serialization=True)
    flat = json.loads((path / "config.json").read_text())
    nested = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
              "tie_word_embeddings": False, "text_config": flat}
    (path / "config.json").write_text(json.dumps(nested, indent=2))
    return path


def reference_logits(model: Qwen3_5MoeForCausalLM, prompt: list[int], decode: list[int]) -> np.ndarray:
    """Logits [len(prompt) + len(decode), V]: one prefill, then cached decode steps one by one."""
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        rows, past = [out.logits[0]], out.cache
        for tok in decode:
            out = model(torch.tensor([[tok]]), cache=past, use_cache=True)
            rows.append(out.logits[0])
            past = out.cache
    return torch.cat(rows).float().numpy()


def vision_config(**overrides) -> dict:
    """A tiny vision tower with odd sizes: 3 heads of 16 dims, a 7 x 7 position grid, 8-pixel patches."""
    cfg = dict(depth=2, hidden_size=48, intermediate_size=72, num_heads=3, in_channels=3, patch_size=8,
               temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=49,
               hidden_act="gelu_pytorch_tanh", deepstack_visual_indexes=[])
    cfg.update(overrides)
    return cfg


MM_TOKEN_IDS = dict(image_token_id=300, vision_start_token_id=301, vision_end_token_id=302, video_token_id=303)


def build_multimodal_model(seed: int = 0, vision: dict | None = None, **text_overrides):
    """Qwen3_5MoeForConditionalGeneration (fp32, eager) around text_config(...) and vision_config(...),
    weights drawn as build_model's, the vision tower's LayerNorms and biases away from neutral."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    torch.manual_seed(seed)
    text = text_config(**text_overrides)
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [11, 11, 10], "mrope_interleaved": True}
    # the special ids inside the tiny vocabulary (text_config's 313 rows)
    config = Qwen3_5MoeConfig(text_config=text, vision_config=vision_config(**(vision or {})), **MM_TOKEN_IDS)
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    config.vision_config._attn_implementation = "eager"
    model = Qwen3_5MoeForConditionalGeneration(config).float().eval()
    return init_params(model, seed)


def save_multimodal(model, path: Path, processor: dict | None = None) -> Path:
    """save_pretrained (model.language_model.*, model.visual.*, lm_head) and a preprocessor_config.json."""
    model.save_pretrained(path, safe_serialization=True)
    v = model.config.vision_config
    pre = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": v.patch_size,
           "temporal_patch_size": v.temporal_patch_size, "merge_size": v.spatial_merge_size,
           "size": {"shortest_edge": 16 * 16, "longest_edge": 96 * 96},
           "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], **(processor or {})}
    (path / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
    return path


def multimodal_reference_logits(model, prompt: list[int], pixels: np.ndarray, grids: list, decode: list[int]) -> np.ndarray:
    """Logits [1 + len(decode), V]: the prompt's last row after one prefill with the images, then cached
    decode steps (positions offset by the model's rope_deltas)."""
    ids = torch.tensor([prompt])
    model.model.rope_deltas = None
    with torch.no_grad():
        out = model(input_ids=ids, pixel_values=torch.from_numpy(pixels), image_grid_thw=torch.tensor(grids),
                    mm_token_type_ids=(ids == model.config.image_token_id).int(), use_cache=True)
        rows, past = [out.logits[0, -1:]], out.cache
        for tok in decode:
            out = model(input_ids=torch.tensor([[tok]]), cache=past, use_cache=True)
            rows.append(out.logits[0])
            past = out.cache
    return torch.cat(rows).float().numpy()


def mlx_to_torch_state(path: Path, text_prefix: str = "model.") -> dict:
    """Dequantized float32 weights of an MLX-layout checkpoint under transformers' parameter names: the text
    model's under ``text_prefix`` (``model.`` for Qwen3_5MoeForCausalLM, ``model.language_model.`` for the
    multimodal class), other tensors (``model.visual.*``) under their stored names."""
    from lily.checkpoint import quant
    from lily.checkpoint.dtypes import decode_float
    from lily.checkpoint.safetensors_io import SafetensorsFile, find_shards

    raw, infos = {}, {}
    for f in find_shards(path):
        st = SafetensorsFile(f)
        for n in st.names():
            raw[n], infos[n] = np.array(st.get(n)), st.info(n).dtype
    state = {}
    for n in raw:
        if n.endswith((".scales", ".biases")):
            continue
        if infos[n] == "U32":
            m = n[: -len(".weight")]
            s = decode_float(infos[m + ".scales"], raw[m + ".scales"])
            b = decode_float(infos[m + ".biases"], raw[m + ".biases"])
            cfg = json.loads((path / "config.json").read_text())["quantization"]
            q = cfg.get(m, {"bits": cfg["bits"], "group_size": cfg["group_size"]})
            a = quant.dequantize(raw[n], s, b, q["bits"], q["group_size"])
        else:
            a = decode_float(infos[n], raw[n])
        name = n.replace("language_model.model.", text_prefix, 1).replace("language_model.lm_head", "lm_head", 1)
        if name.endswith("conv1d.weight"):
            a = a.transpose(0, 2, 1)  # MLX [C, K, 1] -> HF [C, 1, K]
        if re.search(r"(model\.norm|input_layernorm|post_attention_layernorm|q_norm|k_norm)\.weight$", name):
            a = a - 1.0  # MLX stores 1 + w
        state[name] = a
    for n in [k for k in state if ".switch_mlp.gate_proj" in k]:
        layer = n.split(".switch_mlp.")[0]
        state[layer + ".experts.gate_up_proj"] = np.concatenate(
            [state.pop(n), state.pop(layer + ".switch_mlp.up_proj.weight")], axis=1)
        state[layer + ".experts.down_proj"] = state.pop(layer + ".switch_mlp.down_proj.weight")
    return {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in state.items()}
