// Launchers of decode's folded router (kernels/linear_route.cuh): the fold of a layer at load
// (route_fold_build) and the output projection with the router's logits and top-k in one kernel
// (linear_add_route). The MoE block after it runs moe_routed_rms_normed_add (moe.cu: moe_up and moe_down only).
#include <algorithm>

#include "cuda_ops.h"
#include "kernels/linear_route.cuh"
#include "linear.h"
#include "../runtime/cuda_device.h"

namespace lily::cuda {

// The fold's shapes: the router [E, H] and the gate [1, H] (any stored form), E <= ROUTE_MAX_EXPERTS, O [H, A]
// 4/8-bit in a form the integer GEMV takes, H and A in whole parts (at most ROUTE_MAX_PARTS), H within the
// tail's one round of loads, w_post [H] F32. The decode step then takes it where linear_add_route_supported
// holds (the real model: H = 2048, E = 256).
bool route_fold_supported(const QMatrix& out, const MoeWeights& moe, const Tensor& w_post) {
  const QMatrix *r = moe.router, *g = moe.shared_expert_gate;
  const int64_t H = out.rows, A = out.cols;
  return r && g && out.num_stack == 1 && r->num_stack == 1 && g->num_stack == 1 && r->cols == H && g->cols == H &&
         g->rows == 1 && r->rows >= 1 && r->rows <= ROUTE_MAX_EXPERTS && H % ROUTE_PART == 0 && A % ROUTE_PART == 0 &&
         H <= 4 * ROUTE_TAIL_F4 * MMA_THREADS && (H + A) / ROUTE_PART <= ROUTE_MAX_PARTS &&
         is_fast_affine(weight_view(out)) && mma_group_halves(out.bits, out.group_size) != 0 &&
         w_post.dtype == DType::F32 && w_post.numel() == H;
}

RouteFold route_fold_build(const QMatrix& out, const MoeWeights& moe, const Tensor& w_post) {
  LILY_CHECK(route_fold_supported(out, moe, w_post), "route_fold_build: unsupported shapes");
  RouteFold f;
  f.rows = moe.router->rows + 1, f.H = out.rows, f.A = out.cols;
  f.wm = Buffer(Device::CUDA, size_t(f.rows * (f.H + f.A)) * sizeof(float));
  const RouteFoldParams p{weight_view(*moe.router), weight_view(*moe.shared_expert_gate), weight_view(out),
                          w_post.ptr<float>(), static_cast<float*>(f.wm.data()), int(f.rows), int(f.H), int(f.A)};
  launch(route_fold_w_kernel, dim3(unsigned(ceil_div<int64_t>(f.H, 256)), unsigned(f.rows)), 256, 0, p);
  LILY_CUDA_LAUNCHED();
  launch(route_fold_m_kernel,
         dim3(unsigned(ceil_div<int64_t>(f.A, ROUTE_FOLD_COLS)), unsigned(ceil_div<int64_t>(f.rows, ROUTE_FOLD_ROWS))),
         ROUTE_FOLD_COLS, 0, p);
  LILY_CUDA_LAUNCHED();
  return f;
}

// Parts of the fold's columns, and the part sums' room in s.down (unused by the decode chain: moe_down adds
// into the residual row).
static int64_t route_parts(const RouteFold& f) { return (f.H + f.A) / ROUTE_PART; }

bool linear_add_route_supported(const QMatrix& w, const RouteFold& fold, const MoeWeights& moe, const Tensor& x,
                                const Tensor& res, const Tensor& weight, const Tensor& h, const ops::MoeScratch& s,
                                int top_k) {
  return fold.rows == moe.router->rows + 1 && fold.H == w.rows && fold.A == w.cols && use_gemv_mma(w, 0, x) &&
         cuda::moe_rms_normed_supported(moe, res, weight, h, s, top_k) && top_k <= 32 && is_aligned16(res.data) &&
         is_aligned16(x.data) && s.down.numel() >= route_parts(fold) * fold.rows;
}

// Router CTAs: the fewest rows a warp (rpw, at most ROUTE_MAX_RPW) whose CTAs fit `ctas` (else ROUTE_MAX_RPW).
struct RoutePlan {
  int rpw, Q, ctas;
};
static RoutePlan route_plan(int64_t R, int64_t P, int64_t ctas) {
  RoutePlan best{};
  for (int rpw = 1; rpw <= ROUTE_MAX_RPW; ++rpw) {
    const int Q = int(ceil_div<int64_t>(R, rpw));
    best = RoutePlan{rpw, Q, int(ceil_div<int64_t>(P * Q, MMA_WARPS))};
    if (best.ctas <= ctas) break;
  }
  return best;
}

template <int BITS, int NG>
static void launch_linear_route(LinearRouteParams p, const RouteFold& fold) {
  const auto kernel = linear_route_kernel<BITS, NG>;
  const auto plain = linear_gemv_mma_kernel<BITS, NG, false>;
  static const bool configured = [&] {
    for (const auto k : {reinterpret_cast<const void*>(kernel), reinterpret_cast<const void*>(plain)})
      LILY_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(GEMV_MAX_SMEM)));
    return true;
  }();
  (void)configured;
  const size_t smem = mma_x_bytes(p.lin.cols, MmaSeg<BITS>::VALS / NG);
  // linear_add's plan: its K split, so its sums
  const MmaPlan plan = mma_plan(reinterpret_cast<const void*>(plain), smem, ceil_div(p.lin.rows, 16),
                                p.lin.cols / MmaSeg<BITS>::VALS, 1);
  p.lin.ks = plan.ks;
  // both rows of the grid in one wave where they fit: G CTAs a row, at least the projection's
  int per_sm = 0;
  LILY_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, MMA_THREADS, smem));
  const int64_t half = int64_t(num_sms()) * std::max(per_sm, 1) / 2;
  const RoutePlan rp = route_plan(fold.rows, p.route.P, std::max<int64_t>(half, plan.grid));
  p.route.rpw = rp.rpw, p.route.Q = rp.Q;
  launch(kernel, dim3(unsigned(std::max(plan.grid, rp.ctas)), 2), MMA_THREADS, smem, p);
  LILY_CUDA_LAUNCHED();
}

void linear_add_route(const QMatrix& w, const RouteFold& fold, const Tensor& x, const Tensor& res, const Tensor& tmp,
                      float eps, const ops::MoeScratch& s, int top_k, const Tensor& sync) {
  LILY_CHECK(fold.rows > 0 && fold.H == w.rows && fold.A == w.cols && use_gemv_mma(w, 0, x) && is_aligned16(res.data) &&
                 s.down.numel() >= route_parts(fold) * fold.rows && top_k <= 32,
             "linear_add_route: unsupported operands (linear_add_route_supported)");
  LinearRouteParams p{};
  p.lin.w = static_cast<const uint32_t*>(w.weight.data());
  p.lin.scales = static_cast<const uint16_t*>(w.scales.data());
  p.lin.biases = static_cast<const uint16_t*>(w.biases.data());
  p.lin.x = x.ptr<float>();
  p.lin.y = tmp.ptr<float>();
  p.lin.rows = int(w.rows);
  p.lin.cols = int(w.cols);
  p.lin.group_shift = log2_of(w.group_size);
  const DecodeRouting r = moe_decode_routing(s, fold.rows - 1, top_k);
  RouteParams& q = p.route;
  q.wm = static_cast<const float*>(fold.wm.data());
  q.x = res.ptr<float>();
  q.a = x.ptr<float>();
  q.y = tmp.ptr<float>();
  q.partial = s.down.ptr<float>();
  q.topk_id = r.topk_id, q.topk_w = r.topk_w, q.shared_gate = r.shared_gate;
  q.done = static_cast<unsigned*>(sync.data);
  q.R = int(fold.rows), q.H = int(fold.H), q.A = int(fold.A), q.P = int(route_parts(fold));
  q.E = q.R - 1, q.K = top_k;
  q.eps = eps;
  const int halves = mma_group_halves(w.bits, w.group_size);
  if (w.bits == 4) return halves == 1 ? launch_linear_route<4, 1>(p, fold) : launch_linear_route<4, 2>(p, fold);
  if (w.bits == 8) return halves == 1 ? launch_linear_route<8, 1>(p, fold) : launch_linear_route<8, 2>(p, fold);
  fail("linear_add_route: unsupported bits ", w.bits);
}

}  // namespace lily::cuda
