// Prefill linear over dense BF16 weights (the vision tower's) on Hopper warpgroup tensor cores (wgmma,
// sm_90a), both operands loaded by TMA:
//   Y[r, o] = sum_k W[o, k] * bf16(X[r, k]) (+ bias[o]), fp32 accumulation; with a GELU epilogue
//   (linear_bias_gelu) Y[r, o] = gelu_tanh(that + bias[o]) (kernels/gelu.cuh), stored as fp32 (WGD_GELU)
//   or as bf16_rn into Yb [M, N] row-major (WGD_GELU_XB: the next product's Xb, natural k order).
// Shapes: W [N, K] BF16 as stored (one stack entry), K % 8 == 0 (TMA: rows of whole 16 bytes); X [M, K]
// F32 converted once per product into Xb [M, K] BF16 in natural k order (wgx_bf16_kernel<true>; the
// 4-bit GEMM's k permutation, wg_phys_k, only serves its register dequantization and is not used here);
// bias [N] F32 or null. X may come as Xb already (written by its producer: layer_norm_xb, or another
// product's WGD_GELU_XB epilogue; linear_bias_xb, linear_bias_gelu_xb): no conversion then.
// Two kernels:
//   wgx_bf16_kernel<true>      (linear_wgmma_tma.cuh) X [M, ldx] F32 -> Xb [M, K] BF16, natural order.
//   linear_wgmma_dense_kernel  the GEMM: the 4-bit GEMM's structure (kernels/linear_wgmma_tma.cuh:
//                              persistent, warp-specialised, full/empty mbarrier ring) with A from
//                              shared memory: one producer thread issues two TMA loads a k-tile, two
//                              consumer warpgroups only issue wgmma (no dequantization).
// The product is computed transposed, D[o, r] = W[o, :] . X[r, :]: the weights are the wgmma A operand
// (M = 64 outputs per instruction), the rows of X the N dimension (BM = 64 or 128).
// Tile: 256 weight rows x BM rows of X, k-tiles of 64. Stage layout (1024-aligned, all parts too):
//   [Xb tile BM x 64 bf16][W tile 256 x 64 bf16], each [rows][128 B] as TMA SWIZZLE_128B writes it
//   (16-byte chunk j of row r at r*128 + ((j ^ (r & 7)) << 4): wg_swz), which is the wgmma K-major
//   128B-swizzle layout read by descriptor (wg_desc: SBO 1024 B; k16 step s at start + 32 s, i.e.
//   descriptor + 2 s). Consumer warpgroup cw owns W rows [cw*128, +128) as two m64 blocks b, whose A
//   descriptors start at the W tile + (cw*128 + b*64) * 128 B (wgd_a_offset; 1024-aligned).
// Tails: the tensor maps' extents are the true M, N and K; TMA fills box elements past them with zeros
//   in both operands, so a partial last k-tile (fc2: K = 4304 = 67 x 64 + 16) adds exact zeros, and
//   rows past N or M are computed from zeros and never stored. The stage's full byte count is always
//   delivered (TMA counts the zero-filled bytes too).
// Precision: bf16 x bf16 products exact in fp32, fp32 accumulation in wgmma's order (k-tiles ascending,
//   4 k16 steps each): ~1e-3 relative to the fp32 product, deterministic (fixed order per output), not
//   bit-identical to the mma.sync dense GEMM (GEMM_DENSE_BF16: another summation order). The bias is one
//   fp32 add after the sum: the bits of linear then add_bias on this kernel; the GELU epilogue then applies
//   the gelu op's function (the same bits as the gelu op after it) and WGD_GELU_XB rounds as wg_bf16 does
//   (the bits wgx_bf16_kernel<true> would write converting that fp32 output).
#pragma once
#include <cuda.h>  // CUtensorMap (the type only; maps are encoded on the host, csrc/cuda/tensor_map.h)

#include <cstdint>

#include "gelu.cuh"
#include "linear_common.cuh"
#include "linear_wgmma_tma.cuh"  // WG_BN, WG_BK, WGX_THREADS, wg_swz
#include "wgmma.cuh"
#include "xb_layout.cuh"  // wg_bf16

namespace lily::cuda {

// CTA: 1 producer warpgroup (one thread issues the TMA loads) + 2 consumer warpgroups.
constexpr int WGD_THREADS = 384, WGD_PRODUCER_REGS = 40, WGD_CONSUMER_REGS = 232;
// Epilogues: y = acc (+ bias); y = gelu_tanh(acc + bias); yb = bf16_rn(gelu_tanh(acc + bias)).
enum WgdEpilogue { WGD_PLAIN = 0, WGD_GELU = 1, WGD_GELU_XB = 2 };
__host__ __device__ constexpr int wgd_x_bytes(int bm) { return bm * WG_BK * 2; }
__host__ __device__ constexpr int wgd_stage_bytes(int bm) { return wgd_x_bytes(bm) + WG_BN * WG_BK * 2; }
__host__ __device__ constexpr int wgd_stages(int bm) { return bm == 128 ? 4 : 5; }  // 192 KB / 200 KB
__host__ __device__ constexpr int wgd_smem_bytes(int bm) {
  return 1024 + wgd_stages(bm) * wgd_stage_bytes(bm) + 2 * wgd_stages(bm) * 8;
}
// Byte offset in a stage of the A tile (64 weight rows x 64 k) of m64 block b of consumer warpgroup cw.
__host__ __device__ constexpr int wgd_a_offset(int bm, int cw, int b) {
  return wgd_x_bytes(bm) + (cw * 128 + b * 64) * WG_BK * 2;
}
static_assert(wgd_smem_bytes(128) <= 227 * 1024 && wgd_smem_bytes(64) <= 227 * 1024,
              "the dense ring exceeds the 227 KB opt-in shared memory");
static_assert(wgd_stage_bytes(64) % 1024 == 0 && wgd_x_bytes(64) % 1024 == 0 && wgd_a_offset(64, 0, 1) % 1024 == 0,
              "SWIZZLE_128B tiles start at multiples of 1024 B");

// Row tile for an M x N product on `sms` SMs: 128 rows, or 64 where that takes fewer "waves" of tile
// work, a 64-row tile counted at ~0.6 of a 128-row one (proj and fc2 at 4096 rows: 160 tiles of 128
// rows are 2 waves on 132 SMs, 320 of 64 rows 3 x 0.6). A host-side choice (linear.cu, the lab).
__host__ __device__ constexpr int wgd_bm(int64_t M, int64_t N, int64_t sms) {
  const int64_t col_tiles = (N + WG_BN - 1) / WG_BN;
  const int64_t waves128 = ((M + 127) / 128 * col_tiles + sms - 1) / sms;
  const int64_t waves64 = ((M + 63) / 64 * col_tiles + sms - 1) / sms;
  return waves64 * 3 < waves128 * 5 ? 64 : 128;
}
static_assert(wgd_bm(4096, 1152, 132) == 64 && wgd_bm(4096, 3456, 132) == 128 && wgd_bm(4096, 4304, 132) == 128,
              "the vision tower's products at 1 MP: proj and fc2 on 64-row tiles, qkv and fc1 on 128");

// Work unit u of a dense product: row tile u % row_tiles (fastest: CTAs running together share a weight
// column tile), column tile u / row_tiles.
struct WgdTile {
  int64_t row0, n0;
};
__host__ __device__ constexpr WgdTile wgd_tile(int64_t u, int64_t row_tiles, int bm) {
  return {(u % row_tiles) * bm, (u / row_tiles) * WG_BN};
}

// Accumulator i of m64 block b of consumer thread ct (0..255) is D[o, r] at tile offsets
// o = (ct / 128)*128 + b*64 + 16*((ct / 32) % 4) + (ct % 32) / 4 + 8*((i / 2) % 2),
// r = 8*(i / 4) + 2*(ct % 4) + i % 2 (wgmma's m64nNk16 f32 accumulator fragment).
__host__ __device__ constexpr int wgd_acc_o(int ct, int b, int i) {
  return (ct >> 7) * 128 + b * 64 + 16 * ((ct >> 5) & 3) + ((ct & 31) >> 2) + 8 * ((i >> 1) & 1);
}
__host__ __device__ constexpr int wgd_acc_r(int ct, int i) { return 8 * (i >> 2) + 2 * (ct & 3) + (i & 1); }

#ifdef __CUDACC__

// Epilogue of one consumer thread: y[row0 + r, n0 + o] = acc (+ bias[n0 + o]) for its (o, r) pairs
// (wgd_acc_o / wgd_acc_r) inside M and N. One bias load per weight row per tile. GELU epilogues (bias
// given): y = gelu_tanh(acc + bias, gelu_k) as fp32 (WGD_GELU) or as bf16 into a.yb [M, N] (WGD_GELU_XB:
// 2-byte stores, a warp's eight consecutive outputs of four rows per store).
template <int BM, int EPI>
__device__ __forceinline__ void wgd_store_tile(const LinearArgs& a, const float* bias, float gelu_k, WgdTile tile,
                                               int ct, const float (&acc)[2][BM / 2]) {
  const int64_t N = a.w.rows, rows = a.tiles.M - tile.row0;
  float bv[2][2];
  bool col[2][2];
#pragma unroll
  for (int b = 0; b < 2; ++b)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t o = tile.n0 + wgd_acc_o(ct, b, 2 * h);
      col[b][h] = o < N;
      bv[b][h] = bias != nullptr && col[b][h] ? bias[o] : 0.f;
    }
  const int64_t o0 = tile.n0 + wgd_acc_o(ct, 0, 0);
#pragma unroll
  for (int i = 0; i < BM / 2; ++i) {
    const int r = wgd_acc_r(ct, i), h = (i >> 1) & 1;
    if (r >= rows) continue;
    if constexpr (EPI == WGD_PLAIN) {
      float* y = a.y + (tile.row0 + r) * a.ldy + o0;
#pragma unroll
      for (int b = 0; b < 2; ++b)
        if (col[b][h]) y[b * 64 + 8 * h] = bias != nullptr ? acc[b][i] + bv[b][h] : acc[b][i];
    } else if constexpr (EPI == WGD_GELU) {
      float* y = a.y + (tile.row0 + r) * a.ldy + o0;
#pragma unroll
      for (int b = 0; b < 2; ++b)
        if (col[b][h]) y[b * 64 + 8 * h] = gelu_tanh(acc[b][i] + bv[b][h], gelu_k);
    } else {
      uint16_t* yb = a.yb + (tile.row0 + r) * N + o0;
#pragma unroll
      for (int b = 0; b < 2; ++b)
        if (col[b][h]) yb[b * 64 + 8 * h] = wg_bf16(gelu_tanh(acc[b][i] + bv[b][h], gelu_k));
    }
  }
}

// linear_wgmma_dense_kernel<BM, EPI>: Y = W . X^T (+ bias) over 256-output x BM-row tiles, persistent, the
// epilogue EPI (WgdEpilogue; gelu_k: the tanh form's constant, read by the GELU epilogues).
// Grid: min(units, SMs) CTAs of 384 threads; CTA i takes work units i, i + gridDim.x, ... (wgd_tile).
// Shared memory: a ring of S = wgd_stages(BM) stages of wgd_stage_bytes(BM), then full[S] and empty[S].
// Warpgroup 0 = producer (setmaxnreg 40), thread 0 only: per k-tile of every unit it waits empty[s],
//   arms full[s] with the stage's bytes and loads the W box {64 k, 256 rows} of tmap_w at (kt*64, n0)
//   and the Xb box {64 k, BM rows} of tmap_x at (kt*64, row0).
// Warpgroups 1, 2 = consumers (setmaxnreg 232), ct = tid - 128, cw = ct / 128: per k-tile wait full[s],
//   queue 4 k16 steps x 2 m64 blocks of m64nBMk16 wgmma (A and B by descriptor), commit, retire the
//   previous k-tile's group (wait_group 1) and release its stage (one arrival per consumer warp: empty
//   counts 8). Accumulators: 2 x BM/2 fp32 per thread. Epilogue straight from the accumulators
//   (wgd_store_tile) while the producer already fills the ring with the next unit.
template <int BM, int EPI>
__global__ void __launch_bounds__(WGD_THREADS, 1)
    linear_wgmma_dense_kernel(const LinearArgs a, const float* bias, float gelu_k,
                              const __grid_constant__ CUtensorMap tmap_x, const __grid_constant__ CUtensorMap tmap_w) {
  constexpr int S = wgd_stages(BM);
  constexpr uint32_t STAGE = wgd_stage_bytes(BM), XBYTES = wgd_x_bytes(BM);
  pdl_wait();
  pdl_trigger();
  extern __shared__ uint8_t smem_raw[];
  const uint32_t ring_s = (smem_u32(smem_raw) + 1023) & ~1023u, bars = ring_s + S * STAGE;
  auto full = [&](uint32_t s) { return bars + 8 * s; };
  auto empty = [&](uint32_t s) { return bars + 8 * (S + s); };
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(full(s), 1);
      mbar_init(empty(s), 8);
    }
    mbar_init_fence();
  }
  __syncthreads();

  const int64_t N = a.w.rows, K = a.w.cols, M = a.tiles.M;
  const int nk = int((K + WG_BK - 1) / WG_BK);
  const int64_t row_tiles = (M + BM - 1) / BM, units = row_tiles * ((N + WG_BN - 1) / WG_BN);

  if (warp < 4) {  // ---------------- producer ----------------
    setmaxnreg_dec<WGD_PRODUCER_REGS>();
    if (tid != 0) return;
    uint32_t s = 0, ph = 0;
    for (int64_t u = blockIdx.x; u < units; u += gridDim.x) {
      const WgdTile tile = wgd_tile(u, row_tiles, BM);
      for (int kt = 0; kt < nk; ++kt) {
        mbar_wait(empty(s), ph ^ 1);
        const uint32_t st = ring_s + s * STAGE;
        mbar_arrive_expect_tx(full(s), STAGE);
        tma_load_2d(st + XBYTES, &tmap_w, full(s), kt * WG_BK, int(tile.n0));
        tma_load_2d(st, &tmap_x, full(s), kt * WG_BK, int(tile.row0));
        if (++s == S) s = 0, ph ^= 1;
      }
    }
    return;
  }

  // ---------------- consumers ----------------
  setmaxnreg_inc<WGD_CONSUMER_REGS>();
  const int ct = tid - 128, cw = ct >> 7;
  uint32_t s = 0, ph = 0, prev = 0;
  for (int64_t u = blockIdx.x; u < units; u += gridDim.x) {
    const WgdTile tile = wgd_tile(u, row_tiles, BM);
    float acc[2][BM / 2];
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
      for (int i = 0; i < BM / 2; ++i) acc[b][i] = 0.f;
#pragma unroll 1
    for (int kt = 0; kt < nk; ++kt) {
      mbar_wait(full(s), ph);
      const uint32_t st = ring_s + s * STAGE;
      const uint64_t xd = wg_desc(st), ad0 = wg_desc(st + wgd_a_offset(BM, cw, 0)),
                     ad1 = wg_desc(st + wgd_a_offset(BM, cw, 1));
#pragma unroll
      for (int b = 0; b < 2; ++b)
#pragma unroll
        for (int i = 0; i < BM / 2; ++i) fence_reg(acc[b][i]);
      wgmma_fence();
#pragma unroll
      for (int k16 = 0; k16 < WG_BK / 16; ++k16) {  // descriptor + 2 = start + 32 B (see the header)
        wgmma_rows_ss<BM>(acc[0], ad0 + 2 * k16, xd + 2 * k16);
        wgmma_rows_ss<BM>(acc[1], ad1 + 2 * k16, xd + 2 * k16);
      }
      wgmma_commit();
#pragma unroll
      for (int b = 0; b < 2; ++b)
#pragma unroll
        for (int i = 0; i < BM / 2; ++i) fence_reg(acc[b][i]);
      wgmma_wait<1>();  // the previous k-tile's group retired: its stage is free
      if (kt > 0 && lane == 0) mbar_arrive(empty(prev));
      prev = s;
      if (++s == S) s = 0, ph ^= 1;
    }
    wgmma_wait<0>();
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
      for (int i = 0; i < BM / 2; ++i) fence_reg(acc[b][i]);
    if (lane == 0) mbar_arrive(empty(prev));
    wgd_store_tile<BM, EPI>(a, bias, gelu_k, tile, ct, acc);
  }
}

#endif  // __CUDACC__

}  // namespace lily::cuda
