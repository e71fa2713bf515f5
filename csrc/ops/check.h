// Validation helpers shared by the checked op entries.
#pragma once
#include "../runtime/profile.h"
#include "../runtime/tensor.h"
#ifdef LILY_WITH_CUDA
#include "../cuda/cuda_ops.h"
// Dispatch to the CUDA backend when the tensors live there (only in builds with LILY_CUDA).
#define LILY_CUDA_CASE(device, call) \
  if ((device) == ::lily::Device::CUDA) return ::lily::cuda::call;
#else
#define LILY_CUDA_CASE(device, call)
#endif

namespace lily::ops {

inline void check_tensor(const char* op, const char* arg, const Tensor& t, DType dtype, int ndim) {
  LILY_CHECK(t.data != nullptr, op, ": ", arg, " is empty");
  LILY_CHECK(t.dtype == dtype, op, ": ", arg, " must be ", dtype_name(dtype), ", got ", dtype_name(t.dtype));
  LILY_CHECK(t.ndim == ndim, op, ": ", arg, " must have ", ndim, " dims, got ", t.shape_str());
}

inline void check_shape(const char* op, const char* arg, const Tensor& t, int axis, int64_t want) {
  LILY_CHECK(t.dim(axis) == want, op, ": ", arg, " ", t.shape_str(), " needs size ", want, " on axis ", axis);
}

inline void check_same_device(const char* op, std::initializer_list<Tensor> ts) {
  Device d = ts.begin()->device;
  for (const Tensor& t : ts) LILY_CHECK(t.device == d, op, ": tensors live on different devices");
}

// out, the updated copy of a carried state `in` (arg: its name): the same shape, and either `in` itself
// (in place) or bytes apart from it.
inline void check_state_out(const char* op, const char* arg, const Tensor& out, const Tensor& in) {
  LILY_CHECK(out.dtype == in.dtype && out.ndim == in.ndim && out.shape == in.shape, op, ": ", arg, " ",
             out.shape_str(), " must have the shape of its input ", in.shape_str());
  const char *o = static_cast<const char*>(out.data), *i = static_cast<const char*>(in.data);
  const size_t n = size_t(in.numel()) * dtype_size(in.dtype);
  LILY_CHECK(o == i || o + n <= i || i + n <= o, op, ": ", arg, " overlaps its input without being it");
}

// An optional operand left out: Tensor{} (no data, no dims). A view of no data with dims is an error.
inline bool absent(const Tensor& t) { return t.data == nullptr && t.ndim == 0; }

// add_rms_norm's argument checks, for the ops that end in it (ops/norms.cpp); y absent: only x, res, weight.
void check_add_rms_norm(const char* op, const Tensor& x, const Tensor& res, const Tensor& weight, const Tensor& y);
void check_add_rms_norm_in(const char* op, const Tensor& x, const Tensor& res, const Tensor& weight);

[[noreturn]] inline void no_backend(const char* op, Device d) {
  fail(op, ": no ", device_name(d), " implementation in this build");
}

}  // namespace lily::ops
