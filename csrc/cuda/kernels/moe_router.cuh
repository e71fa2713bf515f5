// The MoE router of one decode token as one kernel: the router logits, the shared expert gate logit,
// then moe_topk's softmax, top-k, renormalisation and sigmoid:
//   l[e] = sum_j Wr[e, j] h[j] (e < E),  g = sum_j Wg[j] h[j],  W = scale[group] * q + bias[group]
//   (topk_id, topk_w) = moe_topk_warp(l),  shared_gate = sigmoid(g).
// Wr [E, 2048], Wg [1, 2048]: MLX affine 8-bit, BF16 scales, group size a multiple of 16; h [2048] F32,
// 16-byte aligned; E <= 256; topk_id [K], topk_w [K] (ascending id), shared_gate [1]. T tokens (a short
// prompt, T <= MOE_DECODE_MAX_TOKENS): h [T, 2048], topk_id / topk_w [T, K], shared_gate [T], one cluster
// per token (grid (n, T), blockIdx.y = t), each as the one-token kernel (the same bits per token).
// Grid: per token one thread-block cluster of n = ceil(E/16) CTAs (n > 8 is a non-portable cluster size) of 17
// warps. Warps 0-15 own router rows 16b..16b+15 of CTA b in linear_gemv_kernel<8,1>'s mapping: 4 slots
// of 128 threads, thread q of slot s holds 16-byte chunk q (16 weights) of rows 16b+4s+r, r < 4, and
// loads them before pdl_wait. After it, warp 16 (no weights) loads h at once and stages it as
// gemv_stage_x does (swizzled chunks and their sums) while warps 0-15 decode their weights to floats
// (64 registers), so the math after the barrier is 64 fmas a thread. The gate row's 128 chunks are 16
// pieces {32g + m + 4k : k < 8} (g, m < 4); piece 4g+m belongs to CTA (4g+m) % n, one chunk per thread
// on 8 consecutive lanes of warps 0-3. The row sums and the pieces go to rank 0's shared memory
// (DSMEM); after a cluster barrier rank 0's warp 0 runs moe_topk_warp and its warp 1 the gate's sigmoid.
// Precision: each logit is bit-identical to linear_gemv_kernel<8,1>'s, so the choices and weights equal
// the GEMV + moe_topk path's: chunk partial p_c = fma(scale, dot_c, fma(bias, xsum_c, 0)), dot_c the 16
// fmas in value order, xsum_c the staged sum; per group of 32 chunks the xor butterfly (pairs at
// distance 16, 8, 4, 2, 1), then the four group sums added to 0 in order (slot_sum). The gate pieces
// run the first three butterfly levels on their 8 lanes and rank 0 the last two, which is the same
// tree: after levels 16, 8, 4 the value of chunk j depends on j % 4 only.
// NORM_IN (ops::moe_rms_normed_add): p.h is the residual row x, and two staging warps (18 warps: registers
// are granted per 4 warps, so 17 and 18 both get 96 a thread) stage h = rms_norm(x) * w themselves, bit
// for bit the h of the norm kernels (router_inv_rms: their sum order). Staging warp s loads chunks
// lane + 32 s and lane + 32 (s + 2) of x and of w, all after the wait in one round trip, exchanges one
// partial sum a lane octet with the other over shared memory (a named barrier of the 64 staging threads)
// and stages its chunks as the single staging warp does. ptxas: 96 registers and 32 bytes of spill: the
// norm's sqrt and division have subroutine slow paths, and across those calls ptxas keeps 8 of the compute
// warps' decoded values in local memory (stored before the CTA barrier, reloaded after it, L1 hits).
#pragma once
#include <cooperative_groups.h>

#include "moe_decode.cuh"
#include "norms.cuh"

namespace lily::cuda {

constexpr int ROUTER_COLS = 2048;                // hidden size (= the model's)
constexpr int ROUTER_CHUNKS = ROUTER_COLS / 16;  // 16-byte chunks per row: threads per slot
constexpr int ROUTER_R = 4;                      // rows per slot (GemvTiling<1>::R)
constexpr int ROUTER_SLOTS = 4;
constexpr int ROUTER_ROWS = ROUTER_SLOTS * ROUTER_R;  // 16 router rows per CTA
constexpr int ROUTER_WARPS = ROUTER_SLOTS * ROUTER_CHUNKS / 32;  // 16 compute warps, then the staging warps
// 544 or (NORM_IN) 576 threads: one CTA per SM at <= 96 registers
__host__ __device__ constexpr int router_threads(bool norm_in) { return (ROUTER_WARPS + (norm_in ? 2 : 1)) * 32; }
constexpr int ROUTER_MAX_CTAS = 16;                      // the largest cluster (non-portable)
constexpr int ROUTER_MAX_EXPERTS = ROUTER_ROWS * ROUTER_MAX_CTAS;  // 256
constexpr int ROUTER_GATE_PIECES = 16;                             // of 8 chunks: 4 groups x 4 residues
static_assert(ROUTER_R == GemvTiling<1>::R && ROUTER_CHUNKS == 128, "the logits follow linear_gemv_kernel<8,1>");
static_assert(norm_threads(ROUTER_COLS) == 256, "router_inv_rms follows rms_norm's 256 threads of a row");
constexpr int ROUTER_NORM_BARRIER = 1;  // named barrier of the two staging warps (0 is __syncthreads)

struct MoeRouterParams {
  AffineStack router;  // [E, 2048] 8-bit (rows = E)
  AffineStack gate;    // [1, 2048] 8-bit, the shared expert gate
  const float* h;      // [T, 2048] F32 (NORM_IN: the residual row x)
  int32_t* topk_id;    // [T, K]
  float* topk_w;       // [T, K]
  float* shared_gate;  // [T] sigmoid of the gate logit
  int K;
  NormIn norm_in;      // NORM_IN: the router's input is rms_norm(x) * norm_in.w [2048]
};

// 1 / rms of the row x, s = 1 / sqrt(mean x^2 + eps), from the two staging warps' registers in the order
// of rms_norm's 256 threads (norm_threads(2048)): thread t adds sq4 of float4s t and t + 256, then
// block_sum. Lane l of staging warp sw holds float4 4 (l + 32 (sw + 2 k)) + f in v[k][f], so norm thread
// t = 4 l + 128 sw + f has its two terms in v[0][f], v[1][f]. Its warp w = l / 8 + 4 sw spans lanes
// 8 (l / 8) .. + 7 and f = 0..3 (its lane bits 4, 3, 2 are bits 2, 1, 0 of l, bits 1, 0 are f), so its xor
// tree is shuffles at 4, 2, 1, then f ^ 2 and f ^ 1 in registers: r_w = (u0 + u2) + (u1 + u3). block_sum's
// second tree over r_0..r_7 and 24 zeros adds ((r0 + r4) + (r2 + r6)) + ((r1 + r5) + (r3 + r7)) (a zero
// added leaves a sum of squares unchanged): r_a + r_(a+4) (a = l / 8; r_(a+4) from warp 1 through `part`),
// then shuffles at 16 and 8. Every lane of both warps gets the same s. tests/emu/norm_post_emu.cu checks
// this order against the norms' on the CPU.
__device__ __forceinline__ float router_inv_rms(const float4 (&v)[2][4], int sw, float (&part)[2][4], float eps) {
  const int lane = int(threadIdx.x) & 31;
  float u[4];
#pragma unroll
  for (int f = 0; f < 4; ++f) {
    float ss = 0.f;
    ss += sq4(v[0][f]);
    ss += sq4(v[1][f]);
    u[f] = ss;
  }
#pragma unroll
  for (int o = 4; o > 0; o >>= 1)
#pragma unroll
    for (int f = 0; f < 4; ++f) u[f] += __shfl_xor_sync(0xffffffffu, u[f], o);
  if (lane % 8 == 0) part[sw][lane / 8] = (u[0] + u[2]) + (u[1] + u[3]);
  asm volatile("bar.sync %0, 64;" ::"n"(ROUTER_NORM_BARRIER) : "memory");
  float ss = part[0][lane / 8] + part[1][lane / 8];
  ss += __shfl_xor_sync(0xffffffffu, ss, 16);
  ss += __shfl_xor_sync(0xffffffffu, ss, 8);
  return 1.f / sqrtf(ss / float(ROUTER_COLS) + eps);
}

template <bool NORM_IN>
__global__ void __launch_bounds__(router_threads(NORM_IN), 1) moe_router_kernel(const MoeRouterParams p) {
  namespace cg = cooperative_groups;
  using S = GemvShape<8>;
  static_assert(S::F == 4, "router_inv_rms takes 4 float4s a chunk");
  __shared__ float4 xs[ROUTER_CHUNKS * S::F];  // h in GemvShape's swizzled chunks
  __shared__ float norm_part[2][4];            // NORM_IN: the staging warps' partial sums
  __shared__ float xsum[ROUTER_CHUNKS];
  __shared__ float red[ROUTER_WARPS][ROUTER_R];    // warp sums of the slots
  __shared__ float logits[ROUTER_MAX_EXPERTS];    // rank 0's: the cluster's router logits
  __shared__ float gate_part[ROUTER_GATE_PIECES]; // rank 0's: the gate pieces' partial sums
  const cg::cluster_group cluster = cg::this_cluster();
  const int tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int b = int(cluster.block_rank()), n = int(cluster.num_blocks());
  const bool stager = warp == ROUTER_WARPS || (NORM_IN && warp == ROUTER_WARPS + 1);  // stage h; no weights
  const int slot = tid / ROUTER_CHUNKS, q = tid % ROUTER_CHUNKS, E = p.router.rows;
  const int row0 = b * ROUTER_ROWS + slot * ROUTER_R, t = int(blockIdx.y);
  const float* h = p.h + int64_t(t) * ROUTER_COLS;  // token t's row
  __cluster_barrier_arrive_relaxed();  // paired with the wait before the first store to rank 0

  GemvStage<ROUTER_R> st;  // constant weights: loaded before the wait
#pragma unroll
  for (int r = 0; r < ROUTER_R; ++r)
    gemv_load<8>(st, r, !stager && row0 + r < E, p.router.w, p.router.scales, p.router.biases, row0 + r, q,
                 ROUTER_COLS / 4, ROUTER_COLS / p.router.group_size, p.router.group_size);
  // gate pieces b, b + n, ...: threads 8j..8j+7 hold piece b + j*n, lane k of them chunk 32g + m + 4k
  const int pieces = (ROUTER_GATE_PIECES - b + n - 1) / n, piece = b + (tid >> 3) * n;
  const bool gate_warp = warp * 32 < 8 * pieces, gate_lane = tid < 8 * pieces;  // gate_warp: warp-uniform
  const int gc = gate_lane ? 32 * (piece >> 2) + (piece & 3) + 4 * (tid & 7) : 0;
  GemvStage<1> gs;
  gemv_load<8>(gs, 0, gate_lane, p.gate.w, p.gate.scales, p.gate.biases, 0, gc, ROUTER_COLS / 4,
               ROUTER_COLS / p.gate.group_size, p.gate.group_size);

  pdl_wait();
  pdl_trigger();
  float wq[ROUTER_R][S::VALS], ws[ROUTER_R], wb[ROUTER_R];  // the compute warps' weights as floats
  if (NORM_IN && stager) {  // h = rms_norm(x) * w; warp sw takes chunks lane + 32 (sw + 2 k), k < 2
    const int sw = warp - ROUTER_WARPS;
    float4 v[2][S::F], w[2][S::F];
#pragma unroll
    for (int k = 0; k < 2; ++k)
#pragma unroll
      for (int f = 0; f < S::F; ++f) {
        const int i = (lane + 32 * (sw + 2 * k)) * S::F + f;
        v[k][f] = reinterpret_cast<const float4*>(h)[i];
        w[k][f] = __ldg(reinterpret_cast<const float4*>(p.norm_in.w) + i);
      }
    const float rs = router_inv_rms(v, sw, norm_part, p.norm_in.eps);
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int c = lane + 32 * (sw + 2 * k);
      float s = 0.f;
#pragma unroll
      for (int f = 0; f < S::F; ++f) {
        const float4 hn = norm_scale4(v[k][f], rs, w[k][f]);
        xs[S::slot(c, f)] = hn;
        s += hn.x + hn.y + hn.z + hn.w;
      }
      xsum[c] = s;
    }
  } else if (stager) {  // gemv_stage_x's layout and sums, chunks lane + 32j; its loads issue at once
    float4 v[4][S::F];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int f = 0; f < S::F; ++f) v[j][f] = reinterpret_cast<const float4*>(h)[(lane + 32 * j) * S::F + f];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float s = 0.f;
#pragma unroll
      for (int f = 0; f < S::F; ++f) {
        xs[S::slot(lane + 32 * j, f)] = v[j][f];
        s += v[j][f].x + v[j][f].y + v[j][f].z + v[j][f].w;
      }
      xsum[lane + 32 * j] = s;
    }
  } else {  // decoded while h arrives
#pragma unroll
    for (int r = 0; r < ROUTER_R; ++r) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float v[S::VPW];
        decode_word<8>(word_of(st.w[r], i), v);
#pragma unroll
        for (int k = 0; k < S::VPW; ++k) wq[r][S::VPW * i + k] = v[k];
      }
      ws[r] = bf16_bits_to_f32(st.s[r]);
      wb[r] = bf16_bits_to_f32(st.b[r]);
    }
  }
  __syncthreads();

  float acc[ROUTER_R];  // gemv_chunk<8, 4, 1>'s arithmetic on the decoded weights, then slot_sum's
  if (!stager) {
    float dot[ROUTER_R] = {};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 v = xs[S::slot(q, i)];
      const float xv[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int r = 0; r < ROUTER_R; ++r)
#pragma unroll
        for (int k = 0; k < 4; ++k) dot[r] = fmaf(wq[r][4 * i + k], xv[k], dot[r]);
    }
#pragma unroll
    for (int r = 0; r < ROUTER_R; ++r) acc[r] = fmaf(ws[r], dot[r], fmaf(wb[r], xsum[q], 0.f));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
      for (int r = 0; r < ROUTER_R; ++r) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
    if (lane == 0)
#pragma unroll
      for (int r = 0; r < ROUTER_R; ++r) red[warp][r] = acc[r];
  }
  float gp[1][1] = {};
  if (gate_warp) {
    gemv_chunk<8, 1, 1>(gs, xs, xsum, ROUTER_CHUNKS, gc, gp);
#pragma unroll
    for (int o = 4; o > 0; o >>= 1) gp[0][0] += __shfl_xor_sync(0xffffffffu, gp[0][0], o);  // chunks +-16, 8, 4
  }
  __syncthreads();
  const bool first = !stager && q == 0;  // the slot's 4 logits: its warps' sums from 0 in order
  if (first)
#pragma unroll
    for (int r = 0; r < ROUTER_R; ++r) {
      float s = 0.f;
#pragma unroll
      for (int k = 0; k < ROUTER_CHUNKS / 32; ++k) s += red[warp + k][r];
      acc[r] = s;
    }

  __cluster_barrier_wait();  // every CTA of the cluster runs: rank 0's shared memory may be written
  if (first) {
    float* dst = b == 0 ? logits : cluster.map_shared_rank(logits, 0);
#pragma unroll
    for (int r = 0; r < ROUTER_R; ++r)
      if (row0 + r < E) dst[row0 + r] = acc[r];
  }
  if (gate_lane && (tid & 7) == 0) (b == 0 ? gate_part : cluster.map_shared_rank(gate_part, 0))[piece] = gp[0][0];
  __cluster_barrier_arrive();  // release: the stores above
  __cluster_barrier_wait();    // acquire: rank 0 sees every CTA's; no CTA touches another's memory after this
  if (b != 0) return;
  if (warp == 0) {
    moe_topk_warp<ROUTER_MAX_EXPERTS / 32>(logits, E, p.K, p.topk_id + t * p.K, p.topk_w + t * p.K);
  } else if (warp == 1 && lane == 0) {
    float g = 0.f;  // levels 2 and 1 of each group's butterfly, then the groups in order (slot_sum)
#pragma unroll
    for (int j = 0; j < 4; ++j)
      g += (gate_part[4 * j] + gate_part[4 * j + 2]) + (gate_part[4 * j + 1] + gate_part[4 * j + 3]);
    p.shared_gate[t] = moe_sigmoid(g);
  }
}

}  // namespace lily::cuda
