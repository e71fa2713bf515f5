// MoE expert products for few rows per expert (medium prompts: moe.cu, use_moe_small) with the TOKENS as
// the MMA's N ("swap AB"): the weights are the A operand of mma.sync m16n8k16 BF16 (16 output rows), an
// expert's grouped rows the B operand (n8 tiles of 8 rows), so an expert with 5 rows costs one n8 tile
// instead of a 64-row wgmma tile, and each weight byte is read once per pass over an expert's rows.
//   GATED = false: Y[r, o] = sum_k W_e[o, k] X[r, k]                   (the down product)
//   GATED = true:  Y[r, i] = row_scale[r] * silu(G_e[i, :] . X[x_rows[r]]) * (U_e[i, :] . X[x_rows[r]])
//                            (the gated gate/up product, linear_common.cuh's store_output expression)
// for every grouped row r of expert e: rows [row_end[e-1], row_end[e]) of the routing tables
// (moe_routing.cuh; row_end[-1] = 0). The arguments are the LinearArgs of the grouped products that
// linear_tiles would run (a.w, a.up, a.x/ldx or a.xb, a.x_rows, a.y/ldy or a.yb, a.row_scale,
// a.tiles.row_end), with the same outputs: F32 y rows, or (a.yb) the next product's Xb rows (BF16,
// xb_layout.cuh's k permutation, wg_xb_pos), written with wg_bf16 as the GATED wgmma epilogue writes them.
// Weights: 4-bit MLX affine [E, N, K/8] U32, BF16 scales/biases [E, N, K/gs] 4-byte aligned, gs a power of
// two >= 32, K % 128 == 0, K / gs even (host: use_moe_small).
//
// Layout. A row segment = 64 bytes (128 values); lane (g = lane/4, c = lane%4) loads bytes [16c, 16c+16)
// of the segment in rows g and g+8 of a 16-row tile (words m = 0..3: chunk J = 4c + m of the segment,
// values 8J..8J+7; one weight group: gs >= 32). Word m gives two mmas j = 2m + h (h = 0, 1): with
// p = 2h, the A registers are the bf16 pairs (nibbles p, p+4) and (p+1, p+5) of rows g and g+8:
//   a0 = row g pair p, a1 = row g+8 pair p, a2 = row g pair p+1, a3 = row g+8 pair p+1
// (ms_a_bits, dequantized by wg_dequant_pair: w = s*q + b rounded once to bf16, as the wgmma GEMM).
// So mma k position 2c+e holds value 8J + p + 4e and 2c+8+e holds 8J + p + 1 + 4e: in Xb's permuted
// order (position 2q+e of a chunk holds value q+4e) these are words p and p+1 of Xb's chunk J, and the
// B registers of lane (g, c) are words 2h, 2h+1 of the 16-byte chunk J of row g of the n8 tile (ms_b_frag).
// Shared memory: the pass's X rows as Xb (bf16, k permuted), row stride ms_row_bytes(K) = 2K + 64 bytes
// (2K % 128 == 0, so rows g and g+1 of a quarter warp fall in different bank halves), chunk J of a row at
// 16 * ms_slot(J): inside a segment chunk 4c + m sits at slot 4m + c, so the 4 lanes of a quad read 64
// contiguous bytes (a quarter warp: two rows x 64 bytes, conflict-free).
//
// Two kernels (ms_plan picks): moe_small_kernel keeps a warp's next unit of weights in registers (ms_units:
// one unit of 2 segments in flight), moe_small_ring_kernel streams them through a shared-memory ring, R
// units ahead. Work (the ring kernel; moe_small_kernel alike with one pair a warp, units of 2 segments in
// registers). Grid (slices of ms_ring_cta_rows, E), MS_THREADS = 4 warps, ms_ctas CTAs an SM (one stages its
// rows while the others stream weights). Warp w of slice s owns ms_pairs tile pairs: gated, 16 rows of G and the same 16 of U
// a pair (gate and up of an output in the same lane and register: the SwiGLU is in registers); plain, 32 rows
// of W a pair. Passes of NT*8 rows of the expert: stage the rows as Xb (ms_stage: copied from a.xb, the
// gated product's rows gathered through x_rows; or converted from F32 a.x), __syncthreads, then each warp
// runs its units (pair, K segment) in order, its weights streamed through the warp's shared-memory ring
// (below: MS_SLOT_BYTES), R units ahead, the first R copied before pdl_wait (constant weights); a pair's
// rows are stored after its last segment. n8 tiles past the pass's rows are skipped (warp-uniform). Pairs
// past N: loads of real rows, no stores (the host keeps N % 16 == 0 gated, N % 32 == 0 plain).
// dense_small.cuh shares the fragments and the staging, with its weights in a register double buffer
// (ms_load / ms_units).
// Precision: bf16 operands (w rounded once, x rounded once), fp32 accumulation in the mma; the sum order
// differs from the wgmma GEMM's (not bit-identical; ~1e-3 relative, the same operands).
#pragma once
#include <cstdint>

#include "linear_common.cuh"
#include "xb_layout.cuh"
#ifdef __CUDACC__
#include "wgmma.cuh"
#endif

namespace lily::cuda {

constexpr int MS_THREADS = 128, MS_WARPS = MS_THREADS / 32;
constexpr int MS_SPU = 2;  // segments per unit of ms_units' register pipeline (dense_small.cuh)
constexpr int MS_SEG_VALS = 128;

// The ring (moe_small_ring_kernel): a warp streams its weights one unit (one segment of its two A tiles) at a
// time through a ring of R slots in shared memory, filled by cp.async R units ahead of the math, so
// that ~R - 1 units (2 KB each) of every warp are in flight however long the math takes. A slot: the lane's
// 4 weight words (16 bytes each, tile t, row g + 8h at k = 2t + h: [k][lane] x 16 B, so a quarter warp
// reads 128 contiguous bytes) and 4 scale words ([k][lane] x 4 B): lane (g, c) copies the aligned pair of
// BF16 scales (c even) or biases (c odd) holding the group of its row k; lanes c and c ^ 1 need the same
// pair (group of values 32c..32c+63 of the segment for even c, gs >= 32; the row's first group at an even
// index: K / gs even, host), so each reads its partner's word after a __syncwarp.
constexpr int MS_SLOT_BYTES = 32 * (4 * 16 + 4 * 4);  // 2,560 a warp
constexpr int MS_RING_MAX = 8;
// CTAs an SM (gated: K = 2048, the staged rows take a third of the ring's room; down: three) and the shared
// memory each may take (228 KB an SM, 1 KB reserved a CTA).
__host__ __device__ constexpr int ms_ctas(bool gated) { return gated ? 2 : 3; }
__host__ __device__ constexpr int64_t ms_cta_smem(bool gated) { return 228 * 1024 / ms_ctas(gated) - 1024; }
// moe_small_ring_kernel: output tile pairs a warp owns (gated: 16 gate rows and the same 16 up rows; plain:
// 32 rows), and a CTA's output rows. moe_small_kernel: a CTA's output rows (a warp: one pair).
__host__ __device__ constexpr int ms_pairs(bool gated) { return gated ? 1 : 4; }
__host__ __device__ constexpr int ms_ring_cta_rows(bool gated) {
  return MS_WARPS * ms_pairs(gated) * (gated ? 16 : 32);
}
__host__ __device__ constexpr int ms_slice_rows(bool gated) { return MS_WARPS * (gated ? 16 : 32); }

// Which kernel and pass size (NT n8 tiles) a routed product of `rows` rows over E experts takes. The gated
// product (K = 2048) up to MS_WIDE_ROWS average rows an expert: moe_small_kernel (its registers hold the
// next unit; the ring's extra instructions cost more there than its loads in flight give: twelfth session,
// 137.5 against 157.4 us at T = 146), above it the ring kernel; both with 16-row passes. The down product
// (K = 512) always the ring kernel (66.8 against 84.7 us at T = 146, 73.8 against 102.6 at T = 300): 16-row
// passes up to 8 rows an expert, else 24. Measured at T = 64, 146, 300 (benchmarks/gemm_lab.cu); the
// crossings between are estimates.
constexpr int64_t MS_WIDE_ROWS = 6;
struct MsPlan {
  bool ring;
  int nt;
};
__host__ __device__ constexpr MsPlan ms_plan(bool gated, int64_t rows, int64_t E) {
  return gated ? MsPlan{rows > MS_WIDE_ROWS * E, 2} : MsPlan{true, rows <= 8 * E ? 2 : 3};
}

// Bytes of one staged Xb row of K values, and of a CTA's rows (NT n8 tiles).
__host__ __device__ constexpr int ms_row_bytes(int64_t K) { return int(2 * K + 64); }
__host__ __device__ constexpr size_t ms_smem_bytes(int64_t K, int nt) { return size_t(nt) * 8 * ms_row_bytes(K); }
// Ring slots a warp takes beside NT staged tiles of K values (ms_cta_smem), and the kernel's shared memory.
__host__ __device__ constexpr int ms_ring_units(bool gated, int64_t K, int nt) {
  const int64_t r = (ms_cta_smem(gated) - int64_t(ms_smem_bytes(K, nt))) / (MS_WARPS * MS_SLOT_BYTES);
  return r < MS_RING_MAX ? int(r) : MS_RING_MAX;
}
__host__ __device__ constexpr size_t ms_kernel_smem(int64_t K, int nt, int R) {
  return ms_smem_bytes(K, nt) + size_t(MS_WARPS) * R * MS_SLOT_BYTES;
}
// Slot (16-byte unit) of Xb chunk J (values 8J..8J+7) in a staged row: chunk 4c + m of a segment at 4m + c.
__host__ __device__ constexpr int ms_slot(int J) { return (J & ~15) | ((J & 3) << 2) | ((J >> 2) & 3); }
// The A registers of mma h of word m, before dequantization: rows g (w0) and g+8 (w1) shifted so that the
// pair (nibbles p, p+4), p = 2h (registers 0, 1) or 2h+1 (registers 2, 3), sits at bits 0..3 and 16..19
// (wg_dequant_pair masks the rest).
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
// Weight group of lane c's 32 values in segment seg (gshift = log2 group size >= 5).
__host__ __device__ constexpr int ms_group(int seg, int c, int gshift) { return (seg * MS_SEG_VALS + 32 * c) >> gshift; }

// Where a lane of moe_small_ring_kernel streams from: per tile t (gated: 0 the gate, 1 the up matrix) its row of
// pair 0 (row g of the warp's first pair; pair p, half h: + p * pair_rows + 8h), and the matrices' shape.
// The lane's 4 rows (t, h) start at row[t] + 8h; unit (pair p, segment seg) of every one of them is at the
// same offsets from there (ms_ring_off).
struct MsRing {
  int64_t row[2];
  int64_t wpr4;  // uint4 words a weight row
  int64_t gpr;   // scale groups a row (even)
  int pair_rows, live_pairs, nseg, gshift;
};
// Offsets of lane c's unit (pair p0, a pair past N reading pair 0's rows; segment seg) from its rows' starts:
// weight uint4 words (add the lane's chunk c), and scale/bias elements of the aligned pair holding its
// group (the rows' starts are even: gpr is).
struct MsOff {
  int64_t w4, sc;
};
__host__ __device__ inline MsOff ms_ring_off(const MsRing& m, int p0, int seg, int c) {
  const int64_t r = int64_t(p0 < m.live_pairs ? p0 : 0) * m.pair_rows;
  return {r * m.wpr4 + seg * 4, r * m.gpr + (ms_group(seg, c, m.gshift) & ~1)};
}
// A slot's bytes: weight word k = 2t + h of a lane, and its scale word (lane c even: the scales' pair, odd:
// the biases').
__host__ __device__ constexpr uint32_t ms_ring_w_at(int k, int lane) { return uint32_t(k * 512 + lane * 16); }
__host__ __device__ constexpr uint32_t ms_ring_s_at(int k, int lane) { return uint32_t(2048 + k * 128 + lane * 4); }
// The lanes whose scale words hold lane `lane`'s scales and biases (itself and its partner lane ^ 1).
__host__ __device__ constexpr int ms_ring_sc_lane(int lane) { return lane & 1 ? lane ^ 1 : lane; }
// scale | bias << 16 from the scale pair and the bias pair: their high halves where the group index is odd.
__host__ __device__ inline uint32_t ms_ring_sb(uint32_t sc, uint32_t bi, bool odd) {
  return odd ? (sc >> 16) | (bi & 0xFFFF0000u) : (sc & 0xFFFFu) | (bi << 16);
}

#ifdef __CUDACC__

__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One unit of a lane's loads: per segment and A tile, 16 bytes of rows g and g+8 and their scale | bias << 16.
struct MsStage {
  uint4 w[MS_SPU][2][2];     // [segment][tile][row g / g+8]
  uint32_t sb[MS_SPU][2][2];
};

// Where a lane reads: per tile and row (g, g+8), the row's words as uint4 (at the lane's chunk c) and its
// scale/bias index at group 0.
struct MsRows {
  const uint4* w[2][2];
  uint32_t sbi[2][2];
  const uint16_t* sc[2];
  const uint16_t* bi[2];
};

__device__ __forceinline__ void ms_load(MsStage& st, const MsRows& r, int seg0, int nseg, int c, int gshift) {
#pragma unroll
  for (int s = 0; s < MS_SPU; ++s) {
    const int seg = min(seg0 + s, nseg - 1);  // past the end: a real segment, not computed
    const int g = ms_group(seg, c, gshift);
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        st.w[s][t][h] = ld_stream(r.w[t][h] + seg * 4);
        const uint32_t i = r.sbi[t][h] + uint32_t(g);
        st.sb[s][t][h] = uint32_t(__ldg(r.sc[t] + i)) | (uint32_t(__ldg(r.bi[t] + i)) << 16);
      }
  }
}

// The products of one segment: A tiles t from the lane's words, B from the staged rows (xs: shared address of
// row g of n8 tile 0 at the segment, row stride `stride`), into acc[t][n8 tile] for the `ntiles` live tiles.
template <int NT>
__device__ __forceinline__ void ms_segment(const uint4 (&w)[2][2], const uint32_t (&sb)[2][2], uint32_t xs,
                                           uint32_t stride, int c, int ntiles, float (&acc)[2][NT][4]) {
  uint32_t s2[2][2], b2[2][2];
#pragma unroll
  for (int t = 0; t < 2; ++t)
#pragma unroll
    for (int h = 0; h < 2; ++h) s2[t][h] = __byte_perm(sb[t][h], 0, 0x1010), b2[t][h] = __byte_perm(sb[t][h], 0, 0x3232);
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    uint4 q[NT];
#pragma unroll
    for (int n = 0; n < NT; ++n)
      if (n < ntiles) q[n] = ld_shared_v4(xs + n * 8 * stride + 16 * (4 * m + c));
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      uint32_t a[2][4];
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        uint32_t q[4];
        ms_a_bits(w[t][0], w[t][1], m, hh, q);
#pragma unroll
        for (int i = 0; i < 4; ++i) a[t][i] = wg_dequant_pair(q[i], s2[t][i & 1], b2[t][i & 1]);
      }
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        if (n >= ntiles) continue;
        uint32_t b0, b1;
        ms_b_frag(q[n], hh, b0, b1);
        mma_bf16_16816(acc[0][n], a[0], b0, b1);
        mma_bf16_16816(acc[1][n], a[1], b0, b1);
      }
    }
  }
}

// A pair's products zeroed (before its first segment).
template <int NT>
__device__ __forceinline__ void ms_zero(float (&acc)[2][NT][4]) {
#pragma unroll
  for (int t = 0; t < 2; ++t)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[t][n][i] = 0.f;
}

// A warp's products over `nseg` segments in units of MS_SPU, the loads of unit u+1 in flight while unit u
// computes (gemv_mma.cuh's double buffer): st[0] holds unit 0 on entry (loaded before pdl_wait where the
// weights are constant); xs: shared address of the lane's row g of n8 tile 0 at segment 0; acc: the
// products, zeroed first.
template <int NT>
__device__ __forceinline__ void ms_units(MsStage (&st)[2], const MsRows& rr, int nseg, int c, int gshift, uint32_t xs,
                                         uint32_t stride, int ntiles, float (&acc)[2][NT][4]) {
  ms_zero(acc);
  const int units = (nseg + MS_SPU - 1) / MS_SPU;
#pragma unroll 1
  for (int u = 0; u < units; u += 2) {
    if (u + 1 < units) ms_load(st[1], rr, (u + 1) * MS_SPU, nseg, c, gshift);
#pragma unroll
    for (int s = 0; s < MS_SPU; ++s)
      if (u * MS_SPU + s < nseg)
        ms_segment<NT>(st[0].w[s], st[0].sb[s], xs + (u * MS_SPU + s) * 256, stride, c, ntiles, acc);
    if (u + 1 >= units) break;
    if (u + 2 < units) ms_load(st[0], rr, (u + 2) * MS_SPU, nseg, c, gshift);
#pragma unroll
    for (int s = 0; s < MS_SPU; ++s)
      if ((u + 1) * MS_SPU + s < nseg)
        ms_segment<NT>(st[1].w[s], st[1].sb[s], xs + ((u + 1) * MS_SPU + s) * 256, stride, c, ntiles, acc);
  }
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

// 4-byte cp.async (the ring's scale words).
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src) : "memory");
}

// A lane's sources of the ring: per row (t, h) its weights at chunk c and its scale or bias array, at the
// row's start (MsRing), and the unit offsets (ms_ring_off) of the next unit to copy.
struct MsRingSrc {
  const uint4* w[2][2];
  const uint16_t* sb[2][2];
};
// Copies the unit at offsets o into the lane's words of slot `slot` (one commit group is the caller's).
__device__ __forceinline__ void ms_ring_issue(const MsRingSrc& src, const MsOff& o, uint32_t slot, int lane) {
#pragma unroll
  for (int t = 0; t < 2; ++t)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      cp_async16(slot + ms_ring_w_at(2 * t + h, lane), src.w[t][h] + o.w4, 16);
      cp_async4(slot + ms_ring_s_at(2 * t + h, lane), src.sb[t][h] + o.sc);
    }
}

// The lane's unit from slot `slot` (its copies landed and the warp synchronised): weight words and
// scale | bias << 16 per tile and row, as ms_segment takes them; sel: the byte_perm of ms_ring_sb.
__device__ __forceinline__ void ms_ring_read(uint32_t slot, int lane, uint32_t sel, uint4 (&w)[2][2],
                                             uint32_t (&sb)[2][2]) {
  const int sl = ms_ring_sc_lane(lane), bl = sl ^ 1;
#pragma unroll
  for (int t = 0; t < 2; ++t)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int k = 2 * t + h;
      w[t][h] = ld_shared_v4(slot + ms_ring_w_at(k, lane));
      uint32_t sc, bi;
      asm volatile("ld.shared.u32 %0, [%1];" : "=r"(sc) : "r"(slot + ms_ring_s_at(k, sl)) : "memory");
      asm volatile("ld.shared.u32 %0, [%1];" : "=r"(bi) : "r"(slot + ms_ring_s_at(k, bl)) : "memory");
      sb[t][h] = __byte_perm(sc, bi, sel);
    }
}

// The gated product of prompts with few rows an expert (ms_plan): grid (slices of ms_slice_rows outputs, E
// experts), MS_THREADS, two CTAs an SM, shared memory ms_smem_bytes(K, NT). Warp w of slice s owns one tile
// pair from o0 = (s * MS_WARPS + w) * (gated 16, plain 32); passes of NT*8 rows: stage them, then the K
// segments through ms_units' register double buffer, the first unit loaded before pdl_wait.
template <bool GATED, int NT>
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
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const WeightView& m = GATED && t == 1 ? a.up : a.w;
      rr.sc[t] = static_cast<const uint16_t*>(m.scales);
      rr.bi[t] = static_cast<const uint16_t*>(m.biases);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t row = e * N + (live ? o0 + (GATED ? 0 : 16 * t) + g + 8 * h : 0);
        rr.w[t][h] = reinterpret_cast<const uint4*>(static_cast<const uint32_t*>(m.w) + row * wpr) + c;
        rr.sbi[t][h] = uint32_t(row * gpr);
      }
    }
  }
  MsStage st[2];
  if (live) ms_load(st[0], rr, 0, nseg, c, gshift);  // constant weights: before pdl_wait
  pdl_wait();
  pdl_trigger();
  const int64_t row0 = e > 0 ? a.tiles.row_end[e - 1] : 0, row1 = a.tiles.row_end[e];
  const uint32_t xs0 = smem_u32(ms_smem), stride = uint32_t(ms_row_bytes(K));
  for (int64_t r0 = row0; r0 < row1; r0 += NT * 8) {
    const int rows = int(min(int64_t(NT * 8), row1 - r0)), ntiles = (rows + 7) / 8;
    if (r0 > row0) {
      __syncthreads();  // every warp is done with the previous pass's rows
      if (live) ms_load(st[0], rr, 0, nseg, c, gshift);
    }
    ms_stage<GATED>(a, r0, rows, K, xs0);
    __syncthreads();
    if (!live) continue;
    float acc[2][NT][4];
    const uint32_t xs = xs0 + uint32_t(g) * stride;
    ms_units<NT>(st, rr, nseg, c, gshift, xs, stride, ntiles, acc);
    ms_store<GATED, NT>(a, r0, rows, o0, g, c, acc);
  }
}

// Grid (slices of ms_ring_cta_rows(GATED) outputs, E experts), MS_THREADS, ms_ctas(GATED) CTAs an SM, shared
// memory ms_kernel_smem(K, NT, R): the staged rows, then each warp's R ring slots. Warp w of slice s owns
// ms_pairs(GATED) tile pairs from o0 = (s * MS_WARPS + w) * pairs * rows a pair (gated 16: gate and up of
// the same rows; plain 32). Its units (pair, segment) run in order, pass after pass over the expert's rows
// (the same weights again); the first R are copied before pdl_wait (constant weights). A pair's products
// are stored after its last segment. Pairs past N load row 0 of the expert and store nothing.
template <bool GATED, int NT, int R>
__global__ void __launch_bounds__(MS_THREADS, ms_ctas(GATED)) moe_small_ring_kernel(const LinearArgs a) {
  static_assert(R >= 2 && R <= MS_RING_MAX, "ring slots");
  extern __shared__ uint4 ms_smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const int64_t e = blockIdx.y, N = a.w.rows, K = a.w.cols;
  constexpr int PAIRS = ms_pairs(GATED), PAIR_ROWS = GATED ? 16 : 32;
  const int64_t o0 = (int64_t(blockIdx.x) * MS_WARPS + warp) * PAIRS * PAIR_ROWS;
  MsRing m;
  m.nseg = int(K / MS_SEG_VALS), m.gshift = __ffs(a.w.group_size) - 1, m.pair_rows = PAIR_ROWS;
  m.wpr4 = K / 32, m.gpr = K / a.w.group_size;
  m.live_pairs = int(max(int64_t(0), min(int64_t(PAIRS), (N - o0) / PAIR_ROWS)));
  MsRingSrc src;
#pragma unroll
  for (int t = 0; t < 2; ++t) {
    const WeightView& v = GATED && t == 1 ? a.up : a.w;
    m.row[t] = e * N + (o0 < N ? o0 : 0) + (GATED ? 0 : 16 * t) + g;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = m.row[t] + 8 * h;
      src.w[t][h] = reinterpret_cast<const uint4*>(v.w) + row * m.wpr4 + c;
      src.sb[t][h] = static_cast<const uint16_t*>(c & 1 ? v.biases : v.scales) + row * m.gpr;
    }
  }
  const int per_pass = PAIRS * m.nseg;
  const uint32_t xs0 = smem_u32(ms_smem), stride = uint32_t(ms_row_bytes(K));
  const uint32_t ring = xs0 + uint32_t(ms_smem_bytes(K, NT)) + uint32_t(warp * R * MS_SLOT_BYTES);
  int ip = 0, iseg = 0;  // the next unit to copy: pair, segment
  auto next_copy = [&](uint32_t slot) {
    ms_ring_issue(src, ms_ring_off(m, ip, iseg, c), slot, lane);
    if (++iseg == m.nseg) iseg = 0, ip = ip + 1 == PAIRS ? 0 : ip + 1;
  };
#pragma unroll
  for (int j = 0; j < R; ++j) {  // constant weights: before pdl_wait
    if (j < per_pass) next_copy(ring + j * MS_SLOT_BYTES);
    cp_async_commit();
  }
  pdl_wait();
  pdl_trigger();
  const int64_t row0 = e > 0 ? a.tiles.row_end[e - 1] : 0, row1 = a.tiles.row_end[e];
  const int passes = int((row1 - row0 + NT * 8 - 1) / (NT * 8)), total = passes * per_pass;
  const uint32_t xs = xs0 + uint32_t(g) * stride;
  float acc[2][NT][4];
  int64_t r0 = row0;
  int rows = 0, ntiles = 0, k = 0, seg = 0, pair = 0, slot = 0;
  for (int i = 0; i < total; ++i) {
    if (k == 0) {  // a pass starts: stage its rows (every warp done with the previous pass's)
      if (i > 0) __syncthreads(), r0 += NT * 8;
      rows = int(min(int64_t(NT * 8), row1 - r0)), ntiles = (rows + 7) / 8;
      ms_stage<GATED>(a, r0, rows, K, xs0);
      __syncthreads();
    }
    if (seg == 0) ms_zero(acc);
    cp_async_wait<R - 1>();  // unit i's copies (the lane's own)
    __syncwarp();            // and the partner lanes' scale words
    uint4 w[2][2];
    uint32_t sb[2][2];
    const uint32_t at = ring + uint32_t(slot * MS_SLOT_BYTES);
    ms_ring_read(at, lane, ms_group(seg, c, m.gshift) & 1 ? 0x7632u : 0x5410u, w, sb);
    ms_segment<NT>(w, sb, xs + uint32_t(seg) * 256, stride, c, ntiles, acc);
    if (seg == m.nseg - 1) {
      const int64_t op = o0 + int64_t(pair) * PAIR_ROWS;
      if (op < N) ms_store<GATED, NT>(a, r0, rows, op, g, c, acc);
    }
    __syncwarp();  // every lane has read the slot before it is refilled
    if (i + R < total) next_copy(at);
    cp_async_commit();
    if (++seg == m.nseg) seg = 0, ++pair;
    if (++k == per_pass) k = 0, pair = 0;
    if (++slot == R) slot = 0;
  }
  cp_async_wait<0>();  // no copy lands after the CTA's shared memory is another's (empty experts)
}

// One instance of either kernel for K inputs (ms_plan's choice: RING, NT) and its launch shape: the ring as
// deep as the staged rows leave room for (R), the dynamic shared memory, the output rows a CTA.
template <bool GATED, int NT, bool RING, int64_t K>
struct MsLaunch {
  static constexpr int R = RING ? ms_ring_units(GATED, K, NT) : 0;
  static constexpr size_t smem = RING ? ms_kernel_smem(K, NT, R) : ms_smem_bytes(K, NT);
  static constexpr int64_t cta_rows = RING ? ms_ring_cta_rows(GATED) : ms_slice_rows(GATED);
  static constexpr auto kernel() {
    if constexpr (RING) return moe_small_ring_kernel<GATED, NT, R>;
    else return moe_small_kernel<GATED, NT>;
  }
};

#endif  // __CUDACC__

}  // namespace lily::cuda
