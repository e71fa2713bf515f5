// One warp's work of moe_small.cuh's exact-q segment loop, assembled on the host lane by lane (shared by
// moe_small_emu and dense_small_emu; include after emu_common.h and the kernel header), with the header's own
// host-callable pieces (ms_slot, ms_a_bits, ms_b_frag, ms_group, ms_xsum_at, ms_xsum_offset, ms_row_bytes) and
// the PTX layouts of mma.m16n8k16 written out here independently:
//   ms_emu_stage: the staged rows as ms_stage writes them (Xb chunk J of row j at j * stride + 16 ms_slot(J));
//   ms_emu_xsum:  ms_xsum's block sums (an A of ones over the block's B fragments, lanes g = 0 storing row 0
//                 at ms_xsum_at), every xsum slot of the live tiles written exactly once;
//   ms_emu_tile:  a 16-row A tile over nseg segments: per segment and lane the kernel's loads (two 8-byte
//                 units at bytes 32b + 8c of each row g, g+8; the scale/bias word of ms_load, of the lane's
//                 row (tile c >> 1, row g + 8 (c & 1)): G64 one 32-bit word of the two blocks' values, else the
//                 group's value twice), per block b the steps
//                 m = 2b, 2b+1 with A = bf16(128 + q) (ms_a_bits, then the lop3's bits decoded) and B
//                 (ms_b_frag of the chunk at the segment's slot 4m + c), D accumulated in double, then
//                 ms_block's epilogue y += s*D + (b - 128 s)*xsum, s and b converted by the lane that loaded
//                 them and taken from lane ms_sb_lane(t, r) of the quad, xsum read at the kernel's address.
#pragma once
#include <cstring>
#include <vector>

// The staged rows of nt n8 tiles: rows j < rows from X (row stride ldx, K values from x0), the rest zero.
static std::vector<uint8_t> ms_emu_stage(const float* X, size_t ldx, int rows, int nt, int K) {
  const int stride = lily::cuda::ms_row_bytes(K);
  std::vector<uint8_t> smem(lily::cuda::ms_smem_bytes(K, nt), 0);
  for (int j = 0; j < rows; ++j)
    for (int J = 0; J < K / 8; ++J) {
      const float* x = X + size_t(j) * ldx + 8 * J;
      const uint32_t v[4] = {lily::cuda::wg_pack_bf16x2(x[0], x[4]), lily::cuda::wg_pack_bf16x2(x[1], x[5]),
                             lily::cuda::wg_pack_bf16x2(x[2], x[6]), lily::cuda::wg_pack_bf16x2(x[3], x[7])};
      std::memcpy(&smem[size_t(j) * stride + 16 * lily::cuda::ms_slot(J)], v, 16);
    }
  return smem;
}

// The B values of lane (g, c) from the 16-byte chunk at byte `at` of the staged rows, mma h, n8 tile n.
template <int COLS>
static void ms_emu_b(const std::vector<uint8_t>& smem, size_t at, int h, int g, int c, int n, double (&Bm)[16][COLS]) {
  uint4 chunk;
  std::memcpy(&chunk, &smem[at], 16);
  uint32_t b[2];
  lily::cuda::ms_b_frag(chunk, h, b[0], b[1]);
  for (int i = 0; i < 2; ++i)  // PTX B layout: b0b1 (k 2c, 2c+1), b2b3 (k 2c+8, 2c+9), column g
    for (int e = 0; e < 2; ++e) Bm[2 * c + 8 * i + e][n * 8 + g] = bf16_to_f(uint16_t(b[i] >> (16 * e)));
}

// ms_xsum for `ntiles` live tiles of a K-value staging (nt tiles of room): written into smem's xsum area.
static void ms_emu_xsum(std::vector<uint8_t>& smem, int K, int nt, int ntiles) {
  const size_t stride = lily::cuda::ms_row_bytes(K), xq = lily::cuda::ms_xsum_offset(K, nt);
  std::vector<int> written(size_t(K / 64) * nt * 8, 0);
  for (int blk = 0; blk < K / 64; ++blk)
    for (int n = 0; n < ntiles; ++n) {
      double D[8] = {};  // row 0 of D (an A of ones: every row the column sums)
      for (int mm = 0; mm < 2; ++mm)
        for (int h = 0; h < 2; ++h) {
          double Bm[16][64] = {};
          for (int lane = 0; lane < 32; ++lane) {
            const int g = lane / 4, c = lane % 4;
            ms_emu_b(smem, (8 * n + g) * stride + blk * 128 + 16 * c + 64 * mm, h, g, c, 0, Bm);
          }
          for (int col = 0; col < 8; ++col)
            for (int k = 0; k < 16; ++k) D[col] += Bm[k][col];
        }
      for (int c = 0; c < 4; ++c) {  // lanes g = 0: columns 2c, 2c+1 at ms_xsum_at(blk, 8n + 2c)
        const int at = lily::cuda::ms_xsum_at(blk, 8 * n + 2 * c, nt);
        const float v[2] = {float(D[2 * c]), float(D[2 * c + 1])};
        std::memcpy(&smem[xq + at], v, 8);
        ++written[at / 4], ++written[at / 4 + 1];
      }
    }
  for (int blk = 0; blk < K / 64; ++blk)
    for (int j = 0; j < 8 * ntiles; ++j)
      expect(written[lily::cuda::ms_xsum_at(blk, j, nt) / 4] == 1, "xsum written once", blk, j);
}

// The scale (or bias) bits ms_load leaves for block b of segment seg of a row whose group 0 has index sbi.
static uint16_t ms_emu_sb(const uint16_t* arr, uint32_t sbi, int seg, int b, int gshift) {
  if (gshift == 6) {
    uint32_t word;
    std::memcpy(&word, arr + 2 * ((sbi >> 1) + seg), 4);
    return uint16_t(b ? word >> 16 : word & 0xFFFF);
  }
  return arr[sbi + lily::cuda::ms_group(seg, gshift)];
}

// A tile t of a warp's two 16-row A tiles (first rows rbase[0], rbase[1] of W, `words` U32 a row; scales S,
// biases B, `gpr` a row) over segments seg0 .. seg0 + nseg - 1 (group index of the first: grp0) against ntiles
// live n8 tiles of the staging (nt of room, Kp values a row): returns y[row][8 n + col] as the lanes'
// registers hold it.
static std::vector<double> ms_emu_tile(const uint32_t* W, int words, const uint16_t* S, const uint16_t* B, int gpr,
                                       const int (&rbase)[2], int t, int seg0, int grp0, int nseg, int gshift,
                                       const std::vector<uint8_t>& smem, int Kp, int nt, int ntiles) {
  const int r0 = rbase[t];
  const size_t stride = lily::cuda::ms_row_bytes(Kp), xq = lily::cuda::ms_xsum_offset(Kp, nt);
  const int cols = nt * 8;
  std::vector<double> y(size_t(16) * cols, 0.0);
  for (int seg = 0; seg < nseg; ++seg) {
    // the lanes' loads: row g (w0) and g + 8 (w1) as ms_load's uint4 (uint2 units seg * 8 + c and + 4)
    uint4 wl[32][2];
    for (int lane = 0; lane < 32; ++lane)
      for (int hr = 0; hr < 2; ++hr) {
        const uint32_t* row = W + size_t(r0 + lane / 4 + 8 * hr) * words + 2 * (size_t(seg0 + seg) * 8 + lane % 4);
        wl[lane][hr] = make_uint4(row[0], row[1], row[8], row[9]);
      }
    for (int b = 0; b < 2; ++b) {
      std::vector<double> D(size_t(16) * cols, 0.0);
      for (int m = 2 * b; m < 2 * b + 2; ++m)
        for (int h = 0; h < 2; ++h) {
          double A[16][16], Bm[16][32] = {};
          for (int lane = 0; lane < 32; ++lane) {
            const int g = lane / 4, c = lane % 4;
            uint32_t q[4];
            lily::cuda::ms_a_bits(wl[lane][0], wl[lane][1], m, h, q);
            for (int i = 0; i < 4; ++i) {
              const uint32_t v = (q[i] & 0x000F000Fu) | 0x43004300u;  // the lop3 of wg_q128_pair
              const int row = g + 8 * (i & 1), kb = 2 * c + 8 * (i >> 1);  // PTX A layout: a0a1, a2a3, ...
              for (int e = 0; e < 2; ++e) A[row][kb + e] = bf16_to_f(uint16_t(v >> (16 * e)));
            }
            for (int n = 0; n < ntiles; ++n)
              ms_emu_b(smem, (n * 8 + g) * stride + seg * 256 + 16 * (4 * m + c), h, g, c, n, Bm);
          }
          for (int r = 0; r < 16; ++r)
            for (int col = 0; col < ntiles * 8; ++col) {
              double acc = 0;
              for (int k = 0; k < 16; ++k) acc += A[r][k] * Bm[k][col];
              D[size_t(r) * cols + col] += acc;
            }
        }
      // each lane's converted scale and b - 128 s: its row is tile c >> 1, row g + 8 (c & 1)
      double s1[32], o1[32];
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, c = lane % 4;
        const uint32_t sbi = uint32_t((rbase[c >> 1] + g + 8 * (c & 1)) * gpr + grp0);
        s1[lane] = bf16_to_f(ms_emu_sb(S, sbi, seg, b, gshift));
        o1[lane] = -128.0 * s1[lane] + bf16_to_f(ms_emu_sb(B, sbi, seg, b, gshift));
      }
      // ms_block's epilogue, lane by lane: acc[n][i] is row g + 8 (i >> 1), column 8n + 2c + (i & 1); s and o of
      // row half r from lane ms_sb_lane(t, r) of the quad
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, c = lane % 4;
        for (int n = 0; n < ntiles; ++n)
          for (int i = 0; i < 4; ++i) {
            const int row = g + 8 * (i >> 1), col = 8 * n + 2 * c + (i & 1);
            const int src = 4 * g + lily::cuda::ms_sb_lane(t, i >> 1);
            const double s = s1[src], o = o1[src];
            // the kernel's xsum address: xq + 8c, + seg * 2 NT * 32, + ms_xsum_at(b, 8n), + 4 (i & 1)
            const size_t at =
                xq + 8 * c + size_t(seg) * 2 * nt * 32 + lily::cuda::ms_xsum_at(b, 8 * n, nt) + 4 * (i & 1);
            float xs;
            std::memcpy(&xs, &smem[at], 4);
            y[size_t(row) * cols + col] += s * D[size_t(row) * cols + col] + o * xs;
          }
      }
    }
  }
  return y;
}
