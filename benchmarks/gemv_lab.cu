// gemv_lab: why do lily's decode GEMVs run at 1.0-1.5 TB/s when the H200's HBM gives ~4.3 TB/s?
//
// Times the decode GEMV (kernels/linear_gemv.cuh, linear_gemv_kernel<BITS, 1>) and the MoE decode kernels
// (kernels/moe_decode.cuh) at the model's one-token shapes, next to lab variants that each remove or
// change one thing, and prints a markdown table (stdout, and $OUT/gemv_lab.md when OUT is set).
//   Run: bash benchmarks/gemv_lab.sh   (nvcc build into $TMPDIR or /tmp ~15 s, then a few seconds on an H200)
// Method: each (shape, variant) is one CUDA graph of N >= 100 back-to-back launches (whole rounds over the
// copies below; the engine also replays its decode step as a graph), replayed 7 times after a warm-up and
// timed with cudaEvents; us/call = median replay / N. Unlike a CUPTI kernel duration it includes the gap
// between kernels (the "empty" row measures it). Launch i reads copy i % copies of the
// weights, copies totalling >= 256 MB (L2 is 50 MB), so every launch streams its weights from HBM; MoE
// launch i reads expert set i % 32 (32 disjoint sets of K = 8 of the 256 experts, their own shared expert).
// MB = weight + scale + bias bytes one call reads (1 MB = 1e6 B); GB/s = MB / us * 1e3.
// err = max|y - y_v1| / max|y_v1| on copy 0 (cp.async sums in v1's order: expect exactly 0).
// Linear variants (all with v1's R = 4 rows per thread and tpr, BITS = 4 or 8, one token):
//   v1          library kernel, sized exactly as linear.cu's launch_gemv (tpr, passes, gemv_grid, smem)
//   v1 +pdl     the same launched as a programmatic dependent launch, as in the engine's decode graph
//   loads-only  v1's grid, units, loads and x staging; the math replaced by an xor of the loaded bits
//   no-stage    v1 without staging x per CTA (no x reads from L2, no barrier; shared x set to 1.0)
//   cp.async S  persistent candidate: <= 2 CTAs per SM, each thread streams its weight chunks through
//               a private S-stage shared-memory ring (cp.async 16 B; scale/bias words by 4-byte cp.async)
//   stream      pure uint4 streaming read of the same bytes (per-size bandwidth floor)
//   mma ks=N    the integer tensor-core GEMV (kernels/gemv_mma.cuh) at each K-split ("*": the launch plan's),
//               then an ablation of the planned one: "loads-only" (no fragments, mma or epilogue)
// Also: "empty" (launch gap), "1 GiB stream" (bandwidth ceiling), and v1 against a host fp64 reference.
// Short prompts (bench_tokens): "mma T=n", a product of n tokens as linear.cu's run_gemv_mma_tokens
// launches it (kernels/gemv_mma_tokens.cuh; one token: the one-token kernel), us per product; err there =
// rows differing bitwise from n one-token products ("0 of N" expected). The split-K wgmma GEMM that short
// prompts took before is not in the lab: 25.4 us a call at T = 11 (kernel_profile, /work/.device/4).
// "small T=n": the same product on the dense short-prompt kernel (kernels/dense_small.cuh) as linear.cu's
// run_dense_small launches it (ds_splits' K-parts as a cluster, PDL); err = max|y - y_mma| / max|y_mma| against
// the multi-token GEMV's product of the same copy (bf16 operands against exact digits: ~1e-3 expected).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/kernels/dense_small.cuh"
#include "cuda/kernels/gemv_mma_tokens.cuh"
#include "cuda/kernels/linear_gemv.cuh"
#include "cuda/kernels/moe_decode.cuh"
#include "cuda/kernels/moe_mma.cuh"
#include "cuda/gemv_plan.h"

static void check_cuda(cudaError_t e, const char* what, int line) {
  if (e == cudaSuccess) return;
  std::fprintf(stderr, "gemv_lab: %s failed: %s (gemv_lab.cu:%d)\n", what, cudaGetErrorString(e), line);
  std::exit(1);
}
#define CK(call) check_cuda((call), #call, __LINE__)

namespace lily::cuda::lab {

constexpr int R = GemvTiling<1>::R;

// ---- integer tensor-core GEMV ablation (kernels/gemv_mma.cuh, one token) ---------------------------------
// linear_gemv_mma_kernel's exact body (grid, units, register stages, x staging, pass reductions) with the
// segment step (A/B fragments, mma, epilogue, shared x reads) replaced by an xor of the loaded weight and
// scale words folded into the row sums (so nothing is dead code): the bar the full kernel is held to.
template <int BITS, int NG>
struct LabXorSegment {
  static __device__ __forceinline__ void run(const MmaLane<BITS, NG>&, const MmaStage& st, int i, int, const uint2*,
                                             const float*, const float*, float (&acc)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint4 w = st.w[i][r];
      const uint32_t v = w.x ^ w.y ^ w.z ^ w.w ^ st.s[i][r] ^ st.b[i][r];
      acc[r] += __uint_as_float(v & 0x007FFFFFu);  // a subnormal: finite, never NaN
    }
  }
};

template <int BITS, int NG>
__global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_CTAS) lab_mma_loads_kernel(const MmaLinearParams p) {
  using S = MmaSeg<BITS>;
  constexpr int VB = S::VALS / NG;
  extern __shared__ uint2 xd[];
  float* xe = reinterpret_cast<float*>(xd + p.cols / 8 * 3);
  float* xsum = xe + p.cols / VB;
  const int Sg = p.cols / S::VALS, tiles = (p.rows + 15) / 16;
  const MmaLinearRows<BITS> rows{p.w, p.scales, p.biases, p.y, p.rows, p.cols * BITS / 32,
                                 p.cols >> p.group_shift, p.group_shift, false};
  auto none = [] {};
  auto stage = [&] {
    pdl_wait();
    pdl_trigger();
    mma_stage_x<BITS, VB>([&](int o) { return p.x + 8 * o; }, p.cols, xd, xe, xsum);
    __syncthreads();
  };
  mma_gemv_body<BITS, NG, MmaLinearRows<BITS>, decltype(none), decltype(stage), LabXorSegment<BITS, NG>>(
      rows, tiles, Sg, MmaSplit(p.ks, Sg), xd, xe, xsum, none, stage);
}

          // rows per thread and unit (NT = 1)
constexpr size_t MAX_SMEM = 96 * 1024;       // linear.h's GEMV_MAX_SMEM
constexpr size_t ROTATE_BYTES = 256u << 20;  // weight bytes rotated through (L2 is 50 MB)
constexpr int SINK_WORDS = 1 << 20;

template <int N>
__device__ __forceinline__ uint32_t stage_bits(const GemvStage<N>& st) {
  uint32_t v = 0;
#pragma unroll
  for (int n = 0; n < N; ++n) v ^= st.w[n].x ^ st.w[n].y ^ st.w[n].z ^ st.w[n].w ^ (uint32_t(st.s[n]) << 16 | st.b[n]);
  return v;
}
__device__ __forceinline__ int flat_tid() { return (blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x; }

// ---- linear lab kernels ----------------------------------------------------------------------------------
// v1's slot epilogue: fixed-order slot sum of the R row sums, written by the slot's first thread.
__device__ __forceinline__ void gemv_finish(const GemvParams& p, float (&acc)[R][1], int row0, int tpr,
                                            float (*red)[R]) {
  float v[R];
#pragma unroll
  for (int r = 0; r < R; ++r) v[r] = acc[r][0], acc[r][0] = 0.f;
  if (!slot_sum(v, tpr, red)) return;
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (row0 + r < p.rows) p.y[row0 + r] = v[r];
}

// LOADS_ONLY / NO_STAGE: linear_gemv_kernel<BITS, 1> line for line (same thread mapping: slots of tpr
// threads, R rows per slot, units double-buffered in registers), except
//   LOADS_ONLY: compute is an xor of the loaded words and scale/bias bits, stored once per thread in sink;
//   NO_STAGE:   no x staging from global and no barrier: each thread writes 1.0 into the shared x chunks
//               (and their sums) that it will itself read, so the math and its shared loads are v1's but
//               the result is not (no error check).
enum Mode { LOADS_ONLY, NO_STAGE };
template <int BITS, int MODE>
__global__ void __launch_bounds__(GEMV_THREADS, GemvTiling<1>::MIN_CTAS)
    lab_gemv_kernel(const GemvParams p, uint32_t* sink) {
  using S = GemvShape<BITS>;
  extern __shared__ float4 xs[];
  __shared__ float red[2][GEMV_WARPS][R];
  const int C = p.cols / S::VALS, tpr = p.tpr;
  float* xsum = reinterpret_cast<float*>(xs + C * S::F);
  const int slot = threadIdx.x / tpr, q = threadIdx.x % tpr;
  const int rows_per_pass = (GEMV_THREADS / tpr) * R, nk = (C + tpr - 1) / tpr;
  const int units = (p.num_passes - int(blockIdx.x) + int(gridDim.x) - 1) / int(gridDim.x) * nk;
  const int wpr = p.cols * BITS / 32, gpr = p.cols / p.group_size;
  float acc[R][1] = {};
  uint32_t bits = 0;
  auto row0_of = [&](GemvUnit u) { return (int(blockIdx.x) + u.pass * int(gridDim.x)) * rows_per_pass + slot * R; };
  auto load = [&](GemvStage<R>& st, int j) {
    const GemvUnit u(j, nk);
    const int row0 = row0_of(u), c = q + u.step * tpr;
#pragma unroll
    for (int r = 0; r < R; ++r)
      gemv_load<BITS>(st, r, c < C && row0 + r < p.rows, p.w, p.scales, p.biases, row0 + r, c, wpr, gpr,
                      p.group_size);
  };
  auto compute = [&](const GemvStage<R>& st, int j) {
    if constexpr (MODE == LOADS_ONLY) {
      bits ^= stage_bits(st);
    } else {
      const GemvUnit u(j, nk);
      const int c = q + u.step * tpr;
      if (c < C) gemv_chunk<BITS, R, 1>(st, xs, xsum, C, c, acc);
      if (u.step == nk - 1) gemv_finish(p, acc, row0_of(u), tpr, red[u.pass & 1]);
    }
  };
  GemvStage<R> a, b;
  if (units > 0) load(a, 0);
  pdl_wait();
  pdl_trigger();
  if constexpr (MODE == NO_STAGE) {
    for (int c = q; c < C; c += tpr) {  // slots share chunks: equal values, a benign race
#pragma unroll
      for (int f = 0; f < S::F; ++f) xs[S::slot(c, f)] = make_float4(1.f, 1.f, 1.f, 1.f);
      xsum[c] = 4.f * S::F;
    }
  } else {
    gemv_stage_x<BITS>(p.x, p.cols, p.T, 1, C, xs, xsum);
    __syncthreads();
  }
  gemv_pipeline(units, a, b, load, compute);
  if constexpr (MODE == LOADS_ONLY) sink[flat_tid()] = bits;
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }
// 16-byte global -> shared copy bypassing L1 (src_size 0: writes zeros, reads nothing).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool ok) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_u32(dst)), "l"(src), "r"(ok ? 16 : 0)
               : "memory");
}
// 4-byte copy (.cg takes only 16 bytes, so .ca: the scale words are shared by 4 neighbouring threads).
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool ok) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_u32(dst)), "l"(src), "r"(ok ? 4 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// Ring bytes of the cp.async kernel: per stage and thread R weight chunks and 2R scale/bias words.
constexpr size_t ring_bytes(int stages) { return size_t(stages) * GEMV_THREADS * (R * 16 + 2 * R * 4); }

// cp.async S=ST candidate. Thread mapping and units as v1 (slots of tpr threads, R rows per slot, unit =
// (pass, chunk step), passes blockIdx.x + k*gridDim.x), but the grid is persistent (<= 2 CTAs per SM, many
// units each) and loads run ST-1 units ahead: unit j's R chunks go by 16-byte cp.async into the thread's
// own slots of ring stage j % ST, and the 4-byte aligned words holding its R scales and R biases (bf16
// pairs; the half is picked by the group index's parity) by 4-byte cp.async; one commit group per unit
// (empty past the end, so wait_group<ST-1> always means "unit j has landed"). A thread reads back only what
// it copied, so the ring needs no barrier; the stage refilled at step j was consumed at step j-1. Smem:
// ring_bytes(ST), then x and xsum staged once per CTA exactly as v1. Same sums in the same order as v1.
template <int BITS, int ST>
__global__ void __launch_bounds__(GEMV_THREADS, 2) lab_cpasync_kernel(const GemvParams p) {
  using S = GemvShape<BITS>;
  extern __shared__ uint4 ring[];  // [ST][R][threads] weight chunks
  uint32_t* sbw = reinterpret_cast<uint32_t*>(ring + ST * R * GEMV_THREADS);  // [ST][2R][threads] words
  float4* xs = reinterpret_cast<float4*>(sbw + ST * 2 * R * GEMV_THREADS);
  __shared__ float red[2][GEMV_WARPS][R];
  const int C = p.cols / S::VALS, tpr = p.tpr, tid = threadIdx.x;
  float* xsum = reinterpret_cast<float*>(xs + C * S::F);
  const int slot = tid / tpr, q = tid % tpr;
  const int rows_per_pass = (GEMV_THREADS / tpr) * R, nk = (C + tpr - 1) / tpr;
  const int units = (p.num_passes - int(blockIdx.x) + int(gridDim.x) - 1) / int(gridDim.x) * nk;
  const int wpr = p.cols * BITS / 32, gpr = p.cols / p.group_size;
  float acc[R][1] = {};
  auto row0_of = [&](GemvUnit u) { return (int(blockIdx.x) + u.pass * int(gridDim.x)) * rows_per_pass + slot * R; };
  auto group_of = [&](int64_t row, int c) { return row * gpr + c * S::VALS / p.group_size; };
  const uint32_t* sw = reinterpret_cast<const uint32_t*>(p.scales);
  const uint32_t* bw = reinterpret_cast<const uint32_t*>(p.biases);
  auto issue = [&](int j, int stage) {
    if (j < units) {
      const GemvUnit u(j, nk);
      const int row0 = row0_of(u), c = q + u.step * tpr;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const bool ok = c < C && row0 + r < p.rows;
        const int64_t row = ok ? row0 + r : 0, gi = group_of(row, ok ? c : 0);
        cp_async16(&ring[(stage * R + r) * GEMV_THREADS + tid], p.w + row * wpr + 4 * (ok ? c : 0), ok);
        cp_async4(&sbw[(stage * 2 * R + 2 * r) * GEMV_THREADS + tid], sw + gi / 2, ok);
        cp_async4(&sbw[(stage * 2 * R + 2 * r + 1) * GEMV_THREADS + tid], bw + gi / 2, ok);
      }
    }
    cp_async_commit();
  };
  auto compute = [&](int j, int stage) {
    const GemvUnit u(j, nk);
    const int row0 = row0_of(u), c = q + u.step * tpr;
    GemvStage<R> st;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int half = int(group_of(row0 + r, c) & 1) * 16;
      st.w[r] = ring[(stage * R + r) * GEMV_THREADS + tid];
      st.s[r] = uint16_t(sbw[(stage * 2 * R + 2 * r) * GEMV_THREADS + tid] >> half);
      st.b[r] = uint16_t(sbw[(stage * 2 * R + 2 * r + 1) * GEMV_THREADS + tid] >> half);
    }
    if (c < C) gemv_chunk<BITS, R, 1>(st, xs, xsum, C, c, acc);
    if (u.step == nk - 1) gemv_finish(p, acc, row0, tpr, red[u.pass & 1]);
  };
  for (int j = 0; j < ST - 1; ++j) issue(j, j);
  pdl_wait();
  pdl_trigger();
  gemv_stage_x<BITS>(p.x, p.cols, p.T, 1, C, xs, xsum);
  __syncthreads();
  for (int j = 0, rs = 0; j < units; ++j, rs = rs + 1 == ST ? 0 : rs + 1) {
    issue(j + ST - 1, rs == 0 ? ST - 1 : rs - 1);
    cp_async_wait<ST - 1>();
    compute(j, rs);
  }
}

// Bandwidth references: a grid-stride read of n 16-byte words (4 loads in flight per thread per step).
__global__ void stream_kernel(const uint4* p, size_t n, uint32_t* sink) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  uint32_t v = 0;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = ld_stream(p + i), b = ld_stream(p + i + stride), c = ld_stream(p + i + 2 * stride),
                d = ld_stream(p + i + 3 * stride);
    v ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
  }
  for (; i < n; i += stride) {
    const uint4 a = ld_stream(p + i);
    v ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  sink[flat_tid()] = v;
}
__global__ void empty_kernel() {}

__global__ void clock_kernel(uint64_t ns, double* mhz) {  // SM clock: clock64 ticks per globaltimer ns
  uint64_t t0, t1;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  const long long c0 = clock64();
  do asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  while (t1 - t0 < ns);
  *mhz = double(clock64() - c0) / double(t1 - t0) * 1e3;
}

// ---- MoE loads-only kernels: the library kernels' grid, units and loads (and staging); xor as compute --
// moe_up_kernel: unit j = (pass, step); the slot's MOE_UP_PAIRS (gate, up) row pairs of rho = s*I + i.
constexpr int UP_MIN_CTAS = MOE_UP_PAIRS == 1 ? 4 : 3;  // moe_up_kernel's launch bounds for these pair counts
template <int BITS>
__global__ void __launch_bounds__(GEMV_THREADS, UP_MIN_CTAS) lab_moe_up_loads(const MoeUpParams p, uint32_t* sink) {
  using S = GemvShape<BITS>;
  constexpr int P = MOE_UP_PAIRS;
  extern __shared__ float4 xs[];
  __shared__ int32_t ids[MOE_MAX_TOP_K];
  const int t = blockIdx.y, H = p.gate.cols, C = H / S::VALS, tpr = p.tpr;
  const int slot = threadIdx.x / tpr, q = threadIdx.x % tpr;
  const int rows_per_pass = (GEMV_THREADS / tpr) * P, nk = (C + tpr - 1) / tpr;
  const int units = (p.passes - int(blockIdx.x) + int(gridDim.x) - 1) / int(gridDim.x) * nk;
  const int I = p.gate.rows, KI = p.K * I, total = KI + p.shared_gate.rows, wpr = H * BITS / 32;
  uint32_t bits = 0;
  auto load = [&](GemvStage<2 * P>& st, int j) {
    const GemvUnit u(j, nk);
    const int rho = (int(blockIdx.x) + u.pass * int(gridDim.x)) * rows_per_pass + slot * P;
    const int s = rho < KI ? rho / I : p.K, i = rho < KI ? rho % I : rho - KI, c = q + u.step * tpr;
    const int64_t row = rho < KI ? int64_t(ids[s]) * I + i : i;
    const AffineStack g = s == p.K ? p.shared_gate : p.gate, up = s == p.K ? p.shared_up : p.up;
#pragma unroll
    for (int r = 0; r < P; ++r) {
      gemv_load<BITS>(st, 2 * r, rho < total && c < C, g.w, g.scales, g.biases, row + r, c, wpr,
                      H / g.group_size, g.group_size);
      gemv_load<BITS>(st, 2 * r + 1, rho < total && c < C, up.w, up.scales, up.biases, row + r, c, wpr,
                      H / up.group_size, up.group_size);
    }
  };
  auto compute = [&](const GemvStage<2 * P>& st, int) { bits ^= stage_bits(st); };
  for (int k = threadIdx.x; k < p.K; k += blockDim.x) ids[k] = p.topk_id[t * p.K + k];
  __syncthreads();
  GemvStage<2 * P> a, b;
  if (units > 0) load(a, 0);
  gemv_stage_x<BITS>(p.h + int64_t(t) * H, H, 1, 1, C, xs, reinterpret_cast<float*>(xs + C * S::F));
  __syncthreads();
  gemv_pipeline(units, a, b, load, compute);
  sink[flat_tid()] = bits;
}

// moe_down_kernel with MOE_DOWN_LOADS = NL: one virtual row (K routed rows, then the shared one) per slot
// of tpr threads, loaded in batches of NL chunks per thread; x staged after the first batch is issued.
template <int BITS, int NL>
__global__ void __launch_bounds__(GEMV_THREADS, 2) lab_moe_down_loads_batched(const MoeDownParams p, uint32_t* sink) {
  using S = GemvShape<BITS>;
  extern __shared__ float4 xs[];
  __shared__ int32_t ids[MOE_MAX_TOP_K];
  const int t = blockIdx.y, H = p.down.rows, tpr = p.tpr, slots = p.K + 1;
  const int Cr = p.down.cols / S::VALS, Cs = p.shared_down.cols / S::VALS, Cmax = max(Cr, Cs);
  const int KCr = p.K * Cr, Cv = KCr + Cs, slot = threadIdx.x / tpr, q = threadIdx.x % tpr;
  uint32_t bits = 0;
  bool staged = false;
  for (int k = threadIdx.x; k < p.K; k += blockDim.x) ids[k] = p.topk_id[t * p.K + k];
  __syncthreads();
  for (int pass = blockIdx.x; pass < p.passes; pass += gridDim.x) {
    const int o = pass * (GEMV_THREADS / tpr) + slot;
    for (int base = 0; base < Cv; base += NL * tpr) {
      GemvStage<NL> st;
#pragma unroll
      for (int n = 0; n < NL; ++n) {
        const int v = base + n * tpr + q, s = v < KCr ? v / Cr : p.K, c = v < KCr ? v - s * Cr : v - KCr;
        const bool ok = o < H && v < Cv, sh = s == p.K;
        const AffineStack d = sh ? p.shared_down : p.down;
        const int64_t row = sh ? o : int64_t(ok ? ids[s] : 0) * H + o;
        gemv_load<BITS>(st, n, ok, d.w, d.scales, d.biases, row, c, d.cols * BITS / 32, d.cols / d.group_size,
                        d.group_size);
      }
      if (!staged) {
        gemv_stage_x<BITS>(p.act + int64_t(t) * slots * p.ld, p.ld, slots, slots, Cmax, xs,
                           reinterpret_cast<float*>(xs + slots * Cmax * S::F));
        __syncthreads();
        staged = true;
      }
      bits ^= stage_bits(st);
    }
  }
  sink[flat_tid()] = bits;
}

// ---- host ------------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t mix(uint64_t v) {
  v ^= v >> 33, v *= 0xff51afd7ed558ccdull, v ^= v >> 33, v *= 0xc4ceb9fe1a85ec53ull, v ^= v >> 33;
  return uint32_t(v);
}
__global__ void fill_words(uint32_t* p, size_t n, uint32_t seed) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = mix(i * 0x9E3779B97F4A7C15ull + seed);
}
__global__ void fill_bf16(uint16_t* p, size_t n, float lo, float hi, uint32_t seed) {  // uniform, truncated
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = uint16_t(__float_as_uint(lo + (hi - lo) * float(mix(i * 0x9E3779B97F4A7C15ull + seed) >> 8) * 0x1p-24f) >>
                    16);
}

cudaStream_t g_stream;
int g_sms;
uint32_t* g_sink;
struct Row {
  std::string shape, variant;
  double us, mb;
  std::string err, launch;
};
std::vector<Row> g_rows;
void push_row(const Row& r) {  // progress on stderr, in case the run is cut short
  std::fprintf(stderr, "  %-24s %-16s %10.2f us  err %s\n", r.shape.c_str(), r.variant.c_str(), r.us, r.err.c_str());
  g_rows.push_back(r);
}

template <class T>
T* dalloc(size_t n) {
  T* p;
  CK(cudaMalloc(&p, n * sizeof(T)));
  return p;
}
size_t pad256(size_t b) { return (b + 255) / 256 * 256; }
int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
std::string fmt(const char* f, double v) {
  char s[64];
  std::snprintf(s, sizeof s, f, v);
  return s;
}

// A stack of n affine matrices [n][rows, cols] (MoE experts, or the rotated copies of one matrix), laid out
// as the engine's: all words [n, rows, cols*BITS/32], then all scales, then all biases [n, rows, cols/64].
struct Affine {
  int n, rows, cols, bits;
  size_t wb, sb;  // bytes of one entry's words and of its scales (= its biases)
  char* base;
  static size_t entry_bytes(int rows, int cols, int bits) {
    return size_t(rows) * cols * bits / 8 + 2 * size_t(rows) * (cols / 64) * 2;
  }
  Affine(int n_, int rows_, int cols_, int bits_, uint32_t seed) : n(n_), rows(rows_), cols(cols_), bits(bits_) {
    wb = size_t(rows) * cols * bits / 8, sb = size_t(rows) * (cols / 64) * 2;
    base = dalloc<char>(pad256(n * wb) + 2 * pad256(n * sb));
    fill_words<<<1024, 256, 0, g_stream>>>(reinterpret_cast<uint32_t*>(base), n * wb / 4, seed);
    fill_bf16<<<1024, 256, 0, g_stream>>>(const_cast<uint16_t*>(s(0)), n * sb / 2, 0.002f, 0.012f, seed + 1);
    fill_bf16<<<1024, 256, 0, g_stream>>>(const_cast<uint16_t*>(b(0)), n * sb / 2, -0.05f, 0.05f, seed + 2);
    CK(cudaGetLastError());
  }
  const uint32_t* w(int e) const { return reinterpret_cast<const uint32_t*>(base + e * wb); }
  const uint16_t* s(int e) const { return reinterpret_cast<const uint16_t*>(base + pad256(n * wb) + e * sb); }
  const uint16_t* b(int e) const {
    return reinterpret_cast<const uint16_t*>(base + pad256(n * wb) + pad256(n * sb) + e * sb);
  }
  AffineStack stack(int e) const { return AffineStack{w(e), s(e), b(e), rows, cols, 64}; }
  double mb() const { return double(wb + 2 * sb) / 1e6; }
};

// us per launch: one graph of n launches (launch(i) issues launch i on g_stream), median of 7 replays.
template <class F>
double time_us(F&& launch, int n) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(g_stream, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < n; ++i) launch(i);
  CK(cudaGetLastError());
  CK(cudaStreamEndCapture(g_stream, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  cudaEvent_t ev[2];
  for (cudaEvent_t& e : ev) CK(cudaEventCreate(&e));
  std::vector<float> ms(7);
  CK(cudaGraphLaunch(ge, g_stream));  // warm-up
  for (float& t : ms) {
    CK(cudaEventRecord(ev[0], g_stream));
    CK(cudaGraphLaunch(ge, g_stream));
    CK(cudaEventRecord(ev[1], g_stream));
    CK(cudaEventSynchronize(ev[1]));
    CK(cudaEventElapsedTime(&t, ev[0], ev[1]));
  }
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  for (cudaEvent_t e : ev) CK(cudaEventDestroy(e));
  std::sort(ms.begin(), ms.end());
  return ms[3] * 1e3 / n;
}

template <class F>
void add_row(const char* shape, const char* variant, F&& launch, int n, double mb, const std::string& err,
             const std::string& desc) {
  push_row({shape, variant, time_us(launch, n), mb, err, desc});
}

// A launch as the engine's decode graph makes it: programmatic dependent launch on g_stream.
template <class K, class... Args>
void launch_pdl(K* kernel, int grid, int threads, size_t smem, Args... args) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{dim3(grid), dim3(threads), smem, g_stream, &attr, 1};
  CK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

// linear.cu's gemv_tpr: the power of two covering a row's chunks, at most a CTA.
int gemv_tpr(int64_t chunks) {
  int tpr = 1;
  while (tpr < chunks && tpr < GEMV_THREADS) tpr *= 2;
  return tpr;
}
// linear.cu's gemv_grid: as many CTAs as are resident at once, spread evenly over the rounds.
int gemv_grid(const void* kernel, size_t smem, int64_t passes) {
  int per_sm = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, GEMV_THREADS, smem));
  const int64_t resident = int64_t(g_sms) * std::max(per_sm, 1), rounds = std::max<int64_t>(1, cdiv(passes, resident));
  return int(cdiv(passes, rounds));
}
int per_sm(const void* kernel, size_t smem) {
  int n = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, GEMV_THREADS, smem));
  return n;
}
template <class K>
void allow_smem(K* kernel, size_t bytes) {
  CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}
std::string launch_desc(int grid, size_t smem, int tpr, const void* kernel) {
  char s[128];
  std::snprintf(s, sizeof s, "grid %d, smem %zu, tpr %d, %d CTA/SM", grid, smem, tpr, per_sm(kernel, smem));
  return s;
}
std::vector<float> to_host(const float* d, size_t n) {
  std::vector<float> h(n);
  CK(cudaStreamSynchronize(g_stream));
  CK(cudaMemcpy(h.data(), d, n * 4, cudaMemcpyDeviceToHost));
  return h;
}
double rel_err(const std::vector<float>& a, const std::vector<double>& ref) {
  double d = 0, m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;  // e.g. an output the kernel never wrote (NaN fill)
    d = std::max(d, std::abs(a[i] - ref[i])), m = std::max(m, std::abs(ref[i]));
  }
  return d / m;
}
std::vector<double> as_double(const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); }

template <int BITS>
void bench_linear(const char* name, int rows, int cols) {
  using S = GemvShape<BITS>;
  std::fprintf(stderr, "gemv_lab: %s\n", name);
  const int copies = std::max<int>(2, cdiv(ROTATE_BYTES, Affine::entry_bytes(rows, cols, BITS)));
  const Affine W(copies, rows, cols, BITS, 12345);
  const int C = cols / S::VALS, n = copies * int(cdiv(100, copies));  // whole rounds: replays rotate on
  std::vector<float> hx(cols);
  std::mt19937 rng(3);
  for (float& v : hx) v = std::uniform_real_distribution<float>(-1.f, 1.f)(rng);
  float *x = dalloc<float>(cols), *yv = dalloc<float>(rows);
  CK(cudaMemcpy(x, hx.data(), cols * 4, cudaMemcpyHostToDevice));
  auto params = [&](int i, float* y) {
    GemvParams p{W.w(i % copies), W.s(i % copies), W.b(i % copies), x, y, 1, rows, cols, 64, gemv_tpr(C), 0};
    p.num_passes = int(cdiv(rows, (GEMV_THREADS / p.tpr) * R));
    return p;
  };
  const GemvParams p0 = params(0, yv);
  const size_t smem = size_t(cols) * 4 + size_t(C) * 4;  // linear.cu's gemv_smem_bytes(1, cols, BITS)
  const auto v1 = linear_gemv_kernel<BITS, 1>;
  allow_smem(v1, MAX_SMEM);
  const int grid = gemv_grid(reinterpret_cast<const void*>(v1), smem, p0.num_passes);
  std::vector<float> ref1, mma_y;
  // Times launch(i, y) over the copies; then (check) runs it on copy 0 and compares with v1.
  auto variant = [&](const char* label, auto launch, bool check, const std::string& desc) {
    const double us = time_us([&](int i) { launch(i, yv); }, n);
    std::string err = "n/a";
    if (check) {
      CK(cudaMemsetAsync(yv, 0xff, rows * 4, g_stream));
      launch(0, yv);
      const std::vector<float> y = to_host(yv, rows);
      if (ref1.empty()) ref1 = y;
      err = fmt("%.1e", rel_err(y, as_double(ref1)));
    }
    push_row({name, label, us, W.mb(), err, desc});
  };
  const std::string v1_desc = launch_desc(grid, smem, p0.tpr, reinterpret_cast<const void*>(v1));
  variant("v1", [&](int i, float* y) { v1<<<grid, GEMV_THREADS, smem, g_stream>>>(params(i, y)); }, true, v1_desc);
  variant("v1 +pdl", [&](int i, float* y) {
    launch_pdl(v1, grid, GEMV_THREADS, smem, params(i, y));
  }, true, v1_desc);
  // the integer tensor-core GEMV (kernels/gemv_mma.cuh) at every K-split, launched with PDL like the engine;
  // "*" marks the launcher's choice (mma_plan_for)
  {
    constexpr int NG = BITS == 4 ? 2 : 1;  // group 64
    const auto mk = linear_gemv_mma_kernel<BITS, NG>;
    const size_t ms = mma_x_bytes(cols, MmaSeg<BITS>::VALS / NG);
    allow_smem(mk, MAX_SMEM);
    int mper = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&mper, mk, MMA_THREADS, ms));
    const int64_t tiles = cdiv(rows, 16), segs = cols / MmaSeg<BITS>::VALS, resident = int64_t(g_sms) * mper;
    const MmaPlan chosen = mma_plan_for(tiles, segs, resident);
    for (int ks = 1; ks <= MMA_WARPS && ks <= segs; ks *= 2) {
      const MmaSplit sp(ks, int(segs));
      const int grid = int(std::min<int64_t>(cdiv(tiles, sp.rt), resident));  // mma_plan_for's CTA count
      const std::string label = "mma ks=" + std::to_string(ks) + (ks == chosen.ks ? " *" : "");
      char desc[128];
      std::snprintf(desc, sizeof desc, "grid %d, smem %zu, %d CTA/SM, %d units/pass", grid, ms, mper, sp.upp);
      variant(label.c_str(), [&](int i, float* y) {
        const MmaLinearParams mp{W.w(i % copies), W.s(i % copies), W.b(i % copies), x, y, rows, cols, 6, ks};
        launch_pdl(mk, grid, MMA_THREADS, ms, mp);
      }, true, desc);
      if (ks == chosen.ks) mma_y = to_host(yv, rows);
    }
    {  // the loads-only ablation at the chosen plan
      const auto kernel = lab_mma_loads_kernel<BITS, NG>;
      allow_smem(kernel, MAX_SMEM);
      const MmaSplit sp(chosen.ks, int(segs));
      const int grid = int(std::min<int64_t>(cdiv(tiles, sp.rt), resident));
      variant("mma * loads-only", [&](int i, float* y) {
        const MmaLinearParams mp{W.w(i % copies), W.s(i % copies), W.b(i % copies), x, y, rows, cols, 6, chosen.ks};
        launch_pdl(kernel, grid, MMA_THREADS, ms, mp);
      }, false, "the chosen plan");
    }
  }
  const auto lo = lab_gemv_kernel<BITS, LOADS_ONLY>, ns = lab_gemv_kernel<BITS, NO_STAGE>;
  allow_smem(lo, MAX_SMEM);
  variant("loads-only", [&](int i, float* y) { lo<<<grid, GEMV_THREADS, smem, g_stream>>>(params(i, y), g_sink); },
          false, launch_desc(grid, smem, p0.tpr, reinterpret_cast<const void*>(lo)));
  allow_smem(ns, MAX_SMEM);
  variant("no-stage", [&](int i, float* y) { ns<<<grid, GEMV_THREADS, smem, g_stream>>>(params(i, y), g_sink); },
          false, launch_desc(grid, smem, p0.tpr, reinterpret_cast<const void*>(ns)));
  auto cp_async = [&](auto kernel, int stages) {
    const size_t cs = ring_bytes(stages) + smem;
    allow_smem(kernel, cs);
    const int g = int(std::min<int64_t>(p0.num_passes, int64_t(g_sms) * std::min(2, per_sm((const void*)kernel, cs))));
    const std::string label = "cp.async S=" + std::to_string(stages);
    variant(label.c_str(), [&](int i, float* y) { kernel<<<g, GEMV_THREADS, cs, g_stream>>>(params(i, y)); }, true,
            launch_desc(g, cs, p0.tpr, (const void*)kernel));
  };
  cp_async(lab_cpasync_kernel<BITS, 3>, 3);
  cp_async(lab_cpasync_kernel<BITS, 4>, 4);
  const size_t n16 = (W.wb + 2 * W.sb) / 16;
  const int sg = int(std::min<int64_t>(g_sms * per_sm((const void*)stream_kernel, 0), cdiv(n16, GEMV_THREADS)));
  variant("stream", [&](int i, float*) {
    const uint4* region = reinterpret_cast<const uint4*>(W.base) + (i % copies) * n16;  // disjoint per copy
    stream_kernel<<<sg, GEMV_THREADS, 0, g_stream>>>(region, n16, g_sink);
  }, false, "grid " + std::to_string(sg) + ", copy-sized disjoint regions");
  if (int64_t(rows) * cols <= (1 << 24)) {  // v1 against fp64 on the host: y = sum_j (s*q + b) * x_j
    std::vector<uint32_t> hw(W.wb / 4);
    std::vector<uint16_t> hs(W.sb / 2), hb(W.sb / 2);
    CK(cudaStreamSynchronize(g_stream));
    CK(cudaMemcpy(hw.data(), W.w(0), W.wb, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hs.data(), W.s(0), W.sb, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hb.data(), W.b(0), W.sb, cudaMemcpyDeviceToHost));
    std::vector<double> ref(rows);
    const int wpr = cols * BITS / 32, gpr = cols / 64;
    for (int o = 0; o < rows; ++o)
      for (int j = 0; j < cols; ++j) {
        const uint32_t q = (hw[size_t(o) * wpr + j * BITS / 32] >> (j * BITS % 32)) & ((1u << BITS) - 1);
        const size_t g = size_t(o) * gpr + j / 64;
        ref[o] += (double(bf16_to_f32(hs[g])) * q + bf16_to_f32(hb[g])) * hx[j];
      }
    push_row({name, "v1 vs host fp64", -1, W.mb(), fmt("%.1e", rel_err(ref1, ref)), "reference"});
    push_row({name, "mma * vs host fp64", -1, W.mb(), fmt("%.1e", rel_err(mma_y, ref)), "reference"});
  }
  CK(cudaStreamSynchronize(g_stream));
  for (void* p : {(void*)W.base, (void*)x, (void*)yv})
    CK(cudaFree(p));
}

// Short prompts: products of T = 1, 2, 4, 8, 11, 16, 32 tokens on the multi-token integer GEMV, sized as
// linear.cu's run_gemv_mma_tokens (ks from the one-token kernel's plan, launches of at most
// mma_tokens_per_launch tokens balanced, a one-token launch on the one-token kernel), PDL launches.
// dense_small_kernel over T tokens of copy c, as linear.cu's launch_dense_small (4-bit, group 64).
void launch_dense_small(const Affine& W, int c, const float* x, float* y, int T) {
  LinearArgs a;
  a.w.w = W.w(c);
  a.w.scales = W.s(c);
  a.w.biases = W.b(c);
  a.w.rows = W.rows;
  a.w.cols = W.cols;
  a.w.bits = 4;
  a.w.group_size = 64;
  a.x = x;
  a.ldx = W.cols;
  a.y = y;
  a.ldy = W.rows;
  a.tiles.M = T;
  const int ks = ds_splits(W.rows, W.cols, 64, T, int64_t(g_sms) * DS_CTAS_PER_SM), nt = ds_tiles(T);
  if (ks <= 0) {
    std::fprintf(stderr, "gemv_lab: %d tokens of %dx%d do not fit the dense short-prompt kernel\n", T, W.rows, W.cols);
    std::exit(1);
  }
  void (*kernels[])(LinearArgs, bool) = {dense_small_kernel<1, true>, dense_small_kernel<2, true>,
                                         dense_small_kernel<3, true>, dense_small_kernel<4, true>};  // group 64
  static const bool configured = [&] {  // at the first (checking) launch, before any graph capture
    for (const auto k : kernels)
      CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(DS_MAX_SMEM)));
    return true;
  }();
  (void)configured;
  const auto kernel = kernels[nt - 1];
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  attr[1].id = cudaLaunchAttributeClusterDimension;
  attr[1].val.clusterDim.x = 1;
  attr[1].val.clusterDim.y = unsigned(ks);
  attr[1].val.clusterDim.z = 1;
  cudaLaunchConfig_t cfg{dim3(unsigned(cdiv(W.rows, DS_SLICE_ROWS)), unsigned(ks)), dim3(MS_THREADS),
                         ds_smem_bytes(W.cols / ks, nt), g_stream, attr, ks > 1 ? 2u : 1u};
  CK(cudaLaunchKernelEx(&cfg, kernel, a, false));
}

template <int BITS>
void bench_tokens(const char* name, int rows, int cols) {
  constexpr int NG = BITS == 4 ? 2 : 1, VB = MmaSeg<BITS>::VALS / NG;  // group 64 (Affine's)
  constexpr int TMAX = DS_MAX_TOKENS;
  std::fprintf(stderr, "gemv_lab: %s (tokens)\n", name);
  const int copies = std::max<int>(2, cdiv(ROTATE_BYTES, Affine::entry_bytes(rows, cols, BITS)));
  const Affine W(copies, rows, cols, BITS, 777);
  const int n = copies * int(cdiv(100, copies));
  std::vector<float> hx(size_t(TMAX) * cols);
  std::mt19937 rng(5);
  for (float& v : hx) v = std::uniform_real_distribution<float>(-1.f, 1.f)(rng);
  float *x = dalloc<float>(hx.size()), *yv = dalloc<float>(size_t(TMAX) * rows);
  CK(cudaMemcpy(x, hx.data(), hx.size() * 4, cudaMemcpyHostToDevice));
  const auto one = linear_gemv_mma_kernel<BITS, NG>;
  const auto tk = linear_gemv_mma_tokens_kernel<BITS, NG>;
  allow_smem(one, MAX_SMEM);
  allow_smem(tk, MMA_TOKENS_MAX_SMEM);
  const size_t ms1 = mma_x_bytes(cols, VB);
  const int64_t tiles = cdiv(rows, 16), segs = cols / MmaSeg<BITS>::VALS;
  const MmaPlan plan = mma_plan_for(tiles, segs, int64_t(g_sms) * per_sm((const void*)one, ms1));
  const int64_t passes = cdiv(tiles, MmaSplit(plan.ks, int(segs)).rt);
  const int cap = int(std::min<int64_t>(MMA_MAX_TOKENS, int64_t(MMA_TOKENS_MAX_SMEM / ms1)));
  std::string desc;
  // one product of T tokens of x into y, weights of copy c
  auto product = [&](int c, int T, float* y, bool record) {
    const int launches = int(cdiv(T, cap));
    for (int i = 0, t0 = 0; i < launches; ++i) {
      const int k = (T - t0) / (launches - i);
      const MmaLinearParams mp{W.w(c), W.s(c), W.b(c), x + size_t(t0) * cols, y + size_t(t0) * rows, rows, cols, 6,
                               plan.ks};
      if (k == 1) {
        launch_pdl(one, plan.grid, MMA_THREADS, ms1, mp);
        if (record) desc += "1 token: grid " + std::to_string(plan.grid) + "; ";
      } else {
        const size_t sm = mma_x_bytes(int64_t(k) * cols, VB);
        const int64_t resident = int64_t(g_sms) * std::max(1, per_sm((const void*)tk, sm));
        const int grid = int(cdiv(passes, cdiv(passes, resident)));
        launch_pdl(tk, grid, MMA_THREADS, sm, mp, k);
        if (record)
          desc += std::to_string(k) + " tokens: grid " + std::to_string(grid) + ", smem " + std::to_string(sm) + "; ";
      }
      t0 += k;
    }
  };
  for (int T : {1, 2, 4, 8, 11, 16, 32}) {
    desc = "ks " + std::to_string(plan.ks) + "; ";
    product(0, T, yv, true);
    const double us = time_us([&](int i) { product(i % copies, T, yv, false); }, n);
    // bitwise against T one-token products of copy 0
    CK(cudaMemsetAsync(yv, 0xff, size_t(T) * rows * 4, g_stream));
    product(0, T, yv, false);
    const std::vector<float> y = to_host(yv, size_t(T) * rows);
    int differ = 0;
    for (int t = 0; t < T; ++t) {
      const MmaLinearParams mp{W.w(0), W.s(0), W.b(0), x + size_t(t) * cols, yv, rows, cols, 6, plan.ks};
      launch_pdl(one, plan.grid, MMA_THREADS, ms1, mp);
      const std::vector<float> y1 = to_host(yv, rows);
      for (int o = 0; o < rows; ++o) differ += std::memcmp(&y1[o], &y[size_t(t) * rows + o], 4) != 0;
    }
    const std::string label = "mma T=" + std::to_string(T);
    push_row({name, label, us, W.mb(), std::to_string(differ) + " of " + std::to_string(T * rows), desc});
    if (BITS != 4 || T < 2 || rows % 32 != 0) continue;
    // the dense short-prompt kernel: y (copy 0) is the multi-token GEMV's product, its reference
    float* ys = dalloc<float>(size_t(T) * rows);
    launch_dense_small(W, 0, x, ys, T);
    const std::vector<float> got = to_host(ys, size_t(T) * rows);
    std::vector<double> ref(y.begin(), y.end());
    const double us_s = time_us([&](int i) { launch_dense_small(W, i % copies, x, ys, T); }, n);
    const int ks = ds_splits(rows, cols, 64, T, int64_t(g_sms) * DS_CTAS_PER_SM);
    push_row({name, "small T=" + std::to_string(T), us_s, W.mb(), fmt("%.1e", rel_err(got, ref)),
              "grid " + std::to_string(cdiv(rows, DS_SLICE_ROWS)) + " x " + std::to_string(ks) + " (cluster " +
                  std::to_string(ks) + "), smem " + std::to_string(ds_smem_bytes(cols / ks, ds_tiles(T)))});
    CK(cudaStreamSynchronize(g_stream));
    CK(cudaFree(ys));
  }
  CK(cudaStreamSynchronize(g_stream));
  for (void* p : {(void*)W.base, (void*)x, (void*)yv})
    CK(cudaFree(p));
}

// moe.cu's staged_bytes: x rows and one sum per 16-byte chunk.
size_t staged_bytes(int64_t rows, int64_t cols, int bits) {
  return size_t(rows) * (cols * 4 + cols / (128 / bits) * 4);
}

// One token through moe_up and moe_down, sized as moe.cu's launch_moe_decode with T = 1. Launch i uses
// expert set i % sets (K distinct ids of a fixed random permutation, ascending) and its own shared expert.
template <int BITS, int NL>
void bench_moe(int E, int K, int H, int I, int Is) {
  using S = GemvShape<BITS>;
  std::fprintf(stderr, "gemv_lab: moe E=%d K=%d H=%d I=%d Is=%d\n", E, K, H, I, Is);
  const int sets = E / K, ld = std::max(I, Is), n = sets * int(cdiv(100, sets));
  const Affine gate(E, I, H, BITS, 100), up(E, I, H, BITS, 200), down(E, H, I, BITS, 300);
  const Affine sgate(sets, Is, H, BITS, 400), sup(sets, Is, H, BITS, 500), sdown(sets, H, Is, BITS, 600);
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> uni(-1.f, 1.f);
  std::vector<int32_t> perm(E);
  for (int e = 0; e < E; ++e) perm[e] = e;
  std::shuffle(perm.begin(), perm.end(), rng);
  for (int k = 0; k < sets; ++k) std::sort(perm.begin() + k * K, perm.begin() + (k + 1) * K);
  std::vector<float> tw(sets * K), hh(H), ha((K + 1) * ld), sw{0.5f};
  for (float& v : tw) v = 0.15f + 0.1f * uni(rng);
  for (float& v : hh) v = uni(rng);
  for (float& v : ha) v = 0.1f * uni(rng);
  int32_t* ids = dalloc<int32_t>(sets * K);
  float *topk_w = dalloc<float>(sets * K), *shared_w = dalloc<float>(1), *h = dalloc<float>(H);
  float *act = dalloc<float>((K + 1) * ld), *act_in = dalloc<float>((K + 1) * ld), *out = dalloc<float>(H);
  CK(cudaMemcpy(ids, perm.data(), sets * K * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(topk_w, tw.data(), sets * K * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(shared_w, sw.data(), 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(h, hh.data(), H * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(act_in, ha.data(), ha.size() * 4, cudaMemcpyHostToDevice));

  // moe_up: tpr over H's chunks, passes over the K*I routed rows and the Is shared rows, h staged.
  const int up_tpr = gemv_tpr(H / S::VALS);
  const int up_passes = int(cdiv(int64_t(K) * I + Is, (GEMV_THREADS / up_tpr) * MOE_UP_PAIRS));
  auto upp = [&](int i) {
    const int k = i % sets;
    return MoeUpParams{gate.stack(0), up.stack(0), sgate.stack(k), sup.stack(k), h, ids + k * K, topk_w + k * K,
                       shared_w, act, K, ld, up_tpr, up_passes};
  };
  const size_t up_smem = staged_bytes(1, H, BITS);
  const auto up_v1 = moe_up_kernel<BITS>;
  const auto up_lo = lab_moe_up_loads<BITS>;
  allow_smem(up_v1, MAX_SMEM);
  allow_smem(up_lo, MAX_SMEM);
  const int up_ctas = gemv_grid((const void*)up_v1, up_smem, up_passes);
  const double up_mb = K * (gate.mb() + up.mb()) + sgate.mb() + sup.mb();
  add_row("moe_up", "v1", [&](int i) { up_v1<<<up_ctas, GEMV_THREADS, up_smem, g_stream>>>(upp(i)); }, n, up_mb,
          "-", launch_desc(up_ctas, up_smem, up_tpr, (const void*)up_v1));
  add_row("moe_up", "loads-only", [&](int i) { up_lo<<<up_ctas, GEMV_THREADS, up_smem, g_stream>>>(upp(i), g_sink); },
          n, up_mb, "n/a", launch_desc(up_ctas, up_smem, up_tpr, (const void*)up_lo));

  // moe_down: act [K+1, ld] staged.
  const int cmax = std::max(I, Is) / S::VALS;
  const size_t down_smem = staged_bytes(K + 1, int64_t(cmax) * S::VALS, BITS);
  const double down_mb = K * down.mb() + sdown.mb();
  auto run_down = [&](auto lo_kernel, int tpr, int passes) {
    auto dp = [&](int i) {
      const int k = i % sets;
      return MoeDownParams{down.stack(0), sdown.stack(k), ids + k * K, act_in, out, K, ld, tpr, passes};
    };
    const auto v1 = moe_down_kernel<BITS>;
    allow_smem(v1, MAX_SMEM);
    allow_smem(lo_kernel, MAX_SMEM);
    const int ctas = gemv_grid((const void*)v1, down_smem, passes);
    add_row("moe_down", "v1", [&](int i) { v1<<<ctas, GEMV_THREADS, down_smem, g_stream>>>(dp(i)); }, n, down_mb,
            "-", launch_desc(ctas, down_smem, tpr, (const void*)v1));
    add_row("moe_down", "loads-only",
            [&](int i) { lo_kernel<<<ctas, GEMV_THREADS, down_smem, g_stream>>>(dp(i), g_sink); }, n, down_mb, "n/a",
            launch_desc(ctas, down_smem, tpr, (const void*)lo_kernel));
  };
  // one virtual row of K*I + Is values per slot, one batch of NL loads per thread (moe.cu's sizing)
  const int down_tpr = gemv_tpr(cdiv((int64_t(K) * I + Is) / S::VALS, NL));
  run_down(lab_moe_down_loads_batched<BITS, NL>, down_tpr, int(cdiv(H, GEMV_THREADS / down_tpr)));
  // the integer tensor-core pair (kernels/moe_mma.cuh), sized like moe.cu's launch_moe_mma; errors against
  // v1's act and out for expert set 0
  {
    constexpr int NG = BITS == 4 ? 2 : 1, VB = MmaSeg<BITS>::VALS / NG;
    const auto mu = moe_up_mma_kernel<BITS, NG>;
    const auto md = moe_down_mma_kernel<BITS, NG>;
    allow_smem(mu, MAX_SMEM);
    allow_smem(md, MAX_SMEM);
    const size_t us = mma_x_bytes(H, VB), ds = mma_x_bytes(int64_t(K) * I + Is, VB);
    int pu = 0, pd = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&pu, mu, MMA_THREADS, us));
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&pd, md, MMA_THREADS, ds));
    const MmaPlan plan_u =
        mma_plan_for(cdiv(int64_t(K) * I + Is, 8), H / MmaSeg<BITS>::VALS, int64_t(g_sms) * pu, true);
    const MmaPlan plan_d =
        mma_plan_for(cdiv(H, 16), (int64_t(K) * I + Is) / MmaSeg<BITS>::VALS, int64_t(g_sms) * pd, true);
    float* act_mma = dalloc<float>((K + 1) * ld);
    float* out_mma = dalloc<float>(H);
    auto mp = [&](int i, float* a, float* o) {
      const int k = i % sets;
      return MoeMmaParams{gate.stack(0), up.stack(0), sgate.stack(k), sup.stack(k), down.stack(0), sdown.stack(k),
                          h, ids + k * K, topk_w + k * K, shared_w, a, o, K, ld, 6, plan_u.ks, plan_d.ks};
    };
    char desc[128];
    std::snprintf(desc, sizeof desc, "grid %d, ks %d, smem %zu, %d CTA/SM", plan_u.grid, plan_u.ks, us, pu);
    add_row("moe_up", "mma", [&](int i) { mu<<<plan_u.grid, MMA_THREADS, us, g_stream>>>(mp(i, act_mma, out_mma)); },
            n, up_mb, "-", desc);
    std::snprintf(desc, sizeof desc, "grid %d, ks %d, smem %zu, %d CTA/SM", plan_d.grid, plan_d.ks, ds, pd);
    add_row("moe_down", "mma", [&](int i) { md<<<plan_d.grid, MMA_THREADS, ds, g_stream>>>(mp(i, act_in, out_mma)); },
            n, down_mb, "-", desc);
    // every K-split of both, CTAs as mma_plan_for sizes them (all slots, or the passes when fewer)
    for (int ks = 1; ks <= MMA_WARPS; ks *= 2) {
      const int64_t su = H / MmaSeg<BITS>::VALS, sd = (int64_t(K) * I + Is) / MmaSeg<BITS>::VALS;
      const int64_t pu_passes = cdiv(cdiv(int64_t(K) * I + Is, 8), MmaSplit(ks, int(su)).rt);
      const int64_t pd_passes = cdiv(cdiv(H, 16), MmaSplit(ks, int(sd)).rt);
      const int gu = int(std::min<int64_t>(pu_passes, int64_t(g_sms) * pu));
      const int gd = int(std::min<int64_t>(pd_passes, int64_t(g_sms) * pd));
      auto mks = [&](int i, float* a, float* o) {
        MoeMmaParams q = mp(i, a, o);
        q.ks_up = q.ks_down = ks;
        return q;
      };
      const std::string lu = "mma ks=" + std::to_string(ks), ld2 = lu;
      std::snprintf(desc, sizeof desc, "grid %d, %d units/pass", gu, MmaSplit(ks, int(su)).upp);
      add_row("moe_up", lu.c_str(), [&](int i) { mu<<<gu, MMA_THREADS, us, g_stream>>>(mks(i, act_mma, out_mma)); },
              n, up_mb, "-", desc);
      std::snprintf(desc, sizeof desc, "grid %d, %d units/pass", gd, MmaSplit(ks, int(sd)).upp);
      add_row("moe_down", ld2.c_str(), [&](int i) { md<<<gd, MMA_THREADS, ds, g_stream>>>(mks(i, act_in, out_mma)); },
              n, down_mb, "-", desc);
    }
    // errors, expert set 0: v1 and mma on the same inputs
    const int up_ctas0 = up_ctas;
    CK(cudaMemsetAsync(act, 0xff, (K + 1) * ld * 4, g_stream));
    CK(cudaMemsetAsync(act_mma, 0xff, (K + 1) * ld * 4, g_stream));
    up_v1<<<up_ctas0, GEMV_THREADS, up_smem, g_stream>>>(upp(0));
    mu<<<plan_u.grid, MMA_THREADS, us, g_stream>>>(mp(0, act_mma, out_mma));
    CK(cudaGetLastError());
    std::vector<float> a1 = to_host(act, (K + 1) * ld), a2 = to_host(act_mma, (K + 1) * ld);
    std::vector<float> a1v, a2v;  // the written columns: I per routed slot, Is for the shared one
    for (int s2 = 0; s2 <= K; ++s2)
      for (int i2 = 0; i2 < (s2 < K ? I : Is); ++i2) a1v.push_back(a1[s2 * ld + i2]), a2v.push_back(a2[s2 * ld + i2]);
    push_row({"moe_up", "mma vs v1", -1, up_mb, fmt("%.1e", rel_err(a2v, as_double(a1v))), "act of set 0"});
    const int dtpr = gemv_tpr(cdiv((int64_t(K) * I + Is) / S::VALS, NL));
    const MoeDownParams dp0{down.stack(0), sdown.stack(0), ids, act_in, out, K, ld, dtpr,
                            int(cdiv(H, GEMV_THREADS / dtpr))};
    CK(cudaMemsetAsync(out, 0xff, H * 4, g_stream));
    CK(cudaMemsetAsync(out_mma, 0xff, H * 4, g_stream));
    moe_down_kernel<BITS><<<gemv_grid((const void*)moe_down_kernel<BITS>, down_smem, dp0.passes), GEMV_THREADS,
                            down_smem, g_stream>>>(dp0);
    md<<<plan_d.grid, MMA_THREADS, ds, g_stream>>>(mp(0, act_in, out_mma));
    CK(cudaGetLastError());
    push_row({"moe_down", "mma vs v1", -1, down_mb,
              fmt("%.1e", rel_err(to_host(out_mma, H), as_double(to_host(out, H)))), "out of set 0"});
    CK(cudaFree(act_mma));
    CK(cudaFree(out_mma));
  }
  CK(cudaStreamSynchronize(g_stream));
  for (void* p : {(void*)gate.base, (void*)up.base, (void*)down.base, (void*)sgate.base, (void*)sup.base,
                  (void*)sdown.base, (void*)ids, (void*)topk_w, (void*)shared_w, (void*)h, (void*)act, (void*)act_in,
                  (void*)out})
    CK(cudaFree(p));
}

int run() {
  int ndev = 0;
  const cudaError_t e = cudaGetDeviceCount(&ndev);
  if (e != cudaSuccess || ndev == 0) {
    std::fprintf(stderr, "gemv_lab: no CUDA device (%s); it needs an sm_90 GPU (H200), nothing was measured\n",
                 e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    return 2;
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  if (prop.major != 9) {
    std::fprintf(stderr, "gemv_lab: built for sm_90a, but device 0 (%s) is sm_%d%d\n", prop.name, prop.major,
                 prop.minor);
    return 2;
  }
  g_sms = prop.multiProcessorCount;
  CK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
  g_sink = dalloc<uint32_t>(SINK_WORDS);
  int clock_khz = 0, mem_khz = 0, bus_bits = 0;
  CK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  CK(cudaDeviceGetAttribute(&mem_khz, cudaDevAttrMemoryClockRate, 0));
  CK(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, 0));

  add_row("-", "empty kernel", [](int) { empty_kernel<<<g_sms, GEMV_THREADS, 0, g_stream>>>(); }, 200, 0, "n/a",
          "grid " + std::to_string(g_sms) + " (launch gap in a graph)");
  const size_t gb16 = (size_t(1) << 30) / 16;
  uint4* big = dalloc<uint4>(gb16);
  CK(cudaMemsetAsync(big, 0, gb16 * 16, g_stream));
  const int sg = g_sms * per_sm((const void*)stream_kernel, 0);
  add_row("1 GiB", "stream", [&](int) { stream_kernel<<<sg, GEMV_THREADS, 0, g_stream>>>(big, gb16, g_sink); }, 20,
          gb16 * 16 / 1e6, "n/a", "grid " + std::to_string(sg));
  double* mhz = dalloc<double>(1);
  double sm_mhz = 0;
  clock_kernel<<<1, 1, 0, g_stream>>>(20'000'000, mhz);  // right after the 1 GiB stream: clocks are up
  CK(cudaStreamSynchronize(g_stream));  // g_stream does not synchronise with the legacy stream's copies
  CK(cudaMemcpy(&sm_mhz, mhz, 8, cudaMemcpyDeviceToHost));
  CK(cudaFree(mhz));
  CK(cudaFree(big));

  bench_linear<4>("in_proj 12352x2048", 12352, 2048);
  bench_linear<4>("qkv 9216x2048", 9216, 2048);
  bench_linear<4>("out_proj 2048x4096", 2048, 4096);
  bench_linear<4>("o_proj 2048x4096", 2048, 4096);
  bench_linear<8>("router 257x2048 (8-bit)", 257, 2048);
  bench_linear<4>("lm_head 248320x2048", 248320, 2048);
  bench_moe<4, MOE_DOWN_LOADS>(256, 8, 2048, 512, 512);
  // short prompts: the dense products a prefill of T <= 16 tokens runs per layer (docs/model.md; the
  // stacked in_proj / qkv are decode's, for comparison)
  bench_tokens<4>("in_proj_qkv 8192x2048", 8192, 2048);
  bench_tokens<4>("in_proj_z 4096x2048", 4096, 2048);
  bench_tokens<4>("in_proj_b 32x2048", 32, 2048);
  bench_tokens<4>("out_proj 2048x4096", 2048, 4096);
  bench_tokens<4>("k_proj 512x2048", 512, 2048);
  bench_tokens<4>("shared down 2048x512", 2048, 512);
  bench_tokens<4>("in_proj 12352x2048", 12352, 2048);

  std::string md;
  char line[512];
  std::snprintf(line, sizeof line,
                "# gemv_lab: %s, %d SMs, L2 %d MB, SM clock %.0f MHz measured (%d MHz max), memory %d MHz x %d bit\n\n",
                prop.name, g_sms, prop.l2CacheSize >> 20, sm_mhz, clock_khz / 1000, mem_khz / 1000, bus_bits);
  md += line;
  md += "| shape | variant | us/call | MB | GB/s | max rel err vs v1 | launch |\n|---|---|---:|---:|---:|---|---|\n";
  for (const Row& r : g_rows) {
    const std::string us = r.us < 0 ? "-" : fmt("%.2f", r.us);
    const std::string gbs = r.us <= 0 || r.mb <= 0 ? "-" : fmt("%.0f", r.mb / r.us * 1e3);
    std::snprintf(line, sizeof line, "| %s | %s | %s | %.2f | %s | %s | %s |\n", r.shape.c_str(), r.variant.c_str(),
                  us.c_str(), r.mb, gbs.c_str(), r.err.c_str(), r.launch.c_str());
    md += line;
  }
  std::fputs(md.c_str(), stdout);
  if (const char* dir = std::getenv("OUT")) {
    const std::string path = std::string(dir) + "/gemv_lab.md";
    if (FILE* f = std::fopen(path.c_str(), "w")) {
      std::fputs(md.c_str(), f);
      std::fclose(f);
    }
  }
  return 0;
}

}  // namespace lily::cuda::lab

int main() { return lily::cuda::lab::run(); }
