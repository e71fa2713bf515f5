// The CUDA backend's runtime: its one stream, error checks and launch helpers. Every op launches on
// stream() so that the engine can capture a whole decode step as one CUDA graph. Host code (a .h:
// .cuh files hold device code only), included by the backend's .cu files.
#pragma once
#include <cuda_runtime.h>

#include <utility>

#include "common.h"

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

namespace lily::cuda {

// Whether launch() issues programmatic dependent launches: only while a graph is being captured
// (the decode step). They shorten the replayed decode step but slowed eager prefill (numbers in
// docs/perf-notes.md, "Decisions in the code"), so eager launches (prefill, the first decode step)
// stay plain.
bool programmatic_launches();

// Launches kernel<<<grid, block, smem, stream()>>>(args...), inside a graph capture as a
// programmatic dependent launch: the kernel may start while its predecessor finishes and must call
// pdl_wait() (kernels/common.cuh) before it reads activations or writes anything. The captured
// graph keeps the programmatic edges, so each kernel's launch and weight prefetch overlap its
// predecessor's tail. launch_clustered() is the same with thread-block clusters of `cluster` CTAs
// (the grid a multiple of it in every dimension), for kernels whose cluster shape is chosen at run
// time (no __cluster_dims__); {1, 1, 1} is launch().
template <typename... Params, typename... Args>
void launch_clustered(void (*kernel)(Params...), dim3 grid, dim3 block, dim3 cluster, size_t smem, Args&&... args) {
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = programmatic_launches() ? 1 : 0;
  attr[1].id = cudaLaunchAttributeClusterDimension;
  attr[1].val.clusterDim.x = cluster.x;
  attr[1].val.clusterDim.y = cluster.y;
  attr[1].val.clusterDim.z = cluster.z;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream();
  cfg.attrs = attr;
  cfg.numAttrs = cluster.x * cluster.y * cluster.z > 1 ? 2 : 1;
  LILY_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, Args&&... args) {
  launch_clustered(kernel, grid, block, dim3(1, 1, 1), smem, std::forward<Args>(args)...);
}

// Whether one cluster of `cluster` CTAs of `kernel` (`threads` each, `smem` bytes of dynamic shared memory) can be
// resident on the device: sizes above 8 need the non-portable attribute, which a device may refuse. A refused
// attribute or query is an answer (false), not a launch error: the error state is cleared.
template <typename... Params>
bool cluster_fits(void (*kernel)(Params...), int cluster, int threads, size_t smem = 0) {
  if (cluster > 8 && cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = unsigned(cluster);
  attr.val.clusterDim.y = attr.val.clusterDim.z = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(cluster));
  cfg.blockDim = dim3(unsigned(threads));
  cfg.dynamicSmemBytes = smem;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  int clusters = 0;
  const bool fits = cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) == cudaSuccess && clusters > 0;
  (void)cudaGetLastError();
  return fits;
}

// Ceiling division for grid sizes.
template <typename T>
constexpr T ceil_div(T a, T b) { return (a + b - 1) / b; }

}  // namespace lily::cuda
