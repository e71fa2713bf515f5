// MoE decode on integer tensor cores: the gemv_mma.cuh engine with two row policies, one token per
// grid row (blockIdx.y = t, T <= MOE_DECODE_MAX_TOKENS). Same results as moe_decode.cuh's fp32 kernels up to
// the ~1e-7 of x's 23-bit blocks; these run where every expert matrix has the same BITS and group size
// and the widths are whole segments (moe.cu: use_moe_mma).
//   moe_up_mma:   act[t, s, i] = w(t, s) * silu(G_s[i, :] . h[t]) * (U_s[i, :] . h[t]): a tile is 8 (gate,
//                 up) row pairs, A rows 0-7 the gate rows and 8-15 the up rows of the same i, so one
//                 finished tile holds both products of each pair. Slot s < K is expert topk_id[t, s],
//                 s == K the shared expert (w = sigmoid gate); pair p = s * I + i, shared pairs last.
//                 NORM_IN (ops::moe_rms_normed_add): h[t] = rms_norm(x[t]) * w, each CTA normalising the
//                 residual row x[t] while it stages it (gemv_mma.cuh, mma_stage_normed_x).
//   moe_down_mma: out[t, o] = sum_s D_s[o, :] . act[t, s, :] as one GEMV over a virtual row of
//                 K*I + Is values (the K+1 act rows back to back; segment v of row o reads expert
//                 topk_id[t, v / (I/VALS)]'s row o, the shared expert's past K*I values); accumulating
//                 (ops::moe_add) out[t, o] += it, and with a tail (ops::moe_add_rms_norm, T = 1) the last
//                 CTA then writes the next RMSNorm.
#pragma once
#include "gemv_mma.cuh"
#include "moe_decode.cuh"
#include "moe_router_early.cuh"

namespace lily::cuda {

struct MoeMmaParams {
  AffineStack gate, up, shared_gate, shared_up;  // [E, I, H], [1, Is, H]
  AffineStack down, shared_down;                 // [E, H, I], [1, H, Is]
  const float* h;                                // [T, H] F32, 16-byte aligned (NORM_IN: the residual rows)
  const int32_t* topk_id;                        // [T, K]
  const float* topk_w;                           // [T, K]
  const float* shared_w;                         // [T] sigmoid of the shared expert gate
  float* act;                                    // [T, K+1, ld] F32, 16-byte aligned rows
  float* out;                                    // [T, H]
  int K, ld, group_shift, ks_up, ks_down;
  bool accumulate;  // out += the product (out is the residual stream), else out = it
  NormTail tail;    // tail.done != nullptr (T = 1, accumulate): then tail.y = rms_norm(out) * tail.w by
                    // moe_down_mma's last CTA
  NormIn norm_in;   // moe_up's NORM_IN instance: its input is rms_norm(h[t]) * norm_in.w (mma_stage_normed_x)
  // Early routing (T = 1, NORM_IN, ops::linear_add_moe_rms_normed_add): router_early_kernel's raw logits r [E + 1]
  // and its top-k after them (EarlyRoute, moe_router_early.cuh), two launches before moe_up: both kernels read the
  // ids before their wait, moe_up the weights from its norm's s (topk_id, topk_w and shared_w are then not read).
  // res_add [T, H]: the output projection's O a, not yet in h (the residual): moe_up stages rms_norm(h + res_add)
  // and moe_down adds (h + res_add) + its product, the sums the separate linear_add would have made.
  const float* router_raw;
  int E;
  const float* res_add;
};

// Row `row` of an expert stack's matrices (experts back to back) at segment 0.
template <int BITS>
__device__ __forceinline__ MmaRowRef mma_stack_row(const AffineStack& m, int64_t row, int group_shift) {
  return mma_affine_row(m.w, m.scales, m.biases, row, m.cols * BITS / 32, m.cols >> group_shift);
}

template <int BITS>
struct MmaMoeUpRows {
  const MoeMmaParams& p;
  const int32_t* ids;  // [K] of this token, in shared memory
  int t;
  const float* w_early = nullptr;  // early routing: the K + 1 slots' weights in shared memory
  __device__ __forceinline__ int total() const { return p.K * p.gate.rows + p.shared_gate.rows; }
  // pair -> slot s and row i of that slot's matrices
  __device__ __forceinline__ void slot_of(int pair, int& s, int& i) const {
    const int KI = p.K * p.gate.rows;
    s = pair < KI ? pair / p.gate.rows : p.K;
    i = pair < KI ? pair - s * p.gate.rows : pair - KI;
  }
  using Ref = MmaRowRef;
  __device__ __forceinline__ Ref base(int tile, int r) const {
    const int pair = min(tile * 8 + (r & 7), total() - 1);
    int s, i;
    slot_of(pair, s, i);
    const bool sh = s == p.K;
    const AffineStack& m = r < 8 ? (sh ? p.shared_gate : p.gate) : (sh ? p.shared_up : p.up);
    return mma_stack_row<BITS>(m, sh ? int64_t(i) : int64_t(ids[s]) * p.gate.rows + i, p.group_shift);
  }
  __device__ __forceinline__ MmaRowRef at(const Ref& ref, int seg) const {
    return mma_affine_at<BITS>(ref, seg, p.group_shift);
  }
  template <class Sum>
  __device__ __forceinline__ void finish(int tile, int r, const Sum& row_sum) const {
    const int pair = tile * 8 + r;
    if (r >= 8 || pair >= total()) return;
    int s, i;
    slot_of(pair, s, i);
    const float w = w_early != nullptr ? w_early[s] : s < p.K ? p.topk_w[t * p.K + s] : p.shared_w[t];
    p.act[(int64_t(t) * (p.K + 1) + s) * p.ld + i] = w * silu(row_sum(r)) * row_sum(r + 8);
  }
};

// Slot s < K of the down product is expert ids[s]'s matrix, slot K the shared expert's: the matrices'
// first rows, resolved once per CTA into shared memory (moe_mma_slots).
struct MmaMoeSlots {
  MmaRowRef m[MOE_MAX_TOP_K + 1];
};

template <int BITS>
struct MmaMoeDownRows {
  const MoeMmaParams& p;
  const MmaMoeSlots& slots;  // shared memory
  int t;
  uint32_t sr_magic;  // ceil(2^32 / sr): floor(v / sr) = umulhi(v, sr_magic) for v < 2^16 (sr > 1)
  struct Ref {  // an output row's offsets in an expert's and in the shared expert's matrix
    int64_t w4e, ge, w4s, gs;  // in uint4 (16 bytes) and in groups
  };
  __device__ __forceinline__ Ref base(int tile, int r) const {
    const int64_t o = min(tile * 16 + r, p.down.rows - 1);
    return {o * (p.down.cols * BITS / 128), o * (p.down.cols >> p.group_shift),
            o * (p.shared_down.cols * BITS / 128), o * (p.shared_down.cols >> p.group_shift)};
  }
  // virtual segment v: slot s = v / sr (the shared expert past K * sr), segment v - s * sr of its row
  __device__ __forceinline__ MmaRowRef at(const Ref& ref, int v) const {
    const int sr = p.down.cols / MmaSeg<BITS>::VALS;
    const int s = min(sr == 1 ? v : int(__umulhi(uint32_t(v), sr_magic)), p.K);
    const MmaRowRef& m = slots.m[s];
    const int64_t w4 = s == p.K ? ref.w4s : ref.w4e, g = s == p.K ? ref.gs : ref.ge;
    return mma_affine_at<BITS>(MmaRowRef{m.w + w4, m.s + g, m.b + g}, v - s * sr, p.group_shift);
  }
  template <class Sum>
  __device__ __forceinline__ void finish(int tile, int r, const Sum& row_sum) const {
    const int o = tile * 16 + r;
    if (o >= p.down.rows) return;
    float* y = p.out + int64_t(t) * p.down.rows + o;
    const float base = p.res_add != nullptr ? *y + p.res_add[int64_t(t) * p.down.rows + o] : *y;
    *y = p.accumulate ? base + row_sum(r) : row_sum(r);
  }
};

// Token t's expert ids into shared memory, for both kernels' row addresses: they and the activations come
// from the kernels before (the wait), and every thread reads them after the barrier.
__device__ __forceinline__ void moe_mma_ids(const MoeMmaParams& p, int t, int32_t* ids) {
  pdl_wait();
  pdl_trigger();
  for (int k = threadIdx.x; k < p.K; k += blockDim.x) ids[k] = p.topk_id[t * p.K + k];
  __syncthreads();
}

// The down product's slot matrices of token t, read BEFORE the wait: the expert ids come from the
// router (or moe_topk) two launches earlier (moe_up runs in between), and every kernel waits before it
// triggers, so they are complete when moe_down starts (docs/cuda.md, the PDL rule's exception). The
// chosen experts' first down weights are then requested while moe_up finishes.
// Early routing: the ids of router_early_kernel's top-k, three launches back.
template <int BITS>
__device__ __forceinline__ void moe_mma_slots(const MoeMmaParams& p, int t, MmaMoeSlots& slots) {
  const int32_t* ids = p.router_raw != nullptr ? EarlyRoute{const_cast<float*>(p.router_raw), p.E, p.K}.ids()
                                               : p.topk_id + t * p.K;
  for (int k = threadIdx.x; k <= p.K; k += blockDim.x)
    slots.m[k] = k < p.K ? mma_stack_row<BITS>(p.down, int64_t(ids[k]) * p.down.rows, p.group_shift)
                         : mma_stack_row<BITS>(p.shared_down, 0, p.group_shift);
  __syncthreads();
}

// Grid (CTAs, T); dynamic shared memory mma_x_bytes(H, VB). NORM_IN: its own instance (the plain one's
// code is untouched), launched with the plain one's plan.
template <int BITS, int NG, bool NORM_IN = false>
__global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_CTAS) moe_up_mma_kernel(const MoeMmaParams p) {
  using S = MmaSeg<BITS>;
  constexpr int VB = S::VALS / NG;
  extern __shared__ uint2 xd[];
  __shared__ int32_t ids[MOE_MAX_TOP_K];
  __shared__ float early[3][MOE_MAX_TOP_K + 1];  // early routing: r of the chosen (ascending id, choice order), w
  __shared__ float early_s;
  const int t = blockIdx.y, H = p.gate.cols, Sg = H / S::VALS;
  float* xe = reinterpret_cast<float*>(xd + H / 8 * 3);
  float* xsum = xe + H / VB;
  const bool early_routing = NORM_IN && p.router_raw != nullptr;
  MmaMoeUpRows<BITS> rows{p, ids, t};
  if (early_routing) rows.w_early = early[2];
  const float* h = p.h + int64_t(t) * H;
  // Without early routing, h[t] is staged BEFORE the wait: its producer (out_proj's residual add, or the norm
  // before the router) runs at least two launches earlier (the router, or the router GEMV and moe_topk, in
  // between), so it is complete when this kernel starts (docs/cuda.md, the PDL rule's exception); the staging
  // then overlaps the router, and after the wait only the ids, the weights' latency and the math remain.
  // With it, the ids come from router_early_kernel's top-k before the wait (two launches back, the output
  // projection in between), the chosen experts' first weights are requested, and h + O a (O a from that
  // projection, the kernel just before) is staged after the wait, its norm's s giving the weights.
  auto ids_in = [&] {
    if (early_routing) {
      const EarlyRoute route{const_cast<float*>(p.router_raw), p.E, p.K};
      for (int k = threadIdx.x; k < p.K; k += blockDim.x)
        ids[k] = __ldcg(route.ids() + k), early[0][k] = __ldcg(route.vals() + k), early[1][k] = __ldcg(route.chosen() + k);
      __syncthreads();
      return;
    }
    if constexpr (NORM_IN) mma_stage_normed_x<BITS, VB>(h, p.norm_in, H, xd, xe, xsum, [] {});
    else mma_stage_x<BITS, VB>([&](int o) { return h + 8 * o; }, H, xd, xe, xsum);
    moe_mma_ids(p, t, ids);  // the wait, then the ids; its barrier also publishes the staging
  };
  auto stage = [&] {
    if constexpr (NORM_IN) {
      if (!early_routing) return;
      pdl_wait();
      pdl_trigger();
      mma_stage_normed_x<BITS, VB>(h, p.norm_in, H, xd, xe, xsum, [] {}, &early_s, p.res_add + int64_t(t) * H);
      __syncthreads();
      // read by finish() only after the first pass's barrier
      if (threadIdx.x < 32) moe_early_weights(early[0], early[1], __ldcg(p.router_raw + p.E), early_s, p.K, early[2]);
    }
  };
  mma_gemv_body<BITS, NG>(rows, (rows.total() + 7) / 8, Sg, MmaSplit(p.ks_up, Sg), xd, xe, xsum, ids_in, stage);
}

// Grid (CTAs, T); dynamic shared memory mma_x_bytes(K*I + Is, VB).
template <int BITS, int NG>
__global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_CTAS) moe_down_mma_kernel(const MoeMmaParams p) {
  using S = MmaSeg<BITS>;
  constexpr int VB = S::VALS / NG;
  extern __shared__ uint2 xd[];
  __shared__ MmaMoeSlots slots;
  const int t = blockIdx.y, I = p.down.cols, KI = p.K * I, Kv = KI + p.shared_down.cols, Sg = Kv / S::VALS;
  float* xe = reinterpret_cast<float*>(xd + Kv / 8 * 3);
  float* xsum = xe + Kv / VB;
  const MmaMoeDownRows<BITS> rows{p, slots, t, 0xFFFFFFFFu / uint32_t(I / S::VALS) + 1u};  // 0 when sr = 1
  auto ids_in = [&] { moe_mma_slots<BITS>(p, t, slots); };
  auto stage = [&] {  // act comes from moe_up, the kernel before
    pdl_wait();
    pdl_trigger();
    const float* act = p.act + int64_t(t) * (p.K + 1) * p.ld;
    mma_stage_x<BITS, VB>(
        [&](int o) {
          const int j = 8 * o, s = j < KI ? j / I : p.K;
          return act + int64_t(s) * p.ld + (j - s * I);
        },
        Kv, xd, xe, xsum);
    __syncthreads();
  };
  mma_gemv_body<BITS, NG>(rows, (p.down.rows + 15) / 16, Sg, MmaSplit(p.ks_down, Sg), xd, xe, xsum, ids_in,
                          stage);
  if (p.tail.done != nullptr) grid_tail_rms_norm(p.tail);
}

}  // namespace lily::cuda
