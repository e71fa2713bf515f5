// Decode GEMV on tensor cores over MLX-affine weights (4 or 8 bits, BF16 scales/biases):
//   y[t, o] = sum_g scale[o, g] * (sum_{j in g} q[o, j] x[t, j]) + bias[o, g] * X[t, g],
//   X[t, g] = sum_{j in g} x[t, j]
// the same algebra as linear_gemv.cuh, with the inner sums on mma.sync m16n8k16 (f16 in, f32
// accumulate) instead of FP32 FMAs: the FP32 kernel spends ~8 issue slots per weight byte on
// decoding and FMAs and tops out near 1.5 TB/s; here a 32-bit word of 4-bit weights costs one shift,
// four LOP3 and four HSUB2 and the products run on the tensor cores.
// Exactness: q (or 16q) is an exact f16 (magic 0x6400 = 1024 + q, minus 1024); x is carried as an
// f16 pair hi + lo of x * 2^-e[t] (e[t]: a per-token power of two that puts max|x| near 2^14), so
// the products keep ~22 bits of x and sum in f32: ~1e-6 relative, like the FP32 kernel.
// Shapes: W [rows, cols*BITS/32] U32, scales/biases [rows, cols/group] BF16, x [T, cols] F32
// (T <= NT <= 4), y [T, rows] F32. Needs group % VQ == 0 (VQ = 256/BITS values = 32 bytes per row).
// Mapping: CTA = 8 warps; a tile is 16 rows; warp w takes groups w, w+8, ... of every tile (split K),
// lane (g = lane/4, t = lane%4) loads 8 bytes of rows g and g+8 per 32-byte step (a quad reads one
// 32-byte sector per row). The mma's k order is a permutation of the columns (the nibble pairs the
// LOP3s produce); x is staged in shared memory in that order as B fragments, columns n = 2*token +
// {hi, lo}, so lane t ends with token t's sums. Warps' partial sums meet in shared memory in a fixed
// order: deterministic.
#pragma once
#include <cuda_fp16.h>

#include "linear_common.cuh"

namespace lily::cuda {

constexpr int TC_WARPS = 8;
constexpr int TC_THREADS = TC_WARPS * 32;
constexpr int TC_TILE_ROWS = 16;

template <int BITS>
struct TcShape {
  static constexpr int VQ = 256 / BITS;  // values per 32-byte step of a row
  static constexpr int MPS = 16 / BITS;  // mma per step (each takes 4 values of a lane's 2 rows)
};

__device__ __forceinline__ uint32_t lop3_or_and(uint32_t a, uint32_t mask, uint32_t magic) {
  uint32_t r;  // (a & mask) | magic
  asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(a), "r"(mask), "r"(magic));
  return r;
}

// f16 pair minus (1024, 1024): exact for the magic-number encodings.
__device__ __forceinline__ uint32_t sub1024(uint32_t v) {
  const __half2 r = __hsub2(*reinterpret_cast<const __half2*>(&v), __halves2half2(__ushort_as_half(0x6400),
                                                                                   __ushort_as_half(0x6400)));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// The two A pairs of mma m from word w. 4 bits: m = h selects nibbles (2h, 2h+4) -> q and
// (2h+1, 2h+5) -> 16q (the mask keeps the nibble in place; B carries x/16 there). 8 bits:
// bytes (0, 2) and (1, 3).
template <int BITS>
__device__ __forceinline__ void tc_decode(uint32_t w, int h, uint32_t& lo, uint32_t& hi) {
  if constexpr (BITS == 4) {
    const uint32_t v = h ? w >> 8 : w;
    lo = sub1024(lop3_or_and(v, 0x000F000Fu, 0x64006400u));
    hi = sub1024(lop3_or_and(v, 0x00F000F0u, 0x64006400u));
  } else {
    lo = sub1024(lop3_or_and(w, 0x00FF00FFu, 0x64006400u));
    hi = sub1024(lop3_or_and(w >> 8, 0x00FF00FFu, 0x64006400u));
  }
}

__device__ __forceinline__ void mma_f16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                        uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The activations of one CTA: token t's virtual column c (of cols) sits at
// x + t*tok_stride + (c / seg)*seg_stride + c % seg (seg = cols for a plain row; the MoE down
// product concatenates K+1 slot rows of act). x, seg and seg_stride are 16-byte multiples.
struct TcX {
  const float* x;
  int64_t tok_stride, seg_stride;
  int seg, cols, T, group_size;
  __device__ __forceinline__ float4 quad(int t, int c) const {  // columns c..c+3, c % 4 == 0
    return *reinterpret_cast<const float4*>(x + t * tok_stride + (c / seg) * seg_stride + c % seg);
  }
};

// Shared memory of one CTA: B fragments [steps, MPS, 2*NT, 4 lanes] uint2, then the group sums
// X [NT, groups], the quad sums [NT, cols/4] and the per-token scales 2^e [NT] (floats).
template <int BITS, int NT>
__host__ __device__ constexpr size_t gemv_tc_smem_bytes(int cols, int group_size) {
  return size_t(cols / TcShape<BITS>::VQ) * TcShape<BITS>::MPS * 2 * NT * 4 * 8 +
         size_t(NT) * (cols / group_size + cols / 4 + 1) * 4;
}

// The staged activations in shared memory.
template <int NT>
struct TcStaged {
  uint2* bfrag;  // [steps, MPS, 2*NT, 4]
  float* xg;     // [NT, groups] group sums
  float* quads;  // [NT, cols/4] sums of 4 columns
  float* pow2;   // [NT] 2^e
  __device__ TcStaged(void* smem, int cols, int steps, int mps, int groups)
      : bfrag(static_cast<uint2*>(smem)),
        xg(reinterpret_cast<float*>(bfrag + steps * mps * 2 * NT * 4)),
        quads(xg + NT * groups),
        pow2(quads + NT * (cols / 4)) {}
};

// Where column o (0 <= o < VQ) of a step goes in the B fragments: lane t, mma m, element k (the
// inverse of the A-side pairing in tc_decode); `div16` for the 4-bit 16q slots.
template <int BITS>
__device__ __forceinline__ void tc_slot(int o, int& t, int& m, int& k, bool& div16) {
  if constexpr (BITS == 4) {  // o = 16t + 8*word + v, v = 2h + high + 4*second
    const int v = o & 7, high = v & 1;
    t = o >> 4, m = 2 * ((o >> 3) & 1) + ((v >> 1) & 1), k = 2 * high + (v >> 2), div16 = high;
  } else {  // o = 8t + 4*word + v, v = high + 2*second
    const int v = o & 3;
    t = o >> 3, m = (o >> 2) & 1, k = 2 * (v & 1) + (v >> 1), div16 = false;
  }
}

// Stages x: per token the power of two 2^e (max|x| * 2^-e < 2^14, far from f16's overflow), the
// f16 hi/lo B fragments of x * 2^-e and the group sums (sums of 4-column quads, added in column
// order). x is read twice (the second time from L1). Every thread calls it; the caller
// synchronises afterwards.
template <int BITS, int NT>
__device__ void tc_stage_x(const TcX& x, const TcStaged<NT>& st) {
  using S = TcShape<BITS>;
  __shared__ float red[32];
  const int C4 = x.cols / 4, groups = x.cols / x.group_size, qpg = x.group_size / 4;
  float m[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) m[t] = 0.f;
  for (int f = threadIdx.x; f < NT * C4; f += blockDim.x) {
    const int t = f / C4, c = 4 * (f % C4);
    const float4 v = t < x.T ? x.quad(t, c) : make_float4(0.f, 0.f, 0.f, 0.f);
    const float a = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
#pragma unroll
    for (int u = 0; u < NT; ++u)
      if (u == t) m[u] = fmaxf(m[u], a);
    st.quads[f] = v.x + v.y + v.z + v.w;
  }
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const float mt = block_max(m[t], red);
    int e = 0;
    if (mt > 0.f) frexpf(mt, &e);
    if (threadIdx.x == 0) st.pow2[t] = __int_as_float((max(e - 14, -126) + 127) << 23);  // exact 2^(e-14)
  }
  __syncthreads();
  uint16_t* half = reinterpret_cast<uint16_t*>(st.bfrag);
  for (int f = threadIdx.x; f < NT * C4; f += blockDim.x) {
    const int t = f / C4, c = 4 * (f % C4);
    const float4 v4 = t < x.T ? x.quad(t, c) : make_float4(0.f, 0.f, 0.f, 0.f);
    const float vals[4] = {v4.x, v4.y, v4.z, v4.w};
    const float inv = 1.f / st.pow2[t];  // exact: a power of two
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      int lane_t, mm, k;
      bool div16;
      tc_slot<BITS>((c + i) % S::VQ, lane_t, mm, k, div16);
      const float v = vals[i] * (div16 ? inv * 0.0625f : inv);
      const __half hi = __float2half_rn(v), lo = __float2half_rn(v - __half2float(hi));
      const int entry = (((c + i) / S::VQ * S::MPS + mm) * 2 * NT + 2 * t) * 4 + lane_t;
      half[entry * 4 + k] = __half_as_ushort(hi);
      half[(entry + 4) * 4 + k] = __half_as_ushort(lo);  // column n + 1: the next 4 lanes' entries
    }
  }
  for (int i = threadIdx.x; i < NT * groups; i += blockDim.x) {
    float s = 0.f;
    for (int q = 0; q < qpg; ++q) s += st.quads[i * qpg + q];
    st.xg[i] = s;
  }
}

// One fast-affine matrix stack [E, rows, cols] (4/8 bits, BF16 scales, 16-byte rows).
struct TcMatrix {
  const uint32_t* w;       // [E, rows, cols*BITS/32] U32
  const uint16_t* scales;  // [E, rows, cols/group_size] BF16
  const uint16_t* biases;
  int rows, cols, group_size;
};

// What a lane holds of one tile: steps j < SW (warp w's j-th step: virtual group w + 8*(j / spg),
// step j % spg of it) of rows g and g+8.
template <int SW>
struct TcLoads {
  uint2 w[SW][2];
  uint16_t s[SW][2], b[SW][2];
};

// Loads a lane's steps. where(group, r, m, row, rgroup) names for virtual group `group` and lane
// row r (0: g, 1: g+8) the matrix (a copy: no pointer into parameter space, which would put the
// struct on the stack), its stack row and the group within that row; false: zeros.
template <int BITS, int SW, class Where>
__device__ __forceinline__ void tc_load(TcLoads<SW>& L, int spg, int groups, Where where) {
  const int warp = threadIdx.x >> 5, t = threadIdx.x & 3;
#pragma unroll
  for (int j = 0; j < SW; ++j)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int grp = warp + TC_WARPS * (j / spg);
      TcMatrix m;
      int64_t row = 0;
      int rg = 0;
      if (grp < groups && where(grp, r, m, row, rg)) {
        const int gpr = m.cols / m.group_size;
        const int64_t step = int64_t(rg) * spg + j % spg;
        L.w[j][r] = __ldcs(reinterpret_cast<const uint2*>(m.w + row * (m.cols * BITS / 32) + step * 8) + t);
        L.s[j][r] = __ldg(m.scales + row * gpr + rg);
        L.b[j][r] = __ldg(m.biases + row * gpr + rg);
      } else {
        L.w[j][r] = make_uint2(0, 0);
        L.s[j][r] = L.b[j][r] = 0;
      }
    }
}

// y[r] += sum over the lane's steps of rows g + 8r for token t = lane % 4 (valid for t < NT).
template <int BITS, int NT, int SW>
__device__ __forceinline__ void tc_dot(const TcLoads<SW>& L, const TcStaged<NT>& st, int spg, int groups,
                                       float (&y)[2]) {
  using S = TcShape<BITS>;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const float scale = t < NT ? st.pow2[t] : 0.f;  // 2^e of lane t's token
  float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int j = 0; j < SW; ++j) {
    const int grp = warp + TC_WARPS * (j / spg);
    if (grp >= groups) break;
    const int step = grp * spg + j % spg;
#pragma unroll
    for (int m = 0; m < S::MPS; ++m) {
      const int word = BITS == 4 ? m >> 1 : m, h = BITS == 4 ? m & 1 : 0;
      uint32_t a0, a1, a2, a3;
      tc_decode<BITS>(word ? L.w[j][0].y : L.w[j][0].x, h, a0, a2);
      tc_decode<BITS>(word ? L.w[j][1].y : L.w[j][1].x, h, a1, a3);
      const uint2 b = g < 2 * NT ? st.bfrag[((step * S::MPS + m) * 2 * NT + g) * 4 + t] : make_uint2(0, 0);
      mma_f16(c, a0, a1, a2, a3, b.x, b.y);
    }
    if (j % spg == spg - 1) {  // group done: fold its scale and bias
      const float xsum = t < NT ? st.xg[t * groups + grp] : 0.f;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float dot = (c[2 * r] + c[2 * r + 1]) * scale;
        y[r] = fmaf(bf16_bits_to_f32(L.s[j][r]), dot, fmaf(bf16_bits_to_f32(L.b[j][r]), xsum, y[r]));
        c[2 * r] = c[2 * r + 1] = 0.f;
      }
    }
  }
}

// Adds the 8 warps' y (rows g, g+8 of the tile, token t) in warp order into out[16][NT] on the
// threads < 16*NT (thread i: row i / NT, token i % NT); returns whether this thread holds one.
// Every thread calls it; red is [TC_WARPS][16][NT] shared.
template <int NT>
__device__ __forceinline__ bool tc_reduce(const float (&y)[2], float (*red)[TC_TILE_ROWS][NT], float& out) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  if (t < NT) {
    red[warp][g][t] = y[0];
    red[warp][g + 8][t] = y[1];
  }
  __syncthreads();
  const bool mine = threadIdx.x < TC_TILE_ROWS * NT;
  if (mine) {
    const int r = threadIdx.x / NT, tok = threadIdx.x % NT;
    out = 0.f;
#pragma unroll
    for (int w = 0; w < TC_WARPS; ++w) out += red[w][r][tok];
  }
  __syncthreads();
  return mine;
}

struct GemvTcParams {
  TcMatrix w;  // one stack entry: [rows, cols]
  TcX x;       // [T, cols]
  float* y;    // [T, rows] F32
};

// y = W x for T <= NT tokens; grid-stride over 16-row tiles, each tile's next loads in flight
// during the reduction.
template <int BITS, int NT, int SW>
__global__ void __launch_bounds__(TC_THREADS, 2) linear_gemv_tc_kernel(const GemvTcParams p) {
  using S = TcShape<BITS>;
  extern __shared__ uint2 tc_smem[];
  __shared__ float red[TC_WARPS][TC_TILE_ROWS][NT];
  const int groups = p.x.cols / p.x.group_size, spg = p.x.group_size / S::VQ;
  const TcStaged<NT> st(tc_smem, p.x.cols, p.x.cols / S::VQ, S::MPS, groups);
  const int g = (threadIdx.x & 31) >> 2, tiles = (p.w.rows + TC_TILE_ROWS - 1) / TC_TILE_ROWS;
  TcLoads<SW> L;
  auto load = [&](int tile) {
    tc_load<BITS>(L, spg, groups, [&](int grp, int r, TcMatrix& m, int64_t& row, int& rg) {
      m = p.w;
      row = tile * TC_TILE_ROWS + g + 8 * r;
      rg = grp;
      return row < p.w.rows;
    });
  };
  int tile = blockIdx.x;
  if (tile < tiles) load(tile);  // weights do not depend on x: their latency overlaps the staging
  tc_stage_x<BITS, NT>(p.x, st);
  __syncthreads();
  for (; tile < tiles; tile += gridDim.x) {
    float y[2] = {0.f, 0.f};
    tc_dot<BITS, NT, SW>(L, st, spg, groups, y);
    if (tile + int(gridDim.x) < tiles) load(tile + gridDim.x);
    float out;
    if (tc_reduce<NT>(y, red, out)) {
      const int row = tile * TC_TILE_ROWS + int(threadIdx.x) / NT, tok = threadIdx.x % NT;
      if (row < p.w.rows && tok < p.x.T) p.y[int64_t(tok) * p.w.rows + row] = out;
    }
  }
}

}  // namespace lily::cuda
