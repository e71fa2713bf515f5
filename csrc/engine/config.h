// The text-model hyper-parameters, with Hugging Face's names (see docs/glossary.md for the short
// math names used inside ops: H, Hk, Hv, Dk, Dv, E, K, ...).
#pragma once
#include <string>
#include <vector>

namespace lily {

struct ModelConfig {
  int hidden_size = 0;
  int num_hidden_layers = 0;
  int vocab_size = 0;
  std::vector<int> is_full_attention;  // [num_hidden_layers] 1 = gated attention, 0 = Gated DeltaNet
  // gated full attention
  int num_attention_heads = 0;
  int num_key_value_heads = 0;
  int head_dim = 0;
  int rotary_dim = 0;  // int(head_dim * partial_rotary_factor)
  double rope_theta = 0;
  // Gated DeltaNet
  int linear_num_key_heads = 0;
  int linear_num_value_heads = 0;
  int linear_key_head_dim = 0;
  int linear_value_head_dim = 0;
  int linear_conv_kernel_dim = 0;
  // MoE
  int num_experts = 0;
  int num_experts_per_tok = 0;
  int moe_intermediate_size = 0;
  int shared_expert_intermediate_size = 0;
  float rms_norm_eps = 1e-6f;

  // Throws lily::Error naming the first inconsistent field.
  void validate() const;

  int key_dim() const { return linear_num_key_heads * linear_key_head_dim; }
  int value_dim() const { return linear_num_value_heads * linear_value_head_dim; }
  int conv_dim() const { return 2 * key_dim() + value_dim(); }
  int q_proj_dim() const { return 2 * num_attention_heads * head_dim; }  // query + gate per head
  int kv_dim() const { return num_key_value_heads * head_dim; }
  int attn_dim() const { return num_attention_heads * head_dim; }
};

}  // namespace lily
