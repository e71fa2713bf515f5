#include "config.h"

#include "../runtime/common.h"

namespace lily {

void ModelConfig::validate() const {
  auto positive = [](int v, const char* name) {
    LILY_CHECK(v > 0, "config: ", name, " must be positive, got ", v);
  };
  positive(hidden_size, "hidden_size");
  positive(num_hidden_layers, "num_hidden_layers");
  positive(vocab_size, "vocab_size");
  positive(num_attention_heads, "num_attention_heads");
  positive(num_key_value_heads, "num_key_value_heads");
  positive(head_dim, "head_dim");
  positive(linear_num_key_heads, "linear_num_key_heads");
  positive(linear_num_value_heads, "linear_num_value_heads");
  positive(linear_key_head_dim, "linear_key_head_dim");
  positive(linear_value_head_dim, "linear_value_head_dim");
  positive(linear_conv_kernel_dim, "linear_conv_kernel_dim");
  positive(num_experts, "num_experts");
  positive(num_experts_per_tok, "num_experts_per_tok");
  positive(moe_intermediate_size, "moe_intermediate_size");
  positive(shared_expert_intermediate_size, "shared_expert_intermediate_size");
  LILY_CHECK(int(is_full_attention.size()) == num_hidden_layers, "config: layer_types has ",
             is_full_attention.size(), " entries but num_hidden_layers is ", num_hidden_layers);
  LILY_CHECK(num_attention_heads % num_key_value_heads == 0, "config: num_attention_heads (",
             num_attention_heads, ") is not a multiple of num_key_value_heads (", num_key_value_heads, ")");
  LILY_CHECK(linear_num_value_heads % linear_num_key_heads == 0, "config: linear_num_value_heads (",
             linear_num_value_heads, ") is not a multiple of linear_num_key_heads (", linear_num_key_heads, ")");
  LILY_CHECK(num_experts_per_tok <= num_experts, "config: num_experts_per_tok (", num_experts_per_tok,
             ") exceeds num_experts (", num_experts, ")");
  LILY_CHECK(rotary_dim >= 0 && rotary_dim <= head_dim && rotary_dim % 2 == 0,
             "config: rotary dims (head_dim * partial_rotary_factor = ", rotary_dim,
             ") must be even and at most head_dim ", head_dim);
  LILY_CHECK(rope_theta > 0, "config: rope_theta must be positive");
  LILY_CHECK(rms_norm_eps > 0, "config: rms_norm_eps must be positive");
  if (vision.present()) vision.validate(hidden_size);
}

int VisionConfig::grid_side() const {
  int s = 0;
  while ((s + 1) * (s + 1) <= num_position_embeddings) ++s;
  return s;
}

void VisionConfig::validate(int text_hidden) const {
  auto positive = [](int v, const char* name) {
    LILY_CHECK(v > 0, "config: vision_config.", name, " must be positive, got ", v);
  };
  positive(hidden_size, "hidden_size");
  positive(intermediate_size, "intermediate_size");
  positive(num_heads, "num_heads");
  positive(in_channels, "in_channels");
  positive(patch_size, "patch_size");
  positive(temporal_patch_size, "temporal_patch_size");
  positive(spatial_merge_size, "spatial_merge_size");
  positive(num_position_embeddings, "num_position_embeddings");
  LILY_CHECK(hidden_size % num_heads == 0 && head_dim() % 4 == 0, "config: vision_config.hidden_size (",
             hidden_size, ") must split into num_heads (", num_heads, ") heads of a multiple of 4 dims");
  LILY_CHECK(grid_side() * grid_side() == num_position_embeddings,
             "config: vision_config.num_position_embeddings (", num_position_embeddings, ") must be a square");
  LILY_CHECK(out_hidden_size == text_hidden, "config: vision_config.out_hidden_size (", out_hidden_size,
             ") must equal the text model's hidden_size (", text_hidden, ")");
  LILY_CHECK(rope_theta > 0, "config: vision_config.rope_theta must be positive");
}

}  // namespace lily
