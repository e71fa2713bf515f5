// attn_lab: the prefill attention at the engine's shapes (16 query heads, 2 KV heads, head_dim 256),
// self-checking, one table row per (kernel, chunk):
//   mma.sync   kernels/attention_prefill.cuh, attention_prefill_kernel<256> (attention.cu's prefill where
//              the wgmma kernel does not apply)
//   wgmma      kernels/attention_wgmma.cuh: attention_prefill_wgmma_kernel (TMA, mbarriers, wgmma, a
//              warpgroup's softmax of key tile i overlapping its own P V of tile i - 1; what attention.cu
//              runs at D = 256) on q converted to bf16 by attention_q_bf16_kernel first; "us" and TFLOP/s
//              are the attention kernel's, the conversion's time is the "q->bf16 us" column (the engine
//              pays both)
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
// all outputs. FAIL (exit 1) when the wgmma kernel's err exceeds 2 x mma.sync's or 1e-2, or on a
// non-finite output.
// Run: bash benchmarks/attn_lab.sh (builds it, runs it under a time-out); by hand: attn_lab.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
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

// Sampled fp64 reference outputs: o_ref[(t, h), :] for 32 (head, row) pairs.
struct Reference {
  std::vector<int64_t> base;  // (t * nH + h) * D of each pair
  std::vector<double> o;      // [pairs][D]
  double max_abs = 0;
};

static Reference reference(const std::vector<float>& hq, int T, int pos0, const std::vector<uint16_t>& hk,
                           const std::vector<uint16_t>& hv) {
  Reference ref;
  const int fixed_rows[] = {0, 1, 63, 64, 127, 128, T / 2, T - 1};  // first/last rows, CTA tile edges
  std::vector<double> s(size_t(pos0 + T)), acc(kD);
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
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int j = 0; j < keys; ++j) {
      const double p = std::exp(s[j] - mx);
      sum += p;
      for (int e = 0; e < kD; ++e) acc[e] += p * bf16_val(hv[(int64_t(j) * kNKV + kvh) * kD + e]);
    }
    ref.base.push_back((int64_t(t) * kNH + h) * kD);
    for (int e = 0; e < kD; ++e) {
      ref.o.push_back(acc[e] / sum);
      ref.max_abs = std::max(ref.max_abs, std::fabs(acc[e] / sum));
    }
  }
  return ref;
}

struct Chunk {
  int T, pos0;
  bool timed;
};

static void run_chunk(const Chunk& c, const std::vector<uint16_t>& hk, const std::vector<uint16_t>& hv,
                      uint16_t* dk, uint16_t* dv) {
  const int T = c.T, pos0 = c.pos0;
  const int64_t qn = int64_t(T) * kNH * kD;
  std::vector<float> hq(qn);
  for (auto& x : hq) x = 4.f * rndu() - 2.f;
  float *dq, *d_o;
  uint16_t* dqb;
  int32_t* dpos;
  CK(cudaMalloc(&dq, qn * 4));
  CK(cudaMalloc(&d_o, qn * 4));
  CK(cudaMalloc(&dqb, qn * 2));
  CK(cudaMalloc(&dpos, 4));
  CK(cudaMemcpy(dq, hq.data(), qn * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dpos, &pos0, 4, cudaMemcpyHostToDevice));
  // The cache rows this chunk may not see, NaN (restored at the end for the next chunk).
  const int64_t row_elems = int64_t(kNKV) * kD, poison0 = int64_t(pos0 + T) * row_elems;
  const int64_t poison_n = int64_t(kMaxT) * row_elems - poison0;
  if (poison_n > 0) {  // 0xFFFF: a bf16 NaN
    CK(cudaMemset(dk + poison0, 0xFF, poison_n * 2));
    CK(cudaMemset(dv + poison0, 0xFF, poison_n * 2));
  }

  const float scale_log2 = float(1.4426950408889634 / std::sqrt(double(kD)));
  const PrefillParams pp{dq, reinterpret_cast<const bf16*>(dk), reinterpret_cast<const bf16*>(dv), d_o, dpos,
                         T, kNH, kNKV, kNH / kNKV, scale_log2};
  const AwgParams ap{d_o, dpos, T, kNH, kNKV, kNH / kNKV, scale_log2};
  CUtensorMap map_q, map_k, map_v;
  if (make_xb_tensor_map(map_q, dqb, T, int64_t(kNH) * kD, 64) != CUDA_SUCCESS ||
      make_xb_tensor_map(map_k, dk, kMaxT, row_elems, 64) != CUDA_SUCCESS ||
      make_xb_tensor_map(map_v, dv, kMaxT, row_elems, 64) != CUDA_SUCCESS) {
    std::fprintf(stderr, "attn_lab: cuTensorMapEncodeTiled failed\n");
    std::exit(1);
  }
  const dim3 old_grid(unsigned((T + kPrefillRows - 1) / kPrefillRows), unsigned(kNH));
  const unsigned new_grid = unsigned(awg_q_tiles(T) * kNH);
  auto run_cvt = [&] { attention_q_bf16_kernel<<<unsigned((qn / 8 + 255) / 256), 256>>>(dq, dqb, qn); };
  struct Kernel {
    const char* name;
    std::function<void()> launch;  // the wgmma kernel reads qb: run_cvt() first
  };
  const Kernel kernels[] = {
      {"mma.sync", [&] { attention_prefill_kernel<kD><<<old_grid, kPrefillThreads, prefill_smem_bytes<kD>()>>>(pp); }},
      {"wgmma", [&] { attention_prefill_wgmma_kernel<<<new_grid, AWG_THREADS, AWG_SMEM_BYTES>>>(ap, map_q, map_k, map_v); }},
  };
  const Reference ref = reference(hq, T, pos0, hk, hv);
  double keys = 0;
  for (int t = 0; t < T; ++t) keys += pos0 + t + 1;
  const double flop = 4.0 * kD * kNH * keys;
  const double us_cvt = c.timed ? time_us(run_cvt) : 0;

  std::vector<float> h_o(qn), h_mma(qn);
  double err_mma = 0;
  for (const Kernel& v : kernels) {
    const bool is_mma = &v == &kernels[0];
    CK(cudaMemset(d_o, 0xFF, qn * 4));  // NaN
    CK(cudaMemset(dqb, 0xFF, qn * 2));
    if (!is_mma) run_cvt();
    v.launch();
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(h_o.data(), d_o, qn * 4, cudaMemcpyDeviceToHost));
    int64_t bad = 0;
    for (float x : h_o) bad += !std::isfinite(x);
    double err = 0;
    int64_t worst = -1;  // the sampled output with the largest error (printed on a FAIL)
    size_t worst_ref = 0;
    for (size_t n = 0; n < ref.base.size(); ++n)
      for (int e = 0; e < kD; ++e) {
        const double d = std::fabs(h_o[ref.base[n] + e] - ref.o[n * kD + e]);
        if (!(d <= err)) err = d, worst = ref.base[n] + e, worst_ref = n * kD + e;
      }
    err = bad ? INFINITY : err / ref.max_abs;
    char vs_s[32] = "-", us_s[32] = "-", tf_s[32] = "-", cvt_s[32] = "-";
    if (is_mma) {
      h_mma = h_o, err_mma = err;
    } else {
      double vs = 0, mx = 0;
      for (int64_t i = 0; i < qn; ++i) vs = std::max(vs, double(std::fabs(h_o[i] - h_mma[i]))), mx = std::max(mx, double(std::fabs(h_mma[i])));
      std::snprintf(vs_s, sizeof vs_s, "%.2e", bad ? INFINITY : vs / mx);
      if (c.timed) std::snprintf(cvt_s, sizeof cvt_s, "%.1f", us_cvt);
    }
    const bool fail = bad != 0 || (!is_mma && !(err <= 2 * err_mma && err <= 1e-2));
    g_failures += fail;
    if (c.timed && !bad) {  // a kernel that wrote garbage may also hang or fault: not timed
      const double us = time_us(v.launch);
      std::snprintf(us_s, sizeof us_s, "%.1f", us), std::snprintf(tf_s, sizeof tf_s, "%.1f", flop / us * 1e-6);
    }
    std::printf("| %-9s | %5d | %6d | %8s | %7s | %10s | %9.2e | %11s | %s |\n", v.name, T, pos0, us_s, tf_s, cvt_s,
              err, vs_s, fail ? (bad ? "FAIL (non-finite)" : "FAIL") : (is_mma ? "ref" : "ok"));
    if (fail && worst >= 0)  // where: a layout error shows in which rows / dims go wrong
      std::printf("  %s: worst sampled output row %lld, head %lld, dim %lld: %g, reference %g (%lld non-finite)\n",
                  v.name, (long long)(worst / (int64_t(kNH) * kD)), (long long)(worst / kD % kNH),
                  (long long)(worst % kD), h_o[worst], ref.o[worst_ref], (long long)bad);
    std::fflush(stdout);
  }

  if (poison_n > 0) {
    CK(cudaMemcpy(dk + poison0, hk.data() + poison0, poison_n * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dv + poison0, hv.data() + poison0, poison_n * 2, cudaMemcpyHostToDevice));
  }
  cudaFree(dq), cudaFree(d_o), cudaFree(dqb), cudaFree(dpos);
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
  std::printf("| kernel    |     T |   pos0 |       us | TFLOP/s | q->bf16 us |       err | vs mma.sync | check |\n");
  std::printf("|-----------|-------|--------|----------|---------|------------|-----------|-------------|-------|\n");
  for (const Chunk& c : {Chunk{1000, 77, false}, Chunk{4096, 0, true}, Chunk{4096, 28672, true}}) run_chunk(c, hk, hv, dk, dv);
  cudaFree(dk), cudaFree(dv);
  if (g_failures) {
    std::printf("\nattn_lab: %d FAIL\n", g_failures);
    return 1;
  }
  return 0;
}
