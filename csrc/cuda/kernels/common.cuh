// Device helpers shared by the kernels: warp and block reductions in a fixed order (so results are
// bitwise reproducible run to run), BF16 conversion, the activation functions and the RoPE rotation the ops
// share.
#pragma once
#include <cuda_bf16.h>
#include <cmath>
#include <cstdint>

namespace lily::cuda {

// Programmatic dependent launch (runtime/cuda_device.h's launch): a kernel may start while its predecessor on
// the stream finishes. pdl_wait() blocks until the preceding kernel has completed and its writes are
// visible; earlier kernels are covered only because every launch()-ed kernel calls pdl_wait() in every
// block before it can finish (a kernel that skipped it would break that chain). So: call it first,
// read nothing but constant weights and write nothing before it. pdl_trigger() then lets the next
// kernel start its own prologue. Both are no-ops in a plain launch.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// cp.async bookkeeping: close the thread's group of copies issued since the last commit; wait until at
// most N of its groups are still in flight.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block; every thread gets the result. `red` is shared scratch of >= 32 floats.
// blockDim.x must be a multiple of 32. Ends with a barrier so `red` can be reused at once.
__device__ __forceinline__ float block_sum(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_sum(v);
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float t = lane < nwarps ? red[lane] : 0.f;
  t = warp_sum(t);
  __syncthreads();
  return t;
}

__device__ __forceinline__ float block_max(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_max(v);
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float t = lane < nwarps ? red[lane] : -INFINITY;
  t = warp_max(t);
  __syncthreads();
  return t;
}

// 1 + e^-v as 1 + __expf(-v) rounds it, with ex2.approx.ftz: __expf's non-ftz form wraps the same MUFU.EX2 in a
// range check and two predicated multiplies for subnormal results (argument below -126), and 1 + a subnormal
// rounds to 1 exactly as 1 + 0 does, so the sum, and silu and sigmoid, are bit-identical with 3 instructions
// fewer an element (the gated MoE epilogue computes ~128 SwiGLUs a thread a tile).
__device__ __forceinline__ float one_plus_exp_neg(float v) {
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(v * -1.4426950408889634f));
  return 1.f + e;
}
__device__ __forceinline__ float silu(float v) { return v / one_plus_exp_neg(v); }
__device__ __forceinline__ float sigmoid(float v) { return 1.f / one_plus_exp_neg(v); }

__device__ __forceinline__ float bf16_bits_to_f32(uint16_t h) { return __uint_as_float(uint32_t(h) << 16); }

// The rotation of one rotate-half RoPE pair by an angle of cosine c and sine s, shared by rope_kernel, the
// fused decode prep (attention_decode.cuh), mrope and vision_rope. Explicit roundings (one product, then a
// fused multiply-add) so no compiler contraction choice can make two kernels differ.
__device__ __forceinline__ void rope_rotate(float& x0, float& x1, float c, float s) {
  const float a = x0, b = x1;
  x0 = __fmaf_rn(a, c, -__fmul_rn(b, s));
  x1 = __fmaf_rn(b, c, __fmul_rn(a, s));
}

}  // namespace lily::cuda
