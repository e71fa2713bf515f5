// The launch plan of the integer tensor-core GEMV (kernels/gemv_mma.cuh): how many K-parts per tile
// and how many CTAs. Host code, shared by cuda/linear.cu, cuda/moe.cu (through linear.h) and
// benchmarks/gemv_lab.cu.
#pragma once
#include <cmath>
#include <cstdint>

#include "kernels/gemv_mma.cuh"

namespace lily::cuda {

// The launch plan over `tiles` 16-row tiles of `segments` segments with `resident` CTAs on the device at
// once: K-parts per tile (ks) and the CTA count. Model (fitted to the GEMV lab's ks sweeps, H200,
// docs/perf-notes.md): a CTA's time is its rounds of passes x (units per pass + L), where L is what a
// pass costs beyond its units: its reduction barrier (L = 1/2) or, when the weights' addresses depend on
// the kernel before (dependent = the MoE experts: no load before the wait, so each pass exposes a memory
// latency), L = 3; a plan that leaves CTA slots empty pays sqrt(empty-slot factor) (the other CTAs get
// more of the bandwidth). Rounds: passes / resident as a fraction for independent weights (the CTAs of a
// partial last round stream at the bandwidth the finished ones leave: in_proj 12352 x 2048 took 5.94 us
// at ks = 4's 1.46 rounds against 6.56 at ks = 8's 2.92, thirteenth session), whole rounds for dependent
// ones (each round waits out its latency). The smallest ks among equals; CTAs = all slots, or the passes
// when fewer.
struct MmaPlan {
  int ks, grid;
};
inline MmaPlan mma_plan_for(int64_t tiles, int64_t segments, int64_t resident, bool dependent = false) {
  MmaPlan best{1, 1};
  double best_cost = 1e300;
  const double L = dependent ? 3.0 : 0.5;
  for (int ks = 1; ks <= MMA_WARPS; ks *= 2) {
    if (ks > 1 && ks > segments) break;
    const MmaSplit sp(ks, int(segments));
    const int64_t passes = (tiles + sp.rt - 1) / sp.rt;
    const double rounds = dependent || passes < resident ? double((passes + resident - 1) / resident)
                                                         : double(passes) / double(resident);
    const double fill = passes < resident ? double(resident) / double(passes) : 1.0;
    const double cost = rounds * (sp.upp + L) * std::sqrt(fill);
    if (cost < best_cost) best_cost = cost, best = MmaPlan{ks, int(passes < resident ? passes : resident)};
  }
  return best;
}

// Below this many rows the fp32 GEMV is faster for one token: too few 16-row tiles to spread over the SMs
// (the 257-row router is the model's case; docs/perf-notes.md, "Decisions in the code").
constexpr int64_t GEMV_MMA_MIN_ROWS = 1024;

// Short prompts (linear.cu, use_gemv_mma_tokens; the matrix's own conditions apart): T = 2..MMA_TOKENS_MAX_T
// tokens of a rows x cols matrix take the multi-token integer GEMV (kernels/gemv_mma_tokens.cuh) instead
// of the fp32 GEMV (T <= 8) or the split-K wgmma GEMM (T > 8: ~25 us a call, its fixed cost) when
//  - it has 4 bits (a token's work is the one-token kernel's times T, so few tiles still keep the SMs busy;
//    GDN's 32-row in_proj_b / in_proj_a included), or 8 bits and GEMV_MMA_MIN_ROWS rows as for one token
//    (the 257-row router and the one-row shared gate keep the fp32 GEMV);
//  - T x rows x cols <= MMA_TOKENS_MAX_WORK multiply-adds. The kernel is compute-bound at these T
//    (gemv_lab, H200, sixth session: 8192 x 2048 at T = 16, 2^28 of them, 28.9 us; 12352 x 2048 at
//    T = 16 42.6 us), while the GEMMs it replaces cost ~25 us or stream the weights once: beyond 2^28
//    it loses, and on the 248,320-row lm_head (all_logits' blocks of 16 rows, engine.cpp write_logits)
//    by ~12x (estimated ~0.9 ms a block instead of ~0.07 ms). Every layer matrix of the model at T <= 16
//    is within it (the largest part: 8192 x 2048; the stacked in_proj runs for one token only).
constexpr int64_t MMA_TOKENS_MAX_T = 16, MMA_TOKENS_MAX_WORK = int64_t(1) << 28;
constexpr bool mma_tokens_shape(int bits, int64_t rows, int64_t cols, int64_t T) {
  return T >= 2 && T <= MMA_TOKENS_MAX_T && (bits == 4 || (bits == 8 && rows >= GEMV_MMA_MIN_ROWS)) &&
         T * rows * cols <= MMA_TOKENS_MAX_WORK;
}

}  // namespace lily::cuda
