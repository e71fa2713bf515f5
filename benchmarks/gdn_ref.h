// Host side of the GDN labs (benchmarks/gdn_lab.cu, benchmarks/gdn_emu.cpp): random realistic inputs
// and the sequential Gated DeltaNet recurrence of cpu/gated_delta.cpp, in fp64 (the reference) and in
// fp32 (the CPU op's own arithmetic), for a subset of value heads.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace gdn_ref {

// FNV-1a over the bits of v (the labs' bit hashes: a value-preserving kernel change leaves them alone).
inline uint64_t fnv1a(const std::vector<float>& v) {
  uint64_t h = 1469598103934665603ull;
  for (float f : v) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    for (int i = 0; i < 4; ++i) h = (h ^ ((u >> (8 * i)) & 0xffu)) * 1099511628211ull;
  }
  return h;
}

struct Inputs {
  int T, Hk, Hv, D;
  std::vector<float> qkv, a, b, A_log, dt_bias, state;  // [T, 2HkD + HvD], [T, Hv] x2, [Hv] x2, [Hv, D, D]
  int64_t width() const { return int64_t(2 * Hk + Hv) * D; }
};

// decay: 0 as tests/gpu/test_gated_delta.py's gdn_inputs (g ~ -0.1 .. -5 per token);
// 1: every 3rd chunk's first 40 tokens decay hard (g ~ -10 .. -100), as the tests' strong_decay(mixed);
// 2: model-like, the ranges of Qwen3-Next's initialisation: exp(A_log) log-uniform in [1, 16],
//    softplus(dt_bias) log-uniform in [1e-3, 1e-1], a ~ 0.5 N(0, 1): g ~ -4e-4 .. -4 per token, most
//    heads remembering tens to thousands of tokens (a state error then lives over many chunks).
// q, k, v ~ N(0, 1) pre-norm, beta = sigmoid(N(0,1)) in (0, 1), S ~ 0.1 N(0, 1) (state_scale).
// corr > 0: the q rows and the k rows of a key head share a direction with weight sqrt(corr) (cosine
// ~corr between two keys; (I + A) is then far from I), as keys out of a SiLU do to a lesser degree.
inline Inputs make_inputs(int T, int Hk, int Hv, int D, uint64_t seed, int decay, float state_scale = 0.1f,
                          float corr = 0.f) {
  Inputs x{T, Hk, Hv, D, {}, {}, {}, {}, {}, {}};
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> ud(-1.f, 1.f);
  x.qkv.resize(size_t(T) * x.width());
  for (auto& v : x.qkv) v = nd(rng);
  x.a.resize(size_t(T) * Hv);
  x.b.resize(size_t(T) * Hv);
  for (auto& v : x.a) v = nd(rng);
  for (auto& v : x.b) v = nd(rng);
  x.A_log.resize(Hv);
  x.dt_bias.resize(Hv);
  for (auto& v : x.A_log) v = ud(rng);
  for (auto& v : x.dt_bias) v = nd(rng);
  if (decay) {
    for (int t = 0; t < T; ++t)
      if ((t / 64) % 3 == 1 && t % 64 < 40)
        for (int h = 0; h < Hv; ++h) x.a[size_t(t) * Hv + h] += 12.f;
    for (auto& v : x.A_log) v += 1.5f;
  }
  x.state.resize(size_t(Hv) * D * D);
  for (auto& v : x.state) v = state_scale * nd(rng);
  // (draws for decay 2 and corr come after all others: the inputs of the other cases keep their bits)
  if (decay == 2) {
    std::uniform_real_distribution<float> u01(0.f, 1.f);
    for (int h = 0; h < Hv; ++h) {
      const float dt = std::exp(std::log(1e-3f) + u01(rng) * std::log(100.f));
      x.A_log[h] = u01(rng) * std::log(16.f);
      x.dt_bias[h] = dt + std::log(-std::expm1(-dt));  // softplus^-1(dt)
    }
    for (auto& v : x.a) v *= 0.5f;
  }
  if (corr > 0.f) {
    const float wc = std::sqrt(corr), wn = std::sqrt(1.f - corr);
    for (int part = 0; part < 2; ++part)  // q rows, k rows
      for (int kh = 0; kh < Hk; ++kh) {
        std::vector<float> dir(D);
        for (auto& v : dir) v = nd(rng);
        for (int t = 0; t < T; ++t) {
          float* r = x.qkv.data() + int64_t(t) * x.width() + (part * Hk + kh) * D;
          for (int i = 0; i < D; ++i) r[i] = wc * dir[i] + wn * r[i];
        }
      }
  }
  return x;
}

// Sequential recurrence (cpu/gated_delta.cpp's order) for value head h in type R; o [T, D], S [D, D]
// (S starts as the input state).
template <class R>
void run_head(const Inputs& x, int h, std::vector<R>& o, std::vector<R>& S) {
  const int T = x.T, D = x.D, kh = h / (x.Hv / x.Hk);
  const int64_t W = x.width();
  S.assign(x.state.begin() + int64_t(h) * D * D, x.state.begin() + int64_t(h + 1) * D * D);
  o.assign(size_t(T) * D, R(0));
  std::vector<R> q(D), k(D), delta(D);
  const R q_scale = R(1) / std::sqrt(R(D));
  const R rate = -std::exp(R(x.A_log[h]));
  auto normalize = [&](std::vector<R>& v, R scale) {
    R ss = 0;
    for (int i = 0; i < D; ++i) ss += v[i] * v[i];
    const R f = scale / std::sqrt(ss + R(1e-6));
    for (int i = 0; i < D; ++i) v[i] *= f;
  };
  for (int t = 0; t < T; ++t) {
    const float* row = x.qkv.data() + int64_t(t) * W;
    for (int i = 0; i < D; ++i) q[i] = row[kh * D + i], k[i] = row[x.Hk * D + kh * D + i];
    const float* v = row + 2 * x.Hk * D + h * D;
    normalize(q, q_scale);
    normalize(k, R(1));
    const R beta = R(1) / (R(1) + std::exp(-R(x.b[int64_t(t) * x.Hv + h])));
    const R u = R(x.a[int64_t(t) * x.Hv + h]) + R(x.dt_bias[h]);
    const R sp = u > R(20) ? u : std::log1p(std::exp(u));
    const R alpha = std::exp(rate * sp);
    for (auto& s : S) s *= alpha;
    for (int j = 0; j < D; ++j) {
      R m = 0;
      for (int i = 0; i < D; ++i) m += S[int64_t(i) * D + j] * k[i];
      delta[j] = beta * (R(v[j]) - m);
    }
    R* out = o.data() + int64_t(t) * D;
    for (int i = 0; i < D; ++i)
      for (int j = 0; j < D; ++j) {
        S[int64_t(i) * D + j] += k[i] * delta[j];
        out[j] += S[int64_t(i) * D + j] * q[i];
      }
  }
}

// |got - ref| / |ref| (Frobenius), as tests/gpu/test_gated_delta.py's rel_err
template <class R>
double rel_err(const std::vector<float>& got, const std::vector<R>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = double(got[i]) - double(ref[i]);
    num += d * d;
    den += double(ref[i]) * double(ref[i]);
  }
  const double e = std::sqrt(num / std::max(den, 1e-300));
  return std::isnan(e) ? INFINITY : e;  // NaN anywhere (a read of unwritten memory) is a failure
}

// head h's rows of o [T, Hv*D] and its state [D, D] out of the op's outputs
inline std::vector<float> head_o(const std::vector<float>& o, int T, int Hv, int D, int h) {
  std::vector<float> r(size_t(T) * D);
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < D; ++j) r[size_t(t) * D + j] = o[(size_t(t) * Hv + h) * D + j];
  return r;
}
inline std::vector<float> head_state(const std::vector<float>& s, int D, int h) {
  return std::vector<float>(s.begin() + size_t(h) * D * D, s.begin() + size_t(h + 1) * D * D);
}

}  // namespace gdn_ref
