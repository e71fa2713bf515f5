// Prefill linear on tensor cores over MLX-affine weights (4 or 8 bits, BF16 scales/biases) or dense BF16
// weights (BITS = GEMM_DENSE_BF16: 16 bits per weight, taken as stored):
//   Y[r, o] = sum_i bf16(W_e[o, i]) * bf16(X[x_row(r), i]), fp32 accumulation, then the epilogue
//   of linear_common.cuh (plain store, or SwiGLU with a per-row scale for MoE); dense BF16 weights
//   with LinearArgs::bias: Y[r, o] = sum + bias[o] (one fp32 add, as add_bias after the store).
// W [E, N, K*BITS/32] U32 with K % 32 == 0 (dense BF16: [E, N, K] bf16, K % 8 == 0, 16-byte aligned);
// X rows [K] F32 (16-byte aligned, ldx % 4 == 0); tiles of product rows from RowTiles (dense, or an MoE
// tile map built on the device).
// CTA tile 64 (rows) x 128 (outputs) x 64 (k), 8 warps as 2 x 4, each warp 32 x 32 with
// mma.sync m16n8k16 (bf16 in, fp32 accumulate). Grid (row tiles, ceil(N / 128)): neighbouring CTAs
// share a weight tile, so it comes from HBM once and from L2 for the other row tiles.
// Weight tiles are dequantized in the load path (w = scale*q + bias in fp32, rounded to bf16) and X
// converted to bf16 while staging: no bf16 copy of the weights ever exists in memory. Two shared
// buffers; the next k-tile is loaded into registers while the tensor cores work on the current one.
// Matches cpu::linear to bf16 operand rounding (~1e-3 relative).
#pragma once
#include "linear_common.cuh"

namespace lily::cuda {

constexpr int GEMM_BM = 64, GEMM_BN = 128, GEMM_BK = 64, GEMM_THREADS = 256;
constexpr int GEMM_DENSE_BF16 = 16;  // the BITS of dense BF16 weights: a 16-byte chunk is 8 weights as stored
constexpr int GEMM_LDS = GEMM_BK + 8;  // bf16 row stride in shared memory: 144 B, ldmatrix without bank conflicts
constexpr int GEMM_SMEM_BYTES = 2 * (GEMM_BM + GEMM_BN) * GEMM_LDS * 2;

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <int BITS>
__global__ void __launch_bounds__(GEMM_THREADS) linear_gemm_kernel(const LinearArgs a) {
  pdl_wait();
  pdl_trigger();
  constexpr bool DENSE = BITS == GEMM_DENSE_BF16;              // no scales: chunks go to shared memory as read
  constexpr int VALS = 128 / BITS;                             // weight values per 16-byte chunk
  constexpr int CPR = GEMM_BK / VALS;                          // chunks per weight row per k-tile
  constexpr int B_LOADS = GEMM_BN * CPR / GEMM_THREADS;        // chunks per thread per k-tile
  constexpr int A_LOADS = GEMM_BM * GEMM_BK / 4 / GEMM_THREADS;  // float4s of X per thread per k-tile
  extern __shared__ __align__(16) uint16_t smem[];             // [2][BM + BN][LDS] bf16: X tile, W tile

  Tile tile;
  if (!find_tile(a.tiles, blockIdx.x, GEMM_BM, tile)) return;
  const int64_t N = a.w.rows, K = a.w.cols, n0 = int64_t(blockIdx.y) * GEMM_BN;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int num_k_tiles = int((K + GEMM_BK - 1) / GEMM_BK);

  const float* a_src[A_LOADS];  // X row of each float4 this thread stages (null: padding row)
#pragma unroll
  for (int i = 0; i < A_LOADS; ++i) {
    const int idx = tid + i * GEMM_THREADS, m = idx / (GEMM_BK / 4), c4 = idx % (GEMM_BK / 4);
    a_src[i] = m < tile.rows ? x_row(a, tile.row0 + m) + 4 * c4 : nullptr;
  }
  const int64_t wpr = K * BITS / 32, gpr = DENSE ? 0 : K / a.w.group_size;
  const uint32_t* b_src[B_LOADS];  // weight row of each chunk this thread stages (null: padding row)
  int64_t b_group[B_LOADS];
#pragma unroll
  for (int i = 0; i < B_LOADS; ++i) {
    const int idx = tid + i * GEMM_THREADS, n = idx / CPR, ch = idx % CPR;
    const int64_t row = tile.expert * N + n0 + n;
    b_src[i] = n0 + n < N ? static_cast<const uint32_t*>(a.w.w) + row * wpr + ch * VALS * BITS / 32 : nullptr;
    b_group[i] = row * gpr;
  }

  float4 ra[A_LOADS];
  uint4 rb[B_LOADS];
  float rs[B_LOADS], rz[B_LOADS];
  auto load_tile = [&](int kt) {
    const int64_t k0 = int64_t(kt) * GEMM_BK;
#pragma unroll
    for (int i = 0; i < A_LOADS; ++i) {
      const int c4 = (tid + i * GEMM_THREADS) % (GEMM_BK / 4);
      const bool ok = a_src[i] && k0 + 4 * c4 < K;
      ra[i] = ok ? __ldg(reinterpret_cast<const float4*>(a_src[i] + k0)) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int i = 0; i < B_LOADS; ++i) {
      const int ch = (tid + i * GEMM_THREADS) % CPR;
      const int64_t k = k0 + ch * VALS;  // K % 32 == 0 (dense: K % 8 == 0): a chunk is wholly inside or outside K
      const bool ok = b_src[i] && k < K;
      rb[i] = ok ? ld_stream(b_src[i] + k0 * BITS / 32) : make_uint4(0, 0, 0, 0);
      if constexpr (!DENSE) {
        const int64_t g = b_group[i] + k / a.w.group_size;
        rs[i] = ok ? bf16_bits_to_f32(static_cast<const uint16_t*>(a.w.scales)[g]) : 0.f;
        rz[i] = ok ? bf16_bits_to_f32(static_cast<const uint16_t*>(a.w.biases)[g]) : 0.f;
      }
    }
  };
  auto store_tile = [&](int buf) {
    uint16_t* As = smem + buf * (GEMM_BM + GEMM_BN) * GEMM_LDS;  // [BM][LDS]
    uint16_t* Bs = As + GEMM_BM * GEMM_LDS;                      // [BN][LDS]
#pragma unroll
    for (int i = 0; i < A_LOADS; ++i) {
      const int idx = tid + i * GEMM_THREADS, m = idx / (GEMM_BK / 4), c4 = idx % (GEMM_BK / 4);
      *reinterpret_cast<uint2*>(As + m * GEMM_LDS + 4 * c4) =
          make_uint2(pack_bf16x2(ra[i].x, ra[i].y), pack_bf16x2(ra[i].z, ra[i].w));
    }
    if constexpr (DENSE) {  // bf16 pairs in memory order: the lower index in the low half, as pack_bf16x2
#pragma unroll
      for (int i = 0; i < B_LOADS; ++i) {
        const int idx = tid + i * GEMM_THREADS, n = idx / CPR, ch = idx % CPR;
        *reinterpret_cast<uint4*>(Bs + n * GEMM_LDS + ch * VALS) = rb[i];
      }
    } else {
      constexpr uint32_t mask = (1u << BITS) - 1u;
#pragma unroll
      for (int i = 0; i < B_LOADS; ++i) {
        const int idx = tid + i * GEMM_THREADS, n = idx / CPR, ch = idx % CPR;
        uint32_t packed[VALS / 2];  // VALS bf16 values, two per word
#pragma unroll
        for (int j = 0; j < VALS; j += 2) {
          const uint32_t w = (j * BITS / 32 == 0)   ? rb[i].x
                             : (j * BITS / 32 == 1) ? rb[i].y
                             : (j * BITS / 32 == 2) ? rb[i].z
                                                    : rb[i].w;
          const int s = (j * BITS) % 32;
          const float q0 = float((w >> s) & mask), q1 = float((w >> (s + BITS)) & mask);
          packed[j / 2] = pack_bf16x2(fmaf(rs[i], q0, rz[i]), fmaf(rs[i], q1, rz[i]));
        }
        uint4* dst = reinterpret_cast<uint4*>(Bs + n * GEMM_LDS + ch * VALS);
#pragma unroll
        for (int v = 0; v < VALS / 8; ++v)
          dst[v] = make_uint4(packed[4 * v], packed[4 * v + 1], packed[4 * v + 2], packed[4 * v + 3]);
      }
    }
  };

  const int warp_m = warp & 1, warp_n = warp >> 1;  // warp tile: rows 32*warp_m.., outputs 32*warp_n..
  float acc[2][4][4] = {};
  load_tile(0);
  store_tile(0);
  __syncthreads();
  for (int kt = 0; kt < num_k_tiles; ++kt) {
    const bool has_next = kt + 1 < num_k_tiles;
    if (has_next) load_tile(kt + 1);
    const uint16_t* As = smem + (kt & 1) * (GEMM_BM + GEMM_BN) * GEMM_LDS;
    const uint16_t* Bs = As + GEMM_BM * GEMM_LDS;
#pragma unroll
    for (int kk = 0; kk < GEMM_BK; kk += 16) {
      uint32_t af[2][4], bfr[2][4];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
        ldmatrix_x4(af[mi], As + (warp_m * 32 + mi * 16 + (lane & 15)) * GEMM_LDS + kk + (lane >> 4) * 8);
#pragma unroll
      for (int nj = 0; nj < 2; ++nj)
        ldmatrix_x4(bfr[nj], Bs + (warp_n * 32 + nj * 16 + (lane & 7) + ((lane >> 4) << 3)) * GEMM_LDS + kk +
                                 ((lane >> 3) & 1) * 8);
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) mma_bf16(acc[mi][ni], af[mi], bfr[ni >> 1][(ni & 1) * 2], bfr[ni >> 1][(ni & 1) * 2 + 1]);
    }
    if (has_next) store_tile((kt + 1) & 1);
    __syncthreads();
  }

#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int m = warp_m * 32 + mi * 16 + (lane >> 2) + (c >= 2 ? 8 : 0);
        const int64_t o = n0 + warp_n * 32 + ni * 8 + (lane & 3) * 2 + (c & 1);
        if (m < tile.rows && o < N) {
          float v = acc[mi][ni][c];
          if constexpr (DENSE) {
            if (a.bias) v += a.bias[o];
          }
          store_output(a, tile.row0 + m, o, v);
        }
      }
}

}  // namespace lily::cuda
