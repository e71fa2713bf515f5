// CPU emulator of the dense BF16 wgmma GEMM's data layout (kernels/linear_wgmma_dense.cuh): with the
// kernel header's own host-callable pieces (wgd_tile, wgd_stage_bytes, wgd_x_bytes, wgd_a_offset,
// wgd_acc_o, wgd_acc_r, wg_desc), it runs the GEMM's work units and k-tiles over an emulated shared
// memory ring:
//   TMA:    the producer's two box loads a k-tile (Xb box {64, BM} at (kt*64, row0), W box {64, 256} at
//           (kt*64, n0)) written as cp.async.bulk.tensor with SWIZZLE_128B writes them (the unswizzled
//           address row*128 + 2k, then address bits 4-6 XOR bits 7-9), elements past the tensor's M,
//           N or K zero;
//   wgmma:  the consumers' m64nBMk16 instructions read through their descriptors as the PTX ISA
//           defines the K-major 128B-swizzle canonical layout (start address field << 4, 8-row groups
//           SBO apart, row i of a group at +128 i, element k at +2k, then the same XOR), into the
//           m64nN f32 accumulator fragment (thread t of the warpgroup: row 16*(t/32) + (t%32)/4 +
//           8*((i/2)%2), column 8*(i/4) + 2*(t%4) + i%2; stated here independently of wgd_acc_*);
//   store:  the epilogue's (o, r) = (wgd_acc_o, wgd_acc_r) of every accumulator, inside M and N.
// Checks every output stored exactly once and equal to an fp64 product of the same bf16 values (fp32
// accumulation: relative 1e-5), for BM 64 and 128, K with a partial k-tile, ragged M and N.
// Built with nvcc as host code; exits non-zero and prints FAIL on any mismatch.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/kernels/linear_wgmma_dense.cuh"

#include "emu_common.h"

using namespace lily::cuda;

// SWIZZLE_128B on a shared byte address (the ring is 1024-aligned: address = offset in it).
static uint32_t swizzle128(uint32_t addr) { return addr ^ (((addr >> 7) & 7) << 4); }

// TMA tile load of box {64 k, box_rows} of the bf16 tensor t [rows, cols] at (k0, r0) into smem at dst.
static void tma_box(std::vector<uint8_t>& smem, uint32_t dst, const std::vector<uint16_t>& t, int64_t rows,
                    int64_t cols, int64_t k0, int64_t r0, int box_rows) {
  for (int i = 0; i < box_rows; ++i)
    for (int k = 0; k < 64; ++k) {
      const int64_t r = r0 + i, c = k0 + k;
      const uint16_t v = r < rows && c < cols ? t[size_t(r * cols + c)] : 0;
      std::memcpy(&smem[swizzle128(dst + uint32_t(i * 128 + 2 * k))], &v, 2);
    }
}

// Element (row, k) of a K-major SWIZZLE_128B operand of a k16 wgmma read through descriptor d.
static float desc_elem(const std::vector<uint8_t>& smem, uint64_t d, int row, int k) {
  const uint32_t start = uint32_t(d & 0x3FFF) << 4, sbo = uint32_t((d >> 32) & 0x3FFF) << 4;
  expect((d >> 62) == 1 && sbo == 1024, "descriptor layout / SBO", long(d >> 62), long(sbo));
  uint16_t v;
  std::memcpy(&v, &smem[swizzle128(start + (row / 8) * sbo + (row % 8) * 128 + 2 * k)], 2);
  return bf16_to_f(v);
}

template <int BM>
static bool run(int64_t M, int64_t N, int64_t K, std::mt19937& rng) {
  std::uniform_int_distribution<int> u(-64, 64);
  std::vector<uint16_t> w(size_t(N * K)), xb(size_t(M * K));
  auto bf = [](float f) { uint32_t b; std::memcpy(&b, &f, 4); return uint16_t(b >> 16); };
  for (auto& v : w) v = bf(u(rng) / 64.f);   // exact in bf16
  for (auto& v : xb) v = bf(u(rng) / 16.f);
  const int S = wgd_stages(BM), nk = int((K + WG_BK - 1) / WG_BK);
  const uint32_t STAGE = wgd_stage_bytes(BM);
  expect(STAGE % 1024 == 0 && wgd_x_bytes(BM) % 1024 == 0, "1024-aligned stage parts", STAGE, wgd_x_bytes(BM));
  std::vector<uint8_t> smem(size_t(S) * STAGE);
  std::vector<float> y(size_t(M * N), NAN);
  std::vector<int> stores(size_t(M * N), 0);
  const int64_t row_tiles = (M + BM - 1) / BM, units = row_tiles * ((N + WG_BN - 1) / WG_BN);
  int s = 0;
  for (int64_t un = 0; un < units; ++un) {
    const WgdTile tile = wgd_tile(un, row_tiles, BM);
    std::vector<float> acc(size_t(256) * 2 * (BM / 2), 0.f);  // [ct][b][i]
    for (int kt = 0; kt < nk; ++kt) {
      const uint32_t st = uint32_t(s) * STAGE;
      tma_box(smem, st + wgd_x_bytes(BM), w, N, K, kt * WG_BK, tile.n0, WG_BN);
      tma_box(smem, st, xb, M, K, kt * WG_BK, tile.row0, BM);
      for (int cw = 0; cw < 2; ++cw)
        for (int b = 0; b < 2; ++b) {
          const uint64_t xd = wg_desc(st), ad = wg_desc(st + wgd_a_offset(BM, cw, b));
          for (int k16 = 0; k16 < WG_BK / 16; ++k16)  // the kernel's descriptors: + 2 per k16 step
            for (int t = 0; t < 128; ++t)
              for (int i = 0; i < BM / 2; ++i) {
                const int m = 16 * (t / 32) + (t % 32) / 4 + 8 * ((i / 2) % 2), n = 8 * (i / 4) + 2 * (t % 4) + i % 2;
                float sum = 0.f;
                for (int k = 0; k < 16; ++k)
                  sum += desc_elem(smem, ad + 2 * k16, m, k) * desc_elem(smem, xd + 2 * k16, n, k);
                acc[size_t(((cw * 128 + t) * 2 + b) * (BM / 2) + i)] += sum;
              }
        }
      if (++s == S) s = 0;
    }
    for (int ct = 0; ct < 256; ++ct)
      for (int b = 0; b < 2; ++b)
        for (int i = 0; i < BM / 2; ++i) {
          const int64_t o = tile.n0 + wgd_acc_o(ct, b, i), r = tile.row0 + wgd_acc_r(ct, i);
          if (o >= N || r >= M) continue;
          y[size_t(r * N + o)] = acc[size_t((ct * 2 + b) * (BM / 2) + i)];
          ++stores[size_t(r * N + o)];
        }
  }
  int bad = 0;
  for (int64_t r = 0; r < M; ++r)
    for (int64_t o = 0; o < N; ++o) {
      double ref = 0;
      for (int64_t k = 0; k < K; ++k)
        ref += double(bf16_to_f(w[size_t(o * K + k)])) * bf16_to_f(xb[size_t(r * K + k)]);
      const float v = y[size_t(r * N + o)];
      const bool ok = stores[size_t(r * N + o)] == 1 && std::fabs(v - ref) <= 1e-5 * (std::fabs(ref) + 1.0);
      if (!ok) ++bad;
      expect(ok, "output (row, out)", long(r), long(o));
    }
  std::printf("%s BM %d: M %lld, N %lld, K %lld (%d bad)\n", bad ? "BAD " : "ok  ", BM, (long long)M,
              (long long)N, (long long)K, bad);
  return bad == 0;
}

int main() {
  std::mt19937 rng(11);
  bool ok = run<64>(70, 520, 208, rng);    // K = 3 x 64 + 16 (fc2's 4304 = 67 x 64 + 16), ragged M and N
  ok &= run<128>(300, 260, 136, rng);      // K = 2 x 64 + 8, three row tiles, a nearly empty column tile
  ok &= run<128>(128, 256, 64, rng);       // exact tiles
  ok &= run<64>(9, 40, 144, rng);          // one short row tile, a narrow product
  std::printf(ok && failures == 0 ? "all passed\n" : "FAILED\n");
  return ok && failures == 0 ? 0 : 1;
}
