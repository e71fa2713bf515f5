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
// more of the bandwidth). The smallest ks among equals; CTAs = all slots, or the passes when fewer.
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
    const int64_t passes = (tiles + sp.rt - 1) / sp.rt, rounds = (passes + resident - 1) / resident;
    const double fill = passes < resident ? double(resident) / double(passes) : 1.0;
    const double cost = double(rounds) * (sp.upp + L) * std::sqrt(fill);
    if (cost < best_cost) best_cost = cost, best = MmaPlan{ks, int(passes < resident ? passes : resident)};
  }
  return best;
}

}  // namespace lily::cuda
