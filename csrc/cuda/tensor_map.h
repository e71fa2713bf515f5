// Host side of the TMA GEMM (kernels/linear_wgmma_tma.cuh): the two tensor maps it reads, encoded with
// cuTensorMapEncodeTiled from the runtime's driver entry point (no link against libcuda).
//   Xb [rows, K] bf16 row-major: box {64 k, bm rows}, SWIZZLE_128B (the wgmma B tile layout, wg_swz);
//      rows past `rows` read as zero. bm = 1: the gathered (x_rows) producer's row box, one load a row.
//   W  [E, N, K*bits/32] U32 (4- or 8-bit words): box {2*bits words (a 64-k tile), box_rows rows, 1 expert}
//      (256, or 128 for each of a gated product's two matrices), no swizzle (the stage's [rows][32 or
//      64 B] layout); rows past N read as zero.
// Both return a CUresult (CUDA_SUCCESS = 0); CUDA_ERROR_NOT_FOUND when the entry point is missing.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cstdint>

#include "../runtime/common.h"  // LILY_CHECK

namespace lily::cuda {

inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      p = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// An encoding failure as the op's error: "<op>: cuTensorMapEncodeTiled (<what>) returned <code>".
inline void check_tensor_map(CUresult r, const char* op, const char* what) {
  LILY_CHECK(r == CUDA_SUCCESS, op, ": cuTensorMapEncodeTiled (", what, ") returned ", int(r));
}

inline CUresult make_xb_tensor_map(CUtensorMap& map, const void* xb, int64_t rows, int64_t K, int bm) {
  const auto encode = tensor_map_encoder();
  if (!encode) return CUDA_ERROR_NOT_FOUND;
  const cuuint64_t dims[2] = {cuuint64_t(K), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(K) * 2};
  const cuuint32_t box[2] = {64, cuuint32_t(bm)};
  const cuuint32_t estr[2] = {1, 1};
  return encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(xb), dims, strides, box, estr,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

inline CUresult make_w_tensor_map(CUtensorMap& map, const void* w, int64_t E, int64_t N, int64_t K, int bits,
                                  int box_rows) {
  const auto encode = tensor_map_encoder();
  if (!encode) return CUDA_ERROR_NOT_FOUND;
  const int64_t words = K * bits / 32;  // per row
  const cuuint64_t dims[3] = {cuuint64_t(words), cuuint64_t(N), cuuint64_t(E)};
  const cuuint64_t strides[2] = {cuuint64_t(words) * 4, cuuint64_t(N) * cuuint64_t(words) * 4};
  const cuuint32_t box[3] = {cuuint32_t(2 * bits), cuuint32_t(box_rows), 1};
  const cuuint32_t estr[3] = {1, 1, 1};
  return encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT32, 3, const_cast<void*>(w), dims, strides, box, estr,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

}  // namespace lily::cuda
