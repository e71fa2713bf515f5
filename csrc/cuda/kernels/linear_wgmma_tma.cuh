// Prefill linear on Hopper warpgroup tensor cores (wgmma, sm_90a) over 4- or 8-bit MLX-affine weights (BITS):
//   Y[r, o] = sum_k bf16(W_e[o, k]) * bf16(X[x_row(r), k]), fp32 accumulation, then store_output
//   (linear_common.cuh: plain store, as F32 y or, unsplit with LinearArgs::y16, as bf16 rows rounded to
//   nearest even; or SwiGLU with a per-row scale for MoE), or (GATED) the gate and
//   up products of a SwiGLU at once: y[r, o] = row_scale[r] * silu(G[r, o]) * U[r, o], stored as F32 y
//   or (LinearArgs::yb) as the next product's Xb rows.
// Shapes: W [E, N, K*BITS/32] U32 (K % 64 == 0), scales/biases BF16 [E, N, K/gs] (< 2^32 elements) with
// gs == 32 or a power of two >= 64; X [rows, K] as Xb BF16 (wgx_bf16_kernel from the F32 rows, once per
// product, or written so by X's producer: LinearArgs::xb, wg_xb_pos); rows come in tiles of BM from RowTiles (dense: BM = 256, 128 or 64; MoE grouped tile maps:
// BM = the map's tile_rows, 64 or 128, or 160 for the down product's merged tiles: moe_scatter_kernel).
// Two kernels:
//   wgx_bf16_kernel          X [rows, ldx] F32 -> Xb [rows, K] BF16, k permuted as the GEMM wants it
//                            (NATURAL: in stored order, for the dense BF16 GEMM).
//   linear_wgmma_tma_kernel  the GEMM: warp-specialised and persistent; a producer warpgroup fills an
//                            S-stage shared-memory ring by TMA (W tile, Xb tile) or, for gathered MoE
//                            rows, TMA (W) plus cp.async (Xb rows); two consumer warpgroups dequantize
//                            W and issue wgmma; full/empty mbarriers, no CTA-wide barrier in the loop.
//
// The product is computed transposed, D[o, r] = W[o, :] . X[r, :], so that the weights are the wgmma A
// operand (M = 64 outputs per instruction) and the activation rows are the N dimension (N = BM = 64, 128,
// 160 or 256): a 64-row MoE tile is an exact m64nBMk16 instruction, no padding to 128.
// Tile: wg_rows(BM) weight rows (256; 128 at BM = 256) x BM rows, k-tiles of 64. Consumer warpgroup cw owns
// weight rows [cw*64*NB, +64*NB) of the tile as NB = wg_blocks(BM) m64 blocks (2; 1 at BM = 256); each
// thread holds NB x BM/2 fp32 accumulators. The weight rows are wg_rows(BM)
// outputs of W, or (GATED) 128 rows of the gate matrix W then the same 128 rows of the up matrix,
// interleaved: each 16-row warp slice of an m64 block holds 8 gate rows (rows g) and the up rows of the
// same 8 outputs (rows g + 8), so each thread holds G and U of its outputs and computes the SwiGLU in
// registers (wg_row_base, wg_row_step).
//   A (weights) from registers: each thread dequantizes its own fragment straight from the packed words
//     (w = scale*q + bias rounded once to bf16: q made exact in bf16 first, 4-bit as 0x4300|q minus 128
//     (wg_dequant_pair), 8-bit through fp32 2^23 + q minus 2^23 (wg_q8_pair); then one bf16x2 fma with
//     the bf16 scale and bias). No dequantized weight goes to memory.
//   B (activations) from shared memory: Xb rows in a 128B-swizzled K-major tile [BM][64] (wgmma
//     descriptor: SBO = 1024 B, layout SWIZZLE_128B, k16 steps advance the start by 32 B), written by
//     TMA with SWIZZLE_128B (the same layout: address bits 4-6 XOR bits 7-9 of a 1024-aligned stage,
//     wg_swz) or by cp.async at wg_swz.
// k permutation: inside every aligned block of 8 k values, logical position 2c+e holds physical value
//   c+4e (c = 0..3, e = 0..1; wg_phys_k). A and B use the same permutation, so the sum is unchanged; it
//   makes the A fragment of thread (lane%4 == c) nibbles c and c+4 of each packed word (one shift and
//   one lop3 per bf16 pair: (w >> 4c) & 0x000F000F | 0x43004300), and Xb's 16-byte chunk j of a row the
//   pairs (x_{8j+c}, x_{8j+c+4}). 8-bit: a block of 8 k is two words, and the pair is byte c of each
//   (wg_q8_pair); Xb is the same, so one Xb serves 4- and 8-bit products of the same X.
//   wgmma's A fragment (per warp, rows 16w..16w+15 of the m64 block, g = lane/4):
//   a0a1 (row g, k 2c..2c+1), a2a3 (row g+8, same k), a4a5 (row g, k 2c+8..), a6a7 (row g+8, k 2c+8..);
//   k16 step s of a k-tile covers packed words 2s (k 0..7 of the step) and 2s+1 (k 8..15); 8-bit: words
//   4s, 4s+1 (k 0..7: a0a1, a2a3) and 4s+2, 4s+3 (k 8..15: a4a5, a6a7), one 16-byte load per row.
// Precision: bf16 operands (w rounded once, x rounded once, round to nearest even), fp32 accumulation in
//   a fixed order (k-tiles ascending, 4 k16 steps each; the same for both BITS): ~1e-3 relative to the
//   fp32 product, deterministic (a y16 output then rounds each sum once to bf16: 2^-9 relative); 4-bit
//   bit-identical to the retired one-kernel wgmma GEMM
//   (benchmarks/gemm_lab_wgmma.cuh, same operands and wgmma sequence; checked on the H200 by
//   benchmarks/gemm_lab.sh). GATED computes
//   every G and U value with the same operands and wgmma sequence as the plain gate and up products
//   (an output row sits at the same row of the same m64 block: tiles start at multiples of 128) and
//   the SwiGLU with store_output's expression: bit-identical to the two products (gemm_lab checks).
#pragma once
#include <cuda.h>  // CUtensorMap (the type only; maps are encoded on the host, csrc/cuda/tensor_map.h)

#include <cstdint>
#include <cstring>  // memcpy (wg_f32_of, wg_bits_of on the host)
#include <type_traits>  // std::true_type (the epilogues' all-columns form)

#include "linear_common.cuh"
#include "wgmma.cuh"

namespace lily::cuda {

constexpr int WG_BN = 256, WG_BK = 64;

// wg_phys_k, wg_xb_pos (the k permutation of Xb) and the bf16 rounding: xb_layout.cuh.
// Byte offset of the 16-byte chunk j (logical k 8j..8j+7) of row r in a [rows][64] bf16 SWIZZLE_128B tile.
__host__ __device__ constexpr int wg_swz(int r, int j) { return r * 128 + ((j ^ (r & 7)) << 4); }

// base + 16 * chunk bytes as one IMAD.WIDE.U32 (mad.wide.u32): the gather's per-chunk address, which the
// compiler otherwise forms as 64-bit index arithmetic (four instructions a chunk).
__device__ __forceinline__ const void* wg_chunk_at(const uint16_t* base, uint32_t chunk) {
  uint64_t p;
  asm("mad.wide.u32 %0, %1, 16, %2;" : "=l"(p) : "r"(chunk), "l"(base));
  return reinterpret_cast<const void*>(p);
}

// base + i * stride bytes as one IMAD.WIDE.U32 (an epilogue's row pointer: the compiler otherwise rebuilds the
// element index in 64 bits and shifts it, six instructions a row).
template <typename T>
__device__ __forceinline__ T* wg_at(T* base, uint32_t i, uint32_t stride) {
  uint64_t p;
  asm("mad.wide.u32 %0, %1, %2, %3;" : "=l"(p) : "r"(i), "r"(stride), "l"(base));
  return reinterpret_cast<T*>(p);
}
// *p = v when i < lim (signed), as a predicated store: no branch around it (the epilogues' row and column
// bounds; in the all-columns form a row's stores test the same i and lim, a compare ptxas can share).
__device__ __forceinline__ void wg_st_lt(float* p, float v, int i, int lim) {
  asm volatile("{\n\t.reg .pred q;\n\tsetp.lt.s32 q, %2, %3;\n\t@q st.global.f32 [%0], %1;\n\t}" ::"l"(p), "f"(v),
               "r"(i), "r"(lim)
               : "memory");
}
__device__ __forceinline__ void wg_st_lt(uint16_t* p, uint16_t v, int i, int lim) {
  asm volatile("{\n\t.reg .pred q;\n\tsetp.lt.s32 q, %2, %3;\n\t@q st.global.b16 [%0], %1;\n\t}" ::"l"(p), "h"(v),
               "r"(i), "r"(lim)
               : "memory");
}
__device__ __forceinline__ void wg_st_lt(uint32_t* p, uint32_t v, int i, int lim) {
  asm volatile("{\n\t.reg .pred q;\n\tsetp.lt.s32 q, %2, %3;\n\t@q st.global.b32 [%0], %1;\n\t}" ::"l"(p), "r"(v),
               "r"(i), "r"(lim)
               : "memory");
}

// Xb[r, 8j + 2c + e] = bf16_rn(X[r, 8j + c + 4e]) for c = 0..3, e = 0..1 (wg_phys_k's permutation), so a
// 16-byte chunk j of a k-tile of Xb is a swizzled B chunk as the GEMM reads it.
// Grid: one CTA per row (x = rows), threads stride over the row's K/8 blocks; one 16-byte store each.
// X rows 16-byte aligned (ldx % 4 == 0), K % 8 == 0.
constexpr int WGX_THREADS = 256;

// The GEMM's CTA: 1 producer + 2 consumer warpgroups. Shared memory: 1024 B alignment slack, a ring of
// tma_stages(BM, GATED) stages [Xb tile BM x 64 bf16 (128B-swizzled) | W words 256 rows x
// tma_w_row_bytes(BITS) (4-bit 32 B, 8-bit 64 B)], then the full[S] and empty[S] mbarriers. 4-bit rings:
// 6 x 24 KB (BM 128), 6 x 28 KB (BM 160) or 8 x 16 KB (BM 64); GATED (4-bit only) has two more stages: 193 KB /
// 161 KB. 8-bit rings: 193 KB at BM 128 and 64 (6 x 32 KB, 8 x 24 KB), 217 KB at BM 160 (6 x 36 KB).
// Two consumer warpgroups; the m64 blocks of 64 weight rows each one owns, wg_blocks(BM): two at BM = 64, 128
// and 160 (256 weight rows a tile; BM accumulators and 16 A registers a half a thread), one at BM = 256 (128
// weight rows a tile, wgmma m64n256: BM/2 = 128 accumulators, 8 A registers a half: half the dequantization
// a MAC). (Four warpgroups of one block at BM = 128, the sixteenth session's cwg4, measured no faster.)
constexpr int TMA_CONSUMER_WGS = 2;
__host__ __device__ constexpr int wg_blocks(int bm) { return bm == 256 ? 1 : 2; }
__host__ __device__ constexpr int wg_rows(int bm) { return 64 * TMA_CONSUMER_WGS * wg_blocks(bm); }  // a tile's weight rows
constexpr int TMA_CONSUMERS = 128 * TMA_CONSUMER_WGS;  // consumer threads
constexpr int TMA_THREADS = 128 + TMA_CONSUMERS, TMA_PRODUCER_REGS = 40, TMA_CONSUMER_REGS = 232;
// setmaxnreg moves registers only inside the CTA's launch allocation (__launch_bounds__(TMA_THREADS, 1): the
// largest multiple of 8 a thread that fits 64K registers): the consumers' increase must come from what the
// producer releases, or setmaxnreg.inc waits for ever (the producer then traps in mbar_wait).
constexpr int TMA_LAUNCH_REGS = 65536 / TMA_THREADS / 8 * 8;  // 168 at 384 threads
static_assert(128 * TMA_PRODUCER_REGS + TMA_CONSUMERS * TMA_CONSUMER_REGS <= TMA_THREADS * TMA_LAUNCH_REGS,
              "setmaxnreg: the consumers' registers must come from the producer's release");
constexpr int TMA_GATHER_LAG = 3;  // gather mode: cp.async groups a producer thread keeps in flight
__host__ __device__ constexpr int tma_w_row_bytes(int bits) { return WG_BK * bits / 8; }
__host__ __device__ constexpr int tma_w_bytes(int bits, int bm) { return wg_rows(bm) * tma_w_row_bytes(bits); }
__host__ __device__ constexpr int tma_stages(int bm, bool gated = false) {
  return (bm == 256 ? 5 : bm >= 128 ? 6 : 8) + (gated ? 2 : 0);
}
__host__ __device__ constexpr int tma_stage_bytes(int bm, int bits) { return bm * WG_BK * 2 + tma_w_bytes(bits, bm); }
__host__ __device__ constexpr int tma_smem_bytes(int bm, int bits, bool gated = false) {
  return 1024 + tma_stages(bm, gated) * tma_stage_bytes(bm, bits) + 2 * tma_stages(bm, gated) * 8;
}
static_assert(tma_smem_bytes(128, 4, true) <= 227 * 1024 && tma_smem_bytes(64, 4, true) <= 227 * 1024,
              "the GATED ring exceeds the 227 KB opt-in shared memory");
static_assert(tma_smem_bytes(128, 8) <= 227 * 1024 && tma_smem_bytes(64, 8) <= 227 * 1024,
              "the 8-bit ring exceeds the 227 KB opt-in shared memory");
static_assert(tma_smem_bytes(256, 8) <= 227 * 1024, "the BM = 256 ring exceeds the 227 KB opt-in shared memory");
static_assert(tma_smem_bytes(160, 8) <= 227 * 1024, "the BM = 160 ring exceeds the 227 KB opt-in shared memory");
static_assert(tma_stage_bytes(160, 4) % 1024 == 0, "BM = 160 stages must keep the 1024-byte SWIZZLE_128B alignment");

// Which weight row each accumulator row of a consumer thread is. Thread (cw, w4, g) (consumer warpgroup
// cw, its warp w4, g = lane/4) holds, for m64 block b and h = 0, 1, wgmma row 16*w4 + g + 8h of block b
// (acc[b][4j + 2h + e], the m16n8 layout), dequantized from stage row wg_row_base + wg_row_step(b, h):
//   plain:  cw*64*NB + 16*w4 + g  +  b*64 + 8h
//   GATED:  cw*32*NB + 8*w4 + g   +  h*128 + b*32
// (NB = wg_blocks(BM) blocks b; every m64 block starts at a multiple of 64 weight rows, so an output row sits at the same
// row of its block, 16*w4 + g (+ 8 for an up row), whatever the number of consumer warpgroups)
// A GATED stage holds gate row n0 + i at stage row i and up row n0 + i at stage row 128 + i (i < 128),
// so a GATED thread's rows h = 0 (slice rows 0-7) are gate rows and h = 1 (slice rows 8-15) the up rows
// of the same outputs: tile output wg_row_base + wg_out_step(b) (< 128) for both h. Rows of consecutive
// g are consecutive stage rows in both layouts (a quarter warp's 16-byte loads hit distinct banks).
// tests/emu/wgmma_gated_il_emu.cu walks every thread through these.
__host__ __device__ constexpr int wg_row_base(bool gated, int cw, int w4, int g, int nb = 2) {
  return gated ? cw * (32 * nb) + 8 * w4 + g : cw * (64 * nb) + 16 * w4 + g;
}
__host__ __device__ constexpr int wg_row_step(bool gated, int b, int h) {
  return gated ? h * 128 + b * 32 : b * 64 + 8 * h;
}
// Accumulator row (b, h) of the thread is output n0 + wg_row_base + wg_out_step(b, h) of its matrix
// (plain: W; GATED: the gate for h = 0, up for h = 1).
__host__ __device__ constexpr int wg_out_step(bool gated, int b, int h) { return gated ? b * 32 : b * 64 + 8 * h; }

// __byte_perm (PRMT) without the sign-replicate modes, on the host too (the CPU emulator runs wg_q8_pair):
// byte i of the result is byte (sel >> 4i) & 7 of {b:a} (a's bytes 0-3, b's 4-7).
__host__ __device__ __forceinline__ uint32_t wg_prmt(uint32_t a, uint32_t b, uint32_t sel) {
#ifdef __CUDA_ARCH__
  return __byte_perm(a, b, sel);
#else
  const uint64_t v = uint64_t(b) << 32 | a;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= uint32_t(v >> (8 * ((sel >> (4 * i)) & 7)) & 0xFF) << (8 * i);
  return r;
#endif
}

// Bit casts on host and device (a 4-byte memcpy is one register move on the device).
__host__ __device__ __forceinline__ float wg_f32_of(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
__host__ __device__ __forceinline__ uint32_t wg_bits_of(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

// 8-bit weights: byte c of the words lo and hi (physical k c and c + 4 of a block of 8: the A pair of
// logical k 2c, 2c+1, wg_phys_k) as the bf16x2 pair (q_lo, q_hi), exact. Each byte goes into the low
// mantissa bits of fp32 2^23 (PRMT with 0x4B000000: 0x4B0000qq = 2^23 + q), 2^23 is subtracted (exact:
// FADD), and the upper halves of the two fp32 values are the pair (PRMT 0x7632): q <= 255 has at most 8
// significant bits, so the lower 16 bits are zero and the truncation is exact. bf16's 7 stored mantissa
// bits hold only 128 consecutive integers at one exponent, so the 4-bit 0x4300|q trick cannot hold a byte.
// Five instructions (PRMT, PRMT, FADD, FADD, PRMT); sel = 0x7540 | c, once per thread.
__host__ __device__ __forceinline__ uint32_t wg_q8_sel(int c) { return 0x7540u | uint32_t(c); }
__host__ __device__ __forceinline__ uint32_t wg_q8_pair(uint32_t lo, uint32_t hi, uint32_t sel) {
  const float f0 = wg_f32_of(wg_prmt(lo, 0x4B000000u, sel)) - 8388608.f;
  const float f1 = wg_f32_of(wg_prmt(hi, 0x4B000000u, sel)) - 8388608.f;
  return wg_prmt(wg_bits_of(f0), wg_bits_of(f1), 0x7632);
}

#ifdef __CUDACC__

// NATURAL: the values in stored k order (the dense BF16 GEMM's operand, linear_wgmma_dense.cuh), else each
// 8-value chunk as pairs (v_c, v_c+4) (the 4-bit GEMM's k permutation, xb_layout.cuh).
template <bool NATURAL = false>
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
    if constexpr (NATURAL) {
      v.x = wg_pack_bf16x2(lo.x, lo.y);
      v.y = wg_pack_bf16x2(lo.z, lo.w);
      v.z = wg_pack_bf16x2(hi.x, hi.y);
      v.w = wg_pack_bf16x2(hi.z, hi.w);
    } else {
      v.x = wg_pack_bf16x2(lo.x, hi.x);
      v.y = wg_pack_bf16x2(lo.y, hi.y);
      v.z = wg_pack_bf16x2(lo.z, hi.z);
      v.w = wg_pack_bf16x2(lo.w, hi.w);
    }
    *reinterpret_cast<uint4*>(dst + 8 * j) = v;
  }
}

// Scale and bias of one thread for one k-tile as loaded (bf16 bits in the low half of a word, nothing
// combined at load time); [m64 block][row g / g+8][half of the k-tile] (GS32: the halves are different
// groups). The loop loads the next k-tile's into one of these and reads them one k-tile later
// (wg_dequant_half): an instruction that combined them right after the loads (as a packed scale|bias
// word did) waited a global-load latency every k-tile, ~8% of the consumers' warp samples in ncu.
template <bool GS32, int NB>
struct WgScales {
  uint32_t scale[NB][2][GS32 ? 2 : 1], bias[NB][2][GS32 ? 2 : 1];
};

// Scale/bias index of one thread's weight rows o(b, h) = n0 + orow + wg_out_step(GATED, b, h) (b*64 + 8h;
// GATED b*32, of the gate matrix for h = 0 and of the up matrix, the same shape, for h = 1) at group 0
// of the tile's expert, set once per tile (rows past N read row N - 1: computed, never stored). 32 bits:
// the host keeps the scale tensor below 2^32 elements, so a k-tile's index is one 32-bit add and its
// address one IMAD.WIDE from the kernel's scales/biases pointers.
template <bool GATED, int NB>
__device__ __forceinline__ void wg_scale_rows(uint32_t (&row)[NB][2], const WeightView& w, int64_t expert, int64_t n0,
                                              int orow) {
  const int64_t N = w.rows, gpr = w.cols / w.group_size;
#pragma unroll
  for (int b = 0; b < NB; ++b)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t o = n0 + orow + wg_out_step(GATED, b, h);
      row[b][h] = uint32_t((expert * N + (o < N ? o : N - 1)) * gpr);
    }
}

// Loads the scales and biases (sc, bi: the thread's matrix; GATED: rows h = 1 from sc_u, bi_u, the up
// matrix's) of k-tile kt: group (kt*64 + half*32) / group_size of each row, as a shift (gshift = log2
// group_size: the host takes only power-of-two groups to this kernel).
template <bool GS32, bool GATED, int NB>
__device__ __forceinline__ void wg_load_scales(WgScales<GS32, NB>& s, const uint16_t* sc, const uint16_t* bi,
                                               const uint32_t (&row)[NB][2], int gshift, int kt,
                                               const uint16_t* sc_u = nullptr, const uint16_t* bi_u = nullptr) {
#pragma unroll
  for (int half = 0; half < (GS32 ? 2 : 1); ++half) {
    const uint32_t g = uint32_t(kt * WG_BK + half * 32) >> gshift;
#pragma unroll
    for (int b = 0; b < NB; ++b)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t gi = row[b][h] + g;
        const uint16_t *scp = GATED && h ? sc_u : sc, *bip = GATED && h ? bi_u : bi;
        s.scale[b][h][half] = __ldg(scp + gi);
        s.bias[b][h][half] = __ldg(bip + gi);
      }
  }
}

// Half k-tiles (k16 steps 2H, 2H+1): the consumers pipeline at this grain so that only two half sets of A
// registers (2 x 8 NB) are live next to the NB x BM/2 accumulators (a full double set, 2 x 32 at NB = 2, did
// not fit 232 registers at BM = 128: ptxas C7512, "insufficient register resources", wgmma serialised).
// ws: shared address of this thread's W row rbase in the stage (rows of R = tma_w_row_bytes(BITS) bytes:
// row rbase + wg_row_step(GATED, b, h) at ws + wg_row_step(GATED, b, h)*R); words read by ld.shared.v4 on
// 32-bit addresses.
//   4-bit: the half is the 16-byte chunk H of the row (packed words 4H..4H+3): word m is step m/2,
//          register (m%2)*2 + h, nibbles c and c+4 (wg_dequant_pair).
//   8-bit: the half is 32 bytes at 32H, one 16-byte load per k16 step s (words x, y, z, w = k 0-3, 4-7,
//          8-11, 12-15 of the step): register h is byte c of (x, y), register 2 + h byte c of (z, w)
//          (wg_q8_pair, then the same bf16x2 fma as wg_dequant_pair).
template <int H, bool GS32, int BITS, bool GATED, int NB>
__device__ __forceinline__ void wg_dequant_half(uint32_t ws, int c, const WgScales<GS32, NB>& s, uint32_t (&A)[NB][2][4]) {
  constexpr int R = tma_w_row_bytes(BITS);
#pragma unroll
  for (int b = 0; b < NB; ++b)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t row = ws + wg_row_step(GATED, b, h) * R;
      const uint32_t s2 = __byte_perm(s.scale[b][h][GS32 ? H : 0], 0, 0x1010);  // the bf16 in both halves
      const uint32_t b2 = __byte_perm(s.bias[b][h][GS32 ? H : 0], 0, 0x1010);
      if constexpr (BITS == 4) {
        const uint4 w = ld_shared_v4(row + 16 * H);
        const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int m = 0; m < 4; ++m) A[b][m >> 1][(m & 1) * 2 + h] = wg_dequant_pair(words[m] >> (4 * c), s2, b2);
      } else {
        const uint32_t sel = wg_q8_sel(c);
#pragma unroll
        for (int st = 0; st < 2; ++st) {
          const uint4 w = ld_shared_v4(row + 32 * H + 16 * st);
          A[b][st][h] = fma_bf16x2(wg_q8_pair(w.x, w.y, sel), s2, b2);
          A[b][st][2 + h] = fma_bf16x2(wg_q8_pair(w.z, w.w, sel), s2, b2);
        }
      }
    }
}

// xd = wg_desc(xs) of the stage's Xb tile; k16 step j's descriptor is xd + 2j, the same value as
// wg_desc(xs + 32j): the start address field (bits 0-13, 16-byte units) of a 1024-aligned xs has its
// low 6 bits zero, so adding 2j <= 6 carries nowhere.
template <int BM, int H, int NB = wg_blocks(BM)>
__device__ __forceinline__ void wg_issue_half(float (&acc)[NB][BM / 2], const uint32_t (&A)[NB][2][4], uint64_t xd) {
#pragma unroll
  for (int b = 0; b < NB; ++b)
#pragma unroll
    for (int i = 0; i < BM / 2; ++i) fence_reg(acc[b][i]);
  wgmma_fence();
#pragma unroll
  for (int s = 0; s < 2; ++s)
#pragma unroll
    for (int b = 0; b < NB; ++b) wgmma_rows<BM>(acc[b], A[b][s], xd + (2 * H + s) * 2);
  wgmma_commit();
#pragma unroll
  for (int b = 0; b < NB; ++b)
#pragma unroll
    for (int i = 0; i < BM / 2; ++i) fence_reg(acc[b][i]);
}

// Epilogue of a 256 x BM tile's warpgroup part: acc[b][4j + 2h + e] is D[o, r] with
// o = n0 + rbase + b*64 + 8h (rbase = wg_row_base(false, cw, w4, g)), r = 8j + 2c + e; store_output's arithmetic
// (plain, or y = row_scale * silu(y) * acc); plain with a.y16 set: wg_bf16(acc) into the bf16 rows y16 (same
// rows, ldy elements a row, pair order: LinearArgs::y16) instead of y, the thread's outputs o and o + 8 of a row as
// one 4-byte store (a 2-byte store a value made the MoE down product 5 us slower than its F32 output, and lanes
// swapping values to store natural-order pairs 5 us slower again: docs/perf-notes.md, twenty-second session).
// Addressing: the thread's row 2c as one 64-bit pointer, row 2c + je
// at je * ldy from it (wg_at; the host keeps 256 * ldy < 2^32); each store predicated (wg_st_lt) on
// je < lim: lim = the tile's rows past 2c, or 0 for an output past W's rows (only at a product's last column
// tile; the all-columns form, `every`, tests the rows alone); row groups of 8 past the tile's end are skipped by a
// warp-uniform branch (a MoE tile is often partly empty: computing its SwiGLU anyway made the 64-row gated
// product 98 -> 112 us). No branch around a row inside the tile, no 64-bit compare a store:
// the older form's ~20 instructions a row of 4 stores were ~22% of the MoE down product's warp samples
// (docs/perf-notes.md, twenty-first session).
// SwiGLU reads y first: a row group j's 8 gate values and 2 row scales are loaded before group j-1 is
// computed and stored (one memory latency per group, not one per element: the stores of a row could
// alias the next row's loads, so the compiler would not reorder them itself).
template <int BM, int NB = wg_blocks(BM)>
__device__ __forceinline__ void wg_store_tile(const LinearArgs& a, const Tile& tile, int64_t n0, int rbase, int c,
                                              const float (&acc)[NB][BM / 2]) {
  const int64_t o0 = n0 + rbase;
  const int trows = int(tile.rows), rows = trows - 2 * c;  // row 2c + je is real when je < rows
  int lim[NB][2];                           // rows, or 0 where output o0 + b*64 + 8h is past W's rows
  bool all = true;
#pragma unroll
  for (int b = 0; b < NB; ++b)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const bool real = o0 + b * 64 + 8 * h < a.w.rows;
      lim[b][h] = real ? rows : 0;
      all = all && real;
    }
  const int64_t at = (tile.row0 + 2 * c) * a.ldy + o0;  // row 2c's first output, in elements
  const uint32_t ldy = uint32_t(a.ldy) * 4;
  auto body = [&](auto every) {
    auto lim_of = [&](int b, int h) { return decltype(every)::value ? rows : lim[b][h]; };
    if (!a.swiglu && !a.y16) {
#pragma unroll
      for (int j = 0; j < BM / 8; ++j) {
        if (8 * j >= trows) break;  // row groups past the tile's end: a warp-uniform branch
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float* const y = wg_at(a.y + at, 8 * j + e, ldy);
#pragma unroll
          for (int b = 0; b < NB; ++b)
#pragma unroll
            for (int h = 0; h < 2; ++h) wg_st_lt(y + b * 64 + 8 * h, acc[b][4 * j + 2 * h + e], 8 * j + e, lim_of(b, h));
        }
      }
      return;
    }
    if (!a.swiglu) {
      // y16 in pair order (LinearArgs::y16): the thread's outputs o and o + 8 of a row (h = 0, 1; o = 16q + g
      // within a 16-output block, rbase's g) sit at positions 16q + 2g and 16q + 2g + 1, one 4-byte word
      // (wg_pack_bf16x2: the bits of wg_bf16); W's rows a multiple of 16 (linear_writes_bf16), so both outputs
      // are real or past W together (lim[b][0] == lim[b][1])
      // y16_pos(o0) = o0 + g: o0 = n0 + rbase, n0 and rbase - g multiples of 16 (tests/emu/down_bf16_emu.cu)
      uint32_t* const y0 = reinterpret_cast<uint32_t*>(a.y16 + at + (rbase & 7));
#pragma unroll
      for (int j = 0; j < BM / 8; ++j) {
        if (8 * j >= trows) break;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          uint32_t* const y = wg_at(y0, 8 * j + e, ldy / 2);
#pragma unroll
          for (int b = 0; b < NB; ++b)
            wg_st_lt(y + b * 32, wg_pack_bf16x2(acc[b][4 * j + e], acc[b][4 * j + 2 + e]), 8 * j + e, lim_of(b, 0));
        }
      }
      return;
    }
    float* const y0 = a.y + at;
    float gate[2][2][NB][2], rs[2][2];  // [group parity][e][b][h], [group parity][e]
    auto load = [&](int j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int je = 8 * j + e;
        const float* y = wg_at(y0, je < rows ? je : 0, ldy);
        rs[j & 1][e] = je < rows && a.row_scale ? a.row_scale[tile.row0 + 2 * c + je] : 1.f;
#pragma unroll
        for (int b = 0; b < NB; ++b)
#pragma unroll
          for (int h = 0; h < 2; ++h) gate[j & 1][e][b][h] = je < lim_of(b, h) ? y[b * 64 + 8 * h] : 0.f;
      }
    };
    load(0);
#pragma unroll
    for (int j = 0; j < BM / 8; ++j) {
      if (8 * j >= trows) break;
      if (j + 1 < BM / 8) load(j + 1);
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float* const y = wg_at(y0, 8 * j + e, ldy);
#pragma unroll
        for (int b = 0; b < NB; ++b)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            wg_st_lt(y + b * 64 + 8 * h, rs[j & 1][e] * silu(gate[j & 1][e][b][h]) * acc[b][4 * j + 2 * h + e], 8 * j + e,
                     lim_of(b, h));
      }
    }
  };
  if (all) body(std::true_type{});
  else body(std::false_type{});
}

// GATED epilogue of one consumer thread: acc[b][4j + e] is G and acc[b][4j + 2 + e] is U of the same
// output o = n0 + orow + wg_out_step(true, b, 0) (orow = wg_row_base(true, cw, w4, g)), r = 8j + 2c + e;
// y = row_scale * silu(G) * U with store_output's expression, as F32 y or (a.yb, the output as the next
// product's Xb) as wg_bf16 at row (tile.row0 + r) * N, position wg_xb_pos(o): the same F32 value rounded
// as wgx_bf16_kernel rounds it. No shared memory, no barrier. Row group j + 1's 2 row scales are loaded
// before group j is computed and stored, as in wg_store_tile. A warp's store of one (j, e, b) is 4 rows x
// 8 consecutive outputs (32 B each). Addressing and predicates as in wg_store_tile (the output kind, yb or
// y, chosen once a tile).
template <int BM, int NB = wg_blocks(BM)>
__device__ __forceinline__ void wg_store_gated(const LinearArgs& a, const Tile& tile, int64_t n0, int orow, int c,
                                                  const float (&acc)[NB][BM / 2]) {
  const int64_t o0 = n0 + orow;
  const int trows = int(tile.rows), rows = trows - 2 * c;  // row 2c + je is real when je < rows
  int lim[NB];                              // rows, or 0 where output o0 + wg_out_step(true, b, 0) is past the rows
#pragma unroll
  for (int b = 0; b < NB; ++b) lim[b] = o0 + wg_out_step(true, b, 0) < a.w.rows ? rows : 0;
  const float* const rsc = a.row_scale ? a.row_scale + tile.row0 + 2 * c : nullptr;
  float rs[2][2];  // [group parity][e]
  auto load = [&](int j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) rs[j & 1][e] = 8 * j + e < rows && rsc ? rsc[8 * j + e] : 1.f;
  };
  // out(je, b, v): store output b of row 2c + je (predicated on je < lim[b])
  auto body = [&](auto out) {
    load(0);
#pragma unroll
    for (int j = 0; j < BM / 8; ++j) {
      if (8 * j >= trows) break;  // row groups past the tile's end: no SwiGLU computed for them
      if (j + 1 < BM / 8) load(j + 1);
#pragma unroll
      for (int e = 0; e < 2; ++e)
#pragma unroll
        for (int b = 0; b < NB; ++b) out(8 * j + e, b, rs[j & 1][e] * silu(acc[b][4 * j + e]) * acc[b][4 * j + 2 + e]);
    }
  };
  if (a.yb) {
    const uint32_t ld = uint32_t(a.w.rows) * 2;
    uint16_t* pos[NB];  // row 2c's output b
#pragma unroll
    for (int b = 0; b < NB; ++b)
      pos[b] = a.yb + (tile.row0 + 2 * c) * a.w.rows + wg_xb_pos(o0 + wg_out_step(true, b, 0));
    body([&](int je, int b, float v) { wg_st_lt(wg_at(pos[b], je, ld), wg_bf16(v), je, lim[b]); });
  } else {
    const uint32_t ldy = uint32_t(a.ldy) * 4;
    float* const y0 = a.y + (tile.row0 + 2 * c) * a.ldy + o0;
    body([&](int je, int b, float v) { wg_st_lt(wg_at(y0, je, ldy) + wg_out_step(true, b, 0), v, je, lim[b]); });
  }
}

// Split-K hand-off of one work unit (split sp of tile t) by the TMA_CONSUMERS consumer threads (ct): store the
// partial accumulators of the tile's real rows (r < tile.rows) at [t][sp][BM][ct] (coalesced), fence,
// count the unit on split_done[t] (named barrier 1 over the consumers only). The last unit to arrive sums all
// splits in split order (0 + p0 + p1 + ..., a fixed order whichever CTA is last: deterministic) into
// acc, resets the counter and returns true: its caller stores the tile. L2 reads (ld.cg): the partials
// come from other SMs.
template <int BM, int NB = wg_blocks(BM)>
__device__ __forceinline__ bool wg_split_reduce(const LinearArgs& a, const Tile& tile, int64_t t, int sp, int ct,
                                                int c, float (&acc)[NB][BM / 2], uint32_t& split_last) {
  const int splits = a.k_splits;
  // element-major: accumulator j of consumer thread ct at [j][ct], so a warp's store or load of one j
  // is 128 contiguous bytes (thread-major rows of BM floats made every warp access touch 32 sectors)
  auto slot = [&](int k) { return a.partial + (t * splits + k) * int64_t(BM) * 256 + ct; };  // BM * 256 = NB * BM/2 * TMA_CONSUMERS (NB = 2: split-K has no BM = 256 instance)
  float* mine = slot(sp);
#pragma unroll
  for (int b = 0; b < NB; ++b)
#pragma unroll
    for (int i = 0; i < BM / 2; ++i)
      if (8 * (i / 4) + 2 * c + (i & 1) < tile.rows) mine[(b * (BM / 2) + i) * TMA_CONSUMERS] = acc[b][i];
  __threadfence();
  asm volatile("bar.sync 1, %0;" ::"n"(TMA_CONSUMERS) : "memory");
  if (ct == 0) split_last = atomicAdd(a.split_done + t, 1u) == uint32_t(splits - 1);
  asm volatile("bar.sync 1, %0;" ::"n"(TMA_CONSUMERS) : "memory");
  const bool last = split_last;
  asm volatile("bar.sync 1, %0;" ::"n"(TMA_CONSUMERS) : "memory");  // every consumer has read split_last before the next unit writes it
  if (!last) return false;
  __threadfence();
#pragma unroll
  for (int b = 0; b < NB; ++b)
#pragma unroll
    for (int i = 0; i < BM / 2; ++i) acc[b][i] = 0.f;
  for (int k = 0; k < splits; ++k) {
    const float* p = slot(k);
#pragma unroll
    for (int b = 0; b < NB; ++b)
#pragma unroll
      for (int i = 0; i < BM / 2; ++i)
        if (8 * (i / 4) + 2 * c + (i & 1) < tile.rows) acc[b][i] += __ldcg(p + (b * (BM / 2) + i) * TMA_CONSUMERS);
  }
  if (ct == 0) a.split_done[t] = 0;
  return true;
}

// ---------------------------------------------------------------------------------------------------
// linear_wgmma_tma_kernel<BM, GS32, GATHER, SPLIT, GATED, BITS>: Y = W . X^T over 256-output x BM-row
// tiles (GATED: 128-output tiles of the gate W and the up matrix a.up, [G; U] . X^T, each thread's
// accumulator rows interleaved as wg_row_base/wg_row_step say), persistent.
// Grid: min(units, SMs) CTAs of TMA_THREADS (384) threads; CTA i takes work units i, i + gridDim.x, ... A unit is a
// tile of row_tiles x col_tiles, column tile fastest (CTAs running together share a row tile's X),
// or, with split-K (SPLIT and a.k_splits > 1, dense only: short prompts), split sp of tile t = u / k_splits over
// k-tiles [sp*nk/k_splits, (sp+1)*nk/k_splits); its accumulators go through wg_split_reduce, whose
// last unit per tile sums the splits in order and stores.
// Row tiles: dense ceil(M / BM), grouped *num_tiles (tile map of BM-row tiles: RowTiles::tile_rows == BM).
// Column tiles: ceil(N / 256), GATED ceil(N / 128) (no split-K).
// Shared memory: a ring of S = tma_stages(BM, GATED) stages, each [Xb tile BM x 64 bf16, 128B-swizzled
// as TMA SWIZZLE_128B writes it = wg_swz][W words 256 rows x 32 B], then full[S] and empty[S] mbarriers.
// Warpgroup 0 = producer (setmaxnreg 40): for every k-tile of every tile it waits empty[s], then
//   !GATHER: one thread arms full[s] with the stage's bytes and issues the W and Xb TMA loads: W box
//            {2*BITS words, 256 rows, 1 expert} of tmap_w (3-D [E][N][K*BITS/32] U32; rows >= N read as
//            zero) or
//            (GATED) box {8, 128, 1} of tmap_w into W rows 0-127 and the same rows of tmap_u
//            (the up matrix, the same shape) into rows 128-255: 3 TMAs a stage with the Xb box {64, BM}
//            of tmap_x (2-D [rows][K]
//            bf16) at row tile.row0 (rows past the end read zero; rows of the next expert in a MoE tile
//            are read and never stored).
//   GATHER (MoE gate/up, x_rows): thread 0 arms full[s] with the W bytes and issues the W TMA(s);
//            all 128 threads copy their BM/16 Xb chunks (row x_rows[row0 + r], 16 B each) by cp.async
//            into the swizzled positions; a thread arrives on full[s] once its copies of that stage
//            have landed (cp.async.wait_group TMA_GATHER_LAG, proxy fence, arrive), so full[s] counts
//            1 + 128.
//            Deadlock-free because the lag (3) is below the stage count.
// Warpgroups 1, 2 = consumers (setmaxnreg TMA_CONSUMER_REGS: 232), warpgroup cw = wg - 1 the
//   weight rows [cw*64*NB, +64*NB) of the tile as NB m64 blocks b,
//   thread rows rbase = wg_row_base(false, cw, w4, g) (+ b*64 + 8h) of the stage, lane%4 = c; outputs n0 + rbase
//   (+ b*64 + 8h) of its matrix (GATED: stage rows rbase = wg_row_base(true, cw, w4, g) (+ h*128 +
//   b*32), outputs n0 + rbase (+ b*32), rows h = 0 gate and h = 1 up, their matrix's scales and biases).
//   Per k-tile: wait full[s]; for
//   each half (k16 steps 0-1, then 2-3): dequantize the half's W words from the stage (ld.shared.v4)
//   into its own register set (scales/biases from global, one k-tile ahead: per-tile 32-bit row
//   indices plus the k-tile's group, a shift), queue its 2 NB wgmmas on B = the stage's Xb tile, retire
//   the previous group (wait_group 1); retiring half 1 of kt-1 releases kt-1's stage (one arrival per
//   consumer warp: empty counts 4 TMA_CONSUMER_WGS). The stage's addresses (Xb tile, the thread's W row,
//   full[s]) are carried from k-tile to k-tile, all 32-bit shared addresses. Each consumer thread
//   dequantizes 8 NB bf16 pairs a half for 2 NB wgmmas of N = BM: at BM = 256 half as many pairs a MAC as
//   at BM = 128 (its consumers stalled at the warpgroup-wide wgmma issue, the dequantization between the
//   wgmma groups: docs/perf-notes.md, sixteenth and seventeenth sessions).
//   Epilogue straight from the accumulators (store_output's arithmetic; GATED: wg_store_gated, from each
//   thread's own G and U) while the producer already fills the ring with the next tile.
// No CTA-wide barrier after the mbarrier initialisation. Registers: 168 at launch (384 threads), consumers
// 232, producer 40 (128 x 40 + 256 x 232 = 384 x 168: TMA_LAUNCH_REGS); no spills (ptxas -v).
template <int BM, bool GS32, bool GATHER, bool SPLIT = false, bool GATED = false, int BITS = 4>
__global__ void __launch_bounds__(TMA_THREADS, 1)
    linear_wgmma_tma_kernel(const LinearArgs a, const uint16_t* xb, const __grid_constant__ CUtensorMap tmap_x,
                            const __grid_constant__ CUtensorMap tmap_w, const __grid_constant__ CUtensorMap tmap_u) {
  static_assert(!(GATED && SPLIT), "a gated product has no split-K");
  static_assert(BITS == 4 || (BITS == 8 && !GATED), "4-bit weights, or 8-bit ones without GATED (no room for "
                                                    "its two extra stages of the 8-bit ring)");
  constexpr int NB = wg_blocks(BM), S = tma_stages(BM, GATED), BN = GATED ? wg_rows(BM) / 2 : wg_rows(BM);  // BN: outputs per column tile
  static_assert(BM != 256 || (!GATHER && !SPLIT && !GATED), "BM = 256: dense products only");
  static_assert(BM != 160 || (!GATHER && !SPLIT && !GATED && !GS32), "BM = 160: the MoE down product's merged tiles only");
  constexpr int KW = WG_BK * BITS / 32;  // packed words of a row per k-tile (the W box's width)
  constexpr uint32_t XBYTES = BM * WG_BK * 2, STAGE = tma_stage_bytes(BM, BITS), WBYTES = tma_w_bytes(BITS, BM);
  pdl_wait();
  pdl_trigger();
  extern __shared__ uint8_t smem_raw[];
  __shared__ uint32_t split_last;  // split-K: this CTA's unit was the tile's last
  // the ring as a 32-bit shared address, rounded up to 1024 B (SWIZZLE_128B stages) in the shared space
  const uint32_t ring_s = (smem_u32(smem_raw) + 1023) & ~1023u, bars = ring_s + S * STAGE;
  auto full = [&](uint32_t s) { return bars + 8 * s; };
  auto empty = [&](uint32_t s) { return bars + 8 * (S + s); };
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(full(s), GATHER ? 1 + 128 : 1);
      mbar_init(empty(s), 4 * TMA_CONSUMER_WGS);  // one arrival a consumer warp
    }
    mbar_init_fence();
  }
  __syncthreads();

  const int64_t N = a.w.rows, K = a.w.cols;
  const int nk = int(K / WG_BK);
  const int64_t col_tiles = (N + BN - 1) / BN;
  const int64_t row_tiles = a.tiles.tile_expert ? int64_t(*a.tiles.num_tiles) : (a.tiles.M + BM - 1) / BM;
  const int64_t total = row_tiles * col_tiles;
  // tile t's row tile and column tile, column tile fastest: the CTAs running together share a row tile's X
  // tiles (one read from HBM, the others L2 hits) where row tile fastest re-read all of X once per column
  // tile, after a pass over the weights had evicted much of it (the MoE down product's L2 hit rate 61 -> 81%,
  // 4K: every product 1-5% faster, 32K prefill -21 ms; docs/perf-notes.md, twentieth session)
  auto row_of = [&](int64_t t) { return t / col_tiles; };
  auto col_of = [&](int64_t t) { return t % col_tiles; };
  // work units: tile t = u / splits, k-tiles [split_begin(u % splits), split_begin(u % splits + 1))
  const int splits = SPLIT ? a.k_splits : 1;  // SPLIT instances only for dense products (host)
  const int64_t units = total * splits;
  auto split_begin = [&](int sp) { return int(int64_t(sp) * nk / splits); };
  // the W rows of k-tile kt of column tile n0 into stage st, counted on mbarrier bar
  auto load_w = [&](uint32_t st, uint32_t bar, int kt, int n0, int expert) {
    if constexpr (GATED) {
      tma_load_3d(st + XBYTES, &tmap_w, bar, kt * KW, n0, expert);
      tma_load_3d(st + XBYTES + WBYTES / 2, &tmap_u, bar, kt * KW, n0, expert);
    } else {
      tma_load_3d(st + XBYTES, &tmap_w, bar, kt * KW, n0, expert);
    }
  };

  if (warp < 4) {  // ---------------- producer warpgroup ----------------
    setmaxnreg_dec<TMA_PRODUCER_REGS>();
    uint32_t s = 0, ph = 0;
    if constexpr (!GATHER) {
      if (tid != 0) return;
      for (int64_t u = blockIdx.x; u < units; u += gridDim.x) {
        const int64_t t = u / splits;
        Tile tile;
        if (!find_tile(a.tiles, row_of(t), BM, tile)) continue;
        const int n0 = int(col_of(t)) * BN;
        const int kb = split_begin(u % splits), ke = split_begin(u % splits + 1);
        for (int kt = kb; kt < ke; ++kt) {
          mbar_wait(empty(s), ph ^ 1);
          const uint32_t st = ring_s + s * STAGE;
          mbar_arrive_expect_tx(full(s), STAGE);
          load_w(st, full(s), kt, n0, int(tile.expert));
          tma_load_2d(st, &tmap_x, full(s), kt * WG_BK, int(tile.row0));
          if (++s == S) s = 0, ph ^= 1;
        }
      }
    } else {
      constexpr int PER = BM * 8 / 128;  // 16-byte chunks per thread per stage
      const int j = tid & 7;             // chunk (k 8j..8j+7 of the k-tile) of every row this thread copies
      uint32_t s_arrive = 0;             // oldest stage whose arrival is still due
      int pending = 0;                   // stages copied by this thread and not yet arrived on
      for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {  // GATHER: splits == 1
        Tile tile;
        if (!find_tile(a.tiles, row_of(t), BM, tile)) continue;
        const int n0 = int(col_of(t)) * BN;
        // 16-byte chunk index of each copied row's start in Xb (32 bits: the host checks the bound;
        // 64-bit pointers would not fit the producer's 40 registers at BM = 128), 0 for a row past the
        // tile's end, whose chunk is zero-filled (bit i of `real` clear: the copy reads nothing)
        uint32_t src[PER], real = 0;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
          const int r = (tid >> 3) + 16 * i;
          src[i] = r < tile.rows ? uint32_t(a.x_rows[tile.row0 + r]) * uint32_t(K / 8) + uint32_t(j) : 0u;
          real |= r < tile.rows ? 1u << i : 0u;
        }
        // chunk i's place in a stage: row (tid >> 3) + 16 i, whose swizzle (row & 7) is that of row tid >> 3,
        // so wg_swz((tid >> 3) + 16 i, j) = dst + 2048 i (an immediate offset of the copy)
        const uint32_t dst = wg_swz(tid >> 3, j);
        for (int kt = 0; kt < nk; ++kt) {
          mbar_wait(empty(s), ph ^ 1);
          const uint32_t st = ring_s + s * STAGE;
          if (tid == 0) {
            mbar_arrive_expect_tx(full(s), STAGE - XBYTES);
            load_w(st, full(s), kt, n0, int(tile.expert));
          }
          const uint16_t* x_kt = xb + kt * WG_BK;  // k-tile kt's chunk 0
#pragma unroll
          for (int i = 0; i < PER; ++i)
            cp_async16(st + dst + 16 * 128 * i, wg_chunk_at(x_kt, src[i]), int((real >> i) & 1u) * 16);
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
  const int rbase = wg_row_base(GATED, cw, w4, g, NB);
  const int gshift = GS32 ? 5 : __ffs(a.w.group_size) - 1;  // log2 group_size (a power of two)
  const uint16_t* sc = static_cast<const uint16_t*>(a.w.scales);
  const uint16_t* bi = static_cast<const uint16_t*>(a.w.biases);
  // GATED: rows h = 1 take the up matrix's scales and biases (kernel parameters, no registers held)
  const uint16_t* sc_u = GATED ? static_cast<const uint16_t*>(a.up.scales) : nullptr;
  const uint16_t* bi_u = GATED ? static_cast<const uint16_t*>(a.up.biases) : nullptr;
  // The ring position, carried from k-tile to k-tile: stage s and its parity, the stage's Xb tile (xs),
  // this thread's W row in it (ws), full[s] (fb) and the previous k-tile's empty[] (eb_prev). Computed
  // from s in the loop, they cost ~20 instructions a k-tile: ptxas re-derives the ring base (from
  // SR_CgaCtaId) and the W row (from tid) every time.
  uint32_t s = 0, ph = 0, xs = ring_s, ws = ring_s + XBYTES + rbase * tma_w_row_bytes(BITS), fb = full(0), eb_prev = 0;
  for (int64_t u = blockIdx.x; u < units; u += gridDim.x) {
    const int64_t t = u / splits;
    Tile tile;
    if (!find_tile(a.tiles, row_of(t), BM, tile)) continue;
    const int64_t n0 = col_of(t) * BN;
    const int kb = split_begin(u % splits), ke = split_begin(u % splits + 1);
    float acc[NB][BM / 2];
#pragma unroll
    for (int b = 0; b < NB; ++b)
#pragma unroll
      for (int i = 0; i < BM / 2; ++i) acc[b][i] = 0.f;
    uint32_t rows[NB][2];
    wg_scale_rows<GATED, NB>(rows, a.w, tile.expert, n0, rbase);
    uint32_t H0[NB][2][4], H1[NB][2][4];  // A fragments of half k-tiles 0 and 1
    WgScales<GS32, NB> cur, nxt;
    wg_load_scales<GS32, GATED, NB>(nxt, sc, bi, rows, gshift, kb, sc_u, bi_u);
    // k-tile kt: two groups (half 0, half 1), each queued while the previous group runs, then the
    // previous group is retired (wait_group 1). Retiring half 1 of kt-1 frees kt-1's stage. Every
    // iteration issues H0 then H1, so ptxas can match each wait to its group (no C7513).
#pragma unroll 1
    for (int kt = kb; kt < ke; ++kt) {
      cur = nxt;
      if (kt + 1 < ke) wg_load_scales<GS32, GATED, NB>(nxt, sc, bi, rows, gshift, kt + 1, sc_u, bi_u);
      mbar_wait(fb, ph);
      const uint64_t xd = wg_desc(xs);
      wg_dequant_half<0, GS32, BITS, GATED, NB>(ws, c, cur, H0);
      wg_issue_half<BM, 0>(acc, H0, xd);
      wgmma_wait<1>();  // half 1 of kt-1 retired
      if (kt > kb && lane == 0) mbar_arrive(eb_prev);
      wg_dequant_half<1, GS32, BITS, GATED, NB>(ws, c, cur, H1);
      wg_issue_half<BM, 1>(acc, H1, xd);
      wgmma_wait<1>();  // half 0 of kt retired
      eb_prev = fb + 8 * S;  // empty[s]
      const int d = s + 1 == S ? 1 - S : 1;  // to the next stage, wrapping to 0
      s += d, xs += d * STAGE, ws += d * STAGE, fb += d * 8;
      if (s == 0) ph ^= 1;
    }
    wgmma_wait<0>();
#pragma unroll
    for (int b = 0; b < NB; ++b)
#pragma unroll
      for (int i = 0; i < BM / 2; ++i) fence_reg(acc[b][i]);
    if (lane == 0) mbar_arrive(eb_prev);
    if constexpr (GATED) {
      wg_store_gated<BM>(a, tile, n0, rbase, c, acc);
    } else if (splits == 1) {
      wg_store_tile<BM>(a, tile, n0, rbase, c, acc);
    } else if (wg_split_reduce<BM>(a, tile, t, int(u % splits), ct, c, acc, split_last)) {
      wg_store_tile<BM>(a, tile, n0, rbase, c, acc);
    }
  }
}

#endif  // __CUDACC__

}  // namespace lily::cuda
