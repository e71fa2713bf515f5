// Decode's router folded through the output projection (ops.h, linear_add_route): CUDA only; the CPU keeps
// linear_add, then moe_rms_normed_add (the router over h). moe_routed_rms_normed_add is in moe.cpp.
#include "check.h"

namespace lily::ops {

bool route_fold_supported(const QMatrix& out, const MoeWeights& moe, const Tensor& w_post) {
#ifdef LILY_WITH_CUDA
  if (out.weight.device() == Device::CUDA && w_post.device == Device::CUDA)
    return cuda::route_fold_supported(out, moe, w_post);
#endif
  (void)out, (void)moe, (void)w_post;
  return false;
}

RouteFold route_fold_build(const QMatrix& out, const MoeWeights& moe, const Tensor& w_post) {
  const char* op = "route_fold_build";
  const OpSpan span(op);
  LILY_CHECK(route_fold_supported(out, moe, w_post), op, ": not supported for ", out.describe(), " (CUDA only)");
  LILY_CUDA_CASE(out.weight.device(), route_fold_build(out, moe, w_post));
  no_backend(op, out.weight.device());
}

bool linear_add_route_supported(const QMatrix& w, const RouteFold& fold, const MoeWeights& moe, const Tensor& x,
                                const Tensor& res, const Tensor& weight, const Tensor& h, const MoeScratch& s,
                                int top_k) {
#ifdef LILY_WITH_CUDA
  if (res.device == Device::CUDA && fold.rows > 0)
    return cuda::linear_add_route_supported(w, fold, moe, x, res, weight, h, s, top_k);
#endif
  (void)w, (void)fold, (void)moe, (void)x, (void)res, (void)weight, (void)h, (void)s, (void)top_k;
  return false;
}

void linear_add_route(const QMatrix& w, const RouteFold& fold, const Tensor& x, const Tensor& res, const Tensor& tmp,
                      float eps, const MoeScratch& s, int top_k, const Tensor& sync) {
  const char* op = "linear_add_route";
  const OpSpan span(op);
  check_tensor(op, "x", x, DType::F32, 2);
  check_tensor(op, "res", res, DType::F32, 2);
  check_tensor(op, "tmp", tmp, DType::F32, 2);
  check_tensor(op, "sync", sync, DType::I32, 1);
  check_shape(op, "x", x, 0, 1);
  check_shape(op, "x", x, 1, w.cols);
  check_shape(op, "res", res, 0, 1);
  check_shape(op, "res", res, 1, w.rows);
  check_shape(op, "tmp", tmp, 1, w.rows);
  LILY_CHECK(fold.rows > 0 && fold.H == w.rows && fold.A == w.cols, op, ": the fold was not built for ", w.describe());
  LILY_CHECK(top_k > 0 && top_k < fold.rows, op, ": top_k ", top_k, " outside [1, ", fold.rows - 1, "]");
  LILY_CHECK(s.routing.numel() >= moe_routing_words(res.device, 1, fold.rows - 1, top_k) && s.shared_gate.numel() >= 1,
             op, ": scratch is too small");
  LILY_CHECK(res.data != tmp.data && res.data != x.data && tmp.data != x.data, op, ": x, res and tmp must not alias");
  LILY_CHECK(x.device == w.weight.device(), op, ": weight and input live on different devices");
  check_same_device(op, {x, res, tmp, sync, s.routing, s.shared_gate, s.down});
  LILY_CHECK(res.device != Device::CPU, op, ": CUDA only (the CPU runs linear_add, then moe_rms_normed_add)");
  LILY_CUDA_CASE(res.device, linear_add_route(w, fold, x, res, tmp, eps, s, top_k, sync));
  no_backend(op, res.device);
}

}  // namespace lily::ops
