// A prompt's gated-attention prep at head_dim kD, for the wgmma prefill kernel (attention_wgmma.cuh), in
// one kernel where the op sequence runs split_q_gate, rms_norm (q, k), rope (q, k), kv_cache_write (k, v)
// and attention_q_bf16:
//   qb[t, h, :]               = bf16(rope(rms_norm(p[t, h, query]) * q_norm, pos0 + delta + t))
//   k_cache[pos0 + t, kvh, :] = bf16(rope(rms_norm(k[t, kvh]) * k_norm, pos0 + delta + t))
//   v_cache[pos0 + t, kvh, :] = bf16(v[t, kvh])
// p [T, nH*2D] f32 (per head [query D | gate D]; gate_o_kernel reads the gate after the attention),
// k, v [T, nKV*D] f32, qb [T, nH*D] bf16 (consecutive pairs, as attention_q_bf16_kernel packs them),
// caches [maxT, nKV*D] bf16; pos [1] i32 on the device.
// One warp per row (t, r), r < nH a query head, then nKV key heads, then nKV value heads; 8 warps a CTA.
// Bits: norm_rope_row (attention_decode.cuh: rms_norm_kernel's warp-row sum order and product, rope_kernel's
// fp32 angle, sincosf and rope_rotate), angles from load_prep_consts at position pos0 + t (the same
// integer rope_kernel forms), and round-to-nearest-even bf16 as attention_q_bf16_kernel and
// kv_cache_write convert: qb and the cache rows equal the op sequence's bit for bit.
#pragma once
#include "attention_decode.cuh"
#include "xb_layout.cuh"

namespace lily::cuda::attn {

constexpr int kPrepWarps = 8;

struct PrefillPrepParams {
  DecodePrepParams pp;  // p, k, v, q_norm, k_norm, caches, eps, half, rope_delta, inv_freq (q_out, gate_out unused)
  uint16_t* qb;         // [T, nH*D] bf16
  const int32_t* pos;   // [1] i32
  int T, nH, nKV;
};

template <int kD>
__global__ void __launch_bounds__(32 * kPrepWarps) attention_prep_kernel(const PrefillPrepParams p) {
  static_assert(kD / 8 <= 32, "one 8-value chunk of a row per lane");
  constexpr int kPer = PrepConsts<kD>::kPer;
  __shared__ __align__(16) float stage[kPrepWarps][kD];
  pdl_wait();
  pdl_trigger();
  const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31;
  const int rows = p.nH + 2 * p.nKV;
  const int64_t w = int64_t(blockIdx.x) * kPrepWarps + warp;
  if (w >= int64_t(p.T) * rows) return;  // no block-wide barrier below
  const int t = int(w / rows), r = int(w % rows);
  const int pos0 = *p.pos;
  const DecodePrepParams& pp = p.pp;
  const int64_t cache_row = (int64_t(pos0) + t) * p.nKV * kD;
  if (r >= p.nH + p.nKV) {  // a value row: the cache's bf16
    const int kvh = r - p.nH - p.nKV;
    if (lane < kD / 8) {
      const float4* x4 = reinterpret_cast<const float4*>(pp.v + (int64_t(t) * p.nKV + kvh) * kD + 8 * lane);
      *reinterpret_cast<uint4*>(pp.v_cache + cache_row + kvh * kD + 8 * lane) = pack8_bf16(x4[0], x4[1]);
    }
    return;
  }
  const bool key = r >= p.nH;
  const int head = key ? r - p.nH : r;
  const float4* x4 = reinterpret_cast<const float4*>(key ? pp.k + (int64_t(t) * p.nKV + head) * kD
                                                         : pp.p + (int64_t(t) * p.nH + head) * 2 * kD);
  const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
  float4 x[kPer];
#pragma unroll
  for (int k = 0; k < kPer; ++k) x[k] = lane + 32 * k < kD / 4 ? x4[lane + 32 * k] : zero;
  PrepConsts<kD> pc;
  load_prep_consts<kD>(pc, pp, pos0 + t, key, lane);
  float* row = stage[warp];
  norm_rope_row<kD>(x, key ? pc.wk : pc.wq, pc, row, pp, lane);
  if (lane < kD / 8) {
    const float4* s4 = reinterpret_cast<const float4*>(row + 8 * lane);
    const uint4 b = pack8_bf16(s4[0], s4[1]);
    if (key)
      *reinterpret_cast<uint4*>(pp.k_cache + cache_row + head * kD + 8 * lane) = b;
    else
      *reinterpret_cast<uint4*>(p.qb + (int64_t(t) * p.nH + head) * kD + 8 * lane) = b;
  }
}

// After the attention: o[t, h, :] *= sigmoid(p[t, h, gate]) (SigmoidMulOp's expression, sigmoid_mul's bits),
// in place (XB = false) or written as the prefill GEMM's bf16 X (XB: xb [T, nH*D], each 8-value block
// packed as pairs (v_c, v_c+4), as wgx_bf16_kernel packs it, so the next product reads what linear would
// convert from the gated o). One thread per 8-value block of o (1-D grid); o and p 16-byte aligned.
struct GateParams {
  float* o;            // [T, nH*D] f32
  const float* p;      // [T, nH*2D] f32
  uint16_t* xb;        // [T, nH*D] bf16 (XB)
  int64_t blocks;      // T*nH*D/8
};

template <int kD, bool XB>
__global__ void gate_o_kernel(const GateParams p) {
  pdl_wait();
  pdl_trigger();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= p.blocks) return;
  const int64_t r = i / (kD / 8), j = i % (kD / 8);  // r = t*nH + h
  const float4* o4 = reinterpret_cast<const float4*>(p.o + 8 * i);
  const float4* g4 = reinterpret_cast<const float4*>(p.p + r * 2 * kD + kD + 8 * j);
  const float4 a = o4[0], b = o4[1], ga = g4[0], gb = g4[1];
  const float o[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w}, g[8] = {ga.x, ga.y, ga.z, ga.w, gb.x, gb.y, gb.z, gb.w};
  float v[8];
#pragma unroll
  for (int m = 0; m < 8; ++m) v[m] = o[m] * (1.f / (1.f + expf(-g[m])));
  if constexpr (XB) {
    *reinterpret_cast<uint4*>(p.xb + 8 * i) = wg_pack_xb8(v);
  } else {
    float4* w4 = reinterpret_cast<float4*>(p.o + 8 * i);
    w4[0] = make_float4(v[0], v[1], v[2], v[3]);
    w4[1] = make_float4(v[4], v[5], v[6], v[7]);
  }
}

}  // namespace lily::cuda::attn
