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

// Half k-tiles (k16 steps 2H, 2H+1 = packed words 4H..4H+3 of each row, the 16-byte chunk H of the
// row's 32 bytes): the TMA kernel's consumers pipeline at this grain so that only two half sets of A
// registers (2 x 16) are live next to the 2 x BM/2 accumulators; a full double set (2 x 32) does not
// fit 232 registers at BM = 128 (ptxas C7512, "insufficient register resources": wgmma serialised).
template <int H, bool GS32>
__device__ __forceinline__ void wg_dequant_half(const uint8_t* ws, int rbase, int c, const WgScalesP<GS32>& s,
                                                uint32_t (&A)[2][2][4]) {
#pragma unroll
  for (int b = 0; b < 2; ++b)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4 w = *reinterpret_cast<const uint4*>(ws + (rbase + b * 64 + 8 * h) * 32 + 16 * H);
      const uint32_t words[4] = {w.x, w.y, w.z, w.w};
      const uint32_t sb = s.sb[b][h][GS32 ? H : 0];
      const uint32_t s2 = __byte_perm(sb, 0, 0x1010), b2 = __byte_perm(sb, 0, 0x3232);
#pragma unroll
      for (int m = 0; m < 4; ++m) A[b][m >> 1][(m & 1) * 2 + h] = wg_dequant_pair(words[m] >> (4 * c), s2, b2);
    }
}

template <int BM, int H>
__device__ __forceinline__ void wg_issue_half(float (&acc)[2][BM / 2], const uint32_t (&A)[2][2][4], uint32_t xs) {
#pragma unroll
  for (int b = 0; b < 2; ++b)
#pragma unroll
    for (int i = 0; i < BM / 2; ++i) fence_reg(acc[b][i]);
  wgmma_fence();
#pragma unroll
  for (int s = 0; s < 2; ++s)
#pragma unroll
    for (int b = 0; b < 2; ++b) wgmma_rows<BM>(acc[b], A[b][s], wg_desc(xs + (2 * H + s) * 32));
  wgmma_commit();
#pragma unroll
  for (int b = 0; b < 2; ++b)
#pragma unroll
    for (int i = 0; i < BM / 2; ++i) fence_reg(acc[b][i]);
}

// Epilogue of a 256 x BM tile's warpgroup part: acc[b][4j + 2h + e] is D[o, r] with
// o = n0 + rbase + b*64 + 8h (rbase = wg*128 + 16*w4 + g), r = 8j + 2c + e; store_output's arithmetic
// (plain, or y = row_scale * silu(y) * acc), with one row pointer per r (fewer live 64-bit addresses).
template <int BM>
__device__ __forceinline__ void wg_store_tile(const LinearArgs& a, const Tile& tile, int64_t n0, int rbase, int c,
                                              const float (&acc)[2][BM / 2]) {
  const int64_t o0 = n0 + rbase;
#pragma unroll
  for (int j = 0; j < BM / 8; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int r = 8 * j + 2 * c + e;
      if (r >= tile.rows) continue;
      const int64_t row = tile.row0 + r;
      float* y = a.y + row * a.ldy + o0;
      const float rs = a.swiglu && a.row_scale ? a.row_scale[row] : 1.f;
#pragma unroll
      for (int b = 0; b < 2; ++b)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int off = b * 64 + 8 * h;
          if (o0 + off >= a.w.rows) continue;
          const float v = acc[b][4 * j + 2 * h + e];
          if (!a.swiglu) y[off] = v;
          else y[off] = rs * silu(y[off]) * v;
        }
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

// ---------------------------------------------------------------------------------------------------
// mbarrier / TMA / register-budget primitives (sm_90).
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}
// Waits until the phase of parity `parity` has completed. A wait of more than ~2 s (2^32 clocks) is a
// protocol bug: trap (the launch fails with an error) instead of hanging the lab. No printf here: an
// extern call would make ptxas serialise the kernel's wgmma.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  if (mbar_try_wait(bar, parity)) return;
  const long long t0 = clock64();
  while (!mbar_try_wait(bar, parity))
    if (clock64() - t0 > (1ll << 32)) asm volatile("trap;");
}
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1,
                                            int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], "
      "[%2];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
template <int R>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(R));
}
template <int R>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(R));
}

// ---------------------------------------------------------------------------------------------------
// linear_wgmma_tma_kernel<BM, GS32, GATHER>: Y = W . X^T over 256-output x BM-row tiles, persistent.
// Grid: min(tiles, SMs) CTAs of 384 threads; CTA i takes tiles i, i + gridDim.x, ... of
// row_tiles x col_tiles (row tile fastest: CTAs running together share a weight column tile).
// Row tiles: dense ceil(M / BM), grouped *num_tiles (tile map of 64-row tiles, BM = 64).
// Shared memory: a ring of S = tma_stages(BM) stages, each [Xb tile BM x 64 bf16, 128B-swizzled as TMA
// SWIZZLE_128B writes it = wg_swz][W words 256 rows x 32 B], then full[S] and empty[S] mbarriers.
// Warpgroup 0 = producer (setmaxnreg 40): for every k-tile of every tile it waits empty[s], then
//   !GATHER: one thread arms full[s] with the stage's bytes and issues two TMA loads: W box {8 words,
//            256 rows, 1 expert} of tmap_w (3-D [E][N][K/8] U32; rows >= N read as zero) and Xb box
//            {64, BM} of tmap_x (2-D [rows][K] bf16) at row tile.row0 (rows past the end read zero;
//            rows of the next expert in a MoE tile are read and never stored).
//   GATHER (MoE gate/up, x_rows): thread 0 arms full[s] with the W bytes and issues the W TMA; all 128
//            threads copy their 4 Xb chunks (row x_rows[row0 + r], 16 B each) by cp.async into the
//            swizzled positions; a thread arrives on full[s] once its copies of that stage have landed
//            (cp.async.wait_group TMA_GATHER_LAG, proxy fence, arrive), so full[s] counts 1 + 128.
// Warpgroups 1, 2 = consumers (setmaxnreg 232), outputs [cw*128, +128) of the tile as two m64 blocks,
//   exactly linear_wgmma_kernel's fragment and epilogue mapping (rbase = cw*128 + 16*w4 + g). Per
//   k-tile: wait full[s]; for each half (k16 steps 0-1, then 2-3): dequantize the half's W words from
//   the stage into its own register set (scales/biases from global, one k-tile ahead), queue its 4
//   wgmmas on B = the stage's Xb tile, retire the previous group (wait_group 1); retiring half 1 of
//   kt-1 releases kt-1's stage (one arrival per consumer warp: empty counts 8).
//   Epilogue straight from the accumulators (store_output) while the producer already fills the ring
//   with the next tile.
// No CTA-wide barrier after the mbarrier initialisation. Numerics as linear_wgmma_kernel (same operands,
// same wgmma sequence per accumulator): expected bit-identical.
template <int BM, bool GS32, bool GATHER>
__global__ void __launch_bounds__(TMA_THREADS, 1)
    linear_wgmma_tma_kernel(const LinearArgs a, const uint16_t* xb, const __grid_constant__ CUtensorMap tmap_x,
                            const __grid_constant__ CUtensorMap tmap_w) {
  constexpr int S = tma_stages(BM);
  constexpr uint32_t XBYTES = BM * WG_BK * 2, STAGE = xb_stage_bytes(BM);
  static_assert(!GATHER || BM == 64, "gathered rows come in 64-row MoE tiles");
  pdl_wait();
  pdl_trigger();
  extern __shared__ uint8_t smem_raw[];
  uint8_t* ring = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const uint32_t ring_s = smem_u32(ring), bars = ring_s + S * STAGE;
  auto full = [&](uint32_t s) { return bars + 8 * s; };
  auto empty = [&](uint32_t s) { return bars + 8 * (S + s); };
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(full(s), GATHER ? 1 + 128 : 1);
      mbar_init(empty(s), 8);
    }
    mbar_init_fence();
  }
  __syncthreads();

  const int64_t N = a.w.rows, K = a.w.cols;
  const int nk = int(K / WG_BK);
  const int64_t col_tiles = (N + WG_BN - 1) / WG_BN;
  const int64_t row_tiles = a.tiles.tile_expert ? int64_t(*a.tiles.num_tiles) : (a.tiles.M + BM - 1) / BM;
  const int64_t total = row_tiles * col_tiles;

  if (warp < 4) {  // ---------------- producer warpgroup ----------------
    setmaxnreg_dec<TMA_PRODUCER_REGS>();
    uint32_t s = 0, ph = 0;
    if constexpr (!GATHER) {
      if (tid != 0) return;
      for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
        Tile tile;
        if (!find_tile(a.tiles, t % row_tiles, BM, tile)) continue;
        const int n0 = int(t / row_tiles) * WG_BN;
        for (int kt = 0; kt < nk; ++kt) {
          mbar_wait(empty(s), ph ^ 1);
          const uint32_t st = ring_s + s * STAGE;
          mbar_arrive_expect_tx(full(s), STAGE);
          tma_load_3d(st + XBYTES, &tmap_w, full(s), kt * 8, n0, int(tile.expert));
          tma_load_2d(st, &tmap_x, full(s), kt * WG_BK, int(tile.row0));
          if (++s == S) s = 0, ph ^= 1;
        }
      }
    } else {
      constexpr int PER = BM * 8 / 128;  // 16-byte chunks per thread per stage
      const int j = tid & 7;             // chunk (k 8j..8j+7 of the k-tile) of every row this thread copies
      uint32_t s_arrive = 0;             // oldest stage whose arrival is still due
      int pending = 0;                   // stages copied by this thread and not yet arrived on
      for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
        Tile tile;
        if (!find_tile(a.tiles, t % row_tiles, BM, tile)) continue;
        const int n0 = int(t / row_tiles) * WG_BN;
        const uint16_t* src[PER];
#pragma unroll
        for (int i = 0; i < PER; ++i) {
          const int r = (tid >> 3) + 16 * i;
          src[i] = r < tile.rows ? xb + int64_t(a.x_rows[tile.row0 + r]) * K + 8 * j : nullptr;
        }
        for (int kt = 0; kt < nk; ++kt) {
          mbar_wait(empty(s), ph ^ 1);
          const uint32_t st = ring_s + s * STAGE;
          if (tid == 0) {
            mbar_arrive_expect_tx(full(s), STAGE - XBYTES);
            tma_load_3d(st + XBYTES, &tmap_w, full(s), kt * 8, n0, int(tile.expert));
          }
#pragma unroll
          for (int i = 0; i < PER; ++i)
            cp_async16(st + wg_swz((tid >> 3) + 16 * i, j), src[i] ? src[i] + kt * WG_BK : xb, src[i] ? 16 : 0);
          cp_async_commit();
          if (pending == TMA_GATHER_LAG) {
            cp_async_wait<TMA_GATHER_LAG>();  // the oldest pending stage's copies landed
            fence_proxy_async();              // generic-proxy writes -> read by wgmma (async proxy)
            mbar_arrive(full(s_arrive));
            if (++s_arrive == S) s_arrive = 0;
          } else {
            ++pending;
          }
          if (++s == S) s = 0, ph ^= 1;
        }
      }
      cp_async_wait<0>();
      fence_proxy_async();
      for (; pending > 0; --pending) {
        mbar_arrive(full(s_arrive));
        if (++s_arrive == S) s_arrive = 0;
      }
    }
    return;
  }

  // ---------------- consumer warpgroups ----------------
  setmaxnreg_inc<TMA_CONSUMER_REGS>();
  const int ct = tid - 128, cw = ct >> 7, w4 = (ct >> 5) & 3, g = lane >> 2, c = lane & 3;
  const int rbase = cw * 128 + w4 * 16 + g;
  uint32_t s = 0, ph = 0, s_prev = 0;
  for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
    Tile tile;
    if (!find_tile(a.tiles, t % row_tiles, BM, tile)) continue;
    const int64_t n0 = (t / row_tiles) * WG_BN;
    float acc[2][BM / 2];
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
      for (int i = 0; i < BM / 2; ++i) acc[b][i] = 0.f;
    uint32_t H0[2][2][4], H1[2][2][4];  // A fragments of half k-tiles 0 and 1
    WgScalesP<GS32> cur, nxt;
    wg_load_scales(nxt, a.w, tile.expert, n0, rbase, 0);
    // k-tile kt: two groups (half 0, half 1), each queued while the previous group runs, then the
    // previous group is retired (wait_group 1). Retiring half 1 of kt-1 frees kt-1's stage. Every
    // iteration issues H0 then H1, so ptxas can match each wait to its group (no C7513).
#pragma unroll 1
    for (int kt = 0; kt < nk; ++kt) {
      cur = nxt;
      if (kt + 1 < nk) wg_load_scales(nxt, a.w, tile.expert, n0, rbase, kt + 1);
      mbar_wait(full(s), ph);
      const uint8_t* ws = ring + s * STAGE + XBYTES;
      const uint32_t xs = ring_s + s * STAGE;
      wg_dequant_half<0>(ws, rbase, c, cur, H0);
      wg_issue_half<BM, 0>(acc, H0, xs);
      wgmma_wait<1>();  // half 1 of kt-1 retired
      if (kt > 0 && lane == 0) mbar_arrive(empty(s_prev));
      wg_dequant_half<1>(ws, rbase, c, cur, H1);
      wg_issue_half<BM, 1>(acc, H1, xs);
      wgmma_wait<1>();  // half 0 of kt retired
      s_prev = s;
      if (++s == S) s = 0, ph ^= 1;
    }
    wgmma_wait<0>();
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
      for (int i = 0; i < BM / 2; ++i) fence_reg(acc[b][i]);
    if (lane == 0) mbar_arrive(empty(s_prev));
    wg_store_tile<BM>(a, tile, n0, rbase, c, acc);
  }
}

#endif  // __CUDACC__

}  // namespace lily::cuda
