// gemm_wgmma_emu: CPU emulation of the retired wgmma kernel's index logic (benchmarks/gemm_lab_wgmma.cuh) for
//   one k-tile of a 256-output x BM-row CTA.
//   Also checks the library's kernels/linear_wgmma_tma.cuh: the Xb tile (wgx_bf16_kernel + copy to wg_swz) and the half-tile A fragments
//   (the gated row mapping: tests/emu/wgmma_gated_emu.cu).
//   Build and run (no GPU needed): nvcc -O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I csrc -o "${TMPDIR:-/tmp}/gemm_emu" benchmarks/gemm_wgmma_emu.cu && "${TMPDIR:-/tmp}/gemm_emu"
// Uses the kernel's own wg_phys_k / wg_swz and repeats its thread mappings (convert_x, dequant_w, the
// epilogue), then emulates wgmma as the PTX ISA describes it: the A register fragment of m64nNk16 (per warp
// w: rows 16w + g and 16w + g + 8, registers {k 2c..2c+1, same k row+8, k 2c+8.., row+8}), B read through
// a K-major SWIZZLE_128B descriptor (start + s*32 B per k16 step, 8-row groups SBO = 1024 B apart, address
// bits [4,7) xor bits [7,10)). Checks every (output, row) against the direct sum over physical k.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/kernels/linear_wgmma_tma.cuh"

using namespace lily::cuda;

static float bf16_round(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  u &= 0xFFFF0000u;
  std::memcpy(&f, &u, 4);
  return f;
}

static int run(int BM) {
  std::mt19937 rng(BM);
  std::uniform_real_distribution<float> U(-1.f, 1.f);
  const int BN = WG_BN, BK = WG_BK;
  // raw stage: X fp32 [BM][64], W words [256][8], one scale/bias per row (group 64)
  std::vector<float> X(BM * BK), S(BN), B(BN);
  std::vector<uint32_t> W(BN * 8);
  for (auto& v : X) v = U(rng);
  for (auto& w : W) w = rng();
  for (int n = 0; n < BN; ++n) S[n] = bf16_round(0.01f + 0.01f * U(rng)), B[n] = bf16_round(-0.08f + 0.01f * U(rng));
  auto q_at = [&](int n, int k) { return int((W[n * 8 + k / 8] >> (4 * (k % 8))) & 15u); };

  // convert_x: thread idx -> (r, j); 8 floats of block j -> pairs (x_c, x_{c+4}) at logical 8j + 2c + e
  std::vector<float> xs(BM * 64, NAN);  // smem bytes / 2, as bf16 values
  for (int idx = 0; idx < BM * 8; ++idx) {
    const int r = idx >> 3, j = idx & 7;
    const float* lo = &X[r * BK + 8 * j];
    const float* hi = lo + 4;
    const float vals[8] = {lo[0], hi[0], lo[1], hi[1], lo[2], hi[2], lo[3], hi[3]};
    for (int t = 0; t < 8; ++t) xs[(wg_swz(r, j) + 2 * t) / 2] = bf16_round(vals[t]);
  }
  // dequant_w: A[thread][block][step][reg] as (lo, hi) value pairs
  std::vector<float> A(256 * 2 * 4 * 4 * 2, NAN);
  auto Aat = [&](int tid, int b, int s, int reg, int e) -> float& { return A[((((tid * 2 + b) * 4 + s) * 4 + reg) * 2) + e]; };
  for (int tid = 0; tid < 256; ++tid) {
    const int lane = tid & 31, warp = tid >> 5, wg = warp >> 2, w4 = warp & 3, g = lane >> 2, c = lane & 3;
    for (int b = 0; b < 2; ++b)
      for (int h = 0; h < 2; ++h) {
        const int n = wg * 128 + b * 64 + w4 * 16 + g + 8 * h;
        for (int m = 0; m < 8; ++m) {
          const uint32_t bits = (W[n * 8 + m] >> (4 * c)) & 0x000F000Fu;
          const int q0 = bits & 15, q1 = (bits >> 16) & 15;
          Aat(tid, b, m >> 1, (m & 1) * 2 + h, 0) = bf16_round(S[n] * q0 + B[n]);
          Aat(tid, b, m >> 1, (m & 1) * 2 + h, 1) = bf16_round(S[n] * q1 + B[n]);
        }
      }
  }
  // linear_wgmma_tma.cuh: (1) Xb = wgx_bf16_kernel's permuted bf16 row, chunk j copied (cp.async or
  // TMA SWIZZLE_128B) to wg_swz(r, j) must give the same B tile as convert_x; (2) the TMA consumers'
  // half-tile dequantization (wg_dequant_half: chunk H of the row's 32 bytes, words m = 0..3 -> step
  // 2H + m/2, register (m%2)*2 + h; thread (cw, w4, g) at wg_row_base) must give the A fragments the retired
  // kernel's thread of the same output row holds.
  int xb_bad = 0, half_bad = 0;
  for (int r = 0; r < BM; ++r)
    for (int j = 0; j < 8; ++j) {
      float xb[8];  // wgx_bf16_kernel: v.x = (lo.x, hi.x), v.y = (lo.y, hi.y), ...
      for (int t = 0; t < 4; ++t) xb[2 * t] = bf16_round(X[r * BK + 8 * j + t]), xb[2 * t + 1] = bf16_round(X[r * BK + 8 * j + 4 + t]);
      for (int t = 0; t < 8; ++t) xb_bad += !(xs[(wg_swz(r, j) + 2 * t) / 2] == xb[t]);
    }
  for (int ct = 0; ct < TMA_CONSUMERS; ++ct) {
    const int lane = ct & 31, cw = ct >> 7, w4 = (ct >> 5) & 3, g = lane >> 2, c = lane & 3;
    const int rbase = wg_row_base(false, cw, w4, g);
    for (int H = 0; H < 2; ++H)
      for (int b = 0; b < wg_blocks(BM); ++b)
        for (int h = 0; h < 2; ++h) {
          const int n = rbase + b * 64 + 8 * h;
          // the retired kernel's thread and block holding output n (2 warpgroups of two m64 blocks)
          const int tid_r = (n >> 7) * 128 + ((n >> 4) & 3) * 32 + (n & 7) * 4 + c, b_r = (n >> 6) & 1;
          for (int m = 0; m < 4; ++m) {
            const uint32_t bits = (W[n * 8 + 4 * H + m] >> (4 * c)) & 0x000F000Fu;
            const float v0 = bf16_round(S[n] * (bits & 15) + B[n]), v1 = bf16_round(S[n] * ((bits >> 16) & 15) + B[n]);
            const int step = 2 * H + (m >> 1), reg = (m & 1) * 2 + h;
            half_bad += !(Aat(tid_r, b_r, step, reg, 0) == v0) + !(Aat(tid_r, b_r, step, reg, 1) == v1);
          }
        }
  }
  // wgmma emulation per warpgroup and m64 block, then the epilogue mapping
  double max_err = 0;
  int unwritten = 0;
  for (int wg = 0; wg < 2; ++wg)
    for (int b = 0; b < 2; ++b) {
      std::vector<double> D(64 * BM, 0.0);
      for (int s = 0; s < 4; ++s) {
        std::vector<float> Am(64 * 16, NAN);
        for (int t = 0; t < 128; ++t) {
          const int tid = wg * 128 + t, w4 = t >> 5, lane = t & 31, g = lane >> 2, c = lane & 3;
          for (int reg = 0; reg < 4; ++reg)
            for (int e = 0; e < 2; ++e) {
              const int row = 16 * w4 + g + 8 * (reg & 1), col = 2 * c + e + 8 * (reg >> 1);
              Am[row * 16 + col] = Aat(tid, b, s, reg, e);
            }
        }
        for (int n = 0; n < BM; ++n)
          for (int kk = 0; kk < 16; ++kk) {
            const uint32_t addr = s * 32 + (n / 8) * 1024 + (n % 8) * 128 + kk * 2;
            const uint32_t phys = addr ^ (((addr >> 7) & 7) << 4);
            const float bv = xs[phys / 2];
            for (int m = 0; m < 64; ++m) D[m * BM + n] += double(Am[m * 16 + kk]) * bv;
          }
      }
      for (int t = 0; t < 128; ++t) {
        const int w4 = t >> 5, lane = t & 31, g = lane >> 2, c = lane & 3;
        for (int j = 0; j < BM / 8; ++j)
          for (int q = 0; q < 4; ++q) {
            const int mrow = 16 * w4 + g + 8 * (q >> 1), r = 8 * j + 2 * c + (q & 1);
            const int o = wg * 128 + b * 64 + mrow;  // the kernel's epilogue formula
            double ref = 0;
            for (int k = 0; k < BK; ++k) ref += double(bf16_round(S[o] * q_at(o, k) + B[o])) * bf16_round(X[r * BK + k]);
            const double v = D[mrow * BM + r];
            if (std::isnan(v)) ++unwritten;
            max_err = std::max(max_err, std::fabs(v - ref) / (1e-3 + std::fabs(ref)));
          }
      }
    }
  // the permutation is a bijection of 0..63
  int seen[64] = {};
  for (int lk = 0; lk < 64; ++lk) ++seen[wg_phys_k(lk)];
  int bij = 1;
  for (int k = 0; k < 64; ++k) bij &= seen[k] == 1;
  const bool ok = max_err < 1e-9 && unwritten == 0 && bij && xb_bad == 0 && half_bad == 0;
  std::printf("BM %3d: max rel err %.2e, NaN %d, permutation %s, Xb tile mismatches %d, half-tile A mismatches %d "
              "-> %s\n",
              BM, max_err, unwritten, bij ? "ok" : "BAD", xb_bad, half_bad, ok ? "ok" : "FAIL");
  return ok ? 0 : 1;
}

int main() { return run(64) | run(128); }
