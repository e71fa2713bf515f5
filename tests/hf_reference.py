"""Tiny random Qwen3_5Moe models from transformers (the external truth), saved as checkpoints.

Weights are drawn so every path matters: norm weights away from their neutral value, A_log and
dt_bias varied, router logits spread. Built in float32 with eager attention and eager experts.
"""
from __future__ import annotations

import json
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


def build_model(seed: int = 0, **overrides) -> Qwen3_5MoeForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3_5MoeTextConfig(**text_config(**overrides))
    config._attn_implementation = "eager"
    model = Qwen3_5MoeForCausalLM(config).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(1, 16, generator=g)))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif "norm" in name:  # zero-centred norms store w (applied 1+w); linear_attn.norm is plain
                base = 1.0 if name.endswith("linear_attn.norm.weight") else 0.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(fan_in))
    return model


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
