// One lane's share of an mma.m16n8k16 step of moe_small.cuh's segment loop, assembled on the host (shared
// by moe_small_emu and dense_small_emu; include after emu_common.h and the kernel header): lane (g, c)
// dequantizes its A values of k16 step (m, h) from its two 16-byte weight loads w0 (row g) and w1 (row
// g + 8) with those rows' scale and bias at group grp (sc[0], bi[0]: row g; sc[1], bi[1]: row g + 8), and
// reads its B values of the nt staged n8 tiles (row stride `stride`, segment seg) through ms_b_frag.
#pragma once
#include <cstring>
#include <vector>

template <int COLS>
static void ms_emu_lane(const uint4& w0, const uint4& w1, const uint16_t* const (&sc)[2], const uint16_t* const (&bi)[2],
                        int64_t grp, const std::vector<uint8_t>& smem, size_t stride, int seg, int m, int h, int g,
                        int c, int nt, double (&A)[16][16], double (&Bm)[16][COLS]) {
  uint32_t q[4];
  lily::cuda::ms_a_bits(w0, w1, m, h, q);
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i & 1), kb = 2 * c + 8 * (i >> 1);  // PTX A layout: a0a1, a2a3, a4a5, a6a7
    for (int e = 0; e < 2; ++e) A[row][kb + e] = dequant(q[i], e, sc[i & 1][grp], bi[i & 1][grp]);
  }
  for (int n = 0; n < nt; ++n) {
    uint4 chunk;
    std::memcpy(&chunk, &smem[size_t(n * 8 + g) * stride + seg * 256 + 16 * (4 * m + c)], 16);
    uint32_t b[2];
    lily::cuda::ms_b_frag(chunk, h, b[0], b[1]);
    for (int i = 0; i < 2; ++i)  // PTX B layout: b0b1 (k 2c, 2c+1), b2b3 (k 2c+8, 2c+9), column g
      for (int e = 0; e < 2; ++e) Bm[2 * c + 8 * i + e][n * 8 + g] = bf16_to_f(uint16_t(b[i] >> (16 * e)));
  }
}
