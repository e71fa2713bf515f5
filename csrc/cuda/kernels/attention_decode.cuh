// Split-KV (flash-decoding) attention for a few new tokens, the log-sum-exp merge of the splits in
// the same kernel:
//   o[t, h, :] = sum_{j <= pos0+t} softmax_j(q[t, h, :] . k[j, kvh, :] / sqrt(D)) v[j, kvh, :],
//   kvh = h / group. Matches cpu::attention.
// q, o [T, nH*D] f32; k_cache, v_cache [maxT, nKV*D] bf16; pos [1] i32 on the device.
// Grid (P, nKV), kDecodeThreads threads (4 warps), as many CTAs per multiprocessor as its shared memory
// holds (2 at 32-row tiles), P = that x the multiprocessors / nKV, fixed per device (not per position, so
// one captured graph serves every position). CTA (c, kvh) takes the contiguous cache rows [c R, c R + R)
// below pos0 + T, R = max(kDecodeMinRows, ceil((pos0 + T) / P)) (the bytes balanced over the CTAs;
// n = ceil((pos0 + T) / R) <= P of them have rows), in kDecodeTile-row tiles (cp.async, 2-3 stages) with
// one online softmax, and packs all T*group queries of its KV head as the M rows of the tensor-core
// products (m = t*group + head-in-group), so each K/V byte is read once per step. Q K^T: warp w takes
// tile rows [w R_w, (w+1) R_w), R_w = kDecodeTile / kDecodeWarps (8: one n8 tile); P V: warp w takes
// dims [w D / kDecodeWarps, (w+1) D / kDecodeWarps). Two CTAs a multiprocessor (rather than one with 64-row tiles) let one
// CTA's loads and math run while the other waits at a barrier (docs/perf-notes.md, fourteenth session).
// Precision: q and p are split into bf16 hi + lo parts (two products each) so scores and weighted
// sums keep ~16 mantissa bits against the exact bf16 K/V; softmax and accumulators are fp32.
// Partials (unnormalised o, running max in log2 units, sum) go to a fixed device scratch
// [T, nH, P, D] / [T, nH, P].
//
// Merge: every CTA (with rows or not) arrives on one device counter once its partial is stored:
// CTA barrier, then thread 0 fences (fence.acq_rel.gpu, cumulative over the CTA's stores) and
// increments g_decode_arrivals (bits 0-30: this launch's arrivals, 0 between launches). The last of
// the N = P*nKV arrivals adds 2^31 - N (count back to 0, bit 31 flipped) and fences (acquire). The
// last min(64, N, U) arrivals are the mergers; the others among them poll the counter with
// ld.acquire.gpu until the count is N or bit 31 flipped. A barrier then orders the CTA's reads of
// the partials (__ldcg, through L2) after thread 0's acquire. Merger r (arrival N - mergers + r)
// takes units r, r + mergers, ... of the U = nKV*M*(D/S) units (packed row m of KV head kvh, dims
// [s S, s S + S), S = min(D, 64)): M_u = max_c m_c, w_c = 2^(m_c - M_u), l = sum_c w_c l_c (one
// block_sum: thread i holds c = i and i + 128), o = (sum_c w_c o_c) / l over the n partials.
// Thread (col, lane) = (tid % (S/4), tid / (S/4)) sums the partials c = lane, lane + 128/(S/4), ...
// of dims 4 col .. 4 col + 3 in increasing c (fmaf; loads of up to 12 partials in flight); the lanes
// are then added in lane order. Fixed order everywhere: deterministic, graph replay = eager.
// Only the last 63 arrivals ever wait, and every CTA that has not arrived yet is running or gets a
// multiprocessor from a finishing CTA (the next kernel starts only after all of these CTAs started),
// so the wait needs 64 multiprocessors free for this grid, as a dedicated GPU has.
//
// Fused prep (kPrep, gated_attention at T = 1): the kernel starts from the raw projections instead
// of a prepared q and a written cache row. Per head row (one warp each, rows m = warp, warp + 4, ...,
// all loaded before any is used): x = p[h, query D] (resp. k[kvh]); x *= w / sqrt(mean(x^2) + eps)
// (rms_norm_kernel's 32-lane float4 order and one warp_sum, so the same bits); rotate pairs
// (j, j + half) by (pos0 + rope_delta) * inv_freq[j] (rope_kernel's sincosf and rope_rotate), staged in f32 in the
// score buffer. Every CTA with rows prepares the q rows of its KV head (group x D floats from L2,
// cheap next to its K/V tiles); the CTA whose rows end at pos0 also normalises and rotates the new
// key (last warp) and converts the new value (warp 2), writes both as cache row pos0 of its KV head
// (bf16 round to nearest even, as kv_cache_write) and keeps them in shared memory, where they replace
// row pos0 of its last tile once that tile has landed (its loads zero-fill row pos0). CTA m % n writes
// q and gate row m (the op's outputs). The merge multiplies o by sigmoid(gate) (expf, as sigmoid_mul),
// gate read from p.
// Before griddepcontrol.wait (kPrep only) a CTA reads pos and the norm weights, computes the
// rotations and issues its first tiles' loads: cache rows < pos0 and pos were written at least two
// launches earlier (rows by earlier steps' kernels or prefill; pos by an upload, which synchronises
// the stream, or by advance_position_kernel at the end of the previous forward_chunk, after which at
// least the embedding, the first input norm and the q|k|v projection run before any attention
// kernel), and when a kernel starts every kernel two or more launches before it has completed, since
// each one waits before it triggers (eager launches are plain: nothing overlaps). The current token's
// projections (the kernel just before) are read after the wait. Without kPrep the kernel waits first
// (its cache rows >= pos0 come from the kernels just before).
#pragma once
#include "attention_mma.cuh"
#include "attention_rope.cuh"
#include "common.cuh"
#include "norms.cuh"

namespace lily::cuda::attn {

// The CTA's shape (benchmarks/attn_decode_lab.cu builds other shapes with -D to compare them): warps, and
// cache rows per pipeline stage (also the least rows per CTA). Warp w scores tile rows
// [w kDecodeTile / kDecodeWarps, ...) (8 or 16 of them) and sums dims [w D / kDecodeWarps, ...) of P V.
#ifndef LILY_DECODE_WARPS
#define LILY_DECODE_WARPS 4
#endif
#ifndef LILY_DECODE_TILE
#define LILY_DECODE_TILE 32
#endif
constexpr int kDecodeWarps = LILY_DECODE_WARPS;
constexpr int kDecodeThreads = 32 * kDecodeWarps;
constexpr int kDecodeTile = LILY_DECODE_TILE;
#ifndef LILY_DECODE_MIN_ROWS  // the least cache rows a CTA takes (fewer partials to merge at short contexts)
#define LILY_DECODE_MIN_ROWS LILY_DECODE_TILE
#endif
constexpr int kDecodeMinRows = LILY_DECODE_MIN_ROWS;
constexpr int kDecodeWarpRows = kDecodeTile / kDecodeWarps;  // tile rows a warp scores: one or two n8 tiles
static_assert(kDecodeWarpRows == 8 || kDecodeWarpRows == 16, "a warp scores one or two n8 tiles of keys");
constexpr int kMaxDecodeRows = 32;       // T * group packed per CTA (two m-tiles)
constexpr int kMaxDecodeTokens = 4;
constexpr int kMaxDecodeCtas = 256;      // P per KV head; the merge holds kMaxDecodeCtas / threads statistics a thread
constexpr int kDecodeMergers = 64;       // most CTAs that merge (the launch's last arrivals)
constexpr int kMergeBatch = 12;          // partial loads in flight per merging thread
// Scratch bound: T * nH * P * D partial floats (8 MiB; real dims use 1 * 16 * 132 * 256 at T = 1, and P = 128
// at T = 4, the scratch's fit).
constexpr int64_t kDecodeScratchFloats = int64_t(1) << 21;
constexpr int64_t kDecodeMaxPartials = kDecodeScratchFloats / 32;  // D >= 32 on this path

__device__ float g_decode_partial_o[kDecodeScratchFloats];     // [T, nH, P, D] f32
__device__ float2 g_decode_partial_ml[kDecodeMaxPartials];     // [T, nH, P] (max, sum)
__device__ unsigned g_decode_arrivals;                         // see the header: 0 between launches

struct DecodeParams {
  const float* q;        // [T, nH*D] f32 (not read with kPrep)
  const bf16* k_cache;   // [maxT, nKV*D] bf16
  const bf16* v_cache;   // [maxT, nKV*D] bf16
  const int32_t* pos;    // [1] i32
  float* o;              // [T, nH*D] f32
  int T, nH, nKV, group;
  int num_ctas;          // P, CTAs per KV head
  float scale_log2;      // log2(e) / sqrt(D)
};

constexpr int kMaxPrepHalf = 128;  // rotary_dim / 2 <= D / 2 <= 128 on this path

struct DecodePrepParams {
  const float* p;        // [1, nH*2D] f32, per head [query D | gate D]
  const float* k;        // [1, nKV*D] f32 new key (projection output, before norm and RoPE)
  const float* v;        // [1, nKV*D] f32 new value
  const float* q_norm;   // [D] f32
  const float* k_norm;   // [D] f32
  bf16* k_cache;         // [maxT, nKV*D] bf16 (DecodeParams' caches, writable)
  bf16* v_cache;         // [maxT, nKV*D] bf16
  float* q_out;          // [1, nH*D] f32 normed, roped query
  float* gate_out;       // [1, nH*D] f32
  float eps;
  int half;              // rotary_dim / 2
  int rope_delta;        // rotary position minus cache position (RopeParams::delta)
  float inv_freq[kMaxPrepHalf];  // as RopeParams: host double pow rounded to float
};

// PTX release / acquire patterns at GPU scope (the merge's arrival protocol).
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
__device__ __forceinline__ unsigned ld_acquire_gpu(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// What the prep needs that is known before the wait: norm weights (lane's float4s i = lane + 32 k)
// and the rotation of pairs j = lane + 32 k at pos0.
template <int kD>
struct PrepConsts {
  static constexpr int kPer = (kD / 4 + 31) / 32, kRopePer = (kD / 2 + 31) / 32;
  float4 wq[kPer], wk[kPer];
  float sn[kRopePer], cs[kRopePer];
};

template <int kD>
__device__ __forceinline__ void load_prep_consts(PrepConsts<kD>& pc, const DecodePrepParams& pp, int pos0,
                                                 bool key_row, int lane) {
  const float4* wq4 = reinterpret_cast<const float4*>(pp.q_norm);
  const float4* wk4 = reinterpret_cast<const float4*>(pp.k_norm);
#pragma unroll
  for (int k = 0; k < PrepConsts<kD>::kPer; ++k) {
    const int i = lane + 32 * k;
    if (i < kD / 4) {
      pc.wq[k] = wq4[i];
      if (key_row) pc.wk[k] = wk4[i];
    }
  }
#pragma unroll
  for (int k = 0; k < PrepConsts<kD>::kRopePer; ++k) {
    const int j = lane + 32 * k;
    if (j < pp.half) sincosf(float(int64_t(pos0) + pp.rope_delta) * pp.inv_freq[j], &pc.sn[k], &pc.cs[k]);
  }
}

// x (lane's float4s i = lane + 32 k of a kD row) -> stage[0, kD) = rope(rms_norm(x) * w): one warp,
// in rms_norm_kernel's and rope_kernel's arithmetic (see the header). Ends with the warp synchronised
// on the staged row.
template <int kD>
__device__ __forceinline__ void norm_rope_row(const float4 (&x)[PrepConsts<kD>::kPer],
                                              const float4 (&w)[PrepConsts<kD>::kPer], const PrepConsts<kD>& pc,
                                              float* stage, const DecodePrepParams& pp, int lane) {
  float4* s4 = reinterpret_cast<float4*>(stage);
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < PrepConsts<kD>::kPer; ++k)
    if (lane + 32 * k < kD / 4) ss += sq4(x[k]);
  ss = warp_sum(ss);
  const float s = 1.f / sqrtf(ss / float(kD) + pp.eps);
#pragma unroll
  for (int k = 0; k < PrepConsts<kD>::kPer; ++k) {
    const float4 a = x[k], b = w[k];
    if (lane + 32 * k < kD / 4)
      s4[lane + 32 * k] = make_float4(a.x * s * b.x, a.y * s * b.y, a.z * s * b.z, a.w * s * b.w);
  }
  __syncwarp();
#pragma unroll
  for (int k = 0; k < PrepConsts<kD>::kRopePer; ++k) {
    const int j = lane + 32 * k;
    if (j < pp.half) {
      float x0 = stage[j], x1 = stage[j + pp.half];
      rope_rotate(x0, x1, pc.cs[k], pc.sn[k]);
      stage[j] = x0;
      stage[j + pp.half] = x1;
    }
  }
  __syncwarp();
}

// q row elements [off, off + 4) as bf16 hi and lo parts (x = hi + lo to ~16 bits).
__device__ __forceinline__ void store_hi_lo(bf16* q_hi, bf16* q_lo, int off, float4 x) {
  const uint32_t h01 = pack_bf16(x.x, x.y), h23 = pack_bf16(x.z, x.w);
  const float2 f01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&h01));
  const float2 f23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&h23));
  *reinterpret_cast<uint2*>(q_hi + off) = make_uint2(h01, h23);
  *reinterpret_cast<uint2*>(q_lo + off) =
      make_uint2(pack_bf16(x.x - f01.x, x.y - f01.y), pack_bf16(x.z - f23.x, x.w - f23.y));
}

// Eight floats -> eight bf16 (round to nearest even) as one 16-byte word.
__device__ __forceinline__ uint4 pack8_bf16(float4 a, float4 b) {
  return make_uint4(pack_bf16(a.x, a.y), pack_bf16(a.z, a.w), pack_bf16(b.x, b.y), pack_bf16(b.z, b.w));
}

// kPrep, T = 1: the q rows of KV head kvh into q_hi / q_lo [kM][kD + kPad] (rows >= group zero) and,
// in the CTA whose rows end at pos0 (writes_row), cache row pos0 of K and V, also kept in
// kv_new [2][kD + kPad]. stage: this warp's kD floats.
template <int kD, int kM>
__device__ __forceinline__ void prep_rows(const DecodeParams& p, const DecodePrepParams& pp, const PrepConsts<kD>& pc,
                                          bf16* q_hi, bf16* q_lo, bf16* kv_new, float* stage, int pos0, int kvh,
                                          int cta, int n_parts, bool writes_row) {
  constexpr int kStride = kD + kPad, kSlots = kM / kDecodeWarps, kPer = PrepConsts<kD>::kPer, kChunks = kD / 8;
  static_assert(kChunks <= 32, "one 8-element chunk of the new row per lane");
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool key_warp = writes_row && warp == kDecodeWarps - 1, value_warp = writes_row && warp == kDecodeWarps - 2;
  const int64_t cache_row = int64_t(pos0) * p.nKV * kD + kvh * kD;  // cache row pos0 of this KV head
  const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);

  // Every load first (one L2 round trip): this warp's q rows, the new key or value row.
  float4 xq[kSlots][kPer], xk[kPer], xv[2];
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    const int m = warp + kDecodeWarps * s;
    const float4* x4 = reinterpret_cast<const float4*>(pp.p + int64_t(kvh * p.group + (m < p.group ? m : 0)) * 2 * kD);
#pragma unroll
    for (int k = 0; k < kPer; ++k)
      xq[s][k] = m < p.group && lane + 32 * k < kD / 4 ? x4[lane + 32 * k] : zero;
  }
  if (key_warp) {
    const float4* x4 = reinterpret_cast<const float4*>(pp.k + kvh * kD);
#pragma unroll
    for (int k = 0; k < kPer; ++k) xk[k] = lane + 32 * k < kD / 4 ? x4[lane + 32 * k] : zero;
  }
  if (value_warp && lane < kChunks) {
    const float4* x4 = reinterpret_cast<const float4*>(pp.v + kvh * kD + 8 * lane);
    xv[0] = x4[0];
    xv[1] = x4[1];
  }

  if (key_warp) {
    norm_rope_row<kD>(xk, pc.wk, pc, stage, pp, lane);
    if (lane < kChunks) {
      const float4* s4 = reinterpret_cast<const float4*>(stage + 8 * lane);
      const uint4 b = pack8_bf16(s4[0], s4[1]);
      *reinterpret_cast<uint4*>(pp.k_cache + cache_row + 8 * lane) = b;
      *reinterpret_cast<uint4*>(kv_new + 8 * lane) = b;
    }
    __syncwarp();  // the staged row is read before a q row overwrites it
  }
  if (value_warp && lane < kChunks) {
    const uint4 b = pack8_bf16(xv[0], xv[1]);
    *reinterpret_cast<uint4*>(pp.v_cache + cache_row + 8 * lane) = b;
    *reinterpret_cast<uint4*>(kv_new + kStride + 8 * lane) = b;
  }
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    const int m = warp + kDecodeWarps * s;
    if (m < p.group) {  // T = 1: packed row m is head kvh * group + m
      const int h = kvh * p.group + m;
      norm_rope_row<kD>(xq[s], pc.wq, pc, stage, pp, lane);
#pragma unroll
      for (int k = 0; k < kPer; ++k) {
        const int i = lane + 32 * k;
        if (i < kD / 4) {
          const float4 x = reinterpret_cast<const float4*>(stage)[i];
          store_hi_lo(q_hi, q_lo, m * kStride + 4 * i, x);
          if (cta == m % n_parts) {
            reinterpret_cast<float4*>(pp.q_out + int64_t(h) * kD)[i] = x;
            reinterpret_cast<float4*>(pp.gate_out + int64_t(h) * kD)[i] =
                reinterpret_cast<const float4*>(pp.p + int64_t(h) * 2 * kD + kD)[i];
          }
        }
      }
      __syncwarp();  // the staged row is read before the next row overwrites it
    } else {
#pragma unroll
      for (int k = 0; k < kPer; ++k)
        if (lane + 32 * k < kD / 4) store_hi_lo(q_hi, q_lo, m * kStride + 4 * (lane + 32 * k), zero);
    }
  }
}

// B fragments of a warp's kSN n8 tiles of keys (tile rows [n0, n0 + 8 kSN)) for k cols [k0, k0 + 16).
template <int kSN>
__device__ __forceinline__ void load_key_frag(uint32_t (&b)[2 * kSN], const bf16* tile, int stride, int n0, int k0) {
  if constexpr (kSN == 2)
    load_bt_frag_x2n(b, tile, stride, n0, k0);
  else
    load_bt_frag_x1n(b, tile, stride, n0, k0);
}

template <int kD>
struct MergeShape {
  static constexpr int kDims = kD < 64 ? kD : 64;             // S: dims per unit
  static constexpr int kSlices = kD / kDims;                   // units per packed row
  static constexpr int kCols = kDims / 4;                      // float4 columns of a unit
  static constexpr int kLanes = kDecodeThreads / kCols;        // partial lanes
  static constexpr int kScratchFloats = kMaxDecodeCtas + kDecodeThreads * 4 + 32;
};

// Merge unit u (see the header) over the n partials; scratch: MergeShape::kScratchFloats floats of
// shared memory ([P] weights | [lanes][S] lane sums | [32] reduction).
template <int kD, bool kPrep>
__device__ __forceinline__ void merge_unit(const DecodeParams& p, const DecodePrepParams& pp, int u, int n,
                                           float* scratch) {
  using S = MergeShape<kD>;
  float* weight = scratch;                       // [kMaxDecodeCtas]
  float* lane_sum = weight + kMaxDecodeCtas;     // [kLanes][kDims]
  float* red = lane_sum + kDecodeThreads * 4;    // [32]
  const int tid = threadIdx.x, M = p.T * p.group;
  const int s = u % S::kSlices, m = (u / S::kSlices) % M, kvh = u / (S::kSlices * M);
  const int t = m / p.group, h = kvh * p.group + m % p.group;
  const int64_t row = int64_t(t) * p.nH + h;     // partial rows (row * P + c)
  const int col = tid % S::kCols, lane = tid / S::kCols, d0 = s * S::kDims;
  const float4* part = reinterpret_cast<const float4*>(g_decode_partial_o + row * p.num_ctas * kD + d0) + col;
  const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
  float gate = 0.f;  // of dim d0 + tid (kPrep), loaded with the partials
  if (kPrep && tid < S::kDims) gate = pp.p[int64_t(h) * 2 * kD + kD + d0 + tid];

  float4 x[kMergeBatch];
  const auto load_batch = [&](int c0) {
#pragma unroll
    for (int b = 0; b < kMergeBatch; ++b) {
      const int c = c0 + b * S::kLanes;
      x[b] = c < n ? __ldcg(part + int64_t(c) * (kD / 4)) : zero;
    }
  };
  load_batch(lane);  // in flight during the statistics
  constexpr int kStats = kMaxDecodeCtas / kDecodeThreads;  // partials' statistics a thread holds
  const float2 none = make_float2(-INFINITY, 0.f);
  float2 ml[kStats];
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < kStats; ++i) {
    const int c = tid + i * kDecodeThreads;
    ml[i] = c < n ? __ldcg(g_decode_partial_ml + row * p.num_ctas + c) : none;
    mx = fmaxf(mx, ml[i].x);
  }
  mx = block_max(mx, red);  // finite: CTA 0 holds cache row 0
  float lsum = 0.f;
#pragma unroll
  for (int i = 0; i < kStats; ++i) {
    const int c = tid + i * kDecodeThreads;
    const float w = c < n ? exp2f(ml[i].x - mx) : 0.f;
    weight[c] = w;
    lsum += ml[i].y * w;
  }
  const float inv_l = 1.f / block_sum(lsum, red);  // its barriers publish weight[]

  float4 acc = zero;
  for (int c0 = lane;;) {
#pragma unroll
    for (int b = 0; b < kMergeBatch; ++b) {
      const int c = c0 + b * S::kLanes;
      if (c < n) {
        const float w = weight[c];
        acc = make_float4(fmaf(w, x[b].x, acc.x), fmaf(w, x[b].y, acc.y), fmaf(w, x[b].z, acc.z),
                          fmaf(w, x[b].w, acc.w));
      }
    }
    c0 += kMergeBatch * S::kLanes;
    if (c0 >= n) break;
    load_batch(c0);
  }
  reinterpret_cast<float4*>(lane_sum + lane * S::kDims)[col] = acc;
  __syncthreads();
  if (tid < S::kDims) {
    float sum = lane_sum[tid];
#pragma unroll
    for (int l = 1; l < S::kLanes; ++l) sum += lane_sum[l * S::kDims + tid];
    const float out = sum * inv_l;
    p.o[row * kD + d0 + tid] = kPrep ? out * (1.f / (1.f + expf(-gate))) : out;
  }
  __syncthreads();  // scratch is reused by the next unit
}

// Floats of the score buffer: the scores [kM][kDecodeTile + 4], or (kPrep) each warp's f32 staging row
// of kD floats, whichever is larger.
template <int kD, int kMTiles>
constexpr int decode_score_floats() {
  return kMTiles * 16 * (kDecodeTile + 4) > kDecodeWarps * kD ? kMTiles * 16 * (kDecodeTile + 4) : kDecodeWarps * kD;
}

template <int kD, int kMTiles>
constexpr int decode_smem_bytes_for(int stages) {
  constexpr int kM = kMTiles * 16;
  return (2 * kM * (kD + kPad) + 2 * stages * kDecodeTile * (kD + kPad) + 2 * kM * (kDecodeTile + kPad) +
          2 * (kD + kPad)) * 2 +
         (decode_score_floats<kD, kMTiles>() + 3 * kM + 1) * 4;
}

// Three tiles in flight where two CTAs of 32-row tiles or one of 64 still fit a multiprocessor (227 KB of
// shared memory, 1 KB reserved a CTA), else two. The launch puts as many CTAs on a multiprocessor as fit
// (attention.cu, decode_ctas_per_sm).
template <int kD, int kMTiles>
constexpr int decode_stages() {
  constexpr int kCtas = kDecodeTile <= 32 ? 2 : 1;
  return kCtas * (decode_smem_bytes_for<kD, kMTiles>(3) + 1024) <= 228 * 1024 ? 3 : 2;
}

template <int kD, int kMTiles>
constexpr int decode_smem_bytes() { return decode_smem_bytes_for<kD, kMTiles>(decode_stages<kD, kMTiles>()); }

template <int kD, int kMTiles, bool kPrep>
__global__ void __launch_bounds__(kDecodeThreads)
    attention_decode_kernel(const DecodeParams p, const DecodePrepParams pp) {
  constexpr int kM = kMTiles * 16, kStride = kD + kPad, kPStride = kDecodeTile + kPad;
  constexpr int kSStride = kDecodeTile + 4, kWarpDims = kD / kDecodeWarps, kNT = kWarpDims / 8;
  constexpr int kSN = kDecodeWarpRows / 8;  // n8 tiles of keys a warp scores
  constexpr int kStages = decode_stages<kD, kMTiles>(), kStageElems = kDecodeTile * kStride;
  static_assert(MergeShape<kD>::kScratchFloats * 4 <= 2 * kStages * kStageElems * 2,
                "the merge scratch must fit in the K/V stages");
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* q_hi = reinterpret_cast<bf16*>(smem);      // [kM][kStride]
  bf16* q_lo = q_hi + kM * kStride;                // [kM][kStride]
  bf16* k_s = q_lo + kM * kStride;                 // [kStages][kDecodeTile][kStride]
  bf16* v_s = k_s + kStages * kStageElems;         // [kStages][kDecodeTile][kStride]
  bf16* p_hi = v_s + kStages * kStageElems;        // [kM][kPStride]
  bf16* p_lo = p_hi + kM * kPStride;               // [kM][kPStride]
  bf16* kv_new = p_lo + kM * kPStride;             // [2][kStride] new K, V row (kPrep)
  float* s_s = reinterpret_cast<float*>(kv_new + 2 * kStride);  // [kM][kSStride] scores, log2 units
  float* row_m = s_s + decode_score_floats<kD, kMTiles>();  // [kM] running max
  float* row_l = row_m + kM;                       // [kM] running sum
  float* row_alpha = row_l + kM;                   // [kM] rescale of this tile
  unsigned* arrival = reinterpret_cast<unsigned*>(row_alpha + kM);  // this CTA's arrival index

  const int cta = blockIdx.x, kvh = blockIdx.y, tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  if constexpr (!kPrep) {
    pdl_wait();
    pdl_trigger();
  }
  const int pos0 = __ldcg(p.pos);  // kPrep: before the wait (see the header)
  const int row_end = pos0 + p.T;  // cache rows [0, pos0 + T) are visible to some query
  const int64_t per_cta = (int64_t(row_end) + p.num_ctas - 1) / p.num_ctas;
  const int rows_per_cta = int(per_cta > kDecodeMinRows ? per_cta : kDecodeMinRows);  // R
  const int n_parts = int((int64_t(row_end) + rows_per_cta - 1) / rows_per_cta);  // CTAs with rows
  const int64_t r0_64 = int64_t(cta) * rows_per_cta;
  const int r0 = int(r0_64 < row_end ? r0_64 : row_end);
  const int r1 = row_end - r0 < rows_per_cta ? row_end : r0 + rows_per_cta;  // this CTA's rows [r0, r1)
  const int num_tiles = (r1 - r0 + kDecodeTile - 1) / kDecodeTile;
  // kPrep: rows < pos0 only (written before the wait's predecessor); row pos0 comes from kv_new.
  const int load_end = kPrep && pos0 < r1 ? pos0 : r1;
  const bool writes_row = kPrep && cta == n_parts - 1;
  const int M = p.T * p.group;
  const int64_t row_stride = int64_t(p.nKV) * kD;
  const bf16* k_head = p.k_cache + kvh * kD;
  const bf16* v_head = p.v_cache + kvh * kD;

  // Tile i goes to stage i % kStages; one commit group per tile (empty past the last) keeps the
  // wait count uniform. Rows at or past load_end are zero-filled.
  const auto issue_tile = [&](int i) {
    if (i < num_tiles) {
      const int row0 = r0 + i * kDecodeTile, stage = (i % kStages) * kStageElems;
      load_kv_tile<kDecodeTile, kD, kDecodeThreads>(k_s + stage, k_head, row_stride, row0, load_end);
      load_kv_tile<kDecodeTile, kD, kDecodeThreads>(v_s + stage, v_head, row_stride, row0, load_end);
    }
    cp_async_commit();
  };
  PrepConsts<kD> pc;
  if (num_tiles > 0) {
#pragma unroll
    for (int i = 0; i < kStages - 1; ++i) issue_tile(i);
    if constexpr (kPrep) load_prep_consts<kD>(pc, pp, pos0, writes_row && warp == kDecodeWarps - 1, lane);
  }
  if constexpr (kPrep) {
    pdl_wait();
    pdl_trigger();
  }

  if (num_tiles > 0) {
    if constexpr (kPrep) {
      // The scores are not used before the tile loop, whose first barrier also publishes kv_new.
      prep_rows<kD, kM>(p, pp, pc, q_hi, q_lo, kv_new, s_s + warp * kD, pos0, kvh, cta, n_parts, writes_row);
    } else {
      for (int i = tid; i < kM * (kD / 4); i += kDecodeThreads) {
        const int m = i / (kD / 4), d = (i % (kD / 4)) * 4;
        float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
        if (m < M) {
          const int t = m / p.group, h = kvh * p.group + m % p.group;
          x = *reinterpret_cast<const float4*>(p.q + (int64_t(t) * p.nH + h) * kD + d);
        }
        store_hi_lo(q_hi, q_lo, m * kStride + d, x);
      }
    }
    if (tid < kM) {
      row_m[tid] = -INFINITY;
      row_l[tid] = 0.f;
    }

    float o[kMTiles][kNT][4] = {};  // rows mt*16 + g (+8), dims warp*kWarpDims + 8j + 2c (+1)
    int last_key[kMTiles][2];        // last key of rows mt*16 + g (+8) in this CTA; -1 for padding rows
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int m = 16 * mt + g + 8 * half, causal = pos0 + m / p.group;
        last_key[mt][half] = m < M ? (causal < r1 - 1 ? causal : r1 - 1) : -1;
      }
    for (int tile = 0; tile < num_tiles; ++tile) {
      const int tile_row0 = r0 + tile * kDecodeTile;
      cp_async_wait<kStages - 2>();
      // After this barrier every warp is done with tile - 1: its stage, the scores and P are free.
      __syncthreads();
      issue_tile(tile + kStages - 1);
      bf16* k_t = k_s + (tile % kStages) * kStageElems;  // [kDecodeTile][kStride]
      bf16* v_t = v_s + (tile % kStages) * kStageElems;  // [kDecodeTile][kStride]
      if (writes_row && tile == num_tiles - 1) {  // row pos0 (zero-filled) <- the new K, V row
        for (int i = tid; i < 2 * (kD / 8); i += kDecodeThreads) {
          const int which = i / (kD / 8), ch = i % (kD / 8);
          *reinterpret_cast<uint4*>((which ? v_t : k_t) + (pos0 - tile_row0) * kStride + 8 * ch) =
              *reinterpret_cast<const uint4*>(kv_new + which * kStride + 8 * ch);
        }
        __syncthreads();
      }

      // Scores of tile rows [kDecodeWarpRows warp, + kDecodeWarpRows) for all packed queries.
      float sc[kMTiles][kSN][4] = {}, sc_lo[kMTiles][kSN][4] = {};  // hi and lo products: independent chains
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) {
        uint32_t kb[2 * kSN];
        load_key_frag<kSN>(kb, k_t, kStride, kDecodeWarpRows * warp, 16 * kk);
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          uint32_t ah[4], al[4];
          load_a_frag(ah, q_hi, kStride, 16 * mt, 16 * kk);
          load_a_frag(al, q_lo, kStride, 16 * mt, 16 * kk);
#pragma unroll
          for (int nt = 0; nt < kSN; ++nt) {
            mma_bf16(sc_lo[mt][nt], al, kb[2 * nt], kb[2 * nt + 1]);
            mma_bf16(sc[mt][nt], ah, kb[2 * nt], kb[2 * nt + 1]);
          }
        }
      }
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kSN; ++nt)
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int m = 16 * mt + g + 8 * half, n = kDecodeWarpRows * warp + 8 * nt + 2 * c, key = tile_row0 + n;
            const float* acc_hi = sc[mt][nt] + 2 * half;
            const float* acc_lo = sc_lo[mt][nt] + 2 * half;
            *reinterpret_cast<float2*>(s_s + m * kSStride + n) =
                make_float2(key <= last_key[mt][half] ? (acc_hi[0] + acc_lo[0]) * p.scale_log2 : -INFINITY,
                            key + 1 <= last_key[mt][half] ? (acc_hi[1] + acc_lo[1]) * p.scale_log2 : -INFINITY);
          }
      __syncthreads();

      // Online softmax: kThreadsPerRow consecutive lanes own one packed query row.
      {
        constexpr int kThreadsPerRow = kDecodeThreads / kM, kCols = kDecodeTile / kThreadsPerRow;
        static_assert(kCols % 4 == 0, "a softmax thread takes whole float4s of scores");
        const int r = tid / kThreadsPerRow, col0 = (tid % kThreadsPerRow) * kCols;
        const float m_old = row_m[r];
        float sv[kCols];
#pragma unroll
        for (int i = 0; i < kCols; i += 4)
          *reinterpret_cast<float4*>(sv + i) = *reinterpret_cast<const float4*>(s_s + r * kSStride + col0 + i);
        float mx = -INFINITY;
#pragma unroll
        for (int i = 0; i < kCols; ++i) mx = fmaxf(mx, sv[i]);
#pragma unroll
        for (int off = kThreadsPerRow / 2; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        const float m_new = fmaxf(m_old, mx);
        const float m_ref = m_new == -INFINITY ? 0.f : m_new;  // rows with nothing valid yet stay at 0
        float sum = 0.f;
#pragma unroll
        for (int i = 0; i < kCols; i += 4) {
          uint32_t hi[2], lo[2];
#pragma unroll
          for (int k = 0; k < 2; ++k) {
            const float p0 = exp2f(sv[i + 2 * k] - m_ref), p1 = exp2f(sv[i + 2 * k + 1] - m_ref);
            sum += p0 + p1;
            hi[k] = pack_bf16(p0, p1);
            const float2 h = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&hi[k]));
            lo[k] = pack_bf16(p0 - h.x, p1 - h.y);
          }
          *reinterpret_cast<uint2*>(p_hi + r * kPStride + col0 + i) = make_uint2(hi[0], hi[1]);
          *reinterpret_cast<uint2*>(p_lo + r * kPStride + col0 + i) = make_uint2(lo[0], lo[1]);
        }
#pragma unroll
        for (int off = kThreadsPerRow / 2; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
        const float alpha = exp2f(m_old - m_ref);
        __syncwarp();
        if (tid % kThreadsPerRow == 0) {
          row_m[r] = m_new;
          row_l[r] = row_l[r] * alpha + sum;
          row_alpha[r] = alpha;
        }
      }
      __syncthreads();

      // o = o * alpha + P V over this warp's dims.
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        const float a0 = row_alpha[16 * mt + g], a1 = row_alpha[16 * mt + g + 8];
#pragma unroll
        for (int j = 0; j < kNT; ++j) {
          o[mt][j][0] *= a0;
          o[mt][j][1] *= a0;
          o[mt][j][2] *= a1;
          o[mt][j][3] *= a1;
        }
      }
#pragma unroll
      for (int kk = 0; kk < kDecodeTile / 16; ++kk) {
        uint32_t ph[kMTiles][4], pl[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          load_a_frag(ph[mt], p_hi, kPStride, 16 * mt, 16 * kk);
          load_a_frag(pl[mt], p_lo, kPStride, 16 * mt, 16 * kk);
        }
#pragma unroll
        for (int j = 0; j + 1 < kNT; j += 2) {
          uint32_t vb[4];
          load_b_frag_x2n(vb, v_t, kStride, 16 * kk, warp * kWarpDims + 8 * j);
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            mma_bf16(o[mt][j], pl[mt], vb[0], vb[1]);
            mma_bf16(o[mt][j], ph[mt], vb[0], vb[1]);
            mma_bf16(o[mt][j + 1], pl[mt], vb[2], vb[3]);
            mma_bf16(o[mt][j + 1], ph[mt], vb[2], vb[3]);
          }
        }
        if constexpr (kNT % 2 == 1) {
          uint32_t vb[2];
          load_b_frag_x1n(vb, v_t, kStride, 16 * kk, warp * kWarpDims + 8 * (kNT - 1));
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            mma_bf16(o[mt][kNT - 1], pl[mt], vb[0], vb[1]);
            mma_bf16(o[mt][kNT - 1], ph[mt], vb[0], vb[1]);
          }
        }
      }
    }
    __syncthreads();  // row_m, row_l final

    // The partial of (t, h) from this CTA is row (t*nH + h) * P + cta.
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int m = 16 * mt + g + 8 * half;
        if (m >= M) continue;
        const int t = m / p.group, h = kvh * p.group + m % p.group;
        float* dst = g_decode_partial_o + ((int64_t(t) * p.nH + h) * p.num_ctas + cta) * kD;
#pragma unroll
        for (int j = 0; j < kNT; ++j)
          *reinterpret_cast<float2*>(dst + warp * kWarpDims + 8 * j + 2 * c) =
              make_float2(o[mt][j][2 * half], o[mt][j][2 * half + 1]);
      }
    if (tid < M) {
      const int t = tid / p.group, h = kvh * p.group + tid % p.group;
      g_decode_partial_ml[(int64_t(t) * p.nH + h) * p.num_ctas + cta] = make_float2(row_m[tid], row_l[tid]);
    }
  }

  // Arrival of every CTA, then the last `mergers` arrivals merge (see the header).
  __syncthreads();  // every thread's partial stores come before thread 0's (cumulative) fence
  const unsigned n_arrive = gridDim.x * gridDim.y;
  const int units = p.nKV * M * MergeShape<kD>::kSlices;
  const unsigned mergers = min(unsigned(kDecodeMergers), min(n_arrive, unsigned(units)));
  if (tid == 0) {
    fence_acq_rel_gpu();  // release: the CTA's partials, then its arrival
    const unsigned old = atomicAdd(&g_decode_arrivals, 1u), a = old & 0x7fffffffu;
    if (a == n_arrive - 1) {
      atomicAdd(&g_decode_arrivals, 0x80000000u - n_arrive);  // count 0, bit 31 flipped: all arrived
      fence_acq_rel_gpu();  // acquire: every CTA's partial, before this CTA reads them
    } else if (a >= n_arrive - mergers) {
      for (;;) {  // acquire loads until all arrived: the count is N, or the last arrival reset it
        const unsigned v = ld_acquire_gpu(&g_decode_arrivals);
        if (((v ^ old) & 0x80000000u) != 0u || (v & 0x7fffffffu) == n_arrive) break;
      }
    }
    *arrival = a;
  }
  __syncthreads();  // the partials read after this barrier follow thread 0's acquire
  const unsigned a = *arrival;
  if (a < n_arrive - mergers) return;
  float* scratch = reinterpret_cast<float*>(k_s);  // the stages are idle: no copies in flight
  for (int u = int(a - (n_arrive - mergers)); u < units; u += int(mergers))
    merge_unit<kD, kPrep>(p, pp, u, n_parts, scratch);
}

}  // namespace lily::cuda::attn
