// Device compile check of the converter-fed GEMM sketch (kernels/linear_wgmma_cvt.cuh, linear_wgmma_cvt_kernel):
// not dispatched by the host yet, so nothing else instantiates it. tests/test_wgmma_cvt_emu.py builds this with
// ptxas -v and wants no spills.
#include "cuda/kernels/linear_wgmma_cvt.cuh"

namespace lily::cuda {
#define LILY_CVT_INSTANCE(GS32, BITS)                                                                             \
  template __global__ void linear_wgmma_cvt_kernel<128, GS32, BITS>(const LinearArgs, const __grid_constant__ CUtensorMap, \
                                                                    const __grid_constant__ CUtensorMap);
LILY_CVT_INSTANCE(false, 4)
LILY_CVT_INSTANCE(true, 4)
LILY_CVT_INSTANCE(false, 8)
LILY_CVT_INSTANCE(true, 8)
}  // namespace lily::cuda
