#include "../cpu/cpu_ops.h"
#include "check.h"

namespace lily::ops {

static void check_pair(const char* op, const Tensor& x, const Tensor& y) {
  check_tensor(op, "x", x, DType::F32, 2);
  check_tensor(op, "y", y, DType::F32, 2);
  check_shape(op, "y", y, 0, x.dim(0));
  check_shape(op, "y", y, 1, x.dim(1));
  check_same_device(op, {x, y});
}

void sigmoid_mul(const Tensor& x, const Tensor& gate) {
  const OpSpan span("sigmoid_mul");
  check_pair("sigmoid_mul", x, gate);
  if (x.device == Device::CPU) return cpu::sigmoid_mul(x, gate);
  LILY_CUDA_CASE(x.device, sigmoid_mul(x, gate));
  no_backend("sigmoid_mul", x.device);
}

void add(const Tensor& x, const Tensor& y) {
  const OpSpan span("add");
  check_pair("add", x, y);
  if (x.device == Device::CPU) return cpu::add(x, y);
  LILY_CUDA_CASE(x.device, add(x, y));
  no_backend("add", x.device);
}

}  // namespace lily::ops
