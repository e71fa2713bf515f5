// The GDN mixer core of one decode token in one kernel: conv1d_silu -> gated_delta_rule ->
// gated_rms_norm (device code only; launcher in gated_delta.cu). Matches the three CUDA kernels it
// replaces operation for operation (and so cpu::gdn_decode_mixer, which runs the three CPU ops):
//   x_c     = silu(sum_{j<K-1} w[c, j] state[j, c] + w[c, K-1] u[c])   every channel c of q | k | v
//   state   = [state[1:], u]                                          (the last K-1 inputs)
//   q, k    = l2norm(x_q[kh]) / sqrt(Dk), l2norm(x_k[kh]),  kh = h / (Hv/Hk)
//   S_h     = alpha S_h;  delta_j = beta (v_j - sum_i S_ij k_i);  S_ij += k_i delta_j;  o_j = sum_i S_ij q_i
//   y[h, j] = norm_w[j] * (o_j / sqrt(mean_j o_j^2 + eps)) * silu(z[h, j])
// u [C = 2*Hk*Dk + Hv*Dv] pre-conv q | k | v (head-major); conv w [C, K]; conv state [K-1, C] (oldest
// first); a, b [Hv]; A_log, dt_bias [Hv]; S [Hv, Dk, Dv] f32 (k-major, in place); z, y [Hv*Dv]; norm_w [Dv].
//
// Grid (ns = ceil(Dv/32), Hv), block 128, clusters of (ns, Hv/Hk) CTAs: one cluster per key head, one
// CTA per (value head h, slice of 32 value columns). The recurrence is gated_delta_kernel's for one
// token (same lane -> (column, row group) mapping, same sums), with S's 32 columns in registers.
// Conv: every CTA convolves its key head's 2*Dk q, k channels itself (the 2*ns CTAs of the key head
// compute the same values) and its own 32 v channels, whose conv state it alone shifts. The q/k state
// rows are shifted by the cluster's rank-0 CTA only, after the first cluster barrier, when every CTA
// that reads them has done so (the cluster holds all their readers).
// Norm: each CTA leaves its 32 outputs o_j in shared memory; after the cluster barrier warp 0 of each
// CTA reads its head's Dv outputs over DSMEM and sums the squares in gated_rms_norm_kernel's order
// (lane l: float4 / element l, l+32, ...; one warp butterfly: its block has 32 threads for Dv <= 256),
// so every slice gets the same scale, bit for bit, and the same as the unfused kernels. A second
// cluster barrier keeps every CTA's shared memory alive until the others have read it.
// fp32 throughout; expf (not the fast intrinsic) like the unfused kernels. Nothing but constant
// weights (conv taps, A_log, dt_bias, norm_w) is read before pdl_wait().
#pragma once
#include <cooperative_groups.h>

#include "gated_delta.cuh"
#include "norms.cuh"

namespace lily::cuda {

constexpr int GDN_DECODE_MAX_CLUSTER = 8;  // portable cluster size: (Hv/Hk) * ceil(Dv/32) <= 8

struct GdnDecodeParams {
  const float* u;        // [C] pre-conv q | k | v
  const float* conv_w;   // [C, K]
  float* conv_state;     // [K-1, C]
  const float* a;        // [Hv]
  const float* b;        // [Hv]
  const float* A_log;    // [Hv]
  const float* dt_bias;  // [Hv]
  float* state;          // [Hv, Dk, Dv]
  const float* z;        // [Hv*Dv]
  const float* norm_w;   // [Dv]
  float* y;              // [Hv*Dv]
  int Hk, Hv, Dv;
  float eps;
  bool norm_vec4;        // the float4 order of gated_rms_norm (Dv % 4 == 0, z, norm_w, y 16-byte aligned)
};

// silu of channel c's causal conv for the token, as conv1d_silu_kernel sums it (taps oldest first).
template <int K>
__device__ __forceinline__ float conv_silu_token(const float (&w)[K], const float* state, const float* u,
                                                 int64_t C, int64_t c) {
  float acc = 0.f;
#pragma unroll
  for (int j = 0; j < K - 1; ++j) acc += w[j] * state[j * C + c];
  acc += w[K - 1] * u[c];
  return acc / (1.f + expf(-acc));
}

// state[:, c] = [state[1:, c], u[c]] (read in ascending rows before each is overwritten).
template <int K>
__device__ __forceinline__ void conv_state_shift(float* state, const float* u, int64_t C, int64_t c) {
#pragma unroll
  for (int j = 0; j + 1 < K - 1; ++j) state[j * C + c] = state[(j + 1) * C + c];
  state[(K - 2) * C + c] = u[c];
}

template <int DK, int K>
__global__ void __launch_bounds__(GDN_THREADS) gdn_decode_mixer_kernel(GdnDecodeParams p) {
  namespace cg = cooperative_groups;
  constexpr int RPT = DK / GDN_KSPLIT;                             // rows of S per thread
  constexpr int QK_PER = (2 * DK + GDN_THREADS - 1) / GDN_THREADS;  // q/k channels per thread
  static_assert(RPT % 4 == 0 && K >= 2, "rows go in float4 groups; the conv carries state");
  __shared__ float4 qk[2][DK / 4];                 // conv'd, then normalised q, k of key head kh
  __shared__ float vs[GDN_COLS];                   // this CTA's conv'd v columns
  __shared__ alignas(16) float osl[GDN_COLS];      // this CTA's o_j before the norm (read over DSMEM)
  __shared__ float2 gate;                          // (alpha, beta)
  const cg::cluster_group cluster = cg::this_cluster();
  const int slice = blockIdx.x, ns = gridDim.x, h = blockIdx.y;
  const int group = p.Hv / p.Hk, kh = h / group, hr = h % group;  // cluster rank = slice + ns * hr
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, ks = lane & (GDN_KSPLIT - 1);
  const int jl = warp * (32 / GDN_KSPLIT) + lane / GDN_KSPLIT;  // column within the CTA
  const int j = slice * GDN_COLS + jl;
  const bool has_col = j < p.Dv;
  const int64_t C = 2 * int64_t(p.Hk) * DK + int64_t(p.Hv) * p.Dv;
  float* qkf = reinterpret_cast<float*>(qk);
  // channel of element i of the key head's [q (DK) | k (DK)]
  auto qk_channel = [&](int i) { return int64_t(i / DK) * p.Hk * DK + int64_t(kh) * DK + i % DK; };
  const int vj = slice * GDN_COLS + int(threadIdx.x);  // v column of threads < GDN_COLS
  const bool has_v = threadIdx.x < GDN_COLS && vj < p.Dv;
  const int64_t vc = 2 * int64_t(p.Hk) * DK + int64_t(h) * p.Dv + vj;
  const bool gate_thread = threadIdx.x == GDN_COLS;
  const bool norm_lane = warp == 0 && slice * GDN_COLS + lane < p.Dv;

  // Constant weights, before the wait.
  float wqk[QK_PER][K], wv[K], A_log = 0.f, dt_bias = 0.f, nw = 0.f;
#pragma unroll
  for (int r = 0; r < QK_PER; ++r) {
    const int i = threadIdx.x + GDN_THREADS * r;
#pragma unroll
    for (int t = 0; t < K; ++t) wqk[r][t] = i < 2 * DK ? p.conv_w[qk_channel(i) * K + t] : 0.f;
  }
#pragma unroll
  for (int t = 0; t < K; ++t) wv[t] = has_v ? p.conv_w[vc * K + t] : 0.f;
  if (gate_thread) A_log = p.A_log[h], dt_bias = p.dt_bias[h];
  if (norm_lane) nw = p.norm_w[slice * GDN_COLS + lane];

  pdl_wait();
  pdl_trigger();
  float* S = p.state + int64_t(h) * DK * p.Dv + (has_col ? j : 0);  // column j of [DK, Dv]
  float s[RPT];
#pragma unroll
  for (int r = 0; r < RPT / 4; ++r)
#pragma unroll
    for (int c = 0; c < 4; ++c) s[4 * r + c] = has_col ? S[int64_t(4 * (ks + GDN_KSPLIT * r) + c) * p.Dv] : 0.f;

  // 1. conv + SiLU: q, k of key head kh (state shifted later, by rank 0), v of this slice (shifted now).
#pragma unroll
  for (int r = 0; r < QK_PER; ++r) {
    const int i = threadIdx.x + GDN_THREADS * r;
    if (i < 2 * DK) qkf[i] = conv_silu_token<K>(wqk[r], p.conv_state, p.u, C, qk_channel(i));
  }
  if (has_v) {
    vs[threadIdx.x] = conv_silu_token<K>(wv, p.conv_state, p.u, C, vc);
    conv_state_shift<K>(p.conv_state, p.u, C, vc);
  } else if (threadIdx.x < GDN_COLS) {
    vs[threadIdx.x] = 0.f;
  }
  if (gate_thread) gate = gdn_gates_of(p.a[h], p.b[h], A_log, dt_bias);
  __syncthreads();
  if (warp < 2) {  // 2. l2norm: warp 0 q (times 1/sqrt(Dk)), warp 1 k, as gated_delta_kernel
    float* x = qkf + warp * DK;
    float ss = 0.f;
    for (int i = lane; i < DK; i += 32) ss += x[i] * x[i];
    const float f = (warp ? 1.f : 1.f / sqrtf(float(DK))) / sqrtf(warp_sum(ss) + 1e-6f);
    for (int i = lane; i < DK; i += 32) x[i] *= f;
  }
  __syncthreads();

  // 3. the recurrence step (gated_delta_kernel's loop body for one token).
  {
    const float alpha = gate.x, beta = gate.y;
    float m = 0.f;
#pragma unroll
    for (int r = 0; r < RPT / 4; ++r) {
      const float4 k4 = qk[1][ks + GDN_KSPLIT * r];
      s[4 * r + 0] *= alpha, s[4 * r + 1] *= alpha, s[4 * r + 2] *= alpha, s[4 * r + 3] *= alpha;
      m += s[4 * r] * k4.x + s[4 * r + 1] * k4.y + s[4 * r + 2] * k4.z + s[4 * r + 3] * k4.w;
    }
    m += __shfl_xor_sync(0xffffffffu, m, 1);
    m += __shfl_xor_sync(0xffffffffu, m, 2);
    const float delta = beta * (vs[jl] - m);
    float out = 0.f;
#pragma unroll
    for (int r = 0; r < RPT / 4; ++r) {
      const float4 k4 = qk[1][ks + GDN_KSPLIT * r], q4 = qk[0][ks + GDN_KSPLIT * r];
      s[4 * r + 0] += k4.x * delta, s[4 * r + 1] += k4.y * delta;
      s[4 * r + 2] += k4.z * delta, s[4 * r + 3] += k4.w * delta;
      out += s[4 * r] * q4.x + s[4 * r + 1] * q4.y + s[4 * r + 2] * q4.z + s[4 * r + 3] * q4.w;
    }
    out += __shfl_xor_sync(0xffffffffu, out, 1);
    out += __shfl_xor_sync(0xffffffffu, out, 2);
    if (ks == 0) osl[jl] = has_col ? out : 0.f;
  }
  if (has_col) {
#pragma unroll
    for (int r = 0; r < RPT / 4; ++r)
#pragma unroll
      for (int c = 0; c < 4; ++c) S[int64_t(4 * (ks + GDN_KSPLIT * r) + c) * p.Dv] = s[4 * r + c];
  }
  cluster.sync();  // every o_j of the key head is in shared memory; every read of the old conv state is done

  // 4. gated RMSNorm of head h: warp 0 sums the head's squares over DSMEM in gated_rms_norm's order.
  if (warp == 0) {
    float ss = 0.f;
    if (p.norm_vec4) {
      for (int i = lane; i < p.Dv / 4; i += 32) {
        const int e = 4 * i;  // a float4 never straddles two slices (32 % 4 == 0)
        const float* src = cluster.map_shared_rank(osl, e / GDN_COLS + ns * hr);
        ss += sq4(*reinterpret_cast<const float4*>(src + e % GDN_COLS));
      }
    } else {
      for (int i = lane; i < p.Dv; i += 32) {
        const float x = cluster.map_shared_rank(osl, i / GDN_COLS + ns * hr)[i % GDN_COLS];
        ss += x * x;
      }
    }
    ss = warp_sum(ss);
    const float sc = 1.f / sqrtf(ss / float(p.Dv) + p.eps);
    if (norm_lane) {
      const int64_t at = int64_t(h) * p.Dv + slice * GDN_COLS + lane;
      p.y[at] = norm_out<true>(osl[lane], sc, nw, p.z[at]);
    }
  }
  if (slice == 0 && hr == 0) {  // rank 0: the key head's q/k conv state, now that all its readers are done
#pragma unroll
    for (int r = 0; r < QK_PER; ++r) {
      const int i = threadIdx.x + GDN_THREADS * r;
      if (i < 2 * DK) conv_state_shift<K>(p.conv_state, p.u, C, qk_channel(i));
    }
  }
  cluster.sync();  // no CTA exits while another may still read its osl
}

}  // namespace lily::cuda
