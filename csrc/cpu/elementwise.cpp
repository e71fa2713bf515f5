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

}  // namespace lily::cpu
