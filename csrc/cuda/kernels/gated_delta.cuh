// Gated DeltaNet kernels (device code only; launchers in gated_delta.cu). Match cpu/gated_delta.cpp.
#pragma once
#include "common.cuh"

namespace lily::cuda {

// ---------------------------------------------------------------------------------------------
// conv1d_silu: y[t, c] = silu(sum_j w[c, j] * in(t - K + 1 + j, c)), in(tau < 0) = state[K-1+tau, c].
// u, y [T, C] f32; w [C, K] f32; state [K-1, C] f32 (oldest first); state_out [K-1, C] gets the last
// K-1 inputs (state itself, or a separate copy).
// Grid (ceil(C/128), ceil(T/CONV_STEPS)), block 128: one thread per channel and CONV_STEPS tokens (their
// inputs loaded at once), the K-1 previous inputs sliding in registers. Only blockIdx.y == 0 reads the old state
// (CONV_STEPS >= K-1), and its threads write state_out at the end, each its own channel after reading
// it, so in place never races other blocks. fp32, taps summed oldest first like the CPU.
constexpr int CONV_STEPS = 16;
constexpr int CONV_THREADS = 128;

struct Conv1dParams {
  const float* u;      // [T, C]
  const float* w;      // [C, K]
  const float* state;  // [K-1, C]
  float* state_out;    // [K-1, C]
  float* y;            // [T, C]
  int T, C;
};

// One output of conv1d_silu: silu(sum_j w[j] * in_j) over the taps oldest first, win the K-1 earlier inputs and x
// the current one, the sum as a chain of fmaf from 0 (so that gdn_chunk's prep, which applies the conv to its
// rows while it loads them, gets the same bits).
template <int K>
__device__ __forceinline__ float conv_silu_out(const float (&w)[K], const float* win, float x) {
  float acc = 0.f;
#pragma unroll
  for (int j = 0; j + 1 < K; ++j) acc = fmaf(w[j], win[j], acc);
  acc = fmaf(w[K - 1], x, acc);
  return acc / (1.f + expf(-acc));
}

template <int K>
__global__ void __launch_bounds__(CONV_THREADS) conv1d_silu_kernel(Conv1dParams p) {
  pdl_wait();
  pdl_trigger();
  constexpr int S = K - 1;
  static_assert(S <= CONV_STEPS, "one block of tokens must cover the carried state");
  const int c = blockIdx.x * CONV_THREADS + threadIdx.x;
  if (c >= p.C) return;
  const int64_t C = p.C;
  const int t0 = blockIdx.y * CONV_STEPS, t1 = min(p.T, t0 + CONV_STEPS);
  float w[K], win[S];  // taps; inputs at t-S .. t-1
#pragma unroll
  for (int j = 0; j < K; ++j) w[j] = p.w[c * int64_t(K) + j];
#pragma unroll
  for (int j = 0; j < S; ++j) {
    const int tau = t0 - S + j;
    win[j] = tau >= 0 ? p.u[tau * C + c] : p.state[(S + tau) * C + c];
  }
  float old[S];  // [K-1] the carried state (block 0 only)
#pragma unroll
  for (int j = 0; j < S; ++j) old[j] = win[j];
  // every input of the block's tokens requested before the first output is stored (y may alias u as far as
  // the compiler knows, so a load after a store would wait for it: one memory latency a token)
  float xs[CONV_STEPS];
#pragma unroll
  for (int i = 0; i < CONV_STEPS; ++i) xs[i] = t0 + i < t1 ? p.u[(t0 + i) * C + c] : 0.f;
#pragma unroll
  for (int i = 0; i < CONV_STEPS; ++i) {
    if (t0 + i >= t1) break;
    const float x = xs[i];
    p.y[(t0 + i) * C + c] = conv_silu_out<K>(w, win, x);
#pragma unroll
    for (int j = 0; j + 1 < S; ++j) win[j] = win[j + 1];
    if constexpr (S > 0) win[S - 1] = x;
  }
  if (blockIdx.y != 0) return;
#pragma unroll
  for (int i = 0; i < S; ++i) {
    const int tau = p.T - S + i;  // input time of new state row i; < 0: old row S + tau
    float carried = 0.f;
#pragma unroll
    for (int r = 0; r < S; ++r)  // select with constant indices so `old` stays in registers
      if (r == S + tau) carried = old[r];
    p.state_out[i * C + c] = tau >= 0 ? p.u[tau * C + c] : carried;
  }
}

// ---------------------------------------------------------------------------------------------
// gated_delta_rule, token by token (decode and short calls; from 64 tokens at Dk = Dv = 128 the
// chunked WY kernels of gdn_chunk.cuh take over, see gated_delta.cu):
//   q, k = l2norm(q_t[kh]) / sqrt(Dk), l2norm(k_t[kh])  (eps 1e-6 inside the sqrt), kh = h / (Hv/Hk)
//   beta = sigmoid(b[t, h]);  alpha = exp(-exp(A_log[h]) * softplus(a[t, h] + dt_bias[h]))
//   S = alpha S;  delta_j = beta (v_j - sum_i S_ij k_i);  S_ij += k_i delta_j;  o_j = sum_i S_ij q_i
// qkv [T, 2*Hk*Dk + Hv*Dv] (q | k | v); a, b [T, Hv]; A_log, dt_bias [Hv]; S [Hv, Dk, Dv] f32
// (k-major, read once from state, written once to state_out: the same buffer or another); o [T, Hv*Dv].
// Fast path (Dk = DK, a multiple of 4*GDN_KSPLIT): grid (Hv, ceil(Dv/32)), block 128. Lane
// (col, ks) of warp w owns column j = 32*blockIdx.y + 8*w + lane/4 and the float4 rows
// 4*(ks + 4r) of S in registers; dot products over k end in two xor-shuffles. Each CTA stages
// GDN_STEPS tokens of normalised q, k, its 32 v columns and the gates in shared memory, then runs
// them with no barrier. fp32 throughout.
constexpr int GDN_KSPLIT = 4;
constexpr int GDN_COLS = 32;
constexpr int GDN_THREADS = GDN_COLS * GDN_KSPLIT;
constexpr int GDN_STEPS = 16;

struct GatedDeltaParams {
  const float* qkv;      // [T, 2*Hk*Dk + Hv*Dv]
  const float* a;        // [T, Hv]
  const float* b;        // [T, Hv]
  const float* A_log;    // [Hv]
  const float* dt_bias;  // [Hv]
  const float* state;    // [Hv, Dk, Dv]
  float* state_out;      // [Hv, Dk, Dv] (may be state)
  float* o;              // [T, Hv*Dv]
  int T, Hk, Hv, Dk, Dv;
};

__device__ __forceinline__ float softplus(float v) { return v > 20.f ? v : log1pf(expf(v)); }

// (alpha, beta) from the raw gate inputs a, b of one token and head (shared with gdn_decode.cuh).
__device__ __forceinline__ float2 gdn_gates_of(float a, float b, float A_log, float dt_bias) {
  const float beta = 1.f / (1.f + expf(-b));
  const float g = -expf(A_log) * softplus(a + dt_bias);
  return make_float2(expf(g), beta);
}

// alpha and beta of token t, value head h.
__device__ __forceinline__ float2 gdn_gates(const GatedDeltaParams& p, int t, int h) {
  return gdn_gates_of(p.a[int64_t(t) * p.Hv + h], p.b[int64_t(t) * p.Hv + h], p.A_log[h], p.dt_bias[h]);
}

template <int DK>
__global__ void __launch_bounds__(GDN_THREADS) gated_delta_kernel(GatedDeltaParams p) {
  pdl_wait();
  pdl_trigger();
  constexpr int RPT = DK / GDN_KSPLIT;  // rows of S per thread
  static_assert(RPT % 4 == 0, "rows go in float4 groups");
  __shared__ float4 qk[GDN_STEPS][2][DK / 4];  // normalised q, k of the staged tokens
  __shared__ float vs[GDN_STEPS][GDN_COLS];    // this CTA's v columns
  __shared__ float2 gate[GDN_STEPS];           // (alpha, beta)
  const int h = blockIdx.x, kh = h / (p.Hv / p.Hk);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, ks = lane & (GDN_KSPLIT - 1);
  const int jl = warp * (32 / GDN_KSPLIT) + lane / GDN_KSPLIT;  // column within the CTA
  const int j = blockIdx.y * GDN_COLS + jl;
  const bool has_col = j < p.Dv;
  const int64_t W = 2 * int64_t(p.Hk) * DK + int64_t(p.Hv) * p.Dv;
  const int64_t col = int64_t(h) * DK * p.Dv + (has_col ? j : 0);  // column j of [DK, Dv]
  const float* S = p.state + col;
  float s[RPT];
#pragma unroll
  for (int r = 0; r < RPT / 4; ++r)
#pragma unroll
    for (int c = 0; c < 4; ++c) s[4 * r + c] = has_col ? S[int64_t(4 * (ks + GDN_KSPLIT * r) + c) * p.Dv] : 0.f;
  const float q_scale = 1.f / sqrtf(float(DK));
  for (int t0 = 0; t0 < p.T; t0 += GDN_STEPS) {
    const int n = min(GDN_STEPS, p.T - t0);
    __syncthreads();  // the previous tokens are done with the staging buffers
    float* qkf = reinterpret_cast<float*>(qk);
    for (int i = threadIdx.x; i < n * 2 * DK; i += GDN_THREADS) {
      const int tt = i / (2 * DK), w = i % (2 * DK), which = w / DK;
      qkf[i] = p.qkv[(t0 + tt) * W + int64_t(which) * p.Hk * DK + int64_t(kh) * DK + (w % DK)];
    }
    for (int i = threadIdx.x; i < n * GDN_COLS; i += GDN_THREADS) {
      const int tt = i / GDN_COLS, c = blockIdx.y * GDN_COLS + i % GDN_COLS;
      vs[tt][i % GDN_COLS] = c < p.Dv ? p.qkv[(t0 + tt) * W + 2 * int64_t(p.Hk) * DK + int64_t(h) * p.Dv + c] : 0.f;
    }
    if (threadIdx.x < n) gate[threadIdx.x] = gdn_gates(p, t0 + threadIdx.x, h);
    __syncthreads();
    for (int vec = warp; vec < 2 * n; vec += GDN_THREADS / 32) {  // one warp per q or k vector
      float* x = qkf + vec * DK;
      float ss = 0.f;
      for (int i = lane; i < DK; i += 32) ss += x[i] * x[i];
      const float f = ((vec & 1) ? 1.f : q_scale) / sqrtf(warp_sum(ss) + 1e-6f);
      for (int i = lane; i < DK; i += 32) x[i] *= f;
    }
    __syncthreads();
    for (int tt = 0; tt < n; ++tt) {
      const float alpha = gate[tt].x, beta = gate[tt].y;
      float m = 0.f;
#pragma unroll
      for (int r = 0; r < RPT / 4; ++r) {
        const float4 k4 = qk[tt][1][ks + GDN_KSPLIT * r];
        s[4 * r + 0] *= alpha, s[4 * r + 1] *= alpha, s[4 * r + 2] *= alpha, s[4 * r + 3] *= alpha;
        m += s[4 * r] * k4.x + s[4 * r + 1] * k4.y + s[4 * r + 2] * k4.z + s[4 * r + 3] * k4.w;
      }
      m += __shfl_xor_sync(0xffffffffu, m, 1);
      m += __shfl_xor_sync(0xffffffffu, m, 2);
      const float delta = beta * (vs[tt][jl] - m);
      float out = 0.f;
#pragma unroll
      for (int r = 0; r < RPT / 4; ++r) {
        const float4 k4 = qk[tt][1][ks + GDN_KSPLIT * r], q4 = qk[tt][0][ks + GDN_KSPLIT * r];
        s[4 * r + 0] += k4.x * delta, s[4 * r + 1] += k4.y * delta;
        s[4 * r + 2] += k4.z * delta, s[4 * r + 3] += k4.w * delta;
        out += s[4 * r] * q4.x + s[4 * r + 1] * q4.y + s[4 * r + 2] * q4.z + s[4 * r + 3] * q4.w;
      }
      out += __shfl_xor_sync(0xffffffffu, out, 1);
      out += __shfl_xor_sync(0xffffffffu, out, 2);
      if (ks == 0 && has_col) p.o[int64_t(t0 + tt) * p.Hv * p.Dv + int64_t(h) * p.Dv + j] = out;
    }
  }
  if (!has_col) return;
  float* So = p.state_out + col;
#pragma unroll
  for (int r = 0; r < RPT / 4; ++r)
#pragma unroll
    for (int c = 0; c < 4; ++c) So[int64_t(4 * (ks + GDN_KSPLIT * r) + c) * p.Dv] = s[4 * r + c];
}

// Generic path for any Dk: grid (Hv, ceil(Dv/32)), one thread per column j of S, which it copies to
// state_out (a no-op in place) and then updates there in global memory every token; each thread
// normalises q and k itself. Slow, for the odd sizes of tests; same equations and order of operations
// as the fast path.
__global__ void __launch_bounds__(32) gated_delta_generic_kernel(GatedDeltaParams p) {
  pdl_wait();
  pdl_trigger();
  const int h = blockIdx.x, kh = h / (p.Hv / p.Hk), j = blockIdx.y * 32 + threadIdx.x;
  if (j >= p.Dv) return;
  const int64_t W = 2 * int64_t(p.Hk) * p.Dk + int64_t(p.Hv) * p.Dv;
  float* S = p.state_out + int64_t(h) * p.Dk * p.Dv + j;  // column j of [Dk, Dv], stride Dv
  if (p.state_out != p.state)
    for (int i = 0; i < p.Dk; ++i) S[int64_t(i) * p.Dv] = p.state[int64_t(h) * p.Dk * p.Dv + j + int64_t(i) * p.Dv];
  for (int t = 0; t < p.T; ++t) {
    const float* q = p.qkv + t * W + int64_t(kh) * p.Dk;  // [Dk]
    const float* k = q + int64_t(p.Hk) * p.Dk;            // [Dk]
    const float* v = p.qkv + t * W + 2 * int64_t(p.Hk) * p.Dk + int64_t(h) * p.Dv;  // [Dv]
    float qq = 0.f, kk = 0.f;
    for (int i = 0; i < p.Dk; ++i) qq += q[i] * q[i], kk += k[i] * k[i];
    const float fq = (1.f / sqrtf(float(p.Dk))) / sqrtf(qq + 1e-6f), fk = 1.f / sqrtf(kk + 1e-6f);
    const float2 ab = gdn_gates(p, t, h);
    float m = 0.f;
    for (int i = 0; i < p.Dk; ++i) {
      const float s = S[int64_t(i) * p.Dv] * ab.x;
      S[int64_t(i) * p.Dv] = s;
      m += s * (k[i] * fk);
    }
    const float delta = ab.y * (v[j] - m);
    float out = 0.f;
    for (int i = 0; i < p.Dk; ++i) {
      const float s = S[int64_t(i) * p.Dv] + (k[i] * fk) * delta;
      S[int64_t(i) * p.Dv] = s;
      out += s * (q[i] * fq);
    }
    p.o[int64_t(t) * p.Hv * p.Dv + int64_t(h) * p.Dv + j] = out;
  }
}

}  // namespace lily::cuda
