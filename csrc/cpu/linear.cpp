// CPU linear and embedding over dense or MLX-affine weights, computed in float32.
// Each output row is dequantized once per call and dotted with all T input rows, so a prefill chunk
// pays the dequantization once. Threads split the output rows.
#include <vector>

#include "cpu_ops.h"

namespace lily::cpu {

static inline float load_float(const void* base, DType t, int64_t i) {
  switch (t) {
    case DType::F32: return static_cast<const float*>(base)[i];
    case DType::BF16: return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
    case DType::F16: return f16_to_f32(static_cast<const uint16_t*>(base)[i]);
    default: fail("dequantize: unsupported float dtype ", dtype_name(t));
  }
}

void dequantize_row(const QMatrix& w, int64_t e, int64_t r, float* out) {
  const int64_t row = e * w.rows + r, n = w.cols;
  if (!w.quantized()) {
    for (int64_t j = 0; j < n; ++j) out[j] = load_float(w.weight.data(), w.dtype, row * n + j);
    return;
  }
  // MLX affine: element j of the row sits in word j*bits/32 at bit (j*bits)%32, lowest bits first.
  const uint32_t* words = static_cast<const uint32_t*>(w.weight.data()) + row * w.words_per_row();
  const int64_t g0 = row * w.groups_per_row();
  const int bits = w.bits, per_word = 32 / bits;
  const uint32_t mask = (1u << bits) - 1u;
  const int64_t words_per_group = w.group_size / per_word;
  for (int64_t g = 0; g < w.groups_per_row(); ++g) {
    const float scale = load_float(w.scales.data(), w.scale_dtype, g0 + g);
    const float bias = load_float(w.biases.data(), w.scale_dtype, g0 + g);
    for (int64_t m = g * words_per_group; m < (g + 1) * words_per_group; ++m) {
      uint32_t word = words[m];
      for (int k = 0; k < per_word; ++k, word >>= bits) out[m * per_word + k] = scale * float(word & mask) + bias;
    }
  }
}

void linear(const QMatrix& w, int64_t e, const Tensor& x, const Tensor& y) {
  const int64_t T = x.dim(0), in = w.cols, out = w.rows;
  const float* X = x.ptr<float>();  // [T, in]
  float* Y = y.ptr<float>();        // [T, out]
#pragma omp parallel
  {
    std::vector<float> row(in);  // [in] one dequantized weight row
#pragma omp for schedule(static)
    for (int64_t o = 0; o < out; ++o) {
      dequantize_row(w, e, o, row.data());
      for (int64_t t = 0; t < T; ++t) {
        const float* xt = X + t * in;
        float acc = 0.f;
        for (int64_t i = 0; i < in; ++i) acc += row[i] * xt[i];
        Y[t * out + o] = acc;
      }
    }
  }
}

void embedding(const QMatrix& table, const Tensor& ids, const Tensor& y) {
  const int64_t T = ids.dim(0), H = table.cols;
  for (int64_t t = 0; t < T; ++t) dequantize_row(table, 0, ids.ptr<int32_t>()[t], y.ptr<float>() + t * H);
}

}  // namespace lily::cpu
