// Greedy sampling without logprobs on a plain grid (device code only; launcher in sample.cu). Kept apart from
// sample.cuh, whose source the host emulator (benchmarks/sample_emu.cpp) also compiles.
#pragma once
#include "sample.cuh"

namespace lily::cuda {

// Greedy without logprobs (sample(): temperature 0, num_logprobs < 0) on a plain grid instead of the cluster:
//   chosen = argmax_v z_v (larger z, then the lower id: MaxFirst), token -1 if any logit is NaN.
// Grid GREEDY_CTAS x GREEDY_THREADS, no cluster: thread i of the grid takes quads (4 consecutive ids, one 16-byte
// load, load_quad's scores) i, i + n, ... (n = the grid's threads; the model's 248,320 ids are 2 quads a thread,
// their loads unrolled together), then a warp butterfly and the CTA's warps in order. Each CTA stores its Best in
// g_greedy_part[blockIdx.x], fences (cumulative over that store) and counts itself on g_greedy_arrivals; the last
// to arrive fences again, reads every partial through L2 (__ldcg), reduces them and writes the state as
// sample_kernel's rank 0 does (token, counts, seen; nothing but token -1 on NaN), then sets the counter back to 0
// (0 between launches: the launches of one stream never overlap). MaxFirst is a total order on the non-NaN
// scores, so the choice is the cluster kernel's and the CPU's, whatever order the partials combine in.
constexpr int GREEDY_CTAS = 128, GREEDY_THREADS = 256;
__device__ Best g_greedy_part[GREEDY_CTAS];
__device__ unsigned g_greedy_arrivals;  // see above: 0 between launches

__global__ void __launch_bounds__(GREEDY_THREADS) greedy_kernel(SampleParams p) {
  __shared__ Best warps[GREEDY_THREADS / 32];
  __shared__ bool last;
  pdl_wait();
  pdl_trigger();
  const int lane = int(threadIdx.x) & 31, warp = int(threadIdx.x) >> 5;
  Best b{{-INFINITY, INT_MAX}, 0};
  const int step = 4 * GREEDY_THREADS * int(gridDim.x);
#pragma unroll 2
  for (int v0 = 4 * (int(blockIdx.x) * GREEDY_THREADS + int(threadIdx.x)); v0 < p.V; v0 += step) {
    const Quad q = load_quad(p, v0, p.V);
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (v0 + k < p.V) {
        if (isnan(q.l[k])) b.nan = 1;
        b.a = MaxFirst{}(b.a, ArgMax{q.z[k], v0 + k});
      }
  }
  b = warp_reduce(b, BestMerge{});
  if (lane == 0) warps[warp] = b;
  __syncthreads();
  if (threadIdx.x == 0) {
    Best c = warps[0];
    for (int w = 1; w < GREEDY_THREADS / 32; ++w) c = BestMerge{}(c, warps[w]);
    g_greedy_part[blockIdx.x] = c;
    __threadfence();
    last = atomicAdd(&g_greedy_arrivals, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last || warp != 0) return;
  __threadfence();
  Best c{{-INFINITY, INT_MAX}, 0};
  for (int i = lane; i < int(gridDim.x); i += 32) {
    const Best* part = g_greedy_part + i;
    c = BestMerge{}(c, Best{{__ldcg(&part->a.v), __ldcg(&part->a.id)}, __ldcg(&part->nan)});
  }
  c = warp_reduce(c, BestMerge{});
  if (lane != 0) return;
  g_greedy_arrivals = 0;
  if (c.nan) {  // NaN logits choose nothing: token -1, counts/seen untouched (the host raises)
    p.token[0] = -1;
    return;
  }
  const int chosen = c.a.id >= 0 && c.a.id < p.V ? c.a.id : 0;  // never out of range, whatever the logits
  p.token[0] = chosen;
  p.counts[chosen] += 1;
  p.seen[chosen] = 1;
}

}  // namespace lily::cuda
