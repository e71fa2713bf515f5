// The GDN mixer core of one decode token in one kernel: conv1d_silu -> gated_delta_rule ->
// gated_rms_norm (device code only; launcher in gated_delta.cu). Matches the three CUDA kernels it
// replaces operation for operation (and so cpu::gdn_decode_mixer, which runs the three CPU ops):
//   x_c     = silu(sum_{j<K-1} w[c, j] state[j, c] + w[c, K-1] u[c])   every channel c of q | k | v
//   state   = [state[1:], u]                                          (the last K-1 inputs)
//   q, k    = l2norm(x_q[kh]) / sqrt(Dk), l2norm(x_k[kh]),  kh = h / (Hv/Hk)
//   S_h     = alpha S_h;  delta_j = beta (v_j - sum_i S_ij k_i);  S_ij += k_i delta_j;  o_j = sum_i S_ij q_i
//   y[h, j] = norm_w[j] * (o_j / sqrt(mean_j o_j^2 + eps)) * silu(z[h, j])
// u [C = 2*Hk*Dk + Hv*Dv] pre-conv q | k | v (head-major); conv w [C, K]; conv state [K-1, C] (oldest
// first); a, b [Hv]; A_log, dt_bias [Hv]; S [Hv, Dk, Dv] f32 (k-major); z, y [Hv*Dv]; norm_w [Dv]. The
// conv state and S are read from conv_state, state and their new values written to conv_state_out,
// state_out: the same buffers (in place) or the other copy of the session's ping-pong pair (a decode
// step that can be discarded, docs/generation.md "Pipelined decoding"); the stores below are ordered
// for the in-place case and need no order otherwise.
//
// Grid (ns = ceil(Dv/32), Hv), block 128, clusters of (ns, Hv/Hk) CTAs: one cluster per key head, one
// CTA per (value head h, slice of 32 value columns), cluster rank slice + ns * (h % (Hv/Hk)). The
// recurrence is gated_delta_kernel's for one token, with the same lane -> (column, rows) mapping and
// sums: lane (col, ks) of warp w owns column j = 32*slice + 8*w + lane/4 and the float4 row groups
// ks + 4r of S (Dk/4 floats) in registers.
// Global loads go in two batches, none waiting for another's value (the old kernel chained ~6):
//   before pdl_wait(): the constant weights (conv taps, A_log, dt_bias, norm_w) and the layer's carried
//     state: the CTA's columns of S and the conv state rows it convolves. Only this layer's mixer of the
//     previous token (or a prefill or restore long before) writes them, never the kernel launched just
//     before this one (the in_proj GEMV: it writes u, z, a, b). Every kernel calls pdl_wait() before
//     pdl_trigger(), so when this kernel starts every kernel two or more launches back has completed.
//     With the ping-pong pair, the copy this kernel writes was last read by this layer's mixer of the
//     previous token, also complete by then, and every write comes after pdl_wait() anyway.
//     They are read with ld.global.cg (from L2, the point of coherence: no stale L1 line). In a graph
//     replay (programmatic launches) this DRAM latency overlaps the end of the previous kernel.
//   after pdl_wait(): u, z, a, b (the previous kernel's outputs), all at once. Every write comes later.
// Conv: thread t convolves the key head's q/k channels t, t + 128, ... (all 2*ns CTAs of a key head
// compute the same values) into shared memory; the 4 lanes of column j convolve its v channel (the same
// value) into a register. Every thread computes (alpha, beta) itself. After the one __syncthreads every
// warp sums the squares of q and of k as gated_delta_kernel's warps 0 and 1 do (lane l: elements l,
// l+32, ...; one butterfly) and multiplies q, k by the factors as it reads them (x * f: the unfused
// kernel's x[i] *= f, same rounding).
// Norm: each CTA stores its o_j into shared memory of every CTA of head h over DSMEM (after the phase-0
// wait of the cluster barrier, whose arrive opens the kernel: all CTAs have started), then one cluster
// barrier phase (arrive.release / wait.acquire). Every warp then has the head's Dv outputs locally and
// sums their squares in gated_rms_norm_kernel's order (a warp per row for Dv <= 256: lane l:
// float4 / element l, l+32, ...; one butterfly), so every slice gets the same scale, bit for bit, and the
// same as the unfused kernels. No CTA reads another's shared memory, so none waits for the others to exit.
// Stores: S between that phase's arrive and wait (so the release does not wait for them); after the
// wait y, each v channel's conv state (lane ks = 0 of its column) and the key head's q/k conv state
// (the cluster's rank-0 CTA): every thread that reads the old rows has arrived by then (the cluster
// holds all their readers), and its arrive is a release after those reads.
// fp32 throughout; expf (not the fast intrinsic) like the unfused kernels.
#pragma once
#include "gated_delta.cuh"
#include "norms.cuh"

namespace lily::cuda {

constexpr int GDN_DECODE_MAX_CLUSTER = 8;  // portable cluster size: (Hv/Hk) * ceil(Dv/32) <= 8

struct GdnDecodeParams {
  const float* u;           // [C] pre-conv q | k | v
  const float* conv_w;      // [C, K]
  const float* conv_state;  // [K-1, C]
  float* conv_state_out;    // [K-1, C] (may be conv_state)
  const float* a;           // [Hv]
  const float* b;           // [Hv]
  const float* A_log;       // [Hv]
  const float* dt_bias;     // [Hv]
  const float* state;       // [Hv, Dk, Dv]
  float* state_out;         // [Hv, Dk, Dv] (may be state)
  const float* z;           // [Hv*Dv]
  const float* norm_w;   // [Dv]
  float* y;              // [Hv*Dv]
  int Hk, Hv, Dv;
  float eps;
  bool norm_vec4;        // the float4 order of gated_rms_norm (Dv % 4 == 0, z, norm_w, y 16-byte aligned)
};

// silu of one channel's causal conv for the token, as conv1d_silu_kernel sums it (taps oldest first):
// st = the channel's K-1 carried inputs, x = its new input.
template <int K>
__device__ __forceinline__ float conv_silu_token(const float (&w)[K], const float (&st)[K - 1], float x) {
  float acc = 0.f;
#pragma unroll
  for (int j = 0; j < K - 1; ++j) acc += w[j] * st[j];
  acc += w[K - 1] * x;
  return acc / (1.f + expf(-acc));
}

// state[:, c] = [st[1:], x]: conv1d_silu_kernel's new rows for one token (state: the output copy).
template <int K>
__device__ __forceinline__ void conv_state_store(float* state, int64_t C, int64_t c, const float (&st)[K - 1],
                                                 float x) {
#pragma unroll
  for (int j = 0; j + 1 < K - 1; ++j) state[j * C + c] = st[j + 1];
  state[(K - 2) * C + c] = x;
}

// The l2norm factors (fq, fk) of the key head's conv'd q, k (qkf [2 DK] in shared memory) in every warp,
// as gated_delta_kernel's warps 0 (q, times 1/sqrt(Dk)) and 1 (k) sum them: lane l adds elements l, l+32,
// ..., then one butterfly.
template <int DK>
__device__ __forceinline__ float2 gdn_qk_factors(const float* qkf, int lane) {
  float ssq = 0.f, ssk = 0.f;
#pragma unroll
  for (int e = 0; e < (DK + 31) / 32; ++e) {
    const int i = lane + 32 * e;
    if (i < DK) ssq += qkf[i] * qkf[i], ssk += qkf[DK + i] * qkf[DK + i];
  }
  const float fq = (1.f / sqrtf(float(DK))) / sqrtf(warp_sum(ssq) + 1e-6f);
  const float fk = 1.f / sqrtf(warp_sum(ssk) + 1e-6f);
  return make_float2(fq, fk);
}

// The recurrence step of one column (gated_delta_kernel's loop body for one token): s = the lane's
// DK / GDN_KSPLIT rows of the column (float4 row groups ks + GDN_KSPLIT r), updated in place; qk the conv'd
// q, k (not yet normalised: multiplied by fq, fk as read, the unfused kernel's x[i] *= f); v the column's
// conv'd value. Returns o_j, summed over the column's GDN_KSPLIT lanes.
template <int DK>
__device__ __forceinline__ float gdn_column_step(float (&s)[DK / GDN_KSPLIT], const float4 (*qk)[DK / 4], int ks,
                                                 float fq, float fk, float alpha, float beta, float v) {
  constexpr int RPT = DK / GDN_KSPLIT;
  auto scaled = [](float4 x, float f) { return make_float4(x.x * f, x.y * f, x.z * f, x.w * f); };
  float m = 0.f, out = 0.f;
#pragma unroll
  for (int r = 0; r < RPT / 4; ++r) {
    const float4 k4 = scaled(qk[1][ks + GDN_KSPLIT * r], fk);
    s[4 * r + 0] *= alpha, s[4 * r + 1] *= alpha, s[4 * r + 2] *= alpha, s[4 * r + 3] *= alpha;
    m += s[4 * r] * k4.x + s[4 * r + 1] * k4.y + s[4 * r + 2] * k4.z + s[4 * r + 3] * k4.w;
  }
  m += __shfl_xor_sync(0xffffffffu, m, 1);
  m += __shfl_xor_sync(0xffffffffu, m, 2);
  const float delta = beta * (v - m);
#pragma unroll
  for (int r = 0; r < RPT / 4; ++r) {
    const float4 k4 = scaled(qk[1][ks + GDN_KSPLIT * r], fk), q4 = scaled(qk[0][ks + GDN_KSPLIT * r], fq);
    s[4 * r + 0] += k4.x * delta, s[4 * r + 1] += k4.y * delta;
    s[4 * r + 2] += k4.z * delta, s[4 * r + 3] += k4.w * delta;
    out += s[4 * r] * q4.x + s[4 * r + 1] * q4.y + s[4 * r + 2] * q4.z + s[4 * r + 3] * q4.w;
  }
  out += __shfl_xor_sync(0xffffffffu, out, 1);
  out += __shfl_xor_sync(0xffffffffu, out, 2);
  return out;
}

// The gated RMSNorm scale of one head from its Dv outputs o (ohead, 16-byte aligned, Dv <= MAX_DV) in
// every warp, in gated_rms_norm's order (a warp per row for Dv <= 256: lane l: float4 / element l, l+32,
// ...; one butterfly), so every slice of the head gets the same scale, bit for bit.
template <int MAX_DV>
__device__ __forceinline__ float gdn_head_scale(const float* ohead, int Dv, bool vec4, float eps, int lane) {
  float ss = 0.f;
  if (vec4) {
#pragma unroll
    for (int e = 0; e < MAX_DV / 128; ++e) {
      const int i = lane + 32 * e;
      if (i < Dv / 4) ss += sq4(reinterpret_cast<const float4*>(ohead)[i]);
    }
  } else {
#pragma unroll
    for (int e = 0; e < MAX_DV / 32; ++e) {
      const int i = lane + 32 * e;
      if (i < Dv) ss += ohead[i] * ohead[i];
    }
  }
  ss = warp_sum(ss);
  return 1.f / sqrtf(ss / float(Dv) + eps);
}

template <int DK, int K>
__global__ void __launch_bounds__(GDN_THREADS) gdn_decode_mixer_kernel(GdnDecodeParams p) {
  constexpr int RPT = DK / GDN_KSPLIT;                             // rows of S per thread
  constexpr int QK_PER = (2 * DK + GDN_THREADS - 1) / GDN_THREADS;  // q/k channels per thread
  constexpr int MAX_DV = GDN_DECODE_MAX_CLUSTER * GDN_COLS;         // ns <= 8 slices
  static_assert(RPT % 4 == 0 && K >= 2, "rows go in float4 groups; the conv carries state");
  static_assert(GDN_DECODE_MAX_CLUSTER % GDN_KSPLIT == 0, "a column's lanes share its DSMEM stores");
  __shared__ float4 qk[2][DK / 4];              // conv'd q, k of key head kh (not yet normalised)
  __shared__ alignas(16) float ohead[MAX_DV];  // o_j of head h, j < Dv, stored by every slice of the head
  __cluster_barrier_arrive_relaxed();  // phase 0: this CTA has started (waited on before the DSMEM stores)
  const int slice = blockIdx.x, ns = gridDim.x, h = blockIdx.y;
  const int group = p.Hv / p.Hk, kh = h / group, hr = h % group;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, ks = lane & (GDN_KSPLIT - 1);
  const int jl = warp * (32 / GDN_KSPLIT) + lane / GDN_KSPLIT;  // column within the CTA
  const int j = slice * GDN_COLS + jl;
  const bool has_col = j < p.Dv;
  const int64_t C = 2 * int64_t(p.Hk) * DK + int64_t(p.Hv) * p.Dv;
  const int64_t vc = 2 * int64_t(p.Hk) * DK + int64_t(h) * p.Dv + j;  // v channel of column j
  const int64_t at = int64_t(h) * p.Dv + j;                           // z, y index of column j
  float* qkf = reinterpret_cast<float*>(qk);
  // channel of element i of the key head's [q (DK) | k (DK)]
  auto qk_channel = [&](int i) { return int64_t(i / DK) * p.Hk * DK + int64_t(kh) * DK + i % DK; };

  // Before the wait: constant weights, and this layer's state through L2 (see the header).
  float wqk[QK_PER][K], sqk[QK_PER][K - 1], wv[K], sv[K - 1];
#pragma unroll
  for (int r = 0; r < QK_PER; ++r) {
    const int i = threadIdx.x + GDN_THREADS * r;
    const bool on = i < 2 * DK;
    const int64_t c = on ? qk_channel(i) : 0;
#pragma unroll
    for (int t = 0; t < K; ++t) wqk[r][t] = on ? p.conv_w[c * K + t] : 0.f;
#pragma unroll
    for (int t = 0; t < K - 1; ++t) sqk[r][t] = on ? __ldcg(p.conv_state + t * C + c) : 0.f;
  }
#pragma unroll
  for (int t = 0; t < K; ++t) wv[t] = has_col ? p.conv_w[vc * K + t] : 0.f;
#pragma unroll
  for (int t = 0; t < K - 1; ++t) sv[t] = has_col ? __ldcg(p.conv_state + t * C + vc) : 0.f;
  const float A_log = p.A_log[h], dt_bias = p.dt_bias[h], nw = has_col ? p.norm_w[j] : 0.f;
  // Column j of [DK, Dv] as an opaque register (else NVVM folds each row's address back into p.state
  // plus 64-bit index math: ~9 instructions per load instead of ~3); row offsets < DK * Dv <= 2^16 in int.
  const float* S = p.state + int64_t(h) * DK * p.Dv + (has_col ? j : 0);
  asm("" : "+l"(S));
  auto row = [&](int r, int c) { return (4 * (ks + GDN_KSPLIT * r) + c) * p.Dv; };  // of s[4r + c]
  float s[RPT];
#pragma unroll
  for (int r = 0; r < RPT / 4; ++r)
#pragma unroll
    for (int c = 0; c < 4; ++c) s[4 * r + c] = has_col ? __ldcg(S + row(r, c)) : 0.f;

  pdl_wait();
  pdl_trigger();
  // After the wait: the previous kernel's outputs, all in one batch.
  float uqk[QK_PER];
#pragma unroll
  for (int r = 0; r < QK_PER; ++r) {
    const int i = threadIdx.x + GDN_THREADS * r;
    uqk[r] = i < 2 * DK ? p.u[qk_channel(i)] : 0.f;
  }
  const float uv = has_col ? p.u[vc] : 0.f, z = has_col ? p.z[at] : 0.f;
  const float2 gate = gdn_gates_of(p.a[h], p.b[h], A_log, dt_bias);  // (alpha, beta)

  // 1. conv + SiLU: q, k of key head kh into shared memory; column j's v (0 past Dv) in registers.
#pragma unroll
  for (int r = 0; r < QK_PER; ++r) {
    const int i = threadIdx.x + GDN_THREADS * r;
    if (i < 2 * DK) qkf[i] = conv_silu_token<K>(wqk[r], sqk[r], uqk[r]);
  }
  const float v = conv_silu_token<K>(wv, sv, uv);
  __syncthreads();

  // 2.-3. l2norm factors in every warp, then the recurrence step of column j.
  const float2 f = gdn_qk_factors<DK>(qkf, lane);
  const float out = gdn_column_step<DK>(s, qk, ks, f.x, f.y, gate.x, gate.y, v);

  // 4. o_j into ohead[j] of every CTA of head h: lane ks of the column's quad stores to slices ks, ks + 4.
  __cluster_barrier_wait();  // phase 0: every CTA of the cluster has started
#pragma unroll
  for (int e = 0; e < GDN_DECODE_MAX_CLUSTER / GDN_KSPLIT; ++e) {
    const int t = ks + GDN_KSPLIT * e;
    if (has_col && t < ns) static_cast<float*>(__cluster_map_shared_rank(ohead, unsigned(t + ns * hr)))[j] = out;
  }
  __cluster_barrier_arrive();  // phase 1, release: this thread's o_j stores and conv state reads are done
  if (has_col) {
    float* So = p.state_out + int64_t(h) * DK * p.Dv + j;  // column j of the output copy
    asm("" : "+l"(So));
#pragma unroll
    for (int r = 0; r < RPT / 4; ++r)
#pragma unroll
      for (int c = 0; c < 4; ++c) __stcg(So + row(r, c), s[4 * r + c]);
  }
  __cluster_barrier_wait();  // phase 1, acquire: ohead holds head h; no thread will read the old conv state

  // 5. gated RMSNorm of head h in every warp, in gated_rms_norm's order; lane ks = 0 writes y[h, j].
  const float sc = gdn_head_scale<MAX_DV>(ohead, p.Dv, p.norm_vec4, p.eps, lane);
  if (has_col && ks == 0) {
    p.y[at] = norm_out<true>(out, sc, nw, z);
    conv_state_store<K>(p.conv_state_out, C, vc, sv, uv);
  }
  if (slice == 0 && hr == 0) {  // rank 0: the key head's q/k conv state
#pragma unroll
    for (int r = 0; r < QK_PER; ++r) {
      const int i = threadIdx.x + GDN_THREADS * r;
      if (i < 2 * DK) conv_state_store<K>(p.conv_state_out, C, qk_channel(i), sqk[r], uqk[r]);
    }
  }
}

}  // namespace lily::cuda
