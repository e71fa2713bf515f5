// The CUDA backend's runtime: its one stream, error checks and launch helpers. Every op launches on
// stream() so that the engine can capture a whole decode step as one CUDA graph.
#pragma once
#include <cuda_runtime.h>

#include "../core/common.h"

namespace lily::cuda {

// The stream every kernel and copy of the backend runs on (created on first use).
cudaStream_t stream();

// Multiprocessor count of the current device (cached).
int num_sms();

[[noreturn]] void fail_cuda(cudaError_t e, const char* what, const char* file, int line);

}  // namespace lily::cuda

#define LILY_CUDA_CHECK(call)                                                        \
  do {                                                                               \
    cudaError_t e_ = (call);                                                         \
    if (e_ != cudaSuccess) ::lily::cuda::fail_cuda(e_, #call, __FILE__, __LINE__);   \
  } while (0)

// After every launch: catches bad configurations at once (no synchronisation).
#define LILY_CUDA_LAUNCHED() LILY_CUDA_CHECK(cudaGetLastError())

// Ceiling division for grid sizes.
template <typename T>
constexpr T ceil_div(T a, T b) { return (a + b - 1) / b; }
