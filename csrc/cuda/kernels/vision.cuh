// The vision tower's row and elementwise kernels (device code only; launchers in vision.cu), docs/model.md
// section 8. All fp32, matching cpu/vision.cpp up to summation order (layer_norm) and the device's
// sincosf / tanhf / erff (a few ulps):
//   layer_norm:                y[r, i] = (x[r, i] - mu_r) / sqrt(var_r + eps) * w[i] + b[i] (population var);
//                              layer_norm_xb: bf16_rn(y) into yb [R, D] (the dense GEMM's Xb, wg_bf16)
//   add_bias:                  x[r, c] += bias[c]
//   gelu:                      x = 0.5 x (1 + tanh(k (x + 0.044715 x^3))) or 0.5 x (1 + erf(x / sqrt 2))
//   vision_position_embedding: y[i, :] += the table resampled bilinearly (align corners) at patch i's (row, col)
//   vision_rope:               2D rotate-half RoPE of the q and k heads of qkv rows, angle row f_d or col f_(d-F)
// Rows are row-major f32 [R, D]; pos [n, 2] I32 (row, column) per patch.
#pragma once
#include "common.cuh"
#include "gelu.cuh"
#include "xb_layout.cuh"  // wg_bf16

namespace lily::cuda::vision {

constexpr int kThreads = 256;         // elementwise and position-table blocks
constexpr int kMaxRopeFreqs = 128;    // D / 4 bound of the vision_rope table (head dims up to 512)

// layer_norm: one block of blockDim.x (a multiple of 32, <= 256) threads per row. Thread t sums x[t],
// x[t + nt], ... (then block_sum) for the mean, the same elements' squared deviations for the variance,
// then writes those elements: y may alias x (each thread reads only what it later writes, after both
// reductions of the row have read everything). XB: the values go to yb as bf16 (wg_bf16) instead of y.
struct LayerNormParams {
  const float* x;  // [R, D]
  const float* w;  // [D]
  const float* b;  // [D]
  float* y;        // [R, D] (not XB)
  int D;
  float eps;
  uint16_t* yb = nullptr;  // [R, D] BF16 (XB)
};

template <bool XB>
__global__ void layer_norm_kernel(const LayerNormParams p) {
  pdl_wait();
  pdl_trigger();
  __shared__ float red[32];
  const int64_t off = int64_t(blockIdx.x) * p.D;
  const float* x = p.x + off;
  const int tid = threadIdx.x, nt = blockDim.x;
  float s = 0.f;
  for (int i = tid; i < p.D; i += nt) s += x[i];
  const float mean = block_sum(s, red) / float(p.D);
  float v = 0.f;
  for (int i = tid; i < p.D; i += nt) v += (x[i] - mean) * (x[i] - mean);
  const float inv = 1.f / sqrtf(block_sum(v, red) / float(p.D) + p.eps);
  for (int i = tid; i < p.D; i += nt) {
    const float y = (x[i] - mean) * inv * p.w[i] + p.b[i];
    if constexpr (XB) p.yb[off + i] = wg_bf16(y);
    else p.y[off + i] = y;
  }
}

// add_bias and gelu: one thread per element (VEC4: per four, C % 4 == 0 and 16-byte aligned x and bias).
struct AddBiasParams {
  float* x;           // [R, C]
  const float* bias;  // [C]
  int64_t n;          // R * C
  int64_t C;
};

template <bool VEC4>
__global__ void add_bias_kernel(const AddBiasParams p) {
  pdl_wait();
  pdl_trigger();
  const int64_t e = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * (VEC4 ? 4 : 1);
  if (e >= p.n) return;
  if constexpr (VEC4) {
    float4 v = *reinterpret_cast<float4*>(p.x + e);
    const float4 b = *reinterpret_cast<const float4*>(p.bias + e % p.C);
    v.x += b.x, v.y += b.y, v.z += b.z, v.w += b.w;
    *reinterpret_cast<float4*>(p.x + e) = v;
  } else {
    p.x[e] += p.bias[e % p.C];
  }
}

struct GeluParams {
  float* x;   // [n]
  int64_t n;
  float k;    // sqrt(2 / pi) as the CPU rounds it (tanh form)
  float inv_sqrt2;
};

template <bool TANH>
__device__ __forceinline__ float gelu(float u, const GeluParams& p) {
  if constexpr (TANH) return gelu_tanh(u, p.k);  // kernels/gelu.cuh: the dense GEMM's GELU epilogue's bits
  return gelu_erf(u, p.inv_sqrt2);
}

template <bool TANH>
__global__ void gelu_kernel(const GeluParams p) {
  pdl_wait();
  pdl_trigger();
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < p.n; i += stride) p.x[i] = gelu<TANH>(p.x[i], p);
}

// vision_position_embedding: grid (n, ceil(W / kThreads)), thread (i, j) column j of patch i. Source
// coordinate src = c (side - 1) / (g - 1) (0 when g = 1), taps floor(src) and floor(src) + 1 (clamped to the
// table) weighted 1 - frac and frac, in cpu::vision_position_embedding's float operations and order: acc sums
// the four (row tap, column tap) products row tap major, then y += acc. Positions were checked by the op.
struct PosEmbedParams {
  const float* table;  // [side * side, W]
  const int32_t* pos;  // [n, 2] (row, column)
  float* y;            // [n, W]
  int64_t W;
  int side, grid_h, grid_w;
};

__device__ __forceinline__ void pos_taps(int32_t i, int n, int side, int (&idx)[2], float (&w)[2]) {
  const float src = float(i) * float(side - 1) / float(n > 1 ? n - 1 : 1);
  const float lo = floorf(src), frac = src - lo;
  idx[0] = min(int(lo), side - 1);
  idx[1] = min(int(lo) + 1, side - 1);
  w[0] = 1.f - frac;
  w[1] = frac;
}

__global__ void vision_position_embedding_kernel(const PosEmbedParams p) {
  pdl_wait();
  pdl_trigger();
  const int64_t i = blockIdx.x, j = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;
  if (j >= p.W) return;
  int ri[2], ci[2];
  float rw[2], cw[2];
  pos_taps(p.pos[2 * i], p.grid_h, p.side, ri, rw);
  pos_taps(p.pos[2 * i + 1], p.grid_w, p.side, ci, cw);
  float acc = 0.f;
#pragma unroll
  for (int a = 0; a < 2; ++a)
#pragma unroll
    for (int b = 0; b < 2; ++b) acc += p.table[(int64_t(ri[a]) * p.side + ci[b]) * p.W + j] * (rw[a] * cw[b]);
  p.y[i * p.W + j] += acc;
}

// vision_rope: one thread per (patch t, head h of the 2 nH query and key heads, dim d < D/2); angle
// row_t inv_freq[d] (d < F) or col_t inv_freq[d - F], F = D/4; the pair (d, d + D/2) turned by sincosf and
// rope_rotate (as the text rope). inv_freq from the host, float(1 / pow(theta, 2j / (D/2))) as the CPU.
struct VisionRopeParams {
  float* qkv;          // [N, 3 nH D]: q | k | v, head-major
  const int32_t* pos;  // [N, 2]
  int64_t n;           // N * 2nH * D/2
  int nH, D;
  float inv_freq[kMaxRopeFreqs];
};

__global__ void vision_rope_kernel(const VisionRopeParams p) {
  pdl_wait();
  pdl_trigger();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= p.n) return;
  const int half = p.D / 2, F = p.D / 4, d = int(i % half);
  const int64_t r = i / half, t = r / (2 * p.nH), h = r % (2 * p.nH);
  const float at = float(p.pos[2 * t + (d < F ? 0 : 1)]);
  float s, c;
  sincosf(at * p.inv_freq[d < F ? d : d - F], &s, &c);
  float* v = p.qkv + t * 3 * p.nH * p.D + h * p.D;
  float x0 = v[d], x1 = v[d + half];
  rope_rotate(x0, x1, c, s);
  v[d] = x0;
  v[d + half] = x1;
}

}  // namespace lily::cuda::vision
