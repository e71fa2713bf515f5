#include "../cpu/cpu_ops.h"
#include "check.h"

namespace lily::ops {

int64_t moe_work_rows(Device d, int64_t C, int top_k) { return d == Device::CPU ? C : C * (top_k + 1); }

int64_t moe_routing_words(Device d, int64_t C, int64_t E, int top_k) {
  if (d == Device::CPU) return 0;
#ifdef LILY_WITH_CUDA
  if (d == Device::CUDA) return cuda::moe_routing_words(C, E, top_k);
#endif
  no_backend("moe", d);
}

int64_t moe_xb_elems(Device d, int64_t C, int64_t H, int64_t I, int64_t Is, int top_k) {
  if (d == Device::CPU) return 0;
#ifdef LILY_WITH_CUDA
  if (d == Device::CUDA) return cuda::moe_xb_elems(C, H, I, Is, top_k);
#endif
  no_backend("moe", d);
}

static void check_moe(const char* op, const MoeWeights& w, const Tensor& h, const Tensor& out, const MoeScratch& s,
                      int top_k) {
  check_tensor(op, "h", h, DType::F32, 2);
  check_tensor(op, "out", out, DType::F32, 2);
  const int64_t T = h.dim(0), H = h.dim(1), E = w.router->rows;
  check_shape(op, "out", out, 0, T);
  check_shape(op, "out", out, 1, H);
  LILY_CHECK(top_k > 0 && top_k <= E, op, ": top_k ", top_k, " outside [1, ", E, "]");
  LILY_CHECK(w.gate_proj->num_stack == E && w.up_proj->num_stack == E && w.down_proj->num_stack == E, op,
             ": expert stacks disagree with the router's ", E, " experts");
  const int64_t R = moe_work_rows(h.device, T, top_k);
  LILY_CHECK(s.router_logits.dim(0) >= T && s.router_logits.dim(1) == E && s.gathered.dim(0) >= R &&
                 s.gate.dim(0) >= R && s.down.dim(0) >= R && s.routing.numel() >= moe_routing_words(h.device, T, E, top_k),
             op, ": scratch is too small for ", T, " tokens");
  check_same_device(op, {h, out, s.router_logits, s.gathered, s.gate, s.up, s.down, s.shared_gate});
  // the least accepted (the activation room moe_xb_elems adds is optional: without it the down products
  // convert their X themselves)
  int64_t need = 0;
#ifdef LILY_WITH_CUDA
  if (h.device == Device::CUDA) need = cuda::moe_xb_min_elems(T, H, w.down_proj->cols, w.shared_down_proj->cols, top_k);
#endif
  if (need > 0) {
    check_tensor(op, "xb", s.xb, DType::BF16, 1);
    LILY_CHECK(s.xb.numel() >= need, op, ": xb ", s.xb.shape_str(), " is too small for ", T, " tokens (", need,
               " elements)");
    check_same_device(op, {h, s.xb});
  }
}

bool moe_xb_only_supported(const MoeWeights& w, const Tensor& h, const MoeScratch& s, int top_k) {
#ifdef LILY_WITH_CUDA
  if (h.device == Device::CUDA) return cuda::moe_xb_only_supported(w, h, s, top_k);
#endif
  (void)w, (void)h, (void)s, (void)top_k;
  return false;
}

// h_in for these operands: XB only where nothing reads h's F32 rows; the bf16 X fits scratch.xb.
static void check_moe_input(const char* op, const MoeWeights& w, const Tensor& h, const MoeScratch& s, int top_k,
                            MoeInput h_in) {
  LILY_CHECK(h_in != MoeInput::XB || moe_xb_only_supported(w, h, s, top_k), op, ": h given only as its bf16 X, ",
             "but ", h.dim(0), " rows of this block read its F32 rows (moe_xb_only_supported)");
  LILY_CHECK(h_in == MoeInput::F32 || h.device == Device::CPU || s.xb.numel() >= h.numel(), op, ": scratch xb ",
             s.xb.shape_str(), " cannot hold h ", h.shape_str());
}

void moe(const MoeWeights& w, const Tensor& h, const Tensor& out, const MoeScratch& s, int top_k, MoeInput h_in) {
  const char* op = "moe";
  const OpSpan span(op);
  check_moe(op, w, h, out, s, top_k);
  check_moe_input(op, w, h, s, top_k, h_in);
  if (h.device == Device::CPU) return cpu::moe(w, h, out, s, top_k);
  LILY_CUDA_CASE(h.device, moe(w, h, out, s, top_k, h_in));
  no_backend(op, h.device);
}

void moe_add(const MoeWeights& w, const Tensor& h, const Tensor& res, const Tensor& tmp, const MoeScratch& s,
             int top_k) {
  const char* op = "moe_add";
  const OpSpan span(op);
  check_moe(op, w, h, tmp, s, top_k);
  check_tensor(op, "res", res, DType::F32, 2);
  check_shape(op, "res", res, 0, h.dim(0));
  check_shape(op, "res", res, 1, h.dim(1));
  LILY_CHECK(res.data != tmp.data && res.data != h.data && tmp.data != h.data, op, ": h, res and tmp must not alias");
  check_same_device(op, {h, res});
  if (h.device == Device::CPU) {  // the two ops, literally
    cpu::moe(w, h, tmp, s, top_k);
    return cpu::add(res, tmp);
  }
  LILY_CUDA_CASE(h.device, moe_add(w, h, res, tmp, s, top_k));
  no_backend(op, h.device);
}

bool moe_rms_normed_supported(const MoeWeights& w, const Tensor& res, const Tensor& weight, const Tensor& h,
                              const MoeScratch& s, int top_k) {
#ifdef LILY_WITH_CUDA
  if (res.device == Device::CUDA) return cuda::moe_rms_normed_supported(w, res, weight, h, s, top_k);
#endif
  (void)w, (void)res, (void)weight, (void)h, (void)s, (void)top_k;
  return false;
}

void moe_rms_normed_add(const MoeWeights& w, const Tensor& res, const Tensor& weight, float eps, const Tensor& h,
                        const Tensor& tmp, const MoeScratch& s, int top_k) {
  const char* op = "moe_rms_normed_add";
  const OpSpan span(op);
  check_moe(op, w, h, tmp, s, top_k);
  check_tensor(op, "res", res, DType::F32, 2);
  check_shape(op, "res", res, 0, h.dim(0));
  check_shape(op, "res", res, 1, h.dim(1));
  check_tensor(op, "weight", weight, DType::F32, 1);
  check_shape(op, "weight", weight, 0, h.dim(1));
  LILY_CHECK(res.data != tmp.data && res.data != h.data && tmp.data != h.data, op, ": res, h and tmp must not alias");
  check_same_device(op, {h, res, weight});
  if (res.device == Device::CPU) {  // the three ops, literally
    cpu::rms_norm(res, weight, eps, h);
    cpu::moe(w, h, tmp, s, top_k);
    return cpu::add(res, tmp);
  }
  LILY_CUDA_CASE(res.device, moe_rms_normed_add(w, res, weight, eps, h, tmp, s, top_k));
  no_backend(op, res.device);
}

bool linear_add_moe_supported(const QMatrix& o, const Tensor& x, const MoeWeights& w, const Tensor& res,
                              const Tensor& weight, const Tensor& h, const MoeScratch& s, int top_k) {
#ifdef LILY_WITH_CUDA
  if (res.device == Device::CUDA) return cuda::linear_add_moe_supported(o, x, w, res, weight, h, s, top_k);
#endif
  (void)o, (void)x, (void)w, (void)res, (void)weight, (void)h, (void)s, (void)top_k;
  return false;
}

void linear_add_moe_rms_normed_add(const QMatrix& o, const Tensor& x, const MoeWeights& w, const Tensor& res,
                                   const Tensor& weight, float eps, const Tensor& h, const Tensor& tmp,
                                   const MoeScratch& s, int top_k, const Tensor& workspace) {
  if (!linear_add_moe_supported(o, x, w, res, weight, h, s, top_k)) {  // the two ops (each checks its operands)
    linear_add(o, x, res, tmp, workspace);
    return moe_rms_normed_add(w, res, weight, eps, h, tmp, s, top_k);
  }
  const char* op = "linear_add_moe_rms_normed_add";
  const OpSpan span(op);
  check_moe(op, w, h, tmp, s, top_k);
  check_tensor(op, "res", res, DType::F32, 2);
  check_shape(op, "res", res, 0, h.dim(0));
  check_shape(op, "res", res, 1, h.dim(1));
  check_tensor(op, "x", x, DType::F32, 2);
  check_shape(op, "x", x, 0, res.dim(0));
  check_shape(op, "x", x, 1, o.cols);
  LILY_CHECK(o.rows == res.dim(1), op, ": the projection's ", o.rows, " rows differ from res's width ", res.dim(1));
  check_tensor(op, "weight", weight, DType::F32, 1);
  check_shape(op, "weight", weight, 0, h.dim(1));
  LILY_CHECK(res.data != tmp.data && res.data != h.data && tmp.data != h.data && x.data != res.data, op,
             ": res, x, h and tmp must not alias");
  check_same_device(op, {h, res, weight, x});
  LILY_CUDA_CASE(res.device, linear_add_moe_rms_normed_add(o, x, w, res, weight, eps, h, tmp, s, top_k));
  no_backend(op, res.device);
}

bool router_fold_supported(const QMatrix& router_gates, const Tensor& weight, const QMatrix& out_proj) {
#ifdef LILY_WITH_CUDA
  if (weight.device == Device::CUDA) return cuda::router_fold_supported(router_gates, weight, out_proj);
#endif
  (void)router_gates, (void)weight, (void)out_proj;
  return false;
}

void router_fold(const QMatrix& router_gates, const Tensor& weight, const QMatrix& out_proj, const QMatrix& fold) {
  const char* op = "router_fold";
  const OpSpan span(op);
  LILY_CHECK(router_fold_supported(router_gates, weight, out_proj), op, ": unsupported operands (CUDA only)");
  LILY_CUDA_CASE(weight.device, router_fold(router_gates, weight, out_proj, fold));
  no_backend(op, weight.device);
}

void moe_add_rms_norm(const MoeWeights& w, const Tensor& h, const Tensor& res, const Tensor& weight, float eps,
                      const Tensor& tmp, const MoeScratch& s, int top_k, const Tensor& sync) {
  const char* op = "moe_add_rms_norm";
  const OpSpan span(op);
  check_moe(op, w, h, tmp, s, top_k);
  check_tensor(op, "res", res, DType::F32, 2);
  check_shape(op, "res", res, 0, h.dim(0));
  check_shape(op, "res", res, 1, h.dim(1));
  check_add_rms_norm(op, res, tmp, weight, h);
  check_tensor(op, "sync", sync, DType::I32, 1);
  LILY_CHECK(res.data != tmp.data, op, ": tmp must not alias res");
  check_same_device(op, {h, sync});
  if (h.device == Device::CPU) {  // the two ops, literally
    cpu::moe(w, h, tmp, s, top_k);
    return cpu::add_rms_norm(res, tmp, weight, eps, h);
  }
  LILY_CUDA_CASE(h.device, moe_add_rms_norm(w, h, res, weight, eps, tmp, s, top_k, sync));
  no_backend(op, h.device);
}

void moe_add_rms_norm_xb(const MoeWeights& w, const Tensor& h, MoeInput h_in, const Tensor& res,
                         const Tensor& weight, float eps, const Tensor& y, const Tensor& tmp, const MoeScratch& s,
                         int top_k) {
  const char* op = "moe_add_rms_norm_xb";
  const OpSpan span(op);
  check_moe(op, w, h, tmp, s, top_k);
  check_moe_input(op, w, h, s, top_k, h_in);
  if (absent(y)) check_add_rms_norm_in(op, res, tmp, weight);  // the norm only as the bf16 X
  else check_add_rms_norm(op, res, tmp, weight, y);
  LILY_CHECK(tmp.data != h.data && tmp.data != res.data && res.data != h.data, op,
             ": h, res and tmp must not alias");  // y: not res or tmp (check_add_rms_norm), maybe h
  check_same_device(op, {h, res});
  LILY_CUDA_CASE(h.device, moe_add_rms_norm_xb(w, h, h_in, res, weight, eps, y, tmp, s, top_k));
  no_backend(op, h.device);
}

}  // namespace lily::ops
