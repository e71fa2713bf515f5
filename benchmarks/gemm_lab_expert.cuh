// gemm_lab's "expert" group (lab only, not in the engine): the prefill MoE products with one tile per
// expert, the token rows of an expert as one wgmma N of TN (256, or 160 sized to a 4K prompt's
// ~128 +- 11 rows an expert), so each dequantized weight element feeds up to TN rows instead of the
// library kernel's 128 (kernels/linear_wgmma_tma.cuh, whose tile is 256 weight rows x 128 rows).
//   plain (MoE down):   Y[r, o] = sum_k bf16(W_e[o, k]) * Xb[r, k]                      (F32 y)
//   GATED (MoE gate+up): y[r, o] = row_scale[r] * silu(G[r, o]) * U[r, o], G/U as Y over the gate matrix
//                        a.w and the up matrix a.up, rows gathered as Xb[x_rows[r]]      (F32 y or Xb yb)
// Shapes as linear_wgmma_tma_kernel's (4-bit weights, group size a power of two >= 64, K % 64 == 0); rows
// in tiles of a grouped RowTiles map with tile_rows == TN (an expert with more than TN rows has several).
// Tile: 128 weight rows x TN rows, k-tiles of 64. Consumer warpgroup cw owns ONE m64 block (weight rows
// [cw*64, +64) of the tile) across all TN rows: m64nTNk16, TN/2 fp32 accumulators a thread (128 at TN
// 256, as the library kernel's 2 x m64n128), A from registers (each thread dequantizes 2 rows x 16 k a
// k-tile: half the library kernel's 4 rows x 16 k for the same wgmma FLOPs).
//   plain:  the 128 weight rows are outputs n0 + [0, 128) of W; column tiles of 128 outputs.
//   GATED:  stage rows [0, 64) are gate outputs n0 + [0, 64), rows [64, 128) the up rows of the same
//           outputs; column tiles of 64 outputs. Every 16-row warp slice holds 8 gate rows (slice rows 0-7)
//           and the up rows of the same 8 outputs (rows 8-15), so a thread holds G and U of one output
//           for all its TN/4 columns and computes the SwiGLU in registers (as the library's GATED layout).
//   Thread (cw, w4, g = lane/4, c = lane%4), accumulator row h (0, 1) = m64 row 16*w4 + g + 8h
//   (acc[4j + 2h + e] at column 8j + 2c + e, the m16n8 layout) is stage row xt_row_base + xt_row_step(h):
//     plain:  cw*64 + 16*w4 + g  +  8h      output n0 + xt_row_base + xt_out_step(h) (= the stage row)
//     GATED:  cw*32 + 8*w4 + g   +  64h     output n0 + xt_row_base (h = 0 gate, h = 1 up)
//   (tests/emu/moe_expert_tile_emu.cu walks every thread through these.)
// Stage: [Xb tile TN x 64 bf16, 128B-swizzled (wg_swz) | W words 128 rows x 32 B]; xt_stages(TN) stages
// (TN 256: 6 x 36 KB; TN 160: 8 x 24 KB), full/empty mbarriers, no CTA-wide barrier in the loop.
// Producer warpgroup (setmaxnreg XT_PRODUCER_REGS):
//   W: one TMA box {8 words, 128 rows, 1} of tmap_w (plain) or two boxes {8, 64, 1} of tmap_w (gate, into
//      rows 0-63) and tmap_u (up, rows 64-127); rows >= N read as zero, their outputs never stored.
//   Xb, plain: ceil(tile.rows / 32) TMA boxes {64, XT_XBOX = 32} of tmap_x from tile.row0 (an expert of
//      ~128 rows loads 128 rows of a 256-row stage, not 256: half the L2 -> shared traffic at TN 256). Rows
//      past the expert's end inside the last box are the next expert's or zero, and rows past the last
//      box keep what the stage held: either way their columns are computed and never stored.
//   Xb, GATED: the 128 threads copy the tile's rows x_rows[row0 + r] by cp.async, TN/16 16-byte chunks a
//      thread a stage, arriving on full[s] TMA_GATHER_LAG stages later (as linear_wgmma_tma_kernel's
//      GATHER). Rows r >= tile.rows are not copied: the stage keeps whatever it held, and since column r
//      of D = W . Xb^T depends on Xb row r only, those columns are garbage that is never stored.
// Consumers (setmaxnreg XT_CONSUMER_REGS): per k-tile, wait full[s]; per half (k16 steps 2H, 2H+1)
//   dequantize the thread's 2 rows x 16 bytes (ld.shared.v4, wg_dequant_pair: w = scale*q + bias rounded
//   once to bf16) into A[2][4], queue 2 wgmma m64nTNk16 on B = the stage's Xb tile, retire the previous
//   group (wait_group 1); retiring half 1 of kt-1 releases kt-1's stage (empty counts 8 warps).
//   Epilogue from the accumulators (plain: y = acc; GATED: y = row_scale * silu(G) * U, store_output's
//   expression, as F32 y or wg_bf16 at wg_xb_pos in yb), only rows r < tile.rows and outputs < N.
// Precision: every output value is the same bf16 operands, k order (k-tiles ascending, k16 steps) and
//   fp32 wgmma accumulation as the library kernel's; only its row/column position inside the instruction
//   differs (the tenth session's runtime-N trial found such results bit-identical): the lab demands
//   bit-identity with the library kernel's output (128-row tiles) and FAILs otherwise.
// Persistent: min(units, SMs) CTAs of 384 threads; a unit is (row tile, column tile), row tile fastest.
#pragma once
#include "cuda/kernels/linear_wgmma_tma.cuh"

namespace lily::cuda {

constexpr int XT_WROWS = 128;  // weight rows a tile: 2 consumer warpgroups x m64
constexpr int XT_XBOX = 32;    // plain: rows of one Xb TMA box (a tile loads only the boxes holding its rows)
// The producer keeps TN/16 gather row offsets (16 at TN 256); the consumers need TN/2 + ~40.
constexpr int XT_PRODUCER_REGS = 56, XT_CONSUMER_REGS = 224;
__host__ __device__ constexpr int xt_stage_bytes(int tn) { return tn * WG_BK * 2 + XT_WROWS * tma_w_row_bytes(4); }
__host__ __device__ constexpr int xt_stages(int tn) {
  return (227 * 1024 - 1024 - 128) / xt_stage_bytes(tn) < 8 ? (227 * 1024 - 1024 - 128) / xt_stage_bytes(tn) : 8;
}
__host__ __device__ constexpr int xt_smem_bytes(int tn) { return 1024 + xt_stages(tn) * (xt_stage_bytes(tn) + 16); }
static_assert(xt_smem_bytes(256) <= 227 * 1024 && xt_smem_bytes(160) <= 227 * 1024, "ring exceeds 227 KB");
static_assert(256 % XT_XBOX == 0 && 160 % XT_XBOX == 0, "a tile is whole Xb boxes");
static_assert(xt_stages(256) > TMA_GATHER_LAG && xt_stages(160) > TMA_GATHER_LAG, "gather lag needs more stages");

__host__ __device__ constexpr int xt_row_base(bool gated, int cw, int w4, int g) {
  return gated ? cw * 32 + 8 * w4 + g : cw * 64 + 16 * w4 + g;
}
__host__ __device__ constexpr int xt_row_step(bool gated, int h) { return gated ? 64 * h : 8 * h; }
__host__ __device__ constexpr int xt_out_step(bool gated, int h) { return gated ? 0 : 8 * h; }
// A fragment register of packed word m (0..3) of a half's 16-byte chunk, accumulator row h: word m is k16
// step m/2 of the half (A[m/2]), its k 0-7 (m even) or 8-15 (m odd); wgmma's register r holds row g + 8(r%2),
// k 2c + 8(r/2) of the step.
__host__ __device__ constexpr int xt_a_reg(int m, int h) { return (m & 1) * 2 + h; }
// outputs a column tile covers
__host__ __device__ constexpr int xt_tile_outputs(bool gated) { return gated ? XT_WROWS / 2 : XT_WROWS; }

#ifdef __CUDACC__

__device__ __forceinline__ void wgmma_m64n256k16_rA(float (&d)[128], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, {%128,%129,%130,%131}, %132, p, 1, 1, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

__device__ __forceinline__ void wgmma_m64n160k16_rA(float (&d)[80], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n160k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79}, {%80,%81,%82,%83}, %84, p, 1, 1, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

template <int TN>
__device__ __forceinline__ void xt_wgmma(float (&d)[TN / 2], const uint32_t (&a)[4], uint64_t desc) {
  static_assert(TN == 256 || TN == 160, "xt_wgmma: N 256 or 160");
  if constexpr (TN == 256) wgmma_m64n256k16_rA(d, a, desc);
  else wgmma_m64n160k16_rA(d, a, desc);
}

// The thread's 2 rows of half H of the stage's k-tile (16-byte chunk H of each 32-byte row; packed word m
// is k16 step m/2, register xt_a_reg(m, h) of it, nibbles c and c+4): A[step][4].
template <int H, bool GATED>
__device__ __forceinline__ void xt_dequant_half(uint32_t ws, int c, const uint32_t (&sb)[2], uint32_t (&A)[2][4]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint32_t s2 = __byte_perm(sb[h], 0, 0x1010), b2 = __byte_perm(sb[h], 0, 0x3232);
    const uint4 w = ld_shared_v4(ws + xt_row_step(GATED, h) * tma_w_row_bytes(4) + 16 * H);
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int m = 0; m < 4; ++m) A[m >> 1][xt_a_reg(m, h)] = wg_dequant_pair(words[m] >> (4 * c), s2, b2);
  }
}

template <int TN, int H>
__device__ __forceinline__ void xt_issue_half(float (&acc)[TN / 2], const uint32_t (&A)[2][4], uint64_t xd) {
#pragma unroll
  for (int i = 0; i < TN / 2; ++i) fence_reg(acc[i]);
  wgmma_fence();
#pragma unroll
  for (int s = 0; s < 2; ++s) xt_wgmma<TN>(acc, A[s], xd + (2 * H + s) * 2);
  wgmma_commit();
#pragma unroll
  for (int i = 0; i < TN / 2; ++i) fence_reg(acc[i]);
}

// Epilogue of one consumer thread (outputs o0 + xt_out_step(h), columns r = 8j + 2c + e < tile.rows).
// Row group j + 1's row scales are loaded before group j is stored (one latency a group, not one a
// value: a store to y could alias row_scale, so the compiler would not hoist the loads itself).
template <int TN, bool GATED>
__device__ __forceinline__ void xt_store(const LinearArgs& a, const Tile& tile, int64_t o0, int c,
                                         const float (&acc)[TN / 2]) {
  const int64_t N = a.w.rows;
  if constexpr (!GATED) {
    const bool col[2] = {o0 < N, o0 + 8 < N};
#pragma unroll
    for (int j = 0; j < TN / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int r = 8 * j + 2 * c + e;
        if (r >= tile.rows) continue;
        float* y = a.y + (tile.row0 + r) * a.ldy + o0;
#pragma unroll
        for (int h = 0; h < 2; ++h)
          if (col[h]) y[xt_out_step(false, h)] = acc[4 * j + 2 * h + e];
      }
  } else {
    if (o0 >= N) return;
    float rs[2][2];  // [group parity][e]
    auto load = [&](int j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int r = 8 * j + 2 * c + e;
        rs[j & 1][e] = r < tile.rows && a.row_scale ? a.row_scale[tile.row0 + r] : 1.f;
      }
    };
    load(0);
#pragma unroll
    for (int j = 0; j < TN / 8; ++j) {
      if (j + 1 < TN / 8) load(j + 1);
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int r = 8 * j + 2 * c + e;
        if (r >= tile.rows) continue;
        const float v = rs[j & 1][e] * silu(acc[4 * j + e]) * acc[4 * j + 2 + e];
        if (a.yb) a.yb[(tile.row0 + r) * N + wg_xb_pos(o0)] = wg_bf16(v);
        else a.y[(tile.row0 + r) * a.ldy + o0] = v;
      }
    }
  }
}

// moe_expert_tile_kernel<TN, GATED>: the header's product. GATED gathers its rows (a.x_rows), plain reads
// Xb rows from row0 by 32-row TMA boxes, only those holding the tile's rows. a.tiles: grouped map of
// TN-row tiles (RowTiles::tile_rows == TN).
template <int TN, bool GATED>
__global__ void __launch_bounds__(TMA_THREADS, 1)
    moe_expert_tile_kernel(const LinearArgs a, const uint16_t* xb, const __grid_constant__ CUtensorMap tmap_x,
                           const __grid_constant__ CUtensorMap tmap_w, const __grid_constant__ CUtensorMap tmap_u) {
  constexpr int S = xt_stages(TN), BN = xt_tile_outputs(GATED), KW = WG_BK * 4 / 32;
  constexpr uint32_t XBYTES = TN * WG_BK * 2, STAGE = xt_stage_bytes(TN), WBYTES = XT_WROWS * tma_w_row_bytes(4);
  pdl_wait();
  pdl_trigger();
  extern __shared__ uint8_t smem_raw[];
  const uint32_t ring_s = (smem_u32(smem_raw) + 1023) & ~1023u, bars = ring_s + S * STAGE;
  auto full = [&](uint32_t s) { return bars + 8 * s; };
  auto empty = [&](uint32_t s) { return bars + 8 * (S + s); };
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(full(s), GATED ? 1 + 128 : 1);
      mbar_init(empty(s), 8);
    }
    mbar_init_fence();
  }
  __syncthreads();

  const int64_t N = a.w.rows, K = a.w.cols;
  const int nk = int(K / WG_BK);
  const int64_t col_tiles = (N + BN - 1) / BN, row_tiles = *a.tiles.num_tiles, units = row_tiles * col_tiles;

  if (warp < 4) {  // ---------------- producer warpgroup ----------------
    setmaxnreg_dec<XT_PRODUCER_REGS>();
    uint32_t s = 0, ph = 0;
    if constexpr (!GATED) {
      if (tid != 0) return;
      for (int64_t u = blockIdx.x; u < units; u += gridDim.x) {
        Tile tile;
        if (!find_tile(a.tiles, u % row_tiles, TN, tile)) continue;
        const int n0 = int(u / row_tiles) * BN;
        const int nb = int(tile.rows + XT_XBOX - 1) / XT_XBOX;  // Xb boxes holding the tile's rows
        for (int kt = 0; kt < nk; ++kt) {
          mbar_wait(empty(s), ph ^ 1);
          const uint32_t st = ring_s + s * STAGE;
          mbar_arrive_expect_tx(full(s), WBYTES + nb * XT_XBOX * WG_BK * 2);
          tma_load_3d(st + XBYTES, &tmap_w, full(s), kt * KW, n0, int(tile.expert));
          for (int i = 0; i < nb; ++i)
            tma_load_2d(st + i * XT_XBOX * WG_BK * 2, &tmap_x, full(s), kt * WG_BK, int(tile.row0) + i * XT_XBOX);
          if (++s == S) s = 0, ph ^= 1;
        }
      }
    } else {
      constexpr int PER = TN * 8 / 128;  // 16-byte chunks a thread a stage
      const int j = tid & 7;             // chunk (k 8j..8j+7 of the k-tile) of every row this thread copies
      uint32_t s_arrive = 0;
      int pending = 0;
      for (int64_t u = blockIdx.x; u < units; u += gridDim.x) {
        Tile tile;
        if (!find_tile(a.tiles, u % row_tiles, TN, tile)) continue;
        const int n0 = int(u / row_tiles) * BN;
        uint32_t src[PER];  // 16-byte chunk index of each copied row's start in Xb (32 bits: host checks)
#pragma unroll
        for (int i = 0; i < PER; ++i) {
          const int r = (tid >> 3) + 16 * i;
          src[i] = r < tile.rows ? uint32_t(a.x_rows[tile.row0 + r]) * uint32_t(K / 8) + uint32_t(j) : 0u;
        }
        for (int kt = 0; kt < nk; ++kt) {
          mbar_wait(empty(s), ph ^ 1);
          const uint32_t st = ring_s + s * STAGE;
          if (tid == 0) {
            mbar_arrive_expect_tx(full(s), WBYTES);
            tma_load_3d(st + XBYTES, &tmap_w, full(s), kt * KW, n0, int(tile.expert));
            tma_load_3d(st + XBYTES + WBYTES / 2, &tmap_u, full(s), kt * KW, n0, int(tile.expert));
          }
#pragma unroll
          for (int i = 0; i < PER; ++i)
            if ((tid >> 3) + 16 * i < tile.rows)
              cp_async16(st + wg_swz((tid >> 3) + 16 * i, j), xb + 8 * (int64_t(src[i]) + kt * (WG_BK / 8)), 16);
          cp_async_commit();
          if (pending == TMA_GATHER_LAG) {
            cp_async_wait<TMA_GATHER_LAG>();
            fence_proxy_async();
            mbar_arrive(full(s_arrive));
            if (++s_arrive == S) s_arrive = 0;
          } else {
            ++pending;
          }
          if (++s == S) s = 0, ph ^= 1;
        }
      }
      cp_async_wait<0>();
      fence_proxy_async();
      for (; pending > 0; --pending) {
        mbar_arrive(full(s_arrive));
        if (++s_arrive == S) s_arrive = 0;
      }
    }
    return;
  }

  // ---------------- consumer warpgroups ----------------
  setmaxnreg_inc<XT_CONSUMER_REGS>();
  const int ct = tid - 128, cw = ct >> 7, w4 = (ct >> 5) & 3, g = lane >> 2, c = lane & 3;
  const int rbase = xt_row_base(GATED, cw, w4, g);
  const int gshift = __ffs(a.w.group_size) - 1;
  const int64_t gpr = K / a.w.group_size;
  const uint16_t* sc[2] = {static_cast<const uint16_t*>(a.w.scales),
                           static_cast<const uint16_t*>(GATED ? a.up.scales : a.w.scales)};
  const uint16_t* bi[2] = {static_cast<const uint16_t*>(a.w.biases),
                           static_cast<const uint16_t*>(GATED ? a.up.biases : a.w.biases)};
  uint32_t s = 0, ph = 0, xs = ring_s, ws = ring_s + XBYTES + rbase * tma_w_row_bytes(4), fb = full(0), eb_prev = 0;
  for (int64_t u = blockIdx.x; u < units; u += gridDim.x) {
    Tile tile;
    if (!find_tile(a.tiles, u % row_tiles, TN, tile)) continue;
    const int64_t n0 = (u / row_tiles) * BN;
    float acc[TN / 2];
#pragma unroll
    for (int i = 0; i < TN / 2; ++i) acc[i] = 0.f;
    uint32_t rows[2];  // scale index of the thread's rows h at group 0 (rows past N read row N - 1)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t o = n0 + rbase + xt_out_step(GATED, h);
      rows[h] = uint32_t((tile.expert * N + (o < N ? o : N - 1)) * gpr);
    }
    auto load_scales = [&](uint32_t (&sb)[2], int kt) {
      const uint32_t grp = uint32_t(kt * WG_BK) >> gshift;
#pragma unroll
      for (int h = 0; h < 2; ++h)
        sb[h] = uint32_t(__ldg(sc[h] + rows[h] + grp)) | (uint32_t(__ldg(bi[h] + rows[h] + grp)) << 16);
    };
    uint32_t H0[2][4], H1[2][4], cur[2], nxt[2];
    load_scales(nxt, 0);
#pragma unroll 1
    for (int kt = 0; kt < nk; ++kt) {
      cur[0] = nxt[0], cur[1] = nxt[1];
      if (kt + 1 < nk) load_scales(nxt, kt + 1);
      mbar_wait(fb, ph);
      const uint64_t xd = wg_desc(xs);
      xt_dequant_half<0, GATED>(ws, c, cur, H0);
      xt_issue_half<TN, 0>(acc, H0, xd);
      wgmma_wait<1>();  // half 1 of kt-1 retired
      if (kt > 0 && lane == 0) mbar_arrive(eb_prev);
      xt_dequant_half<1, GATED>(ws, c, cur, H1);
      xt_issue_half<TN, 1>(acc, H1, xd);
      wgmma_wait<1>();  // half 0 of kt retired
      eb_prev = fb + 8 * S;
      const int d = s + 1 == S ? 1 - S : 1;
      s += d, xs += d * STAGE, ws += d * STAGE, fb += d * 8;
      if (s == 0) ph ^= 1;
    }
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < TN / 2; ++i) fence_reg(acc[i]);
    if (lane == 0) mbar_arrive(eb_prev);
    xt_store<TN, GATED>(a, tile, n0 + rbase, c, acc);
  }
}

#endif  // __CUDACC__

}  // namespace lily::cuda
