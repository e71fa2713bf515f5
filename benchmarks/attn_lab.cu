// attn_lab: the prefill attention at the engine's shapes (16 query heads, 2 KV heads, head_dim 256),
// self-checking, one table row per (kernel, chunk):
//   mma.sync   kernels/attention_prefill.cuh, attention_prefill_kernel<256> (what attention.cu runs)
//   wgmma      kernels/attention_wgmma.cuh: attention_q_bf16_kernel (q -> bf16, its time alone is the
//              "q->bf16 us" column) + attention_prefill_wgmma_kernel (TMA, mbarriers, wgmma); its "us"
//              includes the conversion
// Chunks: T = 4096 at pos0 = 0 (a 4K prompt) and T = 4096 at pos0 = 28672 (the last chunk of a 32K
// prompt), timed; T = 1000 at pos0 = 77 (ragged: a partial CTA tile, a warpgroup with no rows, a V tile
// past pos0 + T), checked only. The cache holds maxT = 32768 rows; rows >= pos0 + T are poisoned with
// NaN (no kernel may read them into the output).
// Inputs: q ~ U(-2, 2) f32, k and v ~ U(-1, 1) bf16 (fixed seed).
// Timing: 9 batches of 5 launches between CUDA events after a warm-up; us = median batch / 5 (K/V stay
// in L2 as far as they fit, as in the engine, where the layer has just written them).
// TFLOP/s: causal FLOPs, 4 * D * nH * sum over query rows t of (pos0 + t + 1) keys, over the time.
// Check (before timing, per kernel): o poisoned with NaN, one launch, then every output must be finite;
// "err" = max |o - o_ref| / max |o_ref| over 32 sampled (head, row) pairs, o_ref in fp64 on the host from
// the f32 q and the bf16 k, v (no rounding of q or p); "vs mma.sync" = max |o - o_mma| / max |o_mma| over
// all outputs. FAIL (exit 1) when wgmma's err exceeds 2 x mma.sync's or 1e-2, or on a non-finite output.
// Run: bash benchmarks/attn_lab.sh (builds and runs it under a time-out).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda/kernels/common.cuh"  // before attention_prefill.cuh, which uses pdl_wait
#include "cuda/kernels/attention_prefill.cuh"
#include "cuda/kernels/attention_wgmma.cuh"
#include "cuda/tensor_map.h"

static void check_cuda(cudaError_t e, const char* what, int line) {
  if (e == cudaSuccess) return;
  std::fprintf(stderr, "attn_lab: %s failed: %s (attn_lab.cu:%d)\n", what, cudaGetErrorString(e), line);
  std::exit(1);
}
#define CK(call) check_cuda((call), #call, __LINE__)

using namespace lily::cuda;
using namespace lily::cuda::attn;

constexpr int kNH = 16, kNKV = 2, kD = 256, kMaxT = 32768;
static int g_failures = 0;

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint32_t rnd32() {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return uint32_t(rng_state >> 16);
}
static float rndu() { return (rnd32() >> 8) * (1.f / 16777216.f); }
static double bf16_val(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Median over 9 batches of 5 launches of fn, in us per launch.
template <typename Fn>
static double time_us(Fn fn) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  fn();
  CK(cudaDeviceSynchronize());
  std::vector<float> ms;
  for (int batch = 0; batch < 9; ++batch) {
    CK(cudaEventRecord(a));
    for (int r = 0; r < 5; ++r) fn();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float t;
    CK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  CK(cudaGetLastError());
  std::sort(ms.begin(), ms.end());
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  return ms[ms.size() / 2] * 1000.0 / 5;
}

struct Chunk {
  int T, pos0;
  bool timed;
};

static void run_chunk(const Chunk& c, const std::vector<uint16_t>& hk, const std::vector<uint16_t>& hv,
                      const uint16_t* dk, const uint16_t* dv) {
  const int T = c.T, pos0 = c.pos0;
  const int64_t qn = int64_t(T) * kNH * kD;
  std::vector<float> hq(qn);
  for (auto& x : hq) x = 4.f * rndu() - 2.f;
  float *dq, *d_old, *d_new;
  uint16_t* dqb;
  int32_t* dpos;
  CK(cudaMalloc(&dq, qn * 4));
  CK(cudaMalloc(&d_old, qn * 4));
  CK(cudaMalloc(&d_new, qn * 4));
  CK(cudaMalloc(&dqb, qn * 2));
  CK(cudaMalloc(&dpos, 4));
  CK(cudaMemcpy(dq, hq.data(), qn * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dpos, &pos0, 4, cudaMemcpyHostToDevice));
  // The cache rows this chunk may not see, NaN (restored at the end for the next chunk).
  const int64_t row_elems = int64_t(kNKV) * kD, poison0 = int64_t(pos0 + T) * row_elems;
  const int64_t poison_n = int64_t(kMaxT) * row_elems - poison0;
  CK(cudaMemset(const_cast<uint16_t*>(dk) + poison0, 0xFF, poison_n * 2));  // 0xFFFF: a bf16 NaN
  CK(cudaMemset(const_cast<uint16_t*>(dv) + poison0, 0xFF, poison_n * 2));

  const float scale_log2 = float(1.4426950408889634 / std::sqrt(double(kD)));
  const PrefillParams pp{dq, reinterpret_cast<const bf16*>(dk), reinterpret_cast<const bf16*>(dv), d_old, dpos,
                         T, kNH, kNKV, kNH / kNKV, scale_log2};
  const AwgParams ap{d_new, dpos, T, kNH, kNKV, kNH / kNKV, scale_log2};
  CUtensorMap map_q, map_k, map_v;
  if (make_xb_tensor_map(map_q, dqb, T, int64_t(kNH) * kD, 64) != CUDA_SUCCESS ||
      make_xb_tensor_map(map_k, dk, kMaxT, row_elems, 64) != CUDA_SUCCESS ||
      make_xb_tensor_map(map_v, dv, kMaxT, row_elems, 64) != CUDA_SUCCESS) {
    std::fprintf(stderr, "attn_lab: cuTensorMapEncodeTiled failed\n");
    std::exit(1);
  }
  const dim3 old_grid(unsigned((T + kPrefillRows - 1) / kPrefillRows), unsigned(kNH));
  auto run_old = [&] {
    attention_prefill_kernel<kD><<<old_grid, kPrefillThreads, prefill_smem_bytes<kD>()>>>(pp);
  };
  auto run_cvt = [&] { attention_q_bf16_kernel<<<unsigned((qn / 8 + 255) / 256), 256>>>(dq, dqb, qn); };
  auto run_new = [&] {
    run_cvt();
    attention_prefill_wgmma_kernel<<<unsigned(awg_q_tiles(T) * kNH), AWG_THREADS, AWG_SMEM_BYTES>>>(ap, map_q, map_k,
                                                                                                  map_v);
  };

  // One checked launch each on NaN-poisoned outputs.
  std::vector<float> h_old(qn), h_new(qn);
  CK(cudaMemset(d_old, 0xFF, qn * 4));
  CK(cudaMemset(d_new, 0xFF, qn * 4));
  run_old();
  CK(cudaGetLastError());
  run_new();
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  CK(cudaMemcpy(h_old.data(), d_old, qn * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(h_new.data(), d_new, qn * 4, cudaMemcpyDeviceToHost));

  // fp64 reference on 32 sampled (head, row) pairs: the first and last rows, CTA tile edges, random rows.
  const int fixed_rows[] = {0, 1, 63, 64, 127, 128, T / 2, T - 1};
  double ref_max = 0, err_old = 0, err_new = 0;
  std::vector<double> ref(kD), s(size_t(pos0 + T));
  for (int n = 0; n < 32; ++n) {
    const int h = n % kNH, t = n < 8 ? std::min(fixed_rows[n], T - 1) : int(rnd32() % uint32_t(T));
    const int kvh = h / (kNH / kNKV), keys = pos0 + t + 1;
    const float* q = &hq[(int64_t(t) * kNH + h) * kD];
    double mx = -INFINITY, sum = 0;
    for (int j = 0; j < keys; ++j) {
      double d = 0;
      for (int e = 0; e < kD; ++e) d += double(q[e]) * bf16_val(hk[(int64_t(j) * kNKV + kvh) * kD + e]);
      s[j] = d / std::sqrt(double(kD));
      mx = std::max(mx, s[j]);
    }
    std::fill(ref.begin(), ref.end(), 0.0);
    for (int j = 0; j < keys; ++j) {
      const double p = std::exp(s[j] - mx);
      sum += p;
      for (int e = 0; e < kD; ++e) ref[e] += p * bf16_val(hv[(int64_t(j) * kNKV + kvh) * kD + e]);
    }
    for (int e = 0; e < kD; ++e) {
      const double r = ref[e] / sum;
      const int64_t i = (int64_t(t) * kNH + h) * kD + e;
      ref_max = std::max(ref_max, std::fabs(r));
      err_old = std::max(err_old, std::fabs(h_old[i] - r));
      err_new = std::max(err_new, std::isfinite(h_new[i]) ? std::fabs(h_new[i] - r) : INFINITY);
    }
  }
  err_old /= ref_max, err_new /= ref_max;
  double vs_max = 0, vs = 0;
  int64_t bad_old = 0, bad_new = 0;
  for (int64_t i = 0; i < qn; ++i) {
    bad_old += !std::isfinite(h_old[i]);
    bad_new += !std::isfinite(h_new[i]);
    vs_max = std::max(vs_max, double(std::fabs(h_old[i])));
    vs = std::max(vs, double(std::fabs(h_new[i] - h_old[i])));
  }
  vs = bad_new ? INFINITY : vs / vs_max;
  const bool fail = bad_new != 0 || !(err_new <= 2 * err_old) || !(err_new <= 1e-2);
  if (bad_old) std::printf("attn_lab: mma.sync wrote %lld non-finite outputs (the reference kernel!)\n", (long long)bad_old);
  g_failures += fail;

  double us_old = 0, us_new = 0, us_cvt = 0;
  if (c.timed) {
    us_old = time_us(run_old);
    us_new = time_us(run_new);
    us_cvt = time_us(run_cvt);
  }
  double keys = 0;
  for (int t = 0; t < T; ++t) keys += pos0 + t + 1;
  const double flop = 4.0 * kD * kNH * keys;
  auto row = [&](const char* name, double us, double err, const char* vs_col, const char* cvt, const char* verdict) {
    char t_us[32] = "-", t_tf[32] = "-";
    if (c.timed) std::snprintf(t_us, sizeof t_us, "%.1f", us), std::snprintf(t_tf, sizeof t_tf, "%.1f", flop / us * 1e-6);
    std::printf("| %-9s | %5d | %6d | %9s | %8s | %9s | %9.2e | %12s | %s |\n", name, T, pos0, t_us, t_tf, cvt, err,
                vs_col, verdict);
  };
  char vs_s[32], cvt_s[32] = "-";
  std::snprintf(vs_s, sizeof vs_s, "%.2e", vs);
  if (c.timed) std::snprintf(cvt_s, sizeof cvt_s, "%.1f", us_cvt);
  row("mma.sync", us_old, err_old, "-", "-", bad_old ? "non-finite" : "ref");
  row("wgmma", us_new, err_new, vs_s, cvt_s, fail ? (bad_new ? "FAIL (non-finite)" : "FAIL") : "ok");

  CK(cudaMemcpy(const_cast<uint16_t*>(dk) + poison0, hk.data() + poison0, poison_n * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(const_cast<uint16_t*>(dv) + poison0, hv.data() + poison0, poison_n * 2, cudaMemcpyHostToDevice));
  cudaFree(dq), cudaFree(d_old), cudaFree(d_new), cudaFree(dqb), cudaFree(dpos);
}

int main() {
  CK(cudaFuncSetAttribute(attention_prefill_kernel<kD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          prefill_smem_bytes<kD>()));
  CK(cudaFuncSetAttribute(attention_prefill_wgmma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, AWG_SMEM_BYTES));
  const int64_t cache_n = int64_t(kMaxT) * kNKV * kD;
  std::vector<uint16_t> hk(cache_n), hv(cache_n);
  for (auto& x : hk) x = uint16_t(wg_pack_bf16x2(2.f * rndu() - 1.f, 0.f));
  for (auto& x : hv) x = uint16_t(wg_pack_bf16x2(2.f * rndu() - 1.f, 0.f));
  uint16_t *dk, *dv;
  CK(cudaMalloc(&dk, cache_n * 2));
  CK(cudaMalloc(&dv, cache_n * 2));
  CK(cudaMemcpy(dk, hk.data(), cache_n * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dv, hv.data(), cache_n * 2, cudaMemcpyHostToDevice));

  std::printf("prefill attention, nH %d, nKV %d, D %d, cache %d rows (attn_lab)\n\n", kNH, kNKV, kD, kMaxT);
  std::printf("| kernel    |     T |   pos0 |        us | TFLOP/s | q->bf16 us |       err | vs mma.sync  | check |\n");
  std::printf("|-----------|-------|--------|-----------|----------|-----------|-----------|--------------|-------|\n");
  for (const Chunk& c : {Chunk{1000, 77, false}, Chunk{4096, 0, true}, Chunk{4096, 28672, true}}) run_chunk(c, hk, hv, dk, dv);
  cudaFree(dk), cudaFree(dv);
  if (g_failures) {
    std::printf("\nattn_lab: %d FAIL\n", g_failures);
    return 1;
  }
  return 0;
}
