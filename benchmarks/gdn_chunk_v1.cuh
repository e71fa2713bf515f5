// LAB ONLY: a frozen copy of csrc/cuda/kernels/gdn_chunk.cuh as of commit f946c8c (the fp32 SIMT
// chunked GDN kernels), in namespace lily::cuda::gdn_v1, so benchmarks/gdn_lab.cu can time the old
// kernels next to the tensor-core ones. Not built into the library.
// Chunked (WY) Gated DeltaNet prefill (device code only; launcher in gated_delta.cu). The algebra
// is derived in docs/gdn-prefill.md; the result matches the sequential cpu/gated_delta.cpp.
// Per value head h (key head kh = h / (Hv/Hk)), chunks of C = 64 tokens, state S [Dk, Dv] at the
// chunk's start, rows = tokens of the chunk (q, k L2-normalised, q also scaled by 1/sqrt(Dk)):
//   G_t = sum_{s<=t} g_s (log of the cumulative decay),  beta_t = sigmoid(b_t)
//   A[t, s] = beta_t exp(G_t - G_s) (k_t . k_s) for s < t (else 0);   Tinv = (I + A)^-1
//   U = Tinv (beta * V),  W = Tinv ((beta exp(G)) * K),  P[t, s] = exp(G_t - G_s) (q_t . k_s), s <= t
//   Delta = U - W S;  O = (exp(G) * Q) S + P Delta;  S <- exp(G_last) S + (exp(G_last - G) * K)^T Delta
// Two kernels: gdn_chunk_prep (parallel over chunks and heads) writes U, W, P, exp(G) * Q,
// exp(G_last - G) * K and exp(G_last) to a workspace; gdn_chunk_scan runs the chunks in order.
// Only Dk = Dv = 128 (the model's); fp32 SIMT FMA throughout (no tensor cores yet), G in fp64.
#pragma once
#include "cuda/kernels/gated_delta.cuh"

namespace lily::cuda::gdn_v1 {

constexpr int GDNC_C = 64;         // tokens per chunk
constexpr int GDNC_D = 128;        // Dk = Dv
constexpr int GDNC_THREADS = 256;  // both kernels
constexpr int GDNC_COLS = 32;      // state columns per scan CTA
constexpr int GDNC_LD = GDNC_D + 4;   // padded shared row of a [C, D] tile read by 4 rows per warp
constexpr int GDNC_PLD = GDNC_C + 4;  // padded shared row of a [C, C] tile

// Workspace: one block of GDNC_BLOCK floats per (chunk c, value head h) at (c * Hv + h) * GDNC_BLOCK,
// every tile row-major with rows = the chunk's tokens; rows past the end of the prompt are zeros.
constexpr int GDNC_QT = 0;                                // [C, D] exp(G_t) q_t
constexpr int GDNC_KD = GDNC_C * GDNC_D;                  // [C, D] exp(G_last - G_t) k_t
constexpr int GDNC_W = 2 * GDNC_C * GDNC_D;               // [C, D] W
constexpr int GDNC_U = 3 * GDNC_C * GDNC_D;               // [C, D] U
constexpr int GDNC_P = 4 * GDNC_C * GDNC_D;               // [C, C] P (zero above the diagonal)
constexpr int GDNC_GC = GDNC_P + GDNC_C * GDNC_C;         // exp(G_last), then 3 floats of padding
constexpr int GDNC_BLOCK = GDNC_GC + 4;                   // floats; a multiple of 4 (16-byte blocks)

struct GdnChunkParams {
  const float* qkv;      // [T, 2*Hk*D + Hv*D]
  const float* a;        // [T, Hv]
  const float* b;        // [T, Hv]
  const float* A_log;    // [Hv]
  const float* dt_bias;  // [Hv]
  float* state;          // [Hv, D, D] (k-major), read and written once per call
  float* o;              // [T, Hv*D]
  float* ws;             // [num_chunks * Hv * GDNC_BLOCK]
  int T, Hk, Hv, num_chunks;
};

__device__ __forceinline__ float4 gdnc_ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ void gdnc_st4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
__device__ __forceinline__ float4 gdnc_scale4(float f, float4 v) { return make_float4(f * v.x, f * v.y, f * v.z, f * v.w); }
// acc + f * v, per component
__device__ __forceinline__ float4 gdnc_fma4(float f, float4 v, float4 acc) {
  return make_float4(fmaf(f, v.x, acc.x), fmaf(f, v.y, acc.y), fmaf(f, v.z, acc.z), fmaf(f, v.w, acc.w));
}
__device__ __forceinline__ float gdnc_dot4(float4 x, float4 y, float acc) {
  return fmaf(x.w, y.w, fmaf(x.z, y.z, fmaf(x.y, y.y, fmaf(x.x, y.x, acc))));
}

// ---------------------------------------------------------------------------------------------
// gdn_chunk_prep: one CTA per (chunk c, value head h), grid (num_chunks, Hv), block 256, 2 CTAs/SM.
//   1. beta, g of the chunk's n <= 64 tokens (threads 0..63); q, k rows loaded and L2-normalised
//      (a warp per row, a float4 per lane), staged in shared memory; rows >= n are zeros.
//   2. G = inclusive prefix sum of g in fp64 (warp 0 shuffle scan): exp(G_t - G_s) is formed from an
//      fp64 difference, so a chunk whose early tokens decay hard (G ~ -1000) keeps exact late decays.
//   3. exp(G) q and exp(G_last - G) k to the workspace.
//   4. K K^T then Q K^T [64, 64]: thread (ty, tx) = (tid / 16, tid % 16) owns rows ty + 16i, columns
//      tx + 16j (i, j < 4), float4 steps over Dk. A (strictly lower) goes to shared memory, P (lower,
//      with the diagonal) to the workspace; exp of a positive exponent is never taken.
//   5. (I + A) [U | W] = [beta V | beta exp(G) K] by forward substitution: thread c < 128 owns column
//      c of U (V read from global memory), thread c >= 128 column c - 128 of W; the column's 64
//      values stay in registers (loops fully unrolled), A rows are shared-memory broadcasts.
// fp32; the prefix sum and the exponent differences fp64. Rows >= n of every output tile are zeros
// (zero q, k, beta and decay factors), so the scan needs no masks but on its writes of o.
struct GdnPrepSmem {
  float q[GDNC_C][GDNC_LD];   // normalised, scaled q rows
  float k[GDNC_C][GDNC_LD];   // normalised k rows
  float A[GDNC_C][GDNC_PLD];  // strictly lower
  double G[GDNC_C];           // cumulative log decay
  float g[GDNC_C], beta[GDNC_C], eG[GDNC_C], eGl[GDNC_C];  // g, beta, exp(G), exp(G_last - G); 0 past n
};

// acc[i][j] = x_{ty+16i} . k_{tx+16j} over the D columns of two [64, D] shared tiles (rows padded
// to GDNC_LD: the 16 rows tx + 16j of a warp's float4 loads fall in distinct banks per 8 lanes).
__device__ __forceinline__ void gdnc_gram(float (&acc)[4][4], const float (*x)[GDNC_LD], const float (*k)[GDNC_LD],
                                          int ty, int tx) {
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
#pragma unroll 2
  for (int d = 0; d < GDNC_D; d += 4) {
    float4 xa[4], kb[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      xa[i] = gdnc_ld4(&x[ty + 16 * i][d]);
      kb[i] = gdnc_ld4(&k[tx + 16 * i][d]);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] = gdnc_dot4(xa[i], kb[j], acc[i][j]);
  }
}

__global__ void __launch_bounds__(GDNC_THREADS, 2) gdn_chunk_prep_kernel(GdnChunkParams p) {
  pdl_wait();
  pdl_trigger();
  constexpr int C = GDNC_C, D = GDNC_D;
  extern __shared__ __align__(16) unsigned char gdnc_prep_smem[];
  GdnPrepSmem& sm = *reinterpret_cast<GdnPrepSmem*>(gdnc_prep_smem);
  const int ch = blockIdx.x, h = blockIdx.y, kh = h / (p.Hv / p.Hk);
  const int t0 = ch * C, n = min(C, p.T - t0);  // tokens [t0, t0 + n) of this chunk
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t Wd = 2 * int64_t(p.Hk) * D + int64_t(p.Hv) * D;  // qkv row width
  float* blk = p.ws + (int64_t(ch) * p.Hv + h) * GDNC_BLOCK;

  // 1. gates; q and k rows (rows r < 64 are q, r >= 64 are k; warp w does r = w + 8i)
  if (tid < C) {
    float beta = 0.f, g = 0.f;
    if (tid < n) {
      const int64_t i = int64_t(t0 + tid) * p.Hv + h;
      beta = 1.f / (1.f + expf(-p.b[i]));
      g = -expf(p.A_log[h]) * softplus(p.a[i] + p.dt_bias[h]);
    }
    sm.beta[tid] = beta;
    sm.g[tid] = g;
  }
  constexpr int ROWS_PER_WARP = 2 * C / (GDNC_THREADS / 32), BATCH = 8;  // 16 rows, loads 8 at a time
  const float q_scale = 1.f / sqrtf(float(D));
#pragma unroll
  for (int i0 = 0; i0 < ROWS_PER_WARP; i0 += BATCH) {
    float4 x[BATCH];  // the batch's loads all in flight before the first reduction
#pragma unroll
    for (int i = 0; i < BATCH; ++i) {
      const int r = warp + (GDNC_THREADS / 32) * (i0 + i), t = r % C, is_k = r / C;
      x[i] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (t < n) x[i] = gdnc_ld4(p.qkv + (t0 + t) * Wd + is_k * int64_t(p.Hk) * D + int64_t(kh) * D + 4 * lane);
    }
#pragma unroll
    for (int i = 0; i < BATCH; ++i) {
      const int r = warp + (GDNC_THREADS / 32) * (i0 + i), t = r % C, is_k = r / C;
      const float ss = warp_sum(x[i].x * x[i].x + x[i].y * x[i].y + x[i].z * x[i].z + x[i].w * x[i].w);
      const float f = (is_k ? 1.f : q_scale) / sqrtf(ss + 1e-6f);  // rows past n: 0 * f = 0
      gdnc_st4((is_k ? sm.k[t] : sm.q[t]) + 4 * lane, gdnc_scale4(f, x[i]));
    }
  }
  __syncthreads();

  // 2. G and the decay factors (warp 0; lane l holds tokens 2l, 2l+1)
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
      sm.eG[t] = t < n ? expf(float(sm.G[t])) : 0.f;
      sm.eGl[t] = t < n ? expf(float(Gl - sm.G[t])) : 0.f;
    }
    if (lane == 0) blk[GDNC_GC] = expf(float(Gl));
  }
  __syncthreads();

  // 3. exp(G) q and exp(G_last - G) k: 2 x 64 rows x 32 float4
#pragma unroll
  for (int i = 0; i < 2 * C * (D / 4) / GDNC_THREADS; ++i) {
    const int idx = tid + GDNC_THREADS * i, is_k = idx / (C * D / 4), r = (idx / (D / 4)) % C, c4 = idx % (D / 4);
    const float4 v = is_k ? gdnc_scale4(sm.eGl[r], gdnc_ld4(&sm.k[r][4 * c4])) : gdnc_scale4(sm.eG[r], gdnc_ld4(&sm.q[r][4 * c4]));
    gdnc_st4(blk + (is_k ? GDNC_KD : GDNC_QT) + r * D + 4 * c4, v);
  }

  // 4. K K^T -> A, then Q K^T -> P (one at a time: 16 accumulators)
  const int ty = tid >> 4, tx = tid & 15;
  float acc[4][4];
  gdnc_gram(acc, sm.k, sm.k, ty, tx);
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int t = ty + 16 * i, s = tx + 16 * j;
      const float e = (t < n && s < t) ? expf(float(sm.G[t] - sm.G[s])) : 0.f;  // exponent <= 0
      sm.A[t][s] = sm.beta[t] * e * acc[i][j];
    }
  gdnc_gram(acc, sm.q, sm.k, ty, tx);
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int t = ty + 16 * i, s = tx + 16 * j;
      const float e = (t < n && s <= t) ? expf(float(sm.G[t] - sm.G[s])) : 0.f;
      blk[GDNC_P + t * C + s] = e * acc[i][j];
    }
  __syncthreads();  // A complete

  // 5. forward substitution, one column per thread
  float xs[C];
  if (tid < D) {  // column tid of beta V
    const float* v = p.qkv + int64_t(t0) * Wd + 2 * int64_t(p.Hk) * D + int64_t(h) * D + tid;
#pragma unroll
    for (int t = 0; t < C; ++t) xs[t] = t < n ? sm.beta[t] * v[t * Wd] : 0.f;
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
        const float4 a4 = gdnc_ld4(&sm.A[t][4 * s4]);
        acc = fmaf(-a4.x, xs[4 * s4], acc);
        if (4 * s4 + 1 < t) acc = fmaf(-a4.y, xs[4 * s4 + 1], acc);
        if (4 * s4 + 2 < t) acc = fmaf(-a4.z, xs[4 * s4 + 2], acc);
        if (4 * s4 + 3 < t) acc = fmaf(-a4.w, xs[4 * s4 + 3], acc);
      }
    }
    xs[t] = acc;
  }
  float* dst = blk + (tid < D ? GDNC_U + tid : GDNC_W + tid - D);
#pragma unroll
  for (int t = 0; t < C; ++t) dst[t * D] = xs[t];
}

// ---------------------------------------------------------------------------------------------
// gdn_chunk_scan: one CTA per (value head h, slice of 32 state columns j0 = 32 * blockIdx.y), grid
// (Hv, D/32), block 256; loops over the chunks in order. Columns of S are independent here, so the
// CTA needs only its [128, 32] slice of S and of U. Per chunk, with tiles in shared memory:
//   (a) Delta [64, 32] = U - W S             thread (rg, cg) = (tid / 8, tid % 8): rows rg, rg + 32,
//   (b) O [64, 32] = (exp(G) Q) S + P Delta    columns 4cg..4cg+3 (float4), written to o (rows < T)
//   (c) S [128, 32] <- exp(G_last) S + (exp(G_last - G) K)^T Delta: rows 4rg..4rg+3, columns 4cg..
//       of S in registers (16 floats), copied to shared memory for the next (a), (b).
// Tiles arrive by cp.async, each as soon as the phase reading it is done: W and U during (b), (c)
// of the previous chunk, Q and P during (c) and (a), K during (a) and (b) (one commit group per
// tile set, always committed, so wait_group 2 before a phase means its own group has landed).
// P is zero above the diagonal, so row rg < 32 of O sums Delta rows 0..31 only. fp32.
struct GdnScanSmem {
  float W[GDNC_C][GDNC_LD];
  float Q[GDNC_C][GDNC_LD];      // exp(G) q
  float K[GDNC_C][GDNC_D];       // exp(G_last - G) k
  float P[GDNC_C][GDNC_PLD];
  float U[GDNC_C][GDNC_COLS];    // this CTA's columns of U
  float S[GDNC_D][GDNC_COLS];    // this CTA's columns of S
  float Dl[GDNC_C][GDNC_COLS];   // Delta
};

__device__ __forceinline__ void gdnc_cp16(float* dst, const float* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
               "l"(src)
               : "memory");
}
__device__ __forceinline__ void gdnc_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void gdnc_wait2() { asm volatile("cp.async.wait_group 2;\n" ::: "memory"); }

// [64, 128] workspace tile -> shared rows of `ld` floats: 2048 float4, 8 per thread.
template <int LD>
__device__ __forceinline__ void gdnc_copy_tile(float (*dst)[LD], const float* src) {
#pragma unroll
  for (int i = 0; i < GDNC_C * GDNC_D / 4 / GDNC_THREADS; ++i) {
    const int idx = threadIdx.x + GDNC_THREADS * i, r = idx / (GDNC_D / 4), c4 = idx % (GDNC_D / 4);
    gdnc_cp16(&dst[r][4 * c4], src + r * GDNC_D + 4 * c4);
  }
}

__device__ __forceinline__ void gdnc_issue_wu(GdnScanSmem& sm, const float* blk, int j0) {
  gdnc_copy_tile<GDNC_LD>(sm.W, blk + GDNC_W);
#pragma unroll
  for (int i = 0; i < GDNC_C * GDNC_COLS / 4 / GDNC_THREADS; ++i) {  // U columns [j0, j0 + 32)
    const int idx = threadIdx.x + GDNC_THREADS * i, r = idx / (GDNC_COLS / 4), c4 = idx % (GDNC_COLS / 4);
    gdnc_cp16(&sm.U[r][4 * c4], blk + GDNC_U + r * GDNC_D + j0 + 4 * c4);
  }
}

__device__ __forceinline__ void gdnc_issue_qp(GdnScanSmem& sm, const float* blk) {
  gdnc_copy_tile<GDNC_LD>(sm.Q, blk + GDNC_QT);
#pragma unroll
  for (int i = 0; i < GDNC_C * GDNC_C / 4 / GDNC_THREADS; ++i) {
    const int idx = threadIdx.x + GDNC_THREADS * i, r = idx / (GDNC_C / 4), c4 = idx % (GDNC_C / 4);
    gdnc_cp16(&sm.P[r][4 * c4], blk + GDNC_P + r * GDNC_C + 4 * c4);
  }
}

__global__ void __launch_bounds__(GDNC_THREADS, 1) gdn_chunk_scan_kernel(GdnChunkParams p) {
  pdl_wait();
  pdl_trigger();
  constexpr int C = GDNC_C, D = GDNC_D;
  extern __shared__ __align__(16) unsigned char gdnc_scan_smem[];
  GdnScanSmem& sm = *reinterpret_cast<GdnScanSmem*>(gdnc_scan_smem);
  const int h = blockIdx.x, j0 = blockIdx.y * GDNC_COLS, tid = threadIdx.x;
  const int cg = tid & 7, rg = tid >> 3;
  const int64_t o_row = int64_t(p.Hv) * D;
  float* Sg = p.state + int64_t(h) * D * D + j0 + 4 * cg;  // S[h][.][j0 + 4cg], row stride D
  float4 s[4];                                             // S rows 4rg..4rg+3, columns 4cg..
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    s[i] = gdnc_ld4(Sg + (4 * rg + i) * D);
    gdnc_st4(&sm.S[4 * rg + i][4 * cg], s[i]);
  }
  auto block_of = [&](int c) { return p.ws + (int64_t(c) * p.Hv + h) * GDNC_BLOCK; };
  gdnc_issue_wu(sm, block_of(0), j0);
  gdnc_commit();
  gdnc_issue_qp(sm, block_of(0));
  gdnc_commit();
  gdnc_copy_tile<GDNC_D>(sm.K, block_of(0) + GDNC_KD);
  gdnc_commit();
  for (int c = 0; c < p.num_chunks; ++c) {
    const float* blk = block_of(c);
    const bool more = c + 1 < p.num_chunks;
    const float gC = blk[GDNC_GC];
    const int n = min(C, p.T - c * C);
    gdnc_wait2();
    __syncthreads();  // W, U of chunk c landed; S of the previous chunk in shared memory

    // (a) Delta = U - W S
    float4 d0 = gdnc_ld4(&sm.U[rg][4 * cg]), d1 = gdnc_ld4(&sm.U[rg + 32][4 * cg]);
#pragma unroll 4
    for (int k = 0; k < D; k += 4) {
      const float4 w0 = gdnc_ld4(&sm.W[rg][k]), w1 = gdnc_ld4(&sm.W[rg + 32][k]);
      const float4 s0 = gdnc_ld4(&sm.S[k][4 * cg]), s1 = gdnc_ld4(&sm.S[k + 1][4 * cg]);
      const float4 s2 = gdnc_ld4(&sm.S[k + 2][4 * cg]), s3 = gdnc_ld4(&sm.S[k + 3][4 * cg]);
      d0 = gdnc_fma4(-w0.x, s0, d0), d1 = gdnc_fma4(-w1.x, s0, d1);
      d0 = gdnc_fma4(-w0.y, s1, d0), d1 = gdnc_fma4(-w1.y, s1, d1);
      d0 = gdnc_fma4(-w0.z, s2, d0), d1 = gdnc_fma4(-w1.z, s2, d1);
      d0 = gdnc_fma4(-w0.w, s3, d0), d1 = gdnc_fma4(-w1.w, s3, d1);
    }
    gdnc_st4(&sm.Dl[rg][4 * cg], d0);
    gdnc_st4(&sm.Dl[rg + 32][4 * cg], d1);
    __syncthreads();  // Delta complete; W, U free
    if (more) gdnc_issue_wu(sm, block_of(c + 1), j0);
    gdnc_commit();
    gdnc_wait2();
    __syncthreads();  // Q, P of chunk c landed

    // (b) O = (exp(G) Q) S + P Delta
    float4 o0 = make_float4(0.f, 0.f, 0.f, 0.f), o1 = o0;
#pragma unroll 4
    for (int k = 0; k < D; k += 4) {
      const float4 q0 = gdnc_ld4(&sm.Q[rg][k]), q1 = gdnc_ld4(&sm.Q[rg + 32][k]);
      const float4 s0 = gdnc_ld4(&sm.S[k][4 * cg]), s1 = gdnc_ld4(&sm.S[k + 1][4 * cg]);
      const float4 s2 = gdnc_ld4(&sm.S[k + 2][4 * cg]), s3 = gdnc_ld4(&sm.S[k + 3][4 * cg]);
      o0 = gdnc_fma4(q0.x, s0, o0), o1 = gdnc_fma4(q1.x, s0, o1);
      o0 = gdnc_fma4(q0.y, s1, o0), o1 = gdnc_fma4(q1.y, s1, o1);
      o0 = gdnc_fma4(q0.z, s2, o0), o1 = gdnc_fma4(q1.z, s2, o1);
      o0 = gdnc_fma4(q0.w, s3, o0), o1 = gdnc_fma4(q1.w, s3, o1);
    }
#pragma unroll 4
    for (int t = 0; t < C / 2; t += 4) {  // Delta rows 0..31: both rows
      const float4 p0 = gdnc_ld4(&sm.P[rg][t]), p1 = gdnc_ld4(&sm.P[rg + 32][t]);
      const float4 e0 = gdnc_ld4(&sm.Dl[t][4 * cg]), e1 = gdnc_ld4(&sm.Dl[t + 1][4 * cg]);
      const float4 e2 = gdnc_ld4(&sm.Dl[t + 2][4 * cg]), e3 = gdnc_ld4(&sm.Dl[t + 3][4 * cg]);
      o0 = gdnc_fma4(p0.x, e0, o0), o1 = gdnc_fma4(p1.x, e0, o1);
      o0 = gdnc_fma4(p0.y, e1, o0), o1 = gdnc_fma4(p1.y, e1, o1);
      o0 = gdnc_fma4(p0.z, e2, o0), o1 = gdnc_fma4(p1.z, e2, o1);
      o0 = gdnc_fma4(p0.w, e3, o0), o1 = gdnc_fma4(p1.w, e3, o1);
    }
#pragma unroll 4
    for (int t = C / 2; t < C; t += 4) {  // Delta rows 32..63: only row rg + 32 (P[rg][t] = 0)
      const float4 p1 = gdnc_ld4(&sm.P[rg + 32][t]);
      o1 = gdnc_fma4(p1.x, gdnc_ld4(&sm.Dl[t][4 * cg]), o1);
      o1 = gdnc_fma4(p1.y, gdnc_ld4(&sm.Dl[t + 1][4 * cg]), o1);
      o1 = gdnc_fma4(p1.z, gdnc_ld4(&sm.Dl[t + 2][4 * cg]), o1);
      o1 = gdnc_fma4(p1.w, gdnc_ld4(&sm.Dl[t + 3][4 * cg]), o1);
    }
    float* out = p.o + int64_t(c) * C * o_row + int64_t(h) * D + j0 + 4 * cg;  // row 0 of the chunk
    if (rg < n) gdnc_st4(out + rg * o_row, o0);
    if (rg + 32 < n) gdnc_st4(out + (rg + 32) * o_row, o1);
    __syncthreads();  // Q, P and S in shared memory free
    if (more) gdnc_issue_qp(sm, block_of(c + 1));
    gdnc_commit();
    gdnc_wait2();
    __syncthreads();  // K of chunk c landed

    // (c) S <- exp(G_last) S + (exp(G_last - G) K)^T Delta
#pragma unroll
    for (int i = 0; i < 4; ++i) s[i] = gdnc_scale4(gC, s[i]);
#pragma unroll 4
    for (int t = 0; t < C; ++t) {
      const float4 kd = gdnc_ld4(&sm.K[t][4 * rg]), e = gdnc_ld4(&sm.Dl[t][4 * cg]);
      s[0] = gdnc_fma4(kd.x, e, s[0]);
      s[1] = gdnc_fma4(kd.y, e, s[1]);
      s[2] = gdnc_fma4(kd.z, e, s[2]);
      s[3] = gdnc_fma4(kd.w, e, s[3]);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) gdnc_st4(&sm.S[4 * rg + i][4 * cg], s[i]);
    __syncthreads();  // K free
    if (more) gdnc_copy_tile<GDNC_D>(sm.K, block_of(c + 1) + GDNC_KD);
    gdnc_commit();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) gdnc_st4(Sg + (4 * rg + i) * D, s[i]);
}

}  // namespace lily::cuda::gdn_v1
