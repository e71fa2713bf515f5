// The text-model hyper-parameters, with Hugging Face's names (see docs/glossary.md for the short
// math names used inside ops: H, Hk, Hv, Dk, Dv, E, K, ...).
#pragma once
#include <array>
#include <string>
#include <vector>

namespace lily {

// The vision tower (docs/model.md section 8), Hugging Face's vision_config names. depth 0: the
// checkpoint has none (the text model alone).
struct VisionConfig {
  int depth = 0;                    // ViT blocks
  int hidden_size = 0;              // W, the ViT width
  int intermediate_size = 0;        // the blocks' MLP width
  int num_heads = 0;
  int in_channels = 3;
  int patch_size = 0;               // p: patches are p x p pixels
  int temporal_patch_size = 0;      // frames per patch (an image repeats its one frame)
  int spatial_merge_size = 0;       // m: the merger joins m x m patches into one text token
  int out_hidden_size = 0;          // the merger's output width: the text model's hidden_size
  int num_position_embeddings = 0;  // the learned position grid, side * side entries
  double rope_theta = 10000;        // the 2D rotary embedding's base

  bool present() const { return depth > 0; }
  int head_dim() const { return hidden_size / num_heads; }
  int patch_dim() const { return in_channels * temporal_patch_size * patch_size * patch_size; }
  int merged_dim() const { return hidden_size * spatial_merge_size * spatial_merge_size; }
  int grid_side() const;  // sqrt(num_position_embeddings)
  // Throws lily::Error naming the first inconsistent field (text_hidden: the text model's width).
  void validate(int text_hidden) const;
};

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
  // Multimodal RoPE (docs/model.md section 8.5): rotary frequency j reads the h position when
  // j % 3 == 1 and j < 3 * mrope_section[1], the w position when j % 3 == 2 and j < 3 * mrope_section[2],
  // else the t position.
  std::array<int, 3> mrope_section{11, 11, 10};
  VisionConfig vision;  // depth 0 when there is no vision tower

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
