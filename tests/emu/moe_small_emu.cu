// CPU emulator of moe_small_kernel's fragments (kernels/moe_small.cuh): one warp's two 16-row A tiles over all K
// segments and n8 tiles of staged rows (tests/emu/ms_emu.h: the kernel's loads, the exact-q A = 128 + q and
// B registers by the PTX layout of mma.m16n8k16, ms_xsum's block sums, ms_block's per-block epilogue
// y += s*D + (b - 128 s)*xsum), against a scalar reference. Checked:
//   frag:  y must equal sum_k (s*q_k + b) bf16(X[n, k]) (double; 1e-6 of the products' magnitudes: xsum is
//          fp32 as in the kernel, while rounding each w to bf16 would be off by ~1e-4) for K = 512 and 2048,
//          groups of 64 (two a segment: one 32-bit scale word), 128 and 256 (one a segment or less), 1..24
//          rows (1..3 n8 tiles, ntiles < NT: the live tiles only);
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

static void run_case(int K, int gs, int rows, int nt, std::mt19937& rng) {
  const int N = 32, words = K / 8, gpr = K / gs, ntiles = (rows + 7) / 8, gshift = __builtin_ctz(gs);
  std::vector<uint32_t> W(size_t(N) * words);
  std::vector<uint16_t> S(size_t(N) * gpr), B(size_t(N) * gpr);
  std::uniform_int_distribution<uint32_t> bits;
  std::normal_distribution<float> normal(0.f, 1.f);
  for (auto& w : W) w = bits(rng);
  for (size_t i = 0; i < S.size(); ++i) S[i] = f_to_bf16(normal(rng) * 0.02f), B[i] = f_to_bf16(normal(rng) * 0.1f);
  std::vector<float> X(size_t(rows) * K);
  for (auto& x : X) x = normal(rng);
  std::vector<uint8_t> smem = ms_emu_stage(X.data(), K, rows, nt, K);
  ms_emu_xsum(smem, K, nt, ntiles);
  const int rbase[2] = {0, 16};  // the plain kernel's two tiles of a warp
  for (int t = 0; t < 2; ++t) {
    const std::vector<double> y = ms_emu_tile(W.data(), words, S.data(), B.data(), gpr, rbase, t, 0, 0,
                                              K / MS_SEG_VALS, gshift, smem, K, nt, ntiles);
    for (int o = 0; o < 16; ++o)
      for (int j = 0; j < rows; ++j) {
        const int row = rbase[t] + o;
        double mag;
        const double ref = q4_row_dot(&W[size_t(row) * words], &S[size_t(row) * gpr], &B[size_t(row) * gpr],
                                      &X[size_t(j) * K], K, gs, mag);
        const double got = y[size_t(o) * nt * 8 + j];
        expect(std::fabs(got - ref) <= 1e-6 * (mag + 1e-30), "frag y vs reference", got, ref);
      }
  }
  std::printf("ok  frag K=%d gs=%d rows=%d NT=%d\n", K, gs, rows, nt);
}

int main() {
  std::mt19937 rng(17);
  const int cases[][4] = {{512, 64, 5, 2},   {2048, 64, 8, 2},  {2048, 64, 13, 2}, {512, 128, 24, 3},
                          {2048, 128, 1, 2}, {512, 256, 17, 3}, {2048, 64, 20, 3}};
  for (const auto& cs : cases) run_case(cs[0], cs[1], cs[2], cs[3], rng);
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
