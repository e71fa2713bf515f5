// The gemm lab's reference (benchmarks/gemm_lab.cu, row "wgmma"): the one-kernel wgmma GEMM the library
// ran for prefill before kernels/linear_wgmma_tma.cuh replaced it. Kept here, outside the library, so the
// lab can still check the TMA kernel bit for bit against it and time both.
// Prefill linear on Hopper warpgroup tensor cores (wgmma, sm_90a) over 4-bit MLX-affine weights:
//   Y[r, o] = sum_k bf16(W_e[o, k]) * bf16(X[x_row(r), k]), fp32 accumulation, then store_output
//   (linear_common.cuh: plain store, or SwiGLU with a per-row scale for MoE).
// Shapes: W [E, N, K/8] U32 (4-bit, K % 64 == 0), scales/biases BF16 [E, N, K/gs] with gs == 32 or
// gs % 64 == 0; X rows [K] F32 (16-byte aligned rows, ldx % 4 == 0); rows come in tiles of BM from
// RowTiles (dense: BM = 128 or 64; MoE grouped tile maps: BM = LINEAR_TILE_ROWS = 64).
//
// The product is computed transposed, D[o, r] = W[o, :] . X[r, :], so that the weights are the wgmma A
// operand (M = 64 outputs per instruction) and the activation rows are the N dimension (N = BM = 64 or
// 128): a 64-row MoE tile is an exact m64nBMk16 instruction, no padding to 128.
// CTA: 256 threads = 2 warpgroups, tile BN = 256 outputs x BM rows, k-tiles of 64. Warpgroup wg owns
// outputs [wg*128, wg*128+128) as two m64 blocks; each thread holds 2 x BM/2 fp32 accumulators.
//   A (weights) from registers: each thread dequantizes its own fragment straight from the packed words
//     (w = scale*q + bias rounded once to bf16: q is exact as bf16 0x4300|q minus 128, then one bf16x2
//     fma with the bf16 scale and bias; the same value as linear_gemm's fp32 fma rounded to bf16
//     up to a double rounding). No dequantized weight ever goes to shared or device memory.
//   B (activations) from shared memory: fp32 X rows converted to bf16 into a 128B-swizzled K-major tile
//     [BM][64] (wgmma descriptor: SBO = 1024 B, layout SWIZZLE_128B, k16 steps advance the start by 32 B).
// k permutation: inside every aligned block of 8 k values, logical position 2c+e holds physical value
//   c+4e (c = 0..3, e = 0..1). A and B use the same permutation, so the sum is unchanged; it makes the
//   A fragment of thread (lane%4 == c) nibbles c and c+4 of each packed word (one shift and one mask per
//   bf16 pair: (w >> 4c) & 0x000F000F | 0x43004300), and B pairs (x_c, x_{c+4}) of 8 loaded floats.
//   wgmma's A fragment (per warp, rows 16w..16w+15 of the m64 block, g = lane/4):
//   a0a1 (row g, k 2c..2c+1), a2a3 (row g+8, same k), a4a5 (row g, k 2c+8..), a6a7 (row g+8, k 2c+8..);
//   k16 step s of a k-tile covers packed words 2s (k 0..7 of the step) and 2s+1 (k 8..15).
// Pipeline (all 8 warps load, convert and issue; no warp specialisation):
//   raw ring of S stages in shared memory, filled by cp.async 16 B (X fp32 [BM][64], W words [256][8]),
//   S-1 tiles in flight; per k-tile t: wait raw(t+1), convert X(t+1) into the other bf16 buffer and
//   dequantize W(t+1) into the other register set while wgmma(t) runs, barrier, issue wgmma(t+1).
//   So the tensor cores always have the next k-tile queued when one finishes (wait_group 1).
//   Scales/biases are read with plain loads one k-tile ahead, into registers.
// Precision: bf16 operands (w rounded once, x rounded once), fp32 accumulation: ~1e-3 relative, like
//   linear_gemm.
#pragma once
#include <type_traits>

#include "cuda/kernels/linear_wgmma_tma.cuh"

namespace lily::cuda {

constexpr int WG_THREADS = 256, WG_STAGES = 4;

// Bytes of one raw stage and the whole dynamic shared memory of a CTA with BM rows.
__host__ __device__ constexpr int wg_raw_x_bytes(int bm) { return bm * WG_BK * 4; }
__host__ __device__ constexpr int wg_raw_w_bytes() { return WG_BN * WG_BK / 2; }
__host__ __device__ constexpr int wg_stage_bytes(int bm) { return wg_raw_x_bytes(bm) + wg_raw_w_bytes(); }
__host__ __device__ constexpr int wg_xbf_bytes(int bm) { return bm * WG_BK * 2; }
__host__ __device__ constexpr int wg_smem_bytes(int bm) {
  return 1024 /*alignment slack*/ + 2 * wg_xbf_bytes(bm) + WG_STAGES * wg_stage_bytes(bm) + bm * 8 /*row ptrs*/;
}

#ifdef __CUDACC__

// Scale/bias bits of one thread for one k-tile: [m64 block][row g / g+8][half of the k-tile]; each
// value is a bf16 in the low 16 bits. GS32: the two halves of a k-tile are different groups.
struct LabScales {
  uint32_t s[2][2][2], b[2][2][2];
};

template <int BM, bool GS32>
__global__ void __launch_bounds__(WG_THREADS, 1) linear_wgmma_kernel(const LinearArgs a) {
  pdl_wait();
  pdl_trigger();
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* xbf = smem;                                // [2][BM][128 B] swizzled bf16 X tiles (1024-aligned)
  uint8_t* ring = xbf + 2 * wg_xbf_bytes(BM);         // [S] stages: X fp32 [BM][64], then W words [256][32 B]
  const float** xrow = reinterpret_cast<const float**>(ring + WG_STAGES * wg_stage_bytes(BM));  // [BM]

  Tile tile;
  if (!find_tile(a.tiles, blockIdx.x, BM, tile)) return;
  const int64_t N = a.w.rows, K = a.w.cols, n0 = int64_t(blockIdx.y) * WG_BN;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2, w4 = warp & 3;
  const int g = lane >> 2, c = lane & 3;
  const int nk = int(K / WG_BK);
  const int64_t wpr = K / 8, gpr = K / a.w.group_size;
  const uint32_t* wbase = static_cast<const uint32_t*>(a.w.w) + (tile.expert * N + n0) * wpr;
  const uint16_t* sc = static_cast<const uint16_t*>(a.w.scales);
  const uint16_t* bi = static_cast<const uint16_t*>(a.w.biases);

  for (int r = tid; r < BM; r += WG_THREADS) xrow[r] = r < tile.rows ? x_row(a, tile.row0 + r) : nullptr;
  __syncthreads();

  // ---- raw stage loads (cp.async) ----
  auto load_raw = [&](int kt) {
    if (kt < nk) {
      uint8_t* st = ring + (kt % WG_STAGES) * wg_stage_bytes(BM);
      const int64_t k0 = int64_t(kt) * WG_BK;
#pragma unroll
      for (int i = 0; i < BM * 16 / WG_THREADS; ++i) {  // X: BM rows x 16 chunks of 4 floats
        const int idx = tid + i * WG_THREADS, r = idx >> 4, ch = idx & 15;
        const float* src = xrow[r];
        cp_async16(smem_u32(st + r * 256 + ch * 16), src ? src + k0 + 4 * ch : a.x, src ? 16 : 0);
      }
      uint8_t* ws = st + wg_raw_x_bytes(BM);
#pragma unroll
      for (int i = 0; i < WG_BN * 2 / WG_THREADS; ++i) {  // W: 256 rows x 2 chunks of 4 words
        const int idx = tid + i * WG_THREADS, n = idx >> 1, ch = idx & 1;
        const bool ok = n0 + n < N;
        cp_async16(smem_u32(ws + n * 32 + ch * 16), ok ? wbase + n * wpr + kt * 8 + ch * 4 : a.w.w, ok ? 16 : 0);
      }
    }
    cp_async_commit();  // always: keeps the group count uniform
  };

  // ---- scales/biases of this thread's 4 weight rows, plain loads into registers ----
  auto load_scales = [&](LabScales& s, int kt) {
    if (kt >= nk) return;
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t o = n0 + wg * 128 + b * 64 + w4 * 16 + g + 8 * h;
        const int64_t base = (tile.expert * N + (o < N ? o : N - 1)) * gpr;
#pragma unroll
        for (int half = 0; half < (GS32 ? 2 : 1); ++half) {
          const int64_t gi = base + (int64_t(kt) * WG_BK + half * 32) / a.w.group_size;
          s.s[b][h][half] = __ldg(sc + gi);
          s.b[b][h][half] = __ldg(bi + gi);
        }
        if constexpr (!GS32) {
          s.s[b][h][1] = s.s[b][h][0];
          s.b[b][h][1] = s.b[b][h][0];
        }
      }
  };

  // ---- X raw fp32 -> bf16 swizzled, permuted ----
  auto convert_x = [&](int kt, int buf) {
    const uint8_t* st = ring + (kt % WG_STAGES) * wg_stage_bytes(BM);
    uint8_t* dst = xbf + buf * wg_xbf_bytes(BM);
#pragma unroll
    for (int i = 0; i < BM * 8 / WG_THREADS; ++i) {
      const int idx = tid + i * WG_THREADS, r = idx >> 3, j = idx & 7;
      const float4 lo = *reinterpret_cast<const float4*>(st + r * 256 + j * 32);
      const float4 hi = *reinterpret_cast<const float4*>(st + r * 256 + j * 32 + 16);
      uint4 v;
      v.x = wg_pack_bf16x2(lo.x, hi.x);
      v.y = wg_pack_bf16x2(lo.y, hi.y);
      v.z = wg_pack_bf16x2(lo.z, hi.z);
      v.w = wg_pack_bf16x2(lo.w, hi.w);
      *reinterpret_cast<uint4*>(dst + wg_swz(r, j)) = v;
    }
    fence_proxy_async();  // generic-proxy stores, read next by wgmma (async proxy)
  };

  // ---- W raw words -> A fragments [m64 block][k16 step][4 regs] ----
  auto dequant_w = [&](int kt, const LabScales& s, uint32_t (&A)[2][4][4]) {
    const uint8_t* ws = ring + (kt % WG_STAGES) * wg_stage_bytes(BM) + wg_raw_x_bytes(BM);
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int n = wg * 128 + b * 64 + w4 * 16 + g + 8 * h;
        const uint4 w0 = *reinterpret_cast<const uint4*>(ws + n * 32);
        const uint4 w1 = *reinterpret_cast<const uint4*>(ws + n * 32 + 16);
        const uint32_t words[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
        for (int m = 0; m < 8; ++m) {
          const uint32_t s2 = s.s[b][h][m >> 2] * 0x10001u, b2 = s.b[b][h][m >> 2] * 0x10001u;
          // word m = k16 step m/2, half m%2: register (m%2)*2 + h of that step
          A[b][m >> 1][(m & 1) * 2 + h] = wg_dequant_pair(words[m] >> (4 * c), s2, b2);
        }
      }
  };

  float acc[2][BM / 2];
#pragma unroll
  for (int b = 0; b < 2; ++b)
#pragma unroll
    for (int i = 0; i < BM / 2; ++i) acc[b][i] = 0.f;

  auto issue_mma = [&](int buf, const uint32_t (&A)[2][4][4]) {
    const uint32_t base = smem_u32(xbf + buf * wg_xbf_bytes(BM));
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
      for (int i = 0; i < BM / 2; ++i) fence_reg(acc[b][i]);
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < 4; ++s)
#pragma unroll
      for (int b = 0; b < 2; ++b) wgmma_rows<BM>(acc[b], A[b][s], wg_desc(base + s * 32));
    wgmma_commit();
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
      for (int i = 0; i < BM / 2; ++i) fence_reg(acc[b][i]);
  };

  uint32_t A0[2][4][4], A1[2][4][4];
  LabScales S0, S1;

  // prologue: S-1 raw tiles in flight, k-tile 0 converted and issued
#pragma unroll
  for (int i = 0; i < WG_STAGES - 1; ++i) load_raw(i);
  load_scales(S0, 0);
  load_scales(S1, 1);
  cp_async_wait<WG_STAGES - 2>();
  __syncthreads();
  convert_x(0, 0);
  dequant_w(0, S0, A0);
  load_scales(S0, 2);
  __syncthreads();
  issue_mma(0, A0);

  // iteration kt: wgmma(kt) is queued; prepare and queue kt+1 (parity P = kt & 1).
  auto step = [&](auto parity, int kt) {
    constexpr int P = decltype(parity)::value;
    uint32_t(&An)[2][4][4] = P == 0 ? A1 : A0;  // set of tile kt+1
    LabScales& Sn = P == 0 ? S1 : S0;
    load_raw(kt + WG_STAGES - 1);
    wgmma_wait<1>();  // wgmma(kt-1) done: its X buffer and register set are free
    cp_async_wait<WG_STAGES - 2>();  // raw(kt+1) landed (this thread's copies)
    __syncthreads();                 // ... everyone's; and wgmma(kt-1) done in both warpgroups
    if (kt + 1 < nk) {
      convert_x(kt + 1, P ^ 1);
      dequant_w(kt + 1, Sn, An);
      load_scales(Sn, kt + 3);
    }
    __syncthreads();
    if (kt + 1 < nk) issue_mma(P ^ 1, An);
  };
  for (int kt = 0; kt < nk; kt += 2) {
    step(std::integral_constant<int, 0>(), kt);
    if (kt + 1 < nk) step(std::integral_constant<int, 1>(), kt + 1);
  }
  wgmma_wait<0>();
#pragma unroll
  for (int b = 0; b < 2; ++b)
#pragma unroll
    for (int i = 0; i < BM / 2; ++i) fence_reg(acc[b][i]);

  // epilogue: acc[b][4j + q] is D[o, r] with o = wg*128 + b*64 + 16*w4 + g + 8*(q/2), r = 8j + 2c + q%2
#pragma unroll
  for (int b = 0; b < 2; ++b)
#pragma unroll
    for (int j = 0; j < BM / 8; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int64_t o = n0 + wg * 128 + b * 64 + 16 * w4 + g + 8 * (q >> 1);
        const int r = 8 * j + 2 * c + (q & 1);
        if (r < tile.rows && o < N) store_output(a, tile.row0 + r, o, acc[b][4 * j + q]);
      }
}

#endif  // __CUDACC__

}  // namespace lily::cuda
