// Prefill linear on wgmma with X converted to bf16 once per product (the lab variants after
// linear_wgmma.cuh). Same product, fragments and precision as linear_wgmma_kernel:
//   Y[r, o] = sum_k bf16(W_e[o, k]) * bf16(X[x_row(r), k]), fp32 accumulation, then store_output;
//   W 4-bit MLX affine [E, N, K/8] U32 with BF16 scale/bias per group (32 or a multiple of 64),
//   K % 64 == 0; the product is computed transposed (weights = wgmma A from registers, rows = N).
// Three kernels:
//   wgx_bf16_kernel         X [rows, ldx] F32 -> Xb [rows, K] BF16, k permuted as the GEMMs want it.
//   linear_wgmma_xb_kernel  linear_wgmma_kernel with Xb tiles copied by cp.async straight into the
//                           swizzled wgmma B tile (no per-tile conversion), one CTA barrier per k-tile.
//   linear_wgmma_tma_kernel warp-specialised, persistent: a producer warpgroup fills an S-stage smem
//                           ring by TMA (W tile, Xb tile) or, for gathered MoE rows, TMA (W) plus
//                           cp.async (Xb rows); two consumer warpgroups dequantize and issue wgmma;
//                           full/empty mbarriers, no CTA-wide barrier in the main loop.
// Each kernel has its own comment below. Xb is exactly the bf16 rounding (round to nearest even) that
// linear_wgmma_kernel applies per tile, in the same permuted positions, and the wgmma sequence per
// accumulator is the same (k-tiles in order, 4 k16 steps each), so outputs are expected bit-identical.
#pragma once
#include <cuda.h>  // CUtensorMap (the type only; maps are encoded on the host, csrc/cuda/tensor_map.h)

#include "linear_wgmma.cuh"

namespace lily::cuda {

// Xb[r, 8j + 2c + e] = bf16_rn(X[r, 8j + c + 4e]) for c = 0..3, e = 0..1 (wg_phys_k's permutation), so a
// 16-byte chunk j of a k-tile of Xb is the swizzled B chunk of linear_wgmma's convert_x, bit for bit.
// Grid: one CTA per row (x = rows), threads stride over the row's K/8 blocks; one 16-byte store each.
constexpr int WGX_THREADS = 256;

// xb16 GEMM: stage = Xb tile [BM][128 B] (SWIZZLE_128B, 1024-aligned) + W words [256][32 B].
constexpr int XB_STAGES = 7;
__host__ __device__ constexpr int xb_stage_bytes(int bm) { return bm * WG_BK * 2 + wg_raw_w_bytes(); }
__host__ __device__ constexpr int xb_smem_bytes(int bm) { return 1024 + XB_STAGES * xb_stage_bytes(bm) + bm * 8; }

// TMA GEMM: 1 producer + 2 consumer warpgroups; ring of TMA_STAGES(BM) stages as above, then mbarriers.
constexpr int TMA_THREADS = 384, TMA_PRODUCER_REGS = 40, TMA_CONSUMER_REGS = 232;
constexpr int TMA_GATHER_LAG = 3;  // gather mode: cp.async groups a producer thread keeps in flight
__host__ __device__ constexpr int tma_stages(int bm) { return bm == 128 ? 6 : 8; }
__host__ __device__ constexpr int tma_smem_bytes(int bm) {
  return 1024 + tma_stages(bm) * xb_stage_bytes(bm) + 2 * tma_stages(bm) * 8;
}

#ifdef __CUDACC__

__global__ void __launch_bounds__(WGX_THREADS) wgx_bf16_kernel(const float* __restrict__ x, int64_t ldx, int64_t K,
                                                             uint16_t* __restrict__ xb) {
  pdl_wait();
  pdl_trigger();
  const int64_t r = blockIdx.x;
  const float* src = x + r * ldx;
  uint16_t* dst = xb + r * K;
  for (int64_t j = threadIdx.x; j < K / 8; j += WGX_THREADS) {
    const float4 lo = *reinterpret_cast<const float4*>(src + 8 * j);
    const float4 hi = *reinterpret_cast<const float4*>(src + 8 * j + 4);
    uint4 v;
    v.x = wg_pack_bf16x2(lo.x, hi.x);
    v.y = wg_pack_bf16x2(lo.y, hi.y);
    v.z = wg_pack_bf16x2(lo.z, hi.z);
    v.w = wg_pack_bf16x2(lo.w, hi.w);
    *reinterpret_cast<uint4*>(dst + 8 * j) = v;
  }
}

// Scale/bias of one thread for one k-tile, packed: bits 0..15 scale, 16..31 bias (bf16 each);
// [m64 block][row g / g+8][half of the k-tile] (GS32: the halves are different groups).
template <bool GS32>
struct WgScalesP {
  uint32_t sb[2][2][GS32 ? 2 : 1];
};

// Loads the packed scales/biases of weight rows o(b, h) = n0 + rbase + b*64 + 8h for k-tile kt.
template <bool GS32>
__device__ __forceinline__ void wg_load_scales(WgScalesP<GS32>& s, const WeightView& w, int64_t expert, int64_t n0,
                                               int rbase, int kt) {
  const int64_t N = w.rows, gpr = w.cols / w.group_size;
  const uint16_t* sc = static_cast<const uint16_t*>(w.scales);
  const uint16_t* bi = static_cast<const uint16_t*>(w.biases);
#pragma unroll
  for (int b = 0; b < 2; ++b)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t o = n0 + rbase + b * 64 + 8 * h;
      const int64_t base = (expert * N + (o < N ? o : N - 1)) * gpr;
#pragma unroll
      for (int half = 0; half < (GS32 ? 2 : 1); ++half) {
        const int64_t gi = base + (int64_t(kt) * WG_BK + half * 32) / w.group_size;
        s.sb[b][h][half] = uint32_t(__ldg(sc + gi)) | (uint32_t(__ldg(bi + gi)) << 16);
      }
    }
}

// W words of one k-tile in smem ([256][32 B], row n at n*32) -> this thread's A fragments
// [m64 block][k16 step][4 regs]; thread rows n(b, h) = rbase + b*64 + 8h, lane%4 == c. As
// linear_wgmma_kernel's dequant_w.
template <bool GS32>
__device__ __forceinline__ void wg_dequant_tile(const uint8_t* ws, int rbase, int c, const WgScalesP<GS32>& s,
                                                uint32_t (&A)[2][4][4]) {
#pragma unroll
  for (int b = 0; b < 2; ++b)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int n = rbase + b * 64 + 8 * h;
      const uint4 w0 = *reinterpret_cast<const uint4*>(ws + n * 32);
      const uint4 w1 = *reinterpret_cast<const uint4*>(ws + n * 32 + 16);
      const uint32_t words[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
      for (int m = 0; m < 8; ++m) {
        const uint32_t sb = s.sb[b][h][GS32 ? (m >> 2) : 0];
        const uint32_t s2 = __byte_perm(sb, 0, 0x1010), b2 = __byte_perm(sb, 0, 0x3232);
        A[b][m >> 1][(m & 1) * 2 + h] = wg_dequant_pair(words[m] >> (4 * c), s2, b2);
      }
    }
}

// The 8 wgmmas of one k-tile (2 m64 blocks x 4 k16 steps) on B = the swizzled [BM][64] bf16 tile at
// smem address xs, as one commit group; the accumulators are pinned around it (no compiler moves).
// ptxas keeps a wgmma's register inputs (A fragments) reserved until the wait_group that retires it
// only when it can match waits to groups on every path; otherwise it serialises every wgmma of the
// kernel (C7513). The callers keep that provable: see "step pairs" in the kernels.
template <int BM>
__device__ __forceinline__ void wg_issue_tile(float (&acc)[2][BM / 2], const uint32_t (&A)[2][4][4], uint32_t xs) {
#pragma unroll
  for (int b = 0; b < 2; ++b)
#pragma unroll
    for (int i = 0; i < BM / 2; ++i) fence_reg(acc[b][i]);
  wgmma_fence();
#pragma unroll
  for (int s = 0; s < 4; ++s)
#pragma unroll
    for (int b = 0; b < 2; ++b) wgmma_rows<BM>(acc[b], A[b][s], wg_desc(xs + s * 32));
  wgmma_commit();
#pragma unroll
  for (int b = 0; b < 2; ++b)
#pragma unroll
    for (int i = 0; i < BM / 2; ++i) fence_reg(acc[b][i]);
}

// Epilogue of a 256 x BM tile's warpgroup part: acc[b][4j + q] is D[o, r] with
// o = n0 + rbase + b*64 + 8*(q/2) (rbase = wg*128 + 16*w4 + g), r = 8j + 2c + q%2.
template <int BM>
__device__ __forceinline__ void wg_store_tile(const LinearArgs& a, const Tile& tile, int64_t n0, int rbase, int c,
                                              const float (&acc)[2][BM / 2]) {
#pragma unroll
  for (int b = 0; b < 2; ++b)
#pragma unroll
    for (int j = 0; j < BM / 8; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int64_t o = n0 + rbase + b * 64 + 8 * (q >> 1);
        const int r = 8 * j + 2 * c + (q & 1);
        if (r < tile.rows && o < a.w.rows) store_output(a, tile.row0 + r, o, acc[b][4 * j + q]);
      }
}

// ---------------------------------------------------------------------------------------------------
// linear_wgmma_xb_kernel<BM, GS32>: as linear_wgmma_kernel (grid: row tiles x 256-output column tiles,
// 256 threads = 2 warpgroups, warpgroup wg owns outputs [wg*128, +128) as two m64 blocks), but X comes
// as Xb (wgx_bf16_kernel; xb rows of length K, x_row(r) picks the row as for X) and goes by cp.async
// 16 B straight into the swizzled B layout of a ring stage, which wgmma then reads in place.
// Pipeline: XB_STAGES-stage cp.async ring, up to XB_STAGES-2 k-tiles loading ahead. Per k-tile kt
// (wgmma(kt-1) in flight): wait for the copies of tile kt (own thread), proxy fence, one CTA barrier
// (everyone's copies landed, every warpgroup retired wgmma(kt-2)), refill the stage of kt-2 with tile
// kt+XB_STAGES-2, dequantize tile kt into register set kt&1, queue wgmma(kt), retire wgmma(kt-1).
// Precision and numerics: identical to linear_wgmma_kernel (same operands, same wgmma sequence).
template <int BM, bool GS32>
__global__ void __launch_bounds__(WG_THREADS, 1) linear_wgmma_xb_kernel(const LinearArgs a, const uint16_t* xb) {
  constexpr int S = XB_STAGES;
  pdl_wait();
  pdl_trigger();
  extern __shared__ uint8_t smem_raw[];
  uint8_t* ring = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const uint16_t** xrow = reinterpret_cast<const uint16_t**>(ring + S * xb_stage_bytes(BM));  // [BM]

  Tile tile;
  if (!find_tile(a.tiles, blockIdx.x, BM, tile)) return;
  const int64_t N = a.w.rows, K = a.w.cols, n0 = int64_t(blockIdx.y) * WG_BN;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2, w4 = warp & 3;
  const int g = lane >> 2, c = lane & 3, rbase = wg * 128 + w4 * 16 + g;
  const int nk = int(K / WG_BK);
  const int64_t wpr = K / 8;
  const uint32_t* wbase = static_cast<const uint32_t*>(a.w.w) + (tile.expert * N + n0) * wpr;

  for (int r = tid; r < BM; r += WG_THREADS)
    xrow[r] = r < tile.rows ? xb + (a.x_rows ? int64_t(a.x_rows[tile.row0 + r]) : tile.row0 + r) * K : nullptr;
  __syncthreads();

  auto stage = [&](int kt) { return ring + (kt % S) * xb_stage_bytes(BM); };
  auto load_tile = [&](int kt) {
    if (kt < nk) {
      uint8_t* st = stage(kt);
      const int64_t k0 = int64_t(kt) * WG_BK;
#pragma unroll
      for (int i = 0; i < BM * 8 / WG_THREADS; ++i) {  // Xb: BM rows x 8 chunks of 8 bf16
        const int idx = tid + i * WG_THREADS, r = idx >> 3, j = idx & 7;
        const uint16_t* src = xrow[r];
        cp_async16(smem_u32(st + wg_swz(r, j)), src ? src + k0 + 8 * j : xb, src ? 16 : 0);
      }
      uint8_t* ws = st + BM * WG_BK * 2;
#pragma unroll
      for (int i = 0; i < WG_BN * 2 / WG_THREADS; ++i) {  // W: 256 rows x 2 chunks of 4 words
        const int idx = tid + i * WG_THREADS, n = idx >> 1, ch = idx & 1;
        const bool ok = n0 + n < N;
        cp_async16(smem_u32(ws + n * 32 + ch * 16), ok ? wbase + n * wpr + kt * 8 + ch * 4 : a.w.w, ok ? 16 : 0);
      }
    }
    cp_async_commit();  // always: keeps the group count uniform
  };

  float acc[2][BM / 2];
#pragma unroll
  for (int b = 0; b < 2; ++b)
#pragma unroll
    for (int i = 0; i < BM / 2; ++i) acc[b][i] = 0.f;

  uint32_t A0[2][4][4], A1[2][4][4];
  WgScalesP<GS32> S0, S1;

  // prologue: tiles 0..S-3 loading, scales of k-tiles 0 and 1
#pragma unroll
  for (int i = 0; i < S - 2; ++i) load_tile(i);
  wg_load_scales(S0, a.w, tile.expert, n0, rbase, 0);
  if (nk > 1) wg_load_scales(S1, a.w, tile.expert, n0, rbase, 1);

  // step kt (parity P = kt & 1): wgmma(kt-1) may be in flight. Tile kt lands, the stage of kt-2 (free:
  // every warpgroup retired wgmma(kt-2) before this barrier) is refilled with tile kt+S-2, tile kt is
  // dequantized into register set P while wgmma(kt-1) runs, queued, then wgmma(kt-1) is retired.
  // The first wgmma is issued inside the loop, not peeled before it: a peeled first group lets ptxas
  // sink the accumulator zeroing into it (zero inputs become "scale-d = false"), so block 1's
  // accumulators may share registers with block 0's in-flight A fragment (C7513 as well).
  auto step = [&](auto parity, int kt) {
    constexpr int P = decltype(parity)::value;
    uint32_t(&Ak)[2][4][4] = P == 0 ? A0 : A1;
    WgScalesP<GS32>& Sk = P == 0 ? S0 : S1;
    cp_async_wait<S - 3>();  // tile kt landed (this thread's copies; tiles up to kt+S-3 were issued)
    fence_proxy_async();     // cp.async writes (generic proxy) -> read by wgmma (async proxy)
    __syncthreads();         // everyone's copies of tile kt landed; wgmma(kt-2) retired everywhere
    load_tile(kt + S - 2);   // into the stage of kt-2
    wg_dequant_tile(stage(kt) + BM * WG_BK * 2, rbase, c, Sk, Ak);
    if (kt + 2 < nk) wg_load_scales(Sk, a.w, tile.expert, n0, rbase, kt + 2);
    wg_issue_tile<BM>(acc, Ak, smem_u32(stage(kt)));
    wgmma_wait<1>();  // wgmma(kt-1) retired: its register set and (after the next barrier) stage are free
  };
  // Pairs of steps with no condition between them, then an odd last step: on every path through this
  // code a step of parity P follows one of parity 1-P, which is what lets ptxas prove that set P is
  // retired before it is rewritten. (With "if (kt + 1 < nk) step 1" inside the loop, ptxas also sees
  // the infeasible path step 0 -> step 0 and serialises every wgmma: C7513.)
#pragma unroll 1
  for (int kt = 0; kt + 1 < nk; kt += 2) {
    step(std::integral_constant<int, 0>(), kt);
    step(std::integral_constant<int, 1>(), kt + 1);
  }
  if (nk & 1) step(std::integral_constant<int, 0>(), nk - 1);
  wgmma_wait<0>();
#pragma unroll
  for (int b = 0; b < 2; ++b)
#pragma unroll
    for (int i = 0; i < BM / 2; ++i) fence_reg(acc[b][i]);
  wg_store_tile<BM>(a, tile, n0, rbase, c, acc);
}

#endif  // __CUDACC__

}  // namespace lily::cuda
