#include <algorithm>

#include "../cpu/cpu_ops.h"
#include "check.h"

namespace lily::ops {

int64_t linear_workspace_elems(Device d, int64_t T, int64_t in) {
  if (d == Device::CPU) return 0;
#ifdef LILY_WITH_CUDA
  if (d == Device::CUDA) return cuda::linear_workspace_elems(T, in);
#endif
  no_backend("linear", d);
}

static void check_linear(const char* op, const QMatrix& w, int64_t e, const Tensor& x, const Tensor& y,
                         const Tensor& workspace) {
  check_tensor(op, "x", x, DType::F32, 2);
  check_tensor(op, "y", y, DType::F32, 2);
  check_shape(op, "x", x, 1, w.cols);
  check_shape(op, "y", y, 0, x.dim(0));
  check_shape(op, "y", y, 1, w.rows);
  LILY_CHECK(e >= 0 && e < w.num_stack, op, ": stack index ", e, " outside [0, ", w.num_stack, ")");
  LILY_CHECK(x.device == w.weight.device(), op, ": weight and input live on different devices");
  check_same_device(op, {x, y});
  if (w.quantized()) {
    LILY_CHECK(w.bits == 2 || w.bits == 4 || w.bits == 8, op, ": unsupported bits ", w.bits);
    LILY_CHECK(w.group_size == 32 || w.group_size == 64 || w.group_size == 128, op,
               ": unsupported group size ", w.group_size);
  }
  // the least accepted: X as bf16 (the split-K room that linear_workspace_elems adds is optional)
  int64_t need = 0;
#ifdef LILY_WITH_CUDA
  if (x.device == Device::CUDA) need = cuda::linear_x_elems(x.dim(0), w.cols);
#endif
  if (need > 0) {
    check_tensor(op, "workspace", workspace, DType::BF16, 1);
    LILY_CHECK(workspace.numel() >= need, op, ": workspace ", workspace.shape_str(), " is too small for ", x.dim(0),
               " x ", w.cols, " (", need, " elements)");
    check_same_device(op, {x, workspace});
  }
}

void linear(const QMatrix& w, int64_t e, const Tensor& x, const Tensor& y, const Tensor& workspace) {
  const char* op = "linear";
  const OpSpan span(op);
  check_linear(op, w, e, x, y, workspace);
  if (x.device == Device::CPU) return cpu::linear(w, e, x, y);
  LILY_CUDA_CASE(x.device, linear(w, e, x, y, workspace));
  no_backend(op, x.device);
}

bool linear_xb_supported(Device d, const QMatrix& w, int64_t T) {
#ifdef LILY_WITH_CUDA
  if (d == Device::CUDA && w.weight.device() == d) return cuda::linear_xb_supported(w, T);
#endif
  (void)w, (void)T;
  return false;
}

bool linear_stack_supported(Device d, const QMatrix& stacked, int64_t T) {
#ifdef LILY_WITH_CUDA
  if (d == Device::CUDA && stacked.weight.device() == d) return cuda::linear_stack_supported(stacked, T);
#endif
  (void)stacked, (void)T;
  return false;
}

int64_t linear_stack_rows(Device d, int64_t chunk) {
#ifdef LILY_WITH_CUDA
  if (d == Device::CUDA) return std::max<int64_t>(1, std::min(chunk, cuda::LINEAR_STACK_MAX_ROWS));
#endif
  (void)chunk;
  return 1;
}

void linear_xb(const QMatrix& w, const Tensor& workspace, const Tensor& y) {
  const char* op = "linear_xb";
  const OpSpan span(op);
  check_tensor(op, "workspace", workspace, DType::BF16, 1);
  check_tensor(op, "y", y, DType::F32, 2);
  check_shape(op, "y", y, 1, w.rows);
  LILY_CHECK(workspace.device == w.weight.device(), op, ": weight and workspace live on different devices");
  check_same_device(op, {workspace, y});
  LILY_CHECK(linear_xb_supported(y.device, w, y.dim(0)), op, ": ", y.dim(0), " rows of this ", w.bits,
             "-bit matrix on ", device_name(y.device), " take no bf16 X (linear_xb_supported)");
  LILY_CUDA_CASE(y.device, linear_xb(w, workspace, y));
  no_backend(op, y.device);
}

void linear_add_rms_norm(const QMatrix& w, const Tensor& x, const Tensor& res, const Tensor& weight, float eps,
                         const Tensor& y, const Tensor& tmp, const Tensor& workspace, const Tensor& sync) {
  const char* op = "linear_add_rms_norm";
  const OpSpan span(op);
  check_linear(op, w, 0, x, tmp, workspace);
  check_tensor(op, "res", res, DType::F32, 2);
  check_shape(op, "res", res, 0, x.dim(0));
  check_shape(op, "res", res, 1, w.rows);
  check_add_rms_norm(op, res, tmp, weight, y);
  check_tensor(op, "sync", sync, DType::I32, 1);
  LILY_CHECK(res.data != tmp.data, op, ": tmp must not alias res");
  check_same_device(op, {x, sync});
  if (x.device == Device::CPU) {  // the two ops, literally
    cpu::linear(w, 0, x, tmp);
    return cpu::add_rms_norm(res, tmp, weight, eps, y);
  }
  LILY_CUDA_CASE(x.device, linear_add_rms_norm(w, x, res, weight, eps, y, tmp, workspace, sync));
  no_backend(op, x.device);
}

void linear_add(const QMatrix& w, const Tensor& x, const Tensor& res, const Tensor& tmp, const Tensor& workspace) {
  const char* op = "linear_add";
  const OpSpan span(op);
  check_linear(op, w, 0, x, tmp, workspace);
  check_tensor(op, "res", res, DType::F32, 2);
  check_shape(op, "res", res, 0, x.dim(0));
  check_shape(op, "res", res, 1, w.rows);
  LILY_CHECK(res.data != tmp.data && res.data != x.data && tmp.data != x.data, op, ": x, res and tmp must not alias");
  check_same_device(op, {x, res});
  if (x.device == Device::CPU) {  // the two ops, literally
    cpu::linear(w, 0, x, tmp);
    return cpu::add(res, tmp);
  }
  LILY_CUDA_CASE(x.device, linear_add(w, x, res, tmp, workspace));
  no_backend(op, x.device);
}

static void check_bias(const char* op, const Tensor& bias, const QMatrix& w) {
  check_tensor(op, "bias", bias, DType::F32, 1);
  check_shape(op, "bias", bias, 0, w.rows);
}

void linear_bias(const QMatrix& w, const Tensor& x, const Tensor& bias, const Tensor& y, const Tensor& workspace) {
  const char* op = "linear_bias";
  const OpSpan span(op);
  check_linear(op, w, 0, x, y, workspace);
  check_bias(op, bias, w);
  LILY_CHECK(y.data != x.data, op, ": x and y must not alias");
  check_same_device(op, {x, bias});
  if (x.device == Device::CPU) {  // the two ops, literally
    cpu::linear(w, 0, x, y);
    return cpu::add_bias(y, bias);
  }
  LILY_CUDA_CASE(x.device, linear_bias(w, x, bias, y, workspace));
  no_backend(op, x.device);
}

void linear_bias_gelu(const QMatrix& w, const Tensor& x, const Tensor& bias, const Tensor& y, const Tensor& workspace) {
  const char* op = "linear_bias_gelu";
  const OpSpan span(op);
  check_linear(op, w, 0, x, y, workspace);
  check_bias(op, bias, w);
  LILY_CHECK(y.data != x.data, op, ": x and y must not alias");
  check_same_device(op, {x, bias});
  if (x.device == Device::CPU) {  // the three ops, literally
    cpu::linear(w, 0, x, y);
    cpu::add_bias(y, bias);
    return cpu::gelu(y, true);
  }
  LILY_CUDA_CASE(x.device, linear_bias_gelu(w, x, bias, y, workspace));
  no_backend(op, x.device);
}

bool linear_bias_xb_supported(Device d, const QMatrix& w, int64_t T) {
#ifdef LILY_WITH_CUDA
  if (d == Device::CUDA && w.weight.device() == d) return cuda::linear_bias_xb_supported(w, T);
#endif
  (void)w, (void)T;
  return false;
}

// The checks of a product reading its X as bf16 (xb, [>= rows x w.cols]) into `out` [rows, w.rows] of
// dtype `dt` (name `out_name`), with a bias: shapes, devices, and the dense wgmma GEMM taking it.
static void check_xb_product(const char* op, const QMatrix& w, const Tensor& xb, const Tensor& bias,
                             const char* out_name, const Tensor& out, DType dt) {
  check_tensor(op, out_name, out, dt, 2);
  check_shape(op, out_name, out, 1, w.rows);
  check_bias(op, bias, w);
  const int64_t rows = out.dim(0);
  check_tensor(op, "xb", xb, DType::BF16, 1);
  LILY_CHECK(xb.numel() >= rows * w.cols, op, ": xb ", xb.shape_str(), " is too small for ", rows, " x ", w.cols,
             " (", rows * w.cols, " elements)");
  LILY_CHECK(xb.device == w.weight.device(), op, ": weight and xb live on different devices");
  check_same_device(op, {xb, bias, out});
  LILY_CHECK(linear_bias_xb_supported(out.device, w, rows), op, ": ", rows, " rows of this ", w.rows, "x", w.cols,
             " matrix on ", device_name(out.device), " do not run on the dense wgmma GEMM: they take no bf16 X ",
             "(linear_bias_xb_supported)");
}

void linear_bias_gelu_xb(const QMatrix& w, const Tensor& xb, const Tensor& bias, const Tensor& yb) {
  const char* op = "linear_bias_gelu_xb";
  const OpSpan span(op);
  check_xb_product(op, w, xb, bias, "yb", yb, DType::BF16);
  const auto* x0 = static_cast<const uint8_t*>(xb.data);
  const auto* y0 = static_cast<const uint8_t*>(yb.data);
  LILY_CHECK(y0 + yb.numel() * 2 <= x0 || x0 + xb.numel() * 2 <= y0, op,
             ": yb overlaps xb (the product reads its X from xb while yb is written)");
  LILY_CUDA_CASE(yb.device, linear_bias_gelu_xb(w, xb, bias, yb));
  no_backend(op, yb.device);
}

void linear_bias_xb(const QMatrix& w, const Tensor& xb, const Tensor& bias, const Tensor& y) {
  const char* op = "linear_bias_xb";
  const OpSpan span(op);
  check_xb_product(op, w, xb, bias, "y", y, DType::F32);
  LILY_CUDA_CASE(y.device, linear_bias_xb(w, xb, bias, y));
  no_backend(op, y.device);
}

bool linear_rms_normed_supported(const QMatrix& w, const Tensor& res, const Tensor& weight, const Tensor& h) {
#ifdef LILY_WITH_CUDA
  if (res.device == Device::CUDA) return cuda::linear_rms_normed_supported(w, res, weight, h);
#endif
  (void)w, (void)res, (void)weight, (void)h;
  return false;
}

void linear_rms_normed(const QMatrix& w, const Tensor& res, const Tensor& weight, float eps, const Tensor& h,
                       const Tensor& y, const Tensor& workspace) {
  const char* op = "linear_rms_normed";
  const OpSpan span(op);
  check_linear(op, w, 0, h, y, workspace);
  check_tensor(op, "res", res, DType::F32, 2);
  check_shape(op, "res", res, 0, h.dim(0));
  check_shape(op, "res", res, 1, h.dim(1));
  check_tensor(op, "weight", weight, DType::F32, 1);
  check_shape(op, "weight", weight, 0, w.cols);
  LILY_CHECK(h.data != res.data && h.data != y.data, op, ": h must not alias res or y");
  check_same_device(op, {h, res, weight});
  if (res.device == Device::CPU) {  // the two ops, literally
    cpu::rms_norm(res, weight, eps, h);
    return cpu::linear(w, 0, h, y);
  }
  LILY_CUDA_CASE(res.device, linear_rms_normed(w, res, weight, eps, h, y, workspace));
  no_backend(op, res.device);
}

void embedding(const QMatrix& table, const Tensor& ids, const Tensor& y) {
  const char* op = "embedding";
  const OpSpan span(op);
  check_tensor(op, "ids", ids, DType::I32, 1);
  check_tensor(op, "y", y, DType::F32, 2);
  check_shape(op, "y", y, 0, ids.dim(0));
  check_shape(op, "y", y, 1, table.cols);
  check_same_device(op, {ids, y});
  LILY_CHECK(y.device == table.weight.device(), op, ": table and output live on different devices");
  if (y.device == Device::CPU) {
    for (int64_t t = 0; t < ids.dim(0); ++t) {
      int32_t id = ids.ptr<int32_t>()[t];
      LILY_CHECK(id >= 0 && id < table.rows, "token id ", id, " is outside the vocabulary [0, ", table.rows, ")");
    }
    return cpu::embedding(table, ids, y);
  }
  // GPU ids come from validated prompts or from the sampler; kernels clamp, they never fault.
  LILY_CUDA_CASE(y.device, embedding(table, ids, y));
  no_backend(op, y.device);
}

}  // namespace lily::ops
