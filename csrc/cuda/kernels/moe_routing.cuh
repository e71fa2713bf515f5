// MoE routing on the device: top-k of the router softmax, then the tables that group the chosen
// (token, slot) pairs by expert for the grouped products, then the fixed-order combine.
// Everything is integer counting or fixed-order float sums: results are bitwise reproducible.
// Layout of the routing words is RoutingTables in moe.cu.
#pragma once
#include "common.cuh"

namespace lily::cuda {

constexpr int MOE_MAX_TOP_K = 32;  // one lane holds one chosen expert
constexpr int MOE_TOPK_WARPS = 4;

struct MoeTopkParams {
  const float* logits;  // [T, E] F32 router logits
  float* shared_gate;   // [T] F32 shared expert gate logit in, sigmoid(logit) out
  int32_t* topk_id;     // [T, K] chosen experts, ascending id
  float* topk_w;        // [T, K] their renormalised probabilities
  int T, E, K;
};

// p = softmax(logits[t]) in fp32; the K largest p (ties: lower id), w_k = p_k / sum of the K p
// (summed in choice order like cpu::moe); stored in ascending expert id so that every later sum
// over a token's experts runs in cpu::moe's order. One warp per token; lane l holds experts
// l, l+32, ... (PL of them, E <= 32*PL) in registers; K rounds of a warp argmax over (p, id) with
// u32 reductions (p >= 0, so its float bits order like p). Also turns the shared expert gate logit
// into its sigmoid.
template <int PL>
__global__ void __launch_bounds__(MOE_TOPK_WARPS * 32) moe_topk_kernel(const MoeTopkParams p) {
  pdl_wait();
  pdl_trigger();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int t = blockIdx.x * MOE_TOPK_WARPS + warp;
  if (t >= p.T) return;  // no block-wide barrier below
  const float* l = p.logits + int64_t(t) * p.E;
  float v[PL];  // logits, then probabilities; -1 for experts past E and for chosen ones
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < PL; ++i) {
    const int e = lane + 32 * i;
    v[i] = e < p.E ? l[e] : -INFINITY;
    mx = fmaxf(mx, v[i]);
  }
  mx = warp_max(mx);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < PL; ++i)
    if (lane + 32 * i < p.E) sum += (v[i] = expf(v[i] - mx));
  sum = warp_sum(sum);
#pragma unroll
  for (int i = 0; i < PL; ++i) v[i] = lane + 32 * i < p.E ? v[i] / sum : -1.f;

  int my_id = 0;
  float my_p = 0.f, top = 0.f;
  for (int k = 0; k < p.K; ++k) {
    float best = -1.f;  // ascending e within the lane: the first maximum is the lowest id
    int best_id = INT32_MAX;
#pragma unroll
    for (int i = 0; i < PL; ++i)
      if (v[i] > best) best = v[i], best_id = lane + 32 * i;
    const unsigned bits = best >= 0.f ? __float_as_uint(best) : 0u;  // p >= 0: bits order like p
    const unsigned top_bits = __reduce_max_sync(0xffffffffu, bits);
    best_id = int(__reduce_min_sync(0xffffffffu, bits == top_bits ? unsigned(best_id) : 0xffffffffu));
    best = __uint_as_float(top_bits);
    if (lane == k) my_id = best_id, my_p = best;
    top += best;
#pragma unroll
    for (int i = 0; i < PL; ++i)
      if (lane + 32 * i == best_id) v[i] = -1.f;
  }
  int rank = 0;  // position of this lane's expert in ascending id order
  for (int j = 0; j < p.K; ++j) rank += __shfl_sync(0xffffffffu, my_id, j) < my_id;
  if (lane < p.K) {
    p.topk_id[int64_t(t) * p.K + rank] = my_id;
    p.topk_w[int64_t(t) * p.K + rank] = my_p / top;
  }
  if (lane == 0) p.shared_gate[t] = 1.f / (1.f + expf(-p.shared_gate[t]));
}

struct MoeCountParams {
  const int32_t* topk_id;  // [T, K]
  int32_t* count;          // [E] tokens routed to each expert
  int T, E, K;
};

// count[e] = #{(t, k): topk_id[t, k] == e}. One warp per expert, lanes over tokens.
__global__ void moe_count_kernel(const MoeCountParams p) {
  pdl_wait();
  pdl_trigger();
  const int lane = threadIdx.x & 31;
  const int e = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (e >= p.E) return;
  int n = 0;
  for (int64_t i = lane; i < int64_t(p.T) * p.K; i += 32) n += p.topk_id[i] == e;
  n = __reduce_add_sync(0xffffffffu, n);
  if (lane == 0) p.count[e] = n;
}

struct MoeScatterParams {
  const int32_t* topk_id;  // [T, K]
  const float* topk_w;     // [T, K]
  const int32_t* count;    // [E]
  int32_t* topk_row;       // [T, K] grouped row of (t, k)
  int32_t* row_end;        // [E] one past expert e's last grouped row
  int32_t* row_token;      // [T*K] token of each grouped row
  float* row_weight;       // [T*K] routing weight of each grouped row
  int32_t* tile_expert;    // [max_tiles]
  int32_t* tile_row0;      // [max_tiles]
  int32_t* num_tiles;      // [1]
  int T, E, K, tile_rows;
};

// Grouped rows: expert e owns rows [start_e, start_e + count[e]) with start_e = sum_{e' < e} count,
// its tokens in ascending order; its tiles of tile_rows rows follow those of lower experts.
// One warp per expert: prefix sums over lower experts, then 32 tokens at a time, a ballot ranks the
// tokens that chose e. The last expert's warp writes the tile count.
__global__ void moe_scatter_kernel(const MoeScatterParams p) {
  pdl_wait();
  pdl_trigger();
  const int lane = threadIdx.x & 31;
  const int e = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (e >= p.E) return;
  int start = 0, tiles = 0;
  for (int j = lane; j < e; j += 32) {
    start += p.count[j];
    tiles += (p.count[j] + p.tile_rows - 1) / p.tile_rows;
  }
  start = __reduce_add_sync(0xffffffffu, start);
  tiles = __reduce_add_sync(0xffffffffu, tiles);
  int next = start;
  for (int t0 = 0; t0 < p.T; t0 += 32) {
    const int t = t0 + lane;
    int slot = -1;
    if (t < p.T)
      for (int k = 0; k < p.K; ++k)
        if (p.topk_id[int64_t(t) * p.K + k] == e) slot = k;
    const unsigned hits = __ballot_sync(0xffffffffu, slot >= 0);
    if (slot >= 0) {
      const int row = next + __popc(hits & ((1u << lane) - 1u));
      p.row_token[row] = t;
      p.row_weight[row] = p.topk_w[int64_t(t) * p.K + slot];
      p.topk_row[int64_t(t) * p.K + slot] = row;
    }
    next += __popc(hits);
  }
  const int n = p.count[e], n_tiles = (n + p.tile_rows - 1) / p.tile_rows;
  if (lane == 0) p.row_end[e] = start + n;
  for (int i = lane; i < n_tiles; i += 32) {
    p.tile_expert[tiles + i] = e;
    p.tile_row0[tiles + i] = start + i * p.tile_rows;
  }
  if (e == p.E - 1 && lane == 0) *p.num_tiles = tiles + n_tiles;
}

struct MoeCombineParams {
  const float* down;         // [T*K + T, H] F32 expert outputs, weights folded in; shared rows last
  const int32_t* topk_row;   // [T, K]
  float* out;                // [T, H] F32
  int T, H, K;
};

// out[t, j] = sum_k down[topk_row[t, k], j] (k in ascending expert id) + down[T*K + t, j].
// Grid (T, ceil(H / 256)), one thread per element, a fixed summation order.
__global__ void moe_combine_kernel(const MoeCombineParams p) {
  pdl_wait();
  pdl_trigger();
  const int t = blockIdx.x, j = blockIdx.y * blockDim.x + threadIdx.x;
  if (j >= p.H) return;
  float s = 0.f;
  for (int k = 0; k < p.K; ++k) s += p.down[int64_t(p.topk_row[int64_t(t) * p.K + k]) * p.H + j];
  p.out[int64_t(t) * p.H + j] = s + p.down[(int64_t(p.T) * p.K + t) * p.H + j];
}

}  // namespace lily::cuda
