// Launchers of the RMSNorm kernels (kernels/norms.cuh): one block per row, or for rms_norm and
// gated_rms_norm over rows of <= 256 floats one warp per row, NORM_WARP_ROWS rows a block.
#include "cuda_ops.h"
#include "kernels/norms.cuh"
#include "linear.h"
#include "../runtime/cuda_device.h"

namespace lily::cuda {

static bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Four floats per access when every row starts on a 16-byte boundary.
static bool can_use_vec4(int64_t D, std::initializer_list<const void*> ptrs) {
  if (D % 4 != 0) return false;
  for (const void* p : ptrs)
    if (p && !aligned16(p)) return false;
  return true;
}

NormTail norm_tail(const Tensor& x, const Tensor& weight, float eps, const Tensor& y, const Tensor& sync) {
  const int64_t D = x.dim(1);
  return NormTail{x.ptr<float>(), weight.ptr<float>(), y.ptr<float>(), reinterpret_cast<unsigned*>(sync.data),
                  int(D), norm_threads(D), eps, can_use_vec4(D, {x.data, weight.data, y.data})};
}

// The row count as RmsNormParams holds it (int: R <= 2^31 - 1, as a grid of one block per row needs).
static int norm_rows(int64_t R, const char* op) {
  LILY_CHECK(R <= 0x7fffffff, op, ": too many rows for the CUDA grid (", R, ")");
  return int(R);
}

template <bool GATED>
static void launch_rms_norm(const RmsNormParams& p, bool vec4) {
  if (p.R == 0) return;
  constexpr int W = NORM_WARP_ROWS;
  const unsigned warp_grid = unsigned(ceil_div<int64_t>(p.R, W));
  if (norm_threads(p.D) == 32)  // a warp per row where a row's block would be one warp: the same bits
    launch(vec4 ? rms_norm_kernel<GATED, true, W> : rms_norm_kernel<GATED, false, W>, warp_grid, 32 * W, 0, p);
  else
    launch(vec4 ? rms_norm_kernel<GATED, true, 1> : rms_norm_kernel<GATED, false, 1>, unsigned(p.R),
           unsigned(norm_threads(p.D)), 0, p);
  LILY_CUDA_LAUNCHED();
}

void rms_norm(const Tensor& x, const Tensor& weight, float eps, const Tensor& y) {
  const int64_t D = x.dim(1);
  const RmsNormParams p{x.ptr<float>(), nullptr, weight.ptr<float>(), y.ptr<float>(), norm_rows(x.dim(0), "rms_norm"),
                        int(D), eps};
  launch_rms_norm<false>(p, can_use_vec4(D, {p.x, p.w, p.y}));
}

// The parameters of add_rms_norm_kernel for x += res, y = rms_norm(x) * weight (y empty, add_rms_norm_xb for
// readers of the Xb only: no F32 y; the float4 choice then rests on x and w) and yb, and that choice.
static AddRmsNormLaunch add_rms_norm_launch(const Tensor& x, const Tensor& res, const Tensor& weight, float eps,
                                            const Tensor& y, uint16_t* yb) {
  const int64_t D = x.dim(1);
  LILY_CHECK(x.dim(0) <= 0x7fffffff, "add_rms_norm: too many rows for the CUDA grid (", x.dim(0), ")");
  return {AddRmsNormParams{x.ptr<float>(), res.ptr<float>(), weight.ptr<float>(), y.ptr<float>(), int(D), eps,
                           can_use_vec4(D, {res.data}), yb},
          can_use_vec4(D, {x.data, weight.data, y.data})};  // as rms_norm decides: the same summation order
}

// The float4 path stages the row in D * 4 bytes of shared memory where that fits the default 48 KB (add_rms_norm_row).
static void run_add_rms_norm(const Tensor& x, const AddRmsNormLaunch& l) {
  if (x.dim(0) == 0) return;
  const dim3 grid{unsigned(x.dim(0))}, block{unsigned(norm_threads(l.p.D))};
  const size_t stage = l.vec4 && l.p.D * 4 <= 48 * 1024 ? size_t(l.p.D) * 4 : 0;
  launch(l.vec4 ? add_rms_norm_kernel<true> : add_rms_norm_kernel<false>, grid, block, stage, l.p);
  LILY_CUDA_LAUNCHED();
}

void add_rms_norm(const Tensor& x, const Tensor& res, const Tensor& weight, float eps, const Tensor& y) {
  run_add_rms_norm(x, add_rms_norm_launch(x, res, weight, eps, y, nullptr));
}

AddRmsNormLaunch add_rms_norm_xb_launch(const Tensor& x, const Tensor& res, const Tensor& weight, float eps,
                                        const Tensor& y, const Tensor& xb) {
  LILY_CHECK(x.dim(1) % 8 == 0 && aligned16(xb.data), "add_rms_norm_xb: rows of ", x.dim(1),
             " values or an unaligned workspace: no bf16 X");
  return add_rms_norm_launch(x, res, weight, eps, y, xb.ptr<uint16_t>());
}

void add_rms_norm_xb(const Tensor& x, const Tensor& res, const Tensor& weight, float eps, const Tensor& y,
                     const Tensor& xb) {
  run_add_rms_norm(x, add_rms_norm_xb_launch(x, res, weight, eps, y, xb));
}

void gated_rms_norm_xb(const Tensor& x, const Tensor& z, const Tensor& weight, float eps, const Tensor& xb) {
  const int64_t D = x.dim(1);
  RmsNormParams p{x.ptr<float>(), z.ptr<float>(), weight.ptr<float>(), nullptr,
                  norm_rows(x.dim(0), "gated_rms_norm_xb"), int(D), eps};
  p.yb = xb.ptr<uint16_t>();
  LILY_CHECK(D % 8 == 0 && aligned16(p.yb), "gated_rms_norm_xb: rows of ", D,
             " floats or an xb address off 16 bytes do not allow 16-byte Xb stores");
  launch_rms_norm<true>(p, can_use_vec4(D, {p.x, p.z, p.w}));  // as gated_rms_norm decides: the same s
}

void gated_rms_norm(const Tensor& x, const Tensor& z, const Tensor& weight, float eps, const Tensor& y) {
  const int64_t D = x.dim(1);
  const RmsNormParams p{x.ptr<float>(), z.ptr<float>(), weight.ptr<float>(), y.ptr<float>(),
                        norm_rows(x.dim(0), "gated_rms_norm"), int(D), eps};
  launch_rms_norm<true>(p, can_use_vec4(D, {p.x, p.z, p.w, p.y}));
}

}  // namespace lily::cuda
