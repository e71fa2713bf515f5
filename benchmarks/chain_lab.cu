// chain_lab: can a decode GEMV stream its weights while the kernel before it still runs?
//
// The decode step is a chain of dependent kernels; each integer-MMA GEMV (kernels/gemv_mma.cuh) keeps
// two units of weights in flight per warp, so a small product (in_proj 14.2 MB, out_proj 4.7 MB) pays
// ~2-3 memory round trips after its PDL wait and streams at 1-1.5 TB/s (docs/perf-notes.md, seventh
// session). The candidate here ("bulk"): one CTA per SM, each CTA's whole share of the weight rows
// (all its 16-row tiles, full K) bulk-copied into shared memory (cp.async.bulk, one mbarrier per tile)
// BEFORE the PDL wait, with the PDL trigger issued before the wait too ("early"), so the next kernel's
// CTA becomes resident beside this one (<= 128 registers a thread, shared memory of both fits) and
// requests its own weights while this one computes. The math is gemv_mma's segment step (the same
// fragments, mma and epilogue), reading its A words from shared memory instead of registers loaded from
// global memory.
//
// Method: a chain of LAYERS pairs (in_proj-like A: 12352 x 2048, out_proj-like B: 2048 x 4096, 4-bit,
// group 64), every layer its own weights (LAYERS x 19 MB > the 50 MB L2), launched back to back with PDL
// into one CUDA graph (ROUNDS passes over the layers), replayed 7 times; us per layer = median replay /
// (LAYERS x ROUNDS). Every kernel waits for the one before (griddepcontrol.wait) as in the decode graph;
// inputs are fixed vectors so values stay finite. err = max|y - y_today| / max|y_today| of one layer.
//   Variants: today (linear_gemv_mma_kernel at mma_plan_for's plan), bulk late (copies issued before the
//   wait, trigger after it), bulk early (trigger before the wait as well), mixed, and bulk with the copies
//   after the wait (moe_up's case: its rows are known only after the router).
//   Persistent (one kernel for the chain, below): with and without the dependency waits, 8 warps a tile or a
//   warp a tile, and the consumer math (chain_lab_math.cuh): today's integer digits, (a) the digits with 2 / 4
//   segments a step, (b) x as three bf16 terms on m16n8k16; part 3 (chain_lab_phase.cuh): (1) the phase
//   counted by one release after the CTA barrier (no per-thread fence), (2) x staged by the producing phase
//   (the consumers copy bytes; the producers stage their y, shared 64-row blocks by their last contributor),
//   (3) "flat": a CTA's segments split evenly over its 8 warps (A: 12 a warp instead of a warp's 16-segment
//   tile with two warps idle); (2b) the consumers' x loads all issued before converting. Then a table of
//   errors (the last layer against today's kernel and against fp64; (2): the producers' staged y against
//   staging y, byte for byte), and the timeline rows: per phase kind, medians and 90th percentiles
//   over CTAs of hand-over, x staging, math, store + fence and count (%globaltimer stamps; separate
//   instances, the timed rows have none).
//   Run: bash benchmarks/chain_lab.sh (CPU check of the math policies: tests/test_chain_lab_emu.py)
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda/gemv_plan.h"
#include "cuda/kernels/gemv_mma.cuh"
#include "cuda/kernels/wgmma.cuh"
#include "chain_lab_math.cuh"
#include "chain_lab_phase.cuh"
#include "chain_lab_timeline.h"

static void check_cuda(cudaError_t e, const char* what, int line) {
  if (e == cudaSuccess) return;
  std::fprintf(stderr, "chain_lab: %s failed: %s (chain_lab.cu:%d)\n", what, cudaGetErrorString(e), line);
  std::exit(1);
}
#define CK(call) check_cuda((call), #call, __LINE__)

namespace lily::cuda::lab {

constexpr int BULK_MAX_TILES = 8;  // tiles of one CTA (in_proj: 772 tiles / 132 CTAs -> 6)

__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

struct BulkParams {
  const uint32_t* w;  // [rows, cols * BITS / 32]
  const uint16_t* s;  // [rows, cols / 64] BF16
  const uint16_t* b;
  const float* x;  // [cols]
  float* y;        // [rows]
  int rows, cols;  // rows % 16 == 0
  int tmax, ks;    // tiles per CTA at most; K-parts per tile
};

// Shared memory: W tiles [tmax][16 rows][cols*BITS/8 bytes] (dense rows, one copy a tile), scales and
// biases [tmax][16][cols/64] BF16, then x's digits, e_u, xsum (mma_x_bytes).
template <int BITS>
size_t bulk_smem(int cols, int tmax) {
  constexpr int NG = BITS == 4 ? 2 : 1;
  return size_t(tmax) * 16 * (size_t(cols) * BITS / 8 + 2 * (cols / 64) * 2) +
         mma_x_bytes(cols, MmaSeg<BITS>::VALS / NG);
}

// CTA c: tiles [tiles c / G, tiles (c+1) / G); warp items (tile j, K-part k) round robin; a tile's parts
// summed in ascending k after a barrier (as mma_gemv_body sums a tile's K-split warps).
// MODE: BULK_LATE copies before the wait, trigger after it; BULK_EARLY copies and trigger before the wait;
// BULK_AFTER copies after the wait (what moe_up could do: its rows depend on the router's choice).
// Ablations of BULK_LATE: BULK_NO_MATH (the tiles awaited, no segment step: y = 0), BULK_NO_STAGE (x not
// staged: the digits are whatever shared memory holds; timing only).
enum BulkMode { BULK_LATE, BULK_EARLY, BULK_AFTER, BULK_NO_MATH, BULK_NO_STAGE };
template <int BITS, int MODE>
__global__ void __launch_bounds__(MMA_THREADS, 2) bulk_gemv_kernel(const BulkParams p) {
  using S = MmaSeg<BITS>;
  constexpr int NG = BITS == 4 ? 2 : 1, VB = S::VALS / NG;
  extern __shared__ __align__(128) uint8_t sm[];
  __shared__ __align__(8) uint64_t bars[BULK_MAX_TILES];
  __shared__ float red[BULK_MAX_TILES][MMA_WARPS][16];
  const int tiles = p.rows / 16, G = int(gridDim.x), c = int(blockIdx.x);
  const int t0 = int(int64_t(tiles) * c / G), nt = int(int64_t(tiles) * (c + 1) / G) - t0;
  const int wrow = p.cols * BITS / 8, grow = p.cols / 64 * 2;  // bytes per row
  const int wtile = 16 * wrow, stile = 16 * grow;
  uint8_t* wsm = sm;
  uint8_t* ssm = wsm + size_t(p.tmax) * wtile;
  uint8_t* bsm = ssm + size_t(p.tmax) * stile;
  uint2* xd = reinterpret_cast<uint2*>(bsm + size_t(p.tmax) * stile);
  float* xe = reinterpret_cast<float*>(xd + p.cols / 8 * 3);
  float* xsum = xe + p.cols / VB;
  const int tid = int(threadIdx.x);
  if (tid == 0) {
    for (int j = 0; j < nt; ++j) mbar_init(smem_u32(&bars[j]), 1);
    mbar_init_fence();
  }
  __syncthreads();
  auto copies = [&] {
  if (tid < nt) {  // one thread a tile: its W rows, scales and biases (each contiguous in global memory)
    const int j = tid;
    const int64_t row0 = int64_t(t0 + j) * 16;
    const uint32_t bar = smem_u32(&bars[j]);
    mbar_arrive_expect_tx(bar, uint32_t(wtile + 2 * stile));
    bulk_copy(smem_u32(wsm + size_t(j) * wtile), reinterpret_cast<const uint8_t*>(p.w) + row0 * wrow, wtile, bar);
    bulk_copy(smem_u32(ssm + size_t(j) * stile), reinterpret_cast<const uint8_t*>(p.s) + row0 * grow, stile, bar);
    bulk_copy(smem_u32(bsm + size_t(j) * stile), reinterpret_cast<const uint8_t*>(p.b) + row0 * grow, stile, bar);
  }
  };
  if constexpr (MODE != BULK_AFTER) copies();
  if constexpr (MODE == BULK_EARLY) pdl_trigger();
  pdl_wait();
  if constexpr (MODE != BULK_EARLY) pdl_trigger();
  if constexpr (MODE == BULK_AFTER) copies();
  if constexpr (MODE != BULK_NO_STAGE) mma_stage_x<BITS, VB>([&](int o) { return p.x + 8 * o; }, p.cols, xd, xe, xsum);
  __syncthreads();
  const int warp = tid >> 5, lane = tid & 31;
  const MmaLane<BITS, NG> L(lane);
  const int Sg = p.cols / S::VALS, spk = (Sg + p.ks - 1) / p.ks;
  for (int it = warp; it < nt * p.ks; it += MMA_WARPS) {
    const int j = it / p.ks, k = it % p.ks;
    mbar_wait(smem_u32(&bars[j]), 0);
    const uint8_t* w0 = wsm + size_t(j) * wtile + L.g * wrow + L.t * 16;
    const uint8_t* w1 = w0 + 8 * wrow;
    const uint8_t* s0 = ssm + size_t(j) * stile + L.g * grow;
    const uint8_t* b0 = bsm + size_t(j) * stile + L.g * grow;
    float acc[2] = {0.f, 0.f};
    const int seg_end = MODE == BULK_NO_MATH ? 0 : min(Sg, (k + 1) * spk);
    for (int seg = k * spk; seg < seg_end; ++seg) {
      MmaStage st;
      st.w[0][0] = *reinterpret_cast<const uint4*>(w0 + seg * 64);
      st.w[0][1] = *reinterpret_cast<const uint4*>(w1 + seg * 64);
      if constexpr (NG == 2) {  // both halves' groups in one word
        st.s[0][0] = *reinterpret_cast<const uint32_t*>(s0 + seg * 4);
        st.s[0][1] = *reinterpret_cast<const uint32_t*>(s0 + 8 * grow + seg * 4);
        st.b[0][0] = *reinterpret_cast<const uint32_t*>(b0 + seg * 4);
        st.b[0][1] = *reinterpret_cast<const uint32_t*>(b0 + 8 * grow + seg * 4);
      } else {
        st.s[0][0] = *reinterpret_cast<const uint16_t*>(s0 + seg * 2);
        st.s[0][1] = *reinterpret_cast<const uint16_t*>(s0 + 8 * grow + seg * 2);
        st.b[0][0] = *reinterpret_cast<const uint16_t*>(b0 + seg * 2);
        st.b[0][1] = *reinterpret_cast<const uint16_t*>(b0 + 8 * grow + seg * 2);
      }
      mma_segment<BITS, NG>(L, st, 0, seg, xd, xe, xsum, acc);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], 1);
      acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], 2);
    }
    if (L.t == 0) red[j][k][L.g] = acc[0], red[j][k][L.g + 8] = acc[1];
  }
  __syncthreads();
  for (int i = tid; i < nt * 16; i += MMA_THREADS) {
    const int j = i / 16, r = i % 16;
    float v = 0.f;
    for (int k = 0; k < p.ks; ++k) v += red[j][k][r];
    p.y[int64_t(t0 + j) * 16 + r] = v;
  }
}


// ---- persistent: one kernel for the whole chain, a producer warp streaming weights ahead ------------------
// grid = one CTA per SM (all resident: ~200 KB of shared memory each), 8 consumer warps + 1 producer warp.
// Items: (16-row tile, 2,048-value K-chunk), 16 KB of 4-bit weights + 1 KB scales + 1 KB biases, each
// contiguous: the weights are stored chunk-major, [tile][chunk][16 rows][1 KB] (for K = 2,048 that is the
// row-major layout; B's K = 4,096 products use it as their layout in this lab, so B is not compared with
// `today`). The producer walks the CTA's items (its tiles of phase p, phases in order) and bulk-copies each
// into the next free slot of a PS_SLOTS ring (full: tx bytes; empty: one arrival per consumer warp, or per
// segment when dealt flat), never waiting for activations: later phases' weights stream while the
// consumers wait for the phase before.
// Consumers, per phase: wait until every CTA has counted phase p - 1 done (thread 0 polls an acquire
// load; PS_NO_DEP skips it: the stream's own ceiling), stage x (the math policy's form), then per tile its
// chunks (warp w takes segments 2w, 2w + 1 of each chunk; a warp frees a slot as soon as it has read it),
// the 8 warps' row sums in ascending order, y; at the end of the phase, fence and count the phase done.
constexpr int PS_SLOTS = 10, PS_SLOT_BYTES = 18 * 1024, PS_THREADS = PS_CONSUMERS + 32;  // chain_lab_math.cuh: items

// How a phase's segments go to the consumer warps: PS_8W 8 warps a tile (2 segments of each chunk a warp, a
// barrier a tile), PS_WT a warp a tile (one-chunk phases; no barrier), PS_FLAT the CTA's segments split
// evenly (chain_lab_phase.cuh; one barrier a phase). Flags (part 3, chain_lab_phase.cuh): PS_REL counts the
// phase with one release by thread 0 after the barrier (no fences); PS_XST x is staged by the producing
// phase (the consumers copy it; the producers stage their y); PS_XB the consumers stage x with all their loads
// issued first (ps_stage_x_batched).
enum PsDeal { PS_8W, PS_WT, PS_FLAT };
enum PsFlag { PS_REL = 1, PS_XST = 2, PS_XB = 4 };
constexpr int PS_MAX_TILES = 8;  // tiles of a CTA a phase (PS_FLAT, PS_XST: A has 6 at 132 CTAs)

struct PsPhase {
  const uint32_t* w;
  const uint16_t *s, *b;
  const float* x;
  float* y;
  int rows, cols;      // cols % 2048 == 0
  const uint8_t* xst;  // PS_XST: x as staged (PsDigits' layout, K = cols), copied by the consumers
  uint8_t* yst;        // PS_XST: y as staged by the producers (K = rows)
  unsigned* blk;       // PS_XST: [rows / 64] block counters, zeroed before the launch
};
struct PsParams {
  const PsPhase* ph;
  int phases;
  unsigned* done;          // [phases], zeroed before the launch
  PsStamp* tl;       // TL only: [phases][grid][PS_TL_STAMPS]
};

__device__ __forceinline__ unsigned ps_ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void mbar_arrive_n(uint32_t bar, uint32_t n) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(n) : "memory");
}
__device__ __forceinline__ void ps_consumer_sync() { asm volatile("bar.sync 1, 256;" ::: "memory"); }
__device__ __forceinline__ PsStamp ps_now() {
  PsStamp s;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(s.clk)::"memory");
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(s.gt)::"memory");
  return s;
}

// NO_MATH: consumers only await and free the slots (the ring's own stream rate). SLOTS: ring slots (10 at
// one CTA a SM, 5 at two). DEAL: PsDeal. M: the consumer math (PsDigits<1>: today's). F: PsFlag bits.
// TL (timeline; with the dependency waits): thread 0 stamps (ps_now) per phase into p.tl: [0] its poll
// done (dependency satisfied), [1] x staged (after the barrier), [2] the CTA's last math done (the latest of
// the warps' stamps after their last tile's math), [3] y stored and fenced (after the barrier that follows
// the fences; PS_XST: and the producer's staging of its y by warp 0), [4] the phase counted (after the
// atomic returned; PS_REL: the release atom's return). The untimed instances have no stamps.
template <bool NO_DEP, bool NO_MATH = false, int SLOTS = PS_SLOTS, int DEAL = PS_8W, class M = PsDigits<1>,
          bool TL = false, int F = 0>
__global__ void __launch_bounds__(PS_THREADS, 1) persist_chain_kernel(const PsParams p) {
  static_assert(!TL || !NO_DEP, "the timeline stamps the dependency hand-overs");
  constexpr bool REL = F & PS_REL, XST = F & PS_XST, XB = F & PS_XB, FLAT = DEAL == PS_FLAT;
  static_assert(!(XST || XB) || std::is_same_v<M, PsDigits<M::STEP>>, "PS_XST, PS_XB: the digits' layout");
  static_assert(!(XST && XB), "x copied or staged, not both");
  constexpr int SPW = PS_CSEG / MMA_WARPS;                 // segments a warp takes of a chunk (8 warps a tile)
  constexpr int NS = M::STEP < SPW ? M::STEP : SPW;        // ... in steps of NS
  constexpr int WT_UNROLL = M::STEP == 1 ? 4 : 1;          // warp-a-tile loop: today's unroll
  extern __shared__ __align__(128) uint8_t sm[];
  __shared__ __align__(8) uint64_t full[SLOTS], empty[SLOTS];
  __shared__ float red[2][MMA_WARPS][16];  // by tile parity: one barrier a tile
  __shared__ float redf[FLAT ? MMA_WARPS : 1][2][16];          // PS_FLAT: [warp][its first / next tile][row]
  __shared__ __align__(16) float yown[XST ? PS_MAX_TILES * 16 : 4];  // PS_XST: the CTA's y rows
  __shared__ PsStamp math_done[TL ? MMA_WARPS : 1];
  uint8_t* ring = sm;
  uint8_t* xs = sm + SLOTS * PS_SLOT_BYTES;
  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31, G = int(gridDim.x), c = int(blockIdx.x);
  if (tid == 0) {
    for (int i = 0; i < SLOTS; ++i)
      mbar_init(smem_u32(&full[i]), 1), mbar_init(smem_u32(&empty[i]), FLAT ? PS_CSEG : MMA_WARPS);
    mbar_init_fence();
  }
  __syncthreads();
  auto my_tiles = [&](const PsPhase& ph, int& t0) {
    const int tiles = ph.rows / 16;
    t0 = int(int64_t(tiles) * c / G);
    return int(int64_t(tiles) * (c + 1) / G) - t0;
  };
  if (warp == MMA_WARPS) {  // producer
    if (lane != 0) return;
    int it = 0;
    for (int ph_i = 0; ph_i < p.phases; ++ph_i) {
      const PsPhase ph = p.ph[ph_i];
      int t0;
      const int nt = my_tiles(ph, t0), chunks = ph.cols / PS_CHUNK_VALS;
      for (int i = 0; i < nt * chunks; ++i, ++it) {
        const int slot = it % SLOTS, round = it / SLOTS;
        if (round > 0) mbar_wait(smem_u32(&empty[slot]), (round - 1) & 1);
        const uint32_t bar = smem_u32(&full[slot]), dst = smem_u32(ring + slot * PS_SLOT_BYTES);
        const int64_t item = int64_t(t0) * chunks + i;  // chunk-major: items of a tile are consecutive
        mbar_arrive_expect_tx(bar, uint32_t(PS_ITEM_W + 2 * PS_ITEM_S));
        bulk_copy(dst, reinterpret_cast<const uint8_t*>(ph.w) + item * PS_ITEM_W, PS_ITEM_W, bar);
        bulk_copy(dst + PS_ITEM_W, reinterpret_cast<const uint8_t*>(ph.s) + item * PS_ITEM_S, PS_ITEM_S, bar);
        bulk_copy(dst + PS_ITEM_W + PS_ITEM_S, reinterpret_cast<const uint8_t*>(ph.b) + item * PS_ITEM_S, PS_ITEM_S, bar);
      }
    }
    return;
  }
  const typename M::Lane ln(lane);
  const int g = lane >> 2, t = lane & 3;
  int it = 0;
  for (int ph_i = 0; ph_i < p.phases; ++ph_i) {
    const PsPhase ph = p.ph[ph_i];
    int t0;
    const int nt = my_tiles(ph, t0), chunks = ph.cols / PS_CHUNK_VALS, r0 = 16 * t0;
    PsStamp stamp[PS_TL_STAMPS] = {}, tmath = {};
    if (!NO_DEP && ph_i > 0 && tid == 0)
      while (ps_ld_acquire(&p.done[ph_i - 1]) < unsigned(G)) {
      }
    if (TL && tid == 0) stamp[0] = ps_now();
    ps_consumer_sync();
    if constexpr (XST) ps_copy_x(ph.xst, xs, ps_x_units(ph.cols), tid);
    else if constexpr (XB) ps_stage_x_batched(ph.x, ph.cols, xs, tid);
    else M::stage(ph.x, ph.cols, xs, tid);
    ps_consumer_sync();
    if (TL && tid == 0) stamp[1] = ps_now();
    bool stored = false;
    auto store_y = [&](int row, float v) {
      ph.y[row] = v;
      if constexpr (XST) yown[row - r0] = v;
      stored = true;
    };
    auto quad_sum = [&](float (&acc)[2]) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], 1);
        acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], 2);
      }
      if (TL) tmath = ps_now();
    };
    if constexpr (FLAT) {  // segments [lo, hi) of the CTA's items, a partial per tile touched
      const int tf = ps_flat_tile_of(nt, chunks, warp);
      float acc[2] = {0.f, 0.f};
      ps_flat_walk(nt, chunks, warp, [&](int i, int l0, int l1, bool done) {
        const int slot = (it + i) % SLOTS, round = (it + i) / SLOTS, h = i % chunks;
        mbar_wait(smem_u32(&full[slot]), round & 1);
        const uint8_t* base = ring + slot * PS_SLOT_BYTES;
        if (!NO_MATH)
#pragma unroll 4
          for (int ls = l0; ls < l1; ++ls) M::template step<1>(ln, base, ls, h * PS_CSEG + ls, xs, ph.cols, acc);
        __syncwarp();
        if (lane == 0) mbar_arrive_n(smem_u32(&empty[slot]), uint32_t(l1 - l0));
        if (done) {
          quad_sum(acc);
          const int ps = i / chunks == tf ? 0 : 1;
          if (t == 0) redf[warp][ps][g] = acc[0], redf[warp][ps][g + 8] = acc[1];
          acc[0] = acc[1] = 0.f;
        }
      });
      it += nt * chunks;
      ps_consumer_sync();  // redf written (read before this phase's x-staging barriers)
      if (tid < 16 * nt) {
        const int j = tid / 16, r = tid % 16;
        float v = 0.f;
        for (int w = ps_flat_first(nt, chunks, j); w <= ps_flat_last(nt, chunks, j); ++w)
          v += redf[w][ps_flat_slot(nt, chunks, w, j)][r];
        store_y(r0 + tid, v);
      }
    } else if (DEAL == PS_WT && chunks == 1) {  // a warp a tile: its 16 segments alone, no CTA barrier
      for (int j = warp; j < nt; j += MMA_WARPS) {
        const int i = it + j, slot = i % SLOTS, round = i / SLOTS;
        mbar_wait(smem_u32(&full[slot]), round & 1);
        const uint8_t* base = ring + slot * PS_SLOT_BYTES;
        float acc[2] = {0.f, 0.f};
        if (!NO_MATH)
#pragma unroll WT_UNROLL
          for (int ls = 0; ls < PS_CSEG; ls += M::STEP) M::template step<M::STEP>(ln, base, ls, ls, xs, ph.cols, acc);
        __syncwarp();
        if (lane == 0) mbar_arrive_n(smem_u32(&empty[slot]), MMA_WARPS);
        quad_sum(acc);
        if (t == 0) store_y(r0 + 16 * j + g, acc[0]), store_y(r0 + 16 * j + g + 8, acc[1]);
      }
      it += nt;
    } else {
      for (int j = 0; j < nt; ++j) {
        float acc[2] = {0.f, 0.f};
        for (int h = 0; h < chunks; ++h, ++it) {
          const int slot = it % SLOTS, round = it / SLOTS;
          mbar_wait(smem_u32(&full[slot]), round & 1);
          const uint8_t* base = ring + slot * PS_SLOT_BYTES;
#pragma unroll
          for (int q = 0; q < (NO_MATH ? 0 : SPW); q += NS)
            M::template step<NS>(ln, base, warp * SPW + q, h * PS_CSEG + warp * SPW + q, xs, ph.cols, acc);
          __syncwarp();
          if (lane == 0) mbar_arrive(smem_u32(&empty[slot]));
        }
        quad_sum(acc);
        float(*rd)[16] = red[j & 1];
        if (t == 0) rd[warp][g] = acc[0], rd[warp][g + 8] = acc[1];
        ps_consumer_sync();  // rd written by every warp (red[other] read before: the previous tile's barrier)
        if (tid < 16) {
          float v = 0.f;
          for (int k = 0; k < MMA_WARPS; ++k) v += rd[k][tid];
          store_y(r0 + 16 * j + tid, v);
        }
      }
    }
    if (TL && lane == 0) math_done[warp] = tmath;
    // the storing threads fence their y (today's protocol; PS_REL: no fence, the release below orders them),
    // the CTA barrier, PS_XST: warp 0 stages the CTA's y blocks, then thread 0 counts the phase done
    if (!NO_DEP || XST) {
      if (!NO_DEP && !REL && stored) __threadfence();
      ps_consumer_sync();
    }
    if constexpr (XST)
      if (warp == 0) ps_stage_y(yown, ph.y, ph.rows, r0, r0 + 16 * nt, ph.yst, ph.blk, lane, !NO_DEP && !REL);
    if (!NO_DEP && tid == 0) {
      if constexpr (!TL) {
        if constexpr (REL) ps_red_release_add(&p.done[ph_i], 1u);
        else atomicAdd(&p.done[ph_i], 1u);
      } else {
        stamp[3] = ps_now();
        const unsigned before = REL ? ps_atom_release_add(&p.done[ph_i], 1u) : atomicAdd(&p.done[ph_i], 1u);
        if (before >= unsigned(G)) __trap();  // counted twice: a protocol bug (the stamp waits for the atomic)
        stamp[4] = ps_now();
        stamp[2] = stamp[1];  // the latest warp (clock64: one SM), or x staged if no warp had a tile
        for (int w = 0; w < MMA_WARPS; ++w)
          if (math_done[w].clk > stamp[2].clk) stamp[2] = math_done[w];
        PsStamp* out = p.tl + (size_t(ph_i) * G + c) * PS_TL_STAMPS;
        for (int k = 0; k < PS_TL_STAMPS; ++k) out[k] = stamp[k];
      }
    }
  }
}

// Stages x [K] into global memory as the consumers stage it (PsDigits<1>::stage, one CTA of PS_CONSUMERS
// threads): PS_XST's copied x, and the reference for the producers' staged y.
__global__ void __launch_bounds__(PS_CONSUMERS) ps_stage_global_kernel(const float* x, int K, uint8_t* out) {
  PsDigits<1>::stage(x, K, out, int(threadIdx.x));
}

// The launch floor of a dependent chain: wait, trigger, one store.
__global__ void empty_kernel(float* y) {
  pdl_wait();
  pdl_trigger();
  if (threadIdx.x == 0) y[blockIdx.x] = 0.f;
}

__device__ __forceinline__ uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
__global__ void fill_words(uint32_t* p, size_t n, uint32_t seed) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = uint32_t(mix(i * 0x9E3779B97F4A7C15ull + seed));
}
__global__ void fill_bf16(uint16_t* p, size_t n, float lo, float hi, uint32_t seed) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = uint16_t(__float_as_uint(lo + (hi - lo) * float(mix(i * 0x9E3779B97F4A7C15ull + seed) >> 40) * 0x1p-24f) >>
                    16);
}

cudaStream_t g_stream;
int g_sms;

template <class T>
T* dalloc(size_t n) {
  T* p;
  CK(cudaMalloc(&p, n * sizeof(T)));
  return p;
}
int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// One 4-bit matrix [rows, cols], group 64.
struct Mat {
  int rows, cols;
  uint32_t* w;
  uint16_t *s, *b;
  Mat(int r, int c, uint32_t seed) : rows(r), cols(c) {
    w = dalloc<uint32_t>(size_t(r) * c / 8);
    s = dalloc<uint16_t>(size_t(r) * (c / 64));
    b = dalloc<uint16_t>(size_t(r) * (c / 64));
    fill_words<<<1024, 256, 0, g_stream>>>(w, size_t(r) * c / 8, seed);
    fill_bf16<<<1024, 256, 0, g_stream>>>(s, size_t(r) * (c / 64), 0.002f, 0.012f, seed + 1);
    fill_bf16<<<1024, 256, 0, g_stream>>>(b, size_t(r) * (c / 64), -0.05f, 0.05f, seed + 2);
    CK(cudaGetLastError());
  }
  double mb() const { return (double(rows) * cols / 2 + 4.0 * rows * (cols / 64)) / 1e6; }
};

template <class K, class... Args>
void launch_pdl(K* kernel, int grid, int threads, size_t smem, Args... args) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{dim3(grid), dim3(threads), smem, g_stream, &attr, 1};
  CK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

template <class F>
double time_us(F&& launch, int n, int per) {
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
  CK(cudaGraphLaunch(ge, g_stream));
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
  return ms[3] * 1e3 / (double(n) / per);
}

// The K-split of a bulk CTA with nt tiles: the fewest segments for its busiest warp, then the fewest parts.
int bulk_ks(int nt, int segs) {
  int best = 1;
  int64_t best_load = INT64_MAX;
  for (int ks = 1; ks <= MMA_WARPS && ks <= segs; ks *= 2) {
    const int64_t load = cdiv(int64_t(nt) * ks, MMA_WARPS) * cdiv(segs, ks);
    if (load < best_load) best_load = load, best = ks;
  }
  return best;
}

struct Op {  // one product of the chain, both ways
  const Mat* m;
  const float* x;
  float* y;
  int today_grid, today_ks;
  size_t today_smem;
  int bulk_grid, bulk_tmax, bulk_ks;
  size_t bulk_smem;
};

Op plan_op(const Mat& m, const float* x, float* y, int bulk_per_sm = 1) {
  Op op{&m, x, y};
  const auto mk = linear_gemv_mma_kernel<4, 2>;
  op.today_smem = mma_x_bytes(m.cols, MmaSeg<4>::VALS / 2);
  CK(cudaFuncSetAttribute(mk, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024));
  int per = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, mk, MMA_THREADS, op.today_smem));
  const int64_t tiles = m.rows / 16, segs = m.cols / MmaSeg<4>::VALS;
  const MmaPlan plan = mma_plan_for(tiles, segs, int64_t(g_sms) * per);
  op.today_grid = plan.grid, op.today_ks = plan.ks;
  op.bulk_grid = int(std::min<int64_t>(int64_t(g_sms) * bulk_per_sm, tiles));
  op.bulk_tmax = int(cdiv(tiles, op.bulk_grid));
  op.bulk_ks = bulk_ks(op.bulk_tmax, int(segs));
  op.bulk_smem = bulk_smem<4>(m.cols, op.bulk_tmax);
  std::fprintf(stderr, "  %d x %d: today grid %d ks %d (%d CTA/SM); bulk grid %d, %d tiles, ks %d, smem %zu\n", m.rows,
               m.cols, op.today_grid, op.today_ks, per, op.bulk_grid, op.bulk_tmax, op.bulk_ks, op.bulk_smem);
  return op;
}

void run_today(const Op& op) {
  const MmaLinearParams mp{op.m->w, op.m->s, op.m->b, op.x, op.y, op.m->rows, op.m->cols, 6, op.today_ks};
  launch_pdl(linear_gemv_mma_kernel<4, 2>, op.today_grid, MMA_THREADS, op.today_smem, mp);
}
template <int MODE>
void run_bulk(const Op& op) {
  const BulkParams bp{op.m->w, op.m->s, op.m->b, op.x, op.y, op.m->rows, op.m->cols, op.bulk_tmax, op.bulk_ks};
  launch_pdl(bulk_gemv_kernel<4, MODE>, op.bulk_grid, MMA_THREADS, op.bulk_smem, bp);
}

void run_empty(const Op& op) { launch_pdl(empty_kernel, g_sms, MMA_THREADS, 0, op.y); }

std::vector<float> to_host(const float* d, size_t n) {
  std::vector<float> h(n);
  CK(cudaStreamSynchronize(g_stream));
  CK(cudaMemcpy(h.data(), d, n * 4, cudaMemcpyDeviceToHost));
  return h;
}
double rel_diff(const std::vector<float>& a, const std::vector<float>& ref) {
  double d = 0, m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    d = std::max(d, double(std::abs(a[i] - ref[i]))), m = std::max(m, double(std::abs(ref[i])));
  }
  return d / m;
}

// ---- persistent variants, their errors and timelines (host) -------------------------------------------------
struct PsVariant {
  const char* name;
  void (*k)(PsParams);
  int slots, per_sm;
  bool no_dep, no_math, timeline, xst;
  size_t (*x_bytes)(int);
  size_t smem;
};
template <bool ND, bool NM, int SL, int DEAL, class M, bool TL = false, int F = 0>
PsVariant ps_variant(const char* name, int per_sm = 1) {
  return {name, persist_chain_kernel<ND, NM, SL, DEAL, M, TL, F>, SL, per_sm, ND, NM, TL, (F & PS_XST) != 0, M::x_bytes, 0};
}
// Rows (part 3 adds the release count, x staged by the producers and the flat dealing; the timeline rows of
// (a) and (b), measured in part 2, are dropped).
std::vector<PsVariant> ps_variants() {
  using D1 = PsDigits<1>;
  constexpr int S = PS_SLOTS, S2 = PS_SLOTS / 2, R = PS_REL, X = PS_XST, RX = PS_REL | PS_XST, XB = PS_XB,
                RB = PS_REL | PS_XB;
  return {ps_variant<false, false, S, PS_8W, D1>(""),
          ps_variant<true, false, S, PS_8W, D1>(", no dependency waits"),
          ps_variant<true, true, S, PS_8W, D1>(", no dependency waits, no math"),
          ps_variant<false, false, S2, PS_8W, D1>(", 2 CTAs a SM", 2),
          ps_variant<true, false, S2, PS_8W, D1>(", 2 CTAs a SM, no dependency waits", 2),
          ps_variant<false, false, S, PS_WT, D1>(", A a warp a tile"),
          ps_variant<true, false, S, PS_WT, D1>(", A a warp a tile, no dependency waits"),
          ps_variant<false, false, S, PS_8W, PsDigits<2>>(", (a) digits 2 segments a step"),
          ps_variant<true, false, S, PS_8W, PsDigits<2>>(", (a) digits 2 segments a step, no dependency waits"),
          ps_variant<false, false, S, PS_WT, PsDigits<4>>(", (a) A a warp a tile, digits 4 segments a step"),
          ps_variant<true, false, S, PS_WT, PsDigits<4>>(", (a) A a warp a tile, digits 4 segments a step, no dependency waits"),
          ps_variant<false, false, S, PS_8W, PsBf3>(", (b) bf16 x 3 terms"),
          ps_variant<true, false, S, PS_8W, PsBf3>(", (b) bf16 x 3 terms, no dependency waits"),
          ps_variant<false, false, S, PS_WT, PsBf3>(", (b) A a warp a tile, bf16 x 3 terms"),
          ps_variant<true, false, S, PS_WT, PsBf3>(", (b) A a warp a tile, bf16 x 3 terms, no dependency waits"),
          ps_variant<false, false, S, PS_8W, D1, false, R>(", (1) release count"),
          ps_variant<false, false, S, PS_WT, D1, false, R>(", (1) A a warp a tile, release count"),
          ps_variant<false, false, S, PS_8W, D1, false, X>(", (2) x staged by the producers"),
          ps_variant<true, false, S, PS_8W, D1, false, X>(", (2) x staged by the producers, no dependency waits"),
          ps_variant<false, false, S, PS_8W, D1, false, XB>(", (2b) x loads batched"),
          ps_variant<false, false, S, PS_FLAT, D1>(", (3) flat"),
          ps_variant<true, false, S, PS_FLAT, D1>(", (3) flat, no dependency waits"),
          ps_variant<false, false, S, PS_FLAT, D1, false, R>(", (3) flat, (1) release count"),
          ps_variant<false, false, S, PS_FLAT, D1, false, RX>(", (3) flat, (1) release count, (2) x staged"),
          ps_variant<true, false, S, PS_FLAT, D1, false, RX>(", (3) flat, (2) x staged, no dependency waits"),
          ps_variant<false, false, S, PS_FLAT, D1, false, RB>(", (3) flat, (1) release count, (2b) x loads batched"),
          ps_variant<false, false, S, PS_8W, D1, true>(" (today's math)"),
          ps_variant<false, false, S, PS_WT, D1, true>(", A a warp a tile (today's math)"),
          ps_variant<false, false, S, PS_8W, D1, true, R>(", (1) release count"),
          ps_variant<false, false, S, PS_WT, D1, true, R>(", (1) A a warp a tile, release count"),
          ps_variant<false, false, S, PS_8W, D1, true, RX>(", (1) release count, (2) x staged"),
          ps_variant<false, false, S, PS_FLAT, D1, true, R>(", (3) flat, (1) release count"),
          ps_variant<false, false, S, PS_FLAT, D1, true, RX>(", (3) flat, (1) release count, (2) x staged"),
          ps_variant<false, false, S, PS_FLAT, D1, true, RB>(", (3) flat, (1) release count, (2b) x loads batched")};
}

// y = W x in fp64 for a matrix's weights as the engine stores them (row-major) or as the persistent kernel
// reads them (chunk_major: [tile][2,048-value chunk][16 rows]).
std::vector<double> ref_fp64(const Mat& m, const std::vector<float>& x, bool chunk_major) {
  const int R = m.rows, K = m.cols, G = K / 64, chunks = K / PS_CHUNK_VALS;
  std::vector<uint32_t> w(size_t(R) * K / 8);
  std::vector<uint16_t> s(size_t(R) * G), b(size_t(R) * G);
  CK(cudaStreamSynchronize(g_stream));
  CK(cudaMemcpy(w.data(), m.w, w.size() * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(s.data(), m.s, s.size() * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(b.data(), m.b, b.size() * 2, cudaMemcpyDeviceToHost));
  auto bf = [](uint16_t v) {
    const uint32_t u = uint32_t(v) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return double(f);
  };
  std::vector<double> y(R);
  for (int o = 0; o < R; ++o) {
    double acc = 0;
    for (int k = 0; k < K; ++k) {
      size_t wi = size_t(o) * (K / 8) + k / 8, gi = size_t(o) * G + k / 64;
      if (chunk_major) {
        const size_t row = (size_t(o / 16) * chunks + k / PS_CHUNK_VALS) * 16 + o % 16, kk = k % PS_CHUNK_VALS;
        wi = row * (PS_CHUNK_VALS / 8) + kk / 8, gi = row * (PS_CHUNK_VALS / 64) + kk / 64;
      }
      const int q = int(w[wi] >> (4 * (k % 8))) & 15;
      acc += (bf(s[gi]) * q + bf(b[gi])) * double(x[k]);
    }
    y[o] = acc;
  }
  return y;
}
double rel_diff64(const std::vector<float>& a, const std::vector<double>& ref) {
  double d = 0, m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    d = std::max(d, std::abs(double(a[i]) - ref[i])), m = std::max(m, std::abs(ref[i]));
  }
  return d / m;
}

// Timeline rows of one run (chain_lab_timeline.h: what each column is).
void print_timeline(const char* name, const std::vector<PsStamp>& st, int phases, int G) {
  const PsTimeline r = ps_timeline(st, phases, G);
  for (int kind = 0; kind < 2; ++kind) {
    std::printf("| persistent%s | %s", name, kind == 0 ? "A" : "B");
    for (int i = 0; i < 6; ++i) std::printf(" | %.0f / %.0f", r.med[kind][i], r.p90[kind][i]);
    std::printf(" |\n");
  }
  std::printf("(%s: fit %.3f GHz, rms residual %.0f ns; %%globaltimer step %llu ns)\n", name, r.ghz, r.rms, r.step);
}

int main_lab() {
  CK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
  CK(cudaDeviceGetAttribute(&g_sms, cudaDevAttrMultiProcessorCount, 0));
  constexpr int LAYERS = 16, ROUNDS = 4;
  const int HA = 12352, KA = 2048, HB = 2048, KB = 4096;
  std::vector<Mat*> A, B;
  for (int l = 0; l < LAYERS; ++l) A.push_back(new Mat(HA, KA, 100 + 10 * l)), B.push_back(new Mat(HB, KB, 5000 + 10 * l));
  std::vector<float> hx(KB);
  for (int i = 0; i < KB; ++i) hx[i] = std::sin(0.37f * i) * (1.f + 0.001f * i);
  float *xa = dalloc<float>(KA), *xb = dalloc<float>(KB), *ya = dalloc<float>(HA), *yb = dalloc<float>(HB);
  CK(cudaMemcpy(xa, hx.data(), KA * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(xb, hx.data(), KB * 4, cudaMemcpyHostToDevice));
  for (auto k : {bulk_gemv_kernel<4, BULK_LATE>, bulk_gemv_kernel<4, BULK_EARLY>, bulk_gemv_kernel<4, BULK_AFTER>,
                 bulk_gemv_kernel<4, BULK_NO_MATH>, bulk_gemv_kernel<4, BULK_NO_STAGE>})
    CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  std::vector<Op> opa, opb, opa2, opb2;  // 2: bulk CTAs at 2 a SM (half the tiles each)
  for (int l = 0; l < LAYERS; ++l) opa.push_back(plan_op(*A[l], xa, ya)), opb.push_back(plan_op(*B[l], xb, yb));
  for (int l = 0; l < LAYERS; ++l)
    opa2.push_back(plan_op(*A[l], xa, ya, 2)), opb2.push_back(plan_op(*B[l], xb, yb, 2));
  {
    cudaFuncAttributes fa{};
    CK(cudaFuncGetAttributes(&fa, bulk_gemv_kernel<4, BULK_EARLY>));
    int pa = 0, pb = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&pa, bulk_gemv_kernel<4, BULK_EARLY>, MMA_THREADS, opa[0].bulk_smem));
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&pb, bulk_gemv_kernel<4, BULK_EARLY>, MMA_THREADS, opb[0].bulk_smem));
    std::printf("bulk kernel: %d registers, %zu static smem; CTAs/SM at A's smem %d, at B's %d; A+B smem %zu\n",
                fa.numRegs, fa.sharedSizeBytes, pa, pb, opa[0].bulk_smem + opb[0].bulk_smem + 2 * fa.sharedSizeBytes);
  }
  // correctness: one layer each way
  run_today(opa[0]);
  run_today(opb[0]);
  const std::vector<float> ra = to_host(ya, HA), rb = to_host(yb, HB);
  CK(cudaMemset(ya, 0xff, HA * 4));
  CK(cudaMemset(yb, 0xff, HB * 4));
  run_bulk<BULK_EARLY>(opa[0]);
  run_bulk<BULK_EARLY>(opb[0]);
  const double ea = rel_diff(to_host(ya, HA), ra), eb = rel_diff(to_host(yb, HB), rb);
  const double mb = A[0]->mb() + B[0]->mb();
  const int n = 2 * LAYERS * ROUNDS;
  struct V {
    const char* name;
    void (*a)(const Op&);
    void (*b)(const Op&);
    int set = 1;
  };
  const V vs[] = {{"today (mma_gemv, plan)", run_today, run_today},
                  {"bulk, trigger after wait", run_bulk<BULK_LATE>, run_bulk<BULK_LATE>},
                  {"bulk, trigger early", run_bulk<BULK_EARLY>, run_bulk<BULK_EARLY>},
                  {"today A, bulk-early B", run_today, run_bulk<BULK_EARLY>},
                  {"bulk-early A, today B", run_bulk<BULK_EARLY>, run_today},
                  {"bulk, copies after wait", run_bulk<BULK_AFTER>, run_bulk<BULK_AFTER>},
                  {"bulk late, no math", run_bulk<BULK_NO_MATH>, run_bulk<BULK_NO_MATH>},
                  {"bulk late, no x staging", run_bulk<BULK_NO_STAGE>, run_bulk<BULK_NO_STAGE>},
                  {"empty kernels (132 CTAs)", run_empty, run_empty},
                  {"bulk late, 2 CTAs a SM", run_bulk<BULK_LATE>, run_bulk<BULK_LATE>, 2},
                  {"bulk early, 2 CTAs a SM", run_bulk<BULK_EARLY>, run_bulk<BULK_EARLY>, 2}};
  std::printf("\nchain of %d layers x %d rounds: A %dx%d + B %dx%d, 4-bit, %.1f MB a layer; err A %.1e B %.1e\n\n",
              LAYERS, ROUNDS, HA, KA, HB, KB, mb, ea, eb);
  std::printf("| variant | us per layer (A + B) | TB/s of weights |\n|---|---:|---:|\n");
  for (const V& v : vs) {
    const double us = time_us([&](int i) {
      const int l = (i / 2) % LAYERS;
      if (i % 2 == 0) v.a(v.set == 2 ? opa2[l] : opa[l]);
      else v.b(v.set == 2 ? opb2[l] : opb[l]);
    }, n, 2);
    std::printf("| %s | %.2f | %.2f |\n", v.name, us, mb / us);
  }

  {  // persistent: the same chain as one kernel
    // PS_XST: x staged once from the fixed vectors (the consumers copy these bytes, so their y equal today's
    // math bit for bit); the producers stage their y into ysa / ysb (checked below against staging y).
    const size_t sxa = 16 * ps_x_units(KA), sxb = 16 * ps_x_units(KB), sya = 16 * ps_x_units(HA), syb = 16 * ps_x_units(HB);
    uint8_t *xsa = dalloc<uint8_t>(sxa), *xsb = dalloc<uint8_t>(sxb), *ysa = dalloc<uint8_t>(sya), *ysb = dalloc<uint8_t>(syb);
    ps_stage_global_kernel<<<1, PS_CONSUMERS, 0, g_stream>>>(xa, KA, xsa);
    ps_stage_global_kernel<<<1, PS_CONSUMERS, 0, g_stream>>>(xb, KB, xsb);
    CK(cudaGetLastError());
    const int phases = 2 * ROUNDS * LAYERS, cnt_n = phases + ROUNDS * LAYERS * (HA / 64 + HB / 64);
    unsigned* cnt = dalloc<unsigned>(cnt_n);  // [phases] phase counts, then each phase's block counters
    std::vector<PsPhase> hp;
    unsigned* blk = cnt + phases;
    for (int r = 0; r < ROUNDS; ++r)
      for (int l = 0; l < LAYERS; ++l) {
        hp.push_back(PsPhase{A[l]->w, A[l]->s, A[l]->b, xa, ya, HA, KA, xsa, ysa, blk});
        blk += HA / 64;
        hp.push_back(PsPhase{B[l]->w, B[l]->s, B[l]->b, xb, yb, HB, KB, xsb, ysb, blk});
        blk += HB / 64;
      }
    for (const std::array<int, 2> rk : {std::array<int, 2>{HA, KA}, std::array<int, 2>{HB, KB}}) {
      // PS_FLAT and PS_XST: at most PS_MAX_TILES tiles a CTA, and a CTA's items of a phase fit the ring
      const int64_t nt = cdiv(rk[0] / 16, g_sms), items = nt * (rk[1] / PS_CHUNK_VALS);
      if (nt > PS_MAX_TILES || items > PS_SLOTS) {
        std::fprintf(stderr, "chain_lab: %d x %d on %d SMs: %lld tiles, %lld items a CTA (at most %d, %d)\n", rk[0],
                     rk[1], g_sms, (long long)nt, (long long)items, PS_MAX_TILES, PS_SLOTS);
        return 1;
      }
    }
    PsPhase* dp = dalloc<PsPhase>(hp.size());
    unsigned* done = cnt;
    PsStamp* tl = dalloc<PsStamp>(size_t(phases) * g_sms * PS_TL_STAMPS);
    CK(cudaMemcpy(dp, hp.data(), hp.size() * sizeof(PsPhase), cudaMemcpyHostToDevice));
    const PsParams pp{dp, phases, done, tl};
    std::vector<PsVariant> vs = ps_variants();
    for (PsVariant& v : vs) {
      v.smem = size_t(v.slots) * PS_SLOT_BYTES + (v.x_bytes(KB) + 15) / 16 * 16;  // B's x at most (PS_XST: whole units)
      CK(cudaFuncSetAttribute(v.k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(v.smem)));
    }
    auto launch = [&](const PsVariant& v) {
      CK(cudaMemsetAsync(cnt, 0, size_t(cnt_n) * 4, g_stream));
      v.k<<<g_sms * v.per_sm, PS_THREADS, v.smem, g_stream>>>(pp);
    };
    for (const PsVariant& v : vs) {
      if (v.timeline) continue;
      const double us = time_us([&](int) { launch(v); }, 1, 1) / (LAYERS * ROUNDS);
      std::printf("| persistent, %d x %d KB ring%s | %.2f | %.2f |\n", v.slots, PS_SLOT_BYTES / 1024, v.name, us, mb / us);
    }
    std::printf("| floor at 4.8 TB/s | %.2f | 4.80 |\n", mb / 4.8e6 * 1e6);
    // errors: the last layer's outputs (A: the engine's layout, B: chunk-major) against today's kernel, the
    // persistent kernel with today's math (B) and the fp64 reference
    const std::vector<double> ra64 = ref_fp64(*A[LAYERS - 1], hx, false), rb64 = ref_fp64(*B[LAYERS - 1], hx, true);
    const std::vector<double> rbt64 = ref_fp64(*B[LAYERS - 1], hx, false);  // today's B (row-major)
    run_today(opa[LAYERS - 1]);
    run_today(opb[LAYERS - 1]);
    const std::vector<float> ta = to_host(ya, HA), tb = to_host(yb, HB);
    std::printf("\n| variant | err A vs today | err B vs persistent (today's math) | err A vs fp64 | err B vs fp64 |"
                " staged y bytes differing (A / B) |\n|---|---:|---:|---:|---:|---:|\n| today (mma_gemv) | 0 | | %.1e | %.1e | |\n",
                rel_diff64(ta, ra64), rel_diff64(tb, rbt64));
    // staged y: the producers' bytes against staging the same y as the consumers do, byte for byte
    auto staged_diff = [&](const float* y, int rows, const uint8_t* ys, size_t n) {
      uint8_t* ref = dalloc<uint8_t>(n);
      CK(cudaMemsetAsync(ref, 0, n, g_stream));
      ps_stage_global_kernel<<<1, PS_CONSUMERS, 0, g_stream>>>(y, rows, ref);
      std::vector<uint8_t> a(n), b(n);
      CK(cudaStreamSynchronize(g_stream));
      CK(cudaMemcpy(a.data(), ys, n, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(b.data(), ref, n, cudaMemcpyDeviceToHost));
      CK(cudaFree(ref));
      size_t d = 0;
      for (size_t i = 0; i < PsDigits<1>::x_bytes(rows); ++i) d += a[i] != b[i];  // not the unit's padding
      return d;
    };
    std::vector<float> pb0;
    for (const PsVariant& v : vs) {
      if (v.no_math || v.no_dep || v.timeline || v.per_sm != 1) continue;
      CK(cudaMemset(ya, 0xff, HA * 4));
      CK(cudaMemset(yb, 0xff, HB * 4));
      CK(cudaMemsetAsync(ysa, 0xee, sya, g_stream));  // all but the zero block (never written by the producers)
      CK(cudaMemsetAsync(ysb, 0xee, syb, g_stream));
      CK(cudaMemsetAsync(ysa, 0, 16, g_stream));
      CK(cudaMemsetAsync(ysb, 0, 16, g_stream));
      launch(v);
      const std::vector<float> pa = to_host(ya, HA), pb = to_host(yb, HB);
      if (pb0.empty()) pb0 = pb;  // the first variant: today's math
      std::printf("| persistent%s | %.1e | %.1e | %.1e | %.1e |", v.name, rel_diff(pa, ta), rel_diff(pb, pb0),
                  rel_diff64(pa, ra64), rel_diff64(pb, rb64));
      if (v.xst) std::printf(" %zu / %zu |\n", staged_diff(ya, HA, ysa, sya), staged_diff(yb, HB, ysb, syb));
      else std::printf(" |\n");
    }
    std::printf("\ntimeline (ns, median / p90 over CTAs and phases of a kind; hand-over from the previous phase's last"
                " count):\n\n| variant | kind | hand-over | stage x | math | store + fence | count | phase |\n"
                "|---|---|---:|---:|---:|---:|---:|---:|\n");
    std::vector<PsStamp> st(size_t(phases) * g_sms * PS_TL_STAMPS);
    for (const PsVariant& v : vs) {
      if (!v.timeline) continue;
      launch(v);  // warm
      launch(v);
      CK(cudaStreamSynchronize(g_stream));
      CK(cudaMemcpy(st.data(), tl, st.size() * sizeof(PsStamp), cudaMemcpyDeviceToHost));
      print_timeline(v.name, st, phases, g_sms);
    }
  }
  return 0;
}

}  // namespace lily::cuda::lab

int main() { return lily::cuda::lab::main_lab(); }
