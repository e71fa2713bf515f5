// Elementwise kernels (device code only; launchers in elementwise.cu).
//   sigmoid_mul: x[i] *= 1 / (1 + exp(-gate[i]))      add: x[i] += y[i]
// x, gate, y: n contiguous f32 (any [R, C] viewed flat). Grid-stride loop; with VEC4 the first
// n/4*4 elements go four at a time (16-byte aligned pointers) and the tail one at a time.
// fp32; matches cpu/elementwise.cpp (sigmoid with expf, not the fast intrinsic).
//   split_columns: out_i[r, c] = y[r, begin_i + c] for the n <= 4 column blocks of y [T, W] (a stacked
// projection's output back into its parts' rows); VEC4 (every width and pointer a multiple of 4 floats):
// a thread copies one float4 (else one float) of a row, rows strided by the grid's y.
#pragma once
#include "common.cuh"

namespace lily::cuda {

struct ElementwiseParams {
  float* x;        // [n] in/out
  const float* y;  // [n] gate (sigmoid_mul) or addend (add)
  int64_t n;
};

struct SigmoidMulOp {
  __device__ static float apply(float x, float g) { return x * (1.f / (1.f + expf(-g))); }
};
struct AddOp {
  __device__ static float apply(float x, float y) { return x + y; }
};

template <class Op, bool VEC4>
__global__ void elementwise_kernel(ElementwiseParams p) {
  pdl_wait();
  pdl_trigger();
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t tail = 0;
  if constexpr (VEC4) {
    float4* x4 = reinterpret_cast<float4*>(p.x);
    const float4* y4 = reinterpret_cast<const float4*>(p.y);
    for (int64_t i = first; i < p.n / 4; i += stride) {
      float4 a = x4[i];
      const float4 b = y4[i];
      a.x = Op::apply(a.x, b.x);
      a.y = Op::apply(a.y, b.y);
      a.z = Op::apply(a.z, b.z);
      a.w = Op::apply(a.w, b.w);
      x4[i] = a;
    }
    tail = p.n / 4 * 4;
  }
  for (int64_t i = tail + first; i < p.n; i += stride) p.x[i] = Op::apply(p.x[i], p.y[i]);
}

constexpr int SPLIT_MAX_PARTS = 4;
struct SplitColumnsParams {
  const float* y;  // [T, W]
  int64_t T, W;
  int n;
  int64_t begin[SPLIT_MAX_PARTS + 1];  // part i: columns [begin[i], begin[i + 1]); begin[n] = W
  float* out[SPLIT_MAX_PARTS];         // part i: [T, begin[i + 1] - begin[i]]
};

// Block (tx, ty) threads, grid (word blocks of a row, row blocks): thread (x, y) of block (bx, by) copies
// word bx * tx + x of rows (by * ty + y) + k * gridDim.y * ty (no division per word). The host takes tx =
// the row's words rounded up to a power of two (at most 256) and ty = 256 / tx, so a narrow row (GDN's b|a
// split: 16 float4 words) fills a block with 16 rows instead of leaving 240 of 256 threads idle in one
// block a row (4,096 blocks of one row each took 24.5 us for 1 MB at a 4K prompt).
template <bool VEC4>
__global__ void split_columns_kernel(const SplitColumnsParams p) {
  pdl_wait();
  pdl_trigger();
  constexpr int V = VEC4 ? 4 : 1;
  const int64_t word = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, col = word * V;
  if (col >= p.W) return;
  int k = 0;
#pragma unroll
  for (int j = 1; j < SPLIT_MAX_PARTS; ++j) k += j < p.n && col >= p.begin[j];
  const int64_t w = p.begin[k + 1] - p.begin[k];
  float* dst = p.out[k] + (col - p.begin[k]);
  const int64_t step = int64_t(gridDim.y) * blockDim.y;
  for (int64_t r = int64_t(blockIdx.y) * blockDim.y + threadIdx.y; r < p.T; r += step) {
    if constexpr (VEC4) *reinterpret_cast<float4*>(dst + r * w) = *reinterpret_cast<const float4*>(p.y + r * p.W + col);
    else dst[r * w] = p.y[r * p.W + col];
  }
}

}  // namespace lily::cuda
