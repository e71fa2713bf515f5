// Decode GEMV on integer tensor cores (one token), the shared engine of linear and the MoE decode kernels.
//
// Equation. For weight rows W[o, :] (MLX affine: w = s[o, g] * q + b[o, g], q of BITS = 4 or 8 bits) and
// one activation row x [K] (fp32), the K values are cut into blocks u of VB values that share one weight
// group inside one row segment (below). Per block, x is written exactly as x[j] = e_u * X[j] + r[j] with
// e_u a power of two, X[j] an integer |X| <= 2^22 and |r[j]| <= e_u / 2 = 2^-23 * max_u |x| (round to
// nearest). X[j] = D0 + 2^8 D1 + 2^16 D2 with signed 8-bit digits (balanced base 256), so
//   y[o] = sum_u s[o, g(u)] * e_u * sum_d 2^(8d) * (sum_{j in u} q[o, j] * D_d[j])  +  b[o, g(u)] * xsum_u
// where the inner sums are exact int32 products of mma.sync m16n8k32 u8 x s8 and xsum_u = sum_{j in u} x[j]
// (fp32, fixed order). Error ~1e-7 relative to max |x| of a block (the FP32 GEMV: ~1e-7 too). Inf in a
// block makes e_u NaN and NaN makes xsum_u NaN; either reaches y, as in the fp32 product.
//
// Layout. A row segment = the 64 bytes that 4 lanes read with one 16-byte load each (VALS = 128 values at
// 4 bits, 64 at 8 bits); a tile = 16 rows (the mma's M). Lane (g = lane / 4, t = lane % 4) loads bytes
// [16t, 16t + 16) of the segment in rows g and g + 8 (words 0-3: at 4 bits word s = octet 4t + s, an octet
// being 8 consecutive values; at 8 bits words 2s, 2s+1 = octet 2t + s) and runs MMAS mma k-steps on them:
//   4-bit: mma m = 2 * kind + p takes words 2p, 2p+1 (octets 4t+2p, 4t+2p+1): a0 / a1 = rows g / g+8 of
//          word 2p, a2 / a3 of word 2p+1, masked to the even nibbles (w & 0x0F0F0F0F: bytes = q, kind 0)
//          or the odd nibbles in place (w & 0xF0F0F0F0: bytes = 16 q, kind 1); the kind-0 and kind-1 mmas
//          chain into two int32 accumulators, c = 16 * c0 + c1 = 16 x the product (the 1/16 is folded into
//          the column weights), exact: |c| < 2^22;
//   8-bit: mma m takes octet 2t + m: a0 / a1 = its values 0-3 (word 2m) of rows g / g+8, a2 / a3 values
//          4-7; one accumulator.
// So B (32 x 8, column n = g) must hold digit d of the same values in the same k order: the staged digits
// are, per octet and digit, one uint2 = (values 0,2,4,6 | 1,3,5,7) at 4 bits or (values 0-3 | 4-7) at 8
// bits, stored in octet pairs (mma_xd_store) so that one 16-byte shared load gives a lane both octets of
// an mma, its (b0, b1) in adjacent words (4 bits: the kind-0 or kind-1 halves of octets 4t+2p, 4t+2p+1;
// 8 bits: one load serves both mmas).
// Columns: n = 3h + d for half h < NG of the segment (NG = VALS / VB = 2 when a weight group is half a
// segment, else 1) and digit d < 3; lanes t = 0,1 hold octets of half 0 and t = 2,3 of half 1, so B of
// lane (g, t) is digit g % 3 when g / 3 is its half (NG = 2) or g < 3 (NG = 1), zero otherwise. The
// accumulator c0, c1 (row g) / c2, c3 (row g + 8) of lane t are columns 2t, 2t + 1: after each segment the
// lane scales the columns it holds (fp32) into two row partials. Lanes t of a quad are summed by xor
// shuffles, then a tile's K-split warps through shared memory in ascending order: deterministic.
//
// Work. CTA = 8 warps = RT = 8 / ks tiles x ks K-parts; a pass of the CTA covers RT tiles; warp (tile tl,
// part k) takes segments [k * spw, (k+1) * spw) in units of MMA_SPU segments, double-buffered in registers
// (unit j+1's loads in flight while unit j computes). The Rows policy (linear, MoE up, MoE down) says
// which weight row each of the 16 A rows reads at a segment, and what a finished tile stores. The hot
// loop is kept lean (it is issue- and latency-bound at 2 CTAs per SM): a lane resolves its two rows once
// per pass (Rows::base) and a segment's addresses by adds (Rows::at); pass and unit are counters, not
// divisions; rows past the end and segments past a warp's range are clamped to real ones (loads are never
// predicated), their products are not stored / not computed; the column epilogue has no branches.
#pragma once
#include <cstring>

#include "linear_gemv.cuh"
#include "norms.cuh"

namespace lily::cuda {

constexpr int MMA_THREADS = 256, MMA_WARPS = MMA_THREADS / 32;
constexpr int MMA_SPU = 2;  // segments per unit (pipeline stage)
constexpr int MMA_MIN_CTAS = 2;  // CTAs per SM the registers are held to (3: ptxas spills 8-108 bytes)

template <int BITS>
struct MmaSeg {
  static constexpr int VALS = 512 / BITS;        // values per row segment (64 bytes)
  static constexpr int MMAS = BITS == 4 ? 4 : 2;  // mma k-steps per segment
  static constexpr int OCTETS = VALS / 8;
};

// Bytes of one CTA's staged x for K values in blocks of VB: digits (3 uint2 per octet), e_u and xsum_u.
__host__ __device__ constexpr size_t mma_x_bytes(int64_t K, int VB) { return size_t(K) / 8 * 24 + size_t(K) / VB * 8; }

// Where a row reads a segment: the row's 64-byte segment (4 uint4), its scale and bias at the segment's
// first group (NG consecutive BF16 when NG = 2). Always a real row of the matrix.
struct MmaRowRef {
  const uint4* w;
  const uint16_t* s;
  const uint16_t* b;
};

// Row `row` of an affine matrix with `wpr` 32-bit words and `gpr` groups per row, at segment 0, and the
// same row at segment seg (group_shift = log2 of the group size).
__device__ __forceinline__ MmaRowRef mma_affine_row(const uint32_t* w, const uint16_t* s, const uint16_t* b,
                                                    int64_t row, int wpr, int gpr) {
  return {reinterpret_cast<const uint4*>(w + row * wpr), s + row * gpr, b + row * gpr};
}
template <int BITS>
__device__ __forceinline__ MmaRowRef mma_affine_at(const MmaRowRef& r, int seg, int group_shift) {
  const int g = (seg * MmaSeg<BITS>::VALS) >> group_shift;
  return {r.w + seg * 4, r.s + g, r.b + g};
}

// One unit of a lane's loads: per segment, 16 bytes of rows g and g + 8 and their scale/bias bits
// (NG = 2: both halves' BF16 in one word, half 0 low).
struct MmaStage {
  uint4 w[MMA_SPU][2];
  uint32_t s[MMA_SPU][2], b[MMA_SPU][2];
};

__device__ __forceinline__ void mma_s8(int (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};"
               : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The A registers of mma m from a lane's 16 bytes of rows g (w0) and g + 8 (w1); see the layout above.
template <int BITS>
__host__ __device__ __forceinline__ void mma_a_frag(const uint4& w0, const uint4& w1, int m, uint32_t (&a)[4]) {
  auto word = [](const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; };
  if constexpr (BITS == 4) {
    const uint32_t mask = m < 2 ? 0x0F0F0F0Fu : 0xF0F0F0F0u;
    const int p = m & 1;
    a[0] = word(w0, 2 * p) & mask, a[1] = word(w1, 2 * p) & mask;
    a[2] = word(w0, 2 * p + 1) & mask, a[3] = word(w1, 2 * p + 1) & mask;
  } else {
    a[0] = word(w0, 2 * m), a[2] = word(w0, 2 * m + 1);
    a[1] = word(w1, 2 * m), a[3] = word(w1, 2 * m + 1);
  }
}

// Staged digits, in octet pairs: the 16 bytes of digit d of octets 2P, 2P+1 are words [4 (3P + d), +4),
// ordered so that each mma's (b0, b1) are adjacent words: at 4 bits (2P.x, 2P+1.x, 2P.y, 2P+1.y) = the
// even-value words then the odd-value words; at 8 bits (2P.x, 2P.y, 2P+1.x, 2P+1.y).
template <int BITS>
__host__ __device__ __forceinline__ void mma_xd_store(uint32_t* xw, int o, int d, uint2 v) {
  uint32_t* q = xw + 4 * (3 * (o >> 1) + d);
  if constexpr (BITS == 4) q[o & 1] = v.x, q[2 + (o & 1)] = v.y;
  else q[2 * (o & 1)] = v.x, q[2 * (o & 1) + 1] = v.y;
}

// The 16-byte digit pair that lane t's mmas 2k, 2k+1 (4 bits) or both mmas (8 bits, k = 0) of segment seg
// read: octets mma_pair_octet, +1 of the segment, digit d.
template <int BITS>
__host__ __device__ constexpr int mma_pair_octet(int t, int k) {
  return BITS == 4 ? 4 * t + 2 * k : 2 * t;
}
template <int BITS>
__host__ __device__ __forceinline__ uint4 mma_xd_pair(const uint32_t* xw, int seg, int t, int k, int d) {
  const int pair = seg * (MmaSeg<BITS>::OCTETS / 2) + (mma_pair_octet<BITS>(t, k) >> 1);
  return *reinterpret_cast<const uint4*>(xw + 4 * (3 * pair + d));
}

// The B registers of mma m from its digit pair q (mma_xd_pair).
template <int BITS>
__host__ __device__ __forceinline__ uint2 mma_b_frag(const uint4& q, int m) {
  return BITS == 4 ? (m < 2 ? make_uint2(q.x, q.y) : make_uint2(q.z, q.w))
                   : (m == 0 ? make_uint2(q.x, q.y) : make_uint2(q.z, q.w));
}

// The accumulator an mma chains into, and a segment's product from the accumulators (x16 at 4 bits).
template <int BITS>
__host__ __device__ constexpr int mma_acc_of(int m) {
  return BITS == 4 ? m >> 1 : 0;
}
template <int BITS>
__host__ __device__ __forceinline__ int mma_combine(const int (*acc)[4], int e) {
  return BITS == 4 ? acc[0][e] * 16 + acc[1][e] : acc[0][e];
}

// The exponent of a block: e = 2^(E - 22) with max|x| < 2^E, so |x / e| <= 2^22; E is clamped to
// [-104, 128] (blocks below 2^-104 round towards zero). Returns 1/e; e itself through `e`. A block with
// Inf or NaN gets e = NaN (its digits are then meaningless, and the NaN reaches the output).
__host__ __device__ __forceinline__ float mma_block_scale(float maxabs, float& e) {
  uint32_t bits;
  memcpy(&bits, &maxabs, 4);
  const int eb = int(bits >> 23);
  int E = eb - 126;
  E = E < -104 ? -104 : E > 128 ? 128 : E;
  const uint32_t inv_bits = uint32_t(127 + 22 - E) << 23, e_bits = uint32_t(127 - 22 + E) << 23;
  float inv;
  memcpy(&inv, &inv_bits, 4);
  memcpy(&e, &e_bits, 4);
  if (eb == 255) e = NAN;
  return inv;
}

// Digits of one octet v[8] scaled by inv: out[d] = (b0, b1) in the B order of BITS (layout above).
// Exact: X = rint(v * inv) = D0 + 2^8 D1 + 2^16 D2, each D the signed byte stored.
template <int BITS>
__host__ __device__ __forceinline__ void mma_octet_digits(const float (&v)[8], float inv, uint2 (&out)[3]) {
  uint32_t byte[3][8];
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const int X = int(rintf(v[k] * inv));   // |X| <= 2^22 (NaN/Inf: any value, e = NaN)
    const int d0 = int(int8_t(X & 0xFF));
    const int Y = X - d0;                   // multiple of 2^8
    const int d1 = int(int8_t((Y >> 8) & 0xFF));
    const int Z = Y - d1 * 256;             // multiple of 2^16: D2 = Z >> 16, |D2| <= 64
    byte[0][k] = uint32_t(X) & 0xFFu, byte[1][k] = (uint32_t(Y) >> 8) & 0xFFu, byte[2][k] = (uint32_t(Z) >> 16) & 0xFFu;
  }
#pragma unroll
  for (int d = 0; d < 3; ++d) {
    const uint32_t* q = byte[d];
    if constexpr (BITS == 4) {
      out[d].x = q[0] | q[2] << 8 | q[4] << 16 | q[6] << 24;
      out[d].y = q[1] | q[3] << 8 | q[5] << 16 | q[7] << 24;
    } else {
      out[d].x = q[0] | q[1] << 8 | q[2] << 16 | q[3] << 24;
      out[d].y = q[4] | q[5] << 8 | q[6] << 16 | q[7] << 24;
    }
  }
}

// Stages octet o of x (its 8 values v) into a CTA's shared memory: digits xd [K/8][3], and for the
// first octet of a block its scale e_u (xe [K/VB]) and sum (xsum [K/VB]). A block's VB/8 octets are
// consecutive lanes of one warp (VB/8 in {4, 8, 16}), so its max and sum are xor-shuffle trees (every
// lane gets the same, fixed-order sum): every lane of the warp must call it, those with o >= octets
// (nothing to store) with zeros in v.
template <int BITS, int VB>
__device__ __forceinline__ void mma_stage_octet(const float (&v)[8], int o, int octets, uint2* xd, float* xe,
                                                float* xsum) {
  constexpr int OPB = VB / 8;
  static_assert(OPB == 4 || OPB == 8 || OPB == 16, "a block spans 4, 8 or 16 octets");
  float m = 0.f, s = 0.f;
#pragma unroll
  for (int k = 0; k < 8; ++k) m = fmaxf(m, fabsf(v[k]));
  s = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
#pragma unroll
  for (int off = 1; off < OPB; off <<= 1) {
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    s += __shfl_xor_sync(0xffffffffu, s, off);
  }
  if (o >= octets) return;
  float e;
  const float inv = mma_block_scale(m, e);
  uint2 dg[3];
  mma_octet_digits<BITS>(v, inv, dg);
#pragma unroll
  for (int d = 0; d < 3; ++d) mma_xd_store<BITS>(reinterpret_cast<uint32_t*>(xd), o, d, dg[d]);
  if (o % OPB == 0) xe[o / OPB] = e, xsum[o / OPB] = s;
}

// Stages x [K] into a CTA's shared memory (mma_stage_octet). x_at(o) is the address of octet o (8
// consecutive floats, 16-byte aligned). Each thread takes one octet per round. The loads of NR rounds
// (MMA_STAGE_ROUNDS, or the multi-token kernel's more for its T rows) are issued together (one memory
// latency for K <= NR * 8 * blockDim.x: with 3, the model's 2,048 to 4,608 values), then the rounds are
// converted in order. Every thread must call it; the caller synchronises afterwards.
constexpr int MMA_STAGE_ROUNDS = 3;
template <int BITS, int VB, class XAt, int NR = MMA_STAGE_ROUNDS>
__device__ __forceinline__ void mma_stage_x(const XAt& x_at, int K, uint2* xd, float* xe, float* xsum) {
  const int octets = K / 8;
  for (int base = 0; base < octets; base += NR * blockDim.x) {  // uniform over the CTA: full warps shuffle
    float4 raw[NR][2];
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      const int o = base + r * int(blockDim.x) + int(threadIdx.x);
      raw[r][0] = raw[r][1] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (o < octets) {
        const float4* p = reinterpret_cast<const float4*>(x_at(o));
        raw[r][0] = p[0], raw[r][1] = p[1];
      }
    }
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      if (base + r * int(blockDim.x) >= octets) break;  // uniform
      const float4 a = raw[r][0], b = raw[r][1];
      const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
      mma_stage_octet<BITS, VB>(v, base + r * int(blockDim.x) + int(threadIdx.x), octets, xd, xe, xsum);
    }
  }
}

// Stages h = rms_norm(x) * w (x [K] the residual row, w [K]; 16-byte aligned) with a CTA of MMA_THREADS
// threads where that is rms_norm's own thread mapping for D = K (norm_threads(K) = MMA_THREADS: 1024 <
// K) and one octet a thread covers the row (K <= MMA_NORM_MAX_COLS). The staged values are the h that
// rms_norm, add_rms_norm and grid_tail_rms_norm write, bit for bit: their sum of squares in their order
// (thread t adds sq4 of float4s t, t + MMA_THREADS, ... of x, then the same block_sum), their
// s = 1 / sqrt(ss / K + eps), and (x * s) * w as they store it (norm_scale4).
// One load of x and w: a thread loads its octet of both and shares the squares of its two float4s of x
// through shared memory (sq4 of the same float4 gives the same bits in any thread). w, a constant weight,
// is read before wait() (the PDL wait, after which x may be read): ptxas then issues its loads with x's
// rather than sinking them towards their use (moe_up_mma_kernel, whose x is two launches old and which
// stages it before its own wait, passes a no-op). Every thread must call it; the caller synchronises
// after.
constexpr int MMA_NORM_MAX_COLS = 8 * MMA_THREADS;
template <int BITS, int VB, class Wait>
__device__ __forceinline__ void mma_stage_normed_x(const float* x, const NormIn& n, int K, uint2* xd, float* xe,
                                                   float* xsum, const Wait& wait, float* s_out = nullptr,
                                                   const float* add = nullptr) {
  __shared__ float red[32], sq[MMA_NORM_MAX_COLS / 4];  // sq: sq4 of each float4 of x
  const int tid = int(threadIdx.x), octets = K / 8, o = min(tid, octets - 1);  // past the row: a real octet
  const float4* w4 = reinterpret_cast<const float4*>(n.w) + 2 * o;
  const float4 b[2] = {__ldg(w4), __ldg(w4 + 1)};
  wait();
  const float4* x4 = reinterpret_cast<const float4*>(x) + 2 * o;
  float4 a[2] = {x4[0], x4[1]};
  if (add != nullptr) {  // the row is x + add (early routing: the residual and the output projection's O a)
    const float4* d4 = reinterpret_cast<const float4*>(add) + 2 * o;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const float4 d = d4[k];
      a[k] = make_float4(a[k].x + d.x, a[k].y + d.y, a[k].z + d.z, a[k].w + d.w);
    }
  }
  if (tid < octets) sq[2 * tid] = sq4(a[0]), sq[2 * tid + 1] = sq4(a[1]);
  __syncthreads();
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < MMA_NORM_MAX_COLS / 4 / MMA_THREADS; ++j)  // float4s tid, tid + MMA_THREADS (< K / 4)
    if (tid + j * MMA_THREADS < K / 4) ss += sq[tid + j * MMA_THREADS];
  ss = block_sum(ss, red);
  const float s = 1.f / sqrtf(ss / float(K) + n.eps);
  if (s_out != nullptr && tid == 0) *s_out = s;  // the norm's 1 / rms (moe_up's early routing weights)
  const float4 h0 = norm_scale4(a[0], s, b[0]), h1 = norm_scale4(a[1], s, b[1]);
  const float v[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
  mma_stage_octet<BITS, VB>(v, tid, octets, xd, xe, xsum);
}

// Per-lane constants of the column epilogue: the lane's B digit, and per accumulator column its half h,
// its weight 2^(8d) (times 1/16 at 4 bits, see mma_combine) and whether it adds the bias term (digit 0).
// Columns past 3 * NG are not digits: their h is clamped to a real half and their weights are 0, so the
// epilogue runs the same instructions on every lane (adding exact zeros for finite weights).
template <int BITS, int NG>
struct MmaLane {
  int g, t;
  bool b_ok;       // this lane's B is a digit (else zero)
  int b_digit;     // which
  int h[2];        // the column's half
  uint32_t sel[2];  // byte_perm selector moving the half's BF16 into the high half of a word
  float dpow[2];    // the column's digit weight, 0 for no column
  float bmul[2];    // 1 for a digit-0 column, else 0
  __host__ __device__ MmaLane(int lane) : g(lane >> 2), t(lane & 3) {
    b_ok = NG == 2 ? g / 3 == t / 2 && g < 6 : g < 3;
    b_digit = g % 3;
    const float unit = BITS == 4 ? 1.f / 16.f : 1.f;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int n = 2 * t + j;
      const bool col = n < 3 * NG;
      h[j] = col ? n / 3 : NG - 1;
      sel[j] = h[j] == 0 ? 0x1044u : 0x3244u;
      dpow[j] = !col ? 0.f : n % 3 == 0 ? unit : n % 3 == 1 ? 256.f * unit : 65536.f * unit;
      bmul[j] = col && n % 3 == 0 ? 1.f : 0.f;
    }
  }
};

// The BF16 that byte_perm selector sel (MmaLane::sel) picks from w, as a float.
__host__ __device__ __forceinline__ float bf16_half_to_f32(uint32_t w, uint32_t sel) {
#ifdef __CUDA_ARCH__
  const uint32_t bits = __byte_perm(w, 0u, sel);
#else
  const uint32_t bits = sel == 0x1044u ? w << 16 : w & 0xFFFF0000u;
#endif
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

// The lane's share of a finished segment: its accumulator columns (c[j] row g, c[2 + j] row g + 8) times
// their digit weight, e_u and the row's scale, plus b * xsum_u for digit-0 columns, into acc[0] (row g),
// acc[1] (row g+8). s_bits, b_bits: the rows' scale and bias BF16 (both halves when NG = 2, half 0 low).
template <int BITS, int NG>
__host__ __device__ __forceinline__ void mma_columns(const MmaLane<BITS, NG>& L, const int (&c)[4],
                                                     const uint32_t (&s_bits)[2], const uint32_t (&b_bits)[2],
                                                     int seg, const float* xe, const float* xsum, float (&acc)[2]) {
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int u = seg * NG + L.h[j];
    const float coef = xe[u] * L.dpow[j], bx = xsum[u] * L.bmul[j];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      acc[r] = fmaf(bf16_half_to_f32(s_bits[r], L.sel[j]), coef * float(c[2 * r + j]), acc[r]);
      acc[r] = fmaf(bf16_half_to_f32(b_bits[r], L.sel[j]), bx, acc[r]);
    }
  }
}

// One segment of one unit: MMAS mmas chained into mma_acc_of's accumulators, then mma_columns.
template <int BITS, int NG>
__device__ __forceinline__ void mma_segment(const MmaLane<BITS, NG>& L, const MmaStage& st, int i, int seg,
                                            const uint2* xd, const float* xe, const float* xsum, float (&acc)[2]) {
  using S = MmaSeg<BITS>;
  constexpr int ACCS = BITS == 4 ? 2 : 1;
  int cs[ACCS][4] = {};
  uint4 q[BITS == 4 ? 2 : 1];  // the lane's digit pairs (zero for lanes without a digit column)
#pragma unroll
  for (int k = 0; k < (BITS == 4 ? 2 : 1); ++k)
    q[k] = L.b_ok ? mma_xd_pair<BITS>(reinterpret_cast<const uint32_t*>(xd), seg, L.t, k, L.b_digit)
                  : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
  for (int m = 0; m < S::MMAS; ++m) {
    uint32_t a[4];
    mma_a_frag<BITS>(st.w[i][0], st.w[i][1], m, a);
    const uint2 b = mma_b_frag<BITS>(q[BITS == 4 ? (m & 1) : 0], m);
    mma_s8(cs[mma_acc_of<BITS>(m)], a, b.x, b.y);
  }
  int c[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) c[e] = mma_combine<BITS>(cs, e);
  mma_columns<BITS, NG>(L, c, st.s[i], st.b[i], seg, xe, xsum, acc);
}

// The segment step of mma_gemv_body (a policy, so that benchmarks/gemv_lab.cu can swap in ablations).
template <int BITS, int NG>
struct MmaSegmentOp {
  static __device__ __forceinline__ void run(const MmaLane<BITS, NG>& L, const MmaStage& st, int i, int seg,
                                             const uint2* xd, const float* xe, const float* xsum, float (&acc)[2]) {
    mma_segment<BITS, NG>(L, st, i, seg, xd, xe, xsum, acc);
  }
};

// Loads a segment of the lane's rows g (r0) and g + 8 (r1) into unit slot i.
template <int NG>
__device__ __forceinline__ void mma_load(MmaStage& st, int i, const MmaRowRef& r0, const MmaRowRef& r1, int t) {
  const MmaRowRef* ref[2] = {&r0, &r1};
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const MmaRowRef& R = *ref[r];
    st.w[i][r] = ld_stream(R.w + t);
    if constexpr (NG == 2) {
      st.s[i][r] = __ldg(reinterpret_cast<const unsigned*>(R.s));
      st.b[i][r] = __ldg(reinterpret_cast<const unsigned*>(R.b));
    } else {
      st.s[i][r] = __ldg(reinterpret_cast<const unsigned short*>(R.s));
      st.b[i][r] = __ldg(reinterpret_cast<const unsigned short*>(R.b));
    }
  }
}

// How a CTA's 8 warps split the work: ks K-parts per tile (1, 2, 4 or 8), RT = 8 / ks tiles per pass,
// spw segments per K-part, upp units per pass.
struct MmaSplit {
  int ks, rt, spw, upp;
  __host__ __device__ MmaSplit(int ks_, int S) : ks(ks_), rt(MMA_WARPS / ks_), spw((S + ks_ - 1) / ks_) {
    upp = (spw + MMA_SPU - 1) / MMA_SPU;
  }
};

// Tokens of a multi-token body (NT > 1, gemv_mma_tokens.cuh): n <= NT tokens staged one after the other,
// token k's digits at xd + k * xd_stride (uint2), its e_u and xsum_u at xe, xsum + k * xe_stride.
struct MmaTokens {
  int n, xd_stride, xe_stride;
};

// The GEMV body: rows is the policy (see MmaLinearRows), tiles the tile count, S the segments per
// (virtual) row; passes over tiles are strided by gridDim.x. before() runs before the loads of units 0
// and 1 are issued (what the row addresses need, e.g. the router's expert ids, made visible to the
// CTA), after() between those loads and the first compute: it must stage x into xd, xe, xsum (unless
// before() did: moe_up_mma_kernel) and synchronise the CTA, so the staging (and the wait on the previous
// kernel) overlaps the weights' memory latency.
// Rows: `Ref base(int tile, int r)` for tile < tiles and any r < 16 (rows past the end clamped to a real
// row), `MmaRowRef at(const Ref&, int seg)`, `finish(tile, r, row_sum)` (skips rows past the end); with
// NT > 1 `finish_token(tile, r, k, row_sum)` for token k instead.
// NT > 1 (tok.n tokens): Segment::run takes acc[NT][2] and tok; each token's sums take the one-token
// order (quad xor shuffles, K-parts ascending), so a token's row equals the NT = 1 body's bit for bit.
template <int BITS, int NG, class Rows, class Before, class After, class Segment = MmaSegmentOp<BITS, NG>,
          int NT = 1>
__device__ __forceinline__ void mma_gemv_body(const Rows& rows, int tiles, int S, MmaSplit sp, const uint2* xd,
                                              const float* xe, const float* xsum, const Before& before,
                                              const After& after, const MmaTokens& tok = MmaTokens{1, 0, 0}) {
  __shared__ float red[2][MMA_WARPS][NT * 16];
  const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31;
  const int tl = warp / sp.ks, kp = warp % sp.ks;
  const int seg0 = kp * sp.spw, seg1 = min(S, seg0 + sp.spw), seg_last = max(seg1 - 1, 0);
  const int passes = (tiles + sp.rt - 1) / sp.rt;
  const int my_passes = (passes - int(blockIdx.x) + int(gridDim.x) - 1) / int(gridDim.x);
  const int units = max(my_passes, 0) * sp.upp;
  const MmaLane<BITS, NG> L(lane);
  float acc[NT][2] = {};

  // loads: pass lpass, unit lu of it; the lane's two rows resolved once per pass
  int lpass = int(blockIdx.x), lu = 0;
  typename Rows::Ref ref0, ref1;
  auto resolve = [&](int pass) {
    const int tile = min(pass * sp.rt + tl, tiles - 1);
    ref0 = rows.base(tile, L.g), ref1 = rows.base(tile, L.g + 8);
  };
  auto load = [&](MmaStage& st, int) {
    const int first = seg0 + lu * MMA_SPU;
#pragma unroll
    for (int i = 0; i < MMA_SPU; ++i) {
      const int seg = min(first + i, seg_last);
      mma_load<NG>(st, i, rows.at(ref0, seg), rows.at(ref1, seg), L.t);
    }
    if (++lu < sp.upp) return;
    lu = 0, lpass += int(gridDim.x);
    if (lpass < passes) resolve(lpass);
  };
  // computes: pass cpass, unit cu; pass sums double-buffered in red by pass parity
  int cpass = int(blockIdx.x), cu = 0, parity = 0;
  auto compute = [&](const MmaStage& st, int) {
    const int first = seg0 + cu * MMA_SPU;
#pragma unroll
    for (int i = 0; i < MMA_SPU; ++i)
      if (first + i < seg1) {  // warp-uniform
        if constexpr (NT == 1) Segment::run(L, st, i, first + i, xd, xe, xsum, acc[0]);
        else Segment::run(L, st, i, first + i, xd, xe, xsum, acc, tok);
      }
    if (++cu < sp.upp) return;
    // end of a pass: quad sum, then the tile's K-parts in ascending order
#pragma unroll
    for (int k = 0; k < NT; ++k)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        acc[k][r] += __shfl_xor_sync(0xffffffffu, acc[k][r], 1);
        acc[k][r] += __shfl_xor_sync(0xffffffffu, acc[k][r], 2);
      }
    float(*rd)[NT * 16] = red[parity];
    if (L.t == 0) {
#pragma unroll
      for (int k = 0; k < NT; ++k) rd[warp][16 * k + L.g] = acc[k][0], rd[warp][16 * k + L.g + 8] = acc[k][1];
    }
#pragma unroll
    for (int k = 0; k < NT; ++k) acc[k][0] = acc[k][1] = 0.f;
    __syncthreads();
    const int tid = int(threadIdx.x);
    if constexpr (NT == 1) {
      if (tid < sp.rt * 16) {
        const int t2 = tid / 16, r = tid % 16, tile = cpass * sp.rt + t2;
        auto row_sum = [&](int rr) {
          float v = 0.f;
          for (int k = 0; k < sp.ks; ++k) v += rd[t2 * sp.ks + k][rr];
          return v;
        };
        if (tile < tiles) rows.finish(tile, r, row_sum);
      }
    } else {
      for (int i = tid; i < sp.rt * NT * 16; i += MMA_THREADS) {  // (tile, token, row): the same sums as NT = 1
        const int t2 = i / (NT * 16), k = i / 16 % NT, r = i % 16, tile = cpass * sp.rt + t2;
        auto row_sum = [&](int rr) {
          float v = 0.f;
          for (int kk = 0; kk < sp.ks; ++kk) v += rd[t2 * sp.ks + kk][16 * k + rr];
          return v;
        };
        if (tile < tiles && k < tok.n) rows.finish_token(tile, r, k, row_sum);
      }
    }
    cu = 0, cpass += int(gridDim.x), parity ^= 1;
  };
  // Units 0 and 1 are both requested before after() (which waits on the previous kernel and stages
  // x), then unit j + 2 as soon as unit j is computed: two units in flight throughout.
  MmaStage a, b;
  before();
  if (units > 0) {
    resolve(lpass);
    load(a, 0);
  }
  if (units > 1) load(b, 1);
  after();
  for (int j = 0; j < units; j += 2) {
    compute(a, j);
    if (j + 2 < units) load(a, j + 2);
    if (j + 1 >= units) break;
    compute(b, j + 1);
    if (j + 3 < units) load(b, j + 3);
  }
}

// ---- linear ------------------------------------------------------------------------------------------

// Rows of one matrix: tile t, row r is weight row 16 t + r; y[o] = the row's sum.
template <int BITS>
struct MmaLinearRows {
  const uint32_t* w;  // [rows, cols*BITS/32]
  const uint16_t* s;  // [rows, cols/group] BF16
  const uint16_t* b;
  float* y;           // [rows]
  int rows, wpr, gpr, group_shift;  // words and groups per row, log2(group_size)
  bool accumulate;    // y[o] += the row's sum (else y[o] = it)
  bool wait_late;     // the PDL wait comes before this store, not before x is staged (MmaLinearParams)
  using Ref = MmaRowRef;
  __device__ __forceinline__ Ref base(int tile, int r) const {
    return mma_affine_row(w, s, b, min(tile * 16 + r, rows - 1), wpr, gpr);
  }
  __device__ __forceinline__ MmaRowRef at(const Ref& ref, int seg) const {
    return mma_affine_at<BITS>(ref, seg, group_shift);
  }
  template <class Sum>
  __device__ __forceinline__ void finish(int tile, int r, const Sum& row_sum) const {
    const int o = tile * 16 + r;
    if (wait_late) {  // the CTA triggers once a thread has waited (the next kernel may then start)
      pdl_wait();
      pdl_trigger();
    }
    if (o < rows) y[o] = accumulate ? y[o] + row_sum(r) : row_sum(r);
  }
  // Token k of a multi-token product: y [tokens, rows], row-major.
  template <class Sum>
  __device__ __forceinline__ void finish_token(int tile, int r, int k, const Sum& row_sum) const {
    const int o = tile * 16 + r;
    float* yk = y + int64_t(k) * rows;
    if (o < rows) yk[o] = accumulate ? yk[o] + row_sum(r) : row_sum(r);
  }
};

struct MmaLinearParams {
  const uint32_t* w;
  const uint16_t* scales;
  const uint16_t* biases;
  const float* x;  // [cols] F32, 16-byte aligned (with norm_in: the residual row)
  float* y;        // [rows]
  int rows, cols, group_shift, ks;
  bool accumulate;  // y += W x (y is the residual row: ops::linear_add), else y = W x
  NormTail tail;    // tail.done != nullptr (accumulate): then tail.y = rms_norm(y) * tail.w
  NormIn norm_in;   // the NORM_IN instance's: y = W (rms_norm(x) * norm_in.w), mma_stage_normed_x's conditions
  // x was written two or more launches back (the output projection after router_early_kernel, which reads y):
  // x is staged and the whole product computed before the PDL wait, which then only guards the stores into y
  bool wait_late;
};

// y = W x for one token (T = 1), or accumulating y += W x (ops::linear_add), and with a tail then the next
// RMSNorm of y by the grid's last CTA (ops::linear_add_rms_norm). NORM_IN (p.norm_in set): y = W
// (rms_norm(x) * w), every CTA normalising x while it stages it (ops::linear_rms_normed; its own
// instance, so the plain GEMV's code is untouched).
// Grid: CTAs over passes (launcher: mma_plan). The weights of unit 0 are requested before the wait on the
// previous kernel and before x is staged.
template <int BITS, int NG, bool NORM_IN = false>
__global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_CTAS) linear_gemv_mma_kernel(const MmaLinearParams p) {
  using S = MmaSeg<BITS>;
  constexpr int VB = S::VALS / NG;
  extern __shared__ uint2 xd[];  // [cols/8][3] digits, then xe, xsum [cols/VB]
  float* xe = reinterpret_cast<float*>(xd + p.cols / 8 * 3);
  float* xsum = xe + p.cols / VB;
  const int Sg = p.cols / S::VALS;
  const bool late = !NORM_IN && p.wait_late;
  const MmaLinearRows<BITS> rows{p.w, p.scales, p.biases, p.y, p.rows, p.cols * BITS / 32,
                                 p.cols >> p.group_shift, p.group_shift, p.accumulate, late};
  auto stage = [&] {  // the weights of unit 0 are on their way meanwhile
    auto wait = [] {
      pdl_wait();
      pdl_trigger();
    };
    if constexpr (NORM_IN) {
      mma_stage_normed_x<BITS, VB>(p.x, p.norm_in, p.cols, xd, xe, xsum, wait);
    } else {
      if (!late) wait();
      mma_stage_x<BITS, VB>([&](int o) { return p.x + 8 * o; }, p.cols, xd, xe, xsum);
    }
    __syncthreads();
  };
  mma_gemv_body<BITS, NG>(rows, (p.rows + 15) / 16, Sg, MmaSplit(p.ks, Sg), xd, xe, xsum, [] {}, stage);
  if (late) {  // every thread waits before the CTA triggers: the next kernel may read what this one's
    pdl_wait();  // predecessor wrote (the rule in docs/cuda.md)
    pdl_trigger();
  }
  if (p.tail.done != nullptr) grid_tail_rms_norm(p.tail);
}

}  // namespace lily::cuda
