// CPU emulator of the gathered (GATHER, x_rows) producer of linear_wgmma_tma_kernel: the row-TMA
// producer (one box {64, 1} of tmap_x a gathered row of a k-tile, SWIZZLE_128B) must leave every stage's
// Xb tile as the retired cp.async producer left it (16-byte chunk j of row x_rows[row0 + r] at
// wg_swz(r, j), rows past the tile's end zero-filled), for every row the epilogue stores. Checks, with the
// kernel header's own wg_swz, tma_stage_bytes, tma_stages, tma_w_bytes:
//   model:  the modelled TMA SWIZZLE_128B write (byte address A of the unswizzled box -> A with its 16-byte
//           chunk bits 4-6 XOR its bits 7-9: a function of the destination shared address) of the dense
//           path's box {64, BM} at a stage's Xb base puts chunk j of row r at wg_swz(r, j);
//   align:  every stage's Xb base (ring_s + s * STAGE, ring_s 1024-aligned) is 1024-byte aligned, for
//           every instance's BM / BITS / GATED;
//   rows:   for BM 64 and 128 and several x_rows patterns (identity, reversed, duplicates, random,
//           strided) and tile rows 1..BM: the row loads of the producer threads (row r = tid < tile.rows,
//           destination base + 128 r, coordinate (kt*64, x_rows[row0 + r])) write each real row once,
//           the bytes of rows < tile.rows equal the cp.async producer's (emulated thread by thread: row
//           (tid >> 3) + 16 i, chunk tid & 7, at wg_swz(tid >> 3, j) + 2048 i), the bytes of rows >=
//           tile.rows are left as they were (stale: NaN here), nothing else in the ring is written, each
//           warp's expect_tx (128 x its real rows, + W for warp 0) equals what its own loads deliver,
//           the sum is W + 128 x tile.rows, and there are BM/32 arrivals (full[s]'s count);
//   cols:   an emulated B-operand product over the stage (out[o][r] = sum_k W[o][k] * Xs[r][k], reading Xs
//           through wg_swz as the wgmma descriptor does) gives bit-identical columns r < tile.rows for the
//           two producers, with the stale rows NaN: a token row of Xb is its own N column.
// Built with nvcc as host code; exits non-zero and prints FAIL on any mismatch.
#include <cmath>
#include <cstdio>
#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/kernels/linear_wgmma_tma.cuh"

using namespace lily::cuda;

static int failures = 0;
static void expect(bool ok, const char* what, long a, long b) {
  if (!ok && failures++ < 10) std::printf("FAIL %s (%ld, %ld)\n", what, a, b);
}

// TMA SWIZZLE_128B, as modelled: the box's bytes are laid out unswizzled from the destination address
// (inner dimension 128 B a row), then each 16-byte chunk's index (address bits 4-6) is XORed with
// address bits 7-9. The pattern repeats every 1024 B of shared address.
static uint32_t tma_swz128(uint32_t addr) { return addr ^ (((addr >> 7) & 7u) << 4); }

// One TMA box {64 bf16, box_rows} of the [rows][K] bf16 map at coordinate (k0, row0) into smem at dst
// (an offset into `smem`, 128-aligned); rows outside the map read zero. Returns the bytes delivered.
static uint32_t tma_load(std::vector<uint8_t>& smem, uint32_t dst, const std::vector<uint16_t>& xb, int64_t rows,
                         int64_t K, int k0, int64_t row0, int box_rows) {
  for (int i = 0; i < box_rows; ++i)
    for (int j = 0; j < 8; ++j) {
      const int64_t gr = row0 + i;
      uint8_t chunk[16] = {};
      if (gr >= 0 && gr < rows) std::memcpy(chunk, &xb[gr * K + k0 + 8 * j], 16);
      std::memcpy(&smem[tma_swz128(dst + 128 * i + 16 * j)], chunk, 16);
    }
  return uint32_t(box_rows) * 128;
}

static void check_model() {
  const int64_t K = 128, rows = 300;
  std::vector<uint16_t> xb(rows * K);
  for (size_t i = 0; i < xb.size(); ++i) xb[i] = uint16_t(i * 2654435761u >> 7);
  for (int bm : {64, 128, 256}) {
    std::vector<uint8_t> smem(4096 + bm * 128);
    const uint32_t base = 2048;  // a 1024-aligned stage
    tma_load(smem, base, xb, rows, K, 64, 37, bm);
    for (int r = 0; r < bm; ++r)
      for (int j = 0; j < 8; ++j) {
        const int64_t gr = 37 + r;
        uint16_t want[8] = {};
        if (gr < rows) std::memcpy(want, &xb[gr * K + 64 + 8 * j], 16);
        expect(std::memcmp(&smem[base + wg_swz(r, j)], want, 16) == 0, "model: dense box chunk at wg_swz", r, j);
      }
  }
  std::printf("ok   model: TMA SWIZZLE_128B box {64, BM} = wg_swz (BM 64, 128, 256)\n");
}

static void check_align() {
  for (int bm : {64, 128, 256})
    for (int bits : {4, 8})
      for (bool gated : {false, true}) {
        if (bm == 256 && gated) continue;
        const uint32_t stage = tma_stage_bytes(bm, bits);
        for (uint32_t raw : {0u, 16u, 400u, 1008u, 5000u}) {
          const uint32_t ring_s = (raw + 1023) & ~1023u;
          for (int s = 0; s < tma_stages(bm, gated); ++s) expect((ring_s + s * stage) % 1024 == 0, "align", bm, s);
        }
      }
  std::printf("ok   align: every stage's Xb base 1024-byte aligned\n");
}

// The retired cp.async producer of one stage: 128 threads, BM/16 chunks each (row (tid >> 3) + 16 i, chunk
// tid & 7), copied to wg_swz(tid >> 3, j) + 2048 i, zero-filled past the tile's end.
static void cp_async_stage(std::vector<uint8_t>& smem, uint32_t st, const std::vector<uint16_t>& xb, int64_t K,
                           const std::vector<int32_t>& x_rows, int64_t row0, int rows, int kt, int bm) {
  const int PER = bm * 8 / 128;
  for (int tid = 0; tid < 128; ++tid) {
    const int j = tid & 7;
    const uint32_t dst = wg_swz(tid >> 3, j);
    for (int i = 0; i < PER; ++i) {
      const int r = (tid >> 3) + 16 * i;
      uint8_t chunk[16] = {};
      if (r < rows) std::memcpy(chunk, &xb[int64_t(x_rows[row0 + r]) * K + kt * WG_BK + 8 * j], 16);
      std::memcpy(&smem[st + dst + 16 * 128 * i], chunk, 16);
    }
  }
}

// The row-TMA producer of one stage: threads tid < BM (BM/32 warps), row r = tid if r < rows, box {64, 1} at
// st + 128 r. Lane 0 of warp w arms full[s] with expect_tx = 128 x (its warp's rows < rows) (+ the W bytes for
// warp 0), as the kernel computes it; checks each warp's own loads deliver exactly what it armed (so no
// complete_tx precedes the expect_tx that covers it) and counts the arrivals. Returns the bytes armed.
static uint32_t tma_stage(std::vector<uint8_t>& smem, uint32_t st, const std::vector<uint16_t>& xb, int64_t xrows,
                          int64_t K, const std::vector<int32_t>& x_rows, int64_t row0, int rows, int kt, int bm,
                          uint32_t wbytes, std::vector<int>& loads, int& arrivals) {
  uint32_t armed = 0;
  arrivals = 0;
  for (int warp = 0; warp < bm / 32; ++warp) {
    const int wrows = std::max(0, std::min(32, rows - 32 * warp));
    const uint32_t tx = uint32_t(wrows) * (WG_BK * 2) + (warp == 0 ? wbytes : 0u);
    ++arrivals;
    armed += tx;
    uint32_t got = warp == 0 ? wbytes : 0u;  // the W TMA(s) of warp 0's lane 0
    for (int lane = 0; lane < 32; ++lane) {
      const int r = 32 * warp + lane;
      if (r >= rows) continue;
      ++loads[r];
      got += tma_load(smem, st + r * (WG_BK * 2), xb, xrows, K, kt * WG_BK, x_rows[row0 + r], 1);
    }
    expect(got == tx, "a warp's loads deliver what it armed", warp, got);
  }
  return armed;
}

static void check_rows() {
  std::mt19937 rng(7);
  const int64_t K = 256, xrows = 1000;
  std::vector<uint16_t> xb(xrows * K);
  for (auto& v : xb) v = uint16_t(0x3c00 | (rng() & 0x83ff));  // finite bf16, |x| in [2^-7, 2^1): no overflow
  const uint16_t NaN = 0x7fc1;
  int cases = 0;
  for (int bm : {64, 128}) {
    const int S = tma_stages(bm), WB = tma_w_bytes(4, bm);
    const uint32_t stage = tma_stage_bytes(bm, 4), xbytes = bm * WG_BK * 2;
    for (int pattern = 0; pattern < 5; ++pattern) {
      std::vector<int32_t> x_rows(512);
      for (int i = 0; i < 512; ++i) {
        switch (pattern) {
          case 0: x_rows[i] = i; break;                                   // identity
          case 1: x_rows[i] = int32_t(xrows - 1 - i); break;              // reversed
          case 2: x_rows[i] = (i / 3) * 7 % int32_t(xrows); break;       // duplicates
          case 3: x_rows[i] = int32_t(rng() % xrows); break;              // random
          default: x_rows[i] = int32_t((i * 37 + 11) % xrows); break;     // strided
        }
      }
      for (int rows : {1, 2, 31, 32, 33, 37, bm / 2, bm - 1, bm}) {
        if (rows > bm) continue;
        const int64_t row0 = (pattern * 53 + rows) % 200;  // a tile's first row in the gathered order
        for (int kt = 0; kt < int(K / WG_BK); ++kt) {
          const uint32_t ring_s = 1024, st = ring_s + uint32_t(kt % S) * stage;
          std::vector<uint8_t> a(ring_s + S * stage), b(ring_s + S * stage);
          for (size_t i = 0; i + 1 < b.size(); i += 2) std::memcpy(&b[i], &NaN, 2);  // stale: NaN everywhere
          a = b;
          cp_async_stage(a, st, xb, K, x_rows, row0, rows, kt, bm);
          std::vector<int> loads(bm, 0);
          int arrivals = 0;
          const uint32_t armed = tma_stage(b, st, xb, xrows, K, x_rows, row0, rows, kt, bm, uint32_t(WB), loads, arrivals);
          expect(armed == uint32_t(WB) + uint32_t(rows) * (WG_BK * 2), "expect_tx sum = W bytes + 128 x rows", rows,
                 armed);
          expect(arrivals == bm / 32, "full[s] arrivals = BM / 32 (its init count)", bm, arrivals);
          expect((stage - xbytes) == uint32_t(WB), "W bytes = STAGE - XBYTES", bm, WB);
          for (int r = 0; r < bm; ++r) {
            expect(loads[r] == (r < rows ? 1 : 0), "row loaded once iff r < rows", r, loads[r]);
            if (r < rows) {
              expect(std::memcmp(&a[st + 128 * r], &b[st + 128 * r], 128) == 0, "row bytes = cp.async's", r, kt);
            } else {
              for (int e = 0; e < 64; ++e) {
                uint16_t v;
                std::memcpy(&v, &b[st + 128 * r + 2 * e], 2);
                expect(v == NaN, "rows past the tile untouched", r, e);
              }
            }
          }
          // nothing outside the stage's real rows written (the W part and other stages)
          for (uint32_t i = 0; i < b.size(); ++i)
            if (i < st || i >= st + 128 * uint32_t(rows))
              expect(b[i] == ((i & 1) ? uint8_t(NaN >> 8) : uint8_t(NaN & 0xff)), "bytes outside the rows", i, 0);
          // cols: out[o][r] = sum_k W[o][k] * Xs[r][k] through wg_swz, 8 weight rows
          for (int o = 0; o < 8; ++o)
            for (int r = 0; r < rows; ++r) {
              float sa = 0.f, sb = 0.f;
              for (int j = 0; j < 8; ++j)
                for (int e = 0; e < 8; ++e) {
                  uint16_t ha, hb;
                  std::memcpy(&ha, &a[st + wg_swz(r, j) + 2 * e], 2);
                  std::memcpy(&hb, &b[st + wg_swz(r, j) + 2 * e], 2);
                  const uint32_t ua = uint32_t(ha) << 16, ub = uint32_t(hb) << 16;
                  float fa, fb;
                  std::memcpy(&fa, &ua, 4);
                  std::memcpy(&fb, &ub, 4);
                  const float w = float((o * 13 + j * 8 + e) % 17) - 8.f;
                  sa += w * fa, sb += w * fb;
                }
              uint32_t ba, bb;
              std::memcpy(&ba, &sa, 4);
              std::memcpy(&bb, &sb, 4);
              expect(ba == bb && !std::isnan(sb), "stored column bit-identical, no stale NaN", r, o);
            }
          ++cases;
        }
      }
    }
  }
  std::printf("ok   rows: %d stages (BM 64, 128; 5 x_rows patterns; tile rows 1..BM): row loads = cp.async bytes\n",
              cases);
}

int main() {
  check_model();
  check_align();
  check_rows();
  if (failures) {
    std::printf("%d failures\n", failures);
    return 1;
  }
  std::printf("all passed\n");
  return 0;
}
