// gemm_lab: the prefill GEMM over 4-bit MLX-affine weights, old (kernels/linear_gemm.cuh, mma.sync) vs new
// (kernels/linear_wgmma.cuh, Hopper wgmma), side by side, self-checking.
//   Run: bash benchmarks/gemm_lab.sh   (nvcc build ~1 min on 2 cores, then < 30 s on an H200)
// Shapes (N outputs x K, T rows): the engine's dense prefill products at T = 2048 and its MoE grouped
// products (2048 tokens x top-8 over 256 experts, uniform random routing, tile map of 64-row tiles built
// like moe_routing.cuh: rows grouped by expert, ascending tokens, x_rows gather for gate/up).
// Timing: per kernel, 15 batches of R launches between CUDA events after a warm-up; us = median batch / R.
// Launch i reads weight copy i % copies (dense: copies >= 160 MB together, L2 is 50-60 MB; MoE: one
// 128 MB+ stack), so the first touch of a weight comes from HBM. TFLOP/s = 2*M*N*K / time, M = product rows.
// Check (before timing, per kernel): Y poisoned with NaN bytes, one launch on copy 0, then every output
// must be finite and the sampled relative error ||y - ref|| / ||ref|| over 4096 random outputs (host fp64
// reference on the same bf16 scale/bias values and fp32 x) must be <= 1e-2; otherwise FAIL and exit 1.
// Also checks (not timed): partial row/col tiles, T = 9..300, group sizes 32/128, SwiGLU epilogue.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "cuda/kernels/linear_gemm.cuh"
#include "cuda/kernels/linear_wgmma.cuh"

static void check_cuda(cudaError_t e, const char* what, int line) {
  if (e == cudaSuccess) return;
  std::fprintf(stderr, "gemm_lab: %s failed: %s (gemm_lab.cu:%d)\n", what, cudaGetErrorString(e), line);
  std::exit(1);
}
#define CK(call) check_cuda((call), #call, __LINE__)

using namespace lily::cuda;
using lily::DType;

static int g_failures = 0;
static int g_sms = 132;

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
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// A stack [E, N, K] of 4-bit affine matrices, `copies` copies on the device; copy 0 also on the host.
struct Stack {
  int64_t E, N, K;
  int gs, copies;
  std::vector<uint32_t> hw;
  std::vector<uint16_t> hs, hb;
  std::vector<uint32_t*> dw;
  std::vector<uint16_t*> ds, db;
  Stack(int64_t E_, int64_t N_, int64_t K_, int gs_, int copies_) : E(E_), N(N_), K(K_), gs(gs_), copies(copies_) {
    const int64_t words = E * N * K / 8, groups = E * N * K / gs;
    hw.resize(words);
    hs.resize(groups);
    hb.resize(groups);
    for (auto& w : hw) w = rnd32();
    for (int64_t i = 0; i < groups; ++i) {
      const float s = 0.004f + 0.02f * rndu();
      hs[i] = bf16_bits(s);
      hb[i] = bf16_bits(-8.f * s + 0.02f * (rndu() - 0.5f));
    }
    for (int c = 0; c < copies; ++c) {
      uint32_t* w;
      uint16_t *s, *b;
      CK(cudaMalloc(&w, words * 4));
      CK(cudaMalloc(&s, groups * 2));
      CK(cudaMalloc(&b, groups * 2));
      CK(cudaMemcpy(w, hw.data(), words * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(s, hs.data(), groups * 2, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(b, hb.data(), groups * 2, cudaMemcpyHostToDevice));
      dw.push_back(w), ds.push_back(s), db.push_back(b);
    }
  }
  ~Stack() {
    for (int c = 0; c < copies; ++c) cudaFree(dw[c]), cudaFree(ds[c]), cudaFree(db[c]);
  }
  double w(int64_t e, int64_t o, int64_t k) const {  // dequantized, as cpu::linear
    const int64_t row = e * N + o;
    const uint32_t word = hw[row * (K / 8) + k / 8];
    const double q = (word >> (4 * (k % 8))) & 15u;
    const int64_t g = row * (K / gs) + k / gs;
    return bf16_val(hs[g]) * q + bf16_val(hb[g]);
  }
  WeightView view(int c) const {
    WeightView v;
    v.w = dw[c];
    v.scales = ds[c];
    v.biases = db[c];
    v.rows = N;
    v.cols = K;
    v.bits = 4;
    v.group_size = gs;
    v.scale_dtype = DType::BF16;
    return v;
  }
  size_t bytes() const { return size_t(E * N * K / 2 + 2 * 2 * E * N * K / gs); }
};

// One product: LinearArgs on the device plus what the host reference needs.
struct Problem {
  const char* name;
  Stack* w;
  int64_t M, X_rows;               // product rows, rows of x
  std::vector<float> hx;           // [X_rows, K]
  std::vector<int32_t> hx_rows;    // [M] or empty
  std::vector<int32_t> hrow_expert;  // [M] expert of each product row (dense: 0)
  std::vector<float> hy_old, hrow_scale;  // swiglu only
  float *dx = nullptr, *dy = nullptr, *dy_old = nullptr, *drs = nullptr;
  int32_t *dx_rows = nullptr, *dte = nullptr, *dtr = nullptr, *dre = nullptr, *dnt = nullptr;
  int64_t max_tiles64 = 0;  // grid of 64-row tiles
  bool grouped = false, swiglu = false;
  LinearArgs args(int copy) const {
    LinearArgs a;
    a.w = w->view(copy);
    a.x = dx;
    a.ldx = w->K;
    a.x_rows = dx_rows;
    a.y = dy;
    a.ldy = w->N;
    a.swiglu = swiglu;
    a.row_scale = drs;
    if (grouped) {
      a.tiles.tile_expert = dte;
      a.tiles.tile_row0 = dtr;
      a.tiles.row_end = dre;
      a.tiles.num_tiles = dnt;
    } else {
      a.tiles.M = M;
    }
    return a;
  }
};

static void fill_x(Problem& p) {
  p.hx.resize(p.X_rows * p.w->K);
  for (auto& v : p.hx) v = 2.f * rndu() - 1.f;
  CK(cudaMalloc(&p.dx, p.hx.size() * 4));
  CK(cudaMemcpy(p.dx, p.hx.data(), p.hx.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&p.dy, p.M * p.w->N * 4));
  if (p.swiglu) {
    p.hy_old.resize(p.M * p.w->N);
    for (auto& v : p.hy_old) v = 4.f * rndu() - 2.f;
    p.hrow_scale.resize(p.M);
    for (auto& v : p.hrow_scale) v = rndu();
    CK(cudaMalloc(&p.dy_old, p.M * p.w->N * 4));
    CK(cudaMemcpy(p.dy_old, p.hy_old.data(), p.hy_old.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&p.drs, p.M * 4));
    CK(cudaMemcpy(p.drs, p.hrow_scale.data(), p.M * 4, cudaMemcpyHostToDevice));
  }
}

static Problem dense(const char* name, Stack* w, int64_t T, bool swiglu = false) {
  Problem p;
  p.name = name;
  p.w = w;
  p.M = p.X_rows = T;
  p.swiglu = swiglu;
  p.hrow_expert.assign(T, 0);
  p.max_tiles64 = (T + 63) / 64;
  fill_x(p);
  return p;
}

// Routed rows of T tokens x top_k distinct uniform experts, grouped by expert as moe_scatter does.
// gather: gate/up (x = tokens, x_rows gather); else down (x = the routed rows themselves).
static Problem moe(const char* name, Stack* w, int64_t T, int top_k, bool gather, int empty_experts = 0,
                   bool swiglu = false) {
  Problem p;
  p.name = name;
  p.w = w;
  p.grouped = true;
  p.swiglu = swiglu;
  const int64_t E = w->E;
  std::vector<std::vector<int32_t>> tokens(E);
  std::vector<int> pick(E);
  for (int64_t t = 0; t < T; ++t) {
    std::iota(pick.begin(), pick.end(), 0);
    for (int k = 0; k < top_k; ++k) {  // partial Fisher-Yates over experts >= empty_experts
      const int64_t lo = empty_experts + k, j = lo + rnd32() % (E - lo);
      std::swap(pick[lo], pick[j]);
      tokens[pick[lo]].push_back(int32_t(t));
    }
  }
  std::vector<int32_t> row_end(E), te, tr;
  int64_t row = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t start = row;
    for (int32_t t : tokens[e]) p.hx_rows.push_back(t), p.hrow_expert.push_back(int32_t(e)), ++row;
    row_end[e] = int32_t(row);
    for (int64_t r0 = start; r0 < row; r0 += 64) te.push_back(int32_t(e)), tr.push_back(int32_t(r0));
  }
  p.M = row;
  p.max_tiles64 = (p.M + 63) / 64 + std::min<int64_t>(E, p.M);
  const int32_t nt = int32_t(te.size());
  te.resize(p.max_tiles64, -1);
  tr.resize(p.max_tiles64, -1);
  CK(cudaMalloc(&p.dte, te.size() * 4));
  CK(cudaMalloc(&p.dtr, tr.size() * 4));
  CK(cudaMalloc(&p.dre, E * 4));
  CK(cudaMalloc(&p.dnt, 4));
  CK(cudaMemcpy(p.dte, te.data(), te.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(p.dtr, tr.data(), tr.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(p.dre, row_end.data(), E * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(p.dnt, &nt, 4, cudaMemcpyHostToDevice));
  if (gather) {
    p.X_rows = T;
    CK(cudaMalloc(&p.dx_rows, p.M * 4));
    CK(cudaMemcpy(p.dx_rows, p.hx_rows.data(), p.M * 4, cudaMemcpyHostToDevice));
  } else {
    p.X_rows = p.M;
    p.hx_rows.clear();
  }
  fill_x(p);
  return p;
}

static void free_problem(Problem& p) {
  for (void* q : {(void*)p.dx, (void*)p.dy, (void*)p.dy_old, (void*)p.drs, (void*)p.dx_rows, (void*)p.dte,
                  (void*)p.dtr, (void*)p.dre, (void*)p.dnt})
    if (q) cudaFree(q);
}

enum Kernel { OLD, NEW };

// The new kernel's BM exactly as linear.cu's run_wgmma picks it.
static int new_bm(const Problem& p) {
  const int64_t col_tiles = (p.w->N + WG_BN - 1) / WG_BN;
  return (!p.grouped && p.w->gs != 32 && (p.M + 127) / 128 * col_tiles >= g_sms) ? 128 : 64;
}

template <int BM, bool GS32>
static void launch_new(const LinearArgs& a, int64_t tiles) {
  static bool configured = false;
  if (!configured) {
    CK(cudaFuncSetAttribute(linear_wgmma_kernel<BM, GS32>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            wg_smem_bytes(BM)));
    configured = true;
  }
  const dim3 grid(unsigned(tiles), unsigned((a.w.rows + WG_BN - 1) / WG_BN));
  linear_wgmma_kernel<BM, GS32><<<grid, WG_THREADS, wg_smem_bytes(BM)>>>(a);
}

static void launch(Kernel k, const Problem& p, int copy) {
  const LinearArgs a = p.args(copy);
  if (k == OLD) {
    static bool configured = false;
    if (!configured) {
      CK(cudaFuncSetAttribute(linear_gemm_kernel<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, GEMM_SMEM_BYTES));
      configured = true;
    }
    const dim3 grid(unsigned(p.max_tiles64), unsigned((p.w->N + GEMM_BN - 1) / GEMM_BN));
    linear_gemm_kernel<4><<<grid, GEMM_THREADS, GEMM_SMEM_BYTES>>>(a);
  } else {
    const int bm = new_bm(p);
    if (bm == 128) launch_new<128, false>(a, (p.M + 127) / 128);
    else if (p.w->gs == 32) launch_new<64, true>(a, p.max_tiles64);
    else launch_new<64, false>(a, p.max_tiles64);
  }
  CK(cudaGetLastError());
}

// Poisoned output, one launch on copy 0, all outputs finite, sampled error vs fp64.
static double check(Kernel k, const Problem& p, bool& ok) {
  const int64_t MN = p.M * p.w->N;
  if (p.swiglu) CK(cudaMemcpy(p.dy, p.dy_old, MN * 4, cudaMemcpyDeviceToDevice));
  else CK(cudaMemset(p.dy, 0xFF, MN * 4));
  launch(k, p, 0);
  CK(cudaDeviceSynchronize());
  std::vector<float> y(MN);
  CK(cudaMemcpy(y.data(), p.dy, MN * 4, cudaMemcpyDeviceToHost));
  int64_t bad = 0;
  for (float v : y) bad += !std::isfinite(v);
  double num = 0, den = 0;
  const int samples = 4096;
  for (int i = 0; i < samples; ++i) {
    const int64_t r = rnd32() % p.M, o = rnd32() % p.w->N;
    const int64_t xr = p.hx_rows.empty() ? r : p.hx_rows[r], e = p.hrow_expert[r];
    const float* x = p.hx.data() + xr * p.w->K;
    double ref = 0;
    for (int64_t kk = 0; kk < p.w->K; ++kk) ref += p.w->w(e, o, kk) * double(x[kk]);
    if (p.swiglu) {
      const double yo = p.hy_old[r * p.w->N + o];
      ref = double(p.hrow_scale[r]) * (yo / (1.0 + std::exp(-yo))) * ref;
    }
    const double d = double(y[r * p.w->N + o]) - ref;
    num += d * d;
    den += ref * ref;
  }
  const double err = std::sqrt(num / std::max(den, 1e-300));
  ok = bad == 0 && err <= 1e-2 && std::isfinite(err);
  if (!ok) {
    std::printf("FAIL: %s %s: %lld non-finite outputs of %lld, sampled rel err %.3e\n", p.name,
                k == OLD ? "old" : "new", (long long)bad, (long long)MN, err);
    ++g_failures;
  }
  return err;
}

static double time_us(Kernel k, const Problem& p) {
  const int copies = p.w->copies;
  const int R = std::max(10, copies);
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int i = 0; i < 3; ++i) launch(k, p, i % copies);
  std::vector<float> ms;
  int c = 0;
  for (int b = 0; b < 15; ++b) {
    CK(cudaEventRecord(e0));
    for (int i = 0; i < R; ++i) launch(k, p, c++ % copies);
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float t;
    CK(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  return ms[ms.size() / 2] * 1e3 / R;
}

static void row(const Problem& p, bool timed) {
  bool ok_old, ok_new;
  const double err_old = check(OLD, p, ok_old), err_new = check(NEW, p, ok_new);
  const double flop = 2.0 * p.M * p.w->N * p.w->K;
  if (timed) {
    const double t_old = time_us(OLD, p), t_new = time_us(NEW, p);
    std::printf("| %s | %lld x %lld x %lld | %d | %.1f | %.1f | %.1f | %.1f | %.2fx | %.1e %s | %.1e %s |\n", p.name,
                (long long)p.M, (long long)p.w->N, (long long)p.w->K, new_bm(p), t_old, flop / t_old * 1e-6, t_new,
                flop / t_new * 1e-6, t_old / t_new, err_old, ok_old ? "ok" : "FAIL", err_new, ok_new ? "ok" : "FAIL");
  } else {
    std::printf("| %s | %lld x %lld x %lld | %d | | | | | | %.1e %s | %.1e %s |\n", p.name, (long long)p.M,
                (long long)p.w->N, (long long)p.w->K, new_bm(p), err_old, ok_old ? "ok" : "FAIL", err_new,
                ok_new ? "ok" : "FAIL");
  }
  std::fflush(stdout);
}

int main() {
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  g_sms = prop.multiProcessorCount;
  std::printf("gemm_lab on %s (%d SMs); new kernel: linear_wgmma_kernel, smem %d B (BM 128) / %d B (BM 64)\n\n",
              prop.name, g_sms, wg_smem_bytes(128), wg_smem_bytes(64));
  std::printf("| product | M x N x K | new BM | old us | old TFLOP/s | new us | new TFLOP/s | speed-up | old err | new err |\n");
  std::printf("|---|---|---:|---:|---:|---:|---:|---:|---|---|\n");
  const int64_t T = 2048;
  auto copies_for = [](int64_t N, int64_t K) { return int(std::max<int64_t>(2, (160ll << 20) / (N * K * 9 / 16))); };
  {
    Stack w(1, 8192, 2048, 64, copies_for(8192, 2048));
    Problem p = dense("dense q/qkv 8192x2048", &w, T);
    row(p, true);
    free_problem(p);
  }
  {
    Stack w(1, 12352, 2048, 64, copies_for(12352, 2048));
    Problem p = dense("dense in_proj 12352x2048", &w, T);
    row(p, true);
    free_problem(p);
  }
  {
    Stack w(1, 2048, 4096, 64, copies_for(2048, 4096));
    Problem p = dense("dense out/o_proj 2048x4096", &w, T);
    row(p, true);
    free_problem(p);
  }
  {
    Stack w(1, 512, 2048, 64, copies_for(512, 2048));
    Problem p = dense("dense shared gate/up, k/v 512x2048", &w, T);
    row(p, true);
    free_problem(p);
  }
  {
    Stack w(1, 2048, 512, 64, copies_for(2048, 512));
    Problem p = dense("dense shared down 2048x512", &w, T);
    row(p, true);
    free_problem(p);
  }
  {
    Stack w(256, 512, 2048, 64, 1);
    Problem p = moe("moe gate/up [256,512,2048]", &w, T, 8, true);
    row(p, true);
    free_problem(p);
  }
  {
    Stack w(256, 2048, 512, 64, 1);
    Problem p = moe("moe down [256,2048,512]", &w, T, 8, false);
    row(p, true);
    free_problem(p);
  }
  // correctness only: partial tiles, small T, other group sizes, SwiGLU, empty experts
  {
    Stack w(1, 1000, 512, 64, 1);
    for (int64_t t : {9, 100, 300}) {
      Problem p = dense("check N=1000 K=512 (partial tiles)", &w, t);
      row(p, false);
      free_problem(p);
    }
  }
  {
    Stack w(1, 2048, 2048, 64, 1);
    Problem p = dense("check 128-row tiles, T=2000", &w, 2000);
    row(p, false);
    free_problem(p);
  }
  {
    Stack w(1, 768, 1024, 32, 1);
    Problem p = dense("check group 32", &w, 200);
    row(p, false);
    free_problem(p);
  }
  {
    Stack w(1, 768, 1024, 128, 1);
    Problem p = dense("check group 128", &w, 200);
    row(p, false);
    free_problem(p);
  }
  {
    Stack w(1, 4096, 2048, 64, 1);
    Problem p = dense("check SwiGLU 128-row", &w, 2048, true);
    row(p, false);
    free_problem(p);
  }
  {
    Stack w(16, 512, 2048, 64, 1);
    Problem p = moe("check moe SwiGLU, 6 empty experts", &w, 77, 4, true, 6, true);
    row(p, false);
    free_problem(p);
  }
  CK(cudaDeviceSynchronize());
  if (g_failures) {
    std::printf("\ngemm_lab: %d FAIL\n", g_failures);
    return 1;
  }
  std::printf("\ngemm_lab: all checks passed\n");
  return 0;
}
