// Fixed-order reductions, scans and a radix select over one thread-block cluster, the building
// blocks of the sampler (kernels/sample.cuh). Device code only.
// Every CTA of the cluster reduces its threads (warp butterflies, then the warp partials in warp
// order), publishes its partial in its own shared memory, and after a cluster barrier each CTA
// combines the CTAs' partials in rank order through distributed shared memory. So every thread of
// the cluster gets the same bits, run after run. Exchange buffers are double-buffered: a buffer is
// rewritten only after a later cluster barrier, when every CTA has finished reading it.
#pragma once
#include <cooperative_groups.h>

#include "common.cuh"

namespace lily::cuda {

namespace cg = cooperative_groups;

// The cluster: for a draw SAMPLE_CTAS CTAs where the device grants that non-portable size (sample.cu asks once),
// else (and for greedy) SAMPLE_CTAS_PORTABLE. Each pass over the logits is split over the cluster's CTAs, so the
// wider cluster halves a pass (a chat-sampled step runs 4: the argmax, two of top_k's radix levels, the
// compaction; top_p alone 7).
constexpr int SAMPLE_CTAS = 16, SAMPLE_CTAS_PORTABLE = 8;
constexpr int SAMPLE_THREADS = 512;
constexpr int SAMPLE_TILE = 4 * SAMPLE_THREADS;  // ids per CTA per tile: 4 consecutive per thread
constexpr int RADIX_BINS = 256;                  // 8 bits per radix level, 4 levels
// Kept ids after top_k that the candidate path takes (kernels/sample.cuh, draw_candidates); top_k's ties can
// keep more than k, and past this many (all CTAs together) the sampler runs its full passes instead.
constexpr int SAMPLE_CANDIDATES = 1024;
using u64 = unsigned long long;

struct ArgMax {
  float v;
  int id;
};
struct Lse {  // running log-sum-exp: sum_i exp(x_i - m) = s
  float m, s;
};

struct SampleShared {
  alignas(16) unsigned char slots[32][16];  // per-warp partials of a block reduction
  alignas(16) unsigned char xch[2][16];     // this CTA's partial of a cluster reduction
  u64 hist[2][RADIX_BINS];                  // this CTA's radix histogram
  u64 merged[RADIX_BINS];                   // the cluster's histogram
  float scan[32];                           // warp totals of a block scan
  unsigned sel_bin;
  u64 sel_above, sel_need;
  // the candidate path: this CTA's kept ids in ascending order and their scores z / T (cand_n of them, the
  // first SAMPLE_CANDIDATES stored); rank 0 gathers every CTA's into all_id, all_e (z / T, then compacted to the
  // kept ids with e = exp(z / T - m)), sorts their keys into sort_key (top_k's threshold) and the kept e
  // descending into sorted_e
  int cand_id[SAMPLE_CANDIDATES];
  float cand_z[SAMPLE_CANDIDATES];
  int cand_n;
  int all_id[SAMPLE_CANDIDATES];
  float all_e[SAMPLE_CANDIDATES], sorted_e[SAMPLE_CANDIDATES];
  unsigned sort_key[SAMPLE_CANDIDATES];  // top_k's keys of the gathered candidates, sorted descending
  float tau;
};

struct ClusterCtx {
  cg::cluster_group cluster;
  SampleShared& sh;
  int ctas;  // the cluster's CTAs (SAMPLE_CTAS or SAMPLE_CTAS_PORTABLE)
  int xch_phase = 0, hist_phase = 0;
};

__device__ __forceinline__ float shfl_xor(float v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }
__device__ __forceinline__ int shfl_xor(int v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }
__device__ __forceinline__ ArgMax shfl_xor(ArgMax v, int o) { return {shfl_xor(v.v, o), shfl_xor(v.id, o)}; }
__device__ __forceinline__ Lse shfl_xor(Lse v, int o) { return {shfl_xor(v.m, o), shfl_xor(v.s, o)}; }

// All combiners are commutative, so both lanes of a butterfly compute the same bits.
struct MaxFirst {  // larger value; lower id on ties
  __device__ ArgMax operator()(ArgMax a, ArgMax b) const {
    return (b.v > a.v || (b.v == a.v && b.id < a.id)) ? b : a;
  }
};
struct SumF {
  __device__ float operator()(float a, float b) const { return a + b; }
};
struct MinI {
  __device__ int operator()(int a, int b) const { return min(a, b); }
};
struct MaxI {
  __device__ int operator()(int a, int b) const { return max(a, b); }
};
struct LseMerge {
  __device__ Lse operator()(Lse a, Lse b) const {
    const float m = fmaxf(a.m, b.m);
    if (m == -INFINITY) return {m, 0.f};
    return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
  }
};

__device__ __forceinline__ Lse lse_add(Lse a, float x) {
  if (x == -INFINITY) return a;
  if (x > a.m) return {x, a.s * expf(a.m - x) + 1.f};
  return {a.m, a.s + expf(x - a.m)};
}

template <class T, class Op>
__device__ T block_reduce(T v, Op op, SampleShared& sh) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, shfl_xor(v, o));
  if ((threadIdx.x & 31) == 0) *reinterpret_cast<T*>(sh.slots[threadIdx.x >> 5]) = v;
  __syncthreads();
  T r = *reinterpret_cast<T*>(sh.slots[0]);
  for (int w = 1; w < SAMPLE_THREADS / 32; ++w) r = op(r, *reinterpret_cast<T*>(sh.slots[w]));
  __syncthreads();  // the slots are free for the next reduction
  return r;
}

template <class T, class Op>
__device__ T cluster_reduce(T v, Op op, ClusterCtx& c) {
  v = block_reduce(v, op, c.sh);
  T* mine = reinterpret_cast<T*>(c.sh.xch[c.xch_phase]);
  c.xch_phase ^= 1;
  if (threadIdx.x == 0) *mine = v;
  c.cluster.sync();
  T r = *c.cluster.map_shared_rank(mine, 0);
  for (int k = 1; k < c.ctas; ++k) r = op(r, *c.cluster.map_shared_rank(mine, k));
  return r;
}

// The CTAs' values x_r in rank order: returns sum_{r < rank} x_r and sets total = sum_r x_r,
// both summed left to right (so total extends every CTA's prefix).
__device__ float cluster_exclusive_sum(float x, float& total, ClusterCtx& c) {
  float* mine = reinterpret_cast<float*>(c.sh.xch[c.xch_phase]);
  c.xch_phase ^= 1;
  if (threadIdx.x == 0) *mine = x;
  c.cluster.sync();
  const int rank = int(c.cluster.block_rank());
  float before = 0.f, acc = 0.f;
  for (int k = 0; k < c.ctas; ++k) {
    if (k == rank) before = acc;
    acc += *c.cluster.map_shared_rank(mine, k);
  }
  total = acc;
  return before;
}

// Exclusive prefix of x over the CTA's threads in thread order; total = the CTA's sum.
__device__ float block_exclusive_scan(float x, float& total, SampleShared& sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float inc = x;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const float y = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += y;
  }
  float excl = __shfl_up_sync(0xffffffffu, inc, 1);
  if (lane == 0) excl = 0.f;
  if (lane == 31) sh.scan[warp] = inc;
  __syncthreads();
  float before = 0.f, all = 0.f;
  for (int w = 0; w < SAMPLE_THREADS / 32; ++w) {
    if (w == warp) before = all;
    all += sh.scan[w];
  }
  __syncthreads();
  total = all;
  return before + excl;
}

// Sorts keys[0, n) descending in place, n a power of two <= 2 SAMPLE_THREADS (bitonic network: log2(n) (log2(n)
// + 1) / 2 steps, one compare-exchange a thread a step). Every thread of the CTA calls it (it syncs the CTA).
__device__ void bitonic_sort_desc(unsigned* keys, int n) {
  const int t = int(threadIdx.x);
  for (int size = 2; size <= n; size <<= 1)
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      if (t < n / 2) {
        const int i = 2 * t - (t & (stride - 1)), j = i + stride;  // i has bit `stride` clear
        const unsigned a = keys[i], b = keys[j];
        if ((a < b) == ((i & size) == 0)) keys[i] = b, keys[j] = a;  // descending runs where i & size == 0
      }
      __syncthreads();
    }
}

// Order-preserving map of a float onto u32 (larger float -> larger key), and back.
__device__ __forceinline__ unsigned float_key(float f) {
  const unsigned u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_float(unsigned k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// Warp 0 picks the radix bin where the mass counted from the top crosses sh.sel_need, given the
// mass `above` of keys above the current prefix; writes sel_bin and the new sel_above.
__device__ void pick_bin(SampleShared& sh, u64 above, u64 need) {
  const int lane = threadIdx.x & 31;
  u64 mine[8], sum = 0;  // bins 255 - 8*lane - i, from the top
#pragma unroll
  for (int i = 0; i < 8; ++i) sum += (mine[i] = sh.merged[RADIX_BINS - 1 - 8 * lane - i]);
  u64 inc = sum;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const u64 y = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += y;
  }
  const unsigned crossing = __ballot_sync(0xffffffffu, above + inc >= need);
  // No crossing only with inconsistent inputs (NaN): take the lowest bin and keep everything.
  const int first = crossing ? __ffs(crossing) - 1 : 31;
  if (lane == first) {
    u64 acc = above + inc - sum;
    int bin = RADIX_BINS - 1 - 8 * lane - 7;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (acc + mine[i] >= need) {
        bin = RADIX_BINS - 1 - 8 * lane - i;
        break;
      }
      acc += mine[i];
    }
    sh.sel_bin = unsigned(bin);
    sh.sel_above = acc;
  }
}

// The largest key K with mass(key >= K) >= need and mass(key > K) < need over the cluster's
// elements; elem(v0, key[4], w[4]) fills ids v0..v0+3 and returns the mask of candidates among
// them. need_frac > 0: need = need_frac * (total candidate mass) instead. 4 passes of 8 bits.
// stop_at > 0 (unit weights): after any level at which the elements whose key, masked to the levels so far,
// is at least the prefix so far number at most stop_at, it returns that prefix with *mask_out = its mask (the
// levels' bits) instead: those elements are then a superset of the answer's, small enough to finish elsewhere.
// A full select sets *mask_out = ~0u.
// UNIT: every weight is 1 (top_k's counts): a bin's count stays below 2^32 (V <= 2^30), so the lanes of a warp
// that hit one bin add their count to the bin's low word in one native 32-bit shared atomic (the high word stays
// 0). A 64-bit shared atomicAdd is a compare-and-swap loop on sm_90 (ATOMS.CAST.SPIN.64): with the logits' top
// key bytes shared by most ids, the 16 warps' loops on the same few bins retried ~4 times an atomic, and the
// histogram passes were ~60% of a chat-sampled step's sampler (ncu, eighteenth session). Weighted selects
// (top_p's mass in 2^-40 fixed point, w <= 2^40) group the same way and add a group's sum in one 64-bit atomic.
template <bool UNIT, class Elem>
__device__ unsigned radix_select(Elem elem, int lo, int hi, u64 need, double need_frac, ClusterCtx& c,
                                 u64 stop_at = 0, unsigned* mask_out = nullptr) {
  SampleShared& sh = c.sh;
  unsigned prefix = 0, mask = 0;
  u64 above = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    u64* hist = sh.hist[c.hist_phase];
    c.hist_phase ^= 1;
    for (int b = threadIdx.x; b < RADIX_BINS; b += SAMPLE_THREADS) hist[b] = 0;
    __syncthreads();
#pragma unroll 2
    for (int v0 = lo + 4 * int(threadIdx.x); v0 < hi; v0 += SAMPLE_TILE) {
      unsigned key[4];
      u64 w[4];
      const unsigned is_candidate = elem(v0, key, w);
      const unsigned active = __activemask(), lane = threadIdx.x & 31u;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const bool take = (is_candidate >> k & 1u) && w[k] != 0 && (key[k] & mask) == prefix;
        const unsigned bin = (key[k] >> shift) & 255u;
        if constexpr (UNIT) {
          // the lanes of a warp that hit one bin add their count in one atomic (logits share their top key
          // bytes, so otherwise ~all of a warp's atomics go to one or two bins and serialise); the bins are
          // integer sums, so the histogram is the same whatever the grouping
          const unsigned peers = __match_any_sync(active, take ? bin : RADIX_BINS);
          if (take && (peers & ((1u << lane) - 1u)) == 0)
            atomicAdd(reinterpret_cast<unsigned*>(&hist[bin]), unsigned(__popc(peers)));  // the low word
        } else {
          // the same grouping for weights w <= 2^40 (e <= 1 in 2^-40 fixed point): the group's sum as two exact
          // 32-bit reductions (w's low 24 bits: < 2^29 over 32 lanes; its high bits: < 2^22), one 64-bit atomic
          const unsigned peers = __match_any_sync(active, take ? bin : RADIX_BINS);
          const unsigned lo = __reduce_add_sync(peers, take ? unsigned(w[k] & 0xFFFFFFu) : 0u);
          const unsigned hi = __reduce_add_sync(peers, take ? unsigned(w[k] >> 24) : 0u);
          if (take && (peers & ((1u << lane) - 1u)) == 0) atomicAdd(&hist[bin], (u64(hi) << 24) + lo);
        }
      }
    }
    c.cluster.sync();
    for (int b = threadIdx.x; b < RADIX_BINS; b += SAMPLE_THREADS) {
      u64 m = 0;
      for (int r = 0; r < c.ctas; ++r) m += c.cluster.map_shared_rank(hist, r)[b];
      sh.merged[b] = m;
    }
    __syncthreads();
    if (threadIdx.x < 32) {
      if (shift == 24 && need_frac > 0.0) {
        u64 total = 0;
        for (int b = threadIdx.x; b < RADIX_BINS; b += 32) total += sh.merged[b];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
        need = u64(need_frac * double(total));
        if (need == 0) need = 1;
      }
      pick_bin(sh, above, need);
    }
    __syncthreads();
    prefix |= sh.sel_bin << shift;
    mask |= 255u << shift;
    above = sh.sel_above;
    const u64 at_or_above = above + sh.merged[sh.sel_bin];  // the elements with (key & mask) >= prefix
    __syncthreads();  // sel_* and merged are rewritten by the next level
    if (stop_at > 0 && shift > 0 && at_or_above <= stop_at) break;
  }
  if (mask_out) *mask_out = mask;
  return prefix;
}

}  // namespace lily::cuda
