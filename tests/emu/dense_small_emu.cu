// CPU emulator of dense_small_kernel (kernels/dense_small.cuh) over whole products, with the header's own
// host-callable pieces: the plan (ds_splits, ds_tiles, ds_smem_bytes), a K-part's weight addresses
// (ds_seg0, ds_group0 on top of moe_small.cuh's loads, emulated by tests/emu/ms_emu.h), the staged X of a
// K-part and its block sums (ms_emu_stage, ms_emu_xsum), the partials' places (ds_p_lane, ds_p_at) and the
// reduction's element ranges (ds_elems). Checked:
//   product: every CTA (slice, kz) and warp of the grid, each 16-row A tile by ms_emu_tile (the exact-q
//            fragments and the per-block epilogue, in double over a K-part) into P, then y[j, o] = sum over
//            the ks ranks of P at ds_p_at(j, o') for each rank's element range: must equal
//            sum_k (s*q_k + b) bf16(X[j, k]) (double; 1e-6 of the products' magnitudes, xsum fp32) for
//            T = 2..32, K = 384..8192, groups 64..256, K split 1..8 ways; every (j < T, o < N) stored once;
//   partials: in a CTA each (token, slice row) written by exactly one (warp, lane, t, n, i), and for each
//            (t, n, i) the 32 lanes of a warp write 32 different banks (conflict-free st.shared);
//   plan:    ds_splits of the model's dense shapes at 132 SMs (2 CTAs an SM), staged bytes within
//            DS_MAX_SMEM for T = 2..32, 0 where no split fits (K = 16384 at T = 32).
// Built with nvcc as host code; exits non-zero and prints FAIL on any mismatch.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/kernels/dense_small.cuh"

#include "emu_common.h"
#include "ms_emu.h"

using namespace lily::cuda;

constexpr int64_t RESIDENT = 132 * DS_CTAS_PER_SM;

static void run_case(int N, int K, int gs, int T, std::mt19937& rng) {
  const int ks = ds_splits(N, K, gs, T, RESIDENT), nt = ds_tiles(T), gshift = __builtin_ctz(gs);
  expect(ks > 0 && ds_smem_bytes(K / ks, nt) <= DS_MAX_SMEM, "plan fits", ks, K);
  if (ks <= 0) return;
  const int words = K / 8, gpr = K / gs, Kp = K / ks, nseg = Kp / MS_SEG_VALS;
  std::vector<uint32_t> W(size_t(N) * words);
  std::vector<uint16_t> S(size_t(N) * gpr), B(size_t(N) * gpr);
  std::uniform_int_distribution<uint32_t> bits;
  std::normal_distribution<float> normal(0.f, 1.f);
  for (auto& w : W) w = bits(rng);
  for (size_t i = 0; i < S.size(); ++i) S[i] = f_to_bf16(normal(rng) * 0.02f), B[i] = f_to_bf16(normal(rng) * 0.1f);
  std::vector<float> X(size_t(T) * K);
  for (auto& x : X) x = normal(rng);
  std::vector<double> Y(size_t(T) * N, 0.0);
  std::vector<int> stores(size_t(T) * N, 0);
  const int slices = (N + DS_SLICE_ROWS - 1) / DS_SLICE_ROWS;
  for (int sl = 0; sl < slices; ++sl) {
    std::vector<std::vector<double>> P(ks, std::vector<double>(size_t(nt) * 8 * DS_P_STRIDE, 0.0));
    for (int kz = 0; kz < ks; ++kz) {
      // the K-part's staged rows, as ms_stage writes them from X + kz * Kp (padding rows zero), and their sums
      std::vector<uint8_t> smem = ms_emu_stage(&X[size_t(kz) * Kp], K, T, nt, Kp);
      ms_emu_xsum(smem, Kp, nt, nt);
      std::vector<int> written(size_t(nt) * 8 * DS_P_STRIDE, 0);
      for (int warp = 0; warp < MS_WARPS; ++warp) {
        const int o0 = sl * DS_SLICE_ROWS + warp * 32;
        if (o0 >= N) continue;  // not live
        for (int t = 0; t < 2; ++t) {
          // the kernel's addresses: rr.w = row + c (uint2) + ds_seg0 * 8; rr.sbi = row * gpr + ds_group0 (the
          // lane's scale row)
          const int rbase[2] = {o0, o0 + 16};
          const std::vector<double> D =
              ms_emu_tile(W.data(), words, S.data(), B.data(), gpr, rbase, t, int(ds_seg0(kz, nseg)),
                          int(ds_group0(kz, Kp, gshift)), nseg, gshift, smem, Kp, nt, nt);
          // the accumulator layout: acc[t][n][i] of lane (g, c) is D[g + 8 (i >> 1)][8n + 2c + (i & 1)]
          for (int lane = 0; lane < 32; ++lane) {
            const int g = lane / 4, c = lane % 4;
            for (int n = 0; n < nt; ++n)
              for (int i = 0; i < 4; ++i) {
                const int at = ds_p_lane(warp, t, n, i, g, c);
                P[kz][at] = D[size_t(g + 8 * (i >> 1)) * nt * 8 + 8 * n + 2 * c + (i & 1)];
                ++written[at];
              }
          }
          // banks of the partial stores: for each (n, i) the warp's 32 lanes on 32 banks
          for (int n = 0; n < nt; ++n)
            for (int i = 0; i < 4; ++i) {
              unsigned seen = 0;
              for (int lane = 0; lane < 32; ++lane) seen |= 1u << (ds_p_lane(warp, t, n, i, lane / 4, lane % 4) % 32);
              expect(seen == 0xFFFFFFFFu, "partial stores conflict-free", n, i);
            }
        }
      }
      for (int j = 0; j < nt * 8; ++j)
        for (int ol = 0; ol < DS_SLICE_ROWS; ++ol)
          if (sl * DS_SLICE_ROWS + ol < N) expect(written[ds_p_at(j, ol)] == 1, "partial written once", j, ol);
    }
    // the reduction: rank kz sums its element range over ranks 0..ks-1
    const int per = ds_elems(nt) / ks;
    expect(per * ks == ds_elems(nt), "element ranges whole", per, ks);
    for (int kz = 0; kz < ks; ++kz)
      for (int i = kz * per; i < (kz + 1) * per; ++i) {
        const int j = i / DS_SLICE_ROWS, ol = i % DS_SLICE_ROWS;
        const int64_t o = int64_t(sl) * DS_SLICE_ROWS + ol;
        if (j >= T || o >= N) continue;
        double v = 0;
        for (int q = 0; q < ks; ++q) v += P[q][ds_p_at(j, ol)];
        Y[size_t(j) * N + o] = v;
        ++stores[size_t(j) * N + o];
      }
  }
  // reference
  for (int o = 0; o < N; ++o)
    for (int j = 0; j < T; ++j) {
      double mag;
      const double ref = q4_row_dot(&W[size_t(o) * words], &S[size_t(o) * gpr], &B[size_t(o) * gpr], &X[size_t(j) * K],
                                    K, gs, mag);
      const double got = Y[size_t(j) * N + o];
      expect(stores[size_t(j) * N + o] == 1, "stored once", j, o);
      expect(std::fabs(got - ref) <= 1e-6 * (mag + 1e-30), "y vs reference", got, ref);
    }
  std::printf("ok  product N=%d K=%d gs=%d T=%d ks=%d\n", N, K, gs, T, ks);
}

int main() {
  std::mt19937 rng(29);
  // N, K, group, T: K split 8 / 4 / 2 / 1 ways (8704 rows: 68 slices, 2 parts), one to four n8 tiles (partial
  // ones), dead warps (N = 32, 160)
  const int cases[][4] = {{32, 2048, 64, 2},  {160, 1024, 256, 11}, {256, 2048, 128, 17}, {128, 4096, 64, 32},
                          {96, 384, 64, 8},   {64, 8192, 64, 3},    {512, 512, 128, 24},  {8704, 256, 64, 5}};
  for (const auto& cs : cases) run_case(cs[0], cs[1], cs[2], cs[3], rng);
  // the plan at 132 SMs: the model's dense shapes
  struct Plan {
    int64_t N, K;
    int ks;
  };
  const Plan plans[] = {{8192, 2048, 4}, {12352, 2048, 2}, {4096, 2048, 8}, {2048, 4096, 8},
                        {512, 2048, 8},  {32, 2048, 8},    {2048, 512, 4}};
  for (const auto& p : plans)
    for (int T = 2; T <= DS_MAX_TOKENS; ++T) {
      const int ks = ds_splits(p.N, p.K, 64, T, RESIDENT);
      expect(ks == p.ks, "plan of a model shape", double(p.N), ks);
      expect(ds_smem_bytes(p.K / ks, ds_tiles(T)) <= DS_MAX_SMEM, "plan's shared memory", double(p.N), T);
    }
  expect(ds_splits(2048, 16384, 64, 32, RESIDENT) == 0, "no split fits K = 16384 at T = 32", 0, 0);
  expect(ds_splits(2048, 384, 64, 32, RESIDENT) == 1, "three segments: one part", 0, 0);
  std::printf("ok  plan\n");
  if (failures) {
    std::printf("%d failures\n", failures);
    return 1;
  }
  std::printf("all passed\n");
  return 0;
}
