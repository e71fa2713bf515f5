// MoE decode on tensor cores (T <= MOE_DECODE_MAX_TOKENS): the up and down GEMVs of the decode
// chain (moe_decode.cuh) on the building blocks of linear_gemv_tc.cuh, for the model's shape class:
// every expert matrix fast affine with one bit width and group size, I == Is, I % 16 == 0.
// Slot s of token t: s < K is routed expert topk_id[t, s], s == K the shared expert.
// Grid (CTAs, T): a CTA serves one token (NT = 1: lane t == 0 holds the sums), stages its
// activations once and walks 16-row tiles with a grid stride. Fixed-order sums: deterministic.
#pragma once
#include "linear_gemv_tc.cuh"
#include "moe_decode.cuh"

namespace lily::cuda {

struct MoeUpTcParams {
  TcMatrix gate, up;                // [E, I, H]
  TcMatrix shared_gate, shared_up;  // [1, I, H]
  const float* h;                   // [T, H] F32
  const int32_t* topk_id;           // [T, K]
  const float* topk_w;              // [T, K]
  const float* shared_w;            // [T] sigmoid of the shared expert gate
  float* act;                       // [T, K+1, ld] F32
  int K, ld;
};

// act[t, s, i] = w(t, s) * silu(G_s[i, :] . h[t]) * (U_s[i, :] . h[t]), w = topk_w[t, s] or
// shared_w[t]. Tiles: 16 consecutive rows rho = s*I + i of the K+1 slots (I % 16 == 0, so a tile
// stays in one slot); each tile reads its gate and up rows.
template <int BITS, int SW>
__global__ void __launch_bounds__(TC_THREADS, SW <= 4 ? 2 : 1) moe_up_tc_kernel(const MoeUpTcParams p) {
  using S = TcShape<BITS>;
  extern __shared__ uint2 tc_smem[];
  __shared__ float red[TC_WARPS][TC_TILE_ROWS][1];
  __shared__ int32_t ids[MOE_MAX_TOP_K];
  const int t = blockIdx.y, H = p.gate.cols, I = p.gate.rows, gs = p.gate.group_size;
  const int groups = H / gs, spg = gs / S::VQ, tiles = (p.K + 1) * I / TC_TILE_ROWS;
  const TcX x{p.h + int64_t(t) * H, 0, H, H, H, 1, gs};
  const TcStaged<1> st(tc_smem, H, H / S::VQ, S::MPS, groups);
  const int g = (threadIdx.x & 31) >> 2;
  for (int k = threadIdx.x; k < p.K; k += blockDim.x) ids[k] = p.topk_id[t * p.K + k];
  __syncthreads();

  TcLoads<SW> G, U;
  auto load = [&](int tile) {
    const int s = tile * TC_TILE_ROWS / I, i0 = tile * TC_TILE_ROWS % I;
    const int64_t base = s < p.K ? int64_t(ids[s]) * I : 0;
    const TcMatrix gm = s < p.K ? p.gate : p.shared_gate, um = s < p.K ? p.up : p.shared_up;
    tc_load<BITS>(G, spg, groups, [&](int grp, int r, TcMatrix& m, int64_t& row, int& rg) {
      m = gm, row = base + i0 + g + 8 * r, rg = grp;
      return true;
    });
    tc_load<BITS>(U, spg, groups, [&](int grp, int r, TcMatrix& m, int64_t& row, int& rg) {
      m = um, row = base + i0 + g + 8 * r, rg = grp;
      return true;
    });
  };
  int tile = blockIdx.x;
  if (tile < tiles) load(tile);
  tc_stage_x<BITS, 1>(x, st);
  __syncthreads();
  for (; tile < tiles; tile += gridDim.x) {
    float yg[2] = {0.f, 0.f}, yu[2] = {0.f, 0.f};
    tc_dot<BITS, 1, SW>(G, st, spg, groups, yg);
    tc_dot<BITS, 1, SW>(U, st, spg, groups, yu);
    const int s = tile * TC_TILE_ROWS / I, i0 = tile * TC_TILE_ROWS % I;
    if (tile + int(gridDim.x) < tiles) load(tile + gridDim.x);
    float gate = 0.f, up = 0.f;
    tc_reduce<1>(yg, red, gate);
    if (tc_reduce<1>(yu, red, up)) {
      const float w = s < p.K ? p.topk_w[t * p.K + s] : p.shared_w[t];
      p.act[(int64_t(t) * (p.K + 1) + s) * p.ld + i0 + threadIdx.x] = w * silu(gate) * up;
    }
  }
}

struct MoeDownTcParams {
  TcMatrix down;         // [E, H, I]
  TcMatrix shared_down;  // [1, H, I]
  const int32_t* topk_id;  // [T, K]
  const float* act;        // [T, K+1, ld] F32
  float* out;              // [T, H] F32
  int K, ld;
};

// out[t, o] = sum_{s = 0..K} D_s[o, :] . act[t, s, :] as one product over the (K+1)*I virtual
// columns of the concatenated slots: virtual group v is group v % (I/group) of slot v / (I/group).
template <int BITS, int SW>
__global__ void __launch_bounds__(TC_THREADS, SW <= 9 ? 2 : 1) moe_down_tc_kernel(const MoeDownTcParams p) {
  using S = TcShape<BITS>;
  extern __shared__ uint2 tc_smem[];
  __shared__ float red[TC_WARPS][TC_TILE_ROWS][1];
  __shared__ int32_t ids[MOE_MAX_TOP_K];
  const int t = blockIdx.y, H = p.down.rows, I = p.down.cols, gs = p.down.group_size;
  const int cols = (p.K + 1) * I, gps = I / gs, groups = cols / gs, spg = gs / S::VQ;
  const int tiles = (H + TC_TILE_ROWS - 1) / TC_TILE_ROWS;
  const TcX x{p.act + int64_t(t) * (p.K + 1) * p.ld, 0, p.ld, I, cols, 1, gs};
  const TcStaged<1> st(tc_smem, cols, cols / S::VQ, S::MPS, groups);
  const int g = (threadIdx.x & 31) >> 2;
  for (int k = threadIdx.x; k < p.K; k += blockDim.x) ids[k] = p.topk_id[t * p.K + k];
  __syncthreads();

  TcLoads<SW> L;
  auto load = [&](int tile) {
    tc_load<BITS>(L, spg, groups, [&](int grp, int r, TcMatrix& m, int64_t& row, int& rg) {
      const int s = grp / gps, o = tile * TC_TILE_ROWS + g + 8 * r;
      m = s < p.K ? p.down : p.shared_down;
      row = (s < p.K ? int64_t(ids[s]) * H : 0) + o;
      rg = grp % gps;
      return o < H;
    });
  };
  int tile = blockIdx.x;
  if (tile < tiles) load(tile);
  tc_stage_x<BITS, 1>(x, st);
  __syncthreads();
  for (; tile < tiles; tile += gridDim.x) {
    float y[2] = {0.f, 0.f};
    tc_dot<BITS, 1, SW>(L, st, spg, groups, y);
    if (tile + int(gridDim.x) < tiles) load(tile + gridDim.x);
    float out;
    if (tc_reduce<1>(y, red, out)) {
      const int o = tile * TC_TILE_ROWS + int(threadIdx.x);
      if (o < H) p.out[int64_t(t) * H + o] = out;
    }
  }
}

}  // namespace lily::cuda
