// CPU sparse MoE: fp32 softmax router over all experts, top-k, renormalise; tokens grouped by
// expert so each expert's weights are dequantized once per call; SwiGLU experts; the shared expert
// scaled by its per-token sigmoid gate. Sums in float32, experts in ascending id order.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "cpu_ops.h"

namespace lily::cpu {

static Tensor rows(const Tensor& t, int64_t n) { return Tensor::of(t.data, DType::F32, t.device, {n, t.dim(1)}); }

// y[:n] = down_e(silu(gate_e x) * up_e x) for n tokens x [n, H].
static void swiglu_expert(const QMatrix& gate, const QMatrix& up, const QMatrix& down, int64_t e,
                          const Tensor& x, const ops::MoeScratch& s, int64_t n) {
  const int64_t I = gate.rows;
  Tensor g = Tensor::of(s.gate.data, DType::F32, s.gate.device, {n, I});
  Tensor u = Tensor::of(s.up.data, DType::F32, s.up.device, {n, I});
  linear(gate, e, x, g);
  linear(up, e, x, u);
  float* G = g.ptr<float>();
  const float* U = u.ptr<float>();
  for (int64_t i = 0; i < n * I; ++i) G[i] = G[i] / (1.f + std::exp(-G[i])) * U[i];
  linear(down, e, g, rows(s.down, n));
}

void moe(const MoeWeights& w, const Tensor& h, const Tensor& out, const ops::MoeScratch& s, int K) {
  const int64_t T = h.dim(0), H = h.dim(1), E = w.router->rows;
  // As on the GPU, a decode step runs the router and the shared-expert gate as one product over
  // their stacked rows: E logits, then the gate logit, in router_logits' first E + 1 floats.
  const bool stacked = T == 1 && w.router_gates && s.router_logits.dim(0) >= 2;
  Tensor logits = rows(s.router_logits, T);  // [T, E]
  Tensor sg = stacked ? Tensor::of(logits.ptr<float>() + E, DType::F32, h.device, {1, 1})
                      : rows(s.shared_gate, T);  // [T, 1]
  if (stacked) {
    linear(*w.router_gates, 0, h, Tensor::of(logits.data, DType::F32, h.device, {1, E + 1}));
  } else {
    linear(*w.router, 0, h, logits);
    linear(*w.shared_expert_gate, 0, h, sg);
  }

  // Routing: per expert, the (token, weight) pairs that chose it.
  std::vector<std::vector<std::pair<int64_t, float>>> routed(E);
  std::vector<int64_t> order(E);
  std::vector<float> p(E);
  for (int64_t t = 0; t < T; ++t) {
    const float* l = logits.ptr<float>() + t * E;
    const float mx = *std::max_element(l, l + E);
    float sum = 0.f;
    for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(l[e] - mx));
    for (int64_t e = 0; e < E; ++e) p[e] /= sum;
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + K, order.end(),
                      [&](int64_t x, int64_t y) { return p[x] > p[y] || (p[x] == p[y] && x < y); });
    float top = 0.f;
    for (int k = 0; k < K; ++k) top += p[order[k]];
    for (int k = 0; k < K; ++k) routed[order[k]].push_back({t, p[order[k]] / top});
  }

  float* O = out.ptr<float>();  // [T, H]
  std::fill(O, O + T * H, 0.f);
  for (int64_t e = 0; e < E; ++e) {
    const auto& toks = routed[e];
    const int64_t n = int64_t(toks.size());
    if (n == 0) continue;
    for (int64_t i = 0; i < n; ++i)
      std::copy(h.ptr<float>() + toks[i].first * H, h.ptr<float>() + (toks[i].first + 1) * H,
                s.gathered.ptr<float>() + i * H);
    swiglu_expert(*w.gate_proj, *w.up_proj, *w.down_proj, e, rows(s.gathered, n), s, n);
    for (int64_t i = 0; i < n; ++i) {
      const float* d = s.down.ptr<float>() + i * H;
      float* o = O + toks[i].first * H;
      for (int64_t j = 0; j < H; ++j) o[j] += toks[i].second * d[j];
    }
  }

  swiglu_expert(*w.shared_gate_proj, *w.shared_up_proj, *w.shared_down_proj, 0, h, s, T);
  for (int64_t t = 0; t < T; ++t) {
    const float gate = 1.f / (1.f + std::exp(-sg.ptr<float>()[t]));
    const float* d = s.down.ptr<float>() + t * H;
    for (int64_t j = 0; j < H; ++j) O[t * H + j] += gate * d[j];
  }
}

}  // namespace lily::cpu
