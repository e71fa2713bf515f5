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

void split_columns(const Tensor& y, const Tensor* parts, int n) {
  const char* op = "split_columns";
  const OpSpan span(op);
  check_tensor(op, "y", y, DType::F32, 2);
  LILY_CHECK(n >= 1 && n <= 4, op, ": ", n, " parts (1 to 4)");
  int64_t width = 0;
  for (int i = 0; i < n; ++i) {
    const Tensor& o = parts[i];
    check_tensor(op, "part", o, DType::F32, 2);
    check_shape(op, "part", o, 0, y.dim(0));
    check_same_device(op, {y, o});
    width += o.dim(1);
  }
  LILY_CHECK(width == y.dim(1), op, ": the parts' widths sum to ", width, ", not y's ", y.dim(1));
  if (y.device == Device::CPU) return cpu::split_columns(y, parts, n);
  LILY_CUDA_CASE(y.device, split_columns(y, parts, n));
  no_backend(op, y.device);
}

}  // namespace lily::ops
