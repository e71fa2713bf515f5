// The decode router taken off the chain output projection -> router -> moe_up (issue 12), by folding the
// post-attention norm's multiplier and the mixer's output projection into it. With x the residual row before the
// mixer's output is added, a that projection's input (the mixer's output, width A), O the projection [H, A], w the
// post-attention norm's multiplier [H] and R = [router; shared expert gate] [E + 1, H] (8-bit affine, the
// stacked router_gates), the MoE block's logits are
//   l = R (rms_norm(x + O a) * w) = s (R (w * x) + M a),   s = 1 / rms(x + O a) > 0,   M = R diag(w) O  [E + 1, A].
// router_fold_kernel computes M once at load; router_early_kernel computes r = R (w * x) + M a for one token. It
// is launched just before the output projection (which then adds O a into x only after its own wait), so both
// run beside each other after the mixer; moe_up and moe_down take the top-k on r before their waits (s > 0 keeps
// the order; moe_topk_raw_warp) and moe_up applies s, from its own norm of x + O a, to the chosen logits.
// Precision: M in f32 from fp64 sums of the dequantized products; r in f32. The logits are the router's in
// another factorisation: they differ from the direct GEMV's by f32 rounding (~1e-6 relative), so near-ties of the
// top-k may choose differently (docs/numerics.md), as the prompts' bf16 router already may.
#pragma once
#include "moe_decode.cuh"

namespace lily::cuda {

// An affine matrix (8 or 4 bits, BF16 scales) as the fold reads it, value by value.
struct FoldMatrix {
  const uint32_t* w;
  const uint16_t* s;
  const uint16_t* b;
  int cols, bits, group_size;
  __device__ __forceinline__ float at(int64_t row, int col) const {
    const int per = 32 / bits;
    const uint32_t word = w[row * (cols / per) + col / per];
    const uint32_t q = (word >> (bits * (col % per))) & ((1u << bits) - 1u);
    const int64_t g = row * (cols / group_size) + col / group_size;
    return fmaf(bf16_bits_to_f32(s[g]), float(q), bf16_bits_to_f32(b[g]));
  }
};

struct RouterFoldParams {
  FoldMatrix R;    // [E + 1, H]
  FoldMatrix O;    // [H, A]
  const float* w;  // [H]
  float* M;        // [E + 1, A]
  int H, A;
};

// M[e, j] = sum_i (R[e, i] w[i]) O[i, j]: grid (ceil(A / 256), E + 1), 256 threads; the CTA stages row e of
// R diag(w) in shared memory (f32), thread j of the CTA sums its column over i in fp64 in increasing i.
constexpr int FOLD_THREADS = 256, FOLD_MAX_H = 8192;
__global__ void __launch_bounds__(FOLD_THREADS) router_fold_kernel(const RouterFoldParams p) {
  __shared__ float rw[FOLD_MAX_H];
  const int e = int(blockIdx.y), j = int(blockIdx.x) * FOLD_THREADS + int(threadIdx.x);
  for (int i = threadIdx.x; i < p.H; i += FOLD_THREADS) rw[i] = p.R.at(e, i) * p.w[i];
  __syncthreads();
  if (j >= p.A) return;
  double acc = 0.0;
  for (int i = 0; i < p.H; ++i) acc = fma(double(rw[i]), double(p.O.at(i, j)), acc);
  p.M[int64_t(e) * p.A + j] = float(acc);
}

constexpr int ROUTER_EARLY_PL = 8;  // r values a lane of the top-k warp holds: E <= 256

// router_early_kernel's output, in the floats at r: r [E + 1], then the top-k's ids [K] (i32), their r in
// ascending id [K] and in choice order [K].
struct EarlyRoute {
  float* r;
  int E, K;
  __host__ __device__ static int64_t floats(int E, int K) { return E + 1 + 3 * int64_t(K); }
  __device__ int32_t* ids() const { return reinterpret_cast<int32_t*>(r + E + 1); }
  __device__ float* vals() const { return r + E + 1 + K; }
  __device__ float* chosen() const { return r + E + 1 + 2 * K; }
};
__device__ unsigned g_router_early_arrivals;  // 0 between launches (router_early_kernel's last CTA resets it)

// The K largest of r[0..E) (ties: the lower id), E <= 32 * PL, by one warp (all 32 lanes call it): ids[K] in
// ascending id with their values vals[K], and the values in choice order (largest first) in chosen[K]. The keys
// are r's bits mapped to an order-preserving u32 (0 for experts past E: below every float), each lane's PL pairs
// sorted once, then K rounds of moe_topk_warp's selection. Written by lanes < K (shared memory).
__device__ __forceinline__ uint32_t ordered_key(float f) {
  const uint32_t b = __float_as_uint(f);
  return b & 0x80000000u ? ~b : b | 0x80000000u;
}
template <int PL>
__device__ __forceinline__ void moe_topk_raw_warp(const float* r, int E, int K, int32_t* ids, float* vals,
                                                  float* chosen) {
  const int lane = threadIdx.x & 31;
  uint32_t key[PL];
  int eid[PL];
#pragma unroll
  for (int i = 0; i < PL; ++i) {
    const int e = lane + 32 * i;
    key[i] = e < E ? ordered_key(__ldcg(r + e)) : 0u;
    eid[i] = e < E ? e : INT32_MAX;
  }
  moe_sort_lane(key, eid);
  int my_id = INT32_MAX;
  uint32_t my_key = 0u;
  for (int k = 0; k < K; ++k) {
    const uint32_t top_key = __reduce_max_sync(0xffffffffu, key[0]);
    const int best_id = int(__reduce_min_sync(0xffffffffu, key[0] == top_key ? uint32_t(eid[0]) : 0xffffffffu));
    if (lane == k) my_id = best_id, my_key = top_key;
    if (eid[0] == best_id) {
#pragma unroll
      for (int i = 0; i + 1 < PL; ++i) key[i] = key[i + 1], eid[i] = eid[i + 1];
      key[PL - 1] = 0u, eid[PL - 1] = INT32_MAX;
    }
  }
  int rank = 0;
  for (int j = 0; j < K; ++j) rank += __shfl_sync(0xffffffffu, my_id, j) < my_id;
  if (lane < K) {
    const float v = __uint_as_float(my_key & 0x80000000u ? my_key & 0x7fffffffu : ~my_key);
    ids[rank] = my_id, vals[rank] = v, chosen[lane] = v;
  }
}

// The widths router_early_kernel is built for (the model's): H = 2048 (8 values a thread), A = 4096 (16).
constexpr int EARLY_THREADS = 256, EARLY_ROWS = 2, EARLY_H = 2048, EARLY_A = 4096;

struct RouterEarlyParams {
  const uint32_t* rw;  // R [E + 1, H] 8-bit
  const uint16_t* rs;  // [E + 1, H / group_size] BF16
  const uint16_t* rb;
  const float* M;      // [E + 1, A]
  const float* x;      // [H] the residual row before the mixer's output is added (16-byte aligned)
  const float* w;      // [H] the post-attention norm's multiplier
  const float* a;      // [A] the output projection's input
  float* r;            // EarlyRoute's floats
  int rows, group_size, K;  // E + 1
};

// r[e] = sum_i R[e, i] (w[i] x[i]) + sum_j M[e, j] a[j] for one token, then (the last CTA to arrive on a device
// counter, after the others' fenced stores) the top-k of r[0..E) into EarlyRoute. Grid ceil((E + 1) / EARLY_ROWS), 256
// threads: thread t takes values 8t..8t+7 of R's rows (one 8-byte load a row, one group) and 16t..16t+15 of M's
// (four float4s a row); per row its partial fma(scale, q . u, bias * sum u) + the M terms in order, then a
// warp butterfly and the 8 warps' sums in order: deterministic.
// Before the wait: the rows of R and M (constant weights), x and w: x was written by the MoE block before the
// mixer, two or more launches back (every kernel waits before it triggers, so those have completed). After it:
// a (the kernel just before), then r. The output projection launched next writes O a into its own buffer (not
// x), so both run at once; moe_up adds it to x as it stages its input.
__global__ void __launch_bounds__(EARLY_THREADS) router_early_kernel(const RouterEarlyParams p) {
  __shared__ float red[EARLY_ROWS][EARLY_THREADS / 32];
  const int t = int(threadIdx.x), lane = t & 31, warp = t >> 5, row0 = int(blockIdx.x) * EARLY_ROWS;
  uint2 q[EARLY_ROWS];
  float sc[EARLY_ROWS], bi[EARLY_ROWS];
  float4 m[EARLY_ROWS][4];
#pragma unroll
  for (int k = 0; k < EARLY_ROWS; ++k) {
    const int64_t e = min(row0 + k, p.rows - 1);
    q[k] = __ldg(reinterpret_cast<const uint2*>(p.rw + e * (EARLY_H / 4)) + t);
    const int64_t g = e * (EARLY_H / p.group_size) + (8 * t) / p.group_size;
    sc[k] = bf16_bits_to_f32(__ldg(p.rs + g));
    bi[k] = bf16_bits_to_f32(__ldg(p.rb + g));
#pragma unroll
    for (int c = 0; c < 4; ++c) m[k][c] = __ldg(reinterpret_cast<const float4*>(p.M + e * EARLY_A) + 4 * t + c);
  }
  float u[8];
  {
    const float4* x4 = reinterpret_cast<const float4*>(p.x) + 2 * t;
    const float4* w4 = reinterpret_cast<const float4*>(p.w) + 2 * t;
    const float4 x0 = __ldcg(x4), x1 = __ldcg(x4 + 1), w0 = __ldg(w4), w1 = __ldg(w4 + 1);
    u[0] = x0.x * w0.x, u[1] = x0.y * w0.y, u[2] = x0.z * w0.z, u[3] = x0.w * w0.w;
    u[4] = x1.x * w1.x, u[5] = x1.y * w1.y, u[6] = x1.z * w1.z, u[7] = x1.w * w1.w;
  }
  float usum = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) usum += u[i];
  pdl_wait();
  pdl_trigger();
  float4 av[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) av[c] = reinterpret_cast<const float4*>(p.a)[4 * t + c];
#pragma unroll
  for (int k = 0; k < EARLY_ROWS; ++k) {
    float q0[4], q1[4];
    decode_word<8>(q[k].x, q0);
    decode_word<8>(q[k].y, q1);
    float dot = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) dot = fmaf(q0[i], u[i], dot);
#pragma unroll
    for (int i = 0; i < 4; ++i) dot = fmaf(q1[i], u[4 + i], dot);
    float acc = fmaf(sc[k], dot, bi[k] * usum);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      acc = fmaf(m[k][c].x, av[c].x, acc);
      acc = fmaf(m[k][c].y, av[c].y, acc);
      acc = fmaf(m[k][c].z, av[c].z, acc);
      acc = fmaf(m[k][c].w, av[c].w, acc);
    }
    acc = warp_sum(acc);
    if (lane == 0) red[k][warp] = acc;
  }
  __syncthreads();
  if (t < EARLY_ROWS && row0 + t < p.rows) {
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < EARLY_THREADS / 32; ++i) s += red[t][i];
    p.r[row0 + t] = s;
    __threadfence();  // before the arrival below: the last CTA reads every r
  }
  // The last CTA to arrive takes the top-k of r once for moe_up and moe_down (three launches apart on a CTA each)
  __shared__ bool last;
  __syncthreads();
  if (t == 0) last = atomicAdd(&g_router_early_arrivals, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last || warp != 0) return;
  __threadfence();
  const EarlyRoute route{p.r, p.rows - 1, p.K};
  moe_topk_raw_warp<ROUTER_EARLY_PL>(p.r, p.rows - 1, p.K, route.ids(), route.vals(), route.chosen());
  if (lane == 0) g_router_early_arrivals = 0;
}

// The routing weights of the chosen experts from their raw logits r_k and the norm's s: w_k = exp(s r_k - s r_1)
// / sum_j exp(s r_j - s r_1) (r_1 the largest; the sum in choice order), and the shared expert's sigmoid(s r_E).
// One warp; w[K] in ascending id (as vals), w[K] the shared one.
__device__ __forceinline__ void moe_early_weights(const float* vals, const float* chosen, float r_shared, float s,
                                                  int K, float* w) {
  const int lane = threadIdx.x & 31;
  const float top = s * chosen[0];
  float sum = 0.f;
  for (int k = 0; k < K; ++k) sum += expf(s * chosen[k] - top);
  if (lane < K) w[lane] = expf(s * vals[lane] - top) / sum;
  if (lane == 0) w[K] = moe_sigmoid(s * r_shared);
}

}  // namespace lily::cuda
