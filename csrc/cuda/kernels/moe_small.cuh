// MoE expert products for few rows per expert (medium prompts: moe.cu, use_moe_small) with the TOKENS as
// the MMA's N ("swap AB"): the weights are the A operand of mma.sync m16n8k16 BF16 (16 output rows), an
// expert's grouped rows the B operand (n8 tiles of 8 rows), so an expert with 5 rows costs one n8 tile
// instead of a 64-row wgmma tile, and each weight byte is read once per pass over an expert's rows.
//   moe_small_kernel<false>: Y[r, o] = sum_k W_e[o, k] X[r, k]                   (the down product)
//   moe_small_kernel<true>:  Y[r, i] = row_scale[r] * silu(G_e[i, :] . X[x_rows[r]]) * (U_e[i, :] . X[x_rows[r]])
//                            (the gated gate/up product, linear_common.cuh's store_output expression)
// for every grouped row r of expert e: rows [row_end[e-1], row_end[e]) of the routing tables
// (moe_routing.cuh; row_end[-1] = 0). The arguments are the LinearArgs of the grouped products that
// linear_tiles would run (a.w, a.up, a.x/ldx or a.xb, a.x_rows, a.y/ldy or a.yb, a.row_scale,
// a.tiles.row_end), with the same outputs: F32 y rows, or (a.yb) the next product's Xb rows (BF16,
// xb_layout.cuh's k permutation, wg_xb_pos), written with wg_bf16 as the GATED wgmma epilogue writes them.
// Weights: 4-bit MLX affine [E, N, K/8] U32, BF16 scales/biases [E, N, K/gs], gs a power of two >= 64,
// K % 128 == 0, scale/bias arrays 4-byte aligned (host: use_moe_small).
//
// Math ("exact q"). Per weight group of 64 values (a block; gs >= 128: its blocks share s, b) and output o:
//   sum_k w_k x_k = s * sum_k (128 + q_k) x_k + (b - 128 s) * xsum,   xsum = sum_k x_k over the block,
// w_k = s*q_k + b. The mma's A operand is bf16(128 + q), exact, built by one lop3 a register (wg_q128_pair);
// x_k are the staged bf16 values, xsum their fp32 sum (ms_xsum, once a pass); a block's 4 mma steps
// accumulate from zero into `acc`, then y += s*acc + (b - 128 s)*xsum in fp32 (ms_block's epilogue: lane
// (g, c) holds rows g, g+8 and columns 2c, 2c+1 of acc; the scale and bias of the quad's 4 rows (2 tiles x
// g, g+8) are loaded once a quad, lane ms_sb_lane(t, r) holding tile t's row g + 8r, converted by it and
// shuffled). Per segment and A tile this replaces the per-element dequantization (2 bf16x2 fma a register:
// 64 a segment and tile) by 8 fp32 fma per n8 tile and block.
//
// Layout. A row segment = 64 bytes (128 values) = blocks b = 0, 1 of 32 bytes; lane (g = lane/4, c = lane%4)
// loads 8 bytes of each block (bytes 32b + 8c: two ld.v2) in rows g and g+8 of a 16-row tile, held as one
// uint4 per row whose word m = 2b + m' is chunk J = 8b + 2c + m' of the segment (values 8J..8J+7): so the
// 4 lanes of a quad hold one block in every mma step (a step never mixes groups). Word m gives two mmas
// j = 2m + h (h = 0, 1): with p = 2h, the A registers are the bf16 pairs (nibbles p, p+4) and (p+1, p+5)
// of rows g and g+8:
//   a0 = row g pair p, a1 = row g+8 pair p, a2 = row g pair p+1, a3 = row g+8 pair p+1
// (ms_a_bits, then wg_q128_pair: 128 + q). So mma k position 2c+e holds value 8J + p + 4e and 2c+8+e holds
// 8J + p + 1 + 4e: in Xb's permuted order (position 2q+e of a chunk holds value q+4e) these are words p and
// p+1 of Xb's chunk J, and the B registers of lane (g, c) are words 2h, 2h+1 of the 16-byte chunk J of row g
// of the n8 tile (ms_b_frag). Steps m = 0, 1 are block 0, m = 2, 3 block 1.
// Shared memory: the pass's X rows as Xb (bf16, k permuted), row stride ms_row_bytes(K) = 2K + 64 bytes
// (2K % 128 == 0, so rows g and g+1 of a quarter warp fall in different bank halves), chunk J of a row at
// 16 * ms_slot(J): inside a segment chunk 8b + 2c + m' sits at slot 4(2b + m') + c, so the 4 lanes of a quad
// read 64 contiguous bytes for step m (a quarter warp: two rows x 64 bytes, conflict-free). After the rows,
// ms_xsum_bytes: xsum[block][row of the pass] fp32 (ms_xsum_at).
//
// Work. Grid (slices, E), MS_THREADS = 4 warps, two CTAs an SM (one stages its rows while the other streams
// weights). Warp w of slice s owns two 16-row A tiles: gated, rows
// i0 = (4s + w) * 16 of G and of U (so gate and up of an output sit in the same lane and register: the
// SwiGLU is in registers); plain, rows o0 = (4s + w) * 32 and o0 + 16 of W. Passes of NT*8 rows of the
// expert: stage the rows as Xb (ms_stage: copied from a.xb, the gated product's rows gathered through
// x_rows; or converted from F32 a.x), __syncthreads, their block sums (ms_xsum: mma with an A of ones),
// __syncthreads, then each warp runs the K segments (ms_units) in units of MS_SPU segments, the loads of unit
// u+1 in flight while unit u computes (gemv_mma.cuh's double buffer); the first unit of the first pass is
// loaded before pdl_wait (constant weights). n8 tiles past the pass's rows are skipped: one loop per live
// count (ms_units_live<LIVE>), so no mma or epilogue is predicated. Rows past N: the warp loads none and
// stores none (the host keeps N % 16 == 0 gated, N % 32 == 0 plain).
// Precision: exact q (128 + q in bf16), bf16 x (rounded once, as the wgmma GEMM rounds it), fp32 accumulation
// in the mma over a 64-value block, scale and bias applied in fp32 (xsum fp32, summed by the tensor cores):
// more accurate than the wgmma GEMM's operands, which round each w = s*q + b to bf16; so not bit-identical to
// it (~1e-3 relative, x's rounding dominating both). docs/numerics.md.
#pragma once
#include <cstdint>

#include "linear_common.cuh"
#include "xb_layout.cuh"
#ifdef __CUDACC__
#include "wgmma.cuh"
#endif

namespace lily::cuda {

constexpr int MS_THREADS = 128, MS_WARPS = MS_THREADS / 32;
constexpr int MS_SPU = 2;  // segments per pipeline unit
constexpr int MS_SEG_VALS = 128;

// n8 tiles a pass takes (NT) for `rows` routed rows over E experts: 2 (16 rows, 67 KB staged at K = 2048 with
// the block sums) up to MS_WIDE_ROWS average rows an expert, else 3 (24 rows, 101 KB; two CTAs an SM still
// fit): fewer passes over the weights for the busier experts of longer prompts. An estimate, to be tuned by
// measurement (benchmarks/gemm_lab.cu).
constexpr int64_t MS_WIDE_ROWS = 8;
__host__ __device__ constexpr int ms_pass_tiles(int64_t rows, int64_t E) { return rows <= MS_WIDE_ROWS * E ? 2 : 3; }

// Output rows of one CTA (4 warps x 2 tiles x 16, gated: the two tiles are G and U of the same 16 rows).
__host__ __device__ constexpr int ms_slice_rows(bool gated) { return gated ? MS_WARPS * 16 : MS_WARPS * 32; }
// Bytes of one staged Xb row of K values; the block sums after a CTA's rows (NT n8 tiles): xsum[K/64][8 NT]
// fp32; all of a CTA's staging.
constexpr int MS_BLOCK_VALS = 64;
__host__ __device__ constexpr int ms_row_bytes(int64_t K) { return int(2 * K + 64); }
__host__ __device__ constexpr size_t ms_xsum_offset(int64_t K, int nt) { return size_t(nt) * 8 * ms_row_bytes(K); }
__host__ __device__ constexpr size_t ms_xsum_bytes(int64_t K, int nt) {
  return size_t(K / MS_BLOCK_VALS) * nt * 8 * 4;
}
__host__ __device__ constexpr size_t ms_smem_bytes(int64_t K, int nt) {
  return ms_xsum_offset(K, nt) + ms_xsum_bytes(K, nt);
}
// Byte offset of xsum[blk][j] (block blk of the row, row j of the pass) from ms_xsum_offset.
__host__ __device__ constexpr int ms_xsum_at(int blk, int j, int nt) { return (blk * nt * 8 + j) * 4; }
// Slot (16-byte unit) of Xb chunk J (values 8J..8J+7) in a staged row: chunk 8b + 2c + m' of a segment at
// 4(2b + m') + c.
__host__ __device__ constexpr int ms_slot(int J) {
  return (J & ~15) | (((J >> 3) & 1) << 3) | ((J & 1) << 2) | ((J >> 1) & 3);
}
// The lane of a quad (c) whose loads hold the scale and bias of A tile t, row g + 8r (ms_load: lane c loads those
// of tile c >> 1, row half c & 1; ms_block shuffles them to the quad).
__host__ __device__ constexpr int ms_sb_lane(int t, int r) { return 2 * t + r; }
// Weight group of segment seg's first block (gshift = log2 group size >= 6; gs >= 128: of both blocks).
__host__ __device__ constexpr int ms_group(int seg, int gshift) { return (2 * seg) >> (gshift - 6); }
// The A registers of mma h of word m, before wg_q128_pair: rows g (w0) and g+8 (w1) shifted so that the
// pair (nibbles p, p+4), p = 2h (registers 0, 1) or 2h+1 (registers 2, 3), sits at bits 0..3 and 16..19
// (wg_q128_pair masks the rest).
__host__ __device__ inline void ms_a_bits(const uint4& w0, const uint4& w1, int m, int h, uint32_t (&q)[4]) {
  const uint32_t x0 = m == 0 ? w0.x : m == 1 ? w0.y : m == 2 ? w0.z : w0.w;
  const uint32_t x1 = m == 0 ? w1.x : m == 1 ? w1.y : m == 2 ? w1.z : w1.w;
  q[0] = x0 >> (8 * h), q[1] = x1 >> (8 * h), q[2] = x0 >> (8 * h + 4), q[3] = x1 >> (8 * h + 4);
}
// The B registers of mma h of a word from the 16-byte Xb chunk q: its words 2h, 2h+1.
__host__ __device__ inline void ms_b_frag(const uint4& q, int h, uint32_t& b0, uint32_t& b1) {
  b0 = h ? q.z : q.x;
  b1 = h ? q.w : q.y;
}

#ifdef __CUDACC__

__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// The same with a zero accumulator in (d = a b): a block's first step.
__device__ __forceinline__ void mma_bf16_16816_first(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%10, %10, %10, %10};"
               : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.f));
}

// One unit of a lane's loads: per segment and A tile, its 2 x 8 bytes of rows g and g+8 (as ms_segment's
// uint4); per segment the scales and biases of blocks 0 (low half) and 1 (high half), bf16, of one row: tile
// c >> 1, row g + 8 (c & 1) (ms_sb_lane: the 4 lanes of a quad hold the 4 rows' values once).
struct MsStage {
  uint4 w[MS_SPU][2][2];     // [segment][tile][row g / g+8]
  uint32_t sc[MS_SPU], bi[MS_SPU];
};

// Where a lane reads: per tile and row (g, g+8) the row's 8-byte units at the lane's c in block 0 of segment
// 0; the scales and biases of its row (tile c >> 1, row g + 8 (c & 1)) and the index of the row's group 0.
struct MsRows {
  const uint2* w[2][2];
  const uint16_t* sc;
  const uint16_t* bi;
  uint32_t sbi;
};

// G64 (gs = 64): a segment's two scales (biases) are one aligned 32-bit word (the host keeps K % 128 == 0 and
// 4-byte aligned arrays); else (gs >= 128, gshift = log2 gs) one value for both blocks.
template <bool G64>
__device__ __forceinline__ void ms_load(MsStage& st, const MsRows& r, int seg0, int nseg, int gshift) {
#pragma unroll
  for (int s = 0; s < MS_SPU; ++s) {
    const int seg = min(seg0 + s, nseg - 1);  // past the end: a real segment, not computed
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint2* p = r.w[t][h] + seg * 8;
        const uint2 lo = ld_stream_v2(p), hi = ld_stream_v2(p + 4);
        st.w[s][t][h] = make_uint4(lo.x, lo.y, hi.x, hi.y);
      }
    if constexpr (G64) {
      const uint32_t i = (r.sbi >> 1) + uint32_t(seg);
      st.sc[s] = __ldg(reinterpret_cast<const uint32_t*>(r.sc) + i);
      st.bi[s] = __ldg(reinterpret_cast<const uint32_t*>(r.bi) + i);
    } else {
      const uint32_t i = r.sbi + uint32_t(ms_group(seg, gshift));
      st.sc[s] = uint32_t(__ldg(r.sc + i)) * 0x10001u;
      st.bi[s] = uint32_t(__ldg(r.bi + i)) * 0x10001u;
    }
  }
}

// Block b of a segment for A tiles T0 .. T0 + TN - 1 and the LIVE first n8 tiles: its steps m = 2b, 2b+1 (B
// from the staged rows: xs, the shared address of row g of n8 tile 0 at the segment, row stride `stride`)
// into acc from zero, then y += s*acc + (b - 128 s)*xsum (xq: shared address of the segment's xsum[2 seg][2c];
// lane (g, c): acc[t][n][i] is row g + 8 (i >> 1), column 8n + 2c + (i & 1)).
// sc, bi: the lane's scale and bias words (ms_load), shuffled to the quad after conversion.
template <int NT, int LIVE, int T0, int TN>
__device__ __forceinline__ void ms_block(const uint4 (&w)[2][2], uint32_t sc, uint32_t bi, int b, uint32_t xs,
                                         uint32_t xq, uint32_t stride, int c, float (&y)[2][NT][4]) {
  float acc[TN][LIVE][4];
#pragma unroll
  for (int m = 2 * b; m < 2 * b + 2; ++m) {
    uint4 q[LIVE];
#pragma unroll
    for (int n = 0; n < LIVE; ++n) q[n] = ld_shared_v4(xs + n * 8 * stride + 16 * (4 * m + c));
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      uint32_t a[TN][4];
#pragma unroll
      for (int t = 0; t < TN; ++t) {
        uint32_t qb[4];
        ms_a_bits(w[T0 + t][0], w[T0 + t][1], m, hh, qb);
#pragma unroll
        for (int i = 0; i < 4; ++i) a[t][i] = wg_q128_pair(qb[i]);
      }
#pragma unroll
      for (int n = 0; n < LIVE; ++n) {
        uint32_t b0, b1;
        ms_b_frag(q[n], hh, b0, b1);
#pragma unroll
        for (int t = 0; t < TN; ++t) {
          if (m == 2 * b && hh == 0) mma_bf16_16816_first(acc[t][n], a[t], b0, b1);
          else mma_bf16_16816(acc[t][n], a[t], b0, b1);
        }
      }
    }
  }
  const float s1 = __uint_as_float(b ? sc & 0xFFFF0000u : sc << 16);  // the lane's row (ms_sb_lane)
  const float o1 = fmaf(-128.f, s1, __uint_as_float(b ? bi & 0xFFFF0000u : bi << 16));
  float s[TN][2], o[TN][2];  // [tile][row g / g+8]: scale, b - 128 s
#pragma unroll
  for (int t = 0; t < TN; ++t)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      s[t][r] = __shfl_sync(0xFFFFFFFFu, s1, ms_sb_lane(T0 + t, r), 4);
      o[t][r] = __shfl_sync(0xFFFFFFFFu, o1, ms_sb_lane(T0 + t, r), 4);
    }
#pragma unroll
  for (int n = 0; n < LIVE; ++n) {
    const float2 xv = ld_shared_f2(xq + ms_xsum_at(b, 8 * n, NT));
#pragma unroll
    for (int t = 0; t < TN; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float& v = y[T0 + t][n][i];
        v = fmaf(o[t][i >> 1], i & 1 ? xv.y : xv.x, fmaf(s[t][i >> 1], acc[t][n][i], v));
      }
  }
}

// The products of one segment (ms_block's arguments) added into y[t][n8 tile] for the LIVE first tiles:
// both A tiles at once, or (LIVE >= 3: fewer live registers) one after the other, reading the B fragments
// twice.
template <int NT, int LIVE>
__device__ __forceinline__ void ms_segment(const uint4 (&w)[2][2], uint32_t sc, uint32_t bi, uint32_t xs, uint32_t xq,
                                           uint32_t stride, int c, float (&y)[2][NT][4]) {
#pragma unroll
  for (int b = 0; b < 2; ++b) {
    if constexpr (LIVE >= 3) {
      ms_block<NT, LIVE, 0, 1>(w, sc, bi, b, xs, xq, stride, c, y);
      ms_block<NT, LIVE, 1, 1>(w, sc, bi, b, xs, xq, stride, c, y);
    } else {
      ms_block<NT, LIVE, 0, 2>(w, sc, bi, b, xs, xq, stride, c, y);
    }
  }
}

// A warp's products over `nseg` segments in units of MS_SPU for LIVE n8 tiles, the loads of unit u+1 in
// flight while unit u computes (gemv_mma.cuh's double buffer): st[0] holds unit 0 on entry (loaded before
// pdl_wait where the weights are constant); xs: shared address of the lane's row g of n8 tile 0 at segment 0;
// xq: of xsum[0][2c]; y: zero on entry.
template <int NT, int LIVE, bool G64>
__device__ __forceinline__ void ms_units_live(MsStage (&st)[2], const MsRows& rr, int nseg, int c, int gshift,
                                              uint32_t xs, uint32_t xq, uint32_t stride, float (&y)[2][NT][4]) {
  const int units = (nseg + MS_SPU - 1) / MS_SPU;
  constexpr uint32_t XQ_SEG = 2 * NT * 8 * 4;  // xsum bytes of a segment (two blocks)
#pragma unroll 1
  for (int u = 0; u < units; u += 2) {
    if (u + 1 < units) ms_load<G64>(st[1], rr, (u + 1) * MS_SPU, nseg, gshift);
#pragma unroll
    for (int s = 0; s < MS_SPU; ++s) {
      const int seg = u * MS_SPU + s;
      if (seg < nseg)
        ms_segment<NT, LIVE>(st[0].w[s], st[0].sc[s], st[0].bi[s], xs + seg * 256, xq + seg * XQ_SEG, stride, c, y);
    }
    if (u + 1 >= units) break;
    if (u + 2 < units) ms_load<G64>(st[0], rr, (u + 2) * MS_SPU, nseg, gshift);
#pragma unroll
    for (int s = 0; s < MS_SPU; ++s) {
      const int seg = (u + 1) * MS_SPU + s;
      if (seg < nseg)
        ms_segment<NT, LIVE>(st[1].w[s], st[1].sc[s], st[1].bi[s], xs + seg * 256, xq + seg * XQ_SEG, stride, c, y);
    }
  }
}

// ms_units_live for the pass's `ntiles` live n8 tiles (1..NT; a loop per count, so that no mma or epilogue
// is predicated), y zeroed first.
template <int NT, bool G64>
__device__ __forceinline__ void ms_units(MsStage (&st)[2], const MsRows& rr, int nseg, int c, int gshift, uint32_t xs,
                                         uint32_t xq, uint32_t stride, int ntiles, float (&y)[2][NT][4]) {
#pragma unroll
  for (int t = 0; t < 2; ++t)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) y[t][n][i] = 0.f;
  if constexpr (NT > 1)
    if (ntiles == 1) return ms_units_live<NT, 1, G64>(st, rr, nseg, c, gshift, xs, xq, stride, y);
  if constexpr (NT > 2)
    if (ntiles == 2) return ms_units_live<NT, 2, G64>(st, rr, nseg, c, gshift, xs, xq, stride, y);
  if constexpr (NT > 3)
    if (ntiles == 3) return ms_units_live<NT, 3, G64>(st, rr, nseg, c, gshift, xs, xq, stride, y);
  ms_units_live<NT, NT, G64>(st, rr, nseg, c, gshift, xs, xq, stride, y);
}

// Stages rows [r0, r0 + rows) of the pass as Xb at shared address xs0, up to the end of the last n8 tile they
// touch (those slots zero: their products are computed, never stored). Source row of product row r: x_rows[r]
// (GATED) or r. From a.xb (bf16, already in Xb's order): cp.async, all of a thread's chunks in flight at once.
// From F32 a.x: MS_STAGE_BATCH chunks a thread loaded before any is converted (wgx_bf16_kernel's permutation
// and rounding) and stored, so their loads overlap.
constexpr int MS_STAGE_BATCH = 8;
template <bool GATED>
__device__ __forceinline__ void ms_stage(const LinearArgs& a, int64_t r0, int rows, int64_t K, uint32_t xs0) {
  const int chunks = int(K / 8), stride = ms_row_bytes(K), total = (rows + 7) / 8 * 8 * chunks;
  auto src_row = [&](int j) { return GATED ? int64_t(a.x_rows[r0 + j]) : r0 + j; };
  if (a.xb != nullptr) {
    for (int i = threadIdx.x; i < total; i += MS_THREADS) {
      const int j = i / chunks, J = i - j * chunks;
      const bool real = j < rows;
      cp_async16(xs0 + j * stride + 16 * ms_slot(J), real ? a.xb + src_row(j) * K + 8 * J : a.xb, real ? 16 : 0);
    }
    cp_async_commit();
    cp_async_wait<0>();
    return;
  }
  for (int i0 = threadIdx.x; i0 < total; i0 += MS_STAGE_BATCH * MS_THREADS) {
    float4 lo[MS_STAGE_BATCH], hi[MS_STAGE_BATCH];
#pragma unroll
    for (int b = 0; b < MS_STAGE_BATCH; ++b) {
      const int i = i0 + b * MS_THREADS, j = i / chunks, J = i - j * chunks;
      lo[b] = hi[b] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (i < total && j < rows) {
        const float* src = a.x + src_row(j) * a.ldx + 8 * J;
        lo[b] = *reinterpret_cast<const float4*>(src);
        hi[b] = *reinterpret_cast<const float4*>(src + 4);
      }
    }
#pragma unroll
    for (int b = 0; b < MS_STAGE_BATCH; ++b) {
      const int i = i0 + b * MS_THREADS, j = i / chunks, J = i - j * chunks;
      if (i >= total) break;
      asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(xs0 + j * stride + 16 * ms_slot(J)),
                   "r"(wg_pack_bf16x2(lo[b].x, hi[b].x)), "r"(wg_pack_bf16x2(lo[b].y, hi[b].y)),
                   "r"(wg_pack_bf16x2(lo[b].z, hi[b].z)), "r"(wg_pack_bf16x2(lo[b].w, hi[b].w))
                   : "memory");
    }
  }
}

// The block sums of the pass's staged rows (ntiles n8 tiles of K values at xs0, as ms_stage left them):
// xsum[blk][j] = sum of row j's staged values 64 blk .. 64 blk + 63 (bf16) in fp32, at xs0 +
// ms_xsum_offset + ms_xsum_at(blk, j). Warp w takes the blocks blk = w mod MS_WARPS: per n8 tile the block's
// 4 k16 steps (ms_segment's B fragments) through the mma with an A of ones, so every row of D holds the
// column sums; the lanes g = 0 store row 0 (columns 2c, 2c+1).
template <int NT>
__device__ __forceinline__ void ms_xsum(uint32_t xs0, int64_t K, int ntiles) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const uint32_t stride = uint32_t(ms_row_bytes(K)), xq = xs0 + uint32_t(ms_xsum_offset(K, NT));
  const uint32_t ones[4] = {0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u};
  for (int blk = warp; blk < int(K / MS_BLOCK_VALS); blk += MS_WARPS)
    for (int n = 0; n < ntiles; ++n) {
      float d[4] = {0.f, 0.f, 0.f, 0.f};
      const uint32_t at = xs0 + (8 * n + g) * stride + blk * 128 + 16 * c;
#pragma unroll
      for (int mm = 0; mm < 2; ++mm) {
        const uint4 q = ld_shared_v4(at + 64 * mm);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          uint32_t b0, b1;
          ms_b_frag(q, h, b0, b1);
          mma_bf16_16816(d, ones, b0, b1);
        }
      }
      if (g == 0)
        asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(xq + ms_xsum_at(blk, 8 * n + 2 * c, NT)), "f"(d[0]),
                     "f"(d[1])
                     : "memory");
    }
}

// The epilogue of a warp for the pass's rows [r0, r0 + rows): acc[t][n][2e' + e] is output o = o0 + 16t + g
// + 8e' (plain; gated: t = 0 the gate, 1 the up of o = o0 + g + 8e') for row r0 + 8n + 2c + e.
template <bool GATED, int NT>
__device__ __forceinline__ void ms_store(const LinearArgs& a, int64_t r0, int rows, int64_t o0, int g, int c,
                                         const float (&acc)[2][NT][4]) {
  const int64_t N = a.w.rows;
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int j = 8 * n + 2 * c + e;
      if (j >= rows) continue;
      const int64_t r = r0 + j;
      if constexpr (GATED) {
        const float rs = a.row_scale ? a.row_scale[r] : 1.f;
#pragma unroll
        for (int eh = 0; eh < 2; ++eh) {
          const int64_t o = o0 + g + 8 * eh;
          const float v = rs * silu(acc[0][n][2 * eh + e]) * acc[1][n][2 * eh + e];
          if (a.yb) a.yb[r * N + wg_xb_pos(o)] = wg_bf16(v);
          else a.y[r * a.ldy + o] = v;
        }
      } else {
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
          for (int eh = 0; eh < 2; ++eh) a.y[r * a.ldy + o0 + 16 * t + g + 8 * eh] = acc[t][n][2 * eh + e];
      }
    }
}

template <bool GATED, int NT, bool G64>
__global__ void __launch_bounds__(MS_THREADS, 2) moe_small_kernel(const LinearArgs a) {
  extern __shared__ uint4 ms_smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const int64_t e = blockIdx.y, N = a.w.rows, K = a.w.cols;
  const int nseg = int(K / MS_SEG_VALS), gshift = __ffs(a.w.group_size) - 1;
  const int64_t o0 = (int64_t(blockIdx.x) * MS_WARPS + warp) * (GATED ? 16 : 32);
  const bool live = o0 < N;  // the host keeps whole tiles: a warp's rows are all real or all past N
  MsRows rr;
  {
    const int64_t wpr = K / 8, gpr = K / a.w.group_size;
    const auto row_of = [&](int t, int h) { return e * N + (live ? o0 + (GATED ? 0 : 16 * t) + g + 8 * h : 0); };
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const WeightView& m = GATED && t == 1 ? a.up : a.w;
#pragma unroll
      for (int h = 0; h < 2; ++h)
        rr.w[t][h] = reinterpret_cast<const uint2*>(static_cast<const uint32_t*>(m.w) + row_of(t, h) * wpr) + c;
    }
    const WeightView& m = GATED && c >> 1 ? a.up : a.w;  // the lane's scale row: tile c >> 1, row half c & 1
    rr.sc = static_cast<const uint16_t*>(m.scales);
    rr.bi = static_cast<const uint16_t*>(m.biases);
    rr.sbi = uint32_t(row_of(c >> 1, c & 1) * gpr);
  }
  MsStage st[2];
  if (live) ms_load<G64>(st[0], rr, 0, nseg, gshift);  // constant weights: before pdl_wait
  pdl_wait();
  pdl_trigger();
  const int64_t row0 = e > 0 ? a.tiles.row_end[e - 1] : 0, row1 = a.tiles.row_end[e];
  const uint32_t xs0 = smem_u32(ms_smem), stride = uint32_t(ms_row_bytes(K));
  for (int64_t r0 = row0; r0 < row1; r0 += NT * 8) {
    const int rows = int(min(int64_t(NT * 8), row1 - r0)), ntiles = (rows + 7) / 8;
    if (r0 > row0) {
      __syncthreads();  // every warp is done with the previous pass's rows
      if (live) ms_load<G64>(st[0], rr, 0, nseg, gshift);
    }
    ms_stage<GATED>(a, r0, rows, K, xs0);
    __syncthreads();
    ms_xsum<NT>(xs0, K, ntiles);
    __syncthreads();
    if (!live) continue;
    float acc[2][NT][4];
    const uint32_t xs = xs0 + uint32_t(g) * stride, xq = xs0 + uint32_t(ms_xsum_offset(K, NT)) + 8 * c;
    ms_units<NT, G64>(st, rr, nseg, c, gshift, xs, xq, stride, ntiles, acc);
    ms_store<GATED, NT>(a, r0, rows, o0, g, c, acc);
  }
}

#endif  // __CUDACC__

}  // namespace lily::cuda
