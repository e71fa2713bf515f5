// The chunked GDN prefill's prep kernel as it was on main at 776ddbf: one CTA per (chunk, VALUE head),
// grid (num_chunks, Hv), K K^T and Q K^T computed once per value head. Kept only as the baseline of
// benchmarks/gdn_emu.cpp (its workspace must be bit-identical to prep_kernel's) and of
// benchmarks/gdn_lab.cu (timing); the engine runs gdn_chunk::prep_kernel (csrc/cuda/kernels/gdn_chunk.cuh,
// which must be included first: this file uses its helpers). Renamed prep_base_kernel / PrepBaseSmem.
#pragma once

namespace lily::cuda::gdn_chunk {

struct PrepBaseSmem {
  float q[C][LD];   // normalised, scaled q rows
  float k[C][LD];   // normalised k rows
  float A[C][PLD];  // strictly lower (tiles above the diagonal unwritten, never read)
  double G[C];           // cumulative log decay
  float g[C], beta[C], eG[C], rq[C], rk[C];  // g, beta, exp(G) (0 past n), norm factors
};

__global__ void __launch_bounds__(THREADS, 2) prep_base_kernel(Params p) {
  pdl_wait();
  pdl_trigger();
  PrepBaseSmem& sm = *reinterpret_cast<PrepBaseSmem*>(smem());
  const int ch = blockIdx.x, h = blockIdx.y, kh = h / (p.Hv / p.Hk);
  const int t0 = ch * C, n = min(C, p.T - t0);  // tokens [t0, t0 + n) of this chunk
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t Wd = 2 * int64_t(p.Hk) * D + int64_t(p.Hv) * D;  // qkv row width
  float* blk = p.ws + (int64_t(ch) * p.Hv + h) * BLOCK;

  // 1. q and k rows (rows r < 64 are q, r >= 64 are k; warp w does r = w + 8i); gates. Every global
  // load of the phase is issued before the first use of any (one memory latency per warp): the gate
  // inputs of token tid first, the gates computed after the rows.
  float b_in = 0.f, a_in = 0.f, A_log = 0.f, dt_bias = 0.f;
  if (tid < n) {
    const int64_t i = int64_t(t0 + tid) * p.Hv + h;
    b_in = p.b[i];
    a_in = p.a[i];
    A_log = p.A_log[h];
    dt_bias = p.dt_bias[h];
  }
  constexpr int ROWS_PER_WARP = 2 * C / (THREADS / 32);  // 16
  const float q_scale = 1.f / sqrtf(float(D));
  {
    float4 x[ROWS_PER_WARP];
#pragma unroll
    for (int i = 0; i < ROWS_PER_WARP; ++i) {
      const int r = warp + (THREADS / 32) * i, t = r % C, is_k = r / C;
      x[i] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (t < n) x[i] = ld4(p.qkv + (t0 + t) * Wd + is_k * int64_t(p.Hk) * D + int64_t(kh) * D + 4 * lane);
    }
#pragma unroll
    for (int i = 0; i < ROWS_PER_WARP; ++i) {
      const int r = warp + (THREADS / 32) * i, t = r % C, is_k = r / C;
      const float ss = warp_sum(x[i].x * x[i].x + x[i].y * x[i].y + x[i].z * x[i].z + x[i].w * x[i].w);
      const float f = (is_k ? 1.f : q_scale) / sqrtf(ss + 1e-6f);  // rows past n: 0 * f = 0
      st4((is_k ? sm.k[t] : sm.q[t]) + 4 * lane, scale4(f, x[i]));
      if (lane == 0) (is_k ? sm.rk : sm.rq)[t] = f;
    }
  }
  if (tid < C) {
    float beta = 0.f, g = 0.f;
    if (tid < n) {
      beta = 1.f / (1.f + expf(-b_in));
      g = -expf(A_log) * softplus(a_in + dt_bias);
    }
    sm.beta[tid] = beta;
    sm.g[tid] = g;
  }
  __syncthreads();

  // 2. G, exp(G) and the row factors (warp 0; lane l holds tokens 2l, 2l+1)
  if (warp == 0) {
    const double g0 = sm.g[2 * lane], g1 = sm.g[2 * lane + 1];
    double s = g0 + g1;  // inclusive scan of the pair sums
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const double y = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += y;
    }
    double before = __shfl_up_sync(0xffffffffu, s, 1);  // sum of tokens < 2l
    if (lane == 0) before = 0.0;
    sm.G[2 * lane] = before + g0;
    sm.G[2 * lane + 1] = before + g0 + g1;
    __syncwarp();
    const double Gl = sm.G[n - 1];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int t = 2 * lane + u;
      const float eG = t < n ? expf(float(sm.G[t])) : 0.f;
      sm.eG[t] = eG;
      blk[WS_FQ + t] = eG * sm.rq[t];
      blk[WS_FK + t] = t < n ? expf(float(Gl - sm.G[t])) * sm.rk[t] : 0.f;
    }
    if (lane == 0) blk[WS_GC] = expf(float(Gl));
  }
  __syncthreads();

  // 3. K K^T -> A, Q K^T -> P: 40 tiles, warp w takes w, w + 8, ..., w + 32
  {
    const int g = lane >> 2, c = lane & 3;
#pragma unroll 1
    for (int i = 0; i < 5; ++i) {
      const int idx = warp + 8 * i, is_qk = idx >= 20, j = idx - 20 * is_qk;
      const int mt = (j >= 2) + (j >= 6) + (j >= 12), nt = j - mt * (mt + 1);  // tiles of row mt: 2 mt + 2
      const uint32_t xa = saddr(&(is_qk ? sm.q : sm.k)[16 * mt][0]) + 4 * lsm_a<LD>(lane);  // this lane's rows
      const uint32_t xb = saddr(&sm.k[8 * nt][0]) + 4 * lsm_b<LD>(lane);
      float acc[4] = {0.f, 0.f, 0.f, 0.f}, sml[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
      for (int ks = 0; ks < D / 8; ++ks) {  // k-step ks: 8 floats = 32 bytes on
        Split a[4], b0, b1;
        frag_a(a, xa + 32 * ks);
        frag_bt(b0, b1, xb + 32 * ks);
        mma3(acc, sml, a, b0, b1);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[e] += sml[e];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = 16 * mt + g + 8 * (e >> 1), s = 8 * nt + 2 * c + (e & 1);
        if (is_qk) {
          const float dec = (t < n && s <= t) ? expf(float(sm.G[t] - sm.G[s])) : 0.f;
          blk[WS_P + t * C + s] = dec * acc[e];
        } else {
          const float dec = (t < n && s < t) ? expf(float(sm.G[t] - sm.G[s])) : 0.f;  // exponent <= 0
          sm.A[t][s] = sm.beta[t] * dec * acc[e];
        }
      }
    }
  }
  __syncthreads();  // A complete

  // 4. forward substitution, one column per thread
  float xs[C];
  if (tid < D) {  // column tid of beta V
    const float* v = p.qkv + int64_t(t0) * Wd + 2 * int64_t(p.Hk) * D + int64_t(h) * D + tid;
    // every load issued before the first use (one memory latency, not 64: a load under `t < n` was
    // a branch with its use inside); rows past the prompt re-read row n - 1 and are then dropped
#pragma unroll
    for (int t = 0; t < C; ++t) xs[t] = v[min(t, n - 1) * int(Wd)];  // (63 Wd fits in 32 bits)
#pragma unroll
    for (int t = 0; t < C; ++t) {
      const float bv = sm.beta[t] * xs[t];  // (read unconditionally: no predicated shared loads)
      xs[t] = t < n ? bv : 0.f;
    }
  } else {  // column tid - D of beta exp(G) K
#pragma unroll
    for (int t = 0; t < C; ++t) xs[t] = sm.beta[t] * sm.eG[t] * sm.k[t][tid - D];
  }
#pragma unroll
  for (int t = 1; t < C; ++t) {
    float acc = xs[t];
#pragma unroll
    for (int s4 = 0; s4 < C / 4; ++s4) {
      if (4 * s4 < t) {
        const float4 a4 = ld4(&sm.A[t][4 * s4]);
        acc = fmaf(-a4.x, xs[4 * s4], acc);
        if (4 * s4 + 1 < t) acc = fmaf(-a4.y, xs[4 * s4 + 1], acc);
        if (4 * s4 + 2 < t) acc = fmaf(-a4.z, xs[4 * s4 + 2], acc);
        if (4 * s4 + 3 < t) acc = fmaf(-a4.w, xs[4 * s4 + 3], acc);
      }
    }
    xs[t] = acc;
  }
  float* dst = blk + (tid < D ? WS_U + tid : WS_W + tid - D);
#pragma unroll
  for (int t = 0; t < C; ++t) dst[t * D] = xs[t];
}

}  // namespace lily::cuda::gdn_chunk
