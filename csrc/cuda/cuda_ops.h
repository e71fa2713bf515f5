// The CUDA backend's op entries (sm_90a). Host-only declarations: ops/*.cpp include this without
// CUDA headers. Arguments were validated by ops/; launchers check only what the kernels assume
// (alignment, supported variants) and launch on the backend's stream (runtime/cuda_device.h) with no host
// synchronisation and no allocation, so every op can be captured in a CUDA graph.
// Activations are F32 in device memory; matrix operands are rounded to BF16 where tensor cores
// multiply them; accumulation is F32. Positions are read from device memory (I32 [1]).
#pragma once
#include "../ops/ops.h"

namespace lily::cuda {

// linear.cu / kernels/linear_*.cuh
void embedding(const QMatrix& table, const Tensor& ids, const Tensor& y);
void linear(const QMatrix& w, int64_t stack_index, const Tensor& x, const Tensor& y, const Tensor& workspace);
int64_t linear_workspace_elems(int64_t T, int64_t in);  // to allocate: X as bf16 + split-K room (short prompts)
int64_t linear_x_elems(int64_t T, int64_t in);          // the least a workspace may hold: X as bf16
bool linear_xb_supported(const QMatrix& w, int64_t T);  // linear_xb takes w over T rows (the wgmma GEMM)
// ops::linear_stack_supported on CUDA; LINEAR_STACK_MAX_ROWS: its T bound (an estimate: the copy's cost grows
// with T, the products' fixed costs it saves do not).
constexpr int64_t LINEAR_STACK_MAX_ROWS = 512;
bool linear_stack_supported(const QMatrix& stacked, int64_t T);
void linear_xb(const QMatrix& w, const Tensor& workspace, const Tensor& y);
void linear_add_rms_norm(const QMatrix& w, const Tensor& x, const Tensor& res, const Tensor& weight, float eps,
                         const Tensor& y, const Tensor& tmp, const Tensor& workspace, const Tensor& sync);
void linear_add(const QMatrix& w, const Tensor& x, const Tensor& res, const Tensor& tmp, const Tensor& workspace);
void linear_bias(const QMatrix& w, const Tensor& x, const Tensor& bias, const Tensor& y, const Tensor& workspace);
void linear_bias_gelu(const QMatrix& w, const Tensor& x, const Tensor& bias, const Tensor& y, const Tensor& workspace);
bool linear_bias_xb_supported(const QMatrix& w, int64_t T);  // the dense wgmma GEMM takes w over T rows
void linear_bias_gelu_xb(const QMatrix& w, const Tensor& xb, const Tensor& bias, const Tensor& yb);
void linear_bias_xb(const QMatrix& w, const Tensor& xb, const Tensor& bias, const Tensor& y);
void linear_rms_normed(const QMatrix& w, const Tensor& x, const Tensor& weight, float eps, const Tensor& h,
                       const Tensor& y, const Tensor& workspace);
bool linear_rms_normed_supported(const QMatrix& w, const Tensor& x, const Tensor& weight, const Tensor& h);
// moe.cu / kernels/moe_*.cuh
void moe(const MoeWeights& w, const Tensor& h, const Tensor& out, const ops::MoeScratch& s, int top_k,
         ops::MoeInput h_in);
bool moe_xb_only_supported(const MoeWeights& w, const Tensor& h, const ops::MoeScratch& s, int top_k);
void moe_add_rms_norm_xb(const MoeWeights& w, const Tensor& h, ops::MoeInput h_in, const Tensor& res,
                         const Tensor& weight, float eps, const Tensor& y, const Tensor& tmp, const ops::MoeScratch& s,
                         int top_k);
void moe_add(const MoeWeights& w, const Tensor& h, const Tensor& res, const Tensor& tmp, const ops::MoeScratch& s,
             int top_k);
void moe_rms_normed_add(const MoeWeights& w, const Tensor& res, const Tensor& weight, float eps, const Tensor& h,
                        const Tensor& tmp, const ops::MoeScratch& s, int top_k);
bool moe_rms_normed_supported(const MoeWeights& w, const Tensor& res, const Tensor& weight, const Tensor& h,
                              const ops::MoeScratch& s, int top_k);
bool router_fold_supported(const QMatrix& router_gates, const Tensor& weight, const QMatrix& out_proj);
void router_fold(const QMatrix& router_gates, const Tensor& weight, const QMatrix& out_proj, const QMatrix& fold);
bool linear_add_moe_supported(const QMatrix& o, const Tensor& x, const MoeWeights& w, const Tensor& res,
                              const Tensor& weight, const Tensor& h, const ops::MoeScratch& s, int top_k);
void linear_add_moe_rms_normed_add(const QMatrix& o, const Tensor& x, const MoeWeights& w, const Tensor& res,
                                   const Tensor& weight, float eps, const Tensor& h, const Tensor& tmp,
                                   const ops::MoeScratch& s, int top_k);
bool linear_add_late_supported(const QMatrix& w, const Tensor& x);
void linear_late(const QMatrix& w, const Tensor& x, const Tensor& y);
void moe_add_rms_norm(const MoeWeights& w, const Tensor& h, const Tensor& res, const Tensor& weight, float eps,
                      const Tensor& tmp, const ops::MoeScratch& s, int top_k, const Tensor& sync);
int64_t moe_routing_words(int64_t C, int64_t E, int top_k);
int64_t moe_xb_elems(int64_t C, int64_t H, int64_t I, int64_t Is, int top_k);
int64_t moe_xb_min_elems(int64_t C, int64_t H, int64_t I, int64_t Is, int top_k);  // the least moe accepts
// norms.cu, elementwise.cu, gated_delta.cu
void rms_norm(const Tensor& x, const Tensor& weight, float eps, const Tensor& y);
void add_rms_norm(const Tensor& x, const Tensor& res, const Tensor& weight, float eps, const Tensor& y);
void add_rms_norm_xb(const Tensor& x, const Tensor& res, const Tensor& weight, float eps, const Tensor& y,
                     const Tensor& xb);
void gated_rms_norm(const Tensor& x, const Tensor& z, const Tensor& weight, float eps, const Tensor& y);
void gated_rms_norm_xb(const Tensor& x, const Tensor& z, const Tensor& weight, float eps, const Tensor& xb);
void sigmoid_mul(const Tensor& x, const Tensor& gate);
void add(const Tensor& x, const Tensor& y);
void split_columns(const Tensor& y, const Tensor* outs, int n);
void conv1d_silu(const Tensor& u, const Tensor& weight, const Tensor& state, const Tensor& state_out,
                 const Tensor& y);
void gated_delta_rule(const Tensor& qkv, const Tensor& a, const Tensor& b, const Tensor& A_log,
                      const Tensor& dt_bias, const Tensor& state, const Tensor& state_out, const Tensor& o,
                      const Tensor& workspace, int num_key_heads, int key_head_dim);
int64_t gated_delta_workspace_floats(int64_t T, int64_t Hv, int64_t Dk, int64_t Dv);
void gdn_decode_mixer(const Tensor& qkv, const Tensor& conv_weight, const Tensor& conv_state,
                      const Tensor& conv_state_out, const Tensor& a, const Tensor& b, const Tensor& A_log,
                      const Tensor& dt_bias, const Tensor& state, const Tensor& state_out, const Tensor& z,
                      const Tensor& norm_weight, float eps, const Tensor& y, int num_key_heads, int key_head_dim);
bool gdn_decode_mixer_supported(int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv, int64_t K);
// attention.cu: pos points to the I32 position of the chunk's first token in device memory; rope_delta is
// added to it for the rotations only (ops::Position). k_cache, v_cache are BF16.
void split_q_gate(const Tensor& p, const Tensor& q, const Tensor& gate, int num_heads);
void rope(const Tensor& x, int num_heads, int rotary_dim, double theta, const int32_t* pos, int64_t rope_delta);
void mrope(const Tensor& x, int num_heads, int rotary_dim, double theta, const std::array<int, 3>& sections,
           const Tensor& pos);  // pos [T, 3] I32 in device memory
void kv_cache_write(const Tensor& x, const Tensor& cache, const int32_t* pos);
// workspace: BF16, empty or of >= T * nH * D elements (then the prefill at D = 256 runs on wgmma)
void attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& o,
               int num_heads, int num_kv_heads, const int32_t* pos, const Tensor& workspace);
// gated_attention for T = 1 in two kernels (q/k prep and the cache-row write fused into the split-KV
// decode kernel, sigmoid(gate) into its merge); _fits says whether the shapes and alignment allow it.
bool gated_attention_fits(const Tensor& p, const Tensor& k, const Tensor& v, const Tensor& q_norm,
                          const Tensor& k_norm, const Tensor& k_cache, const Tensor& v_cache, const Tensor& q,
                          const Tensor& gate, const Tensor& o, int num_heads, int num_kv_heads);
void gated_attention(const Tensor& p, const Tensor& k, const Tensor& v, const Tensor& q_norm, const Tensor& k_norm,
                     float eps, int rotary_dim, double theta, const Tensor& k_cache, const Tensor& v_cache,
                     const Tensor& q, const Tensor& gate, const Tensor& o, int num_heads, int num_kv_heads,
                     const int32_t* pos, int64_t rope_delta);
// gated_attention for a prompt at head_dim 256 where attention runs on the wgmma kernel: the q/k prep, the
// cache rows and q's bf16 (into workspace) in one kernel (kernels/attention_prep.cuh), the attention, then
// o *= sigmoid(gate) in place or (o_as_xb) as the next GEMM's bf16 X into workspace; q and gate are not
// written. _shapes: the sizes it takes (T > 1 where attention is not the split-KV kernel, head_dim 256);
// _fits: those, the workspace and alignment.
bool gated_attention_prefill_shapes(int64_t T, int64_t num_heads, int64_t num_kv_heads, int64_t D);
bool gated_attention_prefill_fits(const Tensor& p, const Tensor& k, const Tensor& v, const Tensor& q_norm,
                                  const Tensor& k_norm, const Tensor& k_cache, const Tensor& v_cache, const Tensor& o,
                                  int num_heads, int num_kv_heads, const Tensor& workspace);
void gated_attention_prefill(const Tensor& p, const Tensor& k, const Tensor& v, const Tensor& q_norm,
                             const Tensor& k_norm, float eps, int rotary_dim, double theta, const Tensor& k_cache,
                             const Tensor& v_cache, const Tensor& o, int num_heads, int num_kv_heads,
                             const int32_t* pos, int64_t rope_delta, const Tensor& workspace, bool o_as_xb);
// vision.cu / kernels/vision*.cuh: the vision tower's ops (pos and starts in device memory).
void layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps, const Tensor& y);
void layer_norm_xb(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps, const Tensor& xb);
void add_bias(const Tensor& x, const Tensor& bias);
void gelu(const Tensor& x, bool tanh_approx);
void vision_position_embedding(const Tensor& table, const Tensor& pos, int grid_h, int grid_w, const Tensor& y);
void vision_rope(const Tensor& qkv, const Tensor& pos, int num_heads, double theta);
void vision_attention(const Tensor& qkv, const Tensor& o, const Tensor& starts, int num_heads,
                      const Tensor& workspace);
int64_t vision_attention_workspace_elems(int64_t N, int64_t num_heads, int64_t head_dim);
// sample.cu
void sample(const Tensor& logits, const ops::SamplerParams& params, uint64_t step, const ops::SamplerState& state);
void sampler_mark_seen(const Tensor& ids, const ops::SamplerState& state);
void apply_token_mask(const Tensor& logits, const Tensor& mask);
void advance_position(int32_t* pos, int64_t T);

}  // namespace lily::cuda
