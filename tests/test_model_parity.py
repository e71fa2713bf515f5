"""The CPU backend equals transformers' Qwen3_5MoeForCausalLM (fp32, eager) on tiny random configs,
for the prompt and 8 cached decode steps, loaded from every checkpoint layout lily reads."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest

import lily
from checks import TOL, assert_logits_close
from hf_reference import build_model, mlx_to_torch_state, reference_logits, save_hf
from lily.checkpoint.safetensors_io import LazyTensor, save_sharded

# Odd sizes on purpose: prompts cross the 64-token GDN chunk of the reference, several attention
# layers, top-k < experts, GQA groups of 1, 2 and 3, value heads per key head 1..3.
CONFIGS = {
    "base": dict(),
    "wide": dict(vocab_size=1001, hidden_size=96, num_hidden_layers=8, num_attention_heads=6,
                 num_key_value_heads=2, head_dim=24, linear_num_key_heads=3, linear_num_value_heads=9,
                 linear_key_head_dim=12, linear_value_head_dim=20, num_experts=7, num_experts_per_tok=4,
                 moe_intermediate_size=36, shared_expert_intermediate_size=28),
    "attn_first": dict(num_hidden_layers=3, layer_types=["full_attention", "linear_attention", "full_attention"],
                       num_attention_heads=3, num_key_value_heads=1, head_dim=40, linear_num_key_heads=4,
                       linear_num_value_heads=4, num_experts=5, num_experts_per_tok=1,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5}),
}
PROMPT_LEN = {"base": 70, "wide": 130, "attn_first": 67}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request, tmp_path_factory):
    name = request.param
    model = build_model(seed=len(name), **CONFIGS[name])
    path = save_hf(model, tmp_path_factory.mktemp(f"hf-{name}"))
    rng = np.random.default_rng(7)
    V = model.config.vocab_size
    prompt = rng.integers(0, V, PROMPT_LEN[name]).tolist()
    decode = rng.integers(0, V, 8).tolist()
    ref = reference_logits(model, prompt, decode)[len(prompt) - 1:]  # [1 + 8, V]
    return dict(name=name, model=model, path=path, prompt=prompt, decode=decode, ref=ref)


def run_lily(path, prompt, decode, **load_args) -> np.ndarray:
    m = lily.Model.load(path, device="cpu", **load_args)
    rows = [m.prefill(prompt)] + [m.decode_step(t) for t in decode]
    return np.stack(rows)


def fused_copy(case, dest, shard_size=None):
    """The same weights in the layout Qwen publishes: model.language_model.* with fused experts."""
    state = case["model"].state_dict()
    tensors = {}
    for name, t in state.items():
        stored = name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name
        a = t.detach().float().numpy().copy()
        tensors[stored] = LazyTensor("F32", a.shape, lambda a=a: a)
    save_sharded(dest, tensors, shard_size=shard_size or (1 << 40))
    (dest / "config.json").write_text((case["path"] / "config.json").read_text())
    return dest


def test_hf_layout_per_expert(case):
    assert_logits_close(run_lily(case["path"], case["prompt"], case["decode"]), case["ref"], TOL["cpu_vs_hf_fp32"])


def test_hf_layout_fused_experts_sharded(case, tmp_path):
    path = fused_copy(case, tmp_path, shard_size=20_000)
    assert (path / "model.safetensors.index.json").is_file()
    assert len(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]) > 10
    ours = run_lily(path, case["prompt"], case["decode"], prefill_chunk=16)
    assert_logits_close(ours, case["ref"], TOL["cpu_vs_hf_fp32"])


@pytest.mark.parametrize("quantize, bits, group", [(False, 0, 0), (True, 4, 32), (True, 8, 64)])
def test_mlx_layout(case, tmp_path, quantize, bits, group):
    from lily.checkpoint.convert import convert_hf_to_mlx

    path = convert_hf_to_mlx(case["path"], tmp_path / "mlx", bits=bits or 4, group_size=group or 64,
                             quantize=quantize, dtype="bfloat16" if quantize else "float32")
    qblock = json.loads((path / "config.json").read_text()).get("quantization")
    assert (qblock is not None) == quantize
    # The reference model gets exactly the weights the checkpoint holds (dequantized, bf16-rounded).
    ref_model = copy.deepcopy(case["model"])
    missing, unexpected = ref_model.load_state_dict(mlx_to_torch_state(path), strict=False)
    assert not unexpected and set(missing) <= {"model.rotary_emb.inv_freq"}, (missing, unexpected)
    ref = reference_logits(ref_model, case["prompt"], case["decode"])[len(case["prompt"]) - 1:]
    if not quantize:
        np.testing.assert_allclose(ref, case["ref"], atol=1e-4)  # fp32 MLX copy = the original weights
    ours = run_lily(path, case["prompt"], case["decode"])
    assert_logits_close(ours, ref, TOL["cpu_vs_hf_fp32"])


def test_trace_matches_per_layer_hidden_states(case):
    """The debug trace bisects: every layer's residual stream equals transformers' hidden state."""
    import torch

    m = lily.Model.load(case["path"], device="cpu")
    tr = m.new_session().trace(case["prompt"])
    with torch.no_grad():
        hs = case["model"](torch.tensor([case["prompt"]]), output_hidden_states=True).hidden_states
    L = case["model"].config.num_hidden_layers
    names = ["embedding"] + [f"layers.{i}.residual" for i in range(L - 1)]  # the last one is normed in HF
    for name, ref in zip(names, hs):
        ref = ref[0].numpy()
        err = np.abs(tr[name] - ref).max() / max(1.0, np.abs(ref).max())
        assert err < TOL["cpu_vs_hf_fp32"], f"{name}: relative error {err:.3g}"
    assert {f"layers.{i}.{k}" for i in range(L) for k in ("mixer", "moe")} <= tr.keys()
    np.testing.assert_array_equal(tr["logits"][-1], m.prefill(case["prompt"]))


def test_real_widths_mlx_direct_codes(tmp_path):
    """The real Qwen3.6-35B-A3B widths (hidden 2048, 16/2 x 256 attention, GDN 16/32 x 128 heads,
    512-wide experts, top-8, 4-bit g64 + 8-bit gates) with 4 layers, 16 experts and a 4096 vocab,
    written by the full-size generator (packed codes drawn directly), against transformers."""
    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from lily.checkpoint import synthetic

    dims = {**synthetic.QWEN36_35B_A3B_TEXT_CONFIG, "num_experts": 16, "vocab_size": 4096}
    path = synthetic.make_checkpoint(tmp_path, dims, layout="mlx", with_tokenizer=False, num_layers=4,
                                     direct_codes=True)
    text = json.loads((path / "config.json").read_text())["text_config"]
    cfg = Qwen3_5MoeTextConfig(**{k: v for k, v in text.items() if k != "model_type"})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    ref_model = Qwen3_5MoeForCausalLM(cfg).float().eval()
    missing, unexpected = ref_model.load_state_dict(mlx_to_torch_state(path), strict=False)
    assert not unexpected and set(missing) <= {"model.rotary_emb.inv_freq"}, (missing, unexpected)
    rng = np.random.default_rng(11)
    prompt, decode = rng.integers(0, 4096, 70).tolist(), rng.integers(0, 4096, 8).tolist()
    ref = reference_logits(ref_model, prompt, decode)[len(prompt) - 1:]
    ours = run_lily(path, prompt, decode)
    assert_logits_close(ours, ref, TOL["cpu_vs_hf_fp32"])
