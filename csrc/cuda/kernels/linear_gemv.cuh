// Decode GEMV over MLX-affine weights (4 or 8 bits, BF16 scales/biases, any group size):
//   y[t, o] = sum_c scale[o, g(c)] * sum_{j in c} q[o, j] x[t, j] + bias[o, g(c)] * xsum[t, c]
// where c runs over 16-byte chunks of the weight row (VALS = 128/BITS values, always inside one
// group) and xsum[t, c] = sum_{j in c} x[t, j]. Exact algebra of cpu::linear (w = scale*q + bias),
// all fp32: expect ~1e-6 relative error, not bf16's 1e-3.
// W [rows, cols*BITS/32] U32 (one stack entry), x [T, cols] F32 with T <= NT, y [T, rows] F32.
// CTA of 256 threads = 256/tpr slots of tpr threads (tpr = power of two >= chunks per row, at most
// 256: split-K across warps, so a [2048 x 8192] matrix still spans every SM). A pass of the CTA covers
// R rows per slot; thread q of a slot reads chunks q, q+tpr, ... of its R rows with 16-byte
// streaming loads. Units (pass, chunk step) are double-buffered in registers: the next unit's loads
// are issued before the current one is computed, and the first before x is staged. q is decoded by
// the magic-number trick (byte | 0x4B000000 is the float 2^23 + byte). Slot sums: xor tree inside a
// warp, then warps in ascending order through shared memory. Fixed order: deterministic.
#pragma once
#include "linear_common.cuh"

namespace lily::cuda {

constexpr int GEMV_THREADS = 256;
constexpr int GEMV_WARPS = GEMV_THREADS / 32;

struct GemvParams {
  const uint32_t* w;       // [rows, cols*BITS/32] U32, 16-byte aligned rows
  const uint16_t* scales;  // [rows, cols/group_size] BF16
  const uint16_t* biases;  // [rows, cols/group_size] BF16
  const float* x;          // [T, cols] F32, 16-byte aligned
  float* y;                // [T, rows] F32
  int T, rows, cols, group_size;
  int tpr;         // threads per row slot (power of two, <= 256)
  int num_passes;  // ceil(rows / rows per pass)
};

template <int BITS>
struct GemvShape {
  static constexpr int VALS = 128 / BITS;  // values per 16-byte chunk
  static constexpr int F = VALS / 4;       // float4s of x per chunk
  static constexpr int VPW = 32 / BITS;    // values per 32-bit word
  // x chunk c's float4 f is stored at f ^ key(c): the 8 lanes of a shared-memory phase read 8
  // consecutive chunks, and the XOR spreads them over all 32 banks.
  static __device__ __forceinline__ int slot(int c, int f) { return c * F + (f ^ ((c * F / 8) % F)); }
};

// Rows per thread (each x value read from shared memory serves R rows) and the CTAs per SM the
// register budget is held to (ptxas: no spills at these pairs; two stages of R loads in flight).
template <int NT>
struct GemvTiling {
  static constexpr int R = NT == 1 ? 4 : 2;
  static constexpr int MIN_CTAS = NT <= 2 ? 3 : 2;
};

// One unit of loads: a 16-byte chunk of each of N weight rows with its scale and bias bits.
template <int N>
struct GemvStage {
  uint4 w[N];
  uint16_t s[N], b[N];
};

__device__ __forceinline__ float magic_byte(uint32_t v, int byte) {
  return __int_as_float(__byte_perm(v, 0x4B000000u, 0x7650u | byte)) - 8388608.f;
}

// q[k] = value k of a 32-bit word (little-endian bit stream).
template <int BITS>
__device__ __forceinline__ void decode_word(uint32_t w, float (&q)[32 / BITS]) {
  if constexpr (BITS == 4) {
    const uint32_t lo = w & 0x0F0F0F0Fu, hi = (w >> 4) & 0x0F0F0F0Fu;
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      q[2 * m] = magic_byte(lo, m);
      q[2 * m + 1] = magic_byte(hi, m);
    }
  } else {
#pragma unroll
    for (int m = 0; m < 4; ++m) q[m] = magic_byte(w, m);
  }
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Loads chunk c of weight row `row` (words per row wpr, groups per row gpr) into stage entry n;
// zeros when !ok so that padded rows and chunks add nothing.
template <int BITS, int N>
__device__ __forceinline__ void gemv_load(GemvStage<N>& st, int n, bool ok, const uint32_t* w, const uint16_t* sc,
                                          const uint16_t* bi, int64_t row, int c, int wpr, int gpr, int group) {
  if (!ok) {
    st.w[n] = make_uint4(0, 0, 0, 0);
    st.s[n] = st.b[n] = 0;
    return;
  }
  st.w[n] = ld_stream(w + row * wpr + 4 * c);
  const int64_t gi = row * gpr + c * GemvShape<BITS>::VALS / group;
  st.s[n] = __ldg(reinterpret_cast<const unsigned short*>(sc) + gi);
  st.b[n] = __ldg(reinterpret_cast<const unsigned short*>(bi) + gi);
}

// acc[r][t] += scale_r * sum_j q_r[j] x_t[c*VALS + j] + bias_r * xsum_t[c] for the N rows of a
// stage and NT staged x rows (xs: swizzled chunks, token stride tc chunks; xsum [NT, tc]).
template <int BITS, int N, int NT>
__device__ __forceinline__ void gemv_chunk(const GemvStage<N>& st, const float4* xs, const float* xsum, int tc,
                                           int c, float (&acc)[N][NT]) {
  using S = GemvShape<BITS>;
  float dot[N][NT] = {};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float q[N][S::VPW];
#pragma unroll
    for (int r = 0; r < N; ++r) decode_word<BITS>(word_of(st.w[r], i), q[r]);
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      float xv[S::VPW];
#pragma unroll
      for (int h = 0; h < S::VPW / 4; ++h) {
        const float4 v = xs[t * tc * S::F + S::slot(c, i * (S::VPW / 4) + h)];
        xv[4 * h] = v.x, xv[4 * h + 1] = v.y, xv[4 * h + 2] = v.z, xv[4 * h + 3] = v.w;
      }
#pragma unroll
      for (int r = 0; r < N; ++r)
#pragma unroll
        for (int k = 0; k < S::VPW; ++k) dot[r][t] = fmaf(q[r][k], xv[k], dot[r][t]);
    }
  }
#pragma unroll
  for (int r = 0; r < N; ++r) {
    const float sc = bf16_bits_to_f32(st.s[r]), bi = bf16_bits_to_f32(st.b[r]);
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[r][t] = fmaf(sc, dot[r][t], fmaf(bi, xsum[t * tc + c], acc[r][t]));
  }
}

// Stages `rows` x rows of C chunks (row i at x + i*ldx; rows >= valid are zeros) into swizzled
// shared chunks xs [rows, C*F] and their sums xsum [rows, C]. Caller synchronises afterwards.
template <int BITS>
__device__ __forceinline__ void gemv_stage_x(const float* x, int64_t ldx, int valid, int rows, int C, float4* xs,
                                             float* xsum) {
  using S = GemvShape<BITS>;
  for (int i = threadIdx.x; i < rows * C; i += blockDim.x) {
    const int t = i / C, c = i % C;
    const float4* src = reinterpret_cast<const float4*>(x + int64_t(t) * ldx + c * S::VALS);
    float s = 0.f;
#pragma unroll
    for (int f = 0; f < S::F; ++f) {
      const float4 v = t < valid ? src[f] : make_float4(0.f, 0.f, 0.f, 0.f);
      xs[t * C * S::F + S::slot(c, f)] = v;
      s += v.x + v.y + v.z + v.w;
    }
    xsum[i] = s;
  }
}

// Sums v over the tpr threads of each slot in a fixed order: xor tree within a warp, then (tpr > 32)
// the slot's warps in ascending order through red [GEMV_WARPS, NV] (one barrier; every thread of
// the CTA must call it). Returns true on the slot's first thread, which then holds the sums in v.
template <int NV>
__device__ __forceinline__ bool slot_sum(float (&v)[NV], int tpr, float (*red)[NV]) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int width = min(tpr, 32);
#pragma unroll
  for (int i = 0; i < NV; ++i)
    for (int o = width >> 1; o > 0; o >>= 1) v[i] += __shfl_xor_sync(0xffffffffu, v[i], o);
  if (tpr <= 32) return (tid & (tpr - 1)) == 0;
  if (lane == 0)
#pragma unroll
    for (int i = 0; i < NV; ++i) red[warp][i] = v[i];
  __syncthreads();
  if ((tid & (tpr - 1)) != 0) return false;
  const int wps = tpr / 32;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    float s = 0.f;
    for (int k = 0; k < wps; ++k) s += red[warp + k][i];
    v[i] = s;
  }
  return true;
}

// Unit j of a CTA = (local pass j / nk, chunk step j % nk); nk == 1 (rows of at most 256 chunks,
// the model's shapes) skips the integer division, which would cost ~10% of the issue slots.
struct GemvUnit {
  int pass, step;
  __device__ __forceinline__ GemvUnit(int j, int nk) : pass(nk == 1 ? j : j / nk), step(nk == 1 ? 0 : j % nk) {}
};

// Double-buffered over `units` work units: unit j+1's weight loads are in flight while unit j
// computes. `units` must be uniform over the CTA, since compute may hold barriers.
template <class Stage, class Load, class Compute>
__device__ __forceinline__ void gemv_pipeline(int units, Stage& a, Stage& b, Load& load, Compute& compute) {
  for (int j = 0; j < units; j += 2) {
    if (j + 1 < units) load(b, j + 1);
    compute(a, j);
    if (j + 1 >= units) break;
    if (j + 2 < units) load(a, j + 2);
    compute(b, j + 1);
  }
}

template <int BITS, int NT>
__global__ void __launch_bounds__(GEMV_THREADS, GemvTiling<NT>::MIN_CTAS) linear_gemv_kernel(const GemvParams p) {
  using S = GemvShape<BITS>;
  constexpr int R = GemvTiling<NT>::R;
  extern __shared__ float4 xs[];  // [NT, C*F] swizzled x, then xsum [NT, C]
  __shared__ float red[2][GEMV_WARPS][R * NT];  // slot sums, double-buffered by pass parity
  const int C = p.cols / S::VALS, tpr = p.tpr;
  float* xsum = reinterpret_cast<float*>(xs + NT * C * S::F);
  const int slot = threadIdx.x / tpr, q = threadIdx.x % tpr;
  const int rows_per_pass = (GEMV_THREADS / tpr) * R, nk = (C + tpr - 1) / tpr;
  const int units = (p.num_passes - int(blockIdx.x) + int(gridDim.x) - 1) / int(gridDim.x) * nk;
  const int wpr = p.cols * BITS / 32, gpr = p.cols / p.group_size;
  float acc[R][NT] = {};

  // unit j: pass blockIdx.x + u.pass * gridDim.x, chunk q + u.step * tpr of the slot's R rows
  auto row0_of = [&](GemvUnit u) { return (int(blockIdx.x) + u.pass * int(gridDim.x)) * rows_per_pass + slot * R; };
  auto load = [&](GemvStage<R>& st, int j) {
    const GemvUnit u(j, nk);
    const int row0 = row0_of(u), c = q + u.step * tpr;
#pragma unroll
    for (int r = 0; r < R; ++r)
      gemv_load<BITS>(st, r, c < C && row0 + r < p.rows, p.w, p.scales, p.biases, row0 + r, c, wpr, gpr,
                      p.group_size);
  };
  auto compute = [&](const GemvStage<R>& st, int j) {
    const GemvUnit u(j, nk);
    const int c = q + u.step * tpr;
    if (c < C) gemv_chunk<BITS, R, NT>(st, xs, xsum, C, c, acc);
    if (u.step != nk - 1) return;
    float v[R * NT];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int t = 0; t < NT; ++t) v[r * NT + t] = acc[r][t], acc[r][t] = 0.f;
    if (!slot_sum(v, tpr, red[u.pass & 1])) return;
    const int row0 = row0_of(u);
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int t = 0; t < NT; ++t)
        if (row0 + r < p.rows && t < p.T) p.y[int64_t(t) * p.rows + row0 + r] = v[r * NT + t];
  };

  GemvStage<R> a, b;
  if (units > 0) load(a, 0);  // weights do not depend on x: their latency overlaps the staging
  pdl_wait();                 // ... and the previous kernel's tail
  pdl_trigger();
  gemv_stage_x<BITS>(p.x, p.cols, p.T, NT, C, xs, xsum);
  __syncthreads();
  gemv_pipeline(units, a, b, load, compute);
}

}  // namespace lily::cuda
