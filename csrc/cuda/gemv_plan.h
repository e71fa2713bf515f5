// The launch plan of the integer tensor-core GEMV (kernels/gemv_mma.cuh): how many K-parts per tile
// and how many CTAs. Host code, shared by cuda/linear.cu, cuda/moe.cu (through linear.h) and
// benchmarks/gemv_lab.cu.
#pragma once
#include <cstdint>

#include "kernels/gemv_mma.cuh"

namespace lily::cuda {

// The launch plan over `tiles` 16-row tiles of `segments` segments with `resident` CTAs on the device at
// once: K-parts per tile (ks) and the CTA count. Measured on the H200 (docs/perf-notes.md): a memory-bound
// pass runs at a rate set by the warps in flight, so a plan that leaves CTA slots empty pays in proportion;
// cost = rounds of passes x (units per pass + 1/2 for the pass's reduction) x empty-slot factor, the
// smallest ks among equals; CTAs = all slots, or the passes when fewer.
struct MmaPlan {
  int ks, grid;
};
inline MmaPlan mma_plan_for(int64_t tiles, int64_t segments, int64_t resident) {
  MmaPlan best{1, 1};
  double best_cost = 1e300;
  for (int ks = 1; ks <= MMA_WARPS; ks *= 2) {
    if (ks > 1 && ks > segments) break;
    const MmaSplit sp(ks, int(segments));
    const int64_t passes = (tiles + sp.rt - 1) / sp.rt, rounds = (passes + resident - 1) / resident;
    const double fill = passes < resident ? double(resident) / double(passes) : 1.0;
    const double cost = double(rounds) * (sp.upp + 0.5) * fill;
    if (cost < best_cost) best_cost = cost, best = MmaPlan{ks, int(passes < resident ? passes : resident)};
  }
  return best;
}

}  // namespace lily::cuda
