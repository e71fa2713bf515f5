// GELU of one fp32 value, shared by the gelu op (kernels/vision.cuh) and the dense wgmma GEMM's GELU
// epilogues (kernels/linear_wgmma_dense.cuh: linear_bias_gelu), so that both give the same bits:
//   tanh form: 0.5 u (1 + tanh(k (u + 0.044715 u^3))), k = sqrt(2/pi) rounded as cpu::gelu rounds it
//   erf form:  0.5 u (1 + erf(u c)), c = 1/sqrt(2)
// Every multiply and add is an explicit round-to-nearest operation (__fmul_rn / __fadd_rn: never
// contracted into an FMA), in cpu::gelu's order; tanhf / erff are the device's (a few ulps from the CPU's).
#pragma once
#include <cmath>

namespace lily::cuda {

inline float gelu_tanh_k() { return std::sqrt(2.f / float(M_PI)); }  // the constants as cpu::gelu rounds them
inline float gelu_erf_c() { return float(M_SQRT1_2); }

#ifdef __CUDACC__
__device__ __forceinline__ float gelu_tanh(float u, float k) {
  const float cube = __fmul_rn(__fmul_rn(__fmul_rn(0.044715f, u), u), u);
  return __fmul_rn(__fmul_rn(0.5f, u), __fadd_rn(1.f, tanhf(__fmul_rn(k, __fadd_rn(u, cube)))));
}
__device__ __forceinline__ float gelu_erf(float u, float c) {
  return __fmul_rn(__fmul_rn(0.5f, u), __fadd_rn(1.f, erff(__fmul_rn(u, c))));
}
#endif

}  // namespace lily::cuda
