// Xb: the prefill GEMM's X operand (kernels/linear_wgmma_tma.cuh), BF16 [rows, K] rounded to nearest
// even from the F32 rows, k permuted inside every aligned block of 8: position 2c+e holds X's k = c+4e
// (c = 0..3, e = 0..1; wg_phys_k), so that Xb's 16-byte chunk j of a row holds the pairs
// (x_{8j+c}, x_{8j+c+4}) that thread c of a wgmma B fragment wants. Written by wgx_bf16_kernel from F32
// rows, or by X's producer itself (docs/cuda.md, "Xb hand-over": the GATED epilogue's yb, gated_rms_norm_xb)
// with the same rounding instruction, so the GEMM reads the same bits either way. Host and device (the
// CPU emulator tests/emu/xb_layout_emu.cu runs these very functions).
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

namespace lily::cuda {

// X's k (0..63 inside a k-tile) at Xb position lk (logical position of the operands).
__host__ __device__ constexpr int wg_phys_k(int lk) { return (lk & ~7) | ((lk >> 1) & 3) | ((lk & 1) << 2); }

// Xb position of X's k (wg_phys_k's inverse inside each block of 8): X[r, k] is Xb[r, wg_xb_pos(k)].
__host__ __device__ constexpr int64_t wg_xb_pos(int64_t k) { return (k & ~int64_t(7)) | ((k & 3) << 1) | ((k >> 2) & 1); }

// bf16_rn(lo) | bf16_rn(hi) << 16 (cvt.rn.bf16x2.f32 on the device): wgx_bf16_kernel's conversion.
__host__ __device__ __forceinline__ uint32_t wg_pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Eight consecutive values of a row as one 16-byte Xb chunk: pairs (v_c, v_c+4), c = 0..3.
__host__ __device__ __forceinline__ uint4 wg_pack_xb8(const float (&v)[8]) {
  return make_uint4(wg_pack_bf16x2(v[0], v[4]), wg_pack_bf16x2(v[1], v[5]), wg_pack_bf16x2(v[2], v[6]),
                    wg_pack_bf16x2(v[3], v[7]));
}

// bf16_rn(v) as bits: wg_pack_bf16x2's conversion of one value (the same instruction, the same bits).
__host__ __device__ __forceinline__ uint16_t wg_bf16(float v) { return uint16_t(wg_pack_bf16x2(v, 0.f)); }

}  // namespace lily::cuda
