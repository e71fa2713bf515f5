// MoE decode (T <= MOE_DECODE_MAX_TOKENS): after the router GEMV and moe_topk, two GEMV kernels over
// the chosen experts and the shared expert, reading expert ids from the device routing table; no
// grouping tables, no tensor cores. Same per-chunk algebra as linear_gemv.cuh (fp32, xsum bias term).
// Slot s of token t: s < K is routed expert topk_id[t, s] (ascending id), s == K the shared expert.
#pragma once
#include "linear_gemv.cuh"
#include "moe_routing.cuh"

namespace lily::cuda {

constexpr int MOE_DECODE_MAX_TOKENS = 16;  // short prompts too: per token its experts, no routing tables (TTFT)
constexpr int MOE_UP_PAIRS = 1;    // (gate, up) row pairs per thread and pass (registers: 4 CTAs per SM; 2 pairs at 3 CTAs/SM measured slower)
constexpr int MOE_DOWN_LOADS = 8;  // weight chunks in flight per thread of the down kernel (one batch)

// One affine stack [E, rows, cols] in the fast variant (4/8 bits, BF16 scales, 16-byte rows).
struct AffineStack {
  const uint32_t* w;       // [E, rows, cols*BITS/32] U32
  const uint16_t* scales;  // [E, rows, cols/group_size] BF16
  const uint16_t* biases;
  int rows, cols, group_size;
};

struct MoeUpParams {
  AffineStack gate, up;                // [E, I, H]
  AffineStack shared_gate, shared_up;  // [1, Is, H]
  const float* h;                      // [T, H] F32, 16-byte aligned
  const int32_t* topk_id;              // [T, K]
  const float* topk_w;                 // [T, K]
  const float* shared_w;               // [T] sigmoid of the shared expert gate
  float* act;                          // [T, K+1, ld] F32
  int K, ld, tpr, passes;              // passes per token
};

// act[t, s, i] = w(t, s) * silu(G_s[i, :] . h[t]) * (U_s[i, :] . h[t]) for i < I (s < K) or Is
// (s == K), w = topk_w[t, s] or shared_w[t]. Grid (CTAs, T): a CTA stages h[t] once, then its
// passes cover rho in [0, K*I + Is) (rho = s*I + i, shared rows last), MOE_UP_PAIRS pairs per
// thread of a slot of tpr threads over H's chunks (as linear_gemv_kernel, two rows per pair and one
// x row). Fixed-order slot sums; deterministic. Matches cpu::moe's expert SwiGLU in fp32.
template <int BITS>
__global__ void __launch_bounds__(GEMV_THREADS, 4) moe_up_kernel(const MoeUpParams p) {
  pdl_wait();
  pdl_trigger();
  using S = GemvShape<BITS>;
  constexpr int P = MOE_UP_PAIRS, N = 2 * P;
  extern __shared__ float4 xs[];  // [C*F] swizzled h[t], then xsum [C]
  __shared__ float red[2][GEMV_WARPS][N];
  __shared__ int32_t ids[MOE_MAX_TOP_K];  // topk_id[t]: weight addresses wait on shared, not global memory
  const int t = blockIdx.y, H = p.gate.cols, C = H / S::VALS, tpr = p.tpr;
  float* xsum = reinterpret_cast<float*>(xs + C * S::F);
  const int slot = threadIdx.x / tpr, q = threadIdx.x % tpr;
  const int rows_per_pass = (GEMV_THREADS / tpr) * P, nk = (C + tpr - 1) / tpr;
  const int units = (p.passes - int(blockIdx.x) + int(gridDim.x) - 1) / int(gridDim.x) * nk;
  const int I = p.gate.rows, KI = p.K * I, total = KI + p.shared_gate.rows, wpr = H * BITS / 32;
  float acc[N][1] = {};

  // The slot's first pair of unit j: slot s, row i of that expert, stack row e*I + i. Pairs never
  // straddle two slots (P divides I and Is).
  auto where = [&](int j, int& s, int& i, int64_t& row) {
    const int rho = (int(blockIdx.x) + GemvUnit(j, nk).pass * int(gridDim.x)) * rows_per_pass + slot * P;
    s = rho < KI ? rho / I : p.K;
    i = rho < KI ? rho % I : rho - KI;
    row = rho < KI ? int64_t(ids[s]) * I + i : i;
    return rho < total;
  };
  auto load = [&](GemvStage<N>& st, int j) {
    int s, i;
    int64_t row;
    const bool ok = where(j, s, i, row);
    const int c = q + GemvUnit(j, nk).step * tpr;
    const bool sh = s == p.K;
    const AffineStack g = sh ? p.shared_gate : p.gate, u = sh ? p.shared_up : p.up;
#pragma unroll
    for (int r = 0; r < P; ++r) {
      gemv_load<BITS>(st, 2 * r, ok && c < C, g.w, g.scales, g.biases, row + r, c, wpr, H / g.group_size,
                      g.group_size);
      gemv_load<BITS>(st, 2 * r + 1, ok && c < C, u.w, u.scales, u.biases, row + r, c, wpr, H / u.group_size,
                      u.group_size);
    }
  };
  auto compute = [&](const GemvStage<N>& st, int j) {
    const GemvUnit u(j, nk);
    const int c = q + u.step * tpr;
    if (c < C) gemv_chunk<BITS, N, 1>(st, xs, xsum, C, c, acc);
    if (u.step != nk - 1) return;
    float v[N];
#pragma unroll
    for (int n = 0; n < N; ++n) v[n] = acc[n][0], acc[n][0] = 0.f;
    if (!slot_sum(v, tpr, red[u.pass & 1])) return;
    int s, i;
    int64_t row;
    if (!where(j, s, i, row)) return;
    const float w = s < p.K ? p.topk_w[t * p.K + s] : p.shared_w[t];
    float* y = p.act + (int64_t(t) * (p.K + 1) + s) * p.ld + i;
#pragma unroll
    for (int r = 0; r < P; ++r) y[r] = w * silu(v[2 * r]) * v[2 * r + 1];
  };

  for (int k = threadIdx.x; k < p.K; k += blockDim.x) ids[k] = p.topk_id[t * p.K + k];
  __syncthreads();
  GemvStage<N> a, b;
  if (units > 0) load(a, 0);
  gemv_stage_x<BITS>(p.h + int64_t(t) * H, H, 1, 1, C, xs, xsum);
  __syncthreads();
  gemv_pipeline(units, a, b, load, compute);
}

struct MoeDownParams {
  AffineStack down;         // [E, H, I]
  AffineStack shared_down;  // [1, H, Is]
  const int32_t* topk_id;   // [T, K]
  const float* act;         // [T, K+1, ld] F32, 16-byte aligned rows
  float* out;               // [T, H] F32
  int K, ld, tpr, passes;   // passes per token: ceil(H / (GEMV_THREADS / tpr))
};

// Chunk n of a batch of GemvStage entries against one staged x chunk c (xs, xsum: that x row).
template <int BITS, int N>
__device__ __forceinline__ void gemv_entry(const GemvStage<N>& st, int n, const float4* xs, const float* xsum, int c,
                                           float& acc) {
  GemvStage<1> one;
  one.w[0] = st.w[n], one.s[0] = st.s[n], one.b[0] = st.b[n];
  float a[1][1] = {{acc}};
  gemv_chunk<BITS, 1, 1>(one, xs, xsum, 0, c, a);
  acc = a[0][0];
}

// out[t, o] = sum_{s = 0..K} D_s[o, :] . act[t, s, :]  (routed slots in ascending expert id, the
// shared expert last, the routing weights already folded into act).
// Output row o is one virtual row of Cv = K*Cr + Cs 16-byte chunks: segment s < K is row o of expert
// topk_id[t, s] (Cr chunks), segment K row o of the shared expert (Cs chunks).
// Grid (CTAs, T): a CTA stages act[t] (K+1 rows of Cmax chunks) once; a pass covers GEMV_THREADS/tpr
// output rows, one per slot of tpr threads. Thread q of a slot reads virtual chunks q, q+tpr, ... in
// batches of MOE_DOWN_LOADS, all loads of a batch issued before the first is used (the launcher
// sizes tpr so that a row takes one batch: every weight byte of a thread in flight at once, one
// memory latency per pass). Per-thread sums in chunk order, then the slot's fixed-order sum:
// deterministic.
template <int BITS>
__global__ void __launch_bounds__(GEMV_THREADS, 2) moe_down_kernel(const MoeDownParams p) {
  pdl_wait();  // expert ids and act come from the kernels before
  pdl_trigger();
  using S = GemvShape<BITS>;
  constexpr int NL = MOE_DOWN_LOADS;
  extern __shared__ float4 xs[];  // [K+1, Cmax*F] swizzled act[t], then xsum [K+1, Cmax]
  __shared__ float red[2][GEMV_WARPS][1];
  __shared__ int32_t ids[MOE_MAX_TOP_K];
  const int t = blockIdx.y, H = p.down.rows, tpr = p.tpr, slots = p.K + 1;
  const int Cr = p.down.cols / S::VALS, Cs = p.shared_down.cols / S::VALS, Cmax = max(Cr, Cs);
  const int KCr = p.K * Cr, Cv = KCr + Cs, rows_per_pass = GEMV_THREADS / tpr;
  float* xsum = reinterpret_cast<float*>(xs + slots * Cmax * S::F);
  const int slot = threadIdx.x / tpr, q = threadIdx.x % tpr;

  // virtual chunk v -> segment s and its chunk c
  auto split = [&](int v, int& s, int& c) {
    s = v < KCr ? v / Cr : p.K;
    c = v < KCr ? v - s * Cr : v - KCr;
  };

  for (int k = threadIdx.x; k < p.K; k += blockDim.x) ids[k] = p.topk_id[t * p.K + k];
  __syncthreads();
  bool staged = false;
  for (int pass = blockIdx.x, lp = 0; pass < p.passes; pass += gridDim.x, ++lp) {  // uniform over the CTA
    const int o = pass * rows_per_pass + slot;
    float acc = 0.f;
    for (int base = 0; base < Cv; base += NL * tpr) {  // uniform over the CTA
      GemvStage<NL> st;
#pragma unroll
      for (int n = 0; n < NL; ++n) {
        const int v = base + n * tpr + q;
        int s, c;
        split(v, s, c);
        const bool sh = s == p.K;
        const AffineStack d = sh ? p.shared_down : p.down;
        const bool ok = o < H && v < Cv;
        const int64_t row = sh ? o : int64_t(ok ? ids[s] : 0) * H + o;
        gemv_load<BITS>(st, n, ok, d.w, d.scales, d.biases, row, c, d.cols * BITS / 32, d.cols / d.group_size,
                        d.group_size);
      }
      if (!staged) {  // the first batch's loads are in flight meanwhile
        gemv_stage_x<BITS>(p.act + int64_t(t) * slots * p.ld, p.ld, slots, slots, Cmax, xs, xsum);
        __syncthreads();
        staged = true;
      }
#pragma unroll
      for (int n = 0; n < NL; ++n) {
        const int v = base + n * tpr + q;
        int s, c;
        split(v, s, c);
        if (o < H && v < Cv) gemv_entry<BITS>(st, n, xs + s * Cmax * S::F, xsum + s * Cmax, c, acc);
      }
    }
    float v[1] = {acc};
    if (slot_sum(v, tpr, red[lp & 1]) && o < H) p.out[int64_t(t) * H + o] = v[0];
  }
}

}  // namespace lily::cuda
