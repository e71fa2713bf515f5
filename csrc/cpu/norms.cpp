// CPU RMSNorm variants, float32. rms_norm takes the full multiplier (1+w for Qwen's zero-centred
// norms, folded in at load); gated_rms_norm uses its plain weight and a SiLU gate (GDN output norm).
#include <cmath>

#include "cpu_ops.h"

namespace lily::cpu {

static inline float inv_rms(const float* x, int64_t D, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < D; ++i) ss += x[i] * x[i];
  return 1.f / std::sqrt(ss / float(D) + eps);
}

void rms_norm(const Tensor& x, const Tensor& weight, float eps, const Tensor& y) {
  const int64_t R = x.dim(0), D = x.dim(1);
  const float* w = weight.ptr<float>();
  for (int64_t r = 0; r < R; ++r) {
    const float* xr = x.ptr<float>() + r * D;
    float* yr = y.ptr<float>() + r * D;
    const float s = inv_rms(xr, D, eps);
    for (int64_t i = 0; i < D; ++i) yr[i] = xr[i] * s * w[i];
  }
}

void add_rms_norm(const Tensor& x, const Tensor& res, const Tensor& weight, float eps, const Tensor& y) {
  const int64_t R = x.dim(0), D = x.dim(1);
  const float* w = weight.ptr<float>();
  for (int64_t r = 0; r < R; ++r) {
    float* xr = x.ptr<float>() + r * D;
    const float* rr = res.ptr<float>() + r * D;
    float* yr = y.ptr<float>() + r * D;
    for (int64_t i = 0; i < D; ++i) xr[i] += rr[i];
    const float s = inv_rms(xr, D, eps);
    for (int64_t i = 0; i < D; ++i) yr[i] = xr[i] * s * w[i];
  }
}

void gated_rms_norm(const Tensor& x, const Tensor& z, const Tensor& weight, float eps, const Tensor& y) {
  const int64_t R = x.dim(0), D = x.dim(1);
  const float* w = weight.ptr<float>();
  for (int64_t r = 0; r < R; ++r) {
    const float* xr = x.ptr<float>() + r * D;
    const float* zr = z.ptr<float>() + r * D;
    float* yr = y.ptr<float>() + r * D;
    const float s = inv_rms(xr, D, eps);
    for (int64_t i = 0; i < D; ++i) yr[i] = w[i] * (xr[i] * s) * (zr[i] / (1.f + std::exp(-zr[i])));
  }
}

}  // namespace lily::cpu
