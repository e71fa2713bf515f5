// dense_lab: the vision tower's dense BF16 products, self-checking, one table row per kernel and shape:
//   mma.sync    kernels/linear_gemm.cuh with GEMM_DENSE_BF16 (the old path), then add_bias's arithmetic is
//               not included (a separate kernel: ~21 us a product at 1 MP, docs/results/h200.md)
//   wgmma       the library's path since 2026-12-02: wgx_bf16_kernel<true> (X -> bf16) + linear_wgmma_dense_kernel
//               with the bias in its epilogue, BM by wgd_bm, launched as linear.cu's run_dense_wgmma does
// Shapes (N outputs x K, T rows): qkv 3456x1152, proj 1152x1152, fc1 4304x1152, fc2 1152x4304 at T =
// DENSE_LAB_T (default 4096: a 1-megapixel image), the merger's 4608x4608 and 2048x4608 at T / 4.
// Timing: 15 batches of R launches between CUDA events after a warm-up; us = median batch / R. Launch i
// reads weight copy i % copies (>= 160 MB together: L2 is 50-60 MB), so weights come from HBM as in the
// tower. TFLOP/s = 2*T*N*K / time.
// Check (per kernel, before timing): Y poisoned with NaN bytes, one launch, every output finite, the
// sampled relative error ||y - ref|| / ||ref|| over 4096 outputs against a host fp64 product of the same
// bf16 operands (x rounded to nearest even) + bias <= 1e-4, and wgmma against mma.sync (+ bias on the host)
// over all outputs, relative <= 1e-4 (only the fp32 summation order differs); otherwise FAIL, exit 1.
// Run: bash benchmarks/dense_lab.sh
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda/kernels/linear_gemm.cuh"
#include "cuda/kernels/linear_wgmma_dense.cuh"
#include "cuda/tensor_map.h"

static void check_cuda(cudaError_t e, const char* what, int line) {
  if (e == cudaSuccess) return;
  std::fprintf(stderr, "dense_lab: %s failed: %s (dense_lab.cu:%d)\n", what, cudaGetErrorString(e), line);
  std::exit(1);
}
#define CK(call) check_cuda((call), #call, __LINE__)

using namespace lily::cuda;
using lily::DType;

static int g_failures = 0;
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint32_t rnd32() {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return uint32_t(rng_state >> 16);
}
static float rndu() { return (rnd32() >> 8) * (1.f / 16777216.f); }
static uint16_t bf16_bits(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return uint16_t(u >> 16);
}
static double bf16_val(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct Product {
  const char* name;
  int64_t T, N, K;
  int copies;
  std::vector<uint16_t> hw;
  std::vector<float> hx, hbias;
  std::vector<uint16_t*> dw;
  float *dx, *dy, *dbias;
  uint16_t* dxb;
  LinearArgs args(int c) const {
    LinearArgs a;
    a.w.w = dw[c];
    a.w.num_stack = 1;
    a.w.rows = N;
    a.w.cols = K;
    a.w.bits = 0;
    a.w.dtype = DType::BF16;
    a.x = dx;
    a.ldx = K;
    a.y = dy;
    a.ldy = N;
    a.tiles.M = T;
    return a;
  }
};

static Product make(const char* name, int64_t T, int64_t N, int64_t K) {
  Product p{name, T, N, K};
  p.copies = int(std::max<int64_t>(1, (160ll << 20) / (N * K * 2) + 1));
  p.hw.resize(N * K);
  for (auto& v : p.hw) v = bf16_bits((rndu() - 0.5f) * 0.1f);
  p.hx.resize(T * K);
  for (auto& v : p.hx) v = 2.f * rndu() - 1.f;
  p.hbias.resize(N);
  for (auto& v : p.hbias) v = rndu() - 0.5f;
  for (int c = 0; c < p.copies; ++c) {
    uint16_t* w;
    CK(cudaMalloc(&w, N * K * 2));
    CK(cudaMemcpy(w, p.hw.data(), N * K * 2, cudaMemcpyHostToDevice));
    p.dw.push_back(w);
  }
  CK(cudaMalloc(&p.dx, T * K * 4));
  CK(cudaMemcpy(p.dx, p.hx.data(), T * K * 4, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&p.dy, T * N * 4));
  CK(cudaMalloc(&p.dbias, N * 4));
  CK(cudaMemcpy(p.dbias, p.hbias.data(), N * 4, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&p.dxb, T * K * 2));
  return p;
}

static void free_product(Product& p) {
  for (auto w : p.dw) cudaFree(w);
  cudaFree(p.dx), cudaFree(p.dy), cudaFree(p.dbias), cudaFree(p.dxb);
}

static void launch_old(const Product& p, int c) {
  static bool configured = false;
  if (!configured) {
    CK(cudaFuncSetAttribute(linear_gemm_kernel<GEMM_DENSE_BF16>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            GEMM_SMEM_BYTES));
    configured = true;
  }
  const dim3 grid(unsigned((p.T + GEMM_BM - 1) / GEMM_BM), unsigned((p.N + GEMM_BN - 1) / GEMM_BN));
  linear_gemm_kernel<GEMM_DENSE_BF16><<<grid, GEMM_THREADS, GEMM_SMEM_BYTES>>>(p.args(c));
}

static int g_sms = 132;

template <int BM>
static void launch_wgmma_bm(const Product& p, int c) {
  static bool configured = false;
  if (!configured) {
    CK(cudaFuncSetAttribute(linear_wgmma_dense_kernel<BM>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            wgd_smem_bytes(BM)));
    configured = true;
  }
  CUtensorMap mx, mw;
  if (make_xb_tensor_map(mx, p.dxb, p.T, p.K, BM) != CUDA_SUCCESS ||
      make_xb_tensor_map(mw, p.dw[c], p.N, p.K, WG_BN) != CUDA_SUCCESS) {
    std::fprintf(stderr, "dense_lab: cuTensorMapEncodeTiled failed\n");
    std::exit(1);
  }
  const int64_t units = (p.T + BM - 1) / BM * ((p.N + WG_BN - 1) / WG_BN);
  linear_wgmma_dense_kernel<BM>
      <<<unsigned(std::min<int64_t>(units, g_sms)), WGD_THREADS, wgd_smem_bytes(BM)>>>(p.args(c), p.dbias, mx, mw);
}

static void launch_conv(const Product& p) {
  wgx_bf16_kernel<true><<<unsigned(p.T), WGX_THREADS>>>(p.dx, p.K, p.K, p.dxb);
}

static void launch_new(const Product& p, int c) {
  launch_conv(p);
  if (wgd_bm(p.T, p.N, g_sms) == 64) launch_wgmma_bm<64>(p, c);
  else launch_wgmma_bm<128>(p, c);
}

template <class F>
static double time_us(int copies, F&& launch_copy) {
  const int R = std::max(10, copies);
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int i = 0; i < 3; ++i) launch_copy(i % copies);
  std::vector<float> ms;
  int c = 0;
  for (int b = 0; b < 15; ++b) {
    CK(cudaEventRecord(e0));
    for (int i = 0; i < R; ++i) launch_copy(c++ % copies);
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float t;
    CK(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t);
  }
  CK(cudaGetLastError());
  std::sort(ms.begin(), ms.end());
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  return ms[ms.size() / 2] * 1e3 / R;
}

// One launch from NaN-poisoned y; the output on the host, + bias there for the old kernel.
static std::vector<float> run_once(const Product& p, bool wgmma) {
  CK(cudaMemset(p.dy, 0xFF, p.T * p.N * 4));
  if (wgmma) launch_new(p, 0);
  else launch_old(p, 0);
  CK(cudaDeviceSynchronize());
  std::vector<float> y(p.T * p.N);
  CK(cudaMemcpy(y.data(), p.dy, y.size() * 4, cudaMemcpyDeviceToHost));
  if (!wgmma)
    for (int64_t r = 0; r < p.T; ++r)
      for (int64_t o = 0; o < p.N; ++o) y[r * p.N + o] += p.hbias[o];
  return y;
}

static double sampled_err(const Product& p, const std::vector<float>& y, int64_t& bad) {
  bad = 0;
  for (float v : y) bad += !std::isfinite(v);
  double num = 0, den = 0;
  for (int i = 0; i < 4096; ++i) {
    const int64_t r = rnd32() % p.T, o = rnd32() % p.N;
    double ref = p.hbias[o];
    for (int64_t k = 0; k < p.K; ++k) ref += bf16_val(p.hw[o * p.K + k]) * bf16_val(bf16_bits(p.hx[r * p.K + k]));
    const double d = double(y[r * p.N + o]) - ref;
    num += d * d, den += ref * ref;
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

static void rows(const char* name, int64_t T, int64_t N, int64_t K) {
  Product p = make(name, T, N, K);
  const double flop = 2.0 * T * N * K;
  const std::vector<float> y_old = run_once(p, false), y_new = run_once(p, true);
  double num = 0, den = 0;
  for (size_t i = 0; i < y_new.size(); ++i) {
    const double d = double(y_new[i]) - y_old[i];
    num += d * d, den += double(y_old[i]) * y_old[i];
  }
  const double vs_old = std::sqrt(num / std::max(den, 1e-300));
  const double t_old = time_us(p.copies, [&](int c) { launch_old(p, c); });
  const double t_new = time_us(p.copies, [&](int c) { launch_new(p, c); });
  const double t_conv = time_us(1, [&](int) { launch_conv(p); });
  for (int k = 0; k < 2; ++k) {
    int64_t bad;
    const double err = sampled_err(p, k ? y_new : y_old, bad);
    const bool ok = bad == 0 && err <= 1e-4 && (k == 0 || vs_old <= 1e-4);
    if (!ok) {
      ++g_failures;
      std::printf("FAIL: %s %s: %lld non-finite, sampled rel err %.3e, vs mma.sync %.3e\n", name,
                  k ? "wgmma" : "mma.sync", (long long)bad, err, vs_old);
    }
    const double t = k ? t_new : t_old;
    char extra[64] = "";
    if (k) std::snprintf(extra, sizeof extra, "%d | %.1f | %.2e", wgd_bm(T, N, g_sms), t_conv, vs_old);
    std::printf("| %s | %lld x %lld x %lld | %s | %.1f | %.1f | %.2fx | %.1e %s | %s |\n", name, (long long)T,
                (long long)N, (long long)K, k ? "wgmma" : "mma.sync", t, flop / t * 1e-6, t_old / t, err,
                ok ? "ok" : "FAIL", k ? extra : "| |");
    std::fflush(stdout);
  }
  free_product(p);
}

int main() {
  CK(cudaDeviceGetAttribute(&g_sms, cudaDevAttrMultiProcessorCount, 0));
  const char* t_env = std::getenv("DENSE_LAB_T");
  const int64_t T = t_env ? std::atoll(t_env) : 4096;
  std::printf("| product | T x N x K | kernel | us | TFLOP/s | vs mma.sync | sampled err | BM | X->bf16 us | vs mma.sync out |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  rows("qkv", T, 3456, 1152);
  rows("proj", T, 1152, 1152);
  rows("fc1", T, 4304, 1152);
  rows("fc2", T, 1152, 4304);
  rows("merger fc1", T / 4, 4608, 4608);
  rows("merger fc2", T / 4, 2048, 4608);
  rows("check odd T, tails", 1031, 300, 4304);
  std::printf(g_failures ? "\ndense_lab: %d FAILED\n" : "\ndense_lab: all checks passed\n", g_failures);
  return g_failures ? 1 : 0;
}
