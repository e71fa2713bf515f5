// Short prompts on the integer tensor-core GEMV: y[k] = W x[k] for T = 2..MMA_MAX_TOKENS tokens k in one
// launch, each weight segment loaded once and multiplied with every token's digit columns.
//
// Equation, per token: exactly the one-token GEMV's (gemv_mma.cuh): x[k] split per block u into e_ku and
// three signed 8-bit digits, y[k][o] = sum_u s[o, g(u)] e_ku sum_d 2^(8d) (q . D_kd)_u + b[o, g(u)] xsum_ku,
// with the same block scaling, the same digits, the same int32 mma products, the same per-segment column
// epilogue (mma_columns) into the same lane accumulators and the same quad / K-part sums (mma_gemv_body
// with NT = MMA_MAX_TOKENS, the plan's ks taken from the one-token kernel): so y[k] equals the one-token
// product of row k BIT FOR BIT (tests/emu/gemv_mma_emu.cu, tests/gpu/test_linear.py).
//
// Layout. Shared memory holds the tokens' staged x one after the other: digits [T][K/8][3] uint2, then
// e [T][K/VB], then xsum [T][K/VB] (mma_x_bytes(T * K, VB) bytes): the one-token layout of the
// concatenated row x[0] | x[1] | ..., staged by one mma_stage_x over T * K values (a block never spans
// two tokens: K is a multiple of VB), so token k's view (mma_token_x) is the one-token layout at an
// offset. Weight rows, lanes and fragments are the one-token kernel's.
//
// Work. Per segment, for each token k < T, a lane loads the token's digit pair(s), runs the MMAS mmas on
// the segment's A fragments (the same for every token) and the column epilogue into acc[k]: per token
// per segment the warp issues what the one-token kernel issues, but the weight stream is read once for
// the T tokens.
// MMA_MAX_TOKENS = 8 at one CTA per SM (MMA_TOKENS_MIN_CTAS): 8 tokens' accumulators (16 registers) on top
// of the one-token kernel's 123 registers do not fit the 128 of two CTAs per SM (ptxas, sm_90a: 76-96
// bytes of spills at 4 bits for 8 tokens, still 16 bytes for 4 tokens); at one CTA it takes 172-183
// registers and no spills. Eight warps an SM still keep two units of weights in flight each, and the
// T-fold work per unit (independent mma chains per token) gives the warps their own instruction-level
// parallelism. 8 tokens of K = 4096 stage 100 KB of x (MMA_TOKENS_MAX_SMEM). More tokens run in launches
// of at most MMA_MAX_TOKENS (linear.cu), each reading the weights again.
#pragma once
#include "gemv_mma.cuh"

namespace lily::cuda {

constexpr int MMA_MAX_TOKENS = 8, MMA_TOKENS_MIN_CTAS = 1;
constexpr size_t MMA_TOKENS_MAX_SMEM = 160 * 1024;  // staged x of one launch
// Octets a thread loads before converting (mma_stage_x's NR): 8 tokens of K = 2048 in one memory latency
// (the one-token kernel's 3 would take three); the registers are there at one CTA per SM.
constexpr int MMA_TOKENS_STAGE_ROUNDS = 8;

// The staged-x strides of tokens in a CTA's shared memory (layout above): n tokens of K values in blocks
// of VB.
__host__ __device__ __forceinline__ MmaTokens mma_tokens(int n, int K, int VB) { return {n, K / 8 * 3, K / VB}; }

// Token k's staged x: the one-token layout at its offsets.
struct MmaTokenX {
  const uint2* xd;
  const float* xe;
  const float* xsum;
};
__host__ __device__ __forceinline__ MmaTokenX mma_token_x(const uint2* xd, const float* xe, const float* xsum,
                                                         const MmaTokens& tok, int k) {
  return {xd + k * tok.xd_stride, xe + k * tok.xe_stride, xsum + k * tok.xe_stride};
}

// One segment of one unit for tok.n tokens: the A fragments once, then per token mma_segment's digit
// loads, mmas, accumulator combination and mma_columns into acc[k] (the same operations in the same
// order as mma_segment on that token's staged x).
template <int BITS, int NG, int NT>
__device__ __forceinline__ void mma_segment_tokens(const MmaLane<BITS, NG>& L, const MmaStage& st, int i, int seg,
                                                   const uint2* xd, const float* xe, const float* xsum,
                                                   float (&acc)[NT][2], const MmaTokens& tok) {
  using S = MmaSeg<BITS>;
  constexpr int ACCS = BITS == 4 ? 2 : 1, PAIRS = BITS == 4 ? 2 : 1;
#pragma unroll
  for (int k = 0; k < NT; ++k) {
    if (k >= tok.n) break;  // uniform
    const MmaTokenX v = mma_token_x(xd, xe, xsum, tok, k);
    int cs[ACCS][4] = {};
    const MmaXdLane xl = mma_xd_lane(L, reinterpret_cast<const uint32_t*>(v.xd));
    uint4 q[PAIRS];
#pragma unroll
    for (int p = 0; p < PAIRS; ++p) q[p] = mma_xd_pair<BITS>(xl, seg, p);
#pragma unroll
    for (int m = 0; m < S::MMAS; ++m) {
      uint32_t a[4];  // the segment's A fragments, the same for every token
      mma_a_frag<BITS>(st.w[i][0], st.w[i][1], m, a);
      const uint2 b = mma_b_frag<BITS>(q[BITS == 4 ? (m & 1) : 0], m);
      mma_s8(cs[mma_acc_of<BITS>(m)], a, b.x, b.y);
    }
    int c[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) c[e] = mma_combine<BITS>(cs, e);
    mma_columns<BITS, NG>(L, c, st.s[i], st.b[i], seg, v.xe, v.xsum, acc[k]);
  }
}

template <int BITS, int NG>
struct MmaTokensSegmentOp {
  static __device__ __forceinline__ void run(const MmaLane<BITS, NG>& L, const MmaStage& st, int i, int seg,
                                             const uint2* xd, const float* xe, const float* xsum,
                                             float (&acc)[MMA_MAX_TOKENS][2], const MmaTokens& tok) {
    mma_segment_tokens<BITS, NG, MMA_MAX_TOKENS>(L, st, i, seg, xd, xe, xsum, acc, tok);
  }
};

// y[k] = W x[k] (or y[k] += W x[k]: p.accumulate, ops::linear_add) for k < tokens (2..MMA_MAX_TOKENS),
// x [tokens, cols] and y [tokens, rows] row-major, x 16-byte aligned. (tokens is a parameter of its own:
// a field in MmaLinearParams changes the one-token kernel's SASS.) No tail, no normed input. p.ks: the
// one-token kernel's plan for the matrix (the same sums); grid: CTAs over passes. The weights of units 0
// and 1 are requested before the wait on the previous kernel and before x is staged.
template <int BITS, int NG>
__global__ void __launch_bounds__(MMA_THREADS, MMA_TOKENS_MIN_CTAS)
    linear_gemv_mma_tokens_kernel(const MmaLinearParams p, const int tokens) {
  using S = MmaSeg<BITS>;
  constexpr int VB = S::VALS / NG;
  extern __shared__ uint2 xd[];  // [tokens][cols/8][3] digits, then xe, xsum [tokens][cols/VB]
  float* xe = reinterpret_cast<float*>(xd + tokens * (p.cols / 8 * 3));
  float* xsum = xe + tokens * (p.cols / VB);
  const int Sg = p.cols / S::VALS;
  const MmaLinearRows<BITS> rows{p.w, p.scales, p.biases, p.y, p.rows, p.cols * BITS / 32,
                                 p.cols >> p.group_shift, p.group_shift, p.accumulate};
  auto stage = [&] {  // the weights of units 0 and 1 are on their way meanwhile
    pdl_wait();
    pdl_trigger();
    const auto x_at = [&](int o) { return p.x + 8 * int64_t(o); };
    mma_stage_x<BITS, VB, decltype(x_at), MMA_TOKENS_STAGE_ROUNDS>(x_at, tokens * p.cols, xd, xe, xsum);
    __syncthreads();
  };
  const auto none = [] {};
  mma_gemv_body<BITS, NG, MmaLinearRows<BITS>, decltype(none), decltype(stage), MmaTokensSegmentOp<BITS, NG>,
                MMA_MAX_TOKENS>(rows, (p.rows + 15) / 16, Sg, MmaSplit(p.ks, Sg), xd, xe, xsum, none, stage,
                                mma_tokens(tokens, p.cols, VB));
}

}  // namespace lily::cuda
