// gemm_lab: the prefill GEMM over 4-bit (and, for the 8-bit rows, 8-bit) MLX-affine weights, self-checking,
// one table row per kernel:
//   old         kernels/linear_gemm.cuh (mma.sync; the library's 8-bit prefill GEMM)
//   wgmma       benchmarks/gemm_lab_wgmma.cuh (the retired one-kernel wgmma GEMM, X fp32 converted per
//               k-tile): the reference
//   wgmma-tma   the library's prefill GEMM, kernels/linear_wgmma_tma.cuh: X -> bf16 once
//               (wgx_bf16_kernel) + linear_wgmma_tma_kernel (TMA, mbarriers, producer/consumer
//               warpgroups, persistent), launched as linear.cu's run_wgmma does
//   small       kernels/moe_small.cuh, the few-rows MoE expert kernels (tokens as the mma's N) of medium
//               prompts: moe rows only (small_row), timed against wgmma-tma on the same routing
//   Run: bash benchmarks/gemm_lab.sh (one process per kernel group, so a crash costs one group only);
//   by hand: gemm_lab [-n] [old] [wgmma] [tma] [small]   (-n: no table header; no kernel names: all).
// Shapes (N outputs x K, T rows): the engine's dense prefill products at T = GEMM_LAB_T (default 2048) and
// its MoE grouped products (T tokens x top-8 over 256 experts, uniform random routing, tile map of 64-row
// tiles built like moe_routing.cuh: rows grouped by expert, ascending tokens, x_rows gather for gate/up;
// the "128-row tiles" rows give the tma kernel a map of 128-row tiles, the references keep 64).
// Timing: per kernel, 15 batches of R launches between CUDA events after a warm-up; us = median batch / R.
// Launch i reads weight copy i % copies (dense: copies >= 160 MB together, L2 is 50-60 MB; MoE: one
// 128 MB+ stack), so the first touch of a weight comes from HBM. TFLOP/s = 2*M*N*K / time, M = product rows.
// Check (before timing, per kernel): Y poisoned with NaN bytes, one launch on copy 0, then every output
// must be finite and the sampled relative error ||y - ref|| / ||ref|| over 4096 random outputs (host fp64
// reference on the same bf16 scale/bias values and fp32 x) must be <= 1e-2; otherwise FAIL and exit 1.
// wgmma-tma is also compared with wgmma's output on the same launch: "vs wgmma" is
// max |y - y_wgmma| / max |y_wgmma| over all outputs ("bit-identical" when every float matches); a variant
// must stay <= 1e-6 there (same operands, same order) or FAIL. Its time includes the X -> bf16 kernel,
// whose time alone is the "X->bf16 us" column.
// Also checks (not timed): partial row/col tiles, T = 9..300, group sizes 32/128, SwiGLU epilogue.
// 8-bit rows ("8-bit ..."; old and tma only: the retired wgmma GEMM is 4-bit): the router (256 x 2048), the
// shared-expert gate (1 x 2048) and both stacked (257 x 2048) at T = GEMM_LAB_T, old (linear_gemm_kernel<8>,
// what the engine ran them on) against wgmma-tma with BITS = 8; "vs wgmma (time)" is then old's time over
// the row's, and the output column is empty (no bitwise reference).
// Gated rows (gated_row; tma only): the GATED kernel computing y = row_scale * silu(X Wg^T) * (X Wu^T) in
// one product, against the two-product TMA run on the same inputs (the gate product into y, then the
// up product with the SwiGLU epilogue: linear.cu's fallback). "wgmma-tma 2 products" is that run;
// for "wgmma-tma gated" the "vs wgmma" columns are against it: time ratio, and the output, which must
// be bit-identical (every float) or FAIL. Both times include one X -> bf16 conversion. Two more rows per
// gated problem time the Xb hand-over (docs/cuda.md): the GATED product then wgx_bf16_kernel of its F32
// output (what the down product converted), against the GATED product storing that Xb itself (a.yb),
// whose bits must equal the conversion's (FAIL otherwise).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <tuple>
#include <numeric>
#include <random>
#include <vector>

#include "cuda/kernels/linear_gemm.cuh"
#include "cuda/kernels/linear_wgmma_tma.cuh"
#include "cuda/kernels/moe_small.cuh"
#include "cuda/tensor_map.h"
#include "gemm_lab_wgmma.cuh"

static void check_cuda(cudaError_t e, const char* what, int line) {
  if (e == cudaSuccess) return;
  std::fprintf(stderr, "gemm_lab: %s failed: %s (gemm_lab.cu:%d)\n", what, cudaGetErrorString(e), line);
  std::exit(1);
}
#define CK(call) check_cuda((call), #call, __LINE__)

using namespace lily::cuda;
using lily::DType;

static int g_failures = 0;
static int g_split = 1;  // split-K of the dense 64-row TMA rows (GEMM_LAB_SPLITS)
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

// A stack [E, N, K] of 4- or 8-bit affine matrices, `copies` copies on the device; copy 0 also on the host.
struct Stack {
  int64_t E, N, K;
  int gs, copies, bits;
  std::vector<uint32_t> hw;
  std::vector<uint16_t> hs, hb;
  std::vector<uint32_t*> dw;
  std::vector<uint16_t*> ds, db;
  Stack(int64_t E_, int64_t N_, int64_t K_, int gs_, int copies_, int bits_ = 4)
      : E(E_), N(N_), K(K_), gs(gs_), copies(copies_), bits(bits_) {
    const int64_t words = E * N * K * bits / 32, groups = E * N * K / gs;
    hw.resize(words);
    hs.resize(groups);
    hb.resize(groups);
    for (auto& w : hw) w = rnd32();
    for (int64_t i = 0; i < groups; ++i) {
      const float s = (0.004f + 0.02f * rndu()) * (bits == 8 ? 1.f / 16 : 1.f);  // the same weight range
      hs[i] = bf16_bits(s);
      hb[i] = bf16_bits(-float(1 << (bits - 1)) * s + 0.02f * (rndu() - 0.5f));
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
    const int per = 32 / bits;  // values per word
    const uint32_t word = hw[row * (K / per) + k / per];
    const double q = (word >> (bits * (k % per))) & ((1u << bits) - 1);
    const int64_t g = row * (K / gs) + k / gs;
    return bf16_val(hs[g]) * q + bf16_val(hb[g]);
  }
  WeightView view(int c) const {
    WeightView v;
    v.w = dw[c];
    v.scales = ds[c];
    v.biases = db[c];
    v.num_stack = E;
    v.rows = N;
    v.cols = K;
    v.bits = bits;
    v.group_size = gs;
    v.scale_dtype = DType::BF16;
    return v;
  }
  size_t bytes() const { return size_t(E * N * K * bits / 8 + 2 * 2 * E * N * K / gs); }
};

// One product: LinearArgs on the device plus what the host reference needs.
struct Problem {
  const char* name;
  Stack* w;
  Stack* up = nullptr;             // gated: the up matrix (w is the gate); y = row_scale * silu(gate) * up
  int64_t M, X_rows;               // product rows, rows of x
  std::vector<float> hx;           // [X_rows, K]
  std::vector<int32_t> hx_rows;    // [M] or empty
  std::vector<int32_t> hrow_expert;  // [M] expert of each product row (dense: 0)
  std::vector<float> hy_old, hrow_scale;  // swiglu only
  std::vector<float> hy_wgmma;            // wgmma's output on copy 0 (the variants' reference)
  uint16_t* dxb = nullptr;                // X as bf16 [X_rows, K] (wgx_bf16_kernel)
  float *dx = nullptr, *dy = nullptr, *dy_old = nullptr, *drs = nullptr;
  int32_t *dx_rows = nullptr, *dte = nullptr, *dtr = nullptr, *dre = nullptr, *dnt = nullptr;
  int32_t *dte128 = nullptr, *dtr128 = nullptr, *dnt128 = nullptr;  // grouped, tma_rows 128: the tma kernel's map
  int64_t max_tiles64 = 0;  // grid of 64-row tiles
  int tma_rows = 64;        // grouped: rows per tile of the tma kernel's map (the references take 64)
  bool grouped = false, swiglu = false;
  LinearArgs args(int copy, bool tma = false) const {
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
      const bool wide = tma && tma_rows == 128;
      a.tiles.tile_expert = wide ? dte128 : dte;
      a.tiles.tile_row0 = wide ? dtr128 : dtr;
      a.tiles.row_end = dre;
      a.tiles.num_tiles = wide ? dnt128 : dnt;
      a.tiles.tile_rows = wide ? 128 : 64;
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
  CK(cudaMalloc(&p.dxb, p.hx.size() * 2));
  if (p.swiglu) {
    p.hy_old.resize(p.M * p.w->N);
    for (auto& v : p.hy_old) v = 4.f * rndu() - 2.f;
    CK(cudaMalloc(&p.dy_old, p.M * p.w->N * 4));
    CK(cudaMemcpy(p.dy_old, p.hy_old.data(), p.hy_old.size() * 4, cudaMemcpyHostToDevice));
  }
  if (p.swiglu || p.up) {
    p.hrow_scale.resize(p.M);
    for (auto& v : p.hrow_scale) v = rndu();
    CK(cudaMalloc(&p.drs, p.M * 4));
    CK(cudaMemcpy(p.drs, p.hrow_scale.data(), p.M * 4, cudaMemcpyHostToDevice));
  }
}

static Problem dense(const char* name, Stack* w, int64_t T, bool swiglu = false, Stack* up = nullptr) {
  Problem p;
  p.name = name;
  p.w = w;
  p.up = up;
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
                   bool swiglu = false, int tma_rows = 64, Stack* up = nullptr) {
  Problem p;
  p.tma_rows = tma_rows;
  p.name = name;
  p.w = w;
  p.up = up;
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
  std::vector<int32_t> row_end(E), te, tr, te128, tr128;
  int64_t row = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t start = row;
    for (int32_t t : tokens[e]) p.hx_rows.push_back(t), p.hrow_expert.push_back(int32_t(e)), ++row;
    row_end[e] = int32_t(row);
    for (int64_t r0 = start; r0 < row; r0 += 64) te.push_back(int32_t(e)), tr.push_back(int32_t(r0));
    for (int64_t r0 = start; r0 < row; r0 += 128) te128.push_back(int32_t(e)), tr128.push_back(int32_t(r0));
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
  if (tma_rows == 128) {
    const int32_t nt128 = int32_t(te128.size());
    CK(cudaMalloc(&p.dte128, std::max<size_t>(1, te128.size()) * 4));
    CK(cudaMalloc(&p.dtr128, std::max<size_t>(1, tr128.size()) * 4));
    CK(cudaMalloc(&p.dnt128, 4));
    CK(cudaMemcpy(p.dte128, te128.data(), te128.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(p.dtr128, tr128.data(), tr128.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(p.dnt128, &nt128, 4, cudaMemcpyHostToDevice));
  }
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
                  (void*)p.dtr, (void*)p.dre, (void*)p.dnt, (void*)p.dxb, (void*)p.dte128, (void*)p.dtr128,
                  (void*)p.dnt128})
    if (q) cudaFree(q);
}

enum Kernel { OLD, NEW, TMA, NUM_KERNELS };
static const char* kNames[NUM_KERNELS] = {"old", "wgmma", "wgmma-tma"};
static const char* kArgs[NUM_KERNELS] = {"old", "wgmma", "tma"};
static bool g_run[NUM_KERNELS] = {};

// BM exactly as linear.cu's run_wgmma picks it (the reference uses the same rule).
static int new_bm(const Problem& p) {
  const int64_t col_tiles = (p.w->N + WG_BN - 1) / WG_BN, sms = g_sms;
  const int64_t t128 = (p.M + 127) / 128 * col_tiles, t64 = (p.M + 63) / 64 * col_tiles;  // linear.cu's dense_wide
  const bool wide = t128 >= sms || 10 * ((t64 + sms - 1) / sms) > 13 * ((t128 + sms - 1) / sms);
  return (!p.grouped && p.w->gs != 32 && wide) ? 128 : 64;
}
// BM of the tma kernel: new_bm, or the grouped map's rows (moe.cu picks 128 by rows per expert).
static int tma_bm(const Problem& p) { return p.grouped ? p.tma_rows : new_bm(p); }

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

static void launch_x_bf16(const Problem& p) {
  wgx_bf16_kernel<<<unsigned(p.X_rows), WGX_THREADS>>>(p.dx, p.w->K, p.w->K, p.dxb);
}

// mu: the up matrix's map (GATED), else unread.
template <int BM, bool GS32, bool GATHER, bool GATED = false, int BITS = 4, bool SPLIT = false>
static void launch_tma_kernel(const LinearArgs& a, const uint16_t* xb, const CUtensorMap& mx, const CUtensorMap& mw,
                              const CUtensorMap& mu, int64_t tiles_ub) {
  const auto kernel = linear_wgmma_tma_kernel<BM, GS32, GATHER, SPLIT, GATED, BITS>;
  constexpr int smem = tma_smem_bytes(BM, BITS, GATED), BN = GATED ? WG_BN / 2 : WG_BN;
  static bool configured = false;
  if (!configured) {
    CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    configured = true;
  }
  const int64_t total_ub = tiles_ub * ((a.w.rows + BN - 1) / BN) * (SPLIT ? a.k_splits : 1);
  const unsigned grid = unsigned(std::max<int64_t>(1, std::min<int64_t>(total_ub, g_sms)));
  kernel<<<grid, TMA_THREADS, smem>>>(a, xb, mx, mw, mu);
}

// Tensor maps, cached by (address, shape): Xb per problem and BM (rows: the box rows), W per weight copy,
// bits and box rows (256, or 128 for a gated product).
static const CUtensorMap& tensor_map(bool is_x, const void* ptr, int64_t d0, int64_t d1, int64_t d2, int rows,
                                     int bits = 4) {
  static std::map<std::tuple<bool, const void*, int64_t, int64_t, int64_t, int, int>, CUtensorMap> cache;
  const auto key = std::make_tuple(is_x, ptr, d0, d1, d2, rows, bits);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  CUtensorMap m;
  const CUresult r =
      is_x ? make_xb_tensor_map(m, ptr, d0, d1, rows) : make_w_tensor_map(m, ptr, d0, d1, d2, bits, rows);
  if (r != CUDA_SUCCESS) {
    std::printf("FAIL: wgmma-tma: cuTensorMapEncodeTiled (%s) returned %d\n", is_x ? "Xb" : "W", int(r));
    std::fflush(stdout);
    std::exit(1);
  }
  return cache.emplace(key, m).first->second;
}

// The plain or SwiGLU product of a (its matrix a.w: p.w's or p.up's copy), BITS = a.w.bits.
template <int BITS>
static void launch_tma_bits(const Problem& p, const LinearArgs& a, int bm) {
  const bool gather = p.dx_rows != nullptr, gs32 = a.w.group_size == 32;
  // gathered rows: the row box {64, 1} (one TMA load a row), as linear.cu's launch_wgmma
  const CUtensorMap& mx = tensor_map(true, p.dxb, p.X_rows, a.w.cols, 0, gather ? 1 : bm);
  const CUtensorMap& mw = tensor_map(false, a.w.w, a.w.num_stack, a.w.rows, a.w.cols, WG_BN, BITS);
  if (bm == 128) {
    if (gs32) {
      std::printf("FAIL: wgmma-tma: no BM 128 instance for group 32\n");
      std::exit(1);
    }
    const int64_t tiles = p.grouped ? p.max_tiles64 : (p.M + 127) / 128;
    if (gather) launch_tma_kernel<128, false, true, false, BITS>(a, p.dxb, mx, mw, mw, tiles);
    else launch_tma_kernel<128, false, false, false, BITS>(a, p.dxb, mx, mw, mw, tiles);
  } else if (gather) {
    if (gs32) launch_tma_kernel<64, true, true, false, BITS>(a, p.dxb, mx, mw, mw, p.max_tiles64);
    else launch_tma_kernel<64, false, true, false, BITS>(a, p.dxb, mx, mw, mw, p.max_tiles64);
  } else if (g_split > 1 && !gs32) {  // split-K rows (GEMM_LAB_SPLITS): linear.cu's with_split_k at g_split
    LinearArgs as = a;
    static float* partial = nullptr;
    static uint32_t* done = nullptr;
    if (partial == nullptr) {
      CK(cudaMalloc(&partial, size_t(256) * 256 * 64 * 4 * 2));
      CK(cudaMalloc(&done, 4096 * 4));
      CK(cudaMemset(done, 0, 4096 * 4));
    }
    as.k_splits = g_split, as.partial = partial, as.split_done = done;
    launch_tma_kernel<64, false, false, false, BITS, true>(as, p.dxb, mx, mw, mw, p.max_tiles64);
  } else {
    if (gs32) launch_tma_kernel<64, true, false, false, BITS>(a, p.dxb, mx, mw, mw, p.max_tiles64);
    else launch_tma_kernel<64, false, false, false, BITS>(a, p.dxb, mx, mw, mw, p.max_tiles64);
  }
}

static void launch_tma(const Problem& p, const LinearArgs& a, int bm) {
  if (a.w.bits == 8) return launch_tma_bits<8>(p, a, bm);
  launch_tma_bits<4>(p, a, bm);
}

// BM of the gated product as linear.cu's run_wgmma picks it: the map's rows, or dense 128 when
// 128-row tiles x 128-output column tiles still cover the SMs.
static int gated_bm(const Problem& p) {
  if (p.grouped) return p.tma_rows;
  return (p.M + 127) / 128 * ((p.w->N + 127) / 128) >= g_sms ? 128 : 64;
}

// A gated problem on copy `copy`: X -> bf16, then the GATED product, or (two) the gate product into y
// and the up product with SwiGLU, as linear.cu's fallback runs them. yb (GATED only): the output as the
// next product's Xb there instead of y (LinearArgs::yb, moe.cu's hand-over).
static void launch_gated(const Problem& p, int copy, bool two, uint16_t* yb = nullptr) {
  launch_x_bf16(p);
  LinearArgs a = p.args(copy, true);
  a.yb = yb;
  if (two) {
    LinearArgs g = a, u = a;
    g.row_scale = nullptr;
    u.w = p.up->view(copy);
    u.swiglu = true;
    launch_tma(p, g, tma_bm(p));
    launch_tma(p, u, tma_bm(p));
    CK(cudaGetLastError());
    return;
  }
  a.up = p.up->view(copy);
  const int bm = gated_bm(p);
  const bool gather = p.dx_rows != nullptr;
  const CUtensorMap& mx = tensor_map(true, p.dxb, p.X_rows, p.w->K, 0, gather ? 1 : bm);  // gathered: row box
  const CUtensorMap& mw = tensor_map(false, p.w->dw[copy], p.w->E, p.w->N, p.w->K, WG_BN / 2);
  const CUtensorMap& mu = tensor_map(false, p.up->dw[copy], p.up->E, p.up->N, p.up->K, WG_BN / 2);
  const int64_t tiles = p.grouped || bm == 64 ? p.max_tiles64 : (p.M + 127) / 128;
  if (bm == 128) {
    if (gather) launch_tma_kernel<128, false, true, true>(a, p.dxb, mx, mw, mu, tiles);
    else launch_tma_kernel<128, false, false, true>(a, p.dxb, mx, mw, mu, tiles);
  } else {
    if (gather) launch_tma_kernel<64, false, true, true>(a, p.dxb, mx, mw, mu, tiles);
    else launch_tma_kernel<64, false, false, true>(a, p.dxb, mx, mw, mu, tiles);
  }
  CK(cudaGetLastError());
}

static void launch(Kernel k, const Problem& p, int copy) {
  const LinearArgs a = p.args(copy);
  const int bm = new_bm(p);
  const int64_t tiles = bm == 128 ? (p.M + 127) / 128 : p.max_tiles64;
  if (k == OLD) {
    static bool configured = false;
    if (!configured) {
      CK(cudaFuncSetAttribute(linear_gemm_kernel<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, GEMM_SMEM_BYTES));
      CK(cudaFuncSetAttribute(linear_gemm_kernel<8>, cudaFuncAttributeMaxDynamicSharedMemorySize, GEMM_SMEM_BYTES));
      configured = true;
    }
    const dim3 grid(unsigned(p.max_tiles64), unsigned((p.w->N + GEMM_BN - 1) / GEMM_BN));
    if (p.w->bits == 8) linear_gemm_kernel<8><<<grid, GEMM_THREADS, GEMM_SMEM_BYTES>>>(a);
    else linear_gemm_kernel<4><<<grid, GEMM_THREADS, GEMM_SMEM_BYTES>>>(a);
  } else if (k == NEW) {
    if (p.w->bits != 4) {
      std::printf("FAIL: %s: the retired wgmma GEMM takes 4-bit weights only\n", p.name);
      std::exit(1);
    }
    if (bm == 128) launch_new<128, false>(a, tiles);
    else if (p.w->gs == 32) launch_new<64, true>(a, tiles);
    else launch_new<64, false>(a, tiles);
  } else {
    launch_x_bf16(p);
    launch_tma(p, p.args(copy, true), tma_bm(p));
  }
  CK(cudaGetLastError());
}

// Poisoned output, one launch on copy 0, all outputs finite, sampled error vs fp64; for the variants
// also the max difference to wgmma's output (vs_wgmma < 0: bit-identical).
static double check(Kernel k, Problem& p, bool& ok, double& vs_wgmma) {
  const int64_t MN = p.M * p.w->N;
  auto run_once = [&](Kernel kk, std::vector<float>& y) {
    if (p.swiglu) CK(cudaMemcpy(p.dy, p.dy_old, MN * 4, cudaMemcpyDeviceToDevice));
    else CK(cudaMemset(p.dy, 0xFF, MN * 4));
    launch(kk, p, 0);
    CK(cudaDeviceSynchronize());
    y.resize(MN);
    CK(cudaMemcpy(y.data(), p.dy, MN * 4, cudaMemcpyDeviceToHost));
  };
  std::vector<float> y;
  run_once(k, y);
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
  vs_wgmma = 0;
  if (k == NEW) p.hy_wgmma = y;
  if (k == TMA && p.w->bits == 4) {
    if (p.hy_wgmma.empty()) run_once(NEW, p.hy_wgmma);
    double dmax = 0, rmax = 0;
    bool same = true;
    for (int64_t i = 0; i < MN; ++i) {
      same &= std::memcmp(&y[i], &p.hy_wgmma[i], 4) == 0;
      dmax = std::max(dmax, std::fabs(double(y[i]) - double(p.hy_wgmma[i])));
      rmax = std::max(rmax, std::fabs(double(p.hy_wgmma[i])));
    }
    vs_wgmma = same ? -1.0 : dmax / std::max(rmax, 1e-300);
    // split-K rows sum the k-slices in another order: ~sqrt(K) fp32 roundings, up to ~4e-6 at K = 4096
    if (!(same || vs_wgmma <= (g_split > 1 ? 1e-5 : 1e-6))) ok = false;  // NaN lands here too
  }
  if (!ok) {
    std::printf("FAIL: %s %s: %lld non-finite outputs of %lld, sampled rel err %.3e, vs wgmma %.3e\n", p.name,
                kNames[k], (long long)bad, (long long)MN, err, vs_wgmma);
    ++g_failures;
  }
  return err;
}

template <class F>
static double time_launches(int copies, F&& launch_copy) {
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
  std::sort(ms.begin(), ms.end());
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  return ms[ms.size() / 2] * 1e3 / R;
}

static double time_us(Kernel k, const Problem& p) {
  return time_launches(p.w->copies, [&](int c) { launch(k, p, c); });
}

// One row per requested kernel. Timed rows also time wgmma (not printed unless requested) for "vs wgmma";
// 8-bit rows (no wgmma) time old for it instead, and print no wgmma row.
static void row(Problem& p, bool timed) {
  const double flop = 2.0 * p.M * p.w->N * p.w->K;
  const Kernel ref = p.w->bits == 8 ? OLD : NEW;
  double t_ref = 0, t_conv = 0;
  if (timed && (g_run[TMA] || g_run[OLD])) t_ref = time_us(ref, p);
  if (timed && g_run[TMA]) {
    t_conv = time_launches(1, [&](int) { launch_x_bf16(p); });
    CK(cudaGetLastError());
  }
  for (int k = 0; k < NUM_KERNELS; ++k) {
    if (!g_run[k] || (k == NEW && ref != NEW)) continue;
    bool ok;
    double vs;
    const double err = check(Kernel(k), p, ok, vs);
    char vsbuf[32] = "";
    if (k == TMA && ref == NEW) {
      if (vs < 0) std::snprintf(vsbuf, sizeof vsbuf, "bit-identical");
      else std::snprintf(vsbuf, sizeof vsbuf, "%.1e", vs);
    }
    const int bm = k == OLD ? GEMM_BM : k == TMA ? tma_bm(p) : new_bm(p);
    if (timed) {
      const double t = k == ref && t_ref > 0 ? t_ref : time_us(Kernel(k), p);
      if (k == ref) t_ref = t;
      char conv[32] = "";
      if (k == TMA) std::snprintf(conv, sizeof conv, "%.1f", t_conv);
      std::printf("| %s | %lld x %lld x %lld | %s | %d | %.1f | %.1f | %.2fx | %s | %.1e %s | %s |\n", p.name,
                  (long long)p.M, (long long)p.w->N, (long long)p.w->K, kNames[k], bm, t, flop / t * 1e-6, t_ref / t,
                  conv, err, ok ? "ok" : "FAIL", vsbuf);
    } else {
      std::printf("| %s | %lld x %lld x %lld | %s | %d | | | | | %.1e %s | %s |\n", p.name, (long long)p.M,
                  (long long)p.w->N, (long long)p.w->K, kNames[k], bm, err, ok ? "ok" : "FAIL", vsbuf);
    }
    std::fflush(stdout);
  }
  const char* splits = std::getenv("GEMM_LAB_SPLITS");
  if (timed && splits && g_run[TMA] && !p.grouped && !p.swiglu && tma_bm(p) == 64 && p.w->gs != 32) {
    for (const char* q = splits; *q;) {
      const int sp = std::atoi(q);
      while (*q && *q != ',') ++q;
      if (*q == ',') ++q;
      if (sp < 2 || int64_t(sp) * p.max_tiles64 * ((p.w->N + 255) / 256) > 512) continue;
      g_split = sp;
      bool ok;
      double vs;
      const double err = check(TMA, p, ok, vs);
      const double t = time_us(TMA, p);
      g_split = 1;
      std::printf("| %s | %lld x %lld x %lld | wgmma-tma split %d | 64 | %.1f | %.1f | | | %.1e %s | %.1e |\n", p.name,
                  (long long)p.M, (long long)p.w->N, (long long)p.w->K, sp, t, 2.0 * p.M * p.w->N * p.w->K / t * 1e-6,
                  err, ok ? "ok" : "FAIL", vs);
      std::fflush(stdout);
    }
  }
}

// A gated problem (tma only): the two-product run and the GATED product from NaN-poisoned outputs on
// copy 0, each all finite with a sampled error vs the fp64 reference (rs * silu(g) * u) <= 1e-2; the
// gated output must equal the two-product one in every float. Timed: both, one X -> bf16 each.
static void gated_row(Problem& p, bool timed) {
  if (!g_run[TMA]) return;
  const int64_t MN = p.M * p.w->N, N = p.w->N, K = p.w->K;
  auto run_once = [&](bool two, std::vector<float>& y) {
    CK(cudaMemset(p.dy, 0xFF, MN * 4));
    launch_gated(p, 0, two);
    CK(cudaDeviceSynchronize());
    y.resize(MN);
    CK(cudaMemcpy(y.data(), p.dy, MN * 4, cudaMemcpyDeviceToHost));
  };
  std::vector<float> y[2];  // [0] two products, [1] gated
  run_once(true, y[0]);
  run_once(false, y[1]);
  int64_t bad[2] = {0, 0}, differ = 0;
  for (int v = 0; v < 2; ++v)
    for (float f : y[v]) bad[v] += !std::isfinite(f);
  for (int64_t i = 0; i < MN; ++i) differ += std::memcmp(&y[0][i], &y[1][i], 4) != 0;
  double num[2] = {0, 0}, den = 0;
  for (int i = 0; i < 4096; ++i) {
    const int64_t r = rnd32() % p.M, o = rnd32() % N;
    const int64_t xr = p.hx_rows.empty() ? r : p.hx_rows[r], e = p.hrow_expert[r];
    const float* x = p.hx.data() + xr * K;
    double g = 0, u = 0;
    for (int64_t k = 0; k < K; ++k) g += p.w->w(e, o, k) * double(x[k]), u += p.up->w(e, o, k) * double(x[k]);
    const double ref = double(p.hrow_scale[r]) * (g / (1.0 + std::exp(-g))) * u;
    for (int v = 0; v < 2; ++v) num[v] += (double(y[v][r * N + o]) - ref) * (double(y[v][r * N + o]) - ref);
    den += ref * ref;
  }
  double err[2];
  bool ok[2];
  for (int v = 0; v < 2; ++v) {
    err[v] = std::sqrt(num[v] / std::max(den, 1e-300));
    ok[v] = bad[v] == 0 && err[v] <= 1e-2 && std::isfinite(err[v]);
  }
  ok[1] = ok[1] && differ == 0;
  // The Xb hand-over (docs/cuda.md): the GATED product storing its output as the down product's Xb must
  // leave the bits wgx_bf16_kernel makes from the F32 output (host: wg_pack_bf16x2 at wg_xb_pos).
  uint16_t *dyb = nullptr, *dconv = nullptr;
  CK(cudaMalloc(&dyb, MN * 2));
  CK(cudaMalloc(&dconv, MN * 2));
  CK(cudaMemset(dyb, 0xFF, MN * 2));
  launch_gated(p, 0, false, dyb);
  CK(cudaDeviceSynchronize());
  std::vector<uint16_t> yb(MN);
  CK(cudaMemcpy(yb.data(), dyb, MN * 2, cudaMemcpyDeviceToHost));
  int64_t xb_differ = 0;
  for (int64_t r = 0; r < p.M; ++r)
    for (int64_t o = 0; o < N; ++o)
      xb_differ += yb[r * N + wg_xb_pos(o)] != wg_bf16(y[1][r * N + o]);
  if (xb_differ) {
    std::printf("FAIL: %s: gated Xb output: %lld of %lld values differ from wgx_bf16 of the F32 output\n", p.name,
                (long long)xb_differ, (long long)MN);
    ++g_failures;
  }
  double t[2] = {0, 0}, t_xb[2] = {0, 0};  // [0] gated + wgx_bf16 of its F32 output, [1] gated writing Xb
  if (timed) {
    for (int v = 0; v < 2; ++v) t[v] = time_launches(p.w->copies, [&](int c) { launch_gated(p, c, v == 0); });
    t_xb[0] = time_launches(p.w->copies, [&](int c) {
      launch_gated(p, c, false);
      wgx_bf16_kernel<<<unsigned(p.M), WGX_THREADS>>>(p.dy, N, N, dconv);
    });
    t_xb[1] = time_launches(p.w->copies, [&](int c) { launch_gated(p, c, false, dyb); });
  }
  CK(cudaFree(dyb));
  CK(cudaFree(dconv));
  const double flop = 2.0 * 2.0 * p.M * N * K;
  const char* names[2] = {"wgmma-tma 2 products", "wgmma-tma gated"};
  const int bms[2] = {tma_bm(p), gated_bm(p)};
  for (int v = 0; v < 2; ++v) {
    char vs[48] = "";
    if (v == 1 && differ == 0) std::snprintf(vs, sizeof vs, "bit-identical");
    else if (v == 1) std::snprintf(vs, sizeof vs, "%lld floats differ", (long long)differ);
    if (timed)
      std::printf("| %s | %lld x %lld x %lld | %s | %d | %.1f | %.1f | %s%.2fx | | %.1e %s | %s |\n", p.name,
                  (long long)p.M, (long long)N, (long long)K, names[v], bms[v], t[v], flop / t[v] * 1e-6,
                  v == 1 ? "" : "(ref) ", t[0] / t[v], err[v], ok[v] ? "ok" : "FAIL", vs);
    else
      std::printf("| %s | %lld x %lld x %lld | %s | %d | | | | | %.1e %s | %s |\n", p.name, (long long)p.M,
                  (long long)N, (long long)K, names[v], bms[v], err[v], ok[v] ? "ok" : "FAIL", vs);
    if (!ok[v]) {
      std::printf("FAIL: %s %s: %lld non-finite outputs of %lld, sampled rel err %.3e, %lld floats differ\n",
                  p.name, names[v], (long long)bad[v], (long long)MN, err[v], (long long)differ);
      ++g_failures;
    }
  }
  const char* xb_names[2] = {"wgmma-tma gated + X->bf16 of y", "wgmma-tma gated, Xb out"};
  for (int v = 0; v < 2; ++v) {
    if (timed)
      std::printf("| %s | %lld x %lld x %lld | %s | %d | %.1f | | %s%.2fx | | | %s |\n", p.name, (long long)p.M,
                  (long long)N, (long long)K, xb_names[v], bms[1], t_xb[v], v == 1 ? "" : "(ref) ", t_xb[0] / t_xb[v],
                  v == 0 ? "" : xb_differ ? "FAIL" : "bits = wgx of y");
    else if (v == 1)
      std::printf("| %s | %lld x %lld x %lld | %s | %d | | | | | | %s |\n", p.name, (long long)p.M, (long long)N,
                  (long long)K, xb_names[v], bms[1], xb_differ ? "FAIL" : "bits = wgx of y");
  }
  std::fflush(stdout);
}

// The few-rows expert kernels (kernels/moe_small.cuh, small only): p's routed product (gated: p.up set, y =
// row_scale * silu(gate) * up; else the down product) on moe_small_kernel with moe.cu's pass size, from a
// NaN-poisoned y on copy 0: every output finite, sampled error vs fp64 <= 1e-2, and against wgmma-tma on the
// same launch (gated: the GATED product) "vs tma" = max |y - y_tma| / max |y_tma| <= 1e-2 (same bf16 operands,
// another summation order), else FAIL. Also, not timed: X read as Xb (a.xb, wgx_bf16_kernel's copy; gated:
// rows gathered from it) must give the same floats as from the F32 rows, and the gated kernel's Xb output
// (a.yb) must hold wg_bf16 of its F32 output at wg_xb_pos. Timed: us per call (X -> bf16 + the product from
// Xb, as wgmma-tma's time includes its conversion) and GB/s of the weights of experts with rows (each read
// once; printed in the X->bf16 column), against wgmma-tma: two rows, wgmma-tma (the ref) then moe_small (its
// BM column: the rows a pass).
static bool g_small = false;

// moe.cu's launch_moe_small: ms_plan's kernel, the ring as deep as K (2048 gated, 512 down) leaves room for;
// each instance configured once (the carveout to max shared for the ring kernels only), its occupancy printed.
template <bool GATED, int NT, bool RING>
static void launch_small_nt(const LinearArgs& a, int64_t E) {
  constexpr int64_t K = GATED ? 2048 : 512;
  using L = MsLaunch<GATED, NT, RING, K>;
  const auto kernel = L::kernel();
  constexpr size_t smem = L::smem;
  static bool configured = false;
  if (!configured) {
    CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    if (RING) CK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
    int per_sm = 0;
    cudaFuncAttributes fa;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, MS_THREADS, smem));
    CK(cudaFuncGetAttributes(&fa, kernel));
    std::printf("%s, NT %d, R %d: %zu B shared, %d registers, %d CTAs an SM\n",
                RING ? "moe_small_ring_kernel" : "moe_small_kernel", NT, L::R, smem, fa.numRegs, per_sm);
    configured = true;
  }
  if (a.w.cols != K) {
    std::fprintf(stderr, "gemm_lab: moe_small is built for K = %lld, not %lld\n", (long long)K, (long long)a.w.cols);
    std::exit(1);
  }
  kernel<<<dim3(unsigned((a.w.rows + L::cta_rows - 1) / L::cta_rows), unsigned(E)), MS_THREADS, smem>>>(a);
}

static void launch_small(const Problem& p, int copy, uint16_t* yb = nullptr, const uint16_t* xb = nullptr) {
  LinearArgs a = p.args(copy);
  a.yb = yb;
  a.xb = xb;
  const bool gated = p.up != nullptr;
  const MsPlan plan = ms_plan(gated, p.M, p.w->E);
  if (gated) {
    a.up = p.up->view(copy);
    if (plan.ring) launch_small_nt<true, 2, true>(a, p.w->E);
    else launch_small_nt<true, 2, false>(a, p.w->E);
  } else {
    if (plan.nt == 2) launch_small_nt<false, 2, true>(a, p.w->E);
    else launch_small_nt<false, 3, true>(a, p.w->E);
  }
  CK(cudaGetLastError());
}

static void small_row(Problem& p, bool timed) {
  if (!g_small) return;
  const int64_t MN = p.M * p.w->N, N = p.w->N, K = p.w->K;
  const bool gated = p.up != nullptr;
  auto run_once = [&](bool small, std::vector<float>& y) {
    CK(cudaMemset(p.dy, 0xFF, MN * 4));
    if (small) launch_small(p, 0);
    else if (gated) launch_gated(p, 0, false);
    else launch(TMA, p, 0);
    CK(cudaDeviceSynchronize());
    y.resize(MN);
    CK(cudaMemcpy(y.data(), p.dy, MN * 4, cudaMemcpyDeviceToHost));
  };
  std::vector<float> y, yt;
  run_once(true, y);
  run_once(false, yt);
  int64_t bad = 0;
  for (float v : y) bad += !std::isfinite(v);
  double num = 0, den = 0;
  for (int i = 0; i < 4096; ++i) {
    const int64_t r = rnd32() % p.M, o = rnd32() % N;
    const int64_t xr = p.hx_rows.empty() ? r : p.hx_rows[r], e = p.hrow_expert[r];
    const float* x = p.hx.data() + xr * K;
    double g = 0, u = 0;
    for (int64_t k = 0; k < K; ++k) {
      g += p.w->w(e, o, k) * double(x[k]);
      if (gated) u += p.up->w(e, o, k) * double(x[k]);
    }
    const double ref = gated ? double(p.hrow_scale[r]) * (g / (1.0 + std::exp(-g))) * u : g;
    num += (double(y[r * N + o]) - ref) * (double(y[r * N + o]) - ref);
    den += ref * ref;
  }
  const double err = std::sqrt(num / std::max(den, 1e-300));
  double dmax = 0, rmax = 0;
  for (int64_t i = 0; i < MN; ++i) {
    dmax = std::max(dmax, std::fabs(double(y[i]) - double(yt[i])));
    rmax = std::max(rmax, std::fabs(double(yt[i])));
  }
  const double vs = dmax / std::max(rmax, 1e-300);
  // the bf16 hand-overs: X read as Xb (wgx_bf16_kernel's copy; the gated product gathering its rows from
  // it) gives the same floats as from the F32 rows; the gated product's Xb output is wg_bf16 of its F32 one
  int64_t io_differ = 0;
  {
    launch_x_bf16(p);
    CK(cudaMemset(p.dy, 0xFF, MN * 4));
    launch_small(p, 0, nullptr, p.dxb);
    CK(cudaDeviceSynchronize());
    std::vector<float> yx(MN);
    CK(cudaMemcpy(yx.data(), p.dy, MN * 4, cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < MN; ++i) io_differ += std::memcmp(&yx[i], &y[i], 4) != 0;
  }
  if (gated) {
    uint16_t* dyb = nullptr;
    CK(cudaMalloc(&dyb, MN * 2));
    CK(cudaMemset(dyb, 0xFF, MN * 2));
    launch_small(p, 0, dyb);
    CK(cudaDeviceSynchronize());
    std::vector<uint16_t> yb(MN);
    CK(cudaMemcpy(yb.data(), dyb, MN * 2, cudaMemcpyDeviceToHost));
    CK(cudaFree(dyb));
    for (int64_t r = 0; r < p.M; ++r)
      for (int64_t o = 0; o < N; ++o) io_differ += yb[r * N + wg_xb_pos(o)] != wg_bf16(y[r * N + o]);
  }
  const bool ok = bad == 0 && err <= 1e-2 && std::isfinite(err) && vs <= 1e-2 && io_differ == 0;
  if (!ok) {
    std::printf("FAIL: %s small: %lld non-finite of %lld, sampled rel err %.3e, vs tma %.3e, %lld Xb in/out differ\n",
                p.name, (long long)bad, (long long)MN, err, vs, (long long)io_differ);
    ++g_failures;
  }
  const int nt = ms_plan(p.up != nullptr, p.M, p.w->E).nt;
  if (!timed) {
    std::printf("| %s | %lld x %lld x %lld | moe_small NT=%d | | | | | | %.1e %s | vs tma %.1e, Xb %s |\n", p.name,
                (long long)p.M, (long long)N, (long long)K, nt, err, ok ? "ok" : "FAIL", vs, io_differ ? "FAIL" : "ok");
    std::fflush(stdout);
    return;
  }
  int64_t live = 0;  // experts with rows: their weights are read
  for (int64_t e = 0; e < p.w->E; ++e) live += std::count(p.hrow_expert.begin(), p.hrow_expert.end(), int32_t(e)) > 0;
  const double bytes = double(live) * (double(p.w->bytes()) / p.w->E) * (gated ? 2 : 1);
  const double t_small = time_launches(p.w->copies, [&](int c) {  // as wgmma-tma: X -> bf16, then the product
    launch_x_bf16(p);
    launch_small(p, c, nullptr, p.dxb);
  });
  const double t_tma = time_launches(p.w->copies, [&](int c) {
    if (gated) launch_gated(p, c, false);
    else launch(TMA, p, c);
  });
  const double flop = 2.0 * (gated ? 2 : 1) * p.M * N * K;
  for (int v = 0; v < 2; ++v) {
    const double t = v ? t_small : t_tma;
    std::printf("| %s | %lld x %lld x %lld | %s | %d | %.1f | %.1f | %.2fx | %.0f GB/s | %.1e %s | %s |\n", p.name,
                (long long)p.M, (long long)N, (long long)K, v ? "moe_small" : (gated ? "wgmma-tma gated" : "wgmma-tma"),
                v ? nt * 8 : 64, t, flop / t * 1e-6, t_tma / t, bytes / t * 1e-3, v ? err : 0.0, v ? (ok ? "ok" : "FAIL") : "",
                v ? "vs tma (ref)" : "(ref)");
  }
  std::fflush(stdout);
}

int main(int argc, char** argv) {
  bool header = true, any = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "-n") == 0) {
      header = false;
      continue;
    }
    bool known = false;
    for (int k = 0; k < NUM_KERNELS; ++k)
      if (std::strcmp(argv[i], kArgs[k]) == 0) g_run[k] = known = any = true;
    if (std::strcmp(argv[i], "small") == 0) g_small = known = any = true;
    if (!known) {
      std::fprintf(stderr, "gemm_lab: unknown argument %s (kernels: old wgmma tma small; -n: no header)\n", argv[i]);
      return 2;
    }
  }
  if (!any) {
    for (bool& r : g_run) r = true;
    g_small = true;
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  g_sms = prop.multiProcessorCount;
  if (header) {
    std::printf("gemm_lab on %s (%d SMs); smem: wgmma %d / %d B, tma %d / %d B, tma gated %d / %d B "
                "(BM 128 / 64)\n\n",
                prop.name, g_sms, wg_smem_bytes(128), wg_smem_bytes(64), tma_smem_bytes(128, 4),
                tma_smem_bytes(64, 4), tma_smem_bytes(128, 4, true), tma_smem_bytes(64, 4, true));
    std::printf("| product | M x N x K | kernel | BM | us | TFLOP/s | vs wgmma (time) | X->bf16 us | err vs fp64 | vs wgmma (output) |\n");
    std::printf("|---|---|---|---:|---:|---:|---:|---:|---|---|\n");
  }
  const char* t_env = std::getenv("GEMM_LAB_T");  // prefill rows per product (the engine's chunk); default 2048
  const int64_t T = t_env ? std::atoll(t_env) : 2048;
  if (g_small) {  // moe_small at T, the wgmma-tma products on the same routing; then checks at other T, skew
    {
      Stack wg(256, 512, 2048, 64, 1), wu(256, 512, 2048, 64, 1);
      Problem p = moe("moe gate+up [256,512,2048], gated", &wg, T, 8, true, 0, false, 64, &wu);
      small_row(p, true);
      free_problem(p);
      for (int64_t t : {17, 64, 146, 300, 512}) {
        p = moe("check moe_small gate+up", &wg, t, 8, true, 0, false, 64, &wu);
        small_row(p, false);
        free_problem(p);
      }
      p = moe("check moe_small gate+up, 250 empty experts", &wg, 146, 6, true, 250, false, 64, &wu);
      small_row(p, false);  // top-6 of the last 6 experts: 146 rows each, 10 passes of 16 rows
      free_problem(p);
    }
    {
      Stack w(256, 2048, 512, 64, 1);
      Problem p = moe("moe down [256,2048,512]", &w, T, 8, false);
      small_row(p, true);
      free_problem(p);
      for (int64_t t : {17, 64, 146, 300, 512}) {
        p = moe("check moe_small down", &w, t, 8, false);
        small_row(p, false);
        free_problem(p);
      }
      p = moe("check moe_small down, 250 empty experts", &w, 146, 6, false, 250);
      small_row(p, false);
      free_problem(p);
    }
    {  // (group 32 on the gated side: the GATED wgmma reference has no 32-wide instance)
      Stack w(16, 512, 2048, 128, 1), wu(16, 512, 2048, 128, 1);
      Problem p = moe("check moe_small gate+up group 128", &w, 40, 4, true, 0, false, 64, &wu);
      small_row(p, false);
      free_problem(p);
    }
    {
      Stack w(16, 1024, 512, 32, 1);
      Problem p = moe("check moe_small down group 32", &w, 40, 4, false);
      small_row(p, false);
      free_problem(p);
    }
  }
  if (!(g_run[OLD] || g_run[NEW] || g_run[TMA])) {  // small alone: its rows only
    CK(cudaDeviceSynchronize());
    if (g_failures) std::printf("\ngemm_lab ( small): %d FAIL\n", g_failures);
    return g_failures ? 1 : 0;
  }
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
  {
    Stack w(256, 512, 2048, 64, 1);
    Problem p = moe("moe gate/up [256,512,2048], 128-row tiles", &w, T, 8, true, 0, false, 128);
    row(p, true);
    free_problem(p);
  }
  {
    Stack w(256, 2048, 512, 64, 1);
    Problem p = moe("moe down [256,2048,512], 128-row tiles", &w, T, 8, false, 0, false, 128);
    row(p, true);
    free_problem(p);
  }
  // the 8-bit router, shared-expert gate and both stacked (old = what the engine ran them on); copies as
  // the 4-bit rows (160 MB), at most 300 (the 2 KB gate would take 77,000: it is read from L2 then)
  for (const int64_t n : {257, 256, 1}) {
    Stack w(1, n, 2048, 64, int(std::clamp<int64_t>((160ll << 20) / (n * 2048 * 17 / 16), 2, 300)), 8);
    const char* names[3] = {"8-bit router+shared gate 257x2048", "8-bit router 256x2048", "8-bit shared gate 1x2048"};
    Problem p = dense(names[n == 257 ? 0 : n == 256 ? 1 : 2], &w, T);
    row(p, true);
    free_problem(p);
  }
  {  // the MoE up product as the engine's fallback runs it: y holds the gate product, SwiGLU epilogue.
     // Checked, not timed: a timed loop would rewrite y in place from its last value (running to inf,
     // where silu's division is slow); the gated rows below time the gate + SwiGLU-up pair instead.
    Stack w(256, 512, 2048, 64, 1);
    Problem p = moe("moe up [256,512,2048], 128-row tiles, SwiGLU", &w, T, 8, true, 0, true, 128);
    row(p, false);
    free_problem(p);
  }
  {  // the MoE gate and up products as the engine runs them: one gated product (vs the two above)
    Stack wg(256, 512, 2048, 64, 1), wu(256, 512, 2048, 64, 1);
    Problem p = moe("moe gate+up [256,512,2048], 128-row tiles, gated", &wg, T, 8, true, 0, false, 128, &wu);
    gated_row(p, true);
    free_problem(p);
  }
  {
    Stack wg(1, 512, 2048, 64, copies_for(512, 2048)), wu(1, 512, 2048, 64, copies_for(512, 2048));
    Problem p = dense("dense shared gate+up 512x2048, gated", &wg, T, false, &wu);
    gated_row(p, true);
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
  {  // 8-bit: groups 32 and 128, 128-row tiles, split-free small T, a partial column tile
    Stack w32(1, 300, 1024, 32, 1, 8), w128(1, 768, 1024, 128, 1, 8), w2k(1, 2048, 2048, 64, 1, 8);
    Problem p = dense("check 8-bit group 32, N=300", &w32, 200);
    row(p, false);
    free_problem(p);
    p = dense("check 8-bit group 128", &w128, 77);
    row(p, false);
    free_problem(p);
    p = dense("check 8-bit 128-row tiles, T=4000", &w2k, 4000);
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
  {
    Stack w(16, 512, 2048, 64, 1);
    Problem p = moe("check moe SwiGLU 128-row tiles, 6 empty experts", &w, 700, 4, true, 6, true, 128);
    row(p, false);
    free_problem(p);
  }
  {
    Stack w(16, 2048, 512, 64, 1);
    Problem p = moe("check moe down 128-row tiles", &w, 300, 4, false, 0, false, 128);
    row(p, false);
    free_problem(p);
  }
  // gated: 64- and 128-row tiles with empty experts, a partial column tile (N = 320: 2.5 tiles of 128),
  // N below one tile, dense rows at BM 64 (partial row tile) and BM 128, group 128
  {
    Stack wg(16, 512, 2048, 64, 1), wu(16, 512, 2048, 64, 1);
    Problem p = moe("check moe gated, 6 empty experts", &wg, 77, 4, true, 6, false, 64, &wu);
    gated_row(p, false);
    free_problem(p);
    p = moe("check moe gated 128-row tiles, 6 empty experts", &wg, 700, 4, true, 6, false, 128, &wu);
    gated_row(p, false);
    free_problem(p);
  }
  {
    Stack wg(8, 320, 1024, 64, 1), wu(8, 320, 1024, 64, 1);
    Problem p = moe("check moe gated N=320 (partial column tile)", &wg, 500, 4, true, 0, false, 128, &wu);
    gated_row(p, false);
    free_problem(p);
    p = moe("check moe gated N=320, 64-row tiles", &wg, 100, 4, true, 0, false, 64, &wu);
    gated_row(p, false);
    free_problem(p);
  }
  {
    Stack wg(1, 64, 512, 128, 1), wu(1, 64, 512, 128, 1);
    Problem p = dense("check dense gated N=64, group 128", &wg, 300, false, &wu);
    gated_row(p, false);
    free_problem(p);
  }
  {
    Stack wg(1, 512, 2048, 64, 1), wu(1, 512, 2048, 64, 1);
    Problem p = dense("check dense gated BM 64", &wg, 1000, false, &wu);
    gated_row(p, false);
    free_problem(p);
    p = dense("check dense gated BM 128", &wg, 128 * ((g_sms + 3) / 4) + 50, false, &wu);
    gated_row(p, false);
    free_problem(p);
  }
  CK(cudaDeviceSynchronize());
  if (g_failures) {
    std::printf("\ngemm_lab (%s%s%s%s): %d FAIL\n", g_run[OLD] ? " old" : "", g_run[NEW] ? " wgmma" : "",
                g_run[TMA] ? " tma" : "", g_small ? " small" : "", g_failures);
    return 1;
  }
  return 0;
}
