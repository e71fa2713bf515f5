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

void split_columns(const Tensor& y, const Tensor* outs, int n) {  // n in [1, SPLIT_MAX_PARTS]: ops checks
  SplitColumnsParams p{y.ptr<float>(), y.dim(0), y.dim(1), n, {}, {}};
  bool vec4 = (reinterpret_cast<uintptr_t>(p.y) & 15u) == 0 && p.W % 4 == 0;
  for (int i = 0; i < n; ++i) {
    p.out[i] = outs[i].ptr<float>();
    p.begin[i + 1] = p.begin[i] + outs[i].dim(1);
    vec4 = vec4 && (reinterpret_cast<uintptr_t>(p.out[i]) & 15u) == 0 && outs[i].dim(1) % 4 == 0;
  }
  if (p.T == 0 || p.W == 0) return;
  constexpr int THREADS = 256;
  const int64_t words = p.W / (vec4 ? 4 : 1);
  unsigned tx = 1;  // threads a row: the row's words rounded up to a power of two, at most THREADS
  while (tx < THREADS && tx < words) tx *= 2;
  const dim3 block(tx, THREADS / tx);
  const dim3 grid(unsigned(ceil_div<int64_t>(words, tx)), unsigned(std::min<int64_t>(ceil_div<int64_t>(p.T, block.y), 65535)));
  if (vec4) launch(split_columns_kernel<true>, grid, block, 0, p);
  else launch(split_columns_kernel<false>, grid, block, 0, p);
  LILY_CUDA_LAUNCHED();
}

}  // namespace lily::cuda
