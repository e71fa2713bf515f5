// Causal GQA attention for any head_dim (tiny test configs whose D the tensor-core kernels do
// not instantiate), one pass with an online softmax over 128-key chunks.
//   o[t, h, :] = sum_{j <= pos0+t} softmax_j(q[t, h, :] . k[j, kvh, :] / sqrt(D)) v[j, kvh, :],
//   kvh = h / group. Matches cpu::attention.
// q, o [T, nH*D] f32; k_cache, v_cache [maxT, nKV*D] bf16; pos [1] i32 on the device.
// Grid T*nH (one CTA per (t, h)), 128 threads: thread i scores key j0 + i of each chunk, then
// thread i accumulates dims i, i + 128, ... of o. All arithmetic fp32.
// Shared: q [D], o [D], p [128] f32 (dynamic, (2 D + 128) floats).
#pragma once
#include "attention_mma.cuh"
#include "common.cuh"

namespace lily::cuda::attn {

constexpr int kGenericThreads = 128;

struct GenericParams {
  const float* q;        // [T, nH*D] f32
  const bf16* k_cache;   // [maxT, nKV*D] bf16
  const bf16* v_cache;   // [maxT, nKV*D] bf16
  float* o;              // [T, nH*D] f32
  const int32_t* pos;    // [1] i32
  int nH, nKV, group, D;
  float scale_log2;      // log2(e) / sqrt(D)
};

__global__ void __launch_bounds__(kGenericThreads) attention_generic_kernel(const GenericParams p) {
  pdl_wait();
  pdl_trigger();
  extern __shared__ float gsmem[];
  float* q_s = gsmem;          // [D]
  float* o_s = q_s + p.D;      // [D]
  float* p_s = o_s + p.D;      // [kGenericThreads]
  __shared__ float red[32];
  const int row = blockIdx.x, t = row / p.nH, h = row % p.nH, kvh = h / p.group, tid = threadIdx.x;
  const int n = *p.pos + t + 1;  // visible keys
  const int64_t row_stride = int64_t(p.nKV) * p.D;
  const bf16* k_head = p.k_cache + int64_t(kvh) * p.D;
  const bf16* v_head = p.v_cache + int64_t(kvh) * p.D;
  for (int d = tid; d < p.D; d += kGenericThreads) {
    q_s[d] = p.q[int64_t(row) * p.D + d];
    o_s[d] = 0.f;
  }
  __syncthreads();
  float run_m = -INFINITY, run_l = 0.f;
  for (int j0 = 0; j0 < n; j0 += kGenericThreads) {
    const int j = j0 + tid;
    float s = -INFINITY;
    if (j < n) {
      const bf16* k = k_head + int64_t(j) * row_stride;
      float dot = 0.f;
      for (int d = 0; d < p.D; ++d) dot += q_s[d] * __bfloat162float(k[d]);
      s = dot * p.scale_log2;
    }
    const float m_new = fmaxf(run_m, block_max(s, red));  // key 0 is visible: finite
    const float alpha = exp2f(run_m - m_new), pj = exp2f(s - m_new);
    run_l = run_l * alpha + block_sum(pj, red);
    run_m = m_new;
    p_s[tid] = pj;
    __syncthreads();
    const int len = min(kGenericThreads, n - j0);
    for (int d = tid; d < p.D; d += kGenericThreads) {
      float acc = o_s[d] * alpha;
      for (int i = 0; i < len; ++i) acc += p_s[i] * __bfloat162float(v_head[int64_t(j0 + i) * row_stride + d]);
      o_s[d] = acc;
    }
    __syncthreads();
  }
  for (int d = tid; d < p.D; d += kGenericThreads) p.o[int64_t(row) * p.D + d] = o_s[d] / run_l;
}

}  // namespace lily::cuda::attn
