// Generic linear and embedding: every weight variant the CPU supports (dense F32/F16/BF16, affine
// bits 2/4/8 x group 32/64/128 x F32/F16/BF16 scales), any shape, element-wise dequantization.
// The fast kernels (linear_gemv.cuh, linear_gemm.cuh) cover the model's own variants; this one is
// the fallback for everything else, so it favours being obviously right over speed.
#pragma once
#include "linear_common.cuh"

namespace lily::cuda {

constexpr int GENERIC_WARPS = 8;     // output columns o per CTA, one per warp
constexpr int GENERIC_TOKENS = 8;    // product rows a warp accumulates at once
constexpr int GENERIC_TILE_ROWS = 64;  // product rows per tile (the MoE tile maps use the same)

// Y[r, o] = sum_i W_e[o, i] X[x_row(r), i] then the epilogue (linear_common.cuh).
// W [E, N, K] any variant; X rows [K] F32; Y [M, ldy] F32.
// Grid (tiles, ceil(N / 8)); warp w of CTA (m, j) owns output column o = 8j + w for the tile's
// rows, 8 rows at a time: lanes stride over i, each dequantized weight is used for all 8 rows,
// then a fixed-order warp sum. Matches cpu::linear to fp32 rounding.
__global__ void __launch_bounds__(GENERIC_WARPS * 32) linear_generic_kernel(const LinearArgs a) {
  pdl_wait();
  pdl_trigger();
  Tile tile;
  if (!find_tile(a.tiles, blockIdx.x, GENERIC_TILE_ROWS, tile)) return;
  const int lane = threadIdx.x & 31;
  const int64_t o = int64_t(blockIdx.y) * GENERIC_WARPS + (threadIdx.x >> 5);
  if (o >= a.w.rows) return;
  const int64_t K = a.w.cols;
  for (int64_t r0 = 0; r0 < tile.rows; r0 += GENERIC_TOKENS) {
    const int n = int(min(int64_t(GENERIC_TOKENS), tile.rows - r0));
    const float* xr[GENERIC_TOKENS];
#pragma unroll
    for (int t = 0; t < GENERIC_TOKENS; ++t) xr[t] = x_row(a, tile.row0 + r0 + min(t, n - 1));
    float acc[GENERIC_TOKENS] = {};
    for (int64_t i = lane; i < K; i += 32) {
      const float wv = dequant_at(a.w, tile.expert, o, i);
#pragma unroll
      for (int t = 0; t < GENERIC_TOKENS; ++t) acc[t] = fmaf(wv, xr[t][i], acc[t]);
    }
#pragma unroll
    for (int t = 0; t < GENERIC_TOKENS; ++t) {
      const float v = warp_sum(acc[t]);
      if (lane == 0 && t < n) store_output(a, tile.row0 + r0 + t, o, v);
    }
  }
}

struct EmbeddingParams {
  WeightView table;  // [V, H] any variant
  const int32_t* ids;  // [T] I32
  float* y;            // [T, H] F32
  int64_t H;
};

// y[t, j] = dequant(table)[clamp(ids[t], 0, V-1), j]. Grid (T, ceil(H / 256)), one thread per
// element. Ids come from the device (prompt or sampler), so they are clamped, never trusted.
// Matches cpu::embedding exactly (same fp32 dequantization).
__global__ void embedding_kernel(const EmbeddingParams p) {
  pdl_wait();
  pdl_trigger();
  const int64_t t = blockIdx.x, j = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;
  if (j >= p.H) return;
  const int64_t id = min(max(int64_t(p.ids[t]), int64_t(0)), p.table.rows - 1);
  p.y[t * p.H + j] = dequant_at(p.table, 0, id, j);
}

}  // namespace lily::cuda
