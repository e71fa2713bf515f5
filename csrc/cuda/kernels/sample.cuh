// The sampler (device code only; launcher in sample.cu): the canonical algorithm of
// docs/sampling.md, matching cpu/sample.cpp, on one cluster of SAMPLE_CTAS (16 for a draw; 8 for greedy with
// logprobs and where the device refuses that non-portable size; greedy without logprobs: greedy_kernel in
// sample_greedy.cuh, no cluster) CTAs x SAMPLE_THREADS
// (512 threads leave 128 registers, no spills).
//   z_v = penalise(l_v) [/ T];  greedy: argmax z;  else top_k threshold (radix select on z keys: its first level,
//   FINE_BITS wide, counted in the argmax pass, since a key is monotone in z / T and needs no max; usually the ids
//   at or above that level's prefix already fit the candidate list);
//   with top_k and at most SAMPLE_CANDIDATES kept ids (the candidate path): those ids gathered on rank 0,
//   then min_p, top_p and the draw on them in the CPU's f32 steps (the other CTAs leave once rank 0 has read
//   their lists); otherwise over all ids:
//   e_v = exp(z_v - max z), min_p, top_p threshold (radix select on e keys weighted by e in 2^-40
//   fixed point), u = uniform01(seed, step), chosen = first kept id with prefix(e) > u * sum(e).
// logits, counts, seen [V] (f32, i32, i32; 16-byte aligned); token [1]; logprob ids/values [21].
// CTA r owns ids [r*chunk, (r+1)*chunk), chunk a multiple of 4; in each tile of SAMPLE_TILE ids
// thread t owns the 4 consecutive ids 4t..4t+3 (one 16-byte load). Scores are recomputed from the logits
// (L2-resident after the first pass) in each pass rather than stored. Every reduction is in a
// fixed order (sample_cluster.cuh), so the draw is reproducible; greedy is bit-equal to the CPU
// (same IEEE division/multiply/fma on the scores, no sums). Rank 0 thread 0 writes the state last.
// Shared memory (static, SampleShared): reduction slots and exchange buffers, two 256-bin radix histograms and
// their merge (u64), the 4,096-bin fine histogram (u32, 16 KB), the candidate lists (~24 KB): ~47 KB of 48.
#pragma once
#include "../../ops/sample_rng.h"
#include "sample_cluster.cuh"

namespace lily::cuda {

using ops::uniform01;

struct SampleParams {
  const float* logits;    // [V]
  int32_t* counts;        // [V]
  int32_t* seen;          // [V]
  int32_t* token;         // [1]
  int32_t* logprob_ids;   // [1 + MAX_LOGPROBS]
  float* logprob_values;  // [1 + MAX_LOGPROBS]
  int V, top_k, num_logprobs, max_logprobs;
  float temperature, top_p, min_p, presence, frequency, repetition;
  bool has_penalty;
  u64 seed, step;
};

// Raw logits and penalised scores of ids v0..v0+3 (ids >= hi read as -inf; callers skip them).
struct Quad {
  float l[4], z[4];
};

// Raw logits of ids v0..v0+3; ids >= hi read as -inf.
__device__ __forceinline__ void load_logits(const SampleParams& p, int v0, int hi, float l[4]) {
  if (v0 + 4 <= hi) {
    const float4 f = *reinterpret_cast<const float4*>(p.logits + v0);
    l[0] = f.x, l[1] = f.y, l[2] = f.z, l[3] = f.w;
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) l[k] = v0 + k < hi ? p.logits[v0 + k] : -INFINITY;
  }
}

__device__ __forceinline__ Quad load_quad(const SampleParams& p, int v0, int hi) {
  Quad q;
  const bool full = v0 + 4 <= hi;
  load_logits(p, v0, hi, q.l);
#pragma unroll
  for (int k = 0; k < 4; ++k) q.z[k] = q.l[k];
  if (!p.has_penalty) return q;
  int c[4] = {0, 0, 0, 0}, s[4] = {0, 0, 0, 0};
  if (full) {
    const int4 c4 = *reinterpret_cast<const int4*>(p.counts + v0), s4 = *reinterpret_cast<const int4*>(p.seen + v0);
    c[0] = c4.x, c[1] = c4.y, c[2] = c4.z, c[3] = c4.w, s[0] = s4.x, s[1] = s4.y, s[2] = s4.z, s[3] = s4.w;
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (v0 + k < hi) c[k] = p.counts[v0 + k], s[k] = p.seen[v0 + k];
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {  // explicit roundings: no contraction, the CPU's exact steps
    float z = q.z[k];
    if (p.repetition != 1.f && s[k]) z = z > 0.f ? __fdiv_rn(z, p.repetition) : __fmul_rn(z, p.repetition);
    if (c[k] > 0) z = __fsub_rn(z, __fmaf_rn(p.frequency, __int2float_rn(c[k]), p.presence));
    q.z[k] = z;
  }
  return q;
}

struct Keep {  // the thresholds found so far; an id is kept when it passes all of them
  float m, z_min = -INFINITY, e_min = 0.f;
};

__device__ __forceinline__ float scaled(const SampleParams& p, float z) { return __fdiv_rn(z, p.temperature); }
__device__ __forceinline__ float weight_e(float zt, float m) { return zt == m ? 1.f : expf(zt - m); }
// top_k's radix key of a score: -0 counted as +0, so that key order is the CPU's float order (-0 == +0)
__device__ __forceinline__ unsigned score_key(float zt) { return float_key(zt + 0.f); }

// The candidate path's first half, in every CTA: its ids v in [lo, hi) with z_v / T >= z_min (top_k's threshold:
// mask = ~0u) or, when top_k's select stopped early (mask: its levels' bits), with (score_key(z_v / T) & mask) >=
// prefix (a superset of top_k's ids), in ascending order, to sh.cand_id / cand_z (the first SAMPLE_CANDIDATES of
// them); returns how many there are. A tile's ids take their places by a block scan of the threads' counts
// (exact in f32: < 2^24).
__device__ int compact_kept(const SampleParams& p, int lo, int hi, float z_min, unsigned prefix, unsigned mask,
                            SampleShared& sh) {
  int base = 0;
  for (int tile = lo; tile < hi; tile += SAMPLE_TILE) {
    const int v0 = tile + 4 * int(threadIdx.x);
    const Quad q = load_quad(p, v0, hi);
    float zt[4];
    unsigned kept = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      zt[k] = scaled(p, q.z[k]);
      const bool in = mask == ~0u ? zt[k] >= z_min : (score_key(zt[k]) & mask) >= prefix;
      if (v0 + k < hi && in) kept |= 1u << k;
    }
    float tile_total;
    int at = base + int(block_exclusive_scan(float(__popc(kept)), tile_total, sh));
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (kept >> k & 1u) {
        if (at < SAMPLE_CANDIDATES) sh.cand_id[at] = v0 + k, sh.cand_z[at] = zt[k];
        ++at;
      }
    base += int(tile_total);
  }
  return base;
}

// The candidate path's second half: steps 6-8 and the draw on the n <= SAMPLE_CANDIDATES ids top_k kept (every
// CTA's list in sh.cand_*, published before a cluster barrier), by rank 0, in the CPU reference's f32 steps and
// orders (cpu/sample.cpp): e = exp(z / T - m); min_p; top_p on the kept e sorted descending, W summed in id
// order; then W' and the inverse CDF in id order, one thread. top_k > 0: the list is a superset of top_k's
// ids (its select stopped early), and top_k's threshold is found here first: the k-th largest key of the list
// (bitonic sort of the keys; the radix select's answer, exactly), then z / T >= key_float(that key). The list is
// then compacted, in id order, to the ids top_k keeps (~k), and min_p / top_p / the draw run over those only.
// The other ranks only wait for rank 0's gather (a cluster barrier: their lists must live until it is read) and
// return -1; so does every thread of rank 0 but thread 0, which returns the chosen id.
// Compared with the full passes below (4 radix levels for top_p, 2 passes for the CDF, each over all V ids),
// this reads the ~k kept ids; its sums are the CPU's, so CPU and GPU now differ only by expf's ulps.
__device__ int draw_candidates(const SampleParams& p, const Keep& keep, int n, int top_k, ClusterCtx& c) {
  SampleShared& sh = c.sh;
  const int tid = int(threadIdx.x);
  int chosen = -1;
  const bool gatherer = c.cluster.block_rank() == 0;
  if (gatherer) {  // rank order is id order: CTA r owns the r-th id range, its list goes to cand_off[r]
    if (tid < c.ctas) sh.cand_off[tid + 1] = c.cluster.map_shared_rank(&sh, tid)->cand_n;
    __syncthreads();
    if (tid == 0) {
      sh.cand_off[0] = 0;
      for (int r = 0; r < c.ctas; ++r) sh.cand_off[r + 1] += sh.cand_off[r];
    }
    __syncthreads();
    for (int i = tid; i < n; i += SAMPLE_THREADS) {  // every load independent of the others
      int r = 0;
      while (sh.cand_off[r + 1] <= i) ++r;
      const SampleShared* peer = c.cluster.map_shared_rank(&sh, r);
      sh.all_id[i] = peer->cand_id[i - sh.cand_off[r]], sh.all_e[i] = peer->cand_z[i - sh.cand_off[r]];
    }
  }
  c.sync();  // the peers' lists are read (and rank 0's gathered list visible to its threads): the peers may leave
  if (!gatherer) return -1;
  float z_min = -INFINITY;  // the list is top_k's kept ids already, or top_k finishes here
  if (top_k > 0) {
    int np = 2;  // the sort's width: a power of two >= n (pads: key 0, below every score's key)
    while (np < n) np <<= 1;
    for (int i = tid; i < np; i += SAMPLE_THREADS) sh.sort_key[i] = i < n ? score_key(sh.all_e[i]) : 0u;
    __syncthreads();
    bitonic_sort_desc(sh.sort_key, np);
    z_min = key_float(sh.sort_key[max(0, min(top_k, n) - 1)]);  // (top_k <= n: the select counted them)
  }
  __syncthreads();
  // Compaction to the kept ids, id order kept: thread t takes entries 2t, 2t + 1 (n <= 2 SAMPLE_THREADS) and
  // places them by a block scan of its count; every read precedes the scan's barriers, every write follows.
  static_assert(SAMPLE_CANDIDATES <= 2 * SAMPLE_THREADS, "two candidates a thread");
  float e2[2];
  int id2[2], in2 = 0;
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int i = 2 * tid + u;
    const float zt = i < n ? sh.all_e[i] : -INFINITY;
    id2[u] = i < n ? sh.all_id[i] : -1;
    e2[u] = weight_e(zt, keep.m);
    if (i < n && zt >= z_min) in2 |= 1 << u;
  }
  float total;
  int at = int(block_exclusive_scan(float(__popc(in2)), total, sh));
#pragma unroll
  for (int u = 0; u < 2; ++u)
    if (in2 >> u & 1) sh.all_e[at] = e2[u], sh.all_id[at] = id2[u], ++at;
  n = int(total);
  __syncthreads();
  const float e_min = keep.e_min;  // min_p (0: every e passes)
  float tau = 0.f;                 // top_p's threshold (0: every e passes)
  if (p.top_p < 1.f) {
    // the kept e in descending order: e_i goes to its rank (larger values first, ties by position)
    for (int i = tid; i < n; i += SAMPLE_THREADS) {
      const float x = sh.all_e[i];
      if (!(x >= e_min)) continue;
      int rank = 0;
      for (int j = 0; j < n; ++j) {
        const float y = sh.all_e[j];
        rank += y >= e_min && (y > x || (y == x && j < i));
      }
      sh.sorted_e[rank] = x;
    }
    __syncthreads();
    if (tid == 0) {
      float W = 0.f;
      int kept = 0;
      for (int i = 0; i < n; ++i)
        if (sh.all_e[i] >= e_min) W += sh.all_e[i], ++kept;
      const float need = p.top_p * W;
      float t = kept ? sh.sorted_e[kept - 1] : 0.f, cum = 0.f;  // never reaching `need`: keep all
      for (int r = 0; r < kept; ++r) {
        cum += sh.sorted_e[r];
        if (cum >= need) {
          t = sh.sorted_e[r];
          break;
        }
      }
      sh.tau = t;
    }
    __syncthreads();
    tau = sh.tau;
  }
  if (tid == 0) {
    float W = 0.f;
    for (int i = 0; i < n; ++i)
      if (sh.all_e[i] >= e_min && sh.all_e[i] >= tau) W += sh.all_e[i];
    const float target = uniform01(p.seed, p.step) * W;
    float cum = 0.f;
    int last = -1;
    for (int i = 0; i < n && chosen < 0; ++i) {
      const float e = sh.all_e[i];
      if (!(e >= e_min && e >= tau)) continue;
      cum += e;
      if (cum > target) chosen = sh.all_id[i];
      else if (e > 0.f) last = sh.all_id[i];  // never an id of zero mass
    }
    if (chosen < 0) chosen = last;
  }
  return chosen;
}

// The draw of steps 4-8 given m = max z / T and, with 0 < top_k < V, the fine histograms of top_k's keys (the
// argmax pass's, published by its cluster barrier); returns the chosen id in rank 0's thread 0 (on the full passes
// in every thread of the cluster).
__device__ int draw(const SampleParams& p, int lo, int hi, float m, ClusterCtx& c) {
  Keep keep{m};
  if (p.min_p > 0.f) keep.e_min = p.min_p;  // 7 (top_k's select reads z only)
  if (p.top_k > 0 && p.top_k < p.V) {  // 5
    auto by_score = [&](int v0, unsigned key[4], u64 w[4]) {
      const Quad q = load_quad(p, v0, hi);
      unsigned is_candidate = 0;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        key[k] = score_key(scaled(p, q.z[k])), w[k] = 1;
        if (v0 + k < hi) is_candidate |= 1u << k;
      }
      return is_candidate;
    };
    // The select stops after the level at which the ids at or above its prefix fit the candidate list (with a
    // model's logits usually the first, FINE_BITS wide and counted in the argmax pass: sign, exponent and 3
    // mantissa bits, and few ids share the top bins; tests/test_sample_select_model.py); top_k then finishes on
    // that list. Otherwise 8-bit levels follow, each a pass, and with ties (mask ~0u) it is exact here.
    u64 at_or_above;
    const RadixState fine = select_fine(u64(p.top_k), c, at_or_above);
    unsigned prefix = fine.prefix, mask = fine.mask;
    if (at_or_above > SAMPLE_CANDIDATES)
      prefix = radix_select<true>(by_score, lo, hi, u64(p.top_k), 0.0, c, SAMPLE_CANDIDATES, &mask, fine);
    const bool exact = mask == ~0u;
    if (exact) {
      const float t = key_float(prefix);
      keep.z_min = isnan(t) ? -INFINITY : t;
    }
    const int mine = compact_kept(p, lo, hi, keep.z_min, prefix, mask, c.sh);  // the same in every thread of the CTA
    if (threadIdx.x == 0) c.sh.cand_n = mine;
    float kept;  // over the cluster; the same in every thread, so the branch is uniform
    cluster_exclusive_sum(float(mine), kept, c);  // its barrier publishes every CTA's list
    if (kept <= float(SAMPLE_CANDIDATES))  // always when !exact: the select counted them
      return draw_candidates(p, keep, int(kept), exact ? 0 : p.top_k, c);
  }
  if (p.top_p < 1.f) {                       // 8: weights in 2^-40 fixed point, integer atomics
    auto by_mass = [&](int v0, unsigned key[4], u64 w[4]) {
      const Quad q = load_quad(p, v0, hi);
      unsigned is_candidate = 0;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float zt = scaled(p, q.z[k]), e = weight_e(zt, keep.m);
        key[k] = float_key(e), w[k] = __float2ull_rz(e * 0x1p40f);
        if (v0 + k < hi && zt >= keep.z_min && e >= keep.e_min) is_candidate |= 1u << k;
      }
      return is_candidate;
    };
    const float tau = key_float(radix_select<false>(by_mass, lo, hi, 0, double(p.top_p), c));
    if (!isnan(tau)) keep.e_min = fmaxf(keep.e_min, tau);
  }
  // Inverse CDF over kept ids in id order: the CTA's mass, then each CTA scans its own ids.
  float run = 0.f;
  int last = -1;
  for (int tile = lo; tile < hi; tile += SAMPLE_TILE) {
    const int v0 = tile + 4 * int(threadIdx.x);
    const Quad q = load_quad(p, v0, hi);
    float mine = 0.f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float zt = scaled(p, q.z[k]), e = weight_e(zt, keep.m);
      if (v0 + k < hi && zt >= keep.z_min && e >= keep.e_min) {
        mine += e;
        if (e > 0.f) last = v0 + k;  // the fallback never picks an id of zero mass (a masked -inf logit)
      }
    }
    float tile_total;
    block_exclusive_scan(mine, tile_total, c.sh);
    run += tile_total;
  }
  float W;
  const float offset = cluster_exclusive_sum(run, W, c);
  const float target = uniform01(p.seed, p.step) * W;
  int found = INT_MAX;
  run = offset;
  for (int tile = lo; tile < hi; tile += SAMPLE_TILE) {
    const int v0 = tile + 4 * int(threadIdx.x);
    const Quad q = load_quad(p, v0, hi);
    float e[4], mine = 0.f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float zt = scaled(p, q.z[k]);
      e[k] = weight_e(zt, keep.m);
      if (!(v0 + k < hi && zt >= keep.z_min && e[k] >= keep.e_min)) e[k] = -1.f;
      else mine += e[k];
    }
    float tile_total;
    float prefix = run + block_exclusive_scan(mine, tile_total, c.sh);
    int hit = INT_MAX;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (e[k] < 0.f) continue;
      prefix += e[k];
      if (prefix > target && hit == INT_MAX) hit = v0 + k;
    }
    found = block_reduce(hit, MinI{}, c.sh);
    if (found != INT_MAX) break;
    run += tile_total;
  }
  found = cluster_reduce(found, MinI{}, c);
  last = cluster_reduce(last, MaxI{}, c);
  return found != INT_MAX ? found : last;
}

// The argmax pass over the CTA's ids: step 0 (any NaN logit), the argmax of the scores z and, for logprobs, the
// raw logits' log-sum-exp. FINE (a draw with 0 < top_k < V): also top_k's first radix level, the histogram of the
// top FINE_BITS bits of score_key(z / T) into sh.fine, and its sums by FINE_PER_BIN (an 8-bit level) into
// sh.hist[c.hist_phase]; the cluster reduction after the pass publishes both (select_fine reads them).
template <bool FINE>
__device__ Best first_pass(const SampleParams& p, int lo, int hi, bool want_lp, Lse& lse, ClusterCtx& c) {
  Best best{{-INFINITY, INT_MAX}, 0};
  if constexpr (FINE) {
    for (int b = threadIdx.x; b < FINE_BINS; b += SAMPLE_THREADS) c.sh.fine[b] = 0;
    __syncthreads();
  }
#pragma unroll 4
  for (int v0 = lo + 4 * int(threadIdx.x); v0 < hi; v0 += SAMPLE_TILE) {
    const Quad q = load_quad(p, v0, hi);
    const unsigned active = FINE ? __activemask() : 0u;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const bool in = v0 + k < hi;
      if (in) {
        if (isnan(q.l[k])) best.nan = 1;
        best.a = MaxFirst{}(best.a, ArgMax{q.z[k], v0 + k});
        if (want_lp) lse = lse_add(lse, q.l[k]);
      }
      if constexpr (FINE) {
        const unsigned bin = score_key(scaled(p, q.z[k])) >> (32 - FINE_BITS);
        count_unit(c.sh.fine + bin, bin, in, active);
      }
    }
  }
  if constexpr (FINE) {
    __syncthreads();
    u64* coarse = c.sh.hist[c.hist_phase];
    c.hist_phase ^= 1;
    for (int b = threadIdx.x; b < RADIX_BINS; b += SAMPLE_THREADS) {
      unsigned n = 0;  // an integer sum: any order; rotated so that a warp's reads spread over the banks
      for (int f = 0; f < FINE_PER_BIN; ++f) n += c.sh.fine[b * FINE_PER_BIN + ((f + b) & (FINE_PER_BIN - 1))];
      coarse[b] = n;
    }
  }
  return best;
}

// Launched as one cluster of SAMPLE_CTAS or SAMPLE_CTAS_PORTABLE CTAs (its shape chosen at launch, sample.cu).
__global__ void __launch_bounds__(SAMPLE_THREADS, 1) sample_kernel(SampleParams p) {
  __shared__ SampleShared sh;
  ClusterCtx c{cg::this_cluster(), sh, int(cg::this_cluster().num_blocks())};
  const int rank = int(c.cluster.block_rank());
  const int chunk = (p.V + c.ctas * 4 - 1) / (c.ctas * 4) * 4;
  const int lo = min(p.V, rank * chunk), hi = min(p.V, lo + chunk);
  const bool want_lp = p.num_logprobs >= 0;
  const bool draws = p.temperature != 0.f, fine = draws && p.top_k > 0 && p.top_k < p.V;
  Lse lse{-INFINITY, 0.f};  // of the raw logits
  // The same value in every thread of the cluster, so the branches below stay uniform.
  const Best best = cluster_reduce(fine ? first_pass<true>(p, lo, hi, want_lp, lse, c)
                                        : first_pass<false>(p, lo, hi, want_lp, lse, c), BestMerge{}, c);
  if (best.nan) {  // NaN logits choose nothing: token -1, counts/seen/logprobs untouched (the host raises)
    if (rank == 0 && threadIdx.x == 0) p.token[0] = -1;
    c.sync();
    return;
  }
  int chosen = best.a.id;  // read only by rank 0's thread 0 (the writer), where it is always the chosen id
  if (draws) chosen = draw(p, lo, hi, scaled(p, best.a.v), c);
  if (chosen < 0 || chosen >= p.V) chosen = 0;  // never out of range, whatever the logits
  if (want_lp) {  // step 1: the chosen id's logprob, then the top n raw logits by repeated argmax
    lse = cluster_reduce(lse, LseMerge{}, c);
    const float log_z = lse.m + logf(lse.s);
    const bool writer = rank == 0 && threadIdx.x == 0;  // logprob arrays are outputs only
    if (writer) p.logprob_ids[0] = chosen, p.logprob_values[0] = p.logits[chosen] - log_z;
    ArgMax prev{INFINITY, -1};
    for (int i = 1; i <= p.max_logprobs; ++i) {
      if (i <= p.num_logprobs) {  // the same in every thread: each CTA runs the same reductions
        ArgMax b{-INFINITY, INT_MAX};
#pragma unroll 4
        for (int v0 = lo + 4 * int(threadIdx.x); v0 < hi; v0 += SAMPLE_TILE) {
          float l[4];
          load_logits(p, v0, hi, l);
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const int v = v0 + k;
            if (v < hi && (l[k] < prev.v || (l[k] == prev.v && v > prev.id))) b = MaxFirst{}(b, ArgMax{l[k], v});
          }
        }
        prev = cluster_reduce(b, MaxFirst{}, c);
      }
      const bool has = i <= p.num_logprobs && prev.id != INT_MAX;
      if (writer) p.logprob_ids[i] = has ? prev.id : -1, p.logprob_values[i] = has ? prev.v - log_z : -INFINITY;
    }
  }
  if (rank == 0 && threadIdx.x == 0) {  // after the last cluster barrier: every CTA is done reading
    p.token[0] = chosen;
    p.counts[chosen] += 1;
    p.seen[chosen] = 1;
  }
  // no CTA leaves while another may still read its shared memory (none after the candidate path's last barrier)
  if (c.peers_reading) c.sync();
}

// seen[ids[i]] = 1; ids outside [0, V) are ignored (the CPU op rejects them).
__global__ void mark_seen_kernel(const int32_t* ids, int n, int32_t* seen, int V) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n && ids[i] >= 0 && ids[i] < V) seen[ids[i]] = 1;
}

// pos += T (T = -1: a discarded decode step, Session::decode_discard).
__global__ void advance_position_kernel(int32_t* pos, int T) { pos[0] += T; }

}  // namespace lily::cuda
