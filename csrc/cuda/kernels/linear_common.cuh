// Device pieces shared by the linear, embedding and MoE kernels: the weight view, element-wise
// MLX-affine dequantization (the reference every fast path must agree with; cpu/linear.cpp
// dequantize_row), the row tiles of grouped (MoE) products and the common epilogue.
// Affine element j of row o sits in word (j*bits)/32 at bit (j*bits)%32 of the row's words;
// w = scale[g] * q + bias[g] with g = j / group_size. Everything here computes in fp32.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../../runtime/common.h"
#include "common.cuh"

namespace lily::cuda {

// A stack of matrices [num_stack, rows, cols]. Dense (bits == 0): w holds `dtype` floats.
// Affine: w holds U32 words [num_stack, rows, cols*bits/32]; scales, biases
// [num_stack, rows, cols/group_size] in scale_dtype.
struct WeightView {
  const void* w = nullptr;
  const void* scales = nullptr;
  const void* biases = nullptr;
  int64_t num_stack = 1, rows = 0, cols = 0;
  int bits = 0, group_size = 0;
  DType dtype = DType::F32, scale_dtype = DType::F32;
};

__device__ __forceinline__ float load_float(const void* p, DType t, int64_t i) {
  if (t == DType::F32) return static_cast<const float*>(p)[i];
  const uint16_t h = static_cast<const uint16_t*>(p)[i];
  if (t == DType::BF16) return bf16_bits_to_f32(h);
  return __half2float(__ushort_as_half(h));
}

// W_e[o, j] in fp32, one element at a time (generic kernels, embedding).
__device__ __forceinline__ float dequant_at(const WeightView& v, int64_t e, int64_t o, int64_t j) {
  const int64_t row = e * v.rows + o;
  if (v.bits == 0) return load_float(v.w, v.dtype, row * v.cols + j);
  const int64_t bit = j * v.bits;  // bits divides 32: a value never straddles two words
  const uint32_t word = static_cast<const uint32_t*>(v.w)[row * (v.cols * v.bits / 32) + bit / 32];
  const float q = float((word >> (bit % 32)) & ((1u << v.bits) - 1u));
  const int64_t g = row * (v.cols / v.group_size) + j / v.group_size;
  return load_float(v.scales, v.scale_dtype, g) * q + load_float(v.biases, v.scale_dtype, g);
}

// Weights are read once per call: bypass L1 so they do not evict the activations.
__device__ __forceinline__ uint4 ld_stream(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// Which product rows a CTA's tile covers. Dense (tile_expert == nullptr): tile m is rows
// [m*BM, min(M, (m+1)*BM)) of stack entry `expert`. Grouped (MoE, tables built on the device):
// tile m is rows [tile_row0[m], min(row_end[e], tile_row0[m] + BM)) of expert e = tile_expert[m];
// tiles m >= *num_tiles are empty (the grid is an upper bound). A prompt's MoE gate/up product runs over one
// map of 128-row tiles and a second (tail) map of 64-row tiles, each its own RowTiles and launch (moe.cu).
struct RowTiles {
  const int32_t* tile_expert = nullptr;  // [max_tiles]
  const int32_t* tile_row0 = nullptr;    // [max_tiles]
  const int32_t* row_end = nullptr;      // [E]
  const int32_t* num_tiles = nullptr;    // [1]
  int64_t M = 0;                         // dense: product rows
  int64_t expert = 0;                    // dense: stack entry
  int tile_rows = 64;                    // grouped: rows per tile of the map (a kernel's BM must equal it)
};

struct Tile {
  int64_t expert, row0, rows;
};

__device__ __forceinline__ bool find_tile(const RowTiles& rt, int64_t m, int BM, Tile& tile) {
  if (rt.tile_expert == nullptr) {
    tile.expert = rt.expert;
    tile.row0 = m * BM;
    tile.rows = min(int64_t(BM), rt.M - tile.row0);
    return tile.rows > 0;
  }
  if (m >= *rt.num_tiles) return false;
  tile.expert = rt.tile_expert[m];
  tile.row0 = rt.tile_row0[m];
  tile.rows = min(int64_t(BM), int64_t(rt.row_end[tile.expert]) - tile.row0);
  return tile.rows > 0;
}

// LinearArgs::y16's pair order: the position of output column L in its row, 16q + 2i + h for L = 16q + i + 8h
// (i < 8). Host and device (tests/emu/down_bf16_emu.cu walks the epilogue's and the combines' threads through it).
__host__ __device__ constexpr int64_t y16_pos(int64_t L) {
  return (L & ~int64_t(15)) | ((L & 7) << 1) | ((L >> 3) & 1);
}

// One product Y[r, o] = sum_i W_e[o, i] X[x_row(r), i] over tiles of rows, then the epilogue:
//   plain:  y[r, o] = acc
//   swiglu: y[r, o] = row_scale[r] * silu(y[r, o]) * acc   (y holds the gate product already;
//           row_scale folds the MoE routing weight or the shared expert's sigmoid gate)
// Gated (up.w set; linear.cu's linear_tiles): the gate product (w) and the up product (up, the same
// shape) as one, y[r, o] = row_scale[r] * silu(gate[r, o]) * up[r, o]: linear_wgmma_tma_kernel's GATED
// instances where they apply, else the plain gate product into y, then the up product with swiglu.
struct LinearArgs {
  WeightView w;
  WeightView up;
  const float* x = nullptr;         // [*, ldx] F32
  int64_t ldx = 0;
  const int32_t* x_rows = nullptr;  // [M] row of x for product row r (MoE gather); null: r
  float* y = nullptr;               // [M, ldy] F32
  int64_t ldy = 0;
  const float* row_scale = nullptr;  // [M] swiglu multiplier; null: 1
  // X given as Xb by its producer: [rows, K] BF16 in the wgmma GEMM's k-permuted layout
  // (linear_wgmma_tma.cuh, wg_xb_pos), read by the wgmma GEMM instead of converting x (x unused then;
  // only the wgmma GEMM takes it). Null: x.
  const uint16_t* xb = nullptr;
  // A gated product's output as Xb rows [M, N] BF16 (row r at yb + r*N, k-permuted as xb), for the next
  // product to read as its xb, instead of y (only the GATED wgmma instances write it). Null: y.
  uint16_t* yb = nullptr;
  // The product's output as bf16 [M, ldy] (round to nearest even) instead of y, in pair order: in every block of
  // 16 outputs, output 16q + i + 8h (i < 8, h = 0, 1) at position 16q + 2i + h (the wgmma epilogue's thread holds
  // outputs i and i + 8 of a row: one 4-byte store). Only the wgmma GEMM's plain (no swiglu, no GATED, no
  // split-K) epilogue writes it (linear.cu, linear_writes_bf16); the MoE combines read it (moe_routing.cuh,
  // moe_combine8_at). Null: y.
  uint16_t* y16 = nullptr;
  bool swiglu = false;
  RowTiles tiles;
  // Split-K (linear_wgmma_tma_kernel, dense tiles only): each tile's k-tiles run as k_splits work
  // units whose fp32 partials [tile][split][256 consumer threads][BM] go to `partial`; the unit that
  // arrives last on split_done[tile] (zero before, reset by it) sums them in split order and stores.
  int k_splits = 1;
  float* partial = nullptr;
  uint32_t* split_done = nullptr;
};

__device__ __forceinline__ const float* x_row(const LinearArgs& a, int64_t r) {
  return a.x + (a.x_rows ? int64_t(a.x_rows[r]) : r) * a.ldx;
}

__device__ __forceinline__ void store_output(const LinearArgs& a, int64_t r, int64_t o, float acc) {
  float* y = a.y + r * a.ldy + o;
  if (!a.swiglu) {
    *y = acc;
    return;
  }
  const float s = a.row_scale ? a.row_scale[r] : 1.f;
  *y = s * silu(*y) * acc;
}

}  // namespace lily::cuda
