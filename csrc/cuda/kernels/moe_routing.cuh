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

// Selection order of (key, id) pairs: a before b when a.key > b.key, or the keys tie and a.id < b.id.
__device__ __forceinline__ bool moe_before(uint32_t ka, int ia, uint32_t kb, int ib) {
  return ka > kb || (ka == kb && ia < ib);
}

// Sorts a lane's PL (key, id) pairs (PL a power of two) into selection order: a bitonic network in
// registers (PL = 8: 24 compare-exchanges, 6 deep).
template <int PL>
__device__ __forceinline__ void moe_sort_lane(uint32_t (&key)[PL], int (&id)[PL]) {
#pragma unroll
  for (int k = 2; k <= PL; k <<= 1)
#pragma unroll
    for (int j = k >> 1; j > 0; j >>= 1)
#pragma unroll
      for (int i = 0; i < PL; ++i) {
        const int o = i ^ j;
        if (o <= i) continue;
        // runs with (i & k) == 0 put i first, the others o first (the last run, k = PL, puts i first)
        if (moe_before(key[o], id[o], key[i], id[i]) == ((i & k) == 0)) {
          const uint32_t tk = key[i];
          const int ti = id[i];
          key[i] = key[o], id[i] = id[o];
          key[o] = tk, id[o] = ti;
        }
      }
}

// p = softmax(l) in fp32 over E <= 32 * PL router logits; the K largest p (ties: lower id), w_k = p_k /
// sum of the K p (summed in choice order like cpu::moe); stored in ascending expert id (id[K], w[K]) so
// that every later sum over a token's experts runs in cpu::moe's order. One warp (all 32 lanes call it);
// lane l holds experts l, l+32, ... (PL of them) in registers. The selection keys are the u32 bits of p
// (p >= 0, so they order like p; 0 for experts past E); each lane sorts its (key, id) pairs once, then K
// rounds take the warp's first head by two u32 reductions (max key, then the lowest id holding it) and
// pop it from its lane. l may be global or shared memory; id and w are written by lanes < K.
template <int PL>
__device__ __forceinline__ void moe_topk_warp(const float* l, int E, int K, int32_t* id, float* w) {
  const int lane = threadIdx.x & 31;
  float v[PL];  // logits, then exp(l - max)
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < PL; ++i) {
    const int e = lane + 32 * i;
    v[i] = e < E ? l[e] : -INFINITY;
    mx = fmaxf(mx, v[i]);
  }
  mx = warp_max(mx);
  // past E: expf(-inf) = +0 adds nothing and its p is +0, key 0 (mx is finite), so no branches
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < PL; ++i) v[i] = expf(v[i] - mx);
#pragma unroll
  for (int i = 0; i < PL; ++i) sum += v[i];
  sum = warp_sum(sum);
  uint32_t key[PL];
  int eid[PL];
#pragma unroll
  for (int i = 0; i < PL; ++i) {
    const float pe = v[i] / sum;
    key[i] = pe >= 0.f ? __float_as_uint(pe) : 0u;
    eid[i] = lane + 32 * i;
  }
  moe_sort_lane(key, eid);

  int my_id = 0;
  float my_p = 0.f, top = 0.f;
  for (int k = 0; k < K; ++k) {
    const uint32_t top_key = __reduce_max_sync(0xffffffffu, key[0]);
    const int best_id = int(__reduce_min_sync(0xffffffffu, key[0] == top_key ? uint32_t(eid[0]) : 0xffffffffu));
    const float best = __uint_as_float(top_key);
    if (lane == k) my_id = best_id, my_p = best;
    top += best;
    if (eid[0] == best_id) {  // pop the head; the filler (0, INT32_MAX) loses to every expert
#pragma unroll
      for (int i = 0; i + 1 < PL; ++i) key[i] = key[i + 1], eid[i] = eid[i + 1];
      key[PL - 1] = 0u, eid[PL - 1] = INT32_MAX;
    }
  }
  int rank = 0;  // position of this lane's expert in ascending id order
  for (int j = 0; j < K; ++j) rank += __shfl_sync(0xffffffffu, my_id, j) < my_id;
  if (lane < K) id[rank] = my_id, w[rank] = my_p / top;
}

// The shared expert gate: sigmoid of its logit.
__device__ __forceinline__ float moe_sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

// moe_topk_warp for token t = one warp of the grid; also turns the shared expert gate logit into its sigmoid.
template <int PL>
__global__ void __launch_bounds__(MOE_TOPK_WARPS * 32) moe_topk_kernel(const MoeTopkParams p) {
  pdl_wait();
  pdl_trigger();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int t = blockIdx.x * MOE_TOPK_WARPS + warp;
  if (t >= p.T) return;  // no block-wide barrier below
  moe_topk_warp<PL>(p.logits + int64_t(t) * p.E, p.E, p.K, p.topk_id + int64_t(t) * p.K,
                    p.topk_w + int64_t(t) * p.K);
  if (lane == 0) p.shared_gate[t] = moe_sigmoid(p.shared_gate[t]);
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
