// chain_lab's consumer math (benchmarks/chain_lab.cu, persist_chain_kernel's policy M): how x is staged in
// shared memory, and a step of N segments of a ring item into a lane's row partials. Lab code, not the
// engine's; the step functions and the staged layouts are host-callable so that tests/emu/chain_lab_emu.cu
// checks the fragment mapping on the CPU (mma.sync emulated through the Mma parameter).
//
// An item in a ring slot: W [16 rows][1 KB] (row r at r * PS_CHUNK_W, segment ls at 64 ls: 128 4-bit values,
// value i of a 32-bit word at bits 4i), then scales and biases [16 rows][32 BF16] (row r at r * PS_CHUNK_G,
// group 2 ls + half: a group is half a segment, 64 values). Staged x (M::x_bytes(K) bytes at xs): a zero
// block first (lanes without a B column read it with stride 0), then the policy's form.
// Per policy: STEP = segments a step in the warp-a-tile loop (the 8-warp loop takes min(STEP, 2)); Lane = the
// lane's constants; stage(x, K, xs, tid) by all 256 consumer threads (the caller synchronises);
// step<N>(lane, item, ls, seg, xs, K, acc): segments ls .. ls + N - 1 of the item (seg: the first one's index
// in the phase's K) into the lane's partials acc[0] (row g), acc[1] (row g + 8), to be summed over a quad.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/kernels/gemv_mma.cuh"
#include "cuda/kernels/moe_small.cuh"

namespace lily::cuda::lab {

constexpr int PS_CONSUMERS = 256;
constexpr int PS_CHUNK_VALS = 2048, PS_CHUNK_W = PS_CHUNK_VALS / 2, PS_CHUNK_G = PS_CHUNK_VALS / 64 * 2;  // bytes a row
constexpr int PS_ITEM_W = 16 * PS_CHUNK_W, PS_ITEM_S = 16 * PS_CHUNK_G;  // an item's weight and scale bytes
constexpr int PS_CSEG = PS_CHUNK_VALS / MmaSeg<4>::VALS;                  // segments a chunk (16)

// The tensor-core instructions of a step (the emulator passes its own).
struct PsMmaDevice {
  __device__ static void s8(int (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) { mma_s8(c, a, b0, b1); }
  __device__ static void bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    mma_bf16_16816(d, a, b0, b1);
  }
};

// x's octet o (8 floats, 32-byte aligned) into v, zeros past the last octet (o >= octets).
__device__ __forceinline__ void ps_load_octet(const float* x, int o, int octets, float (&v)[8]) {
  float4 a = make_float4(0.f, 0.f, 0.f, 0.f), b = a;
  if (o < octets) {
    const float4* q = reinterpret_cast<const float4*>(x) + 2 * o;
    a = q[0], b = q[1];
  }
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

template <int N>
__host__ __device__ __forceinline__ void ps_words(const uint8_t* p, uint32_t (&w)[N]) {  // N words, one load
  if constexpr (N == 2) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    w[0] = v.x, w[1] = v.y;
  } else {
    static_assert(N == 4, "2 or 4 words");
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
  }
}
__host__ __device__ __forceinline__ uint32_t ps_word(const uint4& v, int m) {
  return m == 0 ? v.x : m == 1 ? v.y : m == 2 ? v.z : v.w;
}

// PsDigits<SPS>: the integer-digit math of kernels/gemv_mma.cuh (x = e_u (D0 + 2^8 D1 + 2^16 D2) per 64-value
// block, 4 IMMA m16n8k32 a segment, the column epilogue a segment; error ~1e-7). Staged: gemv_mma's digits
// (mma_x_bytes) after the zero block.
//   SPS = 1: gemv_mma's segment step as is (the rows measured before; device only).
//   SPS = 2, 4 (variant a): a step's N segments each into their own partials (N independent IMMA -> epilogue
//   chains, summed at the end, instead of one FFMA chain through acc); the two rows' scales and biases of
//   the N segments in one 8- or 16-byte load per row (SPS = 1 loads 4 bytes per row and segment, which
//   ptxas merges only where it unrolls 4 segments); lanes without a digit column read the zero block (no
//   predicated loads, no register zeroing).
template <int SPS>
struct PsDigits {
  static_assert(SPS == 1 || SPS == 2 || SPS == 4, "1, 2 or 4 segments a step");
  static constexpr int VB = 64;
  static constexpr int STEP = SPS;
  static size_t x_bytes(int K) { return 16 + mma_x_bytes(K, VB); }
  struct View {
    const uint2* xd;
    const float *xe, *xsum;
  };
  __host__ __device__ static View view(const uint8_t* xs, int K) {
    const uint2* xd = reinterpret_cast<const uint2*>(xs + 16);
    const float* xe = reinterpret_cast<const float*>(xd + K / 8 * 3);
    return {xd, xe, xe + K / VB};
  }
  struct Lane {
    MmaLane<4, 2> L;
    uint32_t xoff, koff, sstride;  // byte offsets in xs: the lane's digit pair (k = 0), to k = 1, a segment
    __host__ __device__ Lane(int lane) : L(lane) {
      xoff = L.b_ok ? 16 + 16 * (6 * L.t + L.b_digit) : 0, koff = L.b_ok ? 48 : 0, sstride = L.b_ok ? 384 : 0;
    }
  };
#ifdef __CUDACC__
  __device__ static void stage(const float* x, int K, uint8_t* xs, int tid) {  // octet o by thread o (+ 256)
    const View v0 = view(xs, K);
    uint2* xd = const_cast<uint2*>(v0.xd);
    float* xe = const_cast<float*>(v0.xe);
    if (tid == 0) *reinterpret_cast<uint4*>(xs) = make_uint4(0u, 0u, 0u, 0u);
    const int octets = K / 8;
    for (int base = 0; base < octets; base += PS_CONSUMERS) {
      const int o = base + tid;
      float v[8];
      ps_load_octet(x, o, octets, v);
      mma_stage_octet<4, VB>(v, o, octets, xd, xe, const_cast<float*>(v0.xsum));
    }
  }
#endif
  template <int N, class Mma = PsMmaDevice>
  __host__ __device__ static void step(const Lane& ln, const uint8_t* item, int ls, int seg, const uint8_t* xs, int K,
                                       float (&acc)[2]) {
    const MmaLane<4, 2>& L = ln.L;
    const View xv = view(xs, K);
    const uint8_t* w0 = item + L.g * PS_CHUNK_W + L.t * 16 + ls * 64;
    const uint8_t* s0 = item + PS_ITEM_W + L.g * PS_CHUNK_G + ls * 4;
    const uint8_t* b0 = s0 + PS_ITEM_S;
    if constexpr (N == 1) {
#ifdef __CUDA_ARCH__
      MmaStage st;
      st.w[0][0] = *reinterpret_cast<const uint4*>(w0);
      st.w[0][1] = *reinterpret_cast<const uint4*>(w0 + 8 * PS_CHUNK_W);
      st.s[0][0] = *reinterpret_cast<const uint32_t*>(s0);
      st.s[0][1] = *reinterpret_cast<const uint32_t*>(s0 + 8 * PS_CHUNK_G);
      st.b[0][0] = *reinterpret_cast<const uint32_t*>(b0);
      st.b[0][1] = *reinterpret_cast<const uint32_t*>(b0 + 8 * PS_CHUNK_G);
      mma_segment<4, 2>(L, st, 0, seg, xv.xd, xv.xe, xv.xsum, acc);
#endif
    } else {
      uint32_t sw[2][N], bw[2][N];  // [row g / g + 8][segment]
      ps_words<N>(s0, sw[0]), ps_words<N>(s0 + 8 * PS_CHUNK_G, sw[1]);
      ps_words<N>(b0, bw[0]), ps_words<N>(b0 + 8 * PS_CHUNK_G, bw[1]);
      float part[N][2];
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const uint4 wa = *reinterpret_cast<const uint4*>(w0 + 64 * i);
        const uint4 wb = *reinterpret_cast<const uint4*>(w0 + 8 * PS_CHUNK_W + 64 * i);
        const uint8_t* xq = xs + ln.xoff + (seg + i) * ln.sstride;
        const uint4 q[2] = {*reinterpret_cast<const uint4*>(xq), *reinterpret_cast<const uint4*>(xq + ln.koff)};
        int cs[2][4] = {};
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          uint32_t a[4];
          mma_a_frag<4>(wa, wb, m, a);
          const uint2 b = mma_b_frag<4>(q[m & 1], m);
          Mma::s8(cs[mma_acc_of<4>(m)], a, b.x, b.y);
        }
        int c[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) c[e] = mma_combine<4>(cs, e);
        const uint32_t s2[2] = {sw[0][i], sw[1][i]}, b2[2] = {bw[0][i], bw[1][i]};
        part[i][0] = part[i][1] = 0.f;
        mma_columns<4, 2>(L, c, s2, b2, seg + i, xv.xe, xv.xsum, part[i]);
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {  // pairwise, fixed order
        float s = part[0][r] + part[1][r];
        if constexpr (N == 4) s += part[2][r] + part[3][r];
        acc[r] += s;
      }
    }
  }
};

// PsBf3 (variant b): x as three BF16 terms (t0 = bf16(x), t1 = bf16(x - t0), t2 = bf16(x - t0 - t1): x to
// ~24 bits) against the weights as BF16 (128 + q) on mma.sync m16n8k16 (fp32 accumulation). The products are
// exact (8 x 8 bits); the offset is folded into the bias term: s (sum (128 + q) x) + (b - 128 s) xsum_u =
// s (sum q x) + b xsum_u. Error: the fp32 accumulation of terms ~135 |x| (a 16x larger sum than q x alone)
// and the fp32 xsum: a few 1e-7 of max |y| expected (today's: ~1e-7).
// Fragments. Lane (g, c) reads 16 bytes of rows g and g + 8 at byte 16c of the segment (words m = 0..3: octet
// J = 4c + m of the segment, values 8J..8J+7; group half c / 2, as gemv_mma). Word m gives k-steps h = 0, 1:
// A registers a0 / a1 = rows g / g + 8 nibbles (2h, 2h + 4) at k positions (2c, 2c + 1), a2 / a3 nibbles
// (2h + 1, 2h + 5) at (2c + 8, 2c + 9): the bf16 pairs (w >> (8h [+ 4])) & 0x000F000F | 0x43004300 (one
// LOP3 each). N = 8 columns, n = 3 half + term (6 used): B of lane (g, c) is term g % 3 of its own k
// positions when g < 6 and g / 3 == c / 2, else zeros; D column n of a row sums its half's values times
// term n % 3. Staged: a 128-byte zero block (the lanes without a column read its unit at a bank position
// that no active lane of their quarter warp reads: ZERO_UNIT), then per octet and term one uint4 = (t(v0),
// t(v4) | t(v1), t(v5) | t(v2), t(v6) | t(v3), t(v7)), the B pairs of k-steps h = 0 (x, y) and h = 1 (z, w),
// at uint4 index 3 (16 seg + 4 m + c) + term (the active lanes of a quarter warp read distinct bank
// positions: with the zero unit, conflict-free; chain_lab_emu checks); then xsum per 64-value group
// (mma_stage_octet's sum order). Lane c's D columns 2c, 2c + 1 are scaled by their half's s and the
// term-0 columns (0, 3) add (b - 128 s) xsum.
struct PsBf3 {
  static constexpr int STEP = 4;
  static constexpr int ZERO = 128;  // bytes of the zero block
  static size_t x_bytes(int K) { return ZERO + size_t(K) * 6 + size_t(K) / 64 * 4; }
  __host__ __device__ static const float* xsum_of(const uint8_t* xs, int K) {
    return reinterpret_cast<const float*>(xs + ZERO + size_t(K) * 6);
  }
  // The zero unit of a lane without a column, by quarter warp: a bank position (16-byte unit mod 8) that
  // the quarter's active lanes read at neither parity of m (active units mod 8: quarter 0 {0,1,3,4} / {4,5,7,0},
  // quarter 1 {1,2,5,6}, quarter 2 {0,2,3,7} / {4,6,7,3}, quarter 3 none).
  __host__ __device__ static constexpr int zero_unit(int quarter) { return quarter == 0 ? 2 : quarter == 2 ? 1 : 0; }
  struct Lane {
    int g, c;
    uint32_t xoff, mstride, sstride;  // byte offsets in xs: the lane's uint4 at m = 0, per m, per segment
    int half[2];                      // the column's half (0 for n < 3; n >= 6: 1, its D is zero)
    uint32_t sel[2];                  // that half's BF16 in a scale / bias word (bf16_half_to_f32)
    float bmul[2];                    // 1 for a term-0 column (adds the bias term once per half), else 0
    __host__ __device__ Lane(int lane) : g(lane >> 2), c(lane & 3) {
      const bool b_ok = g < 6 && g / 3 == c / 2;
      xoff = b_ok ? ZERO + 16 * (3 * c + g % 3) : 16 * zero_unit(lane / 8);
      mstride = b_ok ? 16 * 12 : 0, sstride = b_ok ? 16 * 48 : 0;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int n = 2 * c + j;
        half[j] = n < 3 ? 0 : 1, sel[j] = n < 3 ? 0x1044u : 0x3244u;
        bmul[j] = n < 6 && n % 3 == 0 ? 1.f : 0.f;
      }
    }
  };
  // BF16 pair (128 + nibble 0, 128 + nibble 4) of w: exact. One LOP3 (written out: from C, ptxas split it
  // into two, an AND and an OR, both with immediates).
  __host__ __device__ static uint32_t a_pair(uint32_t w) {
#ifdef __CUDA_ARCH__
    uint32_t v;
    asm("lop3.b32 %0, %1, 0x000F000F, 0x43004300, 0xEA;" : "=r"(v) : "r"(w));
    return v;
#else
    return (w & 0x000F000Fu) | 0x43004300u;
#endif
  }
  // Octet o of x (values v) into the staged terms.
  __host__ __device__ static void store_octet(const float (&v)[8], int o, uint8_t* xs) {
    uint32_t t[3][8];  // the terms' BF16 bits
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      float r = v[k];
#pragma unroll
      for (int d = 0; d < 3; ++d) {
        const __nv_bfloat16 h = __float2bfloat16_rn(r);
        t[d][k] = __bfloat16_as_ushort(h);
        r -= __bfloat162float(h);  // exact
      }
    }
    uint4* xt = reinterpret_cast<uint4*>(xs + ZERO);
    const int seg = o / 16, J = o % 16;
#pragma unroll
    for (int d = 0; d < 3; ++d)
      xt[3 * (16 * seg + 4 * (J & 3) + J / 4) + d] =
          make_uint4(t[d][0] | t[d][4] << 16, t[d][1] | t[d][5] << 16, t[d][2] | t[d][6] << 16, t[d][3] | t[d][7] << 16);
  }
#ifdef __CUDACC__
  __device__ static void stage(const float* x, int K, uint8_t* xs, int tid) {
    float* xsum = const_cast<float*>(xsum_of(xs, K));
    if (tid < ZERO / 16) reinterpret_cast<uint4*>(xs)[tid] = make_uint4(0u, 0u, 0u, 0u);
    const int octets = K / 8;
    for (int base = 0; base < octets; base += PS_CONSUMERS) {  // uniform: whole warps shuffle
      const int o = base + tid;
      float v[8];
      ps_load_octet(x, o, octets, v);
      float s = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
#pragma unroll
      for (int off = 1; off < 8; off <<= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
      if (o >= octets) continue;
      store_octet(v, o, xs);
      if (o % 8 == 0) xsum[o / 8] = s;
    }
  }
#endif
  template <int N, class Mma = PsMmaDevice>
  __host__ __device__ static void step(const Lane& ln, const uint8_t* item, int ls, int seg, const uint8_t* xs, int K,
                                       float (&acc)[2]) {
    const float* xsum = xsum_of(xs, K);
    const uint8_t* w0 = item + ln.g * PS_CHUNK_W + ln.c * 16 + ls * 64;
    const uint8_t* s0 = item + PS_ITEM_W + ln.g * PS_CHUNK_G + ls * 4;
    const uint8_t* b0 = s0 + PS_ITEM_S;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const uint4 wa = *reinterpret_cast<const uint4*>(w0 + 64 * i);
      const uint4 wb = *reinterpret_cast<const uint4*>(w0 + 8 * PS_CHUNK_W + 64 * i);
      const uint32_t sw[2] = {*reinterpret_cast<const uint32_t*>(s0 + 4 * i),
                              *reinterpret_cast<const uint32_t*>(s0 + 8 * PS_CHUNK_G + 4 * i)};
      const uint32_t bw[2] = {*reinterpret_cast<const uint32_t*>(b0 + 4 * i),
                              *reinterpret_cast<const uint32_t*>(b0 + 8 * PS_CHUNK_G + 4 * i)};
      const uint8_t* xq = xs + ln.xoff + (seg + i) * ln.sstride;
      float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const uint4 q = *reinterpret_cast<const uint4*>(xq + m * ln.mstride);
        const uint32_t u0 = ps_word(wa, m), u1 = ps_word(wb, m);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t a[4] = {a_pair(u0 >> (8 * h)), a_pair(u1 >> (8 * h)), a_pair(u0 >> (8 * h + 4)),
                                 a_pair(u1 >> (8 * h + 4))};
          Mma::bf16(d, a, h ? q.z : q.x, h ? q.w : q.y);
        }
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float bx = xsum[2 * (seg + i) + ln.half[j]] * ln.bmul[j];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float s = bf16_half_to_f32(sw[r], ln.sel[j]), b = bf16_half_to_f32(bw[r], ln.sel[j]);
          acc[r] = fmaf(s, d[2 * r + j], acc[r]);
          acc[r] = fmaf(fmaf(-128.f, s, b), bx, acc[r]);
        }
      }
    }
  }
};

}  // namespace lily::cuda::lab
