#include "../cpu/cpu_ops.h"
#include "check.h"

namespace lily::ops {

void rms_norm(const Tensor& x, const Tensor& weight, float eps, const Tensor& y) {
  const char* op = "rms_norm";
  const OpSpan span(op);
  check_tensor(op, "x", x, DType::F32, 2);
  check_tensor(op, "y", y, DType::F32, 2);
  check_tensor(op, "weight", weight, DType::F32, 1);
  check_shape(op, "weight", weight, 0, x.dim(1));
  check_shape(op, "y", y, 0, x.dim(0));
  check_shape(op, "y", y, 1, x.dim(1));
  check_same_device(op, {x, y, weight});
  if (x.device == Device::CPU) return cpu::rms_norm(x, weight, eps, y);
  LILY_CUDA_CASE(x.device, rms_norm(x, weight, eps, y));
  no_backend(op, x.device);
}

void check_add_rms_norm_in(const char* op, const Tensor& x, const Tensor& res, const Tensor& weight) {
  check_tensor(op, "x", x, DType::F32, 2);
  check_tensor(op, "res", res, DType::F32, 2);
  check_tensor(op, "weight", weight, DType::F32, 1);
  check_shape(op, "weight", weight, 0, x.dim(1));
  check_shape(op, "res", res, 0, x.dim(0));
  check_shape(op, "res", res, 1, x.dim(1));
  check_same_device(op, {x, res, weight});
}

void check_add_rms_norm(const char* op, const Tensor& x, const Tensor& res, const Tensor& weight, const Tensor& y) {
  check_add_rms_norm_in(op, x, res, weight);
  check_tensor(op, "y", y, DType::F32, 2);
  check_shape(op, "y", y, 0, x.dim(0));
  check_shape(op, "y", y, 1, x.dim(1));
  LILY_CHECK(y.data != x.data && y.data != res.data, op, ": y must not alias x or res");
  check_same_device(op, {x, y});
}

void add_rms_norm(const Tensor& x, const Tensor& res, const Tensor& weight, float eps, const Tensor& y) {
  const char* op = "add_rms_norm";
  const OpSpan span(op);
  check_add_rms_norm(op, x, res, weight, y);
  if (x.device == Device::CPU) return cpu::add_rms_norm(x, res, weight, eps, y);
  LILY_CUDA_CASE(x.device, add_rms_norm(x, res, weight, eps, y));
  no_backend(op, x.device);
}

void add_rms_norm_xb(const Tensor& x, const Tensor& res, const Tensor& weight, float eps, const Tensor& y,
                     const Tensor& xb) {
  const char* op = "add_rms_norm_xb";
  const OpSpan span(op);
  if (absent(y)) check_add_rms_norm_in(op, x, res, weight);  // h only as the bf16 X
  else check_add_rms_norm(op, x, res, weight, y);
  check_tensor(op, "xb", xb, DType::BF16, 1);
  LILY_CHECK(xb.numel() >= x.numel(), op, ": xb ", xb.shape_str(), " is smaller than x ", x.shape_str());
  check_same_device(op, {x, xb});
  LILY_CUDA_CASE(x.device, add_rms_norm_xb(x, res, weight, eps, y, xb));
  no_backend(op, x.device);
}

// The inputs both gated norms take: x, z [T, D] f32 and weight [D] f32.
static void check_gated_norm_inputs(const char* op, const Tensor& x, const Tensor& z, const Tensor& weight) {
  check_tensor(op, "x", x, DType::F32, 2);
  check_tensor(op, "z", z, DType::F32, 2);
  check_tensor(op, "weight", weight, DType::F32, 1);
  check_shape(op, "weight", weight, 0, x.dim(1));
  check_shape(op, "z", z, 0, x.dim(0));
  check_shape(op, "z", z, 1, x.dim(1));
}

void gated_rms_norm_xb(const Tensor& x, const Tensor& z, const Tensor& weight, float eps, const Tensor& xb) {
  const char* op = "gated_rms_norm_xb";
  const OpSpan span(op);
  check_gated_norm_inputs(op, x, z, weight);
  check_tensor(op, "xb", xb, DType::BF16, 1);
  LILY_CHECK(xb.numel() >= x.numel(), op, ": xb ", xb.shape_str(), " is smaller than x ", x.shape_str());
  check_same_device(op, {x, z, weight, xb});
  LILY_CUDA_CASE(x.device, gated_rms_norm_xb(x, z, weight, eps, xb));
  no_backend(op, x.device);
}

void gated_rms_norm(const Tensor& x, const Tensor& z, const Tensor& weight, float eps, const Tensor& y) {
  const char* op = "gated_rms_norm";
  const OpSpan span(op);
  check_gated_norm_inputs(op, x, z, weight);
  check_tensor(op, "y", y, DType::F32, 2);
  check_shape(op, "y", y, 0, x.dim(0));
  check_shape(op, "y", y, 1, x.dim(1));
  check_same_device(op, {x, z, y, weight});
  if (x.device == Device::CPU) return cpu::gated_rms_norm(x, z, weight, eps, y);
  LILY_CUDA_CASE(x.device, gated_rms_norm(x, z, weight, eps, y));
  no_backend(op, x.device);
}

}  // namespace lily::ops
