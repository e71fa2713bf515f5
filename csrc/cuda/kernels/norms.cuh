// RMSNorm kernels (device code and their thread count, norm_threads; launchers in norms.cu).
//   rms_norm:        y[r, i] = x[r, i] * s_r * w[i]
//   gated_rms_norm:  y[r, i] = w[i] * (x[r, i] * s_r) * silu(z[r, i])
//   with s_r = 1 / sqrt(mean_i x[r, i]^2 + eps).
// x, z, y [R, D] f32 row-major (y may alias x); w [D] f32.
// fp32 throughout; matches cpu/norms.cpp up to summation order.
// gated_rms_norm_xb: y as the prefill GEMM's bf16 X instead (yb [R, D] BF16, xb_layout.cuh): the same F32
// values, each 8-value block of a row packed as wgx_bf16_kernel packs it (D % 8 == 0, yb 16-byte aligned).
#pragma once
#include "common.cuh"
#include "xb_layout.cuh"

namespace lily::cuda {

struct RmsNormParams {
  const float* x;  // [R, D]
  const float* z;  // [R, D] gate (gated variant only)
  const float* w;  // [D]
  float* y;        // [R, D]
  int R, D;
  float eps;
  uint16_t* yb = nullptr;  // [R, D] BF16 Xb rows instead of y (D % 8 == 0, 16-byte aligned); null: y
};

constexpr int NORM_WARP_ROWS = 8;  // rows of a block when a warp takes a row

// The threads of a row of D values in rms_norm and add_rms_norm (norms.cu): enough to give each a few
// float4s, at most 256 (D = 2048 -> 256, D = 128 -> 32). Their summation order is the one that
// grid_tail_rms_norm and the GEMV's normed input (gemv_mma.cuh, mma_stage_normed_x) reproduce.
__host__ __device__ constexpr int norm_threads(int64_t D) {
  return (D + 7) / 8 <= 32 ? 32 : (D + 7) / 8 <= 64 ? 64 : (D + 7) / 8 <= 128 ? 128 : 256;
}

__device__ __forceinline__ float sq4(float4 v) { return v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w; }

// (x * s) * w as the norm kernels store it: two rounded products (__fmul_rn, so that a consumer that stages
// the result never contracts a product into an FMA with its own sums, which it could not with h from memory).
__device__ __forceinline__ float4 norm_scale4(float4 x, float s, float4 w) {
  return make_float4(__fmul_rn(__fmul_rn(x.x, s), w.x), __fmul_rn(__fmul_rn(x.y, s), w.y),
                     __fmul_rn(__fmul_rn(x.z, s), w.z), __fmul_rn(__fmul_rn(x.w, s), w.w));
}

// 1 / rms of row x[0, D) from its nt threads (tid = 0..nt-1): each sums the squares of float4s (VEC4) or
// floats tid, tid + nt, ... in that order; then warp_sum (WARP: the row's threads are one warp) or
// block_sum. Every one of the row's threads gets it.
template <bool VEC4, bool WARP>
__device__ __forceinline__ float row_inv_rms(const float* x, int D, float eps, int tid, int nt, float* red) {
  float ss = 0.f;
  if constexpr (VEC4) {
    const float4* x4 = reinterpret_cast<const float4*>(x);
    for (int i = tid; i < D / 4; i += nt) ss += sq4(x4[i]);
  } else {
    for (int i = tid; i < D; i += nt) ss += x[i] * x[i];
  }
  ss = WARP ? warp_sum(ss) : block_sum(ss, red);
  return 1.f / sqrtf(ss / float(D) + eps);
}

template <bool GATED>
__device__ __forceinline__ float norm_out(float x, float s, float w, float z) {
  if constexpr (GATED) return w * (x * s) * (z / (1.f + expf(-z)));
  return x * s * w;
}

// A warp's row of rms_norm / gated_rms_norm as Xb (VEC4, D <= 256, D % 8 == 0): lane l takes float4s
// i = l, l + 32 (x, z and w all requested before the reduction: one memory latency a row, where the
// per-block path below reloads x and first asks for z after it), sums the squares in row_inv_rms's order
// (warp_sum of each lane's float4s in increasing i), and each 8-value block j = i / 2 is stored by its two
// lanes, a float4 each: lane 2j packs (v0, v4), (v1, v5) with v4, v5 from lane 2j + 1 (shfl xor 1), which
// packs (v2, v6), (v3, v7): wgx_bf16_kernel's packing, the same bits as the per-block path.
template <bool GATED>
__device__ __forceinline__ void warp_row_xb(const RmsNormParams& p, int64_t off, int lane) {
  const float4* x4 = reinterpret_cast<const float4*>(p.x + off);
  const float4* z4 = reinterpret_cast<const float4*>(GATED ? p.z + off : p.x + off);
  const float4* w4 = reinterpret_cast<const float4*>(p.w);
  const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
  const int n4 = p.D / 4;
  float4 x[2], z[2], w[2];
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int i = lane + 32 * k;
    x[k] = i < n4 ? x4[i] : zero;
    z[k] = i < n4 ? z4[i] : zero;
    w[k] = i < n4 ? w4[i] : zero;
  }
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < 2; ++k)
    if (lane + 32 * k < n4) ss += sq4(x[k]);
  ss = warp_sum(ss);
  const float s = 1.f / sqrtf(ss / float(p.D) + p.eps);
  const bool odd = lane & 1;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int i = lane + 32 * k;
    if (32 * k >= n4) break;  // warp-uniform: the shuffles below need the whole warp
    const float4 v = make_float4(norm_out<GATED>(x[k].x, s, w[k].x, z[k].x), norm_out<GATED>(x[k].y, s, w[k].y, z[k].y),
                                 norm_out<GATED>(x[k].z, s, w[k].z, z[k].z), norm_out<GATED>(x[k].w, s, w[k].w, z[k].w));
    // even lane sends v2, v3 (its partner's low halves); odd lane sends v4, v5 = its v.x, v.y
    const float a = __shfl_xor_sync(0xffffffffu, odd ? v.x : v.z, 1);
    const float b = __shfl_xor_sync(0xffffffffu, odd ? v.y : v.w, 1);
    if (i < n4) {
      const uint2 q = odd ? make_uint2(wg_pack_bf16x2(a, v.z), wg_pack_bf16x2(b, v.w))
                          : make_uint2(wg_pack_bf16x2(v.x, a), wg_pack_bf16x2(v.y, b));
      *reinterpret_cast<uint2*>(p.yb + off + 4 * i) = q;
    }
  }
}

// rms_norm / gated_rms_norm (VEC4: four floats per access; D % 4 == 0 and 16-byte aligned rows).
// ROWS = 1: one block per row, blockDim = norm_threads(D) threads striding over it.
// ROWS = NORM_WARP_ROWS, for D <= 256 (where norm_threads(D) = 32): a warp per row, ROWS rows a block
// (grid ceil(R / ROWS), 32 * ROWS threads), lane l taking what thread l of the 32-thread block did.
// Both mappings give the same bits: each of the row's 32 threads sums the same terms in the same order,
// then the same xor tree (warp_sum); a one-warp block_sum only adds zeros after that (its second warp_sum
// over red[0] and 31 zeros: ss + 0 = ss, as ss >= +0 or NaN), so warp_sum alone is its value. That is
// also the order gdn_decode_mixer and the decode attention kernel reproduce.
template <bool GATED, bool VEC4, int ROWS>
__global__ void __launch_bounds__(ROWS > 1 ? 32 * ROWS : 1024) rms_norm_kernel(RmsNormParams p) {
  pdl_wait();
  pdl_trigger();
  constexpr bool WARP = ROWS > 1;
  __shared__ float red[32];
  const int64_t row = WARP ? int64_t(blockIdx.x) * ROWS + (threadIdx.x >> 5) : int64_t(blockIdx.x);
  if (row >= p.R) return;  // only a warp row's block has rows past R; no barrier below then
  const int tid = WARP ? int(threadIdx.x & 31) : int(threadIdx.x), nt = WARP ? 32 : int(blockDim.x);
  const int64_t off = row * p.D;
  if constexpr (WARP && VEC4) {
    if (p.yb) {  // a warp's row of D <= 256 as Xb: every load before the reduction (see warp_row_xb)
      warp_row_xb<GATED>(p, off, tid);
      return;
    }
  }
  const float s = row_inv_rms<VEC4, WARP>(p.x + off, p.D, p.eps, tid, nt, red);
  if (p.yb) {  // Xb: 8 values a thread, pairs (v_c, v_c+4) packed as wgx_bf16_kernel does, one 16-byte store
    for (int j = tid; j < p.D / 8; j += nt) {
      const int64_t k = off + 8 * j;
      float v[8];
      if constexpr (VEC4) {
        const float4 xl = *reinterpret_cast<const float4*>(p.x + k), xh = *reinterpret_cast<const float4*>(p.x + k + 4);
        const float4 wl = *reinterpret_cast<const float4*>(p.w + 8 * j),
                     wh = *reinterpret_cast<const float4*>(p.w + 8 * j + 4);
        const float4 zl = *reinterpret_cast<const float4*>(GATED ? p.z + k : p.x + k),
                     zh = *reinterpret_cast<const float4*>(GATED ? p.z + k + 4 : p.x + k + 4);
        const float xs[8] = {xl.x, xl.y, xl.z, xl.w, xh.x, xh.y, xh.z, xh.w};
        const float ws[8] = {wl.x, wl.y, wl.z, wl.w, wh.x, wh.y, wh.z, wh.w};
        const float zs[8] = {zl.x, zl.y, zl.z, zl.w, zh.x, zh.y, zh.z, zh.w};
#pragma unroll
        for (int m = 0; m < 8; ++m) v[m] = norm_out<GATED>(xs[m], s, ws[m], zs[m]);
      } else {
#pragma unroll
        for (int m = 0; m < 8; ++m) v[m] = norm_out<GATED>(p.x[k + m], s, p.w[8 * j + m], GATED ? p.z[k + m] : 0.f);
      }
      *reinterpret_cast<uint4*>(p.yb + k) = wg_pack_xb8(v);
    }
    return;
  }
  if constexpr (VEC4) {
    const float4* x4 = reinterpret_cast<const float4*>(p.x + off);
    const float4* w4 = reinterpret_cast<const float4*>(p.w);
    const float4* z4 = reinterpret_cast<const float4*>(GATED ? p.z + off : p.x + off);
    float4* y4 = reinterpret_cast<float4*>(p.y + off);
    for (int i = tid; i < p.D / 4; i += nt) {
      const float4 x = x4[i], w = w4[i], z = z4[i];
      y4[i] = make_float4(norm_out<GATED>(x.x, s, w.x, z.x), norm_out<GATED>(x.y, s, w.y, z.y),
                          norm_out<GATED>(x.z, s, w.z, z.z), norm_out<GATED>(x.w, s, w.w, z.w));
    }
  } else {
    for (int i = tid; i < p.D; i += nt)
      p.y[off + i] = norm_out<GATED>(p.x[off + i], s, p.w[i], GATED ? p.z[off + i] : 0.f);
  }
}

// add_rms_norm: x[r, :] += res[r, :], then y[r, :] = x[r, :] * s_r * w. Each thread adds, writes back
// and squares the same elements it later normalises (same stride and block reduction as
// rms_norm_kernel, so the result is bit-identical to elementwise add then rms_norm). add_rms_norm_xb: y
// also as the prefill GEMM's bf16 X (yb): the same values packed as wgx_bf16_kernel packs y; with y null
// only as yb (a prompt whose readers take only the Xb): x and yb are the same bits, y's stores are skipped.
struct AddRmsNormParams {
  float* x;          // [R, D] residual stream, updated in place
  const float* res;  // [R, D] (add_rms_norm_kernel; a kernel computing the residual's rows passes null)
  const float* w;    // [D]
  float* y;          // [R, D]; null: not written (yb set)
  int D;
  float eps;
  bool res_vec4;     // res 16-byte aligned (the float4 path is chosen by x, w, y, as rms_norm's)
  uint16_t* yb = nullptr;  // [R, D] BF16: y also as Xb rows (D % 8 == 0, 16-byte aligned); null: y only
};

// add_rms_norm of the row at offset off, by the block's nt = blockDim.x = norm_threads(D) threads: thread tid
// adds res(i) into x for its float4s (VEC4; D % 4 == 0, x, w, y 16-byte aligned) or floats i = tid, tid + nt,
// ... and sums the squares of the sums in that order, then block_sum, s = 1 / sqrt(ss / D + eps), y and yb.
// res(i): the residual's float4 or float i of the row, read from memory (add_rms_norm_kernel) or computed
// (moe_routing.cuh's moe_combine_add_rms_norm_kernel: moe_combine's sums); the same arithmetic either way.
// stage (VEC4 only; null: none): the block's shared memory for the row's D / 4 float4s: the sums go there too, and
// the y and yb passes read them there instead of x in global memory (an L2 round trip a row, and yb's scalar
// loads); the same values, so the same bits.
template <bool VEC4, typename Res>
__device__ __forceinline__ void add_rms_norm_row(const AddRmsNormParams& p, int64_t off, const Res& res, float* red,
                                                 float4* stage = nullptr) {
  float ss = 0.f;
  if constexpr (VEC4) {
    float4* x4 = reinterpret_cast<float4*>(p.x + off);
    for (int i = threadIdx.x; i < p.D / 4; i += blockDim.x) {
      const float4 a = x4[i], b = res(i);
      const float4 v = make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
      x4[i] = v;
      if (stage) stage[i] = v;  // after res(i): a res read from stage[i] (the combine's m) is this thread's
      ss += sq4(v);
    }
  } else {
    for (int i = threadIdx.x; i < p.D; i += blockDim.x) {
      const float v = p.x[off + i] + res(i);
      p.x[off + i] = v;
      ss += v * v;
    }
  }
  ss = block_sum(ss, red);
  const float s = 1.f / sqrtf(ss / float(p.D) + p.eps);
  if (p.y != nullptr) {
    if constexpr (VEC4) {
      const float4* x4 = reinterpret_cast<const float4*>(p.x + off);
      const float4* w4 = reinterpret_cast<const float4*>(p.w);
      float4* y4 = reinterpret_cast<float4*>(p.y + off);
      for (int i = threadIdx.x; i < p.D / 4; i += blockDim.x) {
        const float4 x = stage ? stage[i] : x4[i], w = w4[i];
        y4[i] = make_float4(x.x * s * w.x, x.y * s * w.y, x.z * s * w.z, x.w * s * w.w);
      }
    } else {
      for (int i = threadIdx.x; i < p.D; i += blockDim.x) p.y[off + i] = p.x[off + i] * s * p.w[i];
    }
  }
  if (p.yb == nullptr) return;
  // Xb: 8 values a thread (the row's x as updated above: visible after block_sum's barrier for the other
  // threads' elements, and this thread's own writes), y's expression, packed as rms_norm_kernel's yb
  for (int j = threadIdx.x; j < p.D / 8; j += blockDim.x) {
    const int64_t k = off + 8 * j;
    float v[8];
    if constexpr (VEC4) {
      if (stage) {  // float4s 2j, 2j + 1 of the row and of w (w 16-byte aligned on the VEC4 path)
        const float4 xl = stage[2 * j], xh = stage[2 * j + 1];
        const float4 wl = reinterpret_cast<const float4*>(p.w)[2 * j], wh = reinterpret_cast<const float4*>(p.w)[2 * j + 1];
        const float xs[8] = {xl.x, xl.y, xl.z, xl.w, xh.x, xh.y, xh.z, xh.w};
        const float ws[8] = {wl.x, wl.y, wl.z, wl.w, wh.x, wh.y, wh.z, wh.w};
#pragma unroll
        for (int m = 0; m < 8; ++m) v[m] = xs[m] * s * ws[m];
        *reinterpret_cast<uint4*>(p.yb + k) = wg_pack_xb8(v);
        continue;
      }
    }
#pragma unroll
    for (int m = 0; m < 8; ++m) v[m] = p.x[k + m] * s * p.w[8 * j + m];
    *reinterpret_cast<uint4*>(p.yb + k) = wg_pack_xb8(v);
  }
}

// The block's dynamic shared memory in bytes (PTX %dynamic_smem_size): add_rms_norm_kernel stages a row there
// when its launch gave it room for one.
__device__ __forceinline__ uint32_t dynamic_smem_bytes() {
  uint32_t n;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
  return n;
}

// Grid R (a block a row), norm_threads(D) threads; res read as float4s where res_vec4, else as floats.
template <bool VEC4>
__global__ void add_rms_norm_kernel(AddRmsNormParams p) {
  pdl_wait();
  pdl_trigger();
  __shared__ float red[32];
  const int64_t off = int64_t(blockIdx.x) * p.D;
  if constexpr (VEC4) {
    extern __shared__ float4 arn_stage[];  // [D / 4] where the launch gave D * 4 bytes (norms.cu)
    const float4* r4 = reinterpret_cast<const float4*>(p.res + off);
    add_rms_norm_row<true>(p, off, [&](int i) {
      const float* rs = p.res + off + 4 * i;
      return p.res_vec4 ? r4[i] : make_float4(rs[0], rs[1], rs[2], rs[3]);
    }, red, dynamic_smem_bytes() >= uint32_t(p.D) * 4 ? arn_stage : nullptr);
  } else {
    add_rms_norm_row<false>(p, off, [&](int i) { return p.res[off + i]; }, red);
  }
}

// The second half of add_rms_norm run by the last CTA of a grid that has just written x [D] (the residual
// stream after the add), so that the kernel before ops::add_rms_norm's add can fold the whole op into its
// epilogue: y = x * s * w with add_rms_norm_kernel's thread mapping for D (nt = norm_threads(D) threads
// striding over float4s or floats, the same block reduction; threads >= nt add zeros), so the result is
// bit-identical to add_rms_norm. Every thread of every CTA calls it once, after its last store to x;
// done [1] is zero before the grid and after it (the last CTA resets it). x is read through L2 (other
// CTAs wrote it). With float4s and D <= 4 * TAIL_CACHE * nt (the model's D = 2048: two a thread) the
// last CTA loads x and w once, before the reduction, and scales from registers: one L2 round trip
// instead of two, the same sums and products.
struct NormTail {
  float* x;              // [D] the residual row, complete when the last CTA gets here
  const float* w;        // [D]
  float* y;              // [D]
  unsigned* done;        // [1] completion counter
  int D, nt;
  float eps;
  bool vec4;
};

constexpr int TAIL_CACHE = 4;

// The RMSNorm that a consumer kernel applies to its input row while staging it, instead of reading an h
// that a norm kernel or tail wrote: it reads the residual row x and stages h = rms_norm(x) * w in the
// order above, bit for bit (gemv_mma.cuh's mma_stage_normed_x: linear_rms_normed and moe_up;
// moe_router.cuh's staging warp). w == nullptr: the row is h itself.
struct NormIn {
  const float* w;  // [D]
  float eps;
};

__device__ __forceinline__ void grid_tail_rms_norm(const NormTail& n) {
  __shared__ float red[32];
  __shared__ bool last;
  __threadfence();  // this thread's stores to x, before the CTA's arrival
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(n.done, 1u) == gridDim.x * gridDim.y * gridDim.z - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  const int tid = int(threadIdx.x);
  const bool on = tid < n.nt;
  float ss = 0.f;
  if (n.vec4 && n.D / 4 <= TAIL_CACHE * n.nt) {  // x and w in registers: i = tid + j * nt, j ascending
    const float4* x4 = reinterpret_cast<const float4*>(n.x);
    const float4* w4 = reinterpret_cast<const float4*>(n.w);
    float4 xv[TAIL_CACHE], wv[TAIL_CACHE];
#pragma unroll
    for (int j = 0; j < TAIL_CACHE; ++j) {
      const int i = tid + j * n.nt;
      xv[j] = wv[j] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (on && i < n.D / 4) xv[j] = __ldcg(x4 + i), wv[j] = w4[i];
    }
#pragma unroll
    for (int j = 0; j < TAIL_CACHE; ++j)
      if (on && tid + j * n.nt < n.D / 4) ss += sq4(xv[j]);
    ss = block_sum(ss, red);
    const float s = 1.f / sqrtf(ss / float(n.D) + n.eps);
    float4* y4 = reinterpret_cast<float4*>(n.y);
#pragma unroll
    for (int j = 0; j < TAIL_CACHE; ++j) {
      const int i = tid + j * n.nt;
      const float4 x = xv[j], w = wv[j];
      if (on && i < n.D / 4) y4[i] = make_float4(x.x * s * w.x, x.y * s * w.y, x.z * s * w.z, x.w * s * w.w);
    }
    if (tid == 0) *n.done = 0u;
    return;
  }
  if (n.vec4) {
    const float4* x4 = reinterpret_cast<const float4*>(n.x);
    for (int i = tid; on && i < n.D / 4; i += n.nt) ss += sq4(__ldcg(x4 + i));
  } else {
    for (int i = tid; on && i < n.D; i += n.nt) {
      const float v = __ldcg(n.x + i);
      ss += v * v;
    }
  }
  ss = block_sum(ss, red);
  const float s = 1.f / sqrtf(ss / float(n.D) + n.eps);
  if (n.vec4) {
    const float4* x4 = reinterpret_cast<const float4*>(n.x);
    const float4* w4 = reinterpret_cast<const float4*>(n.w);
    float4* y4 = reinterpret_cast<float4*>(n.y);
    for (int i = tid; on && i < n.D / 4; i += n.nt) {
      const float4 x = __ldcg(x4 + i), w = w4[i];
      y4[i] = make_float4(x.x * s * w.x, x.y * s * w.y, x.z * s * w.z, x.w * s * w.w);
    }
  } else {
    for (int i = tid; on && i < n.D; i += n.nt) n.y[i] = __ldcg(n.x + i) * s * n.w[i];
  }
  if (tid == 0) *n.done = 0u;
}

}  // namespace lily::cuda
