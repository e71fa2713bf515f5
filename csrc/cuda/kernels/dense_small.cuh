// Dense 4-bit products of short prompts (linear.cu, use_dense_small) with the TOKENS as the MMA's N:
//   Y[t, o] = sum_k W[o, k] X[t, k]            (or Y[t, o] += that: ops::linear_add's residual add)
// for T = 2..DS_MAX_TOKENS tokens, W 4-bit MLX affine [N, K/8] U32 with BF16 scales/biases [N, K/gs], X [T, K]
// F32 rows (a.x, a.ldx), Y [T, N] F32 rows (a.y, a.ldy). Each weight byte is read once for all T tokens.
//
// Fragments: moe_small.cuh's plain product, unchanged (the weights as the A operand of mma.sync m16n8k16
// BF16, dequantized in registers by wg_dequant_pair; the tokens' X as Xb rows in shared memory, the B
// operand in n8 tiles; ms_load / ms_units / ms_segment / ms_stage): a warp owns output rows o0 = 32 w' and
// o0 + 16 (w' = 4 * blockIdx.x + warp), a CTA DS_SLICE_ROWS = 128 rows.
//
// Work. Grid (ceil(N / 128) row slices, ks K-parts), launched as clusters of (1, ks, 1): CTA kz of a slice
// covers values [kz * Kp, (kz + 1) * Kp), Kp = K / ks (whole segments and whole weight groups): it stages
// only that range of X (NT n8 tiles of rows, T rounded up to 8; the padding rows zero) and streams only
// that range of its rows' weights, the first unit loaded before pdl_wait (constant weights). ks (ds_splits):
// doubled while the CTAs still fit two an SM, at most DS_MAX_SPLITS (a portable cluster), so that short
// prompts' products with few rows still run on every SM; doubled further where the staged X would not fit.
// Reduction (deterministic): each CTA writes its fp32 partials P[j][o'] (token j < 8 NT, slice row o' < 128,
// row stride DS_P_STRIDE floats) into its own shared memory; after a cluster barrier CTA kz sums, for its
// 1/ks share of the (j, o') elements, the ks CTAs' partials in rank order 0..ks-1 (distributed shared
// memory) and stores (or adds) y[j, o] for j < T, o < N, consecutive threads on consecutive o (coalesced);
// a second cluster barrier keeps every CTA's shared memory alive until all have read it. ks = 1: the same
// with __syncthreads and the CTA's own partials.
// Precision: bf16 operands (w rounded once as the wgmma GEMM rounds it, x rounded once as every prefill above
// 16 tokens rounds it), fp32 accumulation in the mma and in the K-part sum (docs/numerics.md).
// Host conditions (use_dense_small): 4 bits, BF16 scales, gs a power of two >= 32 dividing Kp, K % 128 == 0,
// N % 32 == 0 (a warp's rows all real or all past N), 16-byte aligned W and X rows.
#pragma once
#include <cstddef>
#include <cstdint>

#include "moe_small.cuh"

#ifdef __CUDACC__
#include <cooperative_groups.h>
#endif

namespace lily::cuda {

constexpr int DS_MAX_TOKENS = 32;   // T bound of the routing: 4 n8 tiles (to be tuned on the GPU: gemv_lab)
constexpr int DS_MAX_SPLITS = 8;    // K-parts = cluster size (portable)
constexpr int DS_SLICE_ROWS = MS_WARPS * 32;  // 128 output rows a CTA (a warp: two 16-row A tiles)
constexpr int DS_P_STRIDE = DS_SLICE_ROWS + 4;  // floats per partial row: lane (g, c) at 4j + o' mod 32 banks
constexpr int DS_CTAS_PER_SM = 2;               // the launch bounds' CTAs an SM
constexpr size_t DS_MAX_SMEM = 110 * 1024;      // a CTA's shared memory, two an SM
// The vocabulary head (248,320 rows) keeps its own path: the layer matrices have at most 12,352 rows.
constexpr int64_t DS_MAX_ROWS = 16384;

__host__ __device__ constexpr int ds_tiles(int64_t T) { return int((T + 7) / 8); }
// Shared memory of a CTA: NT n8 tiles of staged X rows of Kp values, then the partials [8 NT][DS_P_STRIDE].
__host__ __device__ constexpr size_t ds_smem_bytes(int64_t Kp, int nt) {
  return ms_smem_bytes(Kp, nt) + size_t(nt) * 8 * DS_P_STRIDE * 4;
}
// Whether K splits into `ks` parts of whole segments and whole groups.
__host__ __device__ constexpr bool ds_split_ok(int64_t K, int64_t gs, int64_t ks) {
  return K % (ks * MS_SEG_VALS) == 0 && (K / ks) % gs == 0;
}
// K-parts of an N x K product of T tokens with `resident` CTA slots on the device (DS_CTAS_PER_SM an SM):
// doubled while the grid stays within the slots (and the parts whole), then while the staged X passes
// DS_MAX_SMEM; 0 when no split fits.
__host__ __device__ constexpr int ds_splits(int64_t N, int64_t K, int64_t gs, int64_t T, int64_t resident) {
  const int64_t slices = (N + DS_SLICE_ROWS - 1) / DS_SLICE_ROWS;
  int ks = 1;
  while (2 * ks <= DS_MAX_SPLITS && slices * 2 * ks <= resident && ds_split_ok(K, gs, 2 * ks)) ks *= 2;
  while (ds_smem_bytes(K / ks, ds_tiles(T)) > DS_MAX_SMEM) {
    if (2 * ks > DS_MAX_SPLITS || !ds_split_ok(K, gs, 2 * ks)) return 0;
    ks *= 2;
  }
  return ks;
}
// Element i of a CTA's partials handled in the reduction: token j = i / 128, slice row o' = i % 128; CTA kz
// takes i in [kz * per, (kz + 1) * per), per = 8 NT * 128 / ks.
__host__ __device__ constexpr int ds_elems(int nt) { return nt * 8 * DS_SLICE_ROWS; }
// Where K-part kz (Kp values, nseg segments) starts in a weight row: its first segment and its first group.
__host__ __device__ constexpr int64_t ds_seg0(int kz, int nseg) { return int64_t(kz) * nseg; }
__host__ __device__ constexpr int64_t ds_group0(int kz, int64_t Kp, int gshift) { return (int64_t(kz) * Kp) >> gshift; }
// The partial (float index in P) of token j and slice row o'; a lane's acc[t][n][i] is token 8n + 2c + (i & 1),
// slice row 32 warp + 16t + g + 8 (i >> 1) (ms_store's mapping).
__host__ __device__ constexpr int ds_p_at(int j, int ol) { return j * DS_P_STRIDE + ol; }
__host__ __device__ constexpr int ds_p_lane(int warp, int t, int n, int i, int g, int c) {
  return ds_p_at(8 * n + 2 * c + (i & 1), warp * 32 + 16 * t + g + 8 * (i >> 1));
}

#ifdef __CUDACC__

template <int NT>
__global__ void __launch_bounds__(MS_THREADS, DS_CTAS_PER_SM)
    dense_small_kernel(const LinearArgs a, const bool accumulate) {
  namespace cg = cooperative_groups;
  extern __shared__ uint4 ds_smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const int ks = int(gridDim.y), kz = int(blockIdx.y);
  const int64_t N = a.w.rows, K = a.w.cols, Kp = K / ks, T = a.tiles.M;
  const int nseg = int(Kp / MS_SEG_VALS), gshift = __ffs(a.w.group_size) - 1;
  const int64_t slice0 = int64_t(blockIdx.x) * DS_SLICE_ROWS, o0 = slice0 + warp * 32;
  const bool live = o0 < N;  // N % 32 == 0: a warp's rows are all real or all past N
  MsRows rr;
  {
    const int64_t wpr = K / 8, gpr = K / a.w.group_size;
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      rr.sc[t] = static_cast<const uint16_t*>(a.w.scales);
      rr.bi[t] = static_cast<const uint16_t*>(a.w.biases);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t row = live ? o0 + 16 * t + g + 8 * h : 0;
        // the K-part's first segment (4 uint4) and group of the row
        rr.w[t][h] = reinterpret_cast<const uint4*>(static_cast<const uint32_t*>(a.w.w) + row * wpr) + c +
                     ds_seg0(kz, nseg) * 4;
        rr.sbi[t][h] = uint32_t(row * gpr + ds_group0(kz, Kp, gshift));
      }
    }
  }
  MsStage st[2];
  if (live) ms_load(st[0], rr, 0, nseg, c, gshift);  // constant weights: before pdl_wait
  pdl_wait();
  pdl_trigger();
  const uint32_t xs0 = smem_u32(ds_smem), stride = uint32_t(ms_row_bytes(Kp));
  LinearArgs part = a;  // the K-part's columns of X: rows a.ldx apart, Kp values from kz * Kp
  part.x = a.x + kz * Kp;
  ms_stage<false>(part, 0, int(T), Kp, xs0);
  __syncthreads();
  float* P = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(ds_smem) + ms_smem_bytes(Kp, NT));
  if (live) {
    float acc[2][NT][4];
    ms_units<NT>(st, rr, nseg, c, gshift, xs0 + uint32_t(g) * stride, stride, NT, acc);
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i)
          P[ds_p_lane(warp, t, n, i, g, c)] = acc[t][n][i];
  }
  cg::cluster_group cluster = cg::this_cluster();
  if (ks > 1) cluster.sync();
  else __syncthreads();
  const int per = ds_elems(NT) / ks;
  for (int i = kz * per + int(threadIdx.x); i < (kz + 1) * per; i += MS_THREADS) {
    const int j = i / DS_SLICE_ROWS, ol = i % DS_SLICE_ROWS;
    const int64_t o = slice0 + ol;
    if (j >= T || o >= N) continue;
    const int at = ds_p_at(j, ol);
    float v = ks > 1 ? cluster.map_shared_rank(P, 0)[at] : P[at];
    for (int q = 1; q < ks; ++q) v += cluster.map_shared_rank(P, q)[at];
    float* y = a.y + j * a.ldy + o;
    *y = accumulate ? *y + v : v;
  }
  if (ks > 1) cluster.sync();  // no CTA leaves while another reads its partials
}

#endif  // __CUDACC__

}  // namespace lily::cuda
