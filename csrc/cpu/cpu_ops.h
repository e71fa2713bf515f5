// The CPU reference backend: float32 scalar loops, readable first (style of llama2.c).
// Arguments were validated by ops/; these functions trust them.
#pragma once
#include "../ops/ops.h"

namespace lily::cpu {

void embedding(const QMatrix& table, const Tensor& ids, const Tensor& y);
void linear(const QMatrix& w, int64_t stack_index, const Tensor& x, const Tensor& y);
void rms_norm(const Tensor& x, const Tensor& weight, float eps, const Tensor& y);
void add_rms_norm(const Tensor& x, const Tensor& res, const Tensor& weight, float eps, const Tensor& y);
void gated_rms_norm(const Tensor& x, const Tensor& z, const Tensor& weight, float eps, const Tensor& y);
void conv1d_silu(const Tensor& u, const Tensor& weight, const Tensor& state, const Tensor& state_out,
                 const Tensor& y);
void gated_delta_rule(const Tensor& qkv, const Tensor& a, const Tensor& b, const Tensor& A_log,
                      const Tensor& dt_bias, const Tensor& state, const Tensor& state_out, const Tensor& o,
                      int num_key_heads, int key_head_dim);
void gdn_decode_mixer(const Tensor& qkv, const Tensor& conv_weight, const Tensor& conv_state,
                      const Tensor& conv_state_out, const Tensor& a, const Tensor& b, const Tensor& A_log,
                      const Tensor& dt_bias, const Tensor& state, const Tensor& state_out, const Tensor& z,
                      const Tensor& norm_weight, float eps, const Tensor& y, int Hk, int Dk);
void split_q_gate(const Tensor& p, const Tensor& q, const Tensor& gate, int num_heads);
void rope(const Tensor& x, int num_heads, int rotary_dim, double theta, int64_t pos0);
void kv_cache_write(const Tensor& x, const Tensor& cache, int64_t pos0);
void attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& o,
               int num_heads, int num_kv_heads, int64_t pos0);
void sigmoid_mul(const Tensor& x, const Tensor& gate);
void add(const Tensor& x, const Tensor& y);
void split_columns(const Tensor& y, const Tensor* outs, int n);
void moe(const MoeWeights& w, const Tensor& h, const Tensor& out, const ops::MoeScratch& s, int top_k);
void sample(const Tensor& logits, const ops::SamplerParams& params, uint64_t step, const ops::SamplerState& state);
void sampler_mark_seen(const Tensor& ids, const ops::SamplerState& state);
void apply_token_mask(const Tensor& logits, const Tensor& mask);

void layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps, const Tensor& y);
void add_bias(const Tensor& x, const Tensor& bias);
void gelu(const Tensor& x, bool tanh_approx);
void vision_position_embedding(const Tensor& table, const Tensor& pos, int grid_h, int grid_w, const Tensor& y);
void vision_rope(const Tensor& qkv, const Tensor& pos, int num_heads, double theta);
void vision_attention(const Tensor& qkv, const Tensor& o, const Tensor& starts, int num_heads);
void mrope(const Tensor& x, int num_heads, int rotary_dim, double theta, const std::array<int, 3>& sections,
           const Tensor& pos);

// Row r of stack entry e of w, dequantized to float32: out [cols].
void dequantize_row(const QMatrix& w, int64_t e, int64_t r, float* out);

}  // namespace lily::cpu
