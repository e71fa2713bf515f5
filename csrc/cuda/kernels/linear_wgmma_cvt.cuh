// The converter warpgroup of the quantized prefill GEMM (docs/perf-notes.md, eighteenth session, "the
// converter warpgroup"; kernels/linear_wgmma_tma.cuh): the layout, thread mapping and arithmetic with which a
// fourth warpgroup dequantizes each packed W stage once into a bf16 A stage in shared memory, so that the
// consumers issue wgmma with A and B both by descriptor (SS, as linear_wgmma_dense.cuh) instead of
// dequantizing their own A fragments into registers (RS). The A values are the same bf16 bits and the
// wgmma shapes and k order the same, so the products are bit-identical to the RS kernel's. Host-callable
// (tests/emu/wgmma_cvt_emu.cu runs these very functions on all 128 converter threads and compares every
// element the SS wgmma reads with the register the RS path's wg_dequant_half fills).
//
// A stage: the tile's wg_rows(BM) weight rows x 64 k as bf16, [rows][128 B] in the K-major SWIZZLE_128B
//   layout (16-byte chunk j of A row a at wg_swz(a, j)), 1024-aligned: 32 KB (BM 64, 128), 16 KB (BM 256).
//   k order of the A fragment (wg_phys_k's permutation, as Xb): chunk j holds logical k 8j..8j+7, its bf16
//   pair c (bytes 4c..4c+3) logical k 8j+2c, 8j+2c+1 = physical k 8j+c, 8j+c+4.
// A tile of consumer warpgroup cw, m64 block b: A rows [(cw*NB + b)*64, +64), at wgc_a_offset (8 KB,
//   1024-aligned), descriptor wg_desc(A stage + wgc_a_offset), k16 step s at + 2s (as the Xb tile's).
// Row map (wgc_stage_row): A row m of tile (cw, b) holds the packed stage row that the RS thread with that
//   accumulator row dequantizes: m = 16*w4 + g + 8h <- wg_row_base(GATED, cw, w4, g, NB) + wg_row_step(GATED,
//   b, h). So the SS wgmma's D fragment has the RS accumulators' rows and the epilogues stay as they are.
//   Plain: the identity (A row a = stage row a). GATED: A row (cw*2 + b)*64 + 16*w4 + g + 8h <- stage row
//   cw*64 + 8*w4 + g + b*32 + 128h (h = 0 gate, 1 up: rows 0-7 of every 16-row slice gate, 8-15 up).
// Packed stage (the converter's input, tma_w_bytes): row r of R = tma_w_row_bytes(BITS) bytes (32 at 4-bit,
//   64 at 8-bit), written by TMA with SWIZZLE_32B / SWIZZLE_64B (the R-byte span: 16-byte unit q of row r at
//   wgc_w_unit: bits 4.. of the offset XOR bits 7..; needs the W part 512-aligned). Unswizzled, a quarter
//   warp's 16-byte loads of 8 consecutive rows would hit 4 (4-bit) or 2 (8-bit) bank groups, 2- and 4-way
//   conflicts; swizzled they hit 8. Only the converter reads this stage (the RS kernel keeps its unswizzled
//   map).
// Converter threads t = 0..127: A rows wgc_a_row(t, i) = t + 128i, i < wgc_rows(BM) (2; 1 at BM 256), all
//   8 chunks of each, chunk j at store j: a quarter warp (8 consecutive A rows from a multiple of 8) stores
//   chunk columns j ^ (a & 7), the 8 distinct 16-byte bank groups of a 128-byte wavefront: conflict-free;
//   every A stage byte is written once a k-tile. Its loads: the R bytes of packed row wgc_stage_row(a) as
//   R/16 16-byte units (consecutive stage rows for consecutive a in both layouts: conflict-free, above).
// Arithmetic (wgc_chunk): chunk j of a row from its packed words of the k-tile, 4-bit word j, bf16 pair c =
//   wg_dequant_pair(word >> 4c, s2, b2); 8-bit words 2j, 2j+1, pair c = fma_bf16x2(wg_q8_pair(lo, hi,
//   wg_q8_sel(c)), s2, b2): the instructions wg_dequant_half runs for the same pair of the same row, so the
//   same bits (w = s*q + b rounded once to bf16). s2, b2: the row's bf16 scale and bias in both halves
//   (wgc_dup), of group (kt*64 + 32*(j/4)) >> log2(gs) (GS32: chunks 0-3 and 4-7 are two groups), of output
//   n0 + wgc_out_row of matrix wgc_matrix (GATED: stage rows 128-255 take the up matrix's).
#pragma once
#include <cstdint>

#include "linear_wgmma_tma.cuh"  // wg_rows, wg_blocks, wg_row_base, wg_row_step, wg_swz, wg_q8_pair, tma_w_row_bytes
#include "wgmma.cuh"             // wg_dequant_pair, fma_bf16x2

namespace lily::cuda {

constexpr int WGC_THREADS = 128;  // the converter warpgroup
__host__ __device__ constexpr int wgc_rows(int bm) { return wg_rows(bm) / WGC_THREADS; }  // A rows a thread
__host__ __device__ constexpr int wgc_a_bytes(int bm) { return wg_rows(bm) * WG_BK * 2; }  // an A stage
__host__ __device__ constexpr int wgc_a_offset(int bm, int cw, int b) { return (cw * wg_blocks(bm) + b) * 64 * WG_BK * 2; }
__host__ __device__ constexpr int wgc_a_row(int t, int i) { return t + WGC_THREADS * i; }
static_assert(wgc_a_offset(128, 1, 1) % 1024 == 0 && wgc_a_bytes(256) % 1024 == 0, "SWIZZLE_128B A tiles: 1024-aligned");

// Packed stage row of A row a = (cw*nb + b)*64 + m, m = 16*w4 + g + 8h (the RS thread's accumulator row).
__host__ __device__ constexpr int wgc_stage_row(bool gated, int a, int nb) {
  return wg_row_base(gated, a / (64 * nb), (a & 63) >> 4, a & 7, nb) + wg_row_step(gated, (a >> 6) % nb, (a >> 3) & 1);
}
// Output (from the tile's n0) and matrix (0: W, 1: GATED's up matrix) of packed stage row r: its scales' row.
__host__ __device__ constexpr int wgc_out_row(bool gated, int r) { return gated ? r & 127 : r; }
__host__ __device__ constexpr int wgc_matrix(bool gated, int r) { return gated ? r >> 7 : 0; }
// Byte offset of 16-byte unit q (words 4q..4q+3) of packed row r in the TMA SWIZZLE_32B (4-bit) or
// SWIZZLE_64B (8-bit) stage.
__host__ __device__ constexpr int wgc_w_unit(int bits, int r, int q) {
  return (r * tma_w_row_bytes(bits) + 16 * q) ^ ((((r * tma_w_row_bytes(bits)) >> 7) & (tma_w_row_bytes(bits) / 16 - 1)) << 4);
}
// Scale/bias group of chunk j of k-tile kt (log2 group size gshift): wg_load_scales's, half = j / 4.
__host__ __device__ constexpr uint32_t wgc_group(int kt, int j, int gshift) { return uint32_t(kt * WG_BK + 32 * (j >> 2)) >> gshift; }
// A bf16 (bits in the low half, as loaded) in both halves: wg_dequant_half's __byte_perm(v, 0, 0x1010).
__host__ __device__ __forceinline__ uint32_t wgc_dup(uint32_t v) { return wg_prmt(v, 0, 0x1010); }

// Chunk j of an A row (8 bf16, logical k 8j..8j+7) from w = its BITS/4 packed words (4-bit: word j; 8-bit:
// words 2j, 2j+1), s2/b2 = the row's scale and bias of the chunk's group (wgc_dup).
template <int BITS>
__host__ __device__ __forceinline__ uint4 wgc_chunk(const uint32_t* w, uint32_t s2, uint32_t b2) {
  uint32_t p[4];
#pragma unroll
  for (int c = 0; c < 4; ++c)
    p[c] = BITS == 4 ? wg_dequant_pair(w[0] >> (4 * c), s2, b2) : fma_bf16x2(wg_q8_pair(w[0], w[1], wg_q8_sel(c)), s2, b2);
  return make_uint4(p[0], p[1], p[2], p[3]);
}

// One converter thread's scales and biases for one k-tile (bf16 bits in the low half, as loaded):
// [A row i][group half: GS32 chunks 0-3 / 4-7].
template <bool GS32, int ROWS>
struct WgcScales {
  uint32_t scale[ROWS][GS32 ? 2 : 1], bias[ROWS][GS32 ? 2 : 1];
};

// One k-tile of converter thread t: the packed stage at wst (shared, as TMA wrote it: wgc_w_unit) into the
// A stage at ast (1024-aligned), its wgc_rows(BM) A rows x 8 chunks. Smem: ld16(addr) -> uint4 and
// st16(addr, uint4) (the kernel: ld.shared / st.shared .v4; the emulator: a byte array).
#pragma nv_exec_check_disable
template <int BM, bool GS32, bool GATED, int BITS, class Smem>
__host__ __device__ __forceinline__ void wgc_convert(const Smem& sm, uint32_t wst, uint32_t ast, int t,
                                                     const WgcScales<GS32, wgc_rows(BM)>& s) {
  constexpr int NB = wg_blocks(BM), RW = tma_w_row_bytes(BITS) / 4;  // RW: packed words of a row
#pragma unroll
  for (int i = 0; i < wgc_rows(BM); ++i) {
    const int a = wgc_a_row(t, i), r = wgc_stage_row(GATED, a, NB);
    uint32_t w[RW];
#pragma unroll
    for (int q = 0; q < RW / 4; ++q) {
      const uint4 v = sm.ld16(wst + wgc_w_unit(BITS, r, q));
      w[4 * q] = v.x, w[4 * q + 1] = v.y, w[4 * q + 2] = v.z, w[4 * q + 3] = v.w;
    }
    uint32_t s2[GS32 ? 2 : 1], b2[GS32 ? 2 : 1];
#pragma unroll
    for (int h = 0; h < (GS32 ? 2 : 1); ++h) s2[h] = wgc_dup(s.scale[i][h]), b2[h] = wgc_dup(s.bias[i][h]);
#pragma unroll
    for (int j = 0; j < 8; ++j)
      sm.st16(ast + wg_swz(a, j), wgc_chunk<BITS>(w + j * BITS / 4, s2[GS32 ? j >> 2 : 0], b2[GS32 ? j >> 2 : 0]));
  }
}

#ifdef __CUDACC__

// The kernel's Smem for wgc_convert: 32-bit shared addresses.
struct WgcShared {
  __device__ __forceinline__ uint4 ld16(uint32_t saddr) const { return ld_shared_v4(saddr); }
  __device__ __forceinline__ void st16(uint32_t saddr, uint4 v) const {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(saddr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
  }
};

#endif  // __CUDACC__

}  // namespace lily::cuda
