// chain_lab's timeline (benchmarks/chain_lab.cu, persist_chain_kernel<..., TL = true>): the stamps of each
// CTA and phase and their reduction to per-interval medians, host code (tests/emu/chain_lab_emu.cu checks it
// on synthetic stamps).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace lily::cuda::lab {

// Stamps a CTA and phase: [0] dependency satisfied (thread 0's poll returned), [1] x staged (after the
// barrier), [2] the CTA's last math (the latest warp), [3] y stored and fenced (after the barrier that
// follows the fences), [4] the phase counted (after the atomic returned).
constexpr int PS_TL_STAMPS = 5;
struct PsStamp {  // one event: %globaltimer (ns; GPU-wide, possibly coarse) and the SM's clock64
  unsigned long long gt, clk;
};

// Per phase kind (0: A, the even phases; 1: B, the odd ones; phase 0 left out), median and 90th percentile
// over CTAs and phases of: [0] hand-over = dependency satisfied - the previous phase's last count over all
// CTAs, [1] stage x, [2] math, [3] store + fence, [4] count, and [5] phase = last count - the previous
// phase's last count (one value a phase). Event times: per CTA a least-squares line gt = a + b clk through
// all its stamps (%globaltimer may tick at 1 us; clock64 is exact on one SM, and the line puts every SM on
// the global timer). ghz: the SM clock the lines imply, rms: their residual (~0.3 us if the timer ticks at
// 1 us; large if the clock changed during the run), both medians over CTAs; step: the smallest step
// between distinct %globaltimer values.
struct PsTimeline {
  double med[2][6], p90[2][6];
  double ghz, rms;
  unsigned long long step;
};
inline PsTimeline ps_timeline(const std::vector<PsStamp>& st, int phases, int G) {
  auto at = [&](int p, int c, int k) -> const PsStamp& { return st[(size_t(p) * G + c) * PS_TL_STAMPS + k]; };
  auto median = [](std::vector<double>& v, double q) {
    std::sort(v.begin(), v.end());
    return v[std::min(v.size() - 1, size_t(double(v.size()) * q))];
  };
  PsTimeline r{};
  unsigned long long gref = ~0ull;  // times as ns after the earliest stamp (doubles keep ns only near 0)
  for (const PsStamp& s : st) gref = std::min(gref, s.gt);
  std::vector<double> t(st.size()), ghz, rms;
  for (int c = 0; c < G; ++c) {
    const PsStamp& s0 = at(0, c, 0);  // the CTA's first stamp
    auto x_of = [&](const PsStamp& s) { return double(int64_t(s.clk - s0.clk)); };
    auto y_of = [&](const PsStamp& s) { return double(int64_t(s.gt - s0.gt)); };
    double sx = 0, sy = 0, sxx = 0, sxy = 0;
    const int n = phases * PS_TL_STAMPS;
    for (int p = 0; p < phases; ++p)
      for (int k = 0; k < PS_TL_STAMPS; ++k) {
        const double x = x_of(at(p, c, k)), y = y_of(at(p, c, k));
        sx += x, sy += y, sxx += x * x, sxy += x * y;
      }
    const double b = (n * sxy - sx * sy) / (n * sxx - sx * sx), a = (sy - b * sx) / n;
    double r2 = 0;
    for (int p = 0; p < phases; ++p)
      for (int k = 0; k < PS_TL_STAMPS; ++k) {
        const double f = a + b * x_of(at(p, c, k)), e = f - y_of(at(p, c, k));
        t[(size_t(p) * G + c) * PS_TL_STAMPS + k] = double(s0.gt - gref) + f;
        r2 += e * e;
      }
    ghz.push_back(1.0 / b), rms.push_back(std::sqrt(r2 / n));
  }
  r.ghz = median(ghz, 0.5), r.rms = median(rms, 0.5);
  auto T = [&](int p, int c, int k) { return t[(size_t(p) * G + c) * PS_TL_STAMPS + k]; };
  std::vector<unsigned long long> all;
  for (const PsStamp& s : st) all.push_back(s.gt);
  std::sort(all.begin(), all.end());
  r.step = ~0ull;
  for (size_t i = 1; i < all.size(); ++i)
    if (all[i] > all[i - 1]) r.step = std::min(r.step, all[i] - all[i - 1]);
  for (int kind = 0; kind < 2; ++kind) {
    std::vector<double> iv[6];
    for (int p = kind == 0 ? 2 : 1; p < phases; p += 2) {
      double prev = 0, last = 0;
      for (int c = 0; c < G; ++c) prev = std::max(prev, T(p - 1, c, 4)), last = std::max(last, T(p, c, 4));
      for (int c = 0; c < G; ++c) {
        iv[0].push_back(T(p, c, 0) - prev);
        for (int k = 1; k < PS_TL_STAMPS; ++k) iv[k].push_back(T(p, c, k) - T(p, c, k - 1));
      }
      iv[5].push_back(last - prev);
    }
    for (int i = 0; i < 6; ++i) r.med[kind][i] = median(iv[i], 0.5), r.p90[kind][i] = median(iv[i], 0.9);
  }
  return r;
}

}  // namespace lily::cuda::lab
