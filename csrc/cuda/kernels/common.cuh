// Device helpers shared by the kernels: warp and block reductions in a fixed order (so results are
// bitwise reproducible run to run), BF16 conversion and the activation functions the ops share.
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

// L2 prefetch hints of the decode step: byte ranges of constant weights that the next kernels read,
// requested into L2 (cp.async.bulk.prefetch) by the kernel before them, so that HBM streams them
// while that kernel runs instead of after it. A hint: nothing waits for it and results do not depend
// on it. Ranges are widened to 16-byte bounds (inside their allocations, which are 256-byte aligned
// and padded) and cut into chunks of L2_PREFETCH_CHUNK bytes numbered across the ranges; chunk c goes
// to the CTA part c % parts, whose warp 0 issues it (one lane per chunk).
constexpr int L2_PREFETCH_RANGES = 16;
constexpr uint32_t L2_PREFETCH_CHUNK = 8192;
struct L2Prefetch {
  const void* p[L2_PREFETCH_RANGES];
  uint32_t bytes[L2_PREFETCH_RANGES];
  int n;  // ranges in use
};

// This CTA's chunks of [p, p + bytes) when its chunks are numbered from `first`; returns the number
// after its last chunk. Call from warp 0 only.
__device__ __forceinline__ uint32_t l2_prefetch_range(const void* p, uint32_t bytes, uint32_t first, uint32_t part,
                                                      uint32_t parts) {
  const size_t g = __cvta_generic_to_global(p);
  const size_t a0 = g & ~size_t(15), a1 = (g + bytes + 15) & ~size_t(15);
  const uint32_t n = uint32_t((a1 - a0 + L2_PREFETCH_CHUNK - 1) / L2_PREFETCH_CHUNK);
  for (uint32_t c = (part + parts - first % parts) % parts + (threadIdx.x & 31) * parts; c < n; c += 32 * parts) {
    const size_t a = a0 + size_t(c) * L2_PREFETCH_CHUNK;
    const uint32_t size = uint32_t(a1 - a < L2_PREFETCH_CHUNK ? a1 - a : L2_PREFETCH_CHUNK);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a), "r"(size));
  }
  return first + n;
}

// This CTA's share of every range of pf (every thread may call it; warp 0 issues).
__device__ __forceinline__ void l2_prefetch(const L2Prefetch& pf, uint32_t part, uint32_t parts) {
  if (threadIdx.x >= 32) return;
  uint32_t first = 0;
  for (int r = 0; r < pf.n; ++r) first = l2_prefetch_range(pf.p[r], pf.bytes[r], first, part, parts);
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

__device__ __forceinline__ float silu(float v) { return v / (1.f + __expf(-v)); }
__device__ __forceinline__ float sigmoid(float v) { return 1.f / (1.f + __expf(-v)); }

__device__ __forceinline__ float bf16_bits_to_f32(uint16_t h) { return __uint_as_float(uint32_t(h) << 16); }

}  // namespace lily::cuda
