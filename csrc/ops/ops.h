// One checked entry per op of the forward pass. Each entry validates shapes, dtypes and devices
// and raises lily::Error naming the problem, then dispatches to the backend of the tensors' device
// (cpu/<op>.cpp; cuda/<op>.cu when built). Kernels never validate; these entries always do.
// Activations are float32 [rows, cols] row-major unless stated.
#pragma once
#include "../runtime/tensor.h"
#include "weights.h"

namespace lily::ops {

// Where a chunk starts in the sequence. The CPU backend reads `host`; GPU backends read `device`
// (an I32 [1] in device memory) so that a captured decode graph replays at any position. The
// engine keeps the two equal; `host` also bounds work on the GPU (positions never exceed it).
// rope_delta: the rotary ops (rope, gated_attention) turn token t by position + t + rope_delta, while
// caches and attention index rows by position + t (text after an image, docs/model.md section 8.5;
// 0 otherwise). GPU kernels take it as an argument: a captured graph holds the delta it was captured with.
struct Position {
  int64_t host = 0;
  const int32_t* device = nullptr;
  int64_t rope_delta = 0;
};

// y[t, :] = dequant(table)[ids[t], :].  ids [T] I32, y [T, H].
void embedding(const QMatrix& table, const Tensor& ids, const Tensor& y);

// y[t, o] = sum_i W_e[o, i] * x[t, i] for stack entry e.  x [T, in], y [T, out].
// workspace [linear_workspace_elems(device, T, in)] BF16: on CUDA the prefill GEMM's bf16 copy of x, then
// room for split-K partials of short prompts (docs/cuda.md; optional: at least T x in is accepted); on the
// CPU that size is 0: it is not read and may be an empty tensor.
void linear(const QMatrix& w, int64_t stack_index, const Tensor& x, const Tensor& y, const Tensor& workspace);
// The same for a single matrix (a stack of one).
inline void linear(const QMatrix& w, const Tensor& x, const Tensor& y, const Tensor& workspace) {
  linear(w, 0, x, y, workspace);
}
// BF16 elements of linear's workspace for x [T, in]; 0 where the backend needs none. Non-decreasing in
// T and in, so a buffer sized for the largest chunk and input serves every call.
int64_t linear_workspace_elems(Device device, int64_t T, int64_t in);
// res += x W^T: a block's output projection joining the residual stream. Equal to linear(w, x, tmp, workspace)
// then add(res, tmp), bit for bit on each backend (CUDA, one token on the tensor-core GEMV: one kernel, the
// add in its epilogue). x [T, in]; res, tmp [T, out] (tmp: work space, contents unspecified after; no two
// of x, res, tmp alias); workspace as linear's.
void linear_add(const QMatrix& w, const Tensor& x, const Tensor& res, const Tensor& tmp, const Tensor& workspace);
// y = x W^T + bias: a biased product (the vision tower's). Equal to linear(w, x, y, workspace) then
// add_bias(y, bias), bit for bit on each backend (CUDA, dense BF16 weights on the dense wgmma GEMM: one
// kernel, the add in its epilogue). x [T, in]; bias [out] F32; y [T, out]; workspace as linear's.
void linear_bias(const QMatrix& w, const Tensor& x, const Tensor& bias, const Tensor& y, const Tensor& workspace);
// y = gelu_tanh(x W^T + bias): the vision tower's fc1 and its activation. Equal to linear_bias(w, x, bias,
// y, workspace) then gelu(y, true), bit for bit on each backend (CUDA, dense BF16 weights on the dense
// wgmma GEMM: one kernel, the GELU in its epilogue). Arguments as linear_bias's.
void linear_bias_gelu(const QMatrix& w, const Tensor& x, const Tensor& bias, const Tensor& y, const Tensor& workspace);
// The tower's bf16 hand-overs (docs/cuda.md, "The dense BF16 GEMM"): X given as bf16 in xb's first T x in
// elements (BF16 [>= T*in], row-major [T, in]: the dense GEMM's X, natural k order; written by
// layer_norm_xb or by linear_bias_gelu_xb), read without the GEMM's conversion of an fp32 x, which would
// round to the same bits. linear_bias_xb(w, xb, bias, y) is linear_bias(w, x, bias, y, ws), y [T, out] F32;
// linear_bias_gelu_xb(w, xb, bias, yb) is linear_bias_gelu(w, x, bias, y, ws) with y stored as bf16_rn into
// yb [T, out] BF16 (the next product's xb; yb must not overlap xb). Only where linear_bias_xb_supported(
// device, w, T) holds (CUDA, the dense wgmma GEMM takes w for T rows; xb 16-byte aligned); elsewhere an error.
bool linear_bias_xb_supported(Device device, const QMatrix& w, int64_t T);
void linear_bias_gelu_xb(const QMatrix& w, const Tensor& xb, const Tensor& bias, const Tensor& yb);
void linear_bias_xb(const QMatrix& w, const Tensor& xb, const Tensor& bias, const Tensor& y);
// X handed over as bf16 (docs/cuda.md, "Xb hand-over"): linear(w, x, y, workspace) where x's producer has
// already written x into the workspace's first T x in elements in the prefill GEMM's bf16 layout (Xb; on
// CUDA gated_rms_norm_xb writes it). The same bits as linear converting x there. y [T, out]. Only where
// linear_xb_supported(device, w, T) holds (CUDA, w and T on the wgmma GEMM); elsewhere an error.
bool linear_xb_supported(Device device, const QMatrix& w, int64_t T);
// A layer's input projections for a prompt of T rows as one product over their stacked rows (then
// split_columns) instead of one product each: where the stacked matrix runs on the wgmma GEMM for T rows
// and T is in (DS_MAX_TOKENS, LINEAR_STACK_MAX_ROWS] (CUDA; docs/cuda.md, "Stacked input projections"):
// fewer products' fixed costs against one copy of the outputs. linear_stack_rows(device, chunk): the
// rows of the engine's stacked scratch (1 where it never holds).
bool linear_stack_supported(Device device, const QMatrix& stacked, int64_t T);
int64_t linear_stack_rows(Device device, int64_t chunk);
void linear_xb(const QMatrix& w, const Tensor& workspace, const Tensor& y);
// res += x W^T, then y = weight * rms_normalise(res) row by row: a block's output projection joining the
// residual stream, and the next RMSNorm. Equal to linear(w, x, tmp, workspace) then add_rms_norm(res, tmp,
// weight, eps, y), bit for bit on each backend (CUDA, one token: one kernel, the add in its epilogue and
// the norm by its last CTA). x [T, in]; res, y, tmp [T, out] (tmp: work space, contents unspecified
// after; no two of res, y, tmp alias); weight [out]; workspace as linear's; sync: I32 [1] device
// scratch, zero before and after.
void linear_add_rms_norm(const QMatrix& w, const Tensor& x, const Tensor& res, const Tensor& weight, float eps,
                         const Tensor& y, const Tensor& tmp, const Tensor& workspace, const Tensor& sync);
// y = (weight * rms_normalise(res)) W^T row by row: a layer's input norm and its first projection. Equal to
// rms_norm(res, weight, eps, h) then linear(w, h, y, workspace), bit for bit on each backend: CUDA, where
// linear_rms_normed_supported, one kernel (every CTA of the GEMV normalises res in rms_norm's order while
// it stages it; h is not written), elsewhere those two ops. res, h [T, in] (h: work space, contents
// unspecified after; aliases neither res nor y); weight [in]; y [T, out]; workspace as linear's.
void linear_rms_normed(const QMatrix& w, const Tensor& res, const Tensor& weight, float eps, const Tensor& h,
                       const Tensor& y, const Tensor& workspace);
// Whether linear_rms_normed runs as one kernel for these operands (never on the CPU). Only then does the
// engine leave a layer's input norm to the layer's first projection (the MoE block before it runs moe_add,
// not moe_add_rms_norm): elsewhere the fallback's rms_norm launch would cost more than the norm it saves.
bool linear_rms_normed_supported(const QMatrix& w, const Tensor& res, const Tensor& weight, const Tensor& h);

// y[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * weight.  x, y [R, D]; weight [D] (the full
// multiplier: 1+w for Qwen's zero-centred norms).  y may alias x.
void rms_norm(const Tensor& x, const Tensor& weight, float eps, const Tensor& y);

// x[r, :] += res[r, :], then y[r, :] = weight * rms_normalise(x[r, :]): a residual add and the next
// RMSNorm in one pass, bit-identical to add() then rms_norm(). x, res, y [R, D] (y aliases neither
// x nor res); weight [D].
void add_rms_norm(const Tensor& x, const Tensor& res, const Tensor& weight, float eps, const Tensor& y);
// add_rms_norm with y also written as linear_xb's X (the prefill GEMM's bf16 X of y [R, D]) into xb
// [>= R*D] BF16: the products over y that follow read it (linear_xb, moe with MoeInput::F32_AND_XB)
// instead of converting y. y absent (Tensor{}): y only as that X, its F32 rows not written, where no
// reader takes them (moe with MoeInput::XB, a layer's projections all on linear_xb); x and xb are the
// same bits as with y (given y's rows 16-byte aligned, as x's and weight: the same float4 sums). CUDA
// only; D % 8 == 0, xb 16-byte aligned.
void add_rms_norm_xb(const Tensor& x, const Tensor& res, const Tensor& weight, float eps, const Tensor& y,
                     const Tensor& xb);

// y[r, :] = weight * rms_normalise(x[r, :]) * silu(z[r, :]).  x, z, y [R, D]; weight [D].
void gated_rms_norm(const Tensor& x, const Tensor& z, const Tensor& weight, float eps, const Tensor& y);
// gated_rms_norm with y written as linear_xb's X instead: xb [>= R*D] BF16 holds y [R, D] (equally the
// matrix [R*D/n, n] for any n that D divides) as the prefill GEMM's bf16 X. CUDA only; D % 8 == 0 and
// 16-byte aligned rows of x, z, weight and xb.
void gated_rms_norm_xb(const Tensor& x, const Tensor& z, const Tensor& weight, float eps, const Tensor& xb);

// Causal depthwise conv over time then SiLU, continuing from state:
// y[t, c] = silu(sum_j w[c, j] * u[t - K + 1 + j, c]), earlier inputs from state [K-1, C]
// (oldest first); state_out [K-1, C] then holds the last K-1 inputs.  u, y [T, C]; w [C, K].
// state_out is state itself (updated in place) or a buffer that overlaps neither state nor y (state is
// then left as it was: a decode step that can be taken back, docs/generation.md "Pipelined decoding").
void conv1d_silu(const Tensor& u, const Tensor& weight, const Tensor& state, const Tensor& state_out,
                 const Tensor& y);

// The Gated DeltaNet recurrence over T tokens from the fp32 state S = state [Hv, Dk, Dv]; the state
// after the last token goes to state_out (state itself: in place; or a buffer that does not overlap it,
// as conv1d_silu's). qkv [T, 2*Hk*Dk + Hv*Dv] (q | k | v, head-major), a, b [T, Hv], A_log, dt_bias
// [Hv], o [T, Hv*Dv].
// workspace [>= gated_delta_workspace_floats(device, T, Hv, Dk, Dv)] F32: the chunked CUDA prefill's
// per-chunk tiles (docs/gdn-prefill.md); when that size is 0 (CPU, short calls, other head sizes)
// it is not read and may be an empty tensor.
void gated_delta_rule(const Tensor& qkv, const Tensor& a, const Tensor& b, const Tensor& A_log,
                      const Tensor& dt_bias, const Tensor& state, const Tensor& state_out, const Tensor& o,
                      const Tensor& workspace, int num_key_heads, int key_head_dim);
// F32 elements of gated_delta_rule's workspace for T tokens; 0 where the backend needs none.
// Non-decreasing in T, so a buffer sized for the largest chunk serves every call.
int64_t gated_delta_workspace_floats(Device device, int64_t T, int64_t Hv, int64_t Dk, int64_t Dv);

// The GDN mixer core of one decode token, exactly conv1d_silu -> gated_delta_rule -> gated_rms_norm:
//   x = conv1d_silu(qkv) (conv_state shifted into conv_state_out),
//   o = gated_delta_rule(x, a, b, A_log, dt_bias, state -> state_out),
//   y[h, :] = gated_rms_norm(o[h, :], z[h, :], norm_weight, eps) per value head h.
// qkv [1, C = 2*Hk*Dk + Hv*Dv]; conv_weight [C, K]; conv_state, conv_state_out [K-1, C]; a, b [1, Hv];
// A_log, dt_bias [Hv]; state, state_out [Hv, Dk, Dv]; z, y [1, Hv*Dv]; norm_weight [Dv]. Each *_out is
// its input (in place) or a buffer apart from it, as in the two ops. The CPU backend runs the three CPU
// ops (bit-identical to them); CUDA runs one kernel where gdn_decode_mixer_supported() says so and
// raises elsewhere (callers then run the three ops).
void gdn_decode_mixer(const Tensor& qkv, const Tensor& conv_weight, const Tensor& conv_state,
                      const Tensor& conv_state_out, const Tensor& a, const Tensor& b, const Tensor& A_log,
                      const Tensor& dt_bias, const Tensor& state, const Tensor& state_out, const Tensor& z,
                      const Tensor& norm_weight, float eps, const Tensor& y, int num_key_heads, int key_head_dim);
// Whether `device` has gdn_decode_mixer for these dims (always on the CPU).
bool gdn_decode_mixer_supported(Device device, int64_t num_key_heads, int64_t num_value_heads, int64_t key_head_dim,
                                int64_t value_head_dim, int64_t conv_kernel);

// Splits q_proj's per-head [query | gate] rows.  p [T, nH*2D] -> q, gate [T, nH*D].
void split_q_gate(const Tensor& p, const Tensor& q, const Tensor& gate, int num_heads);

// Rotate-half RoPE on the first rotary_dim dims of every head, token t at position pos0 + t + pos.rope_delta.
// x [T, n*D] in place.
void rope(const Tensor& x, int num_heads, int rotary_dim, double theta, const Position& pos);

// cache[pos0 + t, :] = x[t, :].  x [T, nKV*D] F32; cache [maxT, nKV*D] F32 (CPU) or BF16 (GPU).
void kv_cache_write(const Tensor& x, const Tensor& cache, const Position& pos);

// Causal GQA attention of T new queries over cache positions [0, pos0 + t].
// q, o [T, nH*D] F32; k_cache, v_cache [maxT, nKV*D] F32 (CPU) or BF16 (GPU); scale = 1/sqrt(D).
// workspace (optional, BF16, >= attention_workspace_elems): on CUDA at D = 256 the prefill runs on the
// wgmma kernel with q as bf16 there (docs/cuda.md, the attention row); without it, the mma.sync one.
void attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& o,
               int num_heads, int num_kv_heads, const Position& pos, const Tensor& workspace = Tensor{});
// BF16 elements of attention's workspace for T queries of nH heads of D (0: none used on this device).
int64_t attention_workspace_elems(Device device, int64_t T, int64_t num_heads, int64_t D);

// The gated-attention core of a full-attention layer, between the q|k|v and o projections:
//   q, gate = split_q_gate(p);  q = rope(rms_norm(q, q_norm));  k = rope(rms_norm(k, k_norm));
//   (rope at pos0 + t + pos.rope_delta)
//   k_cache[pos0 + t] = k;  v_cache[pos0 + t] = v;  o = attention(q, caches) * sigmoid(gate).
// Exactly that sequence of ops on the CPU (bit-identical) and wherever a backend has no fused
// form; on CUDA for T = 1 and the tensor-core head dims it is two kernels, and for a prompt at head_dim
// 256 whose attention runs on the wgmma kernel (workspace given) three, which leave q and gate unwritten
// (o and the caches: the sequence's bits; docs/cuda.md). There, o_as_xb writes the gated o as the prefill
// GEMM's bf16 X into workspace instead of o (what linear_xb reads: o_proj's product, the same bits as
// linear of o); o_as_xb elsewhere is an error (gated_attention_xb_supported says where it runs).
// p [T, nH*2D]; k, v [T, nKV*D] (k is work space: it may hold the normed, roped key afterwards);
// q_norm, k_norm [D]; q, gate, o [T, nH*D] outputs; caches and workspace as attention().
void gated_attention(const Tensor& p, const Tensor& k, const Tensor& v, const Tensor& q_norm, const Tensor& k_norm,
                     float eps, int rotary_dim, double theta, const Tensor& k_cache, const Tensor& v_cache,
                     const Tensor& q, const Tensor& gate, const Tensor& o, int num_heads, int num_kv_heads,
                     const Position& pos, const Tensor& workspace = Tensor{}, bool o_as_xb = false);
// Whether gated_attention takes o_as_xb for these shapes on `device` (given aligned tensors and the workspace).
bool gated_attention_xb_supported(Device device, int64_t T, int64_t num_heads, int64_t num_kv_heads, int64_t D);

// x *= sigmoid(gate), elementwise.  x, gate [R, C].
void sigmoid_mul(const Tensor& x, const Tensor& gate);

// x += y.  x, y [R, C].
void add(const Tensor& x, const Tensor& y);

// The column blocks of y [T, W] into parts[0..n), in order: part i [T, w_i] gets columns [sum of the widths
// before it, + w_i) (a stacked projection's output back into its parts' rows). 1 to 4 parts, widths
// summing to W; no part overlaps y.
void split_columns(const Tensor& y, const Tensor* parts, int n);

// Work space of the MoE op for up to C tokens, allocated with the session. R = rows of expert
// work: C on the CPU (one expert at a time), C*(K+1) on the GPU (all routed rows plus the shared
// expert's at once, see moe_work_rows()).
struct MoeScratch {
  Tensor router_logits;  // [C, E] F32
  Tensor gathered;       // [R, H] F32 tokens routed to one expert
  Tensor gate, up;       // [R, max(I, Is)] F32
  Tensor down;           // [R, H] F32
  Tensor shared_gate;    // [C, 1] F32
  Tensor routing;        // [moe_routing_words(C, E, K)] I32 device routing tables (GPU only)
  Tensor xb;             // [moe_xb_elems(C, H, I, Is, K)] BF16 the expert GEMMs' inputs as bf16 (GPU only;
                         // CUDA accepts less, C*max(H, K*I, Is): its down products then convert their X)
  bool moe_small = true;  // CUDA: medium prompts may take the few-rows expert kernels (kernels/moe_small.cuh);
                          // false keeps the wgmma GEMM (tests and benchmarks compare the two)
  bool down_bf16 = true;  // CUDA: a prompt's wgmma down products write bf16 rows for the combine (docs/numerics.md);
                          // false keeps them F32 (tests compare the two)
};

// Rows of expert work space, I32 words of routing tables and BF16 elements of xb a backend needs for
// C tokens (I, Is: the routed and shared experts' intermediate sizes).
int64_t moe_work_rows(Device device, int64_t C, int top_k);
int64_t moe_routing_words(Device device, int64_t C, int64_t E, int top_k);
int64_t moe_xb_elems(Device device, int64_t C, int64_t H, int64_t I, int64_t Is, int top_k);

// How moe's input h [T, H] arrives. F32: h's rows. F32_AND_XB: h's rows, and scratch.xb's first T x H
// elements hold them as the prefill GEMM's bf16 X (add_rms_norm_xb), which the CUDA wgmma products read
// instead of converting h (ignored on the CPU). XB: only that bf16 X, h's rows not written (add_rms_norm_xb
// without y; h gives the shape), where moe_xb_only_supported holds; elsewhere an error.
enum class MoeInput { F32, F32_AND_XB, XB };

// out[t] = sum_{e in top-k(softmax(router h[t]))} w_e * down_e(silu(gate_e h) * up_e h)
//        + sigmoid(shared_expert_gate h[t]) * shared(h[t]);  weights renormalised over the top-k.
// h, out [T, H]; h_in: how h arrives.
void moe(const MoeWeights& w, const Tensor& h, const Tensor& out, const MoeScratch& scratch, int top_k,
         MoeInput h_in = MoeInput::F32);
// Whether moe reads h only as the bf16 X in scratch.xb for these operands (MoeInput::XB is accepted): CUDA,
// a prompt past the decode chain (T > 16) whose every product over h runs on the wgmma GEMM (the router
// and the shared-expert gate, the shared expert's gate/up) or, the routed gate/up, on it or on the few-rows
// kernel (which then gathers that X). Never on the CPU.
bool moe_xb_only_supported(const MoeWeights& w, const Tensor& h, const MoeScratch& scratch, int top_k);
// res += moe(h): the MoE block joining the residual stream, equal to moe(w, h, tmp, ...) then add(res, tmp),
// bit for bit on each backend (CUDA, on the tensor-core decode path: the add in moe_down's kernel). h, res,
// tmp [T, H] (tmp: work space; no two alias).
void moe_add(const MoeWeights& w, const Tensor& h, const Tensor& res, const Tensor& tmp, const MoeScratch& scratch,
             int top_k);
// res += moe(weight * rms_normalise(res)) row by row: the MoE block with its input norm (the post-attention
// norm), joining the residual stream. Equal to rms_norm(res, weight, eps, h) then moe_add(w, h, res, tmp,
// ...), bit for bit on each backend: CUDA, where moe_rms_normed_supported, the fused router and moe_up
// normalise res in rms_norm's order while they stage it (h is not written) and moe_down adds into res;
// elsewhere those two ops. res, h, tmp [T, H] (h, tmp: work space, contents unspecified after; no two alias);
// weight [H].
void moe_rms_normed_add(const MoeWeights& w, const Tensor& res, const Tensor& weight, float eps, const Tensor& h,
                        const Tensor& tmp, const MoeScratch& scratch, int top_k);
// Whether moe_rms_normed_add runs without the norm kernel for these operands (never on the CPU). Only then
// does the engine leave the post-attention norm to the MoE block (the mixer's output projection runs
// linear_add, not linear_add_rms_norm).
bool moe_rms_normed_supported(const MoeWeights& w, const Tensor& res, const Tensor& weight, const Tensor& h,
                              const MoeScratch& scratch, int top_k);
// res += o x, then res += moe(weight * rms_normalise(res)): a layer's mixer output projection and its MoE block
// with the block's input norm, linear_add then moe_rms_normed_add. On CUDA where linear_add_moe_supported (one
// token, w.router_fold built), the router runs before the projection on [res ; x] through w.router_fold
// (docs/cuda.md "Early routing"): the same block in another factorisation of the router's logits, equal to the
// two ops up to f32 rounding of those logits (docs/numerics.md); elsewhere the two ops. o [H, A]; x [T, A]; the
// rest as moe_rms_normed_add's.
void linear_add_moe_rms_normed_add(const QMatrix& o, const Tensor& x, const MoeWeights& w, const Tensor& res,
                                   const Tensor& weight, float eps, const Tensor& h, const Tensor& tmp,
                                   const MoeScratch& scratch, int top_k, const Tensor& workspace);
bool linear_add_moe_supported(const QMatrix& o, const Tensor& x, const MoeWeights& w, const Tensor& res,
                              const Tensor& weight, const Tensor& h, const MoeScratch& scratch, int top_k);
// fold = router_gates diag(weight) out_proj in F32 (MoeWeights::router_fold), on CUDA where router_fold_supported.
bool router_fold_supported(const QMatrix& router_gates, const Tensor& weight, const QMatrix& out_proj);
void router_fold(const QMatrix& router_gates, const Tensor& weight, const QMatrix& out_proj, const QMatrix& fold);
// res += moe(h), then h = weight * rms_normalise(res): the MoE block joining the residual stream and the
// next layer's input norm, equal to moe(w, h, tmp, ...) then add_rms_norm(res, tmp, weight, eps, h), bit
// for bit on each backend (CUDA, one token on the tensor-core path: the add and the norm in moe_down's
// kernel). h, res, tmp [T, H] (tmp: work space; no two alias); sync as linear_add_rms_norm.
void moe_add_rms_norm(const MoeWeights& w, const Tensor& h, const Tensor& res, const Tensor& weight, float eps,
                      const Tensor& tmp, const MoeScratch& scratch, int top_k, const Tensor& sync);

// res += moe(h), then y = weight * rms_normalise(res) written as linear_xb's X (the prefill GEMM's bf16 X of
// y) into scratch.xb's first T x H elements, and as F32 rows into y unless y is absent (Tensor{}): a prompt's
// MoE block joining the residual stream and the next layer's input norm. Equal to moe(w, h, tmp, scratch,
// top_k, h_in) then add_rms_norm_xb(res, tmp, weight, eps, y, scratch.xb), bit for bit: CUDA, past the decode
// chain (T > 16) with H % 4 == 0, K <= 8 and 16-byte aligned rows, one kernel after the expert products sums
// each token's rows in moe's order, adds them into res and normalises (tmp is not written); otherwise those
// two ops. h, res, tmp [T, H]; y [T, H] or absent, and may be h (the block has read h by then); weight [H];
// tmp aliases none of them, res neither h nor y. CUDA only (the bf16 X is the CUDA prefill GEMM's operand).
void moe_add_rms_norm_xb(const MoeWeights& w, const Tensor& h, MoeInput h_in, const Tensor& res,
                         const Tensor& weight, float eps, const Tensor& y, const Tensor& tmp,
                         const MoeScratch& scratch, int top_k);

// Sampling parameters; the canonical algorithm is in docs/sampling.md and cpu/sample.cpp.
struct SamplerParams {
  float temperature = 0.f;  // 0 = greedy (argmax, lowest id on ties)
  int top_k = 0;            // 0 = off
  float top_p = 1.f;        // 1 = off
  float min_p = 0.f;        // 0 = off
  float presence_penalty = 0.f, frequency_penalty = 0.f;  // over generated tokens
  float repetition_penalty = 1.f;                         // over prompt + generated tokens
  uint64_t seed = 0;
  int num_logprobs = -1;  // -1: none; n >= 0: the chosen token's logprob and the top n
};

// Per-request sampler state on the sampler's device. counts[v]: times v was generated;
// seen[v]: 1 if v is in the prompt or was generated.
struct SamplerState {
  Tensor counts;  // [V] I32
  Tensor seen;    // [V] I32
  Tensor token;   // [1] I32 the sampled id (where the next decode step reads its input)
  Tensor logprob_ids;     // [1 + MAX_LOGPROBS] I32: the chosen id, then the top n ids
  Tensor logprob_values;  // [1 + MAX_LOGPROBS] F32: their log-softmax of the raw logits
};
constexpr int MAX_LOGPROBS = 20;

// Draws the next token from logits [V] F32 per params with uniform u = uniform01(seed, step),
// writes state.token, updates counts/seen, and fills state.logprobs when asked.
void sample(const Tensor& logits, const SamplerParams& params, uint64_t step, const SamplerState& state);

// Constrained decoding: logits[v] = -inf where bit v of mask is 0 (word v / 32, bit v % 32, the
// layout of llguidance's bitmasks). logits [V] F32, mask [W] I32 with W >= ceil(V / 32); in place.
void apply_token_mask(const Tensor& logits, const Tensor& mask);

// Marks ids [n] I32 as seen (prompt tokens for the repetition penalty).
void sampler_mark_seen(const Tensor& ids, const SamplerState& state);

// pos += T on the device (GPU backends; the CPU backend has no device position). T < 0 takes back
// tokens (a discarded decode step).
void advance_position(int32_t* pos_device, Device device, int64_t T);

// ---- The vision tower's ops (docs/model.md section 8), ops/vision.cpp; CPU and CUDA. Patches are listed in
// merge-block order: blocks of m x m patches row-major, the blocks of an image row-major; pos [N, 2] I32
// holds each patch's (row, column) in its image's grid of patches.

// y[r, :] = (x[r, :] - mean(x[r, :])) / sqrt(var(x[r, :]) + eps) * weight + bias, var the biased
// (population) variance.  x, y [R, D] (y may alias x); weight, bias [D].
void layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps, const Tensor& y);
// layer_norm with y written as the dense GEMM's X instead (linear_bias_xb, linear_bias_gelu_xb read it):
// xb [>= R*D] BF16 holds bf16_rn(y) row-major [R, D], the bits the GEMM's own conversion of y would give.
// CUDA only.
void layer_norm_xb(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps, const Tensor& xb);

// x[r, :] += bias.  x [R, D]; bias [D].
void add_bias(const Tensor& x, const Tensor& bias);

// x = gelu(x) in place, elementwise: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) when tanh_approx,
// else the exact 0.5 x (1 + erf(x / sqrt(2))).  x [R, C].
void gelu(const Tensor& x, bool tanh_approx);

// y[i, :] += the learned position table [side*side, W] resampled bilinearly (align-corners) to one image's
// grid of grid_h x grid_w patches, read at patch i's (row, column) = pos[i]: with sr = row (side-1)/(grid_h-1)
// and sc = col (side-1)/(grid_w-1) (0 for a grid of 1), the 4 table rows around (sr, sc) weighted by
// (1 - |sr - r|)(1 - |sc - c|).  y [n, W], pos [n, 2] I32.
void vision_position_embedding(const Tensor& table, const Tensor& pos, int grid_h, int grid_w, const Tensor& y);

// The 2D rotary embedding of the query and key heads of qkv [N, 3*nH*D] (q | k | v, head-major) in place.
// Per head, with F = D/4 frequencies f_j = theta^(-4j/D): dim d < D/2 turns by angle row*f_d (d < F) or
// col*f_(d-F) (d >= F), rotate-half pairs (d, d + D/2): x'_d = x_d cos - x_(d+D/2) sin,
// x'_(d+D/2) = x_(d+D/2) cos + x_d sin.  pos [N, 2] I32.
void vision_rope(const Tensor& qkv, const Tensor& pos, int num_heads, double theta);

// Multimodal RoPE (docs/model.md section 8.5): rope() with each token's own (t, h, w) positions, rotary
// frequency j (of rotary_dim/2) turning by the h position when j % 3 == 1 and j < 3 sections[1], by the w
// position when j % 3 == 2 and j < 3 sections[2], else by the t position. Equal to rope() when a token's
// three positions are equal.  x [T, n*D] in place; pos [T, 3] I32.
void mrope(const Tensor& x, int num_heads, int rotary_dim, double theta, const std::array<int, 3>& sections,
           const Tensor& pos);

// Non-causal attention of each image's patches among themselves: rows [starts[i], starts[i+1]) form
// image i. Per head h: o_t = sum_s softmax_s(q_t . k_s / sqrt(D)) v_s over the rows s of t's image.
// qkv [N, 3*nH*D] (q | k | v); o [N, nH*D]; starts [n+1] I32, 0 = starts[0] < ... < starts[n] = N.
// workspace [vision_attention_workspace_elems(device, N, nH, D)] BF16: on CUDA q, k and v as bf16 per
// head (the tensor cores' operands); on the CPU that size is 0: not read, and it may be an empty tensor.
void vision_attention(const Tensor& qkv, const Tensor& o, const Tensor& starts, int num_heads,
                      const Tensor& workspace);
int64_t vision_attention_workspace_elems(Device device, int64_t N, int64_t num_heads, int64_t head_dim);
}  // namespace lily::ops
