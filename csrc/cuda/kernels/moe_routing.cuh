// MoE routing on the device: top-k of the router softmax, then the tables that group the chosen
// (token, slot) pairs by expert for the grouped products, then the fixed-order combine (alone, or with the
// residual add and the next RMSNorm: moe_combine_add_rms_norm_kernel).
// Everything is integer counting or fixed-order float sums: results are bitwise reproducible.
// Layout of the routing words is RoutingTables in moe.cu.
#pragma once
#include "common.cuh"
#include "norms.cuh"

namespace lily::cuda {

constexpr int MOE_MAX_TOP_K = 32;  // one lane holds one chosen expert
constexpr int MOE_TOPK_WARPS = 4;

struct MoeTopkParams {
  const float* logits;     // [T, ld] F32: token t's E router logits at t * ld
  const float* gate_in;    // token t's shared expert gate logit at t * ld_gate (may alias shared_gate)
  float* shared_gate;      // [T] F32: sigmoid of that logit out
  int64_t ld, ld_gate;
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
  moe_topk_warp<PL>(p.logits + t * p.ld, p.E, p.K, p.topk_id + int64_t(t) * p.K, p.topk_w + int64_t(t) * p.K);
  if (lane == 0) p.shared_gate[t] = moe_sigmoid(p.gate_in[t * p.ld_gate]);
}

// The routing tables run over chunks of MOE_ROUTE_TOKENS consecutive tokens, one CTA of as many threads
// per chunk (C = ceil(T / MOE_ROUTE_TOKENS) CTAs): chunk c holds tokens [c * MOE_ROUTE_TOKENS, ...).
constexpr int MOE_ROUTE_WARPS = 8;
constexpr int MOE_ROUTE_TOKENS = 32 * MOE_ROUTE_WARPS;

struct MoeCountParams {
  const int32_t* topk_id;  // [T, K]
  int32_t* chunk_count;    // [C, E] tokens of chunk c routed to expert e
  int T, E, K;
};

// chunk_count[c, e] = #{(t, k): topk_id[t, k] == e, t in chunk c}. The CTA's threads stride over the
// chunk's (t, k) pairs into a histogram of E ints in shared memory (dynamic, 4E bytes) by shared atomics
// (integer counts: any order gives the same), then store it, one word per expert.
__global__ void __launch_bounds__(MOE_ROUTE_TOKENS) moe_count_kernel(const MoeCountParams p) {
  extern __shared__ int32_t hist[];  // [E]
  pdl_wait();
  pdl_trigger();
  for (int e = threadIdx.x; e < p.E; e += MOE_ROUTE_TOKENS) hist[e] = 0;
  __syncthreads();
  const int64_t i0 = int64_t(blockIdx.x) * MOE_ROUTE_TOKENS * p.K;
  const int n = int(min(int64_t(p.T) * p.K - i0, int64_t(MOE_ROUTE_TOKENS) * p.K));
  for (int i = threadIdx.x; i < n; i += MOE_ROUTE_TOKENS) atomicAdd(&hist[p.topk_id[i0 + i]], 1);
  __syncthreads();
  for (int e = threadIdx.x; e < p.E; e += MOE_ROUTE_TOKENS) p.chunk_count[int64_t(blockIdx.x) * p.E + e] = hist[e];
}

struct MoeScatterParams {
  const int32_t* topk_id;      // [T, K]
  const float* topk_w;         // [T, K]
  const int32_t* chunk_count;  // [C, E] (moe_count_kernel)
  int32_t* topk_row;           // [T, K] grouped row of (t, k)
  int32_t* row_end;            // [E] one past expert e's last grouped row
  int32_t* row_token;          // [T*K] token of each grouped row
  float* row_weight;           // [T*K] routing weight of each grouped row
  int32_t* tile_expert;        // [max_tiles] the map of tile_rows-row tiles
  int32_t* tile_row0;          // [max_tiles]
  int32_t* num_tiles;          // [1]
  int32_t* tail_expert;        // [E] the map of tail_rows-row tiles (an expert's last remainder)
  int32_t* tail_row0;          // [E]
  int32_t* num_tail_tiles;     // [1]
  int32_t* all_expert;         // [max_tiles] the whole map: ceil(n_e / tile_rows) tiles an expert (less a merged one)
  int32_t* all_row0;           // [max_tiles]
  int32_t* num_all_tiles;      // [1]
  int32_t* merge_expert;       // [E] the merge map of tile_rows + merge_rows-row tiles (an expert's last two)
  int32_t* merge_row0;         // [E]
  int32_t* num_merge_tiles;    // [1]
  int T, E, K, tile_rows;
  int tail_rows;               // 0 (no tail map) or below tile_rows
  int merge_rows;              // 0 (no merge map) or the remainder rows a merged tile may add to a full one
};

// Grouped rows: expert e owns rows [start_e, start_e + n_e) with n_e = sum_c chunk_count[c, e] and
// start_e = sum_{e' < e} n_e', its tokens in ascending order. Two tile maps cover them, each expert's
// tiles following those of lower experts: with r_e = n_e mod tile_rows, the tile_rows-row map holds e's
// floor(n_e / tile_rows) full tiles and, when r_e > tail_rows, one tile of its last r_e rows; the
// tail_rows-row map holds that last tile instead when 0 < r_e <= tail_rows (one tile: r_e <= tail_rows).
// tail_rows = 0: ceil(n_e / tile_rows) tiles in the first map, the tail map empty (*num_tail_tiles = 0).
// Every row lies in exactly one tile of one map. A third map, the whole map, holds each expert's
// ceil(n_e / tile_rows) tiles whatever tail_rows (the down product's: its short k loop makes a 64-row
// tile cost about as much as a 128-row one, docs/perf-notes.md, nineteenth session), except, with
// merge_rows > 0, an expert with n_e > tile_rows and 0 < r_e <= merge_rows: its last full tile and the
// remainder go to the merge map as one tile of tile_rows + r_e rows instead (the whole map keeps
// floor(n_e / tile_rows) - 1 tiles; the down product's BM = tile_rows + merge_rows kernel: one k loop
// where two tiles, the second of a few rows, cost two). The whole map and the merge map cover every row
// once too. A token's K experts are distinct (moe_topk's choice).
// Grid C, MOE_ROUTE_TOKENS threads: thread 32w + l of CTA c takes token t = c * MOE_ROUTE_TOKENS + 32w + l.
// Each CTA sums n_e and b_e = sum_{c' < c} chunk_count[c', e] (threads over e), and warp w sets bit l of
// mask[w][e] for each expert e its lane l's token chose (atomicOr: the same bits in any order). Warp 0
// scans n_e and the maps' tile counts over e (a lane per run of ceil(E / 32) experts, then a shuffle scan),
// so expert e's rows of this chunk start at start_e + b_e. The row of (t, k) with e = topk_id[t, k] is
// that plus the chunk's earlier tokens that chose e: popc(mask[w'][e]) for w' < w and popc(mask[w][e])
// over lanes below l, so ascending token order with no ordering between threads. CTA c also writes
// row_end and the tiles (both maps) of the experts e with e % C == c, CTA 0 the two tile counts.
// Dynamic shared memory: (2 + MOE_ROUTE_WARPS) * E words (40 KB at moe_topk's E <= 1024).
__global__ void __launch_bounds__(MOE_ROUTE_TOKENS) moe_scatter_kernel(const MoeScatterParams p) {
  extern __shared__ int32_t smem[];
  int32_t* n_of = smem;                                       // [E] n_e
  int32_t* base = smem + p.E;                                 // [E] b_e, then start_e + b_e
  uint32_t* mask = reinterpret_cast<uint32_t*>(smem + 2 * p.E);  // [MOE_ROUTE_WARPS][E]
  pdl_wait();
  pdl_trigger();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, c = blockIdx.x;
  const int t = c * MOE_ROUTE_TOKENS + threadIdx.x;
  const int32_t* ids = p.topk_id + int64_t(t) * p.K;
  for (int i = threadIdx.x; i < MOE_ROUTE_WARPS * p.E; i += MOE_ROUTE_TOKENS) mask[i] = 0u;
  __syncthreads();
  if (t < p.T)
    for (int k = 0; k < p.K; ++k) atomicOr(&mask[warp * p.E + ids[k]], 1u << lane);
  for (int e = threadIdx.x; e < p.E; e += MOE_ROUTE_TOKENS) {
    int n = 0, b = 0;
    for (int j = 0; j < int(gridDim.x); ++j) {
      const int m = p.chunk_count[int64_t(j) * p.E + e];
      n += m;
      b += j < c ? m : 0;
    }
    n_of[e] = n;
    base[e] = b;
  }
  __syncthreads();
  if (warp == 0) {
    // expert e: full = floor(n / tile_rows) full tiles, remainder r; the last r rows go to the first map
    // as one more tile when r > tail_rows, to the tail map when 0 < r <= tail_rows
    auto main_tiles = [&](int n) { return n / p.tile_rows + (n % p.tile_rows > p.tail_rows ? 1 : 0); };
    auto tail_tiles = [&](int n) { return n % p.tile_rows > 0 && n % p.tile_rows <= p.tail_rows ? 1 : 0; };
    auto merge_tiles = [&](int n) {
      return n > p.tile_rows && n % p.tile_rows > 0 && n % p.tile_rows <= p.merge_rows ? 1 : 0;
    };
    auto all_tiles = [&](int n) { return (n + p.tile_rows - 1) / p.tile_rows - 2 * merge_tiles(n); };
    const int per = (p.E + 31) / 32, e0 = min(lane * per, p.E), e1 = min(e0 + per, p.E);
    int rows = 0, tiles = 0, tails = 0, alls = 0, merges = 0;  // this lane's run, then inclusive scans over lanes
    for (int e = e0; e < e1; ++e) {
      const int n = n_of[e];
      rows += n, tiles += main_tiles(n), tails += tail_tiles(n), alls += all_tiles(n), merges += merge_tiles(n);
    }
    int start = -rows, tile = -tiles, tail = -tails, all = -alls, merge = -merges;
    for (int o = 1; o < 32; o <<= 1) {
      const int r = __shfl_up_sync(0xffffffffu, rows, o), u = __shfl_up_sync(0xffffffffu, tiles, o),
                v = __shfl_up_sync(0xffffffffu, tails, o), w = __shfl_up_sync(0xffffffffu, alls, o),
                m = __shfl_up_sync(0xffffffffu, merges, o);
      if (lane >= o) rows += r, tiles += u, tails += v, alls += w, merges += m;
    }
    // exclusive: the rows and tiles of experts below e0
    start += rows, tile += tiles, tail += tails, all += alls, merge += merges;
    for (int e = e0; e < e1; ++e) {
      const int n = n_of[e], nt = main_tiles(n), nu = tail_tiles(n), na = all_tiles(n), nm = merge_tiles(n);
      base[e] += start;
      if (e % int(gridDim.x) == c) {
        p.row_end[e] = start + n;
        for (int i = 0; i < nt; ++i) p.tile_expert[tile + i] = e, p.tile_row0[tile + i] = start + i * p.tile_rows;
        if (nu) p.tail_expert[tail] = e, p.tail_row0[tail] = start + nt * p.tile_rows;
        for (int i = 0; i < na; ++i) p.all_expert[all + i] = e, p.all_row0[all + i] = start + i * p.tile_rows;
        if (nm) p.merge_expert[merge] = e, p.merge_row0[merge] = start + na * p.tile_rows;
      }
      start += n, tile += nt, tail += nu, all += na, merge += nm;
    }
    if (c == 0 && lane == 31)
      *p.num_tiles = tile, *p.num_tail_tiles = tail, *p.num_all_tiles = all, *p.num_merge_tiles = merge;
  }
  __syncthreads();
  if (t >= p.T) return;
  for (int k = 0; k < p.K; ++k) {
    const int e = ids[k];
    int row = base[e] + __popc(mask[warp * p.E + e] & ((1u << lane) - 1u));
    for (int w = 0; w < warp; ++w) row += __popc(mask[w * p.E + e]);
    p.row_token[row] = t;
    p.row_weight[row] = p.topk_w[int64_t(t) * p.K + k];
    p.topk_row[int64_t(t) * p.K + k] = row;
  }
}

struct MoeCombineParams {
  const float* down;         // [T*K + T, H] F32 expert outputs, weights folded in; shared rows last
  const uint16_t* down16;    // or those rows as BF16 (row r at r*H), read by moe_combine8_at instead of down
  const int32_t* topk_row;   // [T, K]
  float* out;                // [T, H] F32
  int T, H, K;
};

// out[t, j] = sum_k down[topk_row[t, k], j] (k in ascending expert id) + down[T*K + t, j].
// Grid (T, ceil(H / 256)), one thread per element, a fixed summation order. F32 rows (down) only.
__global__ void moe_combine_kernel(const MoeCombineParams p) {
  pdl_wait();
  pdl_trigger();
  const int t = blockIdx.x, j = blockIdx.y * blockDim.x + threadIdx.x;
  if (j >= p.H) return;
  float s = 0.f;
  for (int k = 0; k < p.K; ++k) s += p.down[int64_t(p.topk_row[int64_t(t) * p.K + k]) * p.H + j];
  p.out[int64_t(t) * p.H + j] = s + p.down[(int64_t(p.T) * p.K + t) * p.H + j];
}

constexpr int MOE_COMBINE4_MAX_K = 8;  // moe_combine4_at's loads in flight a thread: K + 1 rows' 4 columns

// moe_combine_kernel's sums for token t's output columns 4c .. 4c+3, from float4 loads: every one of the
// token's K + 1 rows requested before the first add (the scalar kernel's loop waits for each row in turn),
// then added in the same order (0, k ascending, the shared row last), so the same bits. H % 4 == 0, down
// 16-byte aligned, K <= MOE_COMBINE4_MAX_K.
__device__ __forceinline__ float4 moe_combine4_at(const MoeCombineParams& p, int t, int c) {
  float4 v[MOE_COMBINE4_MAX_K];
#pragma unroll
  for (int k = 0; k < MOE_COMBINE4_MAX_K; ++k)
    if (k < p.K)
      v[k] = reinterpret_cast<const float4*>(p.down + int64_t(p.topk_row[int64_t(t) * p.K + k]) * p.H)[c];
  const float4 sh = reinterpret_cast<const float4*>(p.down + (int64_t(p.T) * p.K + t) * p.H)[c];
  float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int k = 0; k < MOE_COMBINE4_MAX_K; ++k)
    if (k < p.K) s.x += v[k].x, s.y += v[k].y, s.z += v[k].z, s.w += v[k].w;
  return make_float4(s.x + sh.x, s.y + sh.y, s.z + sh.z, s.w + sh.w);
}

// The bf16 pair w's values in fp32, exactly (each one's bits as the top half of an fp32), added to s[0], s[1].
__device__ __forceinline__ void moe_add_bf16x2(float* s, uint32_t w) {
  s[0] += __uint_as_float(w << 16);
  s[1] += __uint_as_float(w & 0xFFFF0000u);
}

// The same sums over down16's bf16 rows (pair order, linear_common.cuh's LinearArgs::y16: position 16q + 2i + h
// holds column 16q + i + 8h) for the token t's 16-byte chunk c = 2q + s (positions 16q + 8s .. 16q + 8s + 7):
// lo = columns 16q + 4s .. 16q + 4s + 3 (float4 column 4q + s), hi = the 4 columns 8 past them (float4 column
// 4q + 2 + s). One 16-byte load a row, all K + 1 rows requested before the first add, each value widened exactly
// and added in the order above (0, k ascending, the shared row last). H % 16 == 0, down16 16-byte aligned,
// K <= MOE_COMBINE4_MAX_K. A column's sum does not depend on which thread forms it, so any mapping of columns
// to threads gives the same bits.
__device__ __forceinline__ void moe_combine8_at(const MoeCombineParams& p, int t, int c, float4& lo, float4& hi) {
  uint4 v[MOE_COMBINE4_MAX_K];
#pragma unroll
  for (int k = 0; k < MOE_COMBINE4_MAX_K; ++k)
    if (k < p.K) v[k] = reinterpret_cast<const uint4*>(p.down16 + int64_t(p.topk_row[int64_t(t) * p.K + k]) * p.H)[c];
  const uint4 sh = reinterpret_cast<const uint4*>(p.down16 + (int64_t(p.T) * p.K + t) * p.H)[c];
  float m[8];  // m[2w]: word w's low half (column 4s + w of the block), m[2w + 1]: its high half (+ 8)
#pragma unroll
  for (int i = 0; i < 8; ++i) m[i] = 0.f;
#pragma unroll
  for (int k = 0; k < MOE_COMBINE4_MAX_K; ++k)
    if (k < p.K) moe_add_bf16x2(m, v[k].x), moe_add_bf16x2(m + 2, v[k].y), moe_add_bf16x2(m + 4, v[k].z),
                 moe_add_bf16x2(m + 6, v[k].w);
  moe_add_bf16x2(m, sh.x), moe_add_bf16x2(m + 2, sh.y), moe_add_bf16x2(m + 4, sh.z), moe_add_bf16x2(m + 6, sh.w);
  lo = make_float4(m[0], m[2], m[4], m[6]);
  hi = make_float4(m[1], m[3], m[5], m[7]);
}

// float4 column of chunk c's lo (moe_combine8_at); its hi is 2 float4 columns further. Host and device
// (tests/emu/down_bf16_emu.cu).
__host__ __device__ __forceinline__ int moe_chunk_lo4(int c) { return 4 * (c >> 1) + (c & 1); }

// moe_combine_kernel's output, 4 columns a thread (moe_combine4_at). Grid (T, ceil(H / 1024)), 256 threads;
// out 16-byte aligned.
__global__ void moe_combine4_kernel(const MoeCombineParams p) {
  pdl_wait();
  pdl_trigger();
  const int t = blockIdx.x, c = blockIdx.y * blockDim.x + threadIdx.x;
  if (4 * c >= p.H) return;
  reinterpret_cast<float4*>(p.out + int64_t(t) * p.H)[c] = moe_combine4_at(p, t, c);
}

// The same output from down16's bf16 rows (docs/numerics.md), a 16-byte chunk a thread (moe_combine8_at). Grid
// (T, ceil(H / 2048)), 256 threads; out 16-byte aligned.
__global__ void moe_combine_bf16_kernel(const MoeCombineParams p) {
  pdl_wait();
  pdl_trigger();
  const int t = blockIdx.x, c = blockIdx.y * blockDim.x + threadIdx.x;
  if (8 * c >= p.H) return;
  float4 lo, hi;
  moe_combine8_at(p, t, c, lo, hi);
  float4* const o = reinterpret_cast<float4*>(p.out + int64_t(t) * p.H) + moe_chunk_lo4(c);
  o[0] = lo;
  o[2] = hi;
}

// A prompt's MoE output joining the residual stream, and the next RMSNorm (ops::moe_add_rms_norm_xb): per token t
//   m[t, j] = sum_k down[topk_row[t, k], j] + down[T*K + t, j]    (moe_combine's sums)
//   x[t, j] += m[t, j];  y[t, j] = x[t, j] * s_t * w[j],  s_t = 1 / sqrt(mean_j x[t, j]^2 + eps)
// with y's bf16 X into n.yb and y itself only where n.y is set: add_rms_norm_row<true> with m as its residual.
// Shapes: down [T*K + T, H] F32 (routed rows grouped by expert, then the shared rows; BF16: down16, those rows
// as bf16, docs/numerics.md), topk_row [T, K], x and y [T, H] F32, w [H], yb [T, H] BF16 in the prefill GEMM's
// Xb layout (xb_layout.cuh).
// Bit-identical to moe_combine4_kernel (BF16: moe_combine_bf16_kernel) into out, then add_rms_norm_kernel<true>
// over (x, out): the same fp32 operations in the same order (m's K + 1 adds, x + m, each thread's squares in
// add_rms_norm's order, its block_sum, the same products and packing); m never goes to memory (its [T, H] F32
// rows written and read back: 64 MB a layer at T = 4096, H = 2048). Grid T (a block a token), nt =
// norm_threads(H) threads: thread tid takes float4 columns tid, tid + nt, ... (add_rms_norm's float4 mapping;
// at H = 2048 256 threads, two float4s each). F32: each float4 of m from its K + 1 = 9 row loads in flight
// (moe_combine4_at). BF16: the row of m first, 8 columns a thread from one 16-byte load a row
// (moe_combine8_at: 9 loads in flight, each as wide as a float4 load, where the float4 mapping would take
// two 8-byte loads a row, and in pair order), into H * 4 bytes of dynamic shared memory, then
// add_rms_norm_row reads it there after a barrier. c.out and n.res unused. H % 4 == 0 (BF16: H % 16 == 0), down (down16), x, w, y 16-byte
// aligned (add_rms_norm's float4 path), K <= MOE_COMBINE4_MAX_K; H % 8 == 0 and yb 16-byte aligned (the Xb).
// The block's products wrote down before it (stream order); x, y and yb are its only global stores, so y may
// be the block's input h.
template <bool BF16>
__global__ void moe_combine_add_rms_norm_kernel(const MoeCombineParams c, const AddRmsNormParams n) {
  pdl_wait();
  pdl_trigger();
  __shared__ float red[32];
  const int t = blockIdx.x;
  if constexpr (BF16) {
    extern __shared__ float4 moe_m4[];  // [H / 4] the token's m
    for (int i = threadIdx.x; i < c.H / 8; i += blockDim.x) {
      float4 lo, hi;
      moe_combine8_at(c, t, i, lo, hi);
      moe_m4[moe_chunk_lo4(i)] = lo;
      moe_m4[moe_chunk_lo4(i) + 2] = hi;
    }
    __syncthreads();
    add_rms_norm_row<true>(n, int64_t(t) * n.D, [&](int i) { return moe_m4[i]; }, red, moe_m4);  // x + m over m
  } else {
    add_rms_norm_row<true>(n, int64_t(t) * n.D, [&](int i) { return moe_combine4_at(c, t, i); }, red);
  }
}

}  // namespace lily::cuda
