// Launchers of the elementwise kernels (kernels/elementwise.cuh).
#include <algorithm>

#include "cuda_ops.h"
#include "kernels/elementwise.cuh"
#include "../runtime/cuda_device.h"

namespace lily::cuda {

// Both operands 16-byte aligned: four floats per access.
static bool can_use_vec4(const void* a, const void* b) {
  return ((reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b)) & 15u) == 0;
}

template <class Op>
static void launch_elementwise(const Tensor& x, const Tensor& y) {
  const ElementwiseParams p{x.ptr<float>(), y.ptr<float>(), x.numel()};
  if (p.n == 0) return;
  constexpr int THREADS = 256;
  // A grid-stride loop over at most a few waves: 4 elements per thread per pass.
  const int64_t blocks = std::min<int64_t>(ceil_div<int64_t>(p.n, 4 * THREADS), int64_t(num_sms()) * 8);
  if (can_use_vec4(p.x, p.y))
    launch(elementwise_kernel<Op, true>, unsigned(blocks), THREADS, 0, p);
  else
    launch(elementwise_kernel<Op, false>, unsigned(blocks), THREADS, 0, p);
  LILY_CUDA_LAUNCHED();
}

void sigmoid_mul(const Tensor& x, const Tensor& gate) { launch_elementwise<SigmoidMulOp>(x, gate); }

void add(const Tensor& x, const Tensor& y) { launch_elementwise<AddOp>(x, y); }

}  // namespace lily::cuda
