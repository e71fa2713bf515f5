// The MoE block of one decode token as ONE kernel (ops::moe_rms_normed_add, T = 1), instead of the three
// launches moe_router -> moe_up_mma -> moe_down_mma:
//   x += sum_s w_s * D_s (silu(G_s h) * (U_s h)),  h = rms_norm(x) * norm_w,
//   s over the top-k experts of softmax(R h) (weights renormalised) and the shared expert (w = sigmoid(g . h)).
// x [2048] F32 the residual row; R [E, 2048], g [1, 2048]: 8-bit affine, BF16 scales (moe_router.cuh's
// conditions); the experts: moe_mma.cuh's (use_moe_mma).
// Grid: G CTAs of MMA_THREADS threads, all resident at once (the launcher checks the occupancy), walking
// three phases that hand over through device memory, each an arrival on a counter of g_moe_block_counters
// (barrier, then thread 0's release fence and atomic add) and a wait for it (thread 0's acquire loads,
// then a barrier):
//   stage (every CTA): h staged for the up product as moe_up_mma's NORM_IN instance stages it; the router
//     CTAs keep h as floats too. The router rows' weights are requested before the PDL wait.
//   router (CTAs b < RC = ceil((E + 1) / 8)): warp w computes row 8b + w (row E: the gate g) into
//     router_logits[0, E) and the gate logit into shared_gate[0]; then counter 0.
//   up (CTAs b < up_ctas): waits for counter 0 = RC; warp 0 runs moe_topk_warp on the E logits and warp 1
//     the gate's sigmoid (every CTA, the same bits: ids and weights in its shared memory), then the CTA
//     runs moe_up_mma's passes b, b + up_ctas, ... into act. Every CTA (those past up_ctas too) routes and
//     arrives on counter 1.
//   down (CTAs b < down_ctas): the chosen experts' down rows resolved and their first weights requested,
//     then the wait for counter 1 = G, act staged, moe_down_mma's passes added into x.
//   The last CTA to arrive on counter 2 sets the three counters back to 0 for the next launch (every CTA
//   has passed both waits by then). Staging reads x before counter 1; the down phase writes x after it.
// Router row arithmetic (one warp a row): lane l holds the 16-value chunks c = l + 32 j (j < 4) of the
// row; chunk partial p_c = fma(scale, dot_c, fma(bias, xsum_c, 0)), dot_c the 16 fmas in value order,
// xsum_c the sum of its 4 float4s (each ((x + y) + z) + w) from 0 in order; a xor butterfly (16, 8, 4,
// 2, 1) per j, then the four group sums from 0 in order: moe_router_kernel's (and linear_gemv_kernel<8,
// 1>'s) tree for every row, the gate's included. So the logits, the top-k and the gate equal the
// router kernel's bit for bit; the up and down passes are those of moe_up_mma / moe_down_mma with the
// same K splits (ks_up, ks_down): only which CTA runs a pass differs. The block's output equals the
// three-kernel chain's bit for bit. The routing stays in shared memory (topk_id / topk_w are not
// written); a wait longer than ~2^32 cycles (~2 s) traps (a CTA that never ran) instead of hanging.
#pragma once
#include "moe_mma.cuh"
#include "moe_router.cuh"

namespace lily::cuda {

__device__ unsigned g_moe_block_counters[3];  // 0 between launches (moe_block_kernel's last CTA resets them)
constexpr int MOE_BLOCK_STAMPS = 8, MOE_BLOCK_STAMP_CTAS = 512;  // DIAGNOSTIC (to be removed)
__device__ unsigned long long g_moe_block_stamps[MOE_BLOCK_STAMP_CTAS][MOE_BLOCK_STAMPS];
__device__ __forceinline__ void moe_block_stamp(int k) {
  if (threadIdx.x == 0 && blockIdx.x < MOE_BLOCK_STAMP_CTAS) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    g_moe_block_stamps[blockIdx.x][k] = t;
  }
}

struct MoeBlockParams {
  MoeMmaParams mma;           // the experts; mma.h = the residual row x = mma.out, accumulate, norm_in set
  AffineStack router, gate;   // [E, 2048], [1, 2048] 8-bit
  float* logits;              // [E] the router logits (device scratch)
  float* gate_logit;          // [1] the shared expert gate's logit (device scratch)
  int router_ctas, up_ctas, down_ctas;
  int stage_bytes;            // the staged x's bytes (the larger of the two products'), 16-byte multiple
  int mode;                   // DIAGNOSTIC: bit 0 relaxed polls, bit 1 nanosleep in polls
};

__device__ __forceinline__ void moe_block_arrive(unsigned* counter) {
  __syncthreads();  // every thread's stores come before thread 0's (cumulative) release
  if (threadIdx.x == 0) {
    fence_acq_rel_gpu();
    atomicAdd(counter, 1u);
  }
}

__device__ __forceinline__ void moe_block_wait(const unsigned* counter, unsigned n, int mode = 0) {
  if (threadIdx.x == 0) {
    const long long t0 = clock64();
    if (mode & 1) {
      while (*reinterpret_cast<const volatile unsigned*>(counter) < n) {
        if (mode & 2) __nanosleep(32);
        if (clock64() - t0 > (1ll << 32)) __trap();
      }
    } else {
      while (ld_acquire_gpu(counter) < n) {
        if (mode & 2) __nanosleep(32);
        if (clock64() - t0 > (1ll << 32)) __trap();  // a CTA of the phase never ran: fail, do not hang
      }
    }
    fence_acq_rel_gpu();
  }
  __syncthreads();  // the CTA's reads after this barrier follow thread 0's acquire
}

// Router row `row` (E: the gate) of one warp over h [2048] floats (shared memory), its chunks loaded in w.
__device__ __forceinline__ float moe_block_router_row(const GemvStage<4>& w, const float* h) {
  const int lane = int(threadIdx.x) & 31;
  float part[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float4* h4 = reinterpret_cast<const float4*>(h) + 4 * (lane + 32 * j);
    float dot = 0.f, xsum = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 v = h4[i];
      xsum += v.x + v.y + v.z + v.w;
      float q[4];
      decode_word<8>(word_of(w.w[j], i), q);
      dot = fmaf(q[0], v.x, dot);
      dot = fmaf(q[1], v.y, dot);
      dot = fmaf(q[2], v.z, dot);
      dot = fmaf(q[3], v.w, dot);
    }
    part[j] = fmaf(bf16_bits_to_f32(w.s[j]), dot, fmaf(bf16_bits_to_f32(w.b[j]), xsum, 0.f));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
#pragma unroll
    for (int j = 0; j < 4; ++j) part[j] += __shfl_xor_sync(0xffffffffu, part[j], o);
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < 4; ++j) s += part[j];
  return s;
}

// Dynamic shared memory: stage_bytes of staged x (the up product's, then the down product's), then the
// router CTAs' h as 2048 floats.
template <int BITS, int NG>
__global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_CTAS) moe_block_kernel(const MoeBlockParams q) {
  using S = MmaSeg<BITS>;
  constexpr int VB = S::VALS / NG;
  static_assert(ROUTER_CHUNKS == 4 * 32 && GemvShape<8>::F == 4, "a router row is 4 chunks a lane");
  extern __shared__ __align__(16) uint2 xd[];
  __shared__ int32_t ids[MOE_MAX_TOP_K];
  __shared__ float topk_w[MOE_MAX_TOP_K], shared_w;
  __shared__ float logits[ROUTER_MAX_EXPERTS];
  __shared__ MmaMoeSlots slots;
  const MoeMmaParams& p = q.mma;
  const int b = int(blockIdx.x), G = int(gridDim.x), tid = int(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int H = p.gate.cols, I = p.down.cols, KI = p.K * I, Kv = KI + p.shared_down.cols, E = q.router.rows;
  float* h = reinterpret_cast<float*>(reinterpret_cast<char*>(xd) + q.stage_bytes);
  const bool router = b < q.router_ctas;
  const int row = b * MMA_WARPS + warp;
  moe_block_stamp(0);

  GemvStage<4> rw;  // the warp's router row: constant weights, requested before the wait
  if (router) {
    const AffineStack& m = row < E ? q.router : q.gate;
#pragma unroll
    for (int j = 0; j < 4; ++j)
      gemv_load<8>(rw, j, row <= E, m.w, m.scales, m.biases, row < E ? row : 0, lane + 32 * j, ROUTER_COLS / 4,
                   ROUTER_COLS / m.group_size, m.group_size);
  }
  float* xe = reinterpret_cast<float*>(xd + H / 8 * 3);
  float* xsum = xe + H / VB;
  mma_stage_normed_x<BITS, VB>(p.h, p.norm_in, H, xd, xe, xsum, [] {
    pdl_wait();
    pdl_trigger();
  }, router ? h : nullptr);
  __syncthreads();
  moe_block_stamp(1);

  if (router) {
    if (row <= E) {
      const float l = moe_block_router_row(rw, h);
      if (lane == 0) *(row < E ? q.logits + row : q.gate_logit) = l;
    }
    moe_block_arrive(&g_moe_block_counters[0]);
    moe_block_stamp(2);
  }

  auto route = [&] {  // counter 0, then the routing into shared memory (the same bits in every CTA)
    moe_block_wait(&g_moe_block_counters[0], unsigned(q.router_ctas), q.mode);
    if (warp == 0) {
      for (int e = lane; e < E; e += 32) logits[e] = __ldcg(q.logits + e);
      __syncwarp();
      moe_topk_warp<ROUTER_MAX_EXPERTS / 32>(logits, E, p.K, ids, topk_w);
    } else if (warp == 1 && lane == 0) {
      shared_w = moe_sigmoid(__ldcg(q.gate_logit));
    }
    __syncthreads();
    moe_block_stamp(3);
  };
  const MmaMoeUpRows<BITS> up{p, ids, 0, topk_w, &shared_w};
  const int Su = H / S::VALS;
  if (b < q.up_ctas)
    mma_gemv_body<BITS, NG>(up, (up.total() + 7) / 8, Su, MmaSplit(p.ks_up, Su), xd, xe, xsum, route, [] {},
                            MmaTokens{1, 0, 0}, MmaGrid{b, q.up_ctas});
  else
    route();
  moe_block_stamp(4);
  moe_block_arrive(&g_moe_block_counters[1]);

  if (b < q.down_ctas) {
    const int Sd = Kv / S::VALS;
    float* xe_d = reinterpret_cast<float*>(xd + Kv / 8 * 3);
    float* xsum_d = xe_d + Kv / VB;
    const MmaMoeDownRows<BITS> down{p, slots, 0, 0xFFFFFFFFu / uint32_t(I / S::VALS) + 1u};  // 0 when sr = 1
    auto slots_in = [&] { moe_mma_slots<BITS>(p, ids, slots); };
    auto stage = [&] {  // act from every CTA's up passes; this CTA's own staged h is no longer read
      moe_block_wait(&g_moe_block_counters[1], unsigned(G), q.mode);
      moe_block_stamp(5);
      mma_stage_x<BITS, VB>(
          [&](int o) {
            const int j = 8 * o, s = j < KI ? j / I : p.K;
            return p.act + int64_t(s) * p.ld + (j - s * I);
          },
          Kv, xd, xe_d, xsum_d);
      __syncthreads();
    };
    mma_gemv_body<BITS, NG>(down, (p.down.rows + 15) / 16, Sd, MmaSplit(p.ks_down, Sd), xd, xe_d, xsum_d,
                            slots_in, stage, MmaTokens{1, 0, 0}, MmaGrid{b, q.down_ctas});
    moe_block_stamp(6);
  }

  __syncthreads();
  if (tid == 0) {  // the last CTA out: every CTA has passed both waits, the counters go back to 0
    fence_acq_rel_gpu();
    if (atomicAdd(&g_moe_block_counters[2], 1u) == unsigned(G) - 1u)
      g_moe_block_counters[0] = g_moe_block_counters[1] = g_moe_block_counters[2] = 0u;
  }
  moe_block_stamp(7);
}

}  // namespace lily::cuda
