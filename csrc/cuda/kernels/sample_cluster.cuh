// Fixed-order reductions, scans and a radix select over one thread-block cluster, the building
// blocks of the sampler (kernels/sample.cuh). Device code only.
// Every CTA of the cluster reduces its threads (warp butterflies, then the warp partials in warp
// order), publishes its partial in its own shared memory, and after a cluster barrier each CTA
// combines the CTAs' partials in rank order through distributed shared memory (the CTAs' partials loaded
// together, then combined in rank order: one remote latency, not one a CTA). So every thread of
// the cluster gets the same bits, run after run. Exchange buffers are double-buffered: a buffer is
// rewritten only after a later cluster barrier, when every CTA has finished reading it. A CTA leaves only
// after a cluster barrier that follows the last remote read of the cluster (ClusterCtx::peers_reading).
#pragma once
#include <cooperative_groups.h>

#include "common.cuh"

namespace lily::cuda {

namespace cg = cooperative_groups;

// The cluster: for a draw SAMPLE_CTAS CTAs where the device grants that non-portable size (sample.cu asks once),
// else (and for greedy) SAMPLE_CTAS_PORTABLE. Each pass over the logits is split over the cluster's CTAs, so the
// wider cluster halves a pass (a chat-sampled step usually runs 2: the argmax with top_k's first radix level, the
// compaction; top_p alone 7).
constexpr int SAMPLE_CTAS = 16, SAMPLE_CTAS_PORTABLE = 8;
constexpr int SAMPLE_THREADS = 512;
constexpr int SAMPLE_TILE = 4 * SAMPLE_THREADS;  // ids per CTA per tile: 4 consecutive per thread
constexpr int RADIX_BINS = 256;                  // 8 bits per radix level, 4 levels
// top_k's first level: the top FINE_BITS bits of the key (sign, exponent, 3 mantissa bits: 1/8 of an octave a
// bin), counted in the argmax pass; a radix bin of the 8-bit levels is the sum of FINE_PER_BIN of them
constexpr int FINE_BITS = 12, FINE_BINS = 1 << FINE_BITS, FINE_PER_BIN = FINE_BINS / RADIX_BINS;
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
struct Best {  // the argmax pass's result: the largest score, and whether any logit is NaN
  ArgMax a;
  int nan;
};

struct SampleShared {
  alignas(16) unsigned char slots[32][16];  // per-warp partials of a block reduction
  alignas(16) unsigned char xch[2][16];     // this CTA's partial of a cluster reduction
  u64 hist[2][RADIX_BINS];                  // this CTA's radix histogram
  u64 merged[RADIX_BINS];                   // the cluster's histogram
  unsigned fine[FINE_BINS];                 // this CTA's FINE_BITS histogram of top_k's keys (the argmax pass)
  unsigned fine_merged[FINE_PER_BIN];       // the cluster's counts of the fine bins in the chosen radix bin
  int cand_off[SAMPLE_CTAS + 1];            // rank 0: where each CTA's candidates go in all_id (rank order)
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
  // set by every exchange (a CTA reads its peers' shared memory, and they its), cleared by a cluster barrier;
  // the same in every CTA (they run the same exchanges): the kernel's exit barrier runs only when it is set
  bool peers_reading = false;
  __device__ void sync() {
    cluster.sync();
    peers_reading = false;
  }
  // peer k's copy of this CTA's `x`, for k in [0, SAMPLE_CTAS): ranks past the cluster read the last one (loaded
  // unconditionally, so an unrolled loop issues every load before the first use; callers skip k >= ctas)
  template <class T>
  __device__ T* peer(T* x, int k) {
    return cluster.map_shared_rank(x, min(k, ctas - 1));
  }
};

__device__ __forceinline__ float shfl_xor(float v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }
__device__ __forceinline__ int shfl_xor(int v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }
__device__ __forceinline__ ArgMax shfl_xor(ArgMax v, int o) { return {shfl_xor(v.v, o), shfl_xor(v.id, o)}; }
__device__ __forceinline__ Lse shfl_xor(Lse v, int o) { return {shfl_xor(v.m, o), shfl_xor(v.s, o)}; }
__device__ __forceinline__ Best shfl_xor(Best v, int o) { return {shfl_xor(v.a, o), shfl_xor(v.nan, o)}; }

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
struct BestMerge {
  __device__ Best operator()(Best a, Best b) const { return {MaxFirst{}(a.a, b.a), max(a.nan, b.nan)}; }
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

// The warp's values folded by a butterfly (op commutative: every lane gets the same bits).
template <class T, class Op>
__device__ __forceinline__ T warp_reduce(T v, Op op) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, shfl_xor(v, o));
  return v;
}

template <class T, class Op>
__device__ T block_reduce(T v, Op op, SampleShared& sh) {
  v = warp_reduce(v, op);
  if ((threadIdx.x & 31) == 0) *reinterpret_cast<T*>(sh.slots[threadIdx.x >> 5]) = v;
  __syncthreads();
  T r = *reinterpret_cast<T*>(sh.slots[0]);
  for (int w = 1; w < SAMPLE_THREADS / 32; ++w) r = op(r, *reinterpret_cast<T*>(sh.slots[w]));
  __syncthreads();  // the slots are free for the next reduction
  return r;
}

// The cluster's copies of this CTA's *x (each CTA's own value at the same shared address) folded in rank order:
// every peer's load issued before the first use (one remote latency, not one a CTA). The caller sets
// c.peers_reading (it may fold several elements before it does).
template <class T, class Op>
__device__ __forceinline__ T fold_peers(T* x, Op op, ClusterCtx& c) {
  T part[SAMPLE_CTAS];
#pragma unroll
  for (int k = 0; k < SAMPLE_CTAS; ++k) part[k] = *c.peer(x, k);
  T r = part[0];
#pragma unroll
  for (int k = 1; k < SAMPLE_CTAS; ++k)
    if (k < c.ctas) r = op(r, part[k]);
  return r;
}
struct AddInt {  // integer counts: any order gives the same sum
  template <class T>
  __device__ T operator()(T a, T b) const { return a + b; }
};

template <class T, class Op>
__device__ T cluster_reduce(T v, Op op, ClusterCtx& c) {
  v = block_reduce(v, op, c.sh);
  T* mine = reinterpret_cast<T*>(c.sh.xch[c.xch_phase]);
  c.xch_phase ^= 1;
  if (threadIdx.x == 0) *mine = v;
  c.sync();
  const T r = fold_peers(mine, op, c);
  c.peers_reading = true;
  return r;
}

// The CTAs' values x_r in rank order: returns sum_{r < rank} x_r and sets total = sum_r x_r,
// both summed left to right (so total extends every CTA's prefix).
__device__ float cluster_exclusive_sum(float x, float& total, ClusterCtx& c) {
  float* mine = reinterpret_cast<float*>(c.sh.xch[c.xch_phase]);
  c.xch_phase ^= 1;
  if (threadIdx.x == 0) *mine = x;
  c.sync();
  float part[SAMPLE_CTAS];
#pragma unroll
  for (int k = 0; k < SAMPLE_CTAS; ++k) part[k] = *c.peer(mine, k);
  c.peers_reading = true;
  const int rank = int(c.cluster.block_rank());
  float before = 0.f, acc = 0.f;
#pragma unroll
  for (int k = 0; k < SAMPLE_CTAS; ++k) {
    if (k == rank) before = acc;
    if (k < c.ctas) acc += part[k];
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

// Unit counts into a shared histogram: every lane of `active` with `take` adds 1 to the 32-bit counter `word` of
// its `bin`; the lanes of the warp that hit one bin add their count in one native 32-bit shared atomic (logits share
// their top key bits, so otherwise ~all of a warp's atomics go to one or two bins and serialise). The bins are
// integer sums, so the histogram is the same whatever the grouping. Every lane of `active` calls it.
__device__ __forceinline__ void count_unit(unsigned* word, unsigned bin, bool take, unsigned active) {
  const unsigned peers = __match_any_sync(active, take ? bin : ~0u), lane = threadIdx.x & 31u;
  if (take && (peers & ((1u << lane) - 1u)) == 0) atomicAdd(word, unsigned(__popc(peers)));
}

// Where a radix select stands: the key bits fixed so far (prefix, under mask), the count of elements whose key is
// above them, and the shift of the next 8-bit level.
struct RadixState {
  unsigned prefix = 0, mask = 0;
  u64 above = 0;
  int shift = 24;
};

// Every CTA's sum over the cluster of its peers' hist[b] (a radix histogram), in rank order, into sh.merged.
__device__ __forceinline__ void merge_hist(u64* hist, ClusterCtx& c) {
  for (int b = threadIdx.x; b < RADIX_BINS; b += SAMPLE_THREADS) c.sh.merged[b] = fold_peers(hist + b, AddInt{}, c);
  c.peers_reading = true;
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
// them. need_frac > 0: need = need_frac * (total candidate mass) instead. 4 passes of 8 bits, or, from a state
// `start` (top_k after its FINE_BITS level, select_fine), 8-bit levels at start.shift, start.shift - 8, ..., 0
// (the last may overlap bits already fixed: they match the prefix, so its bins are the same).
// stop_at > 0 (unit weights): after any level at which the elements whose key, masked to the levels so far,
// is at least the prefix so far number at most stop_at, it returns that prefix with *mask_out = its mask (the
// levels' bits) instead: those elements are then a superset of the answer's, small enough to finish elsewhere.
// A full select sets *mask_out = ~0u.
// UNIT: every weight is 1 (top_k's counts): a bin's count stays below 2^32 (V <= 2^30), so the lanes of a warp
// that hit one bin add their count to the bin's low word in one native 32-bit shared atomic (count_unit; the high
// word stays 0). A 64-bit shared atomicAdd is a compare-and-swap loop on sm_90 (ATOMS.CAST.SPIN.64): with the logits' top
// key bytes shared by most ids, the 16 warps' loops on the same few bins retried ~4 times an atomic, and the
// histogram passes were ~60% of a chat-sampled step's sampler (ncu, eighteenth session). Weighted selects
// (top_p's mass in 2^-40 fixed point, w <= 2^40) group the same way and add a group's sum in one 64-bit atomic.
template <bool UNIT, class Elem>
__device__ unsigned radix_select(Elem elem, int lo, int hi, u64 need, double need_frac, ClusterCtx& c,
                                 u64 stop_at = 0, unsigned* mask_out = nullptr, RadixState start = {}) {
  SampleShared& sh = c.sh;
  unsigned prefix = start.prefix, mask = start.mask;
  u64 above = start.above;
  for (int shift = start.shift;; shift = max(shift - 8, 0)) {
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
          count_unit(reinterpret_cast<unsigned*>(&hist[bin]), bin, take, active);  // the low word
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
    c.sync();
    merge_hist(hist, c);
    __syncthreads();
    if (threadIdx.x < 32) {
      if (mask == 0 && need_frac > 0.0) {  // the first level
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
    if (shift == 0 || (stop_at > 0 && at_or_above <= stop_at)) break;
  }
  if (mask_out) *mask_out = mask;
  return prefix;
}

// top_k's first level, from the histograms of FINE_BITS bits that the argmax pass counted (sample.cuh): each CTA's
// sh.fine and their sums by FINE_PER_BIN, an 8-bit level, in sh.hist[phase] (c.hist_phase advanced past it), both
// published by that pass's cluster barrier. The radix bin where the count from the top reaches need (merged as
// radix_select merges a level), then the fine bin within it (its FINE_PER_BIN counts merged over the cluster):
// the state from which radix_select resumes (8-bit levels at shifts 12, 4, 0); at_or_above = the count of keys at or
// above the FINE_BITS prefix. Every thread of the cluster gets the same (integer sums).
__device__ RadixState select_fine(u64 need, ClusterCtx& c, u64& at_or_above) {
  SampleShared& sh = c.sh;
  merge_hist(sh.hist[c.hist_phase ^ 1], c);
  __syncthreads();
  if (threadIdx.x < 32) pick_bin(sh, 0, need);
  __syncthreads();
  const unsigned bin = sh.sel_bin;
  if (threadIdx.x < FINE_PER_BIN) {
    const int f = int(bin) * FINE_PER_BIN + int(threadIdx.x);
    sh.fine_merged[threadIdx.x] = fold_peers(sh.fine + f, AddInt{}, c);
  }
  __syncthreads();
  RadixState s;
  s.above = sh.sel_above;  // the radix bin's count reaches need, so one of its fine bins does
  int f = FINE_PER_BIN - 1;
  while (f > 0 && s.above + sh.fine_merged[f] < need) s.above += sh.fine_merged[f--];
  at_or_above = s.above + sh.fine_merged[f];
  s.prefix = (bin * FINE_PER_BIN + unsigned(f)) << (32 - FINE_BITS);
  s.mask = ~0u << (32 - FINE_BITS);
  s.shift = 32 - FINE_BITS - 8;
  __syncthreads();  // sel_* and fine_merged are rewritten later
  return s;
}

}  // namespace lily::cuda
