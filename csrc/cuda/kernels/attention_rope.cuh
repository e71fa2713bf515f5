// The elementwise pieces of gated attention: q/gate split, rotate-half RoPE (and its multimodal form),
// BF16 KV cache append.
// 1-D grids of 256 threads, one thread per element, or per kVec = 4 consecutive elements when the
// launcher found every row 16-byte aligned. Match cpu::split_q_gate, cpu::rope, cpu::kv_cache_write.
#pragma once
#include <cuda_bf16.h>
#include <cstdint>
#include <type_traits>

#include "common.cuh"

namespace lily::cuda::attn {

constexpr int kElementwiseThreads = 256;
constexpr int kMaxRopeHalf = 256;  // rotary_dim / 2 bound of the inv_freq table in RopeParams

// q[r, d] = p[r, d], gate[r, d] = p[r, D + d] with r = t*nH + h (p rows are [query D | gate D]
// per head). p [T, nH*2D], q, gate [T, nH*D] f32. Thread i moves kVec consecutive d of q and gate.
struct SplitQGateParams {
  const float* p;  // [T, nH*2D] f32
  float* q;        // [T, nH*D] f32
  float* gate;     // [T, nH*D] f32
  int64_t n;       // T*nH*D
  int D;
};

template <int kVec>
__global__ void split_q_gate_kernel(const SplitQGateParams p) {
  pdl_wait();
  pdl_trigger();
  using V = std::conditional_t<kVec == 4, float4, float>;
  const int64_t e = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * kVec;
  if (e >= p.n) return;
  const int64_t r = e / p.D, d = e % p.D;
  const float* src = p.p + r * 2 * p.D + d;
  *reinterpret_cast<V*>(p.q + e) = *reinterpret_cast<const V*>(src);
  *reinterpret_cast<V*>(p.gate + e) = *reinterpret_cast<const V*>(src + p.D);
}

// x[t, h, j], x[t, h, j + half] <- rotate by angle (pos0 + delta + t) * inv_freq[j], j < half:
//   x0' = x0 cos - x1 sin, x1' = x1 cos + x0 sin. x [T, nH*D] f32 in place. delta: the rope offset of text
//   after an image (ops::Position::rope_delta; 0 otherwise, which adds nothing to the integer position).
// One thread per (t, h, j). inv_freq comes from the host (double pow rounded to float, as the CPU
// computes it); the angle is an fp32 product and sincosf is the precise one (positions reach 2^17).
struct RopeParams {
  float* x;             // [T, nH*D] f32
  const int32_t* pos;   // [1] i32
  int64_t n;            // T*nH*half
  int nH, D, half;
  int delta;            // rotary position minus cache position
  float inv_freq[kMaxRopeHalf];
};

__global__ void rope_kernel(const RopeParams p) {
  pdl_wait();
  pdl_trigger();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= p.n) return;
  const int j = int(i % p.half);
  const int64_t r = i / p.half, t = r / p.nH;
  const float ang = float(int64_t(*p.pos) + p.delta + t) * p.inv_freq[j];
  float s, c;
  sincosf(ang, &s, &c);
  float* v = p.x + r * p.D;
  float x0 = v[j], x1 = v[j + p.half];
  rope_rotate(x0, x1, c, s);
  v[j] = x0;
  v[j + p.half] = x1;
}

// mrope (multimodal RoPE, docs/model.md section 8.5): as rope_kernel, token t turning frequency j by its own
// position pos[t, axis_j] (axis 1 = h when j % 3 == 1 and j < 3 sections[1], 2 = w when j % 3 == 2 and
// j < 3 sections[2], else 0 = t): the same fp32 angle, sincosf and rope_rotate, so a token whose three
// positions equal p turns exactly as rope_kernel turns position p. One thread per (t, h, j).
struct MropeParams {
  float* x;             // [T, nH*D] f32
  const int32_t* pos;   // [T, 3] i32 (t, h, w)
  int64_t n;            // T*nH*half
  int nH, D, half;
  int section_h, section_w;
  float inv_freq[kMaxRopeHalf];
};

__global__ void mrope_kernel(const MropeParams p) {
  pdl_wait();
  pdl_trigger();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= p.n) return;
  const int j = int(i % p.half);
  const int64_t r = i / p.half, t = r / p.nH;
  const int axis = j % 3 == 1 && j < 3 * p.section_h ? 1 : j % 3 == 2 && j < 3 * p.section_w ? 2 : 0;
  const float ang = float(int64_t(p.pos[3 * t + axis])) * p.inv_freq[j];
  float s, c;
  sincosf(ang, &s, &c);
  float* v = p.x + r * p.D;
  float x0 = v[j], x1 = v[j + p.half];
  rope_rotate(x0, x1, c, s);
  v[j] = x0;
  v[j + p.half] = x1;
}

// cache[pos0 + t, w] = bf16_rne(x[t, w]), i.e. cache[pos0*W + e] = x[e] with e = t*W + w.
// x [T, W] f32, cache [maxT, W] bf16. Thread i converts kVec consecutive elements.
struct KvCacheWriteParams {
  const float* x;         // [T, W] f32
  __nv_bfloat16* cache;   // [maxT, W] bf16
  const int32_t* pos;     // [1] i32
  int64_t n;              // T*W
  int64_t W;
};

template <int kVec>
__global__ void kv_cache_write_kernel(const KvCacheWriteParams p) {
  pdl_wait();
  pdl_trigger();
  const int64_t e = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * kVec;
  if (e >= p.n) return;
  __nv_bfloat16* dst = p.cache + int64_t(*p.pos) * p.W + e;
  if constexpr (kVec == 4) {
    const float4 v = *reinterpret_cast<const float4*>(p.x + e);
    const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
    *reinterpret_cast<uint2*>(dst) =
        make_uint2(*reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
  } else {
    *dst = __float2bfloat16_rn(p.x[e]);
  }
}

}  // namespace lily::cuda::attn
