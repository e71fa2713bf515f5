// chain_lab's per-phase protocol pieces (benchmarks/chain_lab.cu, persist_chain_kernel; part 3): the count by
// one release, x staged by the producing phase (the consumers copy it) or by the consumers with every load in
// flight at once, and A's segments dealt evenly over the 8 warps ("flat"). Lab code, not the engine's. The index logic (ps_flat_*, ps_block_rows) is host-callable:
// tests/emu/chain_lab_emu.cu checks it on the CPU.
#pragma once
#include <cstdint>

#include "chain_lab_math.cuh"

namespace lily::cuda::lab {

// ---- the count: y stores, one CTA barrier, one release by thread 0 (flag PS_REL) -------------------------------
// Why it is correct (PTX ISA, chapter "Memory Consistency Model"): the storing threads' y (and staged-y)
// stores precede the CTA barrier (bar.sync) in program order, and the barrier synchronizes its participants at
// CTA scope, so in "Causality Order" (base causality order) those stores precede thread 0's
// red.release.gpu. "Release and Acquire Patterns": the red is a release pattern; the consumer's
// ld.acquire.gpu poll is an acquire pattern; both are morally strong (gpu scope, global memory). The poll
// reads the count's final value, which was written by a chain of atomic adds, one per CTA: in "Observation
// Order" each CTA's add precedes the read through that chain of atomics, so every CTA's release
// synchronizes with the poll, and by the "Causality" axiom every store that precedes a release in causality
// order is visible to the poll's thread; the consumer's bar.sync after the poll extends that to its other
// threads. Hence no per-thread fence: the release orders the whole CTA's stores (it is cumulative over the
// barrier). Today's form (a fence.sc.gpu by every storing thread, the barrier, a relaxed atomicAdd) orders the
// same writes with one SC fence per storing thread. SASS (nvcc 13, sm_90a): red.release.gpu is
// MEMBAR.ALL.GPU + REDG by thread 0; today's is MEMBAR.SC.GPU + CCTL.IVALL in each storing warp + ATOMG.
__device__ __forceinline__ void ps_red_release_add(unsigned* p, unsigned v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned ps_atom_release_add(unsigned* p, unsigned v) {  // timeline: waits for the old value
  unsigned old;
  asm volatile("atom.release.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
__device__ __forceinline__ unsigned ps_atom_acq_rel_add(unsigned* p, unsigned v) {
  unsigned old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

// ---- x staged by the producers (flag PS_XST) ----------------------------------------------------------------------
// The consumers' staged x (PsDigits: gemv_mma's digits) depends, per 64-value block u, on the block's max |x|
// (its exponent e_u: the digits are rint(x 2^(22 - E_u))) and on its sum xsum_u (mma_stage_octet's tree).
// Both are reductions over 64 consecutive rows of the producing phase's y, i.e. 4 of its 16-row tiles, and
// the tiles are dealt to CTAs as contiguous ranges (A: ~6 a CTA, so about two of a CTA's blocks straddle a
// neighbour; B: one tile a CTA, so every block is 4 CTAs'). No reduction over all of y is needed, but one
// over 4 tiles is: the cheapest correct form found is per block, "the last contributor stages it":
//   after its y stores and the CTA barrier, warp 0 of the producing CTA takes the (at most 3) blocks its rows
//   [r0, r1) touch; a block wholly inside is staged at once; for a shared block lane k adds its row count to
//   the block's counter with one atom.acq_rel.gpu (release: publishes this CTA's y rows, ordered before it by
//   the barrier; acquire: the last adder sees every other CTA's rows), and the adder that completes 64 rows
//   stages it. Staging: lanes 8k .. 8k + 7 the k-th staged block's octets (mma_stage_octet: the consumers'
//   own code, same lanes-per-block tree, so the bytes equal the consumers' staging bit for bit), own rows
//   from the CTA's shared copy of its y, other CTAs' rows from L2 (ld.global.cg), into the phase's staged
//   output (the consumers' shared-memory layout, PsDigits::x_bytes, its zero block left zero).
// The consumers of the next phase copy x_bytes(K) bytes instead of converting (ps_copy_x) after their poll.
// Cost moved onto the producer's critical path for a shared block: one L2 atomic round trip, then (the
// completing CTA) one L2 load round trip; counters zeroed per launch.

// Rows of 64-row block b inside [r0, r1).
__host__ __device__ inline int ps_block_rows(int r0, int r1, int b) {
  const int lo = r0 > 64 * b ? r0 : 64 * b, hi = r1 < 64 * b + 64 ? r1 : 64 * b + 64;
  return hi > lo ? hi - lo : 0;
}

// The blocks a CTA's rows [r0, r1) touch: [ps_block_first, + ps_block_count), at most 3 (r1 - r0 <= 128).
__host__ __device__ inline int ps_block_first(int r0) { return r0 / 64; }
__host__ __device__ inline int ps_block_count(int r0, int r1) { return r1 > r0 ? (r1 + 63) / 64 - r0 / 64 : 0; }
// Which of them lane group k (lanes 8k .. 8k + 7) stages: the k-th set bit of mine (bit i: block first + i is
// this CTA's to stage), or -1.
__host__ __device__ inline int ps_stage_pick(unsigned mine, int nb, int k) {
  for (int i = 0, seen = 0; i < nb; ++i)
    if (mine >> i & 1u) {
      if (seen == k) return i;
      ++seen;
    }
  return -1;
}

// 16-byte units of a staged x of K values (PsDigits' x_bytes, rounded up: K / 64 odd leaves 8 bytes over;
// buffers and shared memory for a copied x are allocated in whole units).
__host__ __device__ constexpr int ps_x_units(int K) { return int((16 + mma_x_bytes(K, 64) + 15) / 16); }

#ifdef __CUDACC__
// Warp 0 of a producing CTA (all 32 lanes): stages the blocks it completes of y (rows [r0, r1) its own, also in
// yown [r1 - r0] in shared memory; y [rows] global) into yst (PsDigits<1>'s layout for K = rows); blk: the
// phase's block counters. fence: the staging lanes fence their stores (today's count protocol).
__device__ inline void ps_stage_y(const float* yown, const float* y, int rows, int r0, int r1, uint8_t* yst,
                                  unsigned* blk, int lane, bool fence) {
  const int b0 = ps_block_first(r0), nb = ps_block_count(r0, r1);
  if (nb == 0) return;  // a CTA without tiles (uniform over the warp)
  bool mine = false;
  if (lane < nb) {
    const int b = b0 + lane, n = ps_block_rows(r0, r1, b);
    mine = n == 64 || ps_atom_acq_rel_add(&blk[b], unsigned(n)) + unsigned(n) == 64u;
  }
  __syncwarp();  // memory order among the lanes: lane k's acquire before the others' loads
  const unsigned m = __ballot_sync(0xffffffffu, mine);
  const int pick = ps_stage_pick(m, nb, lane >> 3), b = pick < 0 ? -1 : b0 + pick, j = lane & 7, octets = rows / 8;
  float v[8] = {};
  int o = octets;  // no block: mma_stage_octet stores nothing
  if (b >= 0) {
    const int row = 64 * b + 8 * j;  // an octet is all own rows or all another CTA's (tiles are 16 rows)
    const bool own = row >= r0 && row < r1;
    const float4* q = reinterpret_cast<const float4*>(own ? yown + (row - r0) : y + row);
    const float4 a = own ? q[0] : __ldcg(q), c = own ? q[1] : __ldcg(q + 1);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = c.x, v[5] = c.y, v[6] = c.z, v[7] = c.w;
    o = 8 * b + j;
  }
  const auto view = PsDigits<1>::view(yst, rows);
  mma_stage_octet<4, 64>(v, o, octets, const_cast<uint2*>(view.xd), const_cast<float*>(view.xe),
                         const_cast<float*>(view.xsum));
  if (fence && b >= 0) __threadfence();
  __syncwarp();  // the staging stores before lane 0's count
}

// The consumers (all PS_CONSUMERS threads; the caller synchronises after): copy the staged x, n16 (ps_x_units) units,
// all loads of a thread in flight together (4 a thread covers K <= 4,096 in one round trip).
__device__ inline void ps_copy_x(const uint8_t* src, uint8_t* dst, int n16, int tid) {
  constexpr int R = 4;
  const uint4* s = reinterpret_cast<const uint4*>(src);
  uint4* d = reinterpret_cast<uint4*>(dst);
  for (int base = 0; base < n16; base += R * PS_CONSUMERS) {
    uint4 v[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int i = base + r * PS_CONSUMERS + tid;
      if (i < n16) v[r] = __ldcg(s + i);
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int i = base + r * PS_CONSUMERS + tid;
      if (i < n16) d[i] = v[r];
    }
  }
}

// The alternative (flag PS_XB): the consumers stage x themselves as PsDigits::stage does (octet o by thread o,
// + 256 a round, mma_stage_octet: the same bytes), but issue every round's loads before converting (the
// engine's mma_stage_x does; PsDigits::stage converts round by round: two L2 round trips at K = 4,096).
template <int NR = 2>
__device__ inline void ps_stage_x_batched(const float* x, int K, uint8_t* xs, int tid) {
  const auto view = PsDigits<1>::view(xs, K);
  if (tid == 0) *reinterpret_cast<uint4*>(xs) = make_uint4(0u, 0u, 0u, 0u);
  const int octets = K / 8;
  for (int base = 0; base < octets; base += NR * PS_CONSUMERS) {  // one pass for K <= 4,096
    float4 raw[NR][2];
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      const int o = base + r * PS_CONSUMERS + tid;
      raw[r][0] = raw[r][1] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (o < octets) raw[r][0] = reinterpret_cast<const float4*>(x)[2 * o], raw[r][1] = reinterpret_cast<const float4*>(x)[2 * o + 1];
    }
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      if (base + r * PS_CONSUMERS >= octets) break;  // uniform
      const float v[8] = {raw[r][0].x, raw[r][0].y, raw[r][0].z, raw[r][0].w,
                          raw[r][1].x, raw[r][1].y, raw[r][1].z, raw[r][1].w};
      mma_stage_octet<4, 64>(v, base + r * PS_CONSUMERS + tid, octets, const_cast<uint2*>(view.xd),
                             const_cast<float*>(view.xe), const_cast<float*>(view.xsum));
    }
  }
}
#endif

// ---- flat dealing (PS_FLAT): a CTA's segments split evenly over its 8 warps ----------------------------------------
// A phase of nt tiles x C chunks has 16 nt C segments (items of 16 in ring order, a tile's C items consecutive);
// warp w takes [2 nt C w, 2 nt C (w + 1)): A (C = 1) at nt = 6 gives every warp 12 segments (a warp a tile:
// 16 for six warps, none for two; 8 warps a tile: 2 a tile with a barrier each). With nt <= 8 a warp's range
// is at most a tile long, so it touches at most 2 tiles: it writes a partial per tile touched (slot 0: its
// first tile, 1: the next), and after one CTA barrier row r of tile j sums the partials of the warps
// ps_flat_first(j) .. ps_flat_last(j) in ascending order (deterministic). A slot is released by segments:
// the empty barrier counts PS_CSEG arrivals an item, each warp arrives with the segments it read there.
__host__ __device__ inline int ps_flat_lo(int nt, int C, int w) { return 2 * nt * C * w; }
__host__ __device__ inline int ps_flat_tile_of(int nt, int C, int w) { return ps_flat_lo(nt, C, w) / (16 * C); }
__host__ __device__ inline int ps_flat_first(int nt, int C, int j) { return 16 * C * j / (2 * nt * C); }
__host__ __device__ inline int ps_flat_last(int nt, int C, int j) { return (16 * C * (j + 1) - 1) / (2 * nt * C); }
// The partial slot of warp w for tile j (w in ps_flat_first(j) .. ps_flat_last(j)).
__host__ __device__ inline int ps_flat_slot(int nt, int C, int w, int j) { return j == ps_flat_tile_of(nt, C, w) ? 0 : 1; }

// Warp w's pieces in ring order: f(i, l0, l1, done) for item i (of the phase's nt C), its segments [l0, l1) of
// the item, done: the warp's part of tile i / C ends with it (its partial goes to slot ps_flat_slot).
template <class F>
__host__ __device__ inline void ps_flat_walk(int nt, int C, int w, F&& f) {
  const int lo = ps_flat_lo(nt, C, w), hi = lo + 2 * nt * C;
  for (int s0 = lo; s0 < hi;) {
    const int i = s0 / PS_CSEG, end = hi < PS_CSEG * (i + 1) ? hi : PS_CSEG * (i + 1);
    f(i, s0 - PS_CSEG * i, end - PS_CSEG * i, end == hi || end % (PS_CSEG * C) == 0);
    s0 = end;
  }
}

}  // namespace lily::cuda::lab
