// The sampler's one uniform draw per step, shared by the CPU and GPU samplers so that the same
// (seed, step) gives the same number on every backend (docs/sampling.md).
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define LILY_HOST_DEVICE __host__ __device__
#else
#define LILY_HOST_DEVICE
#endif

namespace lily::ops {

// splitmix64 of seed + (step+1)*golden; the top 24 bits -> [0, 1), exactly representable.
LILY_HOST_DEVICE inline float uniform01(uint64_t seed, uint64_t step) {
  uint64_t x = seed + (step + 1) * 0x9E3779B97F4A7C15ull;
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return float(x >> 40) * 0x1p-24f;
}

}  // namespace lily::ops
