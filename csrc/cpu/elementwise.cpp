#include <algorithm>
#include <cmath>

#include "cpu_ops.h"

namespace lily::cpu {

void sigmoid_mul(const Tensor& x, const Tensor& gate) {
  float* X = x.ptr<float>();
  const float* G = gate.ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) X[i] *= 1.f / (1.f + std::exp(-G[i]));
}

void add(const Tensor& x, const Tensor& y) {
  float* X = x.ptr<float>();
  const float* Y = y.ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) X[i] += Y[i];
}

void split_columns(const Tensor& y, const Tensor* outs, int n) {
  const int64_t T = y.dim(0), W = y.dim(1);
  int64_t begin = 0;
  for (int i = 0; i < n; ++i) {
    const int64_t w = outs[i].dim(1);
    for (int64_t r = 0; r < T; ++r)
      std::copy_n(y.ptr<float>() + r * W + begin, w, outs[i].ptr<float>() + r * w);
    begin += w;
  }
}

}  // namespace lily::cpu
