// CPU check of the MoE block's normed input (ops::moe_rms_normed_add) against the RMSNorm kernels whose h it
// replaces (kernels/norms.cuh: grid_tail_rms_norm in out_proj / o_proj, add_rms_norm_kernel and
// rms_norm_kernel, which share one order). Its two readers of the residual row x stage h = rms_norm(x) * w
// themselves for D = ROUTER_COLS = 2048:
// - moe_router_kernel's two staging warps (kernels/moe_router.cuh, router_inv_rms): 32 lanes each holding 8
//   float4s, the norm's 256 sums and block_sum recombined from register pairs, three shuffles, one partial
//   a lane octet exchanged between the warps, and two more shuffles;
// - moe_up_mma_kernel (mma_stage_normed_x: the 256 threads of the CTA, as linear_rms_normed's GEMV).
// Both are transcribed with the device's float operations (sq4 as ptxas compiles it: y*y, then FFMAs of x,
// z and w; an xor shuffle as the partner lane's value added to one's own) over random rows; every lane's
// sum of squares, hence s and the staged values, must equal the norms' bit for bit. A negative control (the
// router's in-register step adding f and f ^ 1 first, the order of another tree) must differ for some rows.
// Built with nvcc as host code; prints FAIL on any mismatch.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/kernels/gemv_mma.cuh"
#include "cuda/kernels/moe_router.cuh"

using namespace lily::cuda;

constexpr int D = ROUTER_COLS;
constexpr int F = GemvShape<8>::F;  // float4s per 16-byte weight chunk: chunk c is float4s F c .. F c + F - 1

static float sq4_dev(const float* v) {
  return std::fmaf(v[3], v[3], std::fmaf(v[2], v[2], std::fmaf(v[0], v[0], v[1] * v[1])));
}

static void xor_tree(float* w, int from, int to = 1) {  // w[l] += w[l ^ o] over 32 lanes, o = from, .., to
  for (int o = from; o >= to; o >>= 1) {
    float t[32];
    for (int l = 0; l < 32; ++l) t[l] = w[l] + w[l ^ o];
    std::memcpy(w, t, sizeof t);
  }
}

// The norms' sum: norm_threads(D) = 256 threads, thread t adding sq4 of float4s t, t + 256 (from 0), then
// block_sum (common.cuh): each warp's xor tree, the 8 warp sums and 24 zeros through a second one.
static float norm_ss(const float* x) {
  const int nt = norm_threads(D);
  std::vector<float> part(nt, 0.f);
  for (int t = 0; t < nt; ++t) {
    float ss = 0.f;
    for (int i = t; i < D / 4; i += nt) ss += sq4_dev(x + 4 * i);
    part[t] = ss;
  }
  float red[32] = {};
  for (int w = 0; w < nt / 32; ++w) {
    xor_tree(&part[32 * w], 16);
    red[w] = part[32 * w];
  }
  xor_tree(red, 16);
  return red[0];
}

// router_inv_rms's sum in every lane of both staging warps (ss[sw][32]); `control` adds f ^ 1 before f ^ 2 in
// the registers. Lane l of warp sw holds chunks l + 32 (sw + 2 k), k < 2: v[k][f] is float4 F (l + 32 (sw +
// 2 k)) + f.
static void router_ss(const float* x, bool control, float (*ss)[32]) {
  float part[2][4];
  for (int sw = 0; sw < 2; ++sw) {
    float u[32][4];
    for (int l = 0; l < 32; ++l)
      for (int f = 0; f < 4; ++f) {
        float s = 0.f;
        s += sq4_dev(x + 4 * (F * (l + 32 * sw) + f));
        s += sq4_dev(x + 4 * (F * (l + 32 * (sw + 2)) + f));
        u[l][f] = s;
      }
    for (int o = 4; o > 0; o >>= 1) {
      float t[32][4];
      for (int l = 0; l < 32; ++l)
        for (int f = 0; f < 4; ++f) t[l][f] = u[l][f] + u[l ^ o][f];
      std::memcpy(u, t, sizeof t);
    }
    for (int l = 0; l < 32; l += 8)
      part[sw][l / 8] = control ? (u[l][0] + u[l][1]) + (u[l][2] + u[l][3]) : (u[l][0] + u[l][2]) + (u[l][1] + u[l][3]);
  }
  for (int sw = 0; sw < 2; ++sw) {
    for (int l = 0; l < 32; ++l) ss[sw][l] = part[0][l / 8] + part[1][l / 8];
    xor_tree(ss[sw], 16, 8);  // the shuffles at 16 and 8
  }
}

// mma_stage_normed_x's sum for K = D: thread t stores sq4 of its octet's float4s 2t, 2t + 1 into sq; then
// thread t adds sq[t + j MMA_THREADS] (< D / 4), j ascending, and the CTA's block_sum.
static float up_ss(const float* x) {
  std::vector<float> sq(MMA_NORM_MAX_COLS / 4), part(MMA_THREADS);
  for (int t = 0; t < D / 8; ++t) sq[2 * t] = sq4_dev(x + 8 * t), sq[2 * t + 1] = sq4_dev(x + 8 * t + 4);
  for (int t = 0; t < MMA_THREADS; ++t) {
    float ss = 0.f;
    for (int j = 0; j < MMA_NORM_MAX_COLS / 4 / MMA_THREADS; ++j)
      if (t + j * MMA_THREADS < D / 4) ss += sq[t + j * MMA_THREADS];
    part[t] = ss;
  }
  float red[32] = {};
  for (int w = 0; w < MMA_THREADS / 32; ++w) {
    xor_tree(&part[32 * w], 16);
    red[w] = part[32 * w];
  }
  xor_tree(red, 16);
  return red[0];
}

static uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

int main() {
  std::mt19937 rng(12);
  const float eps = 1e-6f;
  const int rows = 2000;
  std::vector<float> x(D), w(D);
  int router_differ = 0, lanes_differ = 0, up_differ = 0, control_differ = 0;
  long values = 0;
  for (int r = 0; r < rows; ++r) {
    const float scale = std::exp2(float(int(rng() % 17) - 8));
    for (int j = 0; j < D; ++j) {
      x[j] = std::normal_distribution<float>(0.f, 1.f)(rng) * std::exp2(float(int(rng() % 9) - 4)) * scale;
      if (rng() % 97 == 0) x[j] *= 50.f;
      w[j] = std::uniform_real_distribution<float>(0.5f, 1.5f)(rng);
    }
    const float want = norm_ss(x.data());
    float ss[2][32], ctl[2][32];
    router_ss(x.data(), false, ss);
    router_ss(x.data(), true, ctl);
    bool lanes = false;
    for (int l = 0; l < 64; ++l) lanes |= bits(ss[l / 32][l % 32]) != bits(ss[0][0]);
    lanes_differ += lanes;
    router_differ += bits(ss[0][0]) != bits(want);
    up_differ += bits(up_ss(x.data())) != bits(want);
    control_differ += bits(ctl[0][0]) != bits(want);
    const float sa = 1.f / std::sqrt(want / float(D) + eps), sb = 1.f / std::sqrt(ss[0][0] / float(D) + eps);
    for (int j = 0; j < D; ++j) values += bits(x[j] * sa * w[j]) != bits(x[j] * sb * w[j]);
  }
  bool ok = true;
  auto report = [&](bool pass, const char* what, int n) {
    std::printf("%s %s: %d of %d rows\n", pass ? "ok  " : "FAIL", what, n, rows);
    ok &= pass;
  };
  report(router_differ == 0 && values == 0, "router staging warps, sums that differ from the norms'", router_differ);
  report(lanes_differ == 0, "router staging warps, rows whose lanes disagree", lanes_differ);
  report(up_differ == 0, "moe_up (mma_stage_normed_x), sums that differ from the norms'", up_differ);
  report(control_differ > 0, "control (f ^ 1 first), sums that differ from the norms'", control_differ);
  std::printf(ok ? "norm_post_emu: all passed\n" : "norm_post_emu: FAILED\n");
  return ok ? 0 : 1;
}
