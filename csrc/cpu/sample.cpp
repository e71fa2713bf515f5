// CPU reference sampler: the canonical algorithm of docs/sampling.md, one numbered step per block,
// plain f32 loops. The CUDA sampler (cuda/kernels/sample.cuh) must choose the same token; it may sum
// in another order, so the two can differ only where a target falls within rounding of a boundary.
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <vector>

#include "../ops/sample_rng.h"
#include "cpu_ops.h"

namespace lily::cpu {

using ops::SamplerParams;
using ops::uniform01;
using ops::SamplerState;

// Step 2: the penalised score. The penalty is one fused multiply-add so that every backend
// rounds it the same way (greedy must be bit-equal across backends).
static float penalised_score(float l, int32_t count, int32_t seen, const SamplerParams& p) {
  float z = l;
  if (p.repetition_penalty != 1.f && seen) z = z > 0.f ? z / p.repetition_penalty : z * p.repetition_penalty;
  if (count > 0) z -= std::fma(p.frequency_penalty, float(count), p.presence_penalty);
  return z;
}

// Step 1: logprobs of the raw logits, the chosen id first, then the top n (ties: lower id first).
static void write_logprobs(const float* l, int64_t V, int n, int64_t chosen, const SamplerState& s) {
  int32_t* ids = s.logprob_ids.ptr<int32_t>();    // [1 + MAX_LOGPROBS]
  float* vals = s.logprob_values.ptr<float>();    // [1 + MAX_LOGPROBS]
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t v = 0; v < V; ++v) m = std::max(m, l[v]);
  // A float running sum over 248K positive terms drifts by ~1e-4 relative; the reference sums in double.
  double sum = 0.0;
  for (int64_t v = 0; v < V; ++v) sum += std::exp(double(l[v]) - m);
  const float lse = float(m + std::log(sum));
  for (int i = 0; i <= ops::MAX_LOGPROBS; ++i) {
    ids[i] = -1;
    vals[i] = -std::numeric_limits<float>::infinity();
  }
  ids[0] = int32_t(chosen);
  vals[0] = l[chosen] - lse;
  const int64_t top = std::min<int64_t>(n, V);
  std::vector<int32_t> order(V);  // [V]
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + top, order.end(),
                    [&](int32_t a, int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
  for (int64_t i = 0; i < top; ++i) {
    ids[1 + i] = order[i];
    vals[1 + i] = l[order[i]] - lse;
  }
}

// Steps 4-8 on the scores z (already divided by the temperature): the chosen id.
static int64_t draw(const std::vector<float>& z, const SamplerParams& p, float u) {
  const int64_t V = int64_t(z.size());
  std::vector<char> keep(V, 1);  // [V]
  if (p.top_k > 0 && p.top_k < V) {  // 5: ties at the k-th largest value are all kept
    std::vector<float> sorted(z);
    std::nth_element(sorted.begin(), sorted.begin() + (p.top_k - 1), sorted.end(), std::greater<float>());
    const float t = sorted[p.top_k - 1];
    for (int64_t v = 0; v < V; ++v) keep[v] = z[v] >= t;
  }
  float m = -std::numeric_limits<float>::infinity();  // 6
  for (int64_t v = 0; v < V; ++v)
    if (keep[v]) m = std::max(m, z[v]);
  std::vector<float> e(V, 0.f);  // [V]
  for (int64_t v = 0; v < V; ++v)
    if (keep[v]) e[v] = z[v] == m ? 1.f : std::exp(z[v] - m);
  if (p.min_p > 0.f)  // 7
    for (int64_t v = 0; v < V; ++v) keep[v] = keep[v] && e[v] >= p.min_p;
  if (p.top_p < 1.f) {  // 8: the smallest set of the largest e whose mass reaches top_p
    std::vector<float> kept;
    float W = 0.f;
    for (int64_t v = 0; v < V; ++v)
      if (keep[v]) {
        kept.push_back(e[v]);
        W += e[v];
      }
    std::sort(kept.begin(), kept.end(), std::greater<float>());
    const float need = p.top_p * W;
    // The id with the largest score is always kept (e = 1), so `kept` is never empty for the finite or
    // -inf logits sample() lets through; the guard only keeps a broken invariant from reading past it.
    float tau = kept.empty() ? 0.f : kept.back(), cum = 0.f;  // rounding may never reach `need`: then keep all
    for (float x : kept) {
      cum += x;
      if (cum >= need) {
        tau = x;
        break;
      }
    }
    for (int64_t v = 0; v < V; ++v) keep[v] = keep[v] && e[v] >= tau;
  }
  float W = 0.f;
  for (int64_t v = 0; v < V; ++v)
    if (keep[v]) W += e[v];
  const float target = u * W;
  float cum = 0.f;
  int64_t last = 0;
  for (int64_t v = 0; v < V; ++v) {
    if (!keep[v]) continue;
    cum += e[v];
    if (cum > target) return v;
    if (e[v] > 0.f) last = v;  // never an id of zero mass (a -inf logit, e.g. masked out)
  }
  return last;
}

void sample(const Tensor& logits, const SamplerParams& p, uint64_t step, const SamplerState& s) {
  const int64_t V = logits.dim(0);
  const float* l = logits.ptr<float>();      // [V]
  int32_t* counts = s.counts.ptr<int32_t>();  // [V]
  int32_t* seen = s.seen.ptr<int32_t>();      // [V]
  for (int64_t v = 0; v < V; ++v)  // 0: NaN logits choose nothing: token -1, state untouched
    if (std::isnan(l[v])) {
      s.token.ptr<int32_t>()[0] = -1;
      return;
    }
  std::vector<float> z(V);                    // [V]
  for (int64_t v = 0; v < V; ++v) z[v] = penalised_score(l[v], counts[v], seen[v], p);
  int64_t chosen = 0;
  if (p.temperature == 0.f) {  // 3: argmax, lowest id on ties
    for (int64_t v = 1; v < V; ++v)
      if (z[v] > z[chosen]) chosen = v;
  } else {
    for (int64_t v = 0; v < V; ++v) z[v] /= p.temperature;  // 4
    chosen = draw(z, p, uniform01(p.seed, step));
  }
  if (p.num_logprobs >= 0) write_logprobs(l, V, p.num_logprobs, chosen, s);
  s.token.ptr<int32_t>()[0] = int32_t(chosen);  // 9
  counts[chosen] += 1;
  seen[chosen] = 1;
}

void apply_token_mask(const Tensor& logits, const Tensor& mask) {
  const int64_t V = logits.dim(0);
  float* l = logits.ptr<float>();                                             // [V]
  const uint32_t* m = reinterpret_cast<const uint32_t*>(mask.ptr<int32_t>());  // [ceil(V/32)]
  for (int64_t v = 0; v < V; ++v)
    if (!((m[v >> 5] >> (v & 31)) & 1u)) l[v] = -std::numeric_limits<float>::infinity();
}

void sampler_mark_seen(const Tensor& ids, const SamplerState& s) {
  const int64_t V = s.seen.dim(0);
  const int32_t* id = ids.ptr<int32_t>();  // [n]
  for (int64_t i = 0; i < ids.dim(0); ++i) {
    LILY_CHECK(id[i] >= 0 && id[i] < V, "sampler_mark_seen: id ", id[i], " at index ", i,
               " is outside the vocabulary [0, ", V, ")");
    s.seen.ptr<int32_t>()[id[i]] = 1;
  }
}

}  // namespace lily::cpu
