// CPU check of the GEMV's normed input (csrc/cuda/kernels/gemv_mma.cuh, mma_stage_normed_x) against the
// RMSNorm kernels whose h it replaces (kernels/norms.cuh: rms_norm_kernel's row_inv_rms, add_rms_norm_kernel
// and grid_tail_rms_norm, which share one order): both thread mappings transcribed with the device's
// float operations, for every D the fused path takes (norm_threads(D) = MMA_THREADS, D <= MMA_NORM_MAX_COLS,
// whole 64-value segments), over random rows; the sums of squares, the scales and the staged values must
// agree bit for bit. sq4 is evaluated as ptxas compiles it in both kernels (y*y, then FFMAs of x, z and w:
// the same SASS in linear_gemv_mma_kernel's staging and moe_down_mma_kernel's tail), block_sum as its two
// xor-shuffle trees. A negative control (D = 1024: rms_norm's 128 threads, not the CTA's 256) must differ
// for some rows, so the comparison can fail. Built with nvcc as host code; prints FAIL on any mismatch.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/kernels/gemv_mma.cuh"

using namespace lily::cuda;

static float sq4_dev(const float* v) {
  return std::fmaf(v[3], v[3], std::fmaf(v[2], v[2], std::fmaf(v[0], v[0], v[1] * v[1])));
}

// block_sum (common.cuh) of one value per thread: each warp's xor tree (v += shfl_xor(v, o), o = 16..1),
// then the warps' sums, zeros past the last warp, through a second tree; every thread gets lane 0's.
static float block_sum(std::vector<float> v) {
  auto tree = [](float* w) {
    for (int o = 16; o > 0; o >>= 1) {
      float t[32];
      for (int l = 0; l < 32; ++l) t[l] = w[l] + w[l ^ o];
      std::memcpy(w, t, sizeof t);
    }
  };
  float red[32] = {};
  for (size_t w = 0; w < v.size() / 32; ++w) {
    tree(&v[32 * w]);
    red[w] = v[32 * w];
  }
  tree(red);
  return red[0];
}

// The norms' sum: nt = norm_threads(D) threads of a block of B >= nt (threads past nt add zeros), thread t
// adding sq4 of float4s t, t + nt, ... in that order (grid_tail_rms_norm's cached path: i = t + j nt, j
// ascending, the same terms).
static float norm_ss(const float* x, int D, int nt, int B) {
  std::vector<float> part(B, 0.f);
  for (int t = 0; t < nt; ++t) {
    float ss = 0.f;
    for (int i = t; i < D / 4; i += nt) ss += sq4_dev(x + 4 * i);
    part[t] = ss;
  }
  return block_sum(part);
}

// mma_stage_normed_x's sum: thread t < D/8 stores sq4 of its octet's float4s 2t, 2t+1 into sq; then
// thread t adds sq[t + j MMA_THREADS] (< D/4), j ascending, and the CTA's block_sum.
static float staged_ss(const float* x, int D) {
  std::vector<float> sq(MMA_NORM_MAX_COLS / 4), part(MMA_THREADS);
  for (int t = 0; t < D / 8; ++t) sq[2 * t] = sq4_dev(x + 8 * t), sq[2 * t + 1] = sq4_dev(x + 8 * t + 4);
  for (int t = 0; t < MMA_THREADS; ++t) {
    float ss = 0.f;
    for (int j = 0; j < MMA_NORM_MAX_COLS / 4 / MMA_THREADS; ++j)
      if (t + j * MMA_THREADS < D / 4) ss += sq[t + j * MMA_THREADS];
    part[t] = ss;
  }
  return block_sum(part);
}

static uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Rows of D values with a spread of magnitudes and outliers; returns how many rows differ in the sum,
// and in `values` how many staged values differ from the norm's h = (x * s) * w.
static int compare(int D, int nt, int rows, std::mt19937& rng, long& values) {
  const float eps = 1e-6f;
  std::vector<float> x(D), w(D);
  int differ = 0;
  for (int r = 0; r < rows; ++r) {
    const float scale = std::exp2(float(int(rng() % 17) - 8));
    for (int j = 0; j < D; ++j) {
      x[j] = std::normal_distribution<float>(0.f, 1.f)(rng) * std::exp2(float(int(rng() % 9) - 4)) * scale;
      if (rng() % 97 == 0) x[j] *= 50.f;
      w[j] = std::uniform_real_distribution<float>(0.5f, 1.5f)(rng);
    }
    const float a = norm_ss(x.data(), D, nt, MMA_THREADS), b = staged_ss(x.data(), D);
    differ += bits(a) != bits(b);
    const float sa = 1.f / std::sqrt(a / float(D) + eps), sb = 1.f / std::sqrt(b / float(D) + eps);
    for (int j = 0; j < D; ++j) values += bits(x[j] * sa * w[j]) != bits(x[j] * sb * w[j]);
  }
  return differ;
}

int main() {
  std::mt19937 rng(11);
  bool ok = true;
  int cases = 0;
  for (int D = 64; D <= MMA_NORM_MAX_COLS; D += 64) {
    if (norm_threads(D) != MMA_THREADS) continue;
    long values = 0;
    const int rows = D == 2048 ? 400 : 40;
    const int differ = compare(D, norm_threads(D), rows, rng, values);
    std::printf("%s D = %d: %d rows, %d sums and %ld values differ\n", differ || values ? "FAIL" : "ok  ", D, rows,
                differ, values);
    ok &= differ == 0 && values == 0;
    ++cases;
  }
  long values = 0;  // negative control: another order must show
  const int differ = compare(1024, norm_threads(1024), 200, rng, values);
  std::printf("%s control D = 1024 (%d norm threads): %d of 200 sums differ\n", differ ? "ok  " : "FAIL",
              norm_threads(1024), differ);
  ok &= differ > 0 && cases == 16;
  std::printf(ok ? "norm_in_emu: all passed\n" : "norm_in_emu: FAILED\n");
  return ok ? 0 : 1;
}
