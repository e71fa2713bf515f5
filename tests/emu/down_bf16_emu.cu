// CPU emulator of a prompt's MoE down rows as bf16 (docs/cuda.md, the moe row; LinearArgs::y16's pair order):
// the wgmma GEMM's y16 epilogue stores and the combines' 16-byte reads must agree on where every output column
// sits. Runs, with the kernel headers' own host-callable pieces (wg_row_base, wg_out_step, wg_blocks, wg_rows,
// wg_pack_bf16x2, y16_pos, moe_chunk_lo4):
//   order:    y16_pos permutes each block of 16 columns;
//   store:    wg_store_tile's y16 branch for every consumer thread of every (row tile, column tile) of a plain
//             product (BM 64, 128, 160, 256; ragged row ends and a part last column tile): the word of outputs o
//             and o + 8 of a row at the row's y16 + at + (rbase & 7), which must be y16_pos(o) (and o + 8 at
//             the next position); every element written exactly once, with the bits of wg_bf16;
//   combine:  moe_combine8_at's chunk c (8 positions): word w's low half is column 4 moe_chunk_lo4(c) + w, its
//             high half the column 8 past it; reading every chunk back gives every column's value once.
// Built with nvcc as host code; exits non-zero and prints FAIL on any mismatch.
#include <random>
#include <vector>

#include "cuda/kernels/linear_wgmma_tma.cuh"
#include "cuda/kernels/moe_routing.cuh"
#include "emu_common.h"

using namespace lily::cuda;

static bool check_order() {
  const int before = failures;
  std::vector<int> seen(64, 0);
  for (int64_t L = 0; L < 64; ++L) {
    const int64_t p = y16_pos(L);
    expect(p / 16 == L / 16, "y16_pos leaves the block of 16", long(L), long(p));
    if (p >= 0 && p < 64) ++seen[size_t(p)];
  }
  for (int p = 0; p < 64; ++p) expect(seen[size_t(p)] == 1, "y16_pos is not a permutation", p, seen[size_t(p)]);
  std::printf("%s order\n", failures == before ? "ok  " : "FAIL");
  return failures == before;
}

// The y16 epilogue over Y [M, N] (ldy = N): consumer warpgroup cw, warp w4, lane (g, c) of the tile (row0, rows)
// x (n0: wg_rows(BM) outputs) packs its rows 8j + 2c + e's outputs o = o0 + 64b (h = 0) and o + 8 (h = 1) into
// one word at element y16 + (row0 + 2c + 8j + e) * ldy + o0 + (rbase & 7) + 64b, for 8j + e < rows - 2c and
// o < N (lim[b][0]).
template <int BM>
static std::vector<uint16_t> store(const std::vector<float>& y, int64_t M, int64_t N) {
  constexpr int NB = wg_blocks(BM);
  const int before = failures;
  std::vector<uint16_t> y16(size_t(M * N), 0xdead);
  std::vector<int> writes(size_t(M * N), 0);
  std::vector<int> outputs(size_t(wg_rows(BM)), 0);  // the first tile's outputs, counted at c = 0
  for (int64_t row0 = 0; row0 < M; row0 += BM) {
    const int64_t trows = std::min<int64_t>(BM, M - row0);
    for (int64_t n0 = 0; n0 < N; n0 += wg_rows(BM))
      for (int cw = 0; cw < 2; ++cw)
        for (int w4 = 0; w4 < 4; ++w4)
          for (int lane = 0; lane < 32; ++lane) {
            const int g = lane >> 2, c = lane & 3, rbase = wg_row_base(false, cw, w4, g, NB);
            const int64_t o0 = n0 + rbase, rows = trows - 2 * c;
            expect(o0 + (rbase & 7) == y16_pos(o0), "store: the word's offset is not y16_pos(o0)", long(o0), rbase);
            for (int b = 0; b < NB; ++b) {
              const int64_t o = o0 + wg_out_step(false, b, 0);
              expect(wg_out_step(false, b, 1) == wg_out_step(false, b, 0) + 8, "store: h = 1 is not o + 8", b, 0);
              if (row0 == 0 && n0 == 0 && c == 0) ++outputs[size_t(o)], ++outputs[size_t(o + 8)];
              if (o >= N) continue;
              for (int j = 0; j < BM / 8; ++j)
                for (int e = 0; e < 2; ++e) {
                  if (8 * j + e >= rows) continue;
                  const int64_t r = row0 + 2 * c + 8 * j + e, at = r * N + o0 + (rbase & 7) + 64 * b;
                  const uint32_t w = wg_pack_bf16x2(y[size_t(r * N + o)], y[size_t(r * N + o + 8)]);
                  expect(at - r * N == y16_pos(o), "store: the low half is not at y16_pos(o)", long(o), long(at));
                  y16[size_t(at)] = uint16_t(w), y16[size_t(at + 1)] = uint16_t(w >> 16);
                  ++writes[size_t(at)], ++writes[size_t(at + 1)];
                }
            }
          }
  }
  for (int i = 0; i < wg_rows(BM); ++i) expect(outputs[size_t(i)] == 1, "store: a tile output not held once", i, BM);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t L = 0; L < N; ++L) {
      const size_t at = size_t(r * N + y16_pos(L));
      expect(writes[at] == 1, "store: element not written exactly once", long(r), long(L));
      expect(y16[at] == wg_bf16(y[size_t(r * N + L)]), "store: y16 != wg_bf16(y)", long(r), long(L));
    }
  std::printf("%s store BM %d, M %ld, N %ld\n", failures == before ? "ok  " : "FAIL", BM, long(M), long(N));
  return y16;
}

// moe_combine8_at's reads of one row: chunk c's words w = 0..3 at positions 8c + 2w (low half) and 8c + 2w + 1.
static bool combine(const std::vector<float>& y, const std::vector<uint16_t>& y16, int64_t M, int64_t N) {
  const int before = failures;
  for (int64_t r = 0; r < M; ++r) {
    std::vector<int> got(size_t(N), 0);
    for (int c = 0; c < N / 8; ++c)
      for (int w = 0; w < 4; ++w)
        for (int half = 0; half < 2; ++half) {
          const int64_t col = 4 * (moe_chunk_lo4(c) + 2 * half) + w;  // lo: float4 column lo4, hi: lo4 + 2
          expect(y16_pos(col) == 8 * c + 2 * w + half, "combine: column not where the store put it", c, long(col));
          expect(y16[size_t(r * N + 8 * c + 2 * w + half)] == wg_bf16(y[size_t(r * N + col)]), "combine: value",
                 long(r), long(col));
          if (col >= 0 && col < N) ++got[size_t(col)];
        }
    for (int64_t L = 0; L < N; ++L)
      expect(got[size_t(L)] == 1, "combine: column not read exactly once", double(r), double(L));
  }
  std::printf("%s combine M %ld, N %ld\n", failures == before ? "ok  " : "FAIL", long(M), long(N));
  return failures == before;
}

template <int BM>
static bool run(int64_t M, int64_t N, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.f, 3.f);
  std::vector<float> y(size_t(M * N));
  for (float& v : y) v = normal(rng);
  const int before = failures;
  const std::vector<uint16_t> y16 = store<BM>(y, M, N);
  return combine(y, y16, M, N) && failures == before;
}

int main() {
  std::mt19937 rng(11);
  bool ok = check_order();
  ok &= run<128>(300, 2048, rng);  // the model's routed down product (H = 2048)
  ok &= run<64>(77, 320, rng);     // a part last column tile (320 = 256 + 64), ragged rows
  ok &= run<256>(260, 2048, rng);  // the shared down product on 256-row tiles of 128 outputs
  ok &= run<128>(5, 16, rng);      // one block of 16
  ok &= run<160>(310, 2048, rng);  // the down product's merged tiles (BM 160: 128 + a remainder of <= 32)
  std::printf(ok && failures == 0 ? "all passed\n" : "FAILED\n");
  return ok && failures == 0 ? 0 : 1;
}
