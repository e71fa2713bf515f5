// CPU emulator of the 8-bit weights on the prefill wgmma GEMM (kernels/linear_wgmma_tma.cuh, BITS = 8).
// With the kernel header's own host-callable pieces (wg_q8_pair, wg_q8_sel, wg_prmt, tma_w_row_bytes,
// tma_w_bytes, wg_swz, wg_xb_pos, wg_phys_k), it checks:
//   1. wg_q8_pair over every byte pair (q_lo, q_hi) at every byte position c, the other bytes random:
//      the bf16x2 result must be exactly (bf16(q_lo), bf16(q_hi)).
//   2. A K = 256 product (4 k-tiles) of a 256-output column tile over BM rows, group sizes 64 and 32
//      (GS32: two groups a k-tile): the producer's W box {16 words, 256 rows} at word kt*16 written into
//      the stage's [256][64 B] rows, the Xb box at wg_swz, then every consumer thread's A fragments
//      as wg_dequant_half<H, GS32, 8> builds them (row rbase + b*64 + 8h at ws + (b*64 + 8h)*64, one
//      16-byte load per k16 step st at 32H + 16st: register h from words (x, y), 2 + h from (z, w)),
//      the bf16x2 fma with the row's scale and bias (exact product and sum, one rounding to bf16):
//        - bit for bit against a scalar dequantisation of the same output at the logical k the
//          wgmma A fragment gives the register (row 16*w4 + g + 8*(reg%2), k 2c + e + 8*(reg/2) of
//          step 2H + st, physical k wg_phys_k of that);
//        - through an emulated m64nBMk16 wgmma (B read through the K-major SWIZZLE_128B descriptor
//          layout) into D, against an fp64 sum over the physical k of every (output, row).
// Built with nvcc as host code; prints "ok" per case, exits non-zero and prints FAIL on any mismatch.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/kernels/linear_wgmma_tma.cuh"
#include "cuda/kernels/xb_layout.cuh"

#include "emu_common.h"

using namespace lily::cuda;

// d rounded once to bf16 (8 significant bits, ties to even), normal range: fma.rn.bf16x2's rounding of
// an exact s*q + b.
static uint16_t bf16_of(double d) {
  if (d == 0) return 0;
  int e;
  const double m = std::frexp(d, &e);  // |m| in [0.5, 1)
  const float f = float(std::ldexp(std::nearbyint(m * 256.0), e - 8));  // exact in fp32
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t(u >> 16);
}

static uint16_t bf16_rn(float f) { return wg_bf16(f); }

// 1. the byte -> bf16 conversion, every pair of bytes at every position
static void check_pairs() {
  std::mt19937 rng(7);
  long bad = 0;
  for (int c = 0; c < 4; ++c)
    for (int q0 = 0; q0 < 256; ++q0)
      for (int q1 = 0; q1 < 256; ++q1) {
        const uint32_t keep = ~(0xFFu << (8 * c));
        const uint32_t lo = (rng() & keep) | uint32_t(q0) << (8 * c), hi = (rng() & keep) | uint32_t(q1) << (8 * c);
        const uint32_t v = wg_q8_pair(lo, hi, wg_q8_sel(c));
        const bool ok = bf16_to_f(uint16_t(v)) == float(q0) && bf16_to_f(uint16_t(v >> 16)) == float(q1);
        bad += !ok;
        expect(ok, "wg_q8_pair (c, q0 * 256 + q1)", c, q0 * 256 + q1);
      }
  std::printf("%s wg_q8_pair: 4 x 65536 byte pairs, %ld wrong\n", bad ? "FAIL" : "ok  ", bad);
}

// 2. one column tile, BM rows, K = 256, group size gs
static void check_product(int BM, int gs) {
  constexpr int K = 256, NK = K / WG_BK, KW = WG_BK * 8 / 32, R = tma_w_row_bytes(8);
  static_assert(KW == 16 && R == 64 && tma_w_bytes(8, 128) == 256 * 64 && tma_w_bytes(8, 256) == 128 * 64,
                "8-bit stage layout");
  const int N = wg_rows(BM), NB = wg_blocks(BM);  // the tile's weight rows; m64 blocks a consumer warpgroup
  const int failures0 = failures;
  std::mt19937 rng(BM * 100 + gs);
  std::uniform_real_distribution<float> U(-1.f, 1.f);
  std::vector<uint32_t> W(N * K / 4);
  for (auto& w : W) w = rng();
  std::vector<uint16_t> S(N * K / gs), B(N * K / gs);
  for (size_t i = 0; i < S.size(); ++i)
    S[i] = bf16_rn(0.002f + 0.001f * U(rng)), B[i] = bf16_rn(-0.25f + 0.01f * U(rng));
  std::vector<float> X(BM * K);
  for (auto& x : X) x = U(rng);
  std::vector<uint16_t> Xb(BM * K);  // wgx_bf16_kernel's layout
  for (int r = 0; r < BM; ++r)
    for (int k = 0; k < K; ++k) Xb[r * K + wg_xb_pos(k)] = bf16_rn(X[r * K + k]);
  auto q_at = [&](int o, int k) { return int((W[o * (K / 4) + k / 4] >> (8 * (k % 4))) & 0xFF); };
  auto w_at = [&](int o, int k) {  // scalar dequantisation: one rounding of s*q + b
    const int g = o * (K / gs) + k / gs;
    return bf16_of(double(bf16_to_f(S[g])) * q_at(o, k) + double(bf16_to_f(B[g])));
  };
  const int gshift = gs == 32 ? 5 : 6;
  std::vector<double> D(N * BM, 0.0);  // [o][r]
  std::vector<uint8_t> xs(BM * 128), wsm(tma_w_bytes(8, BM));
  long frag_bad = 0;
  for (int kt = 0; kt < NK; ++kt) {
    // producer: Xb box {64, BM} at (kt*64, 0), SWIZZLE_128B = chunk j of row r at wg_swz(r, j)
    for (int r = 0; r < BM; ++r)
      for (int j = 0; j < 8; ++j) std::memcpy(&xs[wg_swz(r, j)], &Xb[r * K + kt * WG_BK + 8 * j], 16);
    // W box {KW words, N rows} at word kt*KW: row i of the stage at i*R
    for (int i = 0; i < N; ++i) std::memcpy(&wsm[i * R], &W[i * (K / 4) + kt * KW], R);
    for (int cw = 0; cw < TMA_CONSUMER_WGS; ++cw)
      for (int b = 0; b < NB; ++b)
        for (int H = 0; H < 2; ++H)
          for (int st = 0; st < 2; ++st) {
            const int step = 2 * H + st;
            float Am[64][16];
            for (int t = 0; t < 128; ++t) {
              const int w4 = t >> 5, lane = t & 31, g = lane >> 2, c = lane & 3;
              const int rbase = wg_row_base(false, cw, w4, g, NB), ws = rbase * R;
              for (int h = 0; h < 2; ++h) {
                const int o = rbase + b * 64 + 8 * h;
                // wg_load_scales: group (kt*64 + half*32) >> gshift, half = H when GS32
                const int grp = o * (K / gs) + ((kt * WG_BK + (gs == 32 ? H : 0) * 32) >> gshift);
                const double s = bf16_to_f(S[grp]), bias = bf16_to_f(B[grp]);
                uint32_t w[4];
                std::memcpy(w, &wsm[ws + (b * 64 + 8 * h) * R + 32 * H + 16 * st], 16);
                const uint32_t sel = wg_q8_sel(c), pr[2] = {wg_q8_pair(w[0], w[1], sel), wg_q8_pair(w[2], w[3], sel)};
                for (int p = 0; p < 2; ++p) {  // register h (p = 0) or 2 + h (p = 1)
                  const int reg = 2 * p + h;
                  for (int e = 0; e < 2; ++e) {
                    const uint16_t v = bf16_of(s * bf16_to_f(uint16_t(pr[p] >> (16 * e))) + bias);
                    const int row = 16 * w4 + g + 8 * (reg & 1), lk = 2 * c + e + 8 * (reg >> 1);
                    expect(row + cw * 64 * NB + b * 64 == o, "fragment row", o, row);
                    const uint16_t want = w_at(o, kt * WG_BK + wg_phys_k(16 * step + lk));
                    frag_bad += v != want;
                    expect(v == want, "A fragment (output, k)", o, kt * WG_BK + 16 * step + lk);
                    Am[row][lk] = bf16_to_f(v);
                  }
                }
              }
            }
            // wgmma m64nBMk16: B element (n, kk) through the SWIZZLE_128B descriptor (start + step*32 B)
            for (int n = 0; n < BM; ++n)
              for (int kk = 0; kk < 16; ++kk) {
                const uint32_t addr = step * 32 + (n / 8) * 1024 + (n % 8) * 128 + kk * 2;
                uint16_t bv;
                std::memcpy(&bv, &xs[addr ^ (((addr >> 7) & 7) << 4)], 2);
                for (int m = 0; m < 64; ++m) D[(cw * 64 * NB + b * 64 + m) * BM + n] += double(Am[m][kk]) * bf16_to_f(bv);
              }
          }
  }
  double max_err = 0;
  for (int o = 0; o < N; ++o)
    for (int r = 0; r < BM; ++r) {
      double ref = 0;
      for (int k = 0; k < K; ++k) ref += double(bf16_to_f(w_at(o, k))) * bf16_to_f(bf16_rn(X[r * K + k]));
      max_err = std::max(max_err, std::fabs(D[o * BM + r] - ref) / (1e-3 + std::fabs(ref)));
    }
  expect(max_err < 1e-9, "product relative error x 1e12 (BM, gs)", long(max_err * 1e12), BM * 1000 + gs);
  std::printf("%s BM %3d, group %2d: %ld A fragment values wrong, max rel err %.1e\n",
              failures == failures0 ? "ok  " : "FAIL", BM, gs, frag_bad, max_err);
}

int main() {
  check_pairs();
  for (int bm : {64, 128, 256})
    for (int gs : {64, 32}) check_product(bm, gs);
  if (failures) {
    std::printf("FAIL: %d mismatches\n", failures);
    return 1;
  }
  std::printf("all passed\n");
  return 0;
}
