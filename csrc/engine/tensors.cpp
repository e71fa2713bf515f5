#include "tensors.h"

namespace lily {

std::vector<TensorSpec> model_tensors(const ModelConfig& c, ModelWeights& w) {
  c.validate();
  const int64_t H = c.hidden_size, V = c.vocab_size, E = c.num_experts, I = c.moe_intermediate_size,
                Is = c.shared_expert_intermediate_size;
  std::vector<TensorSpec> t;
  auto matrix = [&t](std::string name, std::vector<int64_t> shape, const QMatrix*& view) {
    t.push_back({std::move(name), std::move(shape), &view, nullptr});
  };
  auto vector = [&t](std::string name, std::vector<int64_t> shape, const Vector*& view) {
    t.push_back({std::move(name), std::move(shape), nullptr, &view});
  };
  matrix("embed_tokens", {V, H}, w.embed_tokens);
  vector("norm", {H}, w.final_norm);
  matrix("lm_head", {V, H}, w.lm_head);
  w.layers.assign(c.num_hidden_layers, LayerWeights{});
  for (int i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    LayerWeights& L = w.layers[i];
    vector(p + "input_layernorm", {H}, L.input_layernorm);
    vector(p + "post_attention_layernorm", {H}, L.post_attention_layernorm);
    if (c.is_full_attention[i]) {
      const std::string a = p + "self_attn.";
      matrix(a + "q_proj", {c.q_proj_dim(), H}, L.attn.q_proj);  // query and output gate, interleaved per head
      matrix(a + "k_proj", {c.kv_dim(), H}, L.attn.k_proj);
      matrix(a + "v_proj", {c.kv_dim(), H}, L.attn.v_proj);
      matrix(a + "o_proj", {H, c.attn_dim()}, L.attn.o_proj);
      vector(a + "q_norm", {c.head_dim}, L.attn.q_norm);
      vector(a + "k_norm", {c.head_dim}, L.attn.k_norm);
    } else {
      const std::string g = p + "linear_attn.";
      const int64_t C = c.conv_dim(), Hv = c.linear_num_value_heads;  // conv channels: q | k | v
      matrix(g + "in_proj_qkv", {C, H}, L.gdn.in_proj_qkv);
      matrix(g + "in_proj_z", {c.value_dim(), H}, L.gdn.in_proj_z);
      matrix(g + "in_proj_b", {Hv, H}, L.gdn.in_proj_b);
      matrix(g + "in_proj_a", {Hv, H}, L.gdn.in_proj_a);
      vector(g + "conv1d", {C, c.linear_conv_kernel_dim}, L.gdn.conv1d);
      vector(g + "A_log", {Hv}, L.gdn.A_log);
      vector(g + "dt_bias", {Hv}, L.gdn.dt_bias);
      vector(g + "norm", {c.linear_value_head_dim}, L.gdn.norm);
      matrix(g + "out_proj", {H, c.value_dim()}, L.gdn.out_proj);
    }
    const std::string m = p + "mlp.";
    matrix(m + "gate", {E, H}, L.moe.router);
    matrix(m + "experts.gate_proj", {E, I, H}, L.moe.gate_proj);
    matrix(m + "experts.up_proj", {E, I, H}, L.moe.up_proj);
    matrix(m + "experts.down_proj", {E, H, I}, L.moe.down_proj);
    matrix(m + "shared_expert.gate_proj", {Is, H}, L.moe.shared_gate_proj);
    matrix(m + "shared_expert.up_proj", {Is, H}, L.moe.shared_up_proj);
    matrix(m + "shared_expert.down_proj", {H, Is}, L.moe.shared_down_proj);
    matrix(m + "shared_expert_gate", {1, H}, L.moe.shared_expert_gate);
  }
  if (!c.vision.present()) return t;
  const VisionConfig& v = c.vision;
  const int64_t W = v.hidden_size, Iv = v.intermediate_size, M = v.merged_dim();
  VisionWeights& vw = w.vision;
  auto linear = [&](const std::string& name, int64_t out, int64_t in, BiasedLinear& view) {
    matrix(name, {out, in}, view.w);
    vector(name + ".bias", {out}, view.b);
  };
  auto layer_norm = [&](const std::string& name, int64_t width, LayerNormWeights& view) {
    vector(name, {width}, view.weight);
    vector(name + ".bias", {width}, view.bias);
  };
  linear("visual.patch_embed.proj", W, v.patch_dim(), vw.patch_embed);  // Conv3d [W, C, tp, p, p] flattened
  vector("visual.pos_embed", {v.num_position_embeddings, W}, vw.pos_embed);
  vw.blocks.assign(v.depth, VisionBlockWeights{});
  for (int i = 0; i < v.depth; ++i) {
    const std::string p = "visual.blocks." + std::to_string(i) + ".";
    VisionBlockWeights& B = vw.blocks[i];
    layer_norm(p + "norm1", W, B.norm1);
    linear(p + "attn.qkv", 3 * W, W, B.qkv);
    linear(p + "attn.proj", W, W, B.proj);
    layer_norm(p + "norm2", W, B.norm2);
    linear(p + "mlp.linear_fc1", Iv, W, B.fc1);
    linear(p + "mlp.linear_fc2", W, Iv, B.fc2);
  }
  layer_norm("visual.merger.norm", W, vw.merger_norm);
  linear("visual.merger.linear_fc1", M, M, vw.merger_fc1);
  linear("visual.merger.linear_fc2", H, M, vw.merger_fc2);
  return t;
}

}  // namespace lily
