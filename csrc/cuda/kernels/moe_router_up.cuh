// The MoE decode step's router, top-k and up product of one token as one kernel (one dependent phase
// instead of moe_router_kernel then moe_up_mma_kernel):
//   l[e] = Wr[e, :] . h (e < E),  g = Wg . h,  (topk_id, topk_w) = moe_topk_warp(l),  w_K = sigmoid(g),
//   act[s, i] = w_s * silu(G_s[i, :] . h) * (U_s[i, :] . h)   (moe_up_mma's rows, slot s < K expert
//   topk_id[s], slot K the shared expert).
// Shapes and formats: moe_router's (Wr [E, 2048], Wg [1, 2048] 8-bit affine, BF16 scales, E <= 256) and
// moe_up_mma's (MoeMmaParams, T = 1, H = 2048); act [K+1, ld] exactly as moe_up_mma writes it, topk_id,
// topk_w, shared_gate written by CTA 0 (moe_down_mma_kernel<.., true> reads the ids after its wait).
// NORM_IN: h = rms_norm(x) * w of the residual row x (p.m.h), staged once by mma_stage_normed_x.
// Grid: G clusters of n = ceil(E/16) CTAs of MMA_THREADS (n > 8 non-portable), blockIdx.x = the CTA's
// index in moe_up_mma's pass order. G = ceil(moe_up_mma's grid / n), so the CTAs are moe_up_mma's
// (same K split p.m.ks_up, same tiles and passes, strided by the rounded-up grid; CTAs past the last pass
// only route); at the model's dims 144 CTAs = 9 clusters of 16, one pass each (4.5 MB of router weights
// read from L2 per layer, 9 x 0.5 MB).
// Every cluster routes the token redundantly (no grid-wide exchange):
//  1. before the PDL wait, CTA b loads router rows 16b..16b+15 (warp w, lane l: 16-byte chunk
//     q = 32 (w % 4) + l of rows 16b + 8 (w / 4) + r, r < 8; 32 KB a CTA) and its gate pieces (moe_router's
//     mapping: piece b + jn on threads 8j..8j+7);
//  2. after the wait each thread stages octet tid of h (H = 8 x 256: one octet a thread) twice: as the
//     tensor-core digits (mma_stage_octet, as mma_stage_x / mma_stage_normed_x) and as F32 in the router's
//     swizzled chunks with their sums (chunk c = octets 2c, 2c+1; the sum in gemv_stage_x's order);
//  3. logits as linear_gemv_kernel<8,1> and moe_router sum them: chunk partials by gemv_chunk, per group
//     of 32 chunks the xor butterfly (one warp = one group), the four groups added from 0 in order;
//     thread (j = tid % 16, rank tid / 16) stores logit 16b + j into that rank's shared memory (DSMEM), the
//     gate pieces go to every rank; one cluster barrier (release / acquire);
//  4. every CTA: warp 0 runs moe_topk_warp on its copy of the logits (the same bits everywhere), lane 0 of
//     warp 1 the gate's sigmoid (moe_router's tree), into shared memory; CTA 0 also stores them;
//  5. moe_up_mma's body (mma_gemv_body, MmaMoeUpRows over the ids and weights in shared memory).
// Steps 1-4 are the body's before(), so the experts' first weights are requested right after the top-k
// (the shared expert's too: letting the CTAs whose passes are all shared-expert tiles route in after()
// instead, their weights requested before the wait, held the router's 48 registers across the first
// units: 116-176 bytes of spill, and those CTAs are not the critical path at one pass a CTA).
// Registers (ptxas, sm_90a): 124-126, no spills; shared memory 11.1 KB static (13.2 KB NORM_IN) + the
// staged digits (6.1-6.6 KB): 2 CTAs an SM as moe_up_mma.
// Precision: bit-identical to moe_router_kernel (logits, choices, weights, gate) followed by
// moe_up_mma_kernel with the same ks (launcher: moe_up_mma's plan), so act and moe_down's output equal
// the two-kernel path's bit for bit (tests/gpu/test_moe.py, test_moe_router_up_*).
#pragma once
#include <cooperative_groups.h>

#include "moe_mma.cuh"
#include "moe_router.cuh"

namespace lily::cuda {

struct MoeRouterUpParams {
  MoeMmaParams m;         // the up product's (T = 1; m.h the token's row, the residual row with NORM_IN)
  AffineStack router;     // [E, 2048] 8-bit (rows = E)
  AffineStack gate;       // [1, 2048] 8-bit, the shared expert gate
  int32_t* topk_id;       // [K] written by CTA 0 (= m.topk_id)
  float* topk_w;          // [K]
  float* shared_gate;     // [1] sigmoid of the gate logit
};

constexpr int RU_ROWS = ROUTER_ROWS / 2;  // router rows a thread holds (two warps' halves of a CTA's 16)
static_assert(MMA_THREADS == 2 * ROUTER_CHUNKS, "a CTA = 2 x 4 warps over a router row's 4 chunk groups");
static_assert(ROUTER_COLS / 8 == MMA_THREADS, "one octet of h a thread");

template <int BITS, int NG, bool NORM_IN>
__global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_CTAS) moe_router_up_kernel(const MoeRouterUpParams p) {
  namespace cg = cooperative_groups;
  using S = MmaSeg<BITS>;
  using R = GemvShape<8>;
  constexpr int VB = S::VALS / NG, H = ROUTER_COLS, GROUPS = ROUTER_CHUNKS / 32;
  extern __shared__ uint2 xd[];                    // mma_x_bytes(H, VB): digits, then xe, xsum
  __shared__ float4 xs[ROUTER_CHUNKS * R::F];      // h as F32 in GemvShape's swizzled chunks
  __shared__ float xsum_r[ROUTER_CHUNKS];          // their sums
  __shared__ float red[GROUPS][ROUTER_ROWS];       // the chunk groups' sums of the CTA's rows
  __shared__ float logits[ROUTER_MAX_EXPERTS];     // every rank's copy
  __shared__ float gate_part[ROUTER_GATE_PIECES];  // every rank's copy
  __shared__ int32_t ids[MOE_MAX_TOP_K];
  __shared__ float wts[MOE_MAX_TOP_K + 1];         // routing weights, then the shared expert's
  const MoeMmaParams& m = p.m;
  float* xe = reinterpret_cast<float*>(xd + H / 8 * 3);
  float* xsum = xe + H / VB;
  const cg::cluster_group cluster = cg::this_cluster();
  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int b = int(cluster.block_rank()), n = int(cluster.num_blocks()), E = p.router.rows, K = m.K;
  const int q = 32 * (warp % GROUPS) + lane, rl0 = RU_ROWS * (warp / GROUPS), row0 = b * ROUTER_ROWS + rl0;
  __cluster_barrier_arrive_relaxed();  // paired with the wait before the first remote store

  GemvStage<RU_ROWS> st;  // constant weights: loaded before the wait
#pragma unroll
  for (int r = 0; r < RU_ROWS; ++r)
    gemv_load<8>(st, r, row0 + r < E, p.router.w, p.router.scales, p.router.biases, row0 + r, q, ROUTER_COLS / 4,
                 ROUTER_COLS / p.router.group_size, p.router.group_size);
  const int pieces = (ROUTER_GATE_PIECES - b + n - 1) / n, piece = b + (tid >> 3) * n;
  const bool gate_warp = warp * 32 < 8 * pieces, gate_lane = tid < 8 * pieces;  // gate_warp: warp-uniform
  const int gc = gate_lane ? 32 * (piece >> 2) + (piece & 3) + 4 * (tid & 7) : 0;
  GemvStage<1> gs;
  gemv_load<8>(gs, 0, gate_lane, p.gate.w, p.gate.scales, p.gate.biases, 0, gc, ROUTER_COLS / 4,
               ROUTER_COLS / p.gate.group_size, p.gate.group_size);

  auto route = [&] {
    // octet tid of h: F32 chunk c = tid / 2, float4s 2 (tid % 2), +1, and the chunk's sum
    // (0 + s(f0)) + s(f1) + s(f2) + s(f3) as gemv_stage_x adds it (f2, f3 from the odd neighbour)
    auto emit = [&](int o, const float (&v)[8]) {
      const int c = o >> 1, f0 = 2 * (o & 1);
      xs[R::slot(c, f0)] = make_float4(v[0], v[1], v[2], v[3]);
      xs[R::slot(c, f0 + 1)] = make_float4(v[4], v[5], v[6], v[7]);
      const float s0 = v[0] + v[1] + v[2] + v[3], s1 = v[4] + v[5] + v[6] + v[7];
      const float n0 = __shfl_down_sync(0xffffffffu, s0, 1), n1 = __shfl_down_sync(0xffffffffu, s1, 1);
      if ((o & 1) == 0) {
        float s = 0.f;
        s += s0;
        s += s1;
        s += n0;
        s += n1;
        xsum_r[c] = s;
      }
    };
    auto wait = [] {
      pdl_wait();
      pdl_trigger();
    };
    if constexpr (NORM_IN) {
      mma_stage_normed_x<BITS, VB>(m.h, m.norm_in, H, xd, xe, xsum, wait, emit);
    } else {  // mma_stage_x's one round at H = 8 x MMA_THREADS
      wait();
      const float4* x4 = reinterpret_cast<const float4*>(m.h) + 2 * tid;
      const float4 a = x4[0], c = x4[1];
      const float v[8] = {a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w};
      emit(tid, v);
      mma_stage_octet<BITS, VB>(v, tid, H / 8, xd, xe, xsum);
    }
    __syncthreads();

    float acc[RU_ROWS][1] = {};  // chunk partials, then the group's butterfly
    gemv_chunk<8, RU_ROWS, 1>(st, xs, xsum_r, ROUTER_CHUNKS, q, acc);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
      for (int r = 0; r < RU_ROWS; ++r) acc[r][0] += __shfl_xor_sync(0xffffffffu, acc[r][0], o);
    if (lane == 0)
#pragma unroll
      for (int r = 0; r < RU_ROWS; ++r) red[warp % GROUPS][rl0 + r] = acc[r][0];
    float gp[1][1] = {};
    if (gate_warp) {
      gemv_chunk<8, 1, 1>(gs, xs, xsum_r, ROUTER_CHUNKS, gc, gp);
#pragma unroll
      for (int o = 4; o > 0; o >>= 1) gp[0][0] += __shfl_xor_sync(0xffffffffu, gp[0][0], o);  // chunks +-16, 8, 4
    }
    __syncthreads();
    const int j = tid % ROUTER_ROWS, dst = tid / ROUTER_ROWS;  // logit 16b + j for rank dst
    float l = 0.f;
#pragma unroll
    for (int k = 0; k < GROUPS; ++k) l += red[k][j];

    __cluster_barrier_wait();  // every CTA of the cluster runs: its shared memory may be written
    auto at = [&](float* local, int rank) { return rank == b ? local : cluster.map_shared_rank(local, rank); };
    if (dst < n && b * ROUTER_ROWS + j < E) at(logits, dst)[b * ROUTER_ROWS + j] = l;
    if (gate_lane && (tid & 7) == 0)
      for (int r = 0; r < n; ++r) at(gate_part, r)[piece] = gp[0][0];
    __cluster_barrier_arrive();  // release: the stores above
    __cluster_barrier_wait();    // acquire: every rank's; no CTA touches another's memory after this
    if (warp == 0) {
      moe_topk_warp<ROUTER_MAX_EXPERTS / 32>(logits, E, K, ids, wts);
    } else if (warp == 1 && lane == 0) {
      float g = 0.f;  // levels 2 and 1 of each group's butterfly, then the groups in order (slot_sum)
#pragma unroll
      for (int k = 0; k < 4; ++k)
        g += (gate_part[4 * k] + gate_part[4 * k + 2]) + (gate_part[4 * k + 1] + gate_part[4 * k + 3]);
      wts[K] = moe_sigmoid(g);
    }
    __syncthreads();
    if (blockIdx.x == 0 && tid <= K) {
      if (tid < K) p.topk_id[tid] = ids[tid], p.topk_w[tid] = wts[tid];
      else *p.shared_gate = wts[K];
    }
  };

  const int Sg = H / S::VALS;
  const MmaSplit sp(m.ks_up, Sg);
  const MmaMoeUpRows<BITS> rows{m, ids, 0, wts, wts + K};
  mma_gemv_body<BITS, NG>(rows, (rows.total() + 7) / 8, Sg, sp, xd, xe, xsum, route, [] {});
}

}  // namespace lily::cuda
