// The routing of one token's router logits (one warp, device functions only): softmax, top-k, renormalise
// (moe_topk_warp), and the shared expert gate's sigmoid. Used by moe_topk_kernel and the fused router
// (moe_routing.cuh, moe_router.cuh) and by linear_route_kernel's tail (linear_route.cuh).
#pragma once
#include "common.cuh"

namespace lily::cuda {

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

}  // namespace lily::cuda
