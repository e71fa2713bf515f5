// CPU emulator of moe_small_kernel's fragments (kernels/moe_small.cuh): one warp's 16-row A tile over all K
// segments and n8 tiles of staged rows, with the header's own host-callable pieces (ms_slot, ms_a_bits,
// ms_b_frag, ms_group, ms_row_bytes, wg_pack_bf16x2), against a scalar reference. Checked:
//   frag:  for every lane the A registers (ms_a_bits at the lane's 16 bytes of rows g and g+8, dequantized
//          as wg_dequant_pair: s*q + b rounded once to bf16, the lane's group by ms_group) and the B
//          registers (ms_b_frag of the 16-byte chunk at the kernel's staged address: ms_slot of Xb chunk J,
//          written as ms_stage writes it), assembled into A [16 x 16] and B [16 x 8] by the PTX layout of
//          mma.m16n8k16 (written out here independently), accumulated in double into D [16 x 8] scattered
//          back by the accumulator layout: D must equal sum_k bf16(W[o, k]) bf16(X[n, k]) (double, any order)
//          for K = 512 and 2048, groups of 32, 64 and 128, 1..8 rows per n8 tile;
//   slot:  ms_slot permutes the 16 chunks of each segment;
//   banks: the 8 lanes of each quarter warp read 16-byte units in 8 different 128-byte bank positions
//          (conflict-free ld.shared.v4) for every m.
// Built with nvcc as host code; exits non-zero and prints FAIL on any mismatch.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/kernels/moe_small.cuh"

#include "emu_common.h"
#include "ms_emu.h"

using namespace lily::cuda;

static void run_case(int K, int gs, int rows, std::mt19937& rng) {
  const int N = 16, words = K / 8, gpr = K / gs, nt = (rows + 7) / 8, gshift = __builtin_ctz(gs);
  std::vector<uint32_t> W(size_t(N) * words);
  std::vector<uint16_t> S(size_t(N) * gpr), B(size_t(N) * gpr);
  std::uniform_int_distribution<uint32_t> bits;
  std::normal_distribution<float> normal(0.f, 1.f);
  for (auto& w : W) w = bits(rng);
  for (size_t i = 0; i < S.size(); ++i) S[i] = f_to_bf16(normal(rng) * 0.02f), B[i] = f_to_bf16(normal(rng) * 0.1f);
  std::vector<float> X(size_t(nt) * 8 * K, 0.f);
  for (int j = 0; j < rows; ++j)
    for (int k = 0; k < K; ++k) X[size_t(j) * K + k] = normal(rng);
  // the staged rows as ms_stage writes them: Xb chunk J of row j at byte j * stride + 16 * ms_slot(J)
  const int stride = ms_row_bytes(K);
  std::vector<uint8_t> smem(size_t(nt) * 8 * stride, 0);
  for (int j = 0; j < nt * 8; ++j)
    for (int J = 0; J < K / 8; ++J) {
      const float* x = &X[size_t(j) * K + 8 * J];
      const uint32_t v[4] = {wg_pack_bf16x2(x[0], x[4]), wg_pack_bf16x2(x[1], x[5]), wg_pack_bf16x2(x[2], x[6]),
                             wg_pack_bf16x2(x[3], x[7])};
      std::memcpy(&smem[size_t(j) * stride + 16 * ms_slot(J)], v, 16);
    }
  // the warp: D[o][n] over all segments
  std::vector<double> D(size_t(16) * nt * 8, 0.0);
  for (int seg = 0; seg < K / MS_SEG_VALS; ++seg)
    for (int m = 0; m < 4; ++m)
      for (int h = 0; h < 2; ++h) {
        double A[16][16], Bm[16][64];
        for (int lane = 0; lane < 32; ++lane) {
          const int g = lane / 4, c = lane % 4;
          uint4 w0, w1;
          std::memcpy(&w0, &W[size_t(g) * words + seg * 16 + 4 * c], 16);
          std::memcpy(&w1, &W[size_t(g + 8) * words + seg * 16 + 4 * c], 16);
          const uint16_t* const sc[2] = {&S[size_t(g) * gpr], &S[size_t(g + 8) * gpr]};
          const uint16_t* const bi[2] = {&B[size_t(g) * gpr], &B[size_t(g + 8) * gpr]};
          ms_emu_lane(w0, w1, sc, bi, ms_group(seg, c, gshift), smem, stride, seg, m, h, g, c, nt, A, Bm);
        }
        for (int r = 0; r < 16; ++r)
          for (int col = 0; col < nt * 8; ++col) {
            double acc = 0;
            for (int k = 0; k < 16; ++k) acc += A[r][k] * Bm[k][col];
            D[size_t(r) * nt * 8 + col] += acc;
          }
      }
  // reference
  for (int o = 0; o < 16; ++o)
    for (int j = 0; j < rows; ++j) {
      double mag;
      const double ref = q4_row_dot(&W[size_t(o) * words], &S[size_t(o) * gpr], &B[size_t(o) * gpr], &X[size_t(j) * K],
                                    K, gs, mag);
      const double got = D[size_t(o) * nt * 8 + j];
      expect(std::fabs(got - ref) <= 1e-9 * (mag + 1e-30), "frag D vs reference", got, ref);
    }
  std::printf("ok  frag K=%d gs=%d rows=%d\n", K, gs, rows);
}

int main() {
  std::mt19937 rng(17);
  const int cases[][3] = {{512, 64, 5}, {2048, 64, 8}, {2048, 32, 13}, {512, 128, 32}, {2048, 128, 1}, {512, 32, 24}};
  for (const auto& cs : cases) run_case(cs[0], cs[1], cs[2], rng);
  // ms_slot: a permutation of each segment's 16 chunks
  for (int seg = 0; seg < 4; ++seg) {
    bool seen[16] = {};
    for (int J = 16 * seg; J < 16 * seg + 16; ++J) {
      const int s = ms_slot(J);
      expect(s / 16 == seg && !seen[s % 16], "slot permutation", J, s);
      if (s / 16 == seg) seen[s % 16] = true;
    }
  }
  std::printf("ok  slot\n");
  // banks: a quarter warp's 8 lanes read 8 distinct 16-byte bank positions (K = 512 and 2048)
  for (int K : {512, 2048})
    for (int m = 0; m < 4; ++m)
      for (int qw = 0; qw < 4; ++qw) {
        bool used[8] = {};
        for (int lane = 8 * qw; lane < 8 * qw + 8; ++lane) {
          const int g = lane / 4, c = lane % 4;
          const int unit = ((g * ms_row_bytes(K) + 16 * (4 * m + c)) / 16) % 8;
          expect(!used[unit], "bank conflict", lane, unit);
          used[unit] = true;
        }
      }
  std::printf("ok  banks\n");
  if (failures) {
    std::printf("%d failures\n", failures);
    return 1;
  }
  std::printf("all passed\n");
  return 0;
}
