// Device compile check of the converter-fed GEMM (kernels/linear_wgmma_cvt.cuh, linear_wgmma_cvt_kernel), every
// instance, without the rest of linear.cu: tests/test_wgmma_cvt_emu.py builds this with ptxas -v and wants 128
// registers at launch and no spills.
#include "cuda/kernels/linear_wgmma_cvt.cuh"

namespace lily::cuda {
#define LILY_CVT_INSTANCE(GS32, GATHER, GATED, BITS)                                                        \
  template __global__ void linear_wgmma_cvt_kernel<128, GS32, GATHER, GATED, BITS>(                            \
      const LinearArgs, const uint16_t*, const __grid_constant__ CUtensorMap, const __grid_constant__ CUtensorMap, \
      const __grid_constant__ CUtensorMap);
LILY_CVT_INSTANCE(false, false, false, 4)
LILY_CVT_INSTANCE(true, false, false, 4)
LILY_CVT_INSTANCE(false, false, false, 8)
LILY_CVT_INSTANCE(true, false, false, 8)
LILY_CVT_INSTANCE(false, true, false, 4)
LILY_CVT_INSTANCE(false, true, true, 4)
LILY_CVT_INSTANCE(false, false, true, 4)
LILY_CVT_INSTANCE(false, true, false, 8)
}  // namespace lily::cuda
