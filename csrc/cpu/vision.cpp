// CPU vision-tower ops (docs/model.md section 8), float32: LayerNorm, bias, GELU, the resampled
// position table, 2D RoPE and per-image non-causal attention.
#include <cmath>
#include <vector>

#include "cpu_ops.h"

namespace lily::cpu {

void layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps, const Tensor& y) {
  const int64_t R = x.dim(0), D = x.dim(1);
  const float *w = weight.ptr<float>(), *b = bias.ptr<float>();
  for (int64_t r = 0; r < R; ++r) {
    const float* xr = x.ptr<float>() + r * D;
    float* yr = y.ptr<float>() + r * D;
    float mean = 0.f, var = 0.f;
    for (int64_t i = 0; i < D; ++i) mean += xr[i];
    mean /= float(D);
    for (int64_t i = 0; i < D; ++i) var += (xr[i] - mean) * (xr[i] - mean);
    const float s = 1.f / std::sqrt(var / float(D) + eps);
    for (int64_t i = 0; i < D; ++i) yr[i] = (xr[i] - mean) * s * w[i] + b[i];
  }
}

void add_bias(const Tensor& x, const Tensor& bias) {
  const int64_t R = x.dim(0), D = x.dim(1);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < D; ++i) x.ptr<float>()[r * D + i] += bias.ptr<float>()[i];
}

void gelu(const Tensor& x, bool tanh_approx) {
  float* v = x.ptr<float>();
  const float k = std::sqrt(2.f / float(M_PI)), inv_sqrt2 = float(M_SQRT1_2);
  for (int64_t i = 0; i < x.numel(); ++i) {
    const float u = v[i];
    v[i] = tanh_approx ? 0.5f * u * (1.f + std::tanh(k * (u + 0.044715f * u * u * u)))
                       : 0.5f * u * (1.f + std::erf(u * inv_sqrt2));
  }
}

// The two table indices around source coordinate src = i (side-1)/(n-1) and their weights.
static void taps(int32_t i, int n, int64_t side, int64_t idx[2], float w[2]) {
  const float src = float(i) * float(side - 1) / float(n > 1 ? n - 1 : 1);
  const float lo = std::floor(src), frac = src - lo;
  idx[0] = std::min<int64_t>(int64_t(lo), side - 1);
  idx[1] = std::min<int64_t>(int64_t(lo) + 1, side - 1);
  w[0] = 1.f - frac;
  w[1] = frac;
}

void vision_position_embedding(const Tensor& table, const Tensor& pos, int grid_h, int grid_w, const Tensor& y) {
  const int64_t n = pos.dim(0), W = table.dim(1);
  int64_t side = 0;
  while ((side + 1) * (side + 1) <= table.dim(0)) ++side;
  for (int64_t i = 0; i < n; ++i) {
    int64_t ri[2], ci[2];
    float rw[2], cw[2];
    taps(pos.ptr<int32_t>()[2 * i], grid_h, side, ri, rw);
    taps(pos.ptr<int32_t>()[2 * i + 1], grid_w, side, ci, cw);
    float* yr = y.ptr<float>() + i * W;
    std::vector<float> acc(W, 0.f);
    for (int a = 0; a < 2; ++a)
      for (int b = 0; b < 2; ++b) {
        const float w = rw[a] * cw[b];
        const float* t = table.ptr<float>() + (ri[a] * side + ci[b]) * W;
        for (int64_t j = 0; j < W; ++j) acc[j] += t[j] * w;
      }
    for (int64_t j = 0; j < W; ++j) yr[j] += acc[j];
  }
}

void vision_rope(const Tensor& qkv, const Tensor& pos, int nH, double theta) {
  const int64_t N = qkv.dim(0), D = qkv.dim(1) / (3 * nH), half = D / 2, F = D / 4;
  std::vector<float> inv_freq(F);  // float32, as the reference computes them
  for (int64_t j = 0; j < F; ++j) inv_freq[j] = float(1.0 / std::pow(theta, double(2 * j) / double(half)));
  for (int64_t t = 0; t < N; ++t) {
    const float row = float(pos.ptr<int32_t>()[2 * t]), col = float(pos.ptr<int32_t>()[2 * t + 1]);
    for (int64_t d = 0; d < half; ++d) {
      const float ang = d < F ? row * inv_freq[d] : col * inv_freq[d - F], c = std::cos(ang), s = std::sin(ang);
      for (int64_t h = 0; h < 2 * nH; ++h) {  // the query heads, then the key heads
        float* v = qkv.ptr<float>() + t * 3 * nH * D + h * D;
        const float x0 = v[d], x1 = v[d + half];
        v[d] = x0 * c - x1 * s;
        v[d + half] = x1 * c + x0 * s;
      }
    }
  }
}

void mrope(const Tensor& x, int nH, int rotary_dim, double theta, const std::array<int, 3>& sections,
           const Tensor& pos) {
  const int64_t T = x.dim(0), D = x.dim(1) / nH, half = rotary_dim / 2;
  std::vector<float> inv_freq(half);  // as cpu::rope computes them
  std::vector<int> axis(half);        // 0: t, 1: h, 2: w
  for (int64_t j = 0; j < half; ++j) {
    inv_freq[j] = float(1.0 / std::pow(theta, double(2 * j) / rotary_dim));
    axis[j] = j % 3 == 1 && j < 3 * sections[1] ? 1 : j % 3 == 2 && j < 3 * sections[2] ? 2 : 0;
  }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < half; ++j) {
      const float ang = float(pos.ptr<int32_t>()[3 * t + axis[j]]) * inv_freq[j], c = std::cos(ang),
                  s = std::sin(ang);
      for (int64_t h = 0; h < nH; ++h) {
        float* v = x.ptr<float>() + (t * nH + h) * D;
        const float x0 = v[j], x1 = v[j + half];
        v[j] = x0 * c - x1 * s;
        v[j + half] = x1 * c + x0 * s;
      }
    }
}

void vision_attention(const Tensor& qkv, const Tensor& o, const Tensor& starts, int nH) {
  const int64_t W = qkv.dim(1) / 3, D = W / nH, images = starts.dim(0) - 1;
  const float scale = 1.f / std::sqrt(float(D));
  const int32_t* st = starts.ptr<int32_t>();
  for (int64_t img = 0; img < images; ++img) {
    const int64_t s0 = st[img], s1 = st[img + 1];
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t t = s0; t < s1; ++t)
      for (int64_t h = 0; h < nH; ++h) {
        const float* q = qkv.ptr<float>() + t * 3 * W + h * D;
        std::vector<float> p(size_t(s1 - s0));
        float mx = -INFINITY;
        for (int64_t s = s0; s < s1; ++s) {
          const float* k = qkv.ptr<float>() + s * 3 * W + W + h * D;
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot += q[d] * k[d];
          p[s - s0] = dot * scale;
          mx = std::max(mx, p[s - s0]);
        }
        float sum = 0.f;
        for (float& v : p) sum += (v = std::exp(v - mx));
        float* out = o.ptr<float>() + t * W + h * D;
        for (int64_t d = 0; d < D; ++d) out[d] = 0.f;
        for (int64_t s = s0; s < s1; ++s) {
          const float* v = qkv.ptr<float>() + s * 3 * W + 2 * W + h * D;
          const float w = p[s - s0] / sum;
          for (int64_t d = 0; d < D; ++d) out[d] += w * v[d];
        }
      }
  }
}

}  // namespace lily::cpu
