// One checked entry per op of the forward pass. Each entry validates shapes, dtypes and devices
// and raises lily::Error naming the problem, then dispatches to the backend of the tensors' device
// (cpu/<op>.cpp; cuda/<op>.cu when built). Kernels never validate; these entries always do.
// Activations are float32 [rows, cols] row-major unless stated.
#pragma once
#include "../core/config.h"
#include "../core/tensor.h"
#include "../core/weights.h"

namespace lily::ops {

// y[t, :] = dequant(table)[ids[t], :].  ids [T] I32, y [T, H].
void embedding(const QMatrix& table, const Tensor& ids, const Tensor& y);

// y[t, o] = sum_i W_e[o, i] * x[t, i] for stack entry e.  x [T, in], y [T, out].
void linear(const QMatrix& w, int64_t stack_index, const Tensor& x, const Tensor& y);

// y[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * weight.  x, y [R, D]; weight [D] (the full
// multiplier: 1+w for Qwen's zero-centred norms).  y may alias x.
void rms_norm(const Tensor& x, const Tensor& weight, float eps, const Tensor& y);

// y[r, :] = weight * rms_normalise(x[r, :]) * silu(z[r, :]).  x, z, y [R, D]; weight [D].
void gated_rms_norm(const Tensor& x, const Tensor& z, const Tensor& weight, float eps, const Tensor& y);

// Causal depthwise conv over time then SiLU, continuing from state:
// y[t, c] = silu(sum_j w[c, j] * u[t - K + 1 + j, c]), earlier inputs from state [K-1, C]
// (oldest first); the state then holds the last K-1 inputs.  u, y [T, C]; w [C, K].
void conv1d_silu(const Tensor& u, const Tensor& weight, const Tensor& state, const Tensor& y);

// The Gated DeltaNet recurrence over T tokens, fp32 state S [Hv, Dk, Dv] updated in place.
// qkv [T, 2*Hk*Dk + Hv*Dv] (q | k | v, head-major), a, b [T, Hv], A_log, dt_bias [Hv], o [T, Hv*Dv].
void gated_delta_rule(const Tensor& qkv, const Tensor& a, const Tensor& b, const Tensor& A_log,
                      const Tensor& dt_bias, const Tensor& state, const Tensor& o, int num_key_heads,
                      int key_head_dim);

// Splits q_proj's per-head [query | gate] rows.  p [T, nH*2D] -> q, gate [T, nH*D].
void split_q_gate(const Tensor& p, const Tensor& q, const Tensor& gate, int num_heads);

// Rotate-half RoPE on the first rotary_dim dims of every head, token t at position pos0 + t.
// x [T, n*D] in place.
void rope(const Tensor& x, int num_heads, int rotary_dim, double theta, int64_t pos0);

// cache[pos0 + t, :] = x[t, :].  x [T, nKV*D]; cache [maxT, nKV*D].
void kv_cache_write(const Tensor& x, const Tensor& cache, int64_t pos0);

// Causal GQA attention of T new queries over cache positions [0, pos0 + t].
// q, o [T, nH*D]; k_cache, v_cache [maxT, nKV*D]; scale = 1/sqrt(D).
void attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& o,
               int num_heads, int num_kv_heads, int64_t pos0);

// x *= sigmoid(gate), elementwise.  x, gate [R, C].
void sigmoid_mul(const Tensor& x, const Tensor& gate);

// x += y.  x, y [R, C].
void add(const Tensor& x, const Tensor& y);

// Work space of the MoE op for up to C tokens, allocated with the session.
struct MoeScratch {
  Tensor router_logits;  // [C, E]
  Tensor gathered;       // [C, H]  tokens routed to one expert
  Tensor gate, up;       // [C, max(I, Is)]
  Tensor down;           // [C, H]
  Tensor shared_gate;    // [C, 1]
};

// out[t] = sum_{e in top-k(softmax(router h[t]))} w_e * down_e(silu(gate_e h) * up_e h)
//        + sigmoid(shared_expert_gate h[t]) * shared(h[t]);  weights renormalised over the top-k.
// h, out [T, H].
void moe(const MoeWeights& w, const Tensor& h, const Tensor& out, const MoeScratch& scratch, int top_k);

}  // namespace lily::ops
