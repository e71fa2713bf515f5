// CPU gated full attention pieces: q/gate split, rotate-half partial RoPE, KV cache append and
// causal GQA softmax attention in float32. Threads split the heads.
#include <cmath>
#include <vector>

#include "cpu_ops.h"

namespace lily::cpu {

void split_q_gate(const Tensor& p, const Tensor& q, const Tensor& gate, int nH) {
  const int64_t T = p.dim(0), D = p.dim(1) / (2 * nH);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < nH; ++h) {
      const float* src = p.ptr<float>() + t * 2 * nH * D + h * 2 * D;  // [query D | gate D]
      std::copy(src, src + D, q.ptr<float>() + (t * nH + h) * D);
      std::copy(src + D, src + 2 * D, gate.ptr<float>() + (t * nH + h) * D);
    }
}

void rope(const Tensor& x, int nH, int rotary_dim, double theta, int64_t pos0) {
  const int64_t T = x.dim(0), D = x.dim(1) / nH, half = rotary_dim / 2;
  // inv_freq and angles in float32, as the reference computes them.
  std::vector<float> inv_freq(half);
  for (int64_t j = 0; j < half; ++j) inv_freq[j] = float(1.0 / std::pow(theta, double(2 * j) / rotary_dim));
  for (int64_t t = 0; t < T; ++t) {
    const float pos = float(pos0 + t);
    for (int64_t j = 0; j < half; ++j) {
      const float ang = pos * inv_freq[j], c = std::cos(ang), s = std::sin(ang);
      for (int64_t h = 0; h < nH; ++h) {
        float* v = x.ptr<float>() + (t * nH + h) * D;
        const float x0 = v[j], x1 = v[j + half];
        v[j] = x0 * c - x1 * s;
        v[j + half] = x1 * c + x0 * s;
      }
    }
  }
}

void kv_cache_write(const Tensor& x, const Tensor& cache, int64_t pos0) {
  const int64_t W = x.dim(1);
  std::copy(x.ptr<float>(), x.ptr<float>() + x.numel(), cache.ptr<float>() + pos0 * W);
}

void attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& o, int nH,
               int nKV, int64_t pos0) {
  const int64_t T = q.dim(0), D = q.dim(1) / nH, group = nH / nKV;
  const float scale = 1.f / std::sqrt(float(D));
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < nH; ++h) {
      const int64_t n = pos0 + t + 1, kvh = h / group;
      const float* qv = q.ptr<float>() + (t * nH + h) * D;
      std::vector<float> p(n);  // [n] scores, then probabilities
      float mx = -INFINITY;
      for (int64_t j = 0; j < n; ++j) {
        const float* kv = k_cache.ptr<float>() + (j * nKV + kvh) * D;
        float s = 0.f;
        for (int64_t d = 0; d < D; ++d) s += qv[d] * kv[d];
        p[j] = s * scale;
        mx = std::max(mx, p[j]);
      }
      float sum = 0.f;
      for (int64_t j = 0; j < n; ++j) sum += (p[j] = std::exp(p[j] - mx));
      float* ov = o.ptr<float>() + (t * nH + h) * D;
      for (int64_t d = 0; d < D; ++d) ov[d] = 0.f;
      for (int64_t j = 0; j < n; ++j) {
        const float pj = p[j] / sum;
        const float* vv = v_cache.ptr<float>() + (j * nKV + kvh) * D;
        for (int64_t d = 0; d < D; ++d) ov[d] += pj * vv[d];
      }
    }
}

}  // namespace lily::cpu
