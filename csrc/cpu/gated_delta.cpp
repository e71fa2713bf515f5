// CPU Gated DeltaNet: causal conv1d + SiLU with carried state, and the fp32 delta-rule recurrence
// in its sequential (token-by-token) form, the reference the chunked GPU kernels are tested against.
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_ops.h"

namespace lily::cpu {

static inline float silu(float v) { return v / (1.f + std::exp(-v)); }

void conv1d_silu(const Tensor& u, const Tensor& weight, const Tensor& state, const Tensor& state_out,
                 const Tensor& y) {
  const int64_t T = u.dim(0), C = u.dim(1), K = weight.dim(1), S = K - 1;
  const float* U = u.ptr<float>();        // [T, C]
  const float* W = weight.ptr<float>();   // [C, K]
  const float* st = state.ptr<float>();   // [K-1, C], oldest first
  float* Y = y.ptr<float>();              // [T, C]
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t c = 0; c < C; ++c) {
      float acc = 0.f;
      for (int64_t j = 0; j < K; ++j) {
        const int64_t tau = t - S + j;  // input time of tap j; negative = carried state
        const float in = tau >= 0 ? U[tau * C + c] : st[(S + tau) * C + c];
        acc += W[c * K + j] * in;
      }
      Y[t * C + c] = silu(acc);
    }
  }
  // New state: the last K-1 inputs of [state; u] (through a copy: state_out may be state).
  std::vector<float> next(S * C);  // [K-1, C]
  for (int64_t i = 0; i < S; ++i) {
    const int64_t tau = T - S + i;
    for (int64_t c = 0; c < C; ++c) next[i * C + c] = tau >= 0 ? U[tau * C + c] : st[(S + tau) * C + c];
  }
  std::copy(next.begin(), next.end(), state_out.ptr<float>());
}

static inline float softplus(float v) { return v > 20.f ? v : std::log1p(std::exp(v)); }

static void l2_normalize(float* x, int64_t n, float scale) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float s = scale / std::sqrt(ss + 1e-6f);
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

void gated_delta_rule(const Tensor& qkv, const Tensor& a, const Tensor& b, const Tensor& A_log,
                      const Tensor& dt_bias, const Tensor& state, const Tensor& state_out, const Tensor& o, int Hk,
                      int Dk) {
  const int64_t T = qkv.dim(0), W = qkv.dim(1), Hv = state.dim(0), Dv = state.dim(2);
  // The recurrence runs in place on state_out, starting from a copy of state when they differ.
  if (state_out.data != state.data) std::copy_n(state.ptr<float>(), state.numel(), state_out.ptr<float>());
  const int64_t group = Hv / Hk;  // value heads 2k, 2k+1 (group = 2) share key head k
  const float q_scale = 1.f / std::sqrt(float(Dk));
#pragma omp parallel for schedule(static)
  for (int64_t h = 0; h < Hv; ++h) {
    const int64_t kh = h / group;
    float* S = state_out.ptr<float>() + h * Dk * Dv;  // [Dk, Dv]
    std::vector<float> q(Dk), k(Dk), delta(Dv);
    const float decay_rate = -std::exp(A_log.ptr<float>()[h]);
    for (int64_t t = 0; t < T; ++t) {
      const float* row = qkv.ptr<float>() + t * W;
      std::copy(row + kh * Dk, row + (kh + 1) * Dk, q.begin());
      std::copy(row + Hk * Dk + kh * Dk, row + Hk * Dk + (kh + 1) * Dk, k.begin());
      const float* v = row + 2 * Hk * Dk + h * Dv;
      l2_normalize(q.data(), Dk, q_scale);
      l2_normalize(k.data(), Dk, 1.f);
      const float beta = 1.f / (1.f + std::exp(-b.ptr<float>()[t * Hv + h]));
      const float g = decay_rate * softplus(a.ptr<float>()[t * Hv + h] + dt_bias.ptr<float>()[h]);
      const float alpha = std::exp(g);
      // S <- alpha S;  delta = beta (v - S^T k);  S <- S + k delta^T;  o = S^T q
      for (int64_t i = 0; i < Dk * Dv; ++i) S[i] *= alpha;
      for (int64_t j = 0; j < Dv; ++j) {
        float m = 0.f;
        for (int64_t i = 0; i < Dk; ++i) m += S[i * Dv + j] * k[i];
        delta[j] = beta * (v[j] - m);
      }
      float* out = o.ptr<float>() + t * Hv * Dv + h * Dv;
      for (int64_t j = 0; j < Dv; ++j) out[j] = 0.f;
      for (int64_t i = 0; i < Dk; ++i) {
        float* Si = S + i * Dv;
        for (int64_t j = 0; j < Dv; ++j) {
          Si[j] += k[i] * delta[j];
          out[j] += Si[j] * q[i];
        }
      }
    }
  }
}

// The three ops in order, through temporaries: the reference the fused CUDA kernel is tested against.
void gdn_decode_mixer(const Tensor& qkv, const Tensor& conv_weight, const Tensor& conv_state,
                      const Tensor& conv_state_out, const Tensor& a, const Tensor& b, const Tensor& A_log,
                      const Tensor& dt_bias, const Tensor& state, const Tensor& state_out, const Tensor& z,
                      const Tensor& norm_weight, float eps, const Tensor& y, int Hk, int Dk) {
  const int64_t C = qkv.dim(1), Hv = state.dim(0), Dv = state.dim(2);
  std::vector<float> x(C), o(Hv * Dv);
  const Tensor xt = Tensor::of(x.data(), DType::F32, Device::CPU, {1, C});        // [1, C] after conv + SiLU
  const Tensor ot = Tensor::of(o.data(), DType::F32, Device::CPU, {1, Hv * Dv});  // [1, Hv*Dv]
  conv1d_silu(qkv, conv_weight, conv_state, conv_state_out, xt);
  gated_delta_rule(xt, a, b, A_log, dt_bias, state, state_out, ot, Hk, Dk);
  gated_rms_norm(Tensor::of(o.data(), DType::F32, Device::CPU, {Hv, Dv}),
                 Tensor::of(z.data, DType::F32, Device::CPU, {Hv, Dv}), norm_weight, eps,
                 Tensor::of(y.data, DType::F32, Device::CPU, {Hv, Dv}));
}

}  // namespace lily::cpu
