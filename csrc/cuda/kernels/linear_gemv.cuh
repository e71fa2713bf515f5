// Decode GEMV over MLX-affine weights (4 or 8 bits, BF16 scales/biases, any group size):
//   y[t, o] = sum_c scale[o, g(c)] * sum_{j in c} q[o, j] x[t, j] + bias[o, g(c)] * xsum[t, c]
// where c runs over 16-byte chunks of the weight row (VALS = 128/BITS values, always inside one
// group) and xsum[t, c] = sum_{j in c} x[t, j] is computed once per CTA. Exact algebra of
// cpu::linear (w = scale*q + bias), all fp32: expect ~1e-6 relative error, not bf16's 1e-3.
// W [rows, cols*BITS/32] U32 (one stack entry), x [T, cols] F32 with T <= NT, y [T, rows] F32.
// CTA: 8 warps; x (zero-padded to NT tokens) and xsum staged in shared memory once; then each warp
// takes R rows at a time (grid-stride over row groups, so x is staged once per CTA, not per row):
// lane l reads chunks l, l+32, ... of every row with 16-byte streaming loads, U chunks x R rows in
// flight, decodes q by the magic-number trick (byte | 0x4B000000 is the float 2^23 + byte) and
// reuses every x value it loads for R rows. Fixed-order warp sums: deterministic.
#pragma once
#include "linear_common.cuh"

namespace lily::cuda {

constexpr int GEMV_WARPS = 8;

struct GemvParams {
  const uint32_t* w;       // [rows, cols*BITS/32] U32, 16-byte aligned rows
  const uint16_t* scales;  // [rows, cols/group_size] BF16
  const uint16_t* biases;  // [rows, cols/group_size] BF16
  const float* x;          // [T, cols] F32, 16-byte aligned
  float* y;                // [T, rows] F32
  int T, rows, cols, group_size;
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

template <int NT>
struct GemvTiling {
  static constexpr int R = NT <= 2 ? 4 : NT <= 4 ? 2 : 1;  // rows per warp: reuse x, cost registers
  static constexpr int U = 8 / R;            // chunks per row in flight: R*U = 8 loads of 16 bytes
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

template <int BITS, int NT>
__global__ void __launch_bounds__(GEMV_WARPS * 32) linear_gemv_kernel(const GemvParams p) {
  using S = GemvShape<BITS>;
  constexpr int R = GemvTiling<NT>::R, U = GemvTiling<NT>::U;
  extern __shared__ float4 xs[];  // [NT, C*F] swizzled x, then xsum [NT, C]
  const int C = p.cols / S::VALS;
  float* xsum = reinterpret_cast<float*>(xs + NT * C * S::F);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  for (int i = tid; i < NT * C * S::F; i += blockDim.x) {
    const int t = i / (C * S::F), c = (i / S::F) % C, f = i % S::F;
    const float4 v = t < p.T ? *reinterpret_cast<const float4*>(p.x + int64_t(t) * p.cols + c * S::VALS + 4 * f)
                             : make_float4(0.f, 0.f, 0.f, 0.f);
    xs[t * C * S::F + S::slot(c, f)] = v;
  }
  __syncthreads();
  for (int i = tid; i < NT * C; i += blockDim.x) {
    const int t = i / C, c = i % C;
    float s = 0.f;
    for (int f = 0; f < S::F; ++f) {
      const float4 v = xs[t * C * S::F + S::slot(c, f)];
      s += v.x + v.y + v.z + v.w;
    }
    xsum[i] = s;
  }
  __syncthreads();

  const int wpr = p.cols * BITS / 32, gpr = p.cols / p.group_size;
  const int num_groups = (p.rows + R - 1) / R;
  for (int g = blockIdx.x * GEMV_WARPS + warp; g < num_groups; g += gridDim.x * GEMV_WARPS) {
    const int r0 = g * R;
    float acc[R][NT] = {};
    for (int c0 = lane; c0 < C; c0 += 32 * U) {
      uint4 wv[U][R];
      float sc[U][R], bi[U][R];
#pragma unroll
      for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const int c = c0 + 32 * u, row = r0 + r;
          const bool ok = c < C && row < p.rows;
          wv[u][r] = ok ? ld_stream(p.w + int64_t(row) * wpr + 4 * c) : make_uint4(0, 0, 0, 0);
          const int64_t gi = int64_t(row) * gpr + c * S::VALS / p.group_size;
          sc[u][r] = ok ? bf16_bits_to_f32(p.scales[gi]) : 0.f;
          bi[u][r] = ok ? bf16_bits_to_f32(p.biases[gi]) : 0.f;
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = c0 + 32 * u;
        if (c >= C) break;
        float dot[R][NT] = {};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float q[R][S::VPW];
#pragma unroll
          for (int r = 0; r < R; ++r) decode_word<BITS>(word_of(wv[u][r], i), q[r]);
#pragma unroll
          for (int t = 0; t < NT; ++t) {
            float xv[S::VPW];
#pragma unroll
            for (int h = 0; h < S::VPW / 4; ++h) {
              const float4 v = xs[t * C * S::F + S::slot(c, i * (S::VPW / 4) + h)];
              xv[4 * h] = v.x, xv[4 * h + 1] = v.y, xv[4 * h + 2] = v.z, xv[4 * h + 3] = v.w;
            }
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
              for (int k = 0; k < S::VPW; ++k) dot[r][t] = fmaf(q[r][k], xv[k], dot[r][t]);
          }
        }
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int t = 0; t < NT; ++t)
            acc[r][t] = fmaf(sc[u][r], dot[r][t], fmaf(bi[u][r], xsum[t * C + c], acc[r][t]));
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const float v = warp_sum(acc[r][t]);
        if (lane == 0 && r0 + r < p.rows && t < p.T) p.y[int64_t(t) * p.rows + r0 + r] = v;
      }
  }
}

}  // namespace lily::cuda
