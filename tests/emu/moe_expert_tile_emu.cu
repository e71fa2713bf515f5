// CPU walk of the one-tile-per-expert MoE GEMM's layout (benchmarks/gemm_lab_expert.cuh, gemm_lab's
// "expert" group), with the header's own host-callable pieces (xt_row_base, xt_row_step, xt_out_step,
// xt_a_reg, xt_tile_outputs, the ring sizes):
//   1. rows, plain and GATED: the producer's W box(es) place (matrix, output) in stage rows 0-127 (plain:
//      one box of 128 rows of W; GATED: 64 gate rows, then the same 64 outputs of the up matrix); every
//      consumer thread (cw, w4, g) and accumulator row h reads stage row xt_row_base + xt_row_step(h),
//      whose (matrix, output) must be the one its scales come from (GATED: matrix h; output xt_row_base +
//      xt_out_step(h)); each stage row read by exactly one g quad; consecutive g, consecutive stage rows;
//      warpgroup cw's m64 rows cover its 64 stage rows; GATED: slice rows 0-7 gate, 8-15 up.
//   2. A fragments: register xt_a_reg(m, h) of k16 step 2H + m/2 (word 4H + m of the row, half H) is what
//      wgmma reads from register r of that step: row g + 8(r%2), word 2s + r/2 of the k-tile's 8 words.
//   3. Epilogue (TN 160 and 256): synthetic accumulators D[matrix][output][column] placed by the m64nTN
//      layout (acc[4j + 2h + e] = row h, column 8j + 2c + e); xt_store's reads (plain: acc[4j + 2h + e] at
//      output base + xt_out_step(h); GATED: G = acc[4j + e], U = acc[4j + 2 + e] at output base) must be
//      that output's at that column, and every (output, column) of the tile stored exactly once.
//   4. Shared memory: ring + mbarriers within 227 KB, stages 1024-byte multiples, more stages than the
//      gather lag.
// Built with nvcc as host code; prints "ok" per case, exits non-zero and prints FAIL on any mismatch.
#include <cstdint>
#include <cstdio>
#include <vector>

#include "../../benchmarks/gemm_lab_expert.cuh"

using namespace lily::cuda;

static int failures = 0;
static void expect(bool ok, const char* what, long a, long b) {
  if (!ok && failures++ < 10) std::printf("FAIL %s (%ld, %ld)\n", what, a, b);
}

// 1. stage rows -> (matrix, output), every thread's accumulator rows
static void check_rows(bool gated) {
  const int f0 = failures;
  int stage_matrix[XT_WROWS], stage_out[XT_WROWS], reads[XT_WROWS] = {};
  const int box = xt_tile_outputs(gated);  // W box rows: plain one box of 128, GATED gate box then up box
  for (int i = 0; i < XT_WROWS; ++i) stage_matrix[i] = i / box, stage_out[i] = i % box;
  for (int cw = 0; cw < 2; ++cw)
    for (int w4 = 0; w4 < 4; ++w4)
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, base = xt_row_base(gated, cw, w4, g);
        if (g < 7) expect(xt_row_base(gated, cw, w4, g + 1) == base + 1, "consecutive g: consecutive rows", cw, g);
        for (int h = 0; h < 2; ++h) {
          const int srow = base + xt_row_step(gated, h);
          if (srow < 0 || srow >= XT_WROWS) {
            expect(false, "stage row out of range", srow, lane);
            continue;
          }
          ++reads[srow];
          const int matrix = gated ? h : 0, out = base + xt_out_step(gated, h);
          expect(stage_matrix[srow] == matrix, "stage row's matrix = the scales' matrix", srow, matrix);
          expect(stage_out[srow] == out, "stage row's output = the scales' output", srow, out);
          const int m = 16 * w4 + g + 8 * h;  // row of warpgroup cw's m64 block
          if (gated) expect((m % 16) / 8 == matrix, "slice rows 0-7 gate, 8-15 up", m, matrix);
          else expect(srow == cw * 64 + m, "plain: the block's rows in output order", srow, m);
        }
      }
  for (int r = 0; r < XT_WROWS; ++r) expect(reads[r] == 4, "each stage row read by one g quad", r, reads[r]);
  std::printf("%s %s: stage rows, scale rows and m64 rows of 256 threads agree\n", failures == f0 ? "ok  " : "FAIL",
              gated ? "GATED" : "plain");
}

// 2. A fragment registers: (row h, word) of every register of every k16 step
static void check_fragments() {
  const int f0 = failures;
  for (int s = 0; s < 4; ++s)
    for (int r = 0; r < 4; ++r) {
      int found = 0;
      for (int H = 0; H < 2; ++H)
        for (int m = 0; m < 4; ++m)
          for (int h = 0; h < 2; ++h) {
            if (2 * H + m / 2 != s || xt_a_reg(m, h) != r) continue;
            ++found;
            expect(h == r % 2, "register's row: g + 8(r%2)", s, r);
            expect(4 * H + m == 2 * s + r / 2, "register's word: 2s + r/2 (k 0-7, 8-15 of the step)", s, r);
          }
      expect(found == 1, "each register of each step written once", s, r);
    }
  std::printf("%s A fragments: 4 steps x 4 registers, each from its wgmma row and k words\n",
              failures == f0 ? "ok  " : "FAIL");
}

// 3. each stored value from its own output and column, every (output, column) stored once
static void check_epilogue(bool gated, int TN) {
  const int f0 = failures;
  const int outs = xt_tile_outputs(gated);
  auto D = [&](int matrix, int o, int r) { return float(matrix * 1000000 + o * 1000 + r); };  // distinct values
  std::vector<int> stored(outs * TN, 0);
  for (int cw = 0; cw < 2; ++cw)
    for (int w4 = 0; w4 < 4; ++w4)
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, c = lane % 4, base = xt_row_base(gated, cw, w4, g);
        std::vector<float> acc(TN / 2);
        for (int j = 0; j < TN / 8; ++j)  // acc[4j + 2h + e] = (row h, column 8j + 2c + e)
          for (int h = 0; h < 2; ++h)
            for (int e = 0; e < 2; ++e) {
              const int srow = base + xt_row_step(gated, h);
              acc[4 * j + 2 * h + e] = D(srow / outs, srow % outs, 8 * j + 2 * c + e);
            }
        for (int j = 0; j < TN / 8; ++j)  // xt_store's reads
          for (int e = 0; e < 2; ++e) {
            const int r = 8 * j + 2 * c + e;
            for (int h = 0; h < (gated ? 1 : 2); ++h) {
              const int o = base + xt_out_step(gated, h);
              if (o < 0 || o >= outs) {
                expect(false, "output out of the tile", o, lane);
                continue;
              }
              if (gated) {
                expect(acc[4 * j + e] == D(0, o, r), "G of the stored output", o, r);
                expect(acc[4 * j + 2 + e] == D(1, o, r), "U of the stored output", o, r);
              } else {
                expect(acc[4 * j + 2 * h + e] == D(0, o, r), "the stored output's value", o, r);
              }
              ++stored[o * TN + r];
            }
          }
      }
  long wrong = 0;
  for (int v : stored) wrong += v != 1;
  expect(wrong == 0, "every (output, column) stored once", TN, wrong);
  std::printf("%s %s TN %d: %d x %d outputs stored once from their own accumulators (%ld not)\n",
              failures == f0 ? "ok  " : "FAIL", gated ? "GATED" : "plain", TN, outs, TN, wrong);
}

// 4. shared memory
static void check_smem() {
  const int f0 = failures;
  for (int tn : {160, 256}) {
    expect(xt_smem_bytes(tn) <= 227 * 1024, "within 227 KB", tn, xt_smem_bytes(tn));
    expect(xt_stage_bytes(tn) % 1024 == 0, "stages 1024-byte aligned (SWIZZLE_128B)", tn, xt_stage_bytes(tn));
    expect(xt_stages(tn) > TMA_GATHER_LAG, "more stages than the gather lag", tn, xt_stages(tn));
  }
  std::printf("%s smem: TN 256 %d B (%d stages), TN 160 %d B (%d stages)\n", failures == f0 ? "ok  " : "FAIL",
              xt_smem_bytes(256), xt_stages(256), xt_smem_bytes(160), xt_stages(160));
}

int main() {
  check_rows(false);
  check_rows(true);
  check_fragments();
  for (bool gated : {false, true})
    for (int tn : {160, 256}) check_epilogue(gated, tn);
  check_smem();
  if (failures) {
    std::printf("FAIL: %d mismatches\n", failures);
    return 1;
  }
  std::printf("all passed\n");
  return 0;
}
