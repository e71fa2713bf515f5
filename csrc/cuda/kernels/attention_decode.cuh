// Split-KV (flash-decoding) attention for a few new tokens, then a log-sum-exp merge of the splits.
//   o[t, h, :] = sum_{j <= pos0+t} softmax_j(q[t, h, :] . k[j, kvh, :] / sqrt(D)) v[j, kvh, :],
//   kvh = h / group. Matches cpu::attention.
// q, o [T, nH*D] f32; k_cache, v_cache [maxT, nKV*D] bf16; pos [1] i32 on the device.
// Split kernel: grid (P, nKV), 128 threads, P fixed per device (not per position, so one captured
// graph serves every position). CTA (c, kvh) takes the 64-row cache tiles c, c + P, c + 2P, ...
// below pos0 + T (cp.async, 2-3 stages) with one online softmax, and packs all T*group queries of
// its KV head as the M rows of the tensor-core products (m = t*group + head-in-group), so each
// K/V byte is read once per step. Q K^T: warp w takes tile rows [16w, 16w+16); P V: warp w takes
// dims [w*D/4, (w+1)*D/4).
// Precision: q and p are split into bf16 hi + lo parts (two products each) so scores and weighted
// sums keep ~16 mantissa bits against the exact bf16 K/V; softmax and accumulators are fp32.
// Partials (unnormalised o, running max in log2 units, sum) go to a fixed device scratch; the
// merge kernel (one CTA per (t, h)) combines them in CTA order.
//
// Fused prep (kPrep, gated_attention at T = 1): the split kernel starts from the raw projections
// instead of a prepared q and a written cache row. Per head row (one warp each, rows m = warp,
// warp + 4, ...): x = p[h, query D] (resp. k[kvh]); x *= w / sqrt(mean(x^2) + eps) (rms_norm_kernel's
// 32-lane float4 order and one warp_sum, so the same bits); rotate pairs (j, j + half) by
// pos0 * inv_freq[j] (rope_kernel's sincosf and rope_rotate), staged in f32 in the score buffer.
// Every CTA prepares the q rows of its KV head (group x D floats from L2, cheap next to its K/V
// tiles); the CTA whose tiles hold row pos0 also writes cache row pos0 of its KV head (bf16 round to
// nearest even, as kv_cache_write) before it issues any tile load; the others issue theirs first.
// CTA 0 of each KV head also writes q and gate (the op's outputs). The merge multiplies o by
// sigmoid(gate) (expf, as sigmoid_mul) in its final write when given a gate.
#pragma once
#include "attention_mma.cuh"
#include "attention_rope.cuh"
#include "common.cuh"
#include "norms.cuh"

namespace lily::cuda::attn {

constexpr int kDecodeThreads = 128;
constexpr int kDecodeTile = 64;          // cache rows per pipeline stage
constexpr int kMaxDecodeRows = 32;       // T * group packed per CTA (two m-tiles)
constexpr int kMaxDecodeTokens = 4;
constexpr int kMaxDecodeCtas = 256;      // P per KV head; the merge gives each a thread
// Scratch bound: T * nH * P * D partial floats (8 MiB; real dims use 4 * 16 * 66 * 256 at most).
constexpr int64_t kDecodeScratchFloats = int64_t(1) << 21;
constexpr int64_t kDecodeMaxPartials = kDecodeScratchFloats / 32;  // D >= 32 on this path

__device__ float g_decode_partial_o[kDecodeScratchFloats];     // [T, nH, P, D] f32
__device__ float2 g_decode_partial_ml[kDecodeMaxPartials];     // [T, nH, P] (max, sum)

struct DecodeParams {
  const float* q;        // [T, nH*D] f32
  const bf16* k_cache;   // [maxT, nKV*D] bf16
  const bf16* v_cache;   // [maxT, nKV*D] bf16
  const int32_t* pos;    // [1] i32
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
  float inv_freq[kMaxPrepHalf];  // as RopeParams: host double pow rounded to float
};

// x[0, kD) f32 -> stage = rope(rms_norm(x) * w): one warp, in rms_norm_kernel's and rope_kernel's
// arithmetic (see the header). Ends with the warp synchronised on the staged row.
template <int kD>
__device__ __forceinline__ void prep_head_row(const float* x, const float* w, float* stage, int pos0,
                                              const DecodePrepParams& pp, int lane) {
  const float4* x4 = reinterpret_cast<const float4*>(x);
  const float4* w4 = reinterpret_cast<const float4*>(w);
  float4* s4 = reinterpret_cast<float4*>(stage);
  float ss = 0.f;
  for (int i = lane; i < kD / 4; i += 32) ss += sq4(x4[i]);
  ss = warp_sum(ss);
  const float s = 1.f / sqrtf(ss / float(kD) + pp.eps);
  for (int i = lane; i < kD / 4; i += 32) {
    const float4 a = x4[i], b = w4[i];
    s4[i] = make_float4(a.x * s * b.x, a.y * s * b.y, a.z * s * b.z, a.w * s * b.w);
  }
  __syncwarp();
  for (int j = lane; j < pp.half; j += 32) {
    float sn, cs;
    sincosf(float(int64_t(pos0)) * pp.inv_freq[j], &sn, &cs);
    float x0 = stage[j], x1 = stage[j + pp.half];
    rope_rotate(x0, x1, cs, sn);
    stage[j] = x0;
    stage[j + pp.half] = x1;
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

template <int kD, int kMTiles, int kStages>
constexpr int decode_smem_bytes_for() {
  constexpr int kM = kMTiles * 16;
  return (2 * kM * (kD + kPad) + 2 * kStages * kDecodeTile * (kD + kPad) + 2 * kM * (kDecodeTile + kPad)) * 2 +
         (kM * (kDecodeTile + 4) + 3 * kM) * 4;
}

// Three tiles in flight where they fit in a multiprocessor's 227 KB of shared memory, else two.
template <int kD, int kMTiles>
constexpr int decode_stages() { return decode_smem_bytes_for<kD, kMTiles, 3>() <= 227 * 1024 ? 3 : 2; }

template <int kD, int kMTiles>
constexpr int decode_smem_bytes() { return decode_smem_bytes_for<kD, kMTiles, decode_stages<kD, kMTiles>()>(); }

template <int kD, int kMTiles, bool kPrep>
__global__ void __launch_bounds__(kDecodeThreads)
    attention_decode_split_kernel(const DecodeParams p, const DecodePrepParams pp) {
  pdl_wait();
  pdl_trigger();
  constexpr int kM = kMTiles * 16, kStride = kD + kPad, kPStride = kDecodeTile + kPad;
  constexpr int kSStride = kDecodeTile + 4, kWarpDims = kD / 4, kNT = kWarpDims / 8;
  constexpr int kStages = decode_stages<kD, kMTiles>(), kStageElems = kDecodeTile * kStride;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* q_hi = reinterpret_cast<bf16*>(smem);      // [kM][kStride]
  bf16* q_lo = q_hi + kM * kStride;                // [kM][kStride]
  bf16* k_s = q_lo + kM * kStride;                 // [kStages][kDecodeTile][kStride]
  bf16* v_s = k_s + kStages * kStageElems;         // [kStages][kDecodeTile][kStride]
  bf16* p_hi = v_s + kStages * kStageElems;        // [kM][kPStride]
  bf16* p_lo = p_hi + kM * kPStride;               // [kM][kPStride]
  float* s_s = reinterpret_cast<float*>(p_lo + kM * kPStride);  // [kM][kSStride] scores, log2 units
  float* row_m = s_s + kM * kSStride;              // [kM] running max
  float* row_l = row_m + kM;                       // [kM] running sum
  float* row_alpha = row_l + kM;                   // [kM] rescale of this tile

  const int cta = blockIdx.x, kvh = blockIdx.y, tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const int pos0 = *p.pos;
  const int row_end = pos0 + p.T;  // cache rows [0, pos0 + T) are visible to some query
  const int total_tiles = (row_end + kDecodeTile - 1) / kDecodeTile;
  if (cta >= total_tiles) return;
  const int num_tiles = (total_tiles - cta + p.num_ctas - 1) / p.num_ctas;  // tiles cta + i P
  const int tile_step = p.num_ctas * kDecodeTile;
  const int row_begin = cta * kDecodeTile;
  const int M = p.T * p.group;
  const int64_t row_stride = int64_t(p.nKV) * kD;
  const bf16* k_head = p.k_cache + kvh * kD;
  const bf16* v_head = p.v_cache + kvh * kD;

  // Tile i goes to stage i % kStages; one commit group per tile (empty past the last) keeps the
  // wait count uniform.
  const auto issue_tile = [&](int i) {
    if (i < num_tiles) {
      const int row0 = row_begin + i * tile_step, stage = (i % kStages) * kStageElems;
      load_kv_tile<kDecodeTile, kD, kDecodeThreads>(k_s + stage, k_head, row_stride, row0, row_end);
      load_kv_tile<kDecodeTile, kD, kDecodeThreads>(v_s + stage, v_head, row_stride, row0, row_end);
    }
    cp_async_commit();
  };
  // kPrep (T = 1): this CTA's tiles hold the new row pos0, which it writes before loading any tile.
  const bool writes_row = kPrep && cta == (pos0 / kDecodeTile) % p.num_ctas;
  if (!writes_row) {
#pragma unroll
    for (int i = 0; i < kStages - 1; ++i) issue_tile(i);
  }

  if constexpr (kPrep) {
    static_assert(4 * kD <= kM * kSStride, "per-warp f32 staging rows must fit in the score buffer");
    float* stage = s_s + warp * kD;  // [kD] f32 per warp; the scores are not used before the tile loop
    if (writes_row) {
      const int64_t row = int64_t(pos0) * row_stride + kvh * kD;  // cache row pos0 of this KV head
      if (warp == 0) {
        prep_head_row<kD>(pp.k + kvh * kD, pp.k_norm, stage, pos0, pp, lane);
        for (int i = lane; i < kD; i += 32) pp.k_cache[row + i] = __float2bfloat16_rn(stage[i]);
        __syncwarp();
      } else {
        for (int i = tid - 32; i < kD; i += kDecodeThreads - 32)
          pp.v_cache[row + i] = __float2bfloat16_rn(pp.v[kvh * kD + i]);
      }
    }
    for (int m = warp; m < kM; m += kDecodeThreads / 32) {
      if (m < M) {  // T = 1: packed row m is head kvh * group + m
        const int h = kvh * p.group + m;
        prep_head_row<kD>(pp.p + int64_t(h) * 2 * kD, pp.q_norm, stage, pos0, pp, lane);
        for (int i = lane; i < kD / 4; i += 32) {
          const float4 x = reinterpret_cast<const float4*>(stage)[i];
          store_hi_lo(q_hi, q_lo, m * kStride + 4 * i, x);
          if (cta == 0) {
            reinterpret_cast<float4*>(pp.q_out + int64_t(h) * kD)[i] = x;
            reinterpret_cast<float4*>(pp.gate_out + int64_t(h) * kD)[i] =
                reinterpret_cast<const float4*>(pp.p + int64_t(h) * 2 * kD + kD)[i];
          }
        }
        __syncwarp();  // the staged row is read before the next row overwrites it
      } else {
        for (int i = lane; i < kD / 4; i += 32)
          store_hi_lo(q_hi, q_lo, m * kStride + 4 * i, make_float4(0.f, 0.f, 0.f, 0.f));
      }
    }
    if (writes_row) {
      __threadfence_block();
      __syncthreads();  // cache row pos0 is written before any thread's cp.async reads it
#pragma unroll
      for (int i = 0; i < kStages - 1; ++i) issue_tile(i);
    }
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
  int last_key[kMTiles][2];        // causal limit pos0 + t of rows mt*16 + g (+8); -1 for padding rows
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int m = 16 * mt + g + 8 * half;
      last_key[mt][half] = m < M ? pos0 + m / p.group : -1;
    }
  for (int tile = 0; tile < num_tiles; ++tile) {
    const int tile_row0 = row_begin + tile * tile_step;
    cp_async_wait<kStages - 2>();
    // After this barrier every warp is done with tile - 1: its stage, the scores and P are free.
    __syncthreads();
    issue_tile(tile + kStages - 1);
    const bf16* k_t = k_s + (tile % kStages) * kStageElems;  // [kDecodeTile][kStride]
    const bf16* v_t = v_s + (tile % kStages) * kStageElems;  // [kDecodeTile][kStride]

    // Scores of tile rows [16 warp, 16 warp + 16) for all packed queries.
    float sc[kMTiles][2][4] = {}, sc_lo[kMTiles][2][4] = {};  // hi and lo products: independent chains
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      uint32_t kb[4];
      load_bt_frag_x2n(kb, k_t, kStride, 16 * warp, 16 * kk);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        uint32_t ah[4], al[4];
        load_a_frag(ah, q_hi, kStride, 16 * mt, 16 * kk);
        load_a_frag(al, q_lo, kStride, 16 * mt, 16 * kk);
        mma_bf16(sc_lo[mt][0], al, kb[0], kb[1]);
        mma_bf16(sc[mt][0], ah, kb[0], kb[1]);
        mma_bf16(sc_lo[mt][1], al, kb[2], kb[3]);
        mma_bf16(sc[mt][1], ah, kb[2], kb[3]);
      }
    }
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int m = 16 * mt + g + 8 * half, n = 16 * warp + 8 * nt + 2 * c, key = tile_row0 + n;
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
      for (int i = 0; i < kCols; i += 8) {
        uint32_t hi[4], lo[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const float p0 = exp2f(sv[i + 2 * k] - m_ref), p1 = exp2f(sv[i + 2 * k + 1] - m_ref);
          sum += p0 + p1;
          hi[k] = pack_bf16(p0, p1);
          const float2 h = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&hi[k]));
          lo[k] = pack_bf16(p0 - h.x, p1 - h.y);
        }
        *reinterpret_cast<uint4*>(p_hi + r * kPStride + col0 + i) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
        *reinterpret_cast<uint4*>(p_lo + r * kPStride + col0 + i) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
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

struct DecodeMergeParams {
  float* o;             // [T, nH*D] f32
  const float* gate;    // [T, nH*D] f32, or null: o *= sigmoid(gate) in the final write
  const int32_t* pos;   // [1] i32
  int nH, D, T, num_ctas;
};

constexpr int kMergeThreads = 256;  // >= kMaxDecodeCtas and >= D

// o[t, h, :] = sum_c 2^(m_c - M) o_c / sum_c 2^(m_c - M) l_c over the CTAs c that had tiles, in
// CTA order (M = max_c m_c; CTAs with no visible row for t carry m_c = -inf, weight 0).
// Grid T*nH (one CTA per (t, h)); thread c loads CTA c's (max, sum), thread d sums dim d.
// With a gate: o *= 1 / (1 + expf(-gate)), sigmoid_mul's arithmetic on the same value.
__global__ void __launch_bounds__(kMergeThreads) attention_decode_merge_kernel(const DecodeMergeParams p) {
  pdl_wait();
  pdl_trigger();
  __shared__ float weight[kMergeThreads];  // [P]
  __shared__ float red[32];
  const int row = blockIdx.x, tid = threadIdx.x;
  const int n = min(p.num_ctas, (*p.pos + p.T + kDecodeTile - 1) / kDecodeTile);
  const float2 ml = tid < n ? g_decode_partial_ml[int64_t(row) * p.num_ctas + tid] : make_float2(-INFINITY, 0.f);
  const float mx = block_max(ml.x, red);  // finite: CTA 0 holds cache row 0
  const float w = tid < n ? exp2f(ml.x - mx) : 0.f;
  weight[tid] = w;
  const float inv_l = 1.f / block_sum(ml.y * w, red);
  if (tid >= p.D) return;
  const float* part = g_decode_partial_o + int64_t(row) * p.num_ctas * p.D + tid;  // [P, D] f32, column tid
  float acc = 0.f;
#pragma unroll 8
  for (int c = 0; c < n; ++c) acc += weight[c] * part[int64_t(c) * p.D];
  const int64_t i = int64_t(row) * p.D + tid;
  const float out = acc * inv_l;
  p.o[i] = p.gate ? out * (1.f / (1.f + expf(-p.gate[i]))) : out;
}

}  // namespace lily::cuda::attn
