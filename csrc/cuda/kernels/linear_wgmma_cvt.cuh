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

// Scale/bias index of converter thread t's A rows at group 0 of the tile's expert (wg_scale_rows' form:
// rows past N read row N - 1, computed and never stored), and their matrix (GATED: 1 = the up matrix's).
template <int BM, bool GATED>
__device__ __forceinline__ void wgc_scale_rows(uint32_t (&row)[wgc_rows(BM)], const WeightView& w, int64_t expert,
                                               int64_t n0, int t) {
  const int64_t N = w.rows, gpr = w.cols / w.group_size;
#pragma unroll
  for (int i = 0; i < wgc_rows(BM); ++i) {
    const int64_t o = n0 + wgc_out_row(GATED, wgc_stage_row(GATED, wgc_a_row(t, i), wg_blocks(BM)));
    row[i] = uint32_t((expert * N + (o < N ? o : N - 1)) * gpr);
  }
}
// Loads converter thread t's scales and biases of k-tile kt (wgc_group of chunks 0 and, GS32, 4).
template <int BM, bool GS32, bool GATED>
__device__ __forceinline__ void wgc_load_scales(WgcScales<GS32, wgc_rows(BM)>& s, const uint16_t* sc, const uint16_t* bi,
                                                const uint32_t (&row)[wgc_rows(BM)], int gshift, int kt, int t,
                                                const uint16_t* sc_u = nullptr, const uint16_t* bi_u = nullptr) {
#pragma unroll
  for (int i = 0; i < wgc_rows(BM); ++i) {
    const bool up = wgc_matrix(GATED, wgc_stage_row(GATED, wgc_a_row(t, i), wg_blocks(BM))) != 0;
#pragma unroll
    for (int h = 0; h < (GS32 ? 2 : 1); ++h) {
      const uint32_t gi = row[i] + wgc_group(kt, 4 * h, gshift);
      s.scale[i][h] = __ldg((up ? sc_u : sc) + gi);
      s.bias[i][h] = __ldg((up ? bi_u : bi) + gi);
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// linear_wgmma_cvt_kernel<BM, GS32, GATHER, GATED, BITS>: linear_wgmma_tma_kernel's unsplit products at BM 128
// (the same tiles, work units, producers, epilogues and bits) with a converter warpgroup. Not BM 256: at 512
// threads the launch gives 128 registers a thread, and ptxas refuses m64n256k16 (128 accumulator registers)
// there even after setmaxnreg.inc (C7602, "insufficient registers (128)", asks for 154), though it honours
// setmaxnreg for everything else; BM 256 needs the converter inside the producer warpgroup (384 threads, 168
// at launch) or two m64n128 halves (another wgmma shape: bits not guaranteed the same).
// CTA: 4 warpgroups, WGC_CTA_THREADS = 512 (128 registers a thread at launch), setmaxnreg:
//   warpgroup 0 producer (WGC_PRODUCER_REGS): thread 0 per k-tile waits empty[s], arms wfull[s] with the W
//     part's bytes and loads the W box (GATED: the gate rows into its first half, the up rows into its second,
//     as the RS kernel's stage) into the stage's W part (tmap_w / tmap_u encoded with SWIZZLE_32B at 4-bit,
//     SWIZZLE_64B at 8-bit: wgc_w_unit); the Xb tile: dense, thread 0 arms full[s] with XBYTES and loads the Xb
//     box (SWIZZLE_128B); GATHER, all 128 threads copy the tile's gathered rows by cp.async as the RS kernel
//     does (WGC_GATHER_LAG stages in flight a thread, then proxy fence and one arrival each on full[s]);
//   warpgroup 1 converter (WGC_CONVERTER_REGS): per k-tile waits wfull[s] (the W part only, so it runs ahead
//     of the gathered rows) and aempty[sa], wgc_convert of the packed stage into A stage sa, proxy fence
//     (st.shared -> wgmma reads), arrives on afull[sa] (128 arrivals) and, one arrival a warp, on empty[s]
//     (the W part read); scales one k-tile ahead (GATED: the up rows' from the up matrix);
//   warpgroups 2, 3 consumers cw (WGC_CONSUMER_REGS): per k-tile wait full[s] (Xb) and afull[sa], queue
//     4 k16 steps x NB blocks of wgmma SS (A: wg_desc(A stage + wgc_a_offset(BM, cw, b)) + 2 step; B: the
//     Xb tile's, + 2 step; the RS kernel's shapes and order), commit, retire the previous k-tile's group
//     (wait_group 1) and release its stage and A stage (one arrival a warp on empty and aempty); the
//     epilogue wg_store_tile, GATED wg_store_gated (rbase = wg_row_base(GATED, ...): the A row map puts the
//     RS accumulators' rows in the D fragments).
// Shared memory: 1024 slack, S = WGC_STAGES stages [Xb BM x 64 bf16 | W tma_w_bytes], SA = WGC_A_STAGES A
//   stages of wgc_a_bytes(BM), then the mbarriers full[S] (1 + tx, GATHER 128), empty[S] (4 consumer warps x 2
//   + 4 converter warps), wfull[S] (1 + tx), afull[SA] (128), aempty[SA] (8): 192 KB at 4-bit, 224 KB at 8-bit.
// ptxas (sm_90a): 128 registers at launch, no spills (tests/emu/wgmma_cvt_kernel.cu, test_wgmma_cvt_emu.py).
// Unchecked on a GPU: the mbarrier protocol, the SWIZZLE_32B/64B W map, the speed.
constexpr int WGC_CTA_THREADS = 512, WGC_PRODUCER_REGS = 40, WGC_CONVERTER_REGS = 96, WGC_CONSUMER_REGS = 184;
constexpr int WGC_STAGES = 4, WGC_A_STAGES = 3;
static_assert(128 * (WGC_PRODUCER_REGS + WGC_CONVERTER_REGS + 2 * WGC_CONSUMER_REGS) <= 65536,
              "setmaxnreg: the consumers' registers must come from the producer's and the converter's release");
// The gather producer arrives on stage i - lag's full barrier after issuing stage i, which waits for stage i - S's
// release; the consumers release a stage while on the next, after its full barrier: so i - S + 1 <= i - lag - 1,
// S >= lag + 2, or the ring deadlocks (the RS kernel's 6-8 stages hold TMA_GATHER_LAG = 3; these 4 hold 2).
constexpr int WGC_GATHER_LAG = WGC_STAGES - 2;
__host__ __device__ constexpr int wgc_smem_bytes(int bm, int bits) {
  return 1024 + WGC_STAGES * tma_stage_bytes(bm, bits) + WGC_A_STAGES * wgc_a_bytes(bm) + 8 * (3 * WGC_STAGES + 2 * WGC_A_STAGES);
}
static_assert(wgc_smem_bytes(128, 8) <= 227 * 1024,
              "the converter's rings exceed the 227 KB opt-in shared memory");

template <int BM, bool GS32, bool GATHER, bool GATED, int BITS = 4>
__global__ void __launch_bounds__(WGC_CTA_THREADS, 1)
    linear_wgmma_cvt_kernel(const LinearArgs a, const uint16_t* xb, const __grid_constant__ CUtensorMap tmap_x,
                            const __grid_constant__ CUtensorMap tmap_w, const __grid_constant__ CUtensorMap tmap_u) {
  static_assert(BM == 128, "128-row tiles (BM 256: see above)");
  static_assert(BITS == 4 || !GATED, "GATED: 4-bit weights (as the RS kernel)");
  constexpr int NB = wg_blocks(BM), S = WGC_STAGES, SA = WGC_A_STAGES, KW = WG_BK * BITS / 32;
  constexpr int BN = GATED ? wg_rows(BM) / 2 : wg_rows(BM);  // outputs a column tile
  constexpr uint32_t XBYTES = BM * WG_BK * 2, STAGE = tma_stage_bytes(BM, BITS), WBYTES = tma_w_bytes(BITS, BM);
  constexpr uint32_t ABYTES = wgc_a_bytes(BM);
  pdl_wait();
  pdl_trigger();
  extern __shared__ uint8_t smem_raw[];
  const uint32_t ring_s = (smem_u32(smem_raw) + 1023) & ~1023u, a_ring = ring_s + S * STAGE, bars = a_ring + SA * ABYTES;
  auto full = [&](uint32_t s) { return bars + 8 * s; };
  auto empty = [&](uint32_t s) { return bars + 8 * (S + s); };
  auto wfull = [&](uint32_t s) { return bars + 8 * (2 * S + s); };
  auto afull = [&](uint32_t s) { return bars + 8 * (3 * S + s); };
  auto aempty = [&](uint32_t s) { return bars + 8 * (3 * S + SA + s); };
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(full(s), GATHER ? 128 : 1);
      mbar_init(empty(s), 4 * TMA_CONSUMER_WGS + 4);
      mbar_init(wfull(s), 1);
    }
    for (int s = 0; s < SA; ++s) mbar_init(afull(s), WGC_THREADS), mbar_init(aempty(s), 4 * TMA_CONSUMER_WGS);
    mbar_init_fence();
  }
  __syncthreads();

  const int64_t N = a.w.rows, K = a.w.cols;
  const int nk = int(K / WG_BK);
  const int64_t row_tiles = a.tiles.tile_expert ? int64_t(*a.tiles.num_tiles) : (a.tiles.M + BM - 1) / BM;
  const int64_t units = row_tiles * ((N + BN - 1) / BN);

  if (warp < 4) {  // ---------------- producer ----------------
    setmaxnreg_dec<WGC_PRODUCER_REGS>();
    uint32_t s = 0, ph = 0;
    if constexpr (!GATHER) {
      if (tid != 0) return;
      for (int64_t u = blockIdx.x; u < units; u += gridDim.x) {
        Tile tile;
        if (!find_tile(a.tiles, u % row_tiles, BM, tile)) continue;
        const int n0 = int(u / row_tiles) * BN;
        for (int kt = 0; kt < nk; ++kt) {
          mbar_wait(empty(s), ph ^ 1);
          const uint32_t st = ring_s + s * STAGE;
          mbar_arrive_expect_tx(wfull(s), WBYTES);
          tma_load_3d(st + XBYTES, &tmap_w, wfull(s), kt * KW, n0, int(tile.expert));
          if constexpr (GATED) tma_load_3d(st + XBYTES + WBYTES / 2, &tmap_u, wfull(s), kt * KW, n0, int(tile.expert));
          mbar_arrive_expect_tx(full(s), XBYTES);
          tma_load_2d(st, &tmap_x, full(s), kt * WG_BK, int(tile.row0));
          if (++s == S) s = 0, ph ^= 1;
        }
      }
    } else {
      constexpr int PER = BM * 8 / 128;  // 16-byte chunks per thread per stage
      const int j = tid & 7;             // chunk (k 8j..8j+7 of the k-tile) of every row this thread copies
      uint32_t s_arrive = 0;             // oldest stage whose arrival is still due
      int pending = 0;                   // stages copied by this thread and not yet arrived on
      for (int64_t u = blockIdx.x; u < units; u += gridDim.x) {
        Tile tile;
        if (!find_tile(a.tiles, u % row_tiles, BM, tile)) continue;
        const int n0 = int(u / row_tiles) * BN;
        // the RS kernel's gather addressing (linear_wgmma_tma.cuh): 32-bit chunk indices, rows past the tile's
        // end zero-filled (bit i of `real` clear), chunk i at dst + 2048 i
        uint32_t src[PER], real = 0;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
          const int r = (tid >> 3) + 16 * i;
          src[i] = r < tile.rows ? uint32_t(a.x_rows[tile.row0 + r]) * uint32_t(K / 8) + uint32_t(j) : 0u;
          real |= r < tile.rows ? 1u << i : 0u;
        }
        const uint32_t dst = wg_swz(tid >> 3, j);
        for (int kt = 0; kt < nk; ++kt) {
          mbar_wait(empty(s), ph ^ 1);
          const uint32_t st = ring_s + s * STAGE;
          if (tid == 0) {
            mbar_arrive_expect_tx(wfull(s), WBYTES);
            tma_load_3d(st + XBYTES, &tmap_w, wfull(s), kt * KW, n0, int(tile.expert));
            if constexpr (GATED)
              tma_load_3d(st + XBYTES + WBYTES / 2, &tmap_u, wfull(s), kt * KW, n0, int(tile.expert));
          }
          const uint16_t* x_kt = xb + kt * WG_BK;  // k-tile kt's chunk 0
#pragma unroll
          for (int i = 0; i < PER; ++i)
            cp_async16(st + dst + 16 * 128 * i, wg_chunk_at(x_kt, src[i]), int((real >> i) & 1u) * 16);
          cp_async_commit();
          if (pending == WGC_GATHER_LAG) {
            cp_async_wait<WGC_GATHER_LAG>();  // the oldest pending stage's copies landed
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

  const uint16_t* sc = static_cast<const uint16_t*>(a.w.scales);
  const uint16_t* bi = static_cast<const uint16_t*>(a.w.biases);
  const uint16_t* sc_u = GATED ? static_cast<const uint16_t*>(a.up.scales) : nullptr;
  const uint16_t* bi_u = GATED ? static_cast<const uint16_t*>(a.up.biases) : nullptr;
  const int gshift = GS32 ? 5 : __ffs(a.w.group_size) - 1;
  if (warp < 8) {  // ---------------- converter ----------------
    setmaxnreg_dec<WGC_CONVERTER_REGS>();
    const int t = tid - 128;
    uint32_t s = 0, ph = 0, sa = 0, aph = 0;
    for (int64_t u = blockIdx.x; u < units; u += gridDim.x) {
      Tile tile;
      if (!find_tile(a.tiles, u % row_tiles, BM, tile)) continue;
      uint32_t rows[wgc_rows(BM)];
      wgc_scale_rows<BM, GATED>(rows, a.w, tile.expert, (u / row_tiles) * BN, t);
      WgcScales<GS32, wgc_rows(BM)> cur, nxt;
      wgc_load_scales<BM, GS32, GATED>(nxt, sc, bi, rows, gshift, 0, t, sc_u, bi_u);
#pragma unroll 1
      for (int kt = 0; kt < nk; ++kt) {
        cur = nxt;
        if (kt + 1 < nk) wgc_load_scales<BM, GS32, GATED>(nxt, sc, bi, rows, gshift, kt + 1, t, sc_u, bi_u);
        mbar_wait(wfull(s), ph);
        mbar_wait(aempty(sa), aph ^ 1);
        wgc_convert<BM, GS32, GATED, BITS>(WgcShared{}, ring_s + s * STAGE + XBYTES, a_ring + sa * ABYTES, t, cur);
        fence_proxy_async();  // the A stage's st.shared before the consumers' wgmma reads it
        mbar_arrive(afull(sa));
        __syncwarp();
        if (lane == 0) mbar_arrive(empty(s));  // the warp's reads of the W part are done
        if (++s == S) s = 0, ph ^= 1;
        if (++sa == SA) sa = 0, aph ^= 1;
      }
    }
    return;
  }

  // ---------------- consumers ----------------
  setmaxnreg_inc<WGC_CONSUMER_REGS>();
  const int ct = tid - 256, cw = ct >> 7, w4 = (ct >> 5) & 3, g = lane >> 2, c = lane & 3;
  const int rbase = wg_row_base(GATED, cw, w4, g, NB);
  uint32_t s = 0, ph = 0, sa = 0, aph = 0, eb_prev = 0, aeb_prev = 0;
  for (int64_t u = blockIdx.x; u < units; u += gridDim.x) {
    Tile tile;
    if (!find_tile(a.tiles, u % row_tiles, BM, tile)) continue;
    const int64_t n0 = (u / row_tiles) * BN;
    float acc[NB][BM / 2];
#pragma unroll
    for (int b = 0; b < NB; ++b)
#pragma unroll
      for (int i = 0; i < BM / 2; ++i) acc[b][i] = 0.f;
#pragma unroll 1
    for (int kt = 0; kt < nk; ++kt) {
      mbar_wait(full(s), ph);
      mbar_wait(afull(sa), aph);
      const uint64_t xd = wg_desc(ring_s + s * STAGE), ad = wg_desc(a_ring + sa * ABYTES + wgc_a_offset(BM, cw, 0));
#pragma unroll
      for (int b = 0; b < NB; ++b)
#pragma unroll
        for (int i = 0; i < BM / 2; ++i) fence_reg(acc[b][i]);
      wgmma_fence();
#pragma unroll
      for (int st = 0; st < 4; ++st)
#pragma unroll
        for (int b = 0; b < NB; ++b)  // block b's A tile: + 8 KB = + 512 in the descriptor's address field
          wgmma_rows_ss<BM>(acc[b], ad + b * (wgc_a_offset(BM, 0, 1) >> 4) + 2 * st, xd + 2 * st);
      wgmma_commit();
#pragma unroll
      for (int b = 0; b < NB; ++b)
#pragma unroll
        for (int i = 0; i < BM / 2; ++i) fence_reg(acc[b][i]);
      wgmma_wait<1>();  // kt-1 retired
      if (kt > 0 && lane == 0) mbar_arrive(eb_prev), mbar_arrive(aeb_prev);
      eb_prev = empty(s), aeb_prev = aempty(sa);
      if (++s == S) s = 0, ph ^= 1;
      if (++sa == SA) sa = 0, aph ^= 1;
    }
    wgmma_wait<0>();
#pragma unroll
    for (int b = 0; b < NB; ++b)
#pragma unroll
      for (int i = 0; i < BM / 2; ++i) fence_reg(acc[b][i]);
    if (nk > 0 && lane == 0) mbar_arrive(eb_prev), mbar_arrive(aeb_prev);
    if constexpr (GATED) wg_store_gated<BM>(a, tile, n0, rbase, c, acc);
    else wg_store_tile<BM>(a, tile, n0, rbase, c, acc);
  }
}

#endif  // __CUDACC__

}  // namespace lily::cuda
