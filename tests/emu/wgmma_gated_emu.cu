// CPU walk of the gated prefill GEMM's row mapping (kernels/linear_wgmma_tma.cuh), with the header's own
// host-callable pieces:
//   1. GATED (gate and up rows of the same outputs in one 16-row warp slice, SwiGLU in registers): the
//      producer fills stage rows 0..BN-1 with W box {8, BN, 1} of the gate matrix and BN..2BN-1 with the
//      same rows of the up matrix (BN = wg_rows(BM)/2: 128 with NB = 2 m64 blocks a consumer warpgroup, 64
//      at BM = 256, NB = 1); every consumer thread (cw, w4, g) and accumulator row (b, h) reads stage
//      row wg_row_base + wg_row_step, whose (matrix, output) must be the one its scales and biases come
//      from (h, wg_row_base + wg_out_step); each stage row is read by exactly the 4 threads of one g quad;
//      rows of consecutive g are consecutive stage rows (a quarter warp's 16-byte loads on distinct
//      banks); wgmma rows 0-7 of every 16-row warp slice are gate rows and rows 8-15 up rows.
//   2. The gated epilogue: from synthetic accumulators D[matrix][output][r] placed by the m16n8 layout
//      (acc[b][4j + 2h + e] = row (b, h), column r = 8j + 2c + e), wg_store_gated's reads (G =
//      acc[b][4j + e], U = acc[b][4j + 2 + e], output wg_row_base + wg_out_step(b, 0)) must be the gate and
//      up of that one output at that column, and every (output, column) of the BN x BM tile is stored
//      exactly once (BM 64, 128 and 256).
//   3. Shared memory: GATED has two more stages than the plain product (BM 64, 128; 6 at BM 256), ring and
//      mbarriers only (full, empty), within 227 KB.
// Built with nvcc as host code; prints "ok" per case, exits non-zero and prints FAIL on any mismatch.
#include <cstdint>
#include <cstdio>
#include <vector>

#include "cuda/kernels/linear_wgmma_tma.cuh"

using namespace lily::cuda;

static int failures = 0;
static void expect(bool ok, const char* what, long a, long b) {
  if (!ok && failures++ < 10) std::printf("FAIL %s (%ld, %ld)\n", what, a, b);
}

// 1. stage rows -> (matrix, output), every thread's accumulator rows
static void check_rows(int BM) {
  const int f0 = failures, NB = wg_blocks(BM), rows = wg_rows(BM), BN = rows / 2;
  int stage_matrix[256], stage_out[256], reads[256] = {};
  for (int box = 0; box < 2; ++box)  // load_w: box 0 = tmap_w (gate) rows n0..n0+BN-1 (at WBYTES/2 * box), box 1 = tmap_u (up)
    for (int i = 0; i < BN; ++i) stage_matrix[box * BN + i] = box, stage_out[box * BN + i] = i;
  expect(tma_w_bytes(4, BM) / 2 == BN * tma_w_row_bytes(4), "the up box at WBYTES / 2 = stage row BN", BM, BN);
  for (int cw = 0; cw < TMA_CONSUMER_WGS; ++cw)
    for (int w4 = 0; w4 < 4; ++w4)
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, base = wg_row_base(true, cw, w4, g, NB);
        if (g < 7)
          expect(wg_row_base(true, cw, w4, g + 1, NB) == base + 1, "consecutive g: consecutive stage rows", cw, g);
        for (int b = 0; b < NB; ++b)
          for (int h = 0; h < 2; ++h) {
            const int srow = base + wg_row_step(true, b, h, NB);
            if (srow < 0 || srow >= rows) {
              expect(false, "stage row out of range", srow, lane);
              continue;
            }
            ++reads[srow];
            const int matrix = h, out = base + wg_out_step(true, b, h);
            expect(stage_matrix[srow] == matrix, "stage row's matrix = the scales' matrix", srow, matrix);
            expect(stage_out[srow] == out, "stage row's output = the scales' output", srow, out);
            const int m = 16 * w4 + g + 8 * h;  // wgmma row of block b: slice rows 0-7 gate, 8-15 up
            expect((m % 16) / 8 == matrix, "slice rows 0-7 gate, 8-15 up", m, matrix);
            // output o at block row 16*((o%32)/8) + o%8 (+ 8 for up) at every BM (the same as at NB = 2: bits)
            expect(m == 16 * ((out % 32) / 8) + out % 8 + 8 * h, "an output's block row independent of BM", m, out);
          }
      }
  for (int r = 0; r < rows; ++r) expect(reads[r] == 4, "each stage row read by one g quad (4 threads)", r, reads[r]);
  std::printf("%s GATED BM %3d: stage rows, scale rows and fragment rows of the consumer threads agree (%d + %d rows)\n",
              failures == f0 ? "ok  " : "FAIL", BM, BN, BN);
}

// 2. each thread's G and U of one output, every (output, column) stored once
static void check_epilogue(int BM) {
  const int f0 = failures, NB = wg_blocks(BM), BN = wg_rows(BM) / 2;
  auto D = [&](int matrix, int o, int r) { return float(matrix * 1000000 + o * 1000 + r); };  // distinct values
  std::vector<int> stored(BN * BM, 0);
  for (int cw = 0; cw < TMA_CONSUMER_WGS; ++cw)
    for (int w4 = 0; w4 < 4; ++w4)
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, c = lane % 4, base = wg_row_base(true, cw, w4, g, NB);
        std::vector<std::vector<float>> acc(NB, std::vector<float>(BM / 2));
        for (int b = 0; b < NB; ++b)  // the m16n8 accumulator layout: acc[b][4j + 2h + e] = (row (b, h), r)
          for (int j = 0; j < BM / 8; ++j)
            for (int h = 0; h < 2; ++h)
              for (int e = 0; e < 2; ++e) {
                const int srow = base + wg_row_step(true, b, h, NB);
                acc[b][4 * j + 2 * h + e] = D(srow / BN, srow % BN, 8 * j + 2 * c + e);
              }
        for (int j = 0; j < BM / 8; ++j)  // wg_store_gated's reads
          for (int e = 0; e < 2; ++e)
            for (int b = 0; b < NB; ++b) {
              const int r = 8 * j + 2 * c + e, o = base + wg_out_step(true, b, 0);
              if (o < 0 || o >= BN) {
                expect(false, "output out of the tile", o, lane);
                continue;
              }
              expect(acc[b][4 * j + e] == D(0, o, r), "G of the stored output", o, r);
              expect(acc[b][4 * j + 2 + e] == D(1, o, r), "U of the stored output", o, r);
              ++stored[o * BM + r];
            }
      }
  long wrong = 0;
  for (int i = 0; i < BN * BM; ++i) wrong += stored[i] != 1;
  expect(wrong == 0, "every (output, column) stored once", BM, wrong);
  std::printf("%s GATED BM %3d: G and U of each output in one thread, %d x %d outputs stored once (%ld not)\n",
              failures == f0 ? "ok  " : "FAIL", BM, BN, BM, wrong);
}

// 3. shared memory
static void check_smem() {
  const int f0 = failures;
  for (int bm : {64, 128, 256}) {
    expect(tma_stages(bm, true) == (bm == 256 ? 6 : tma_stages(bm) + 2), "two more stages (6 at BM 256)", bm,
           tma_stages(bm, true));
    expect(tma_smem_bytes(bm, 4, true) <= 227 * 1024, "GATED within 227 KB", bm, tma_smem_bytes(bm, 4, true));
    expect(tma_smem_bytes(bm, 4, true) == 1024 + tma_stages(bm, true) * (tma_stage_bytes(bm, 4) + 16),
           "GATED: ring and mbarriers only", bm, tma_smem_bytes(bm, 4, true));
  }
  std::printf("%s smem: plain %d / %d / %d B, GATED %d / %d / %d B (BM 256 / 128 / 64; %d / %d / %d stages)\n",
              failures == f0 ? "ok  " : "FAIL", tma_smem_bytes(256, 4), tma_smem_bytes(128, 4), tma_smem_bytes(64, 4),
              tma_smem_bytes(256, 4, true), tma_smem_bytes(128, 4, true), tma_smem_bytes(64, 4, true),
              tma_stages(256, true), tma_stages(128, true), tma_stages(64, true));
}

int main() {
  check_rows(128);
  check_rows(256);
  check_epilogue(64);
  check_epilogue(128);
  check_epilogue(256);
  check_smem();
  if (failures) {
    std::printf("FAIL: %d mismatches\n", failures);
    return 1;
  }
  std::printf("all passed\n");
  return 0;
}
