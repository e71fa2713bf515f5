// A decode layer's output projection and its MoE router in one kernel (ops::linear_add_route), and the
// load-time kernels that fold the router through that projection.
//
// Equation (one token). The block before the MoE adds x' = x + O a to the residual row x (O [H, A] the
// output projection, a [A] its input), and the MoE router reads h = rms_norm(x') * w_post
// = s * diag(w_post) x' with s = 1 / sqrt(mean(x'^2) + eps) (w_post: the stored 1 + w multiplier). So
//   logits = Wr h = s * (W x + M a),   W = [Wr; Wg] diag(w_post) [R, H],   M = W O [R, A]
// for the router's E rows and the shared-expert gate's one row (R = E + 1). W x + M a needs only x and a,
// both known when the projection starts: the router leaves the MoE block's dependent chain.
//
// Fold (load time, route_fold_w_kernel, route_fold_m_kernel): WM = [W | M] F32 [R, C], C = H + A, row-major.
// W[r, c] = fp32(dequant(Wr or Wg)[r, c] * w_post[c]) (dequant_at: the CPU's fp32 scale * q + bias, maybe as an FMA);
// M[r, j] = fp32(sum_i W[r, i] * dequant(O)[i, j]) over the stored fp32 W, accumulated in fp64 (correctly
// rounded to ~1 ulp; M's entries then differ from an exact W O by fp32 rounding only).
// route_fold_m_kernel: grid (ceil(A / 256), ceil(R / 16)), 256 threads; thread t owns column j = 256 bx + t and
// rows 16 by .. + 15 (fp64 accumulators); per 32-value step of i the CTA stages W's 16 x 32 block in shared
// memory and each thread dequantizes its 32 values of O's column j.
//
// Decode (linear_route_kernel, grid (G, 2) of MMA_THREADS threads, G >= linear_add's plan's CTAs and >= the
// router CTAs):
//  - row y = 0: linear_gemv_mma_kernel's body (gemv_mma.cuh, linear_gemv_mma_cta: passes over gridDim.x CTAs)
//    over O with linear_add's K split (its sums; which CTA runs a tile does not change them), writing y = O a to
//    the work row tmp (not adding into x: the router CTAs read the pre-add x).
//  - row y = 1: part sums of WM [x ; a]. Columns come in P = C / ROUTE_PART parts of 512
//    (parts < H / 512 read x, the others a); router warp g (= 8 blockIdx.x + warp) takes part
//    p = g % P and rows q, q + Q, ... (q = g / P < Q, at most rpw of them, below R; Q * rpw >= R; warps with
//    q >= Q idle). Lane l holds float4s l, l + 32, l + 64, l + 96 of the part (a warp's load is 512
//    contiguous bytes), loaded for all its rows before pdl_wait (constant weights), then its 16 input values
//    after it; a row's part sum is 16 fmas in value order a lane, then warp_sum's xor tree, stored by lane 0
//    into partial[p][r].
//  - Every CTA, after its stores: the last to arrive on `done` (grid_tail_rms_norm's fence and counter) runs
//    the tail with 256 threads: x' = x + y float4 by float4 (thread t: float4s t, t + 256, ..., loaded in
//    one round; the add of linear_add's epilogue, so x' is linear_add's bit for bit), its squares in that
//    order and block_sum (rms_norm's order at H = 2048: s has rms_norm's bits); logit r = (sum over parts p
//    ascending of partial[p][r], loaded in one round) * s into shared memory; warp 0 runs moe_topk_warp
//    (softmax, top-k, renormalise) into the routing words moe_up reads, warp 1 the shared gate's sigmoid of
//    logit E; thread 0 resets `done`.
// Precision: fp32 sums over 6,144 terms in another factorisation than the router GEMV's over h (W x + M a,
// then * s, against Wr ((x' s) w)): differences of fp32 rounding relative to |W| |x| + |M| |a| (~1e-6 of the
// logits' scale; tests/test_route_fold.py). The top-k can differ from the CPU's on near-ties.
#pragma once
#include "gemv_mma.cuh"
#include "linear_common.cuh"
#include "moe_topk.cuh"

namespace lily::cuda {

constexpr int ROUTE_PART = 512;                // columns of [x ; a] a router warp's part holds
constexpr int ROUTE_F4 = ROUTE_PART / 128;     // float4s a lane holds
constexpr int ROUTE_MAX_RPW = 4;               // rows a router warp takes at most
constexpr int ROUTE_MAX_EXPERTS = 256;         // moe_topk_warp<8>
constexpr int ROUTE_MAX_PARTS = 16;            // the tail loads a row's part sums at once: H + A <= 8192
constexpr int ROUTE_TAIL_F4 = 4;               // and x, y in one round: H <= 4 * 4 * MMA_THREADS = 4096
constexpr int ROUTE_FOLD_ROWS = 16, ROUTE_FOLD_COLS = 256, ROUTE_FOLD_STEP = 32;  // route_fold_m_kernel's tile

struct RouteParams {
  const float* wm;      // [R, H + A] F32: [W | M]
  float* x;             // [H] the residual row: read before the add, x' = x + y after it
  const float* a;       // [A] the projection's input
  const float* y;       // [H] the projection's output O a (the work row)
  float* partial;       // [P, R] the router warps' part sums
  int32_t* topk_id;     // [K] chosen experts, ascending id
  float* topk_w;        // [K] their renormalised weights
  float* shared_gate;   // [1] sigmoid of the gate logit
  unsigned* done;       // [1] completion counter, zero before and after
  int R, H, A, P, Q, rpw, E, K;
  float eps;
};

struct LinearRouteParams {
  MmaLinearParams lin;  // y = O a into the work row (accumulate false, no tail, no norm_in)
  RouteParams route;
};

// Router CTA `cta` (blockIdx.x of row 1): its warps' part sums into p.partial.
__device__ __forceinline__ void route_part_sums(const RouteParams& p, int cta) {
  const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31;
  const int g = cta * MMA_WARPS + warp, part = g % p.P, q = g / p.P;
  const int n = q < p.Q ? min(p.rpw, (p.R - q + p.Q - 1) / p.Q) : 0;  // rows q + i Q < R, i < n (warp-uniform)
  const int64_t ld4 = (p.H + p.A) / 4;
  const uint4* w4 = reinterpret_cast<const uint4*>(p.wm) + part * (ROUTE_PART / 4) + lane;
  uint4 wv[ROUTE_MAX_RPW][ROUTE_F4];
#pragma unroll
  for (int i = 0; i < ROUTE_MAX_RPW; ++i)
    if (i < n)
#pragma unroll
      for (int k = 0; k < ROUTE_F4; ++k) wv[i][k] = ld_stream(w4 + int64_t(q + i * p.Q) * ld4 + 32 * k);
  pdl_wait();
  pdl_trigger();
  if (n == 0) return;
  const int c0 = part * ROUTE_PART;
  const float4* in4 = reinterpret_cast<const float4*>(c0 < p.H ? p.x + c0 : p.a + (c0 - p.H)) + lane;
  float4 in[ROUTE_F4];
#pragma unroll
  for (int k = 0; k < ROUTE_F4; ++k) in[k] = in4[32 * k];
#pragma unroll
  for (int i = 0; i < ROUTE_MAX_RPW; ++i) {
    if (i >= n) break;
    float acc = 0.f;
#pragma unroll
    for (int k = 0; k < ROUTE_F4; ++k) {
      acc = fmaf(__uint_as_float(wv[i][k].x), in[k].x, acc);
      acc = fmaf(__uint_as_float(wv[i][k].y), in[k].y, acc);
      acc = fmaf(__uint_as_float(wv[i][k].z), in[k].z, acc);
      acc = fmaf(__uint_as_float(wv[i][k].w), in[k].w, acc);
    }
    acc = warp_sum(acc);
    if (lane == 0) p.partial[int64_t(part) * p.R + q + i * p.Q] = acc;
  }
}

// The grid's last CTA: x' = x + y, s, the logits, top-k and the shared gate (header). Every thread of every
// CTA calls it once, after its last store.
__device__ __forceinline__ void route_tail(const RouteParams& p) {
  __shared__ float red[32];
  __shared__ float logits[ROUTE_MAX_EXPERTS + 1];
  __shared__ bool last;
  __threadfence();  // this thread's stores (y, partial), before the CTA's arrival
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(p.done, 1u) == gridDim.x * gridDim.y - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  float4* x4 = reinterpret_cast<float4*>(p.x);
  const float4* y4 = reinterpret_cast<const float4*>(p.y);
  float4 xv[ROUTE_TAIL_F4], yv[ROUTE_TAIL_F4];  // float4s tid + j * MMA_THREADS, all loads in one round
#pragma unroll
  for (int j = 0; j < ROUTE_TAIL_F4; ++j) {
    const int i = tid + j * MMA_THREADS;
    if (i < p.H / 4) xv[j] = __ldcg(x4 + i), yv[j] = __ldcg(y4 + i);
  }
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < ROUTE_TAIL_F4; ++j) {
    const int i = tid + j * MMA_THREADS;
    if (i >= p.H / 4) continue;
    const float4 x = xv[j], y = yv[j];
    const float4 v = make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w);
    x4[i] = v;
    ss += sq4(v);
  }
  ss = block_sum(ss, red);
  const float s = 1.f / sqrtf(ss / float(p.H) + p.eps);
  for (int r = tid; r < p.R; r += MMA_THREADS) {  // rows r, r + 256: a row's part sums loaded in one round
    float part[ROUTE_MAX_PARTS];
#pragma unroll
    for (int k = 0; k < ROUTE_MAX_PARTS; ++k)
      if (k < p.P) part[k] = __ldcg(p.partial + int64_t(k) * p.R + r);
    float l = 0.f;
#pragma unroll
    for (int k = 0; k < ROUTE_MAX_PARTS; ++k)
      if (k < p.P) l += part[k];
    logits[r] = l * s;
  }
  __syncthreads();
  if (warp == 0) moe_topk_warp<ROUTE_MAX_EXPERTS / 32>(logits, p.E, p.K, p.topk_id, p.topk_w);
  else if (warp == 1 && lane == 0) *p.shared_gate = moe_sigmoid(logits[p.E]);
  if (tid == 0) *p.done = 0u;
}

template <int BITS, int NG>
__global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_CTAS) linear_route_kernel(const LinearRouteParams p) {
  if (blockIdx.y == 0) linear_gemv_mma_cta<BITS, NG, false>(p.lin);
  else route_part_sums(p.route, int(blockIdx.x));
  route_tail(p.route);
}

// ---- the fold, at load time ------------------------------------------------------------------------------

struct RouteFoldParams {
  WeightView router, gate, out;  // Wr [E, H], Wg [1, H], O [H, A], any variant dequant_at takes
  const float* w_post;           // [H]
  float* wm;                     // [R, H + A]
  int R, H, A;
};

// WM[r, c] = W[r, c] for c < H. Grid (ceil(H / 256), R), 256 threads.
__global__ void route_fold_w_kernel(const RouteFoldParams p) {
  const int r = int(blockIdx.y), c = int(blockIdx.x) * 256 + int(threadIdx.x);
  if (c >= p.H) return;
  const float w = r < p.R - 1 ? dequant_at(p.router, 0, r, c) : dequant_at(p.gate, 0, 0, c);
  p.wm[int64_t(r) * (p.H + p.A) + c] = __fmul_rn(w, p.w_post[c]);
}

// WM[r, H + j] = M[r, j] from the W columns route_fold_w_kernel wrote (header). Grid (ceil(A / 256),
// ceil(R / 16)), 256 threads.
__global__ void __launch_bounds__(ROUTE_FOLD_COLS) route_fold_m_kernel(const RouteFoldParams p) {
  __shared__ float ws[ROUTE_FOLD_ROWS][ROUTE_FOLD_STEP];
  const int64_t ld = p.H + p.A;
  const int j = int(blockIdx.x) * ROUTE_FOLD_COLS + int(threadIdx.x), r0 = int(blockIdx.y) * ROUTE_FOLD_ROWS;
  double acc[ROUTE_FOLD_ROWS] = {};
  for (int i0 = 0; i0 < p.H; i0 += ROUTE_FOLD_STEP) {
    for (int e = int(threadIdx.x); e < ROUTE_FOLD_ROWS * ROUTE_FOLD_STEP; e += ROUTE_FOLD_COLS) {
      const int r = r0 + e / ROUTE_FOLD_STEP, i = i0 + e % ROUTE_FOLD_STEP;
      ws[e / ROUTE_FOLD_STEP][e % ROUTE_FOLD_STEP] = r < p.R && i < p.H ? p.wm[int64_t(r) * ld + i] : 0.f;
    }
    __syncthreads();
    if (j < p.A)
      for (int k = 0; k < ROUTE_FOLD_STEP && i0 + k < p.H; ++k) {
        const double o = dequant_at(p.out, 0, i0 + k, j);
#pragma unroll
        for (int r = 0; r < ROUTE_FOLD_ROWS; ++r) acc[r] += double(ws[r][k]) * o;
      }
    __syncthreads();
  }
  if (j >= p.A) return;
#pragma unroll
  for (int r = 0; r < ROUTE_FOLD_ROWS; ++r)
    if (r0 + r < p.R) p.wm[int64_t(r0 + r) * ld + p.H + j] = float(acc[r]);
}

}  // namespace lily::cuda
