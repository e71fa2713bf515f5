// CPU emulator of moe_small_kernel's fragments (kernels/moe_small.cuh): one warp's 16-row A tile over all K
// segments and n8 tiles of staged rows, with the header's own host-callable pieces (ms_slot, ms_a_bits,
// ms_b_frag, ms_group, ms_row_bytes, wg_pack_bf16x2), against a scalar reference. Checked:
//   frag:  for every lane the A registers (ms_a_bits at the lane's 16 bytes of rows g and g+8, dequantized
//          as wg_dequant_pair: s*q + b rounded once to bf16, the lane's group by ms_group) and the B
//          registers (ms_b_frag of the 16-byte chunk at the kernel's staged address: ms_slot of Xb chunk J,
//          written as ms_stage writes it), assembled into A [16 x 16] and B [16 x 8] by the PTX layout of
//          mma.m16n8k16 (written out here independently), accumulated in double into D [16 x 8] scattered
//          back by the accumulator layout: D must equal sum_k bf16(W[o, k]) bf16(X[n, k]) (double, any order)
//          for K = 512 and 2048, groups of 32, 64 and 128, 1..8 rows per n8 tile;
//   slot:  ms_slot permutes the 16 chunks of each segment;
//   banks: the 8 lanes of each quarter warp read 16-byte units in 8 different 128-byte bank positions
//          (conflict-free ld.shared.v4) for every m;
//   ring:  moe_small_kernel's ring (ms_ring_off from the rows' starts, ms_ring_w_at, ms_ring_s_at,
//          ms_ring_sc_lane, ms_ring_sb): the copies of every
//          lane of a warp (4-byte scale words at their aligned pairs, 16-byte weight words) into a slot,
//          read back with the partner lane's word, give each lane the weight words of rows g and g + 8 of
//          its tiles and scale | bias << 16 of its group (what a direct load reads), for the gated (a pair of
//          16 rows, two matrices) and plain (4 pairs of 32 rows, pairs past N) forms, K = 512 / 2048, groups
//          32..256; no two copies overlap, the slot holds MS_SLOT_BYTES, a quarter warp's weight reads are
//          128 contiguous bytes.
// Built with nvcc as host code; exits non-zero and prints FAIL on any mismatch.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/kernels/moe_small.cuh"

#include "emu_common.h"
#include "ms_emu.h"

using namespace lily::cuda;

static void run_case(int K, int gs, int rows, std::mt19937& rng) {
  const int N = 16, words = K / 8, gpr = K / gs, nt = (rows + 7) / 8, gshift = __builtin_ctz(gs);
  std::vector<uint32_t> W(size_t(N) * words);
  std::vector<uint16_t> S(size_t(N) * gpr), B(size_t(N) * gpr);
  std::uniform_int_distribution<uint32_t> bits;
  std::normal_distribution<float> normal(0.f, 1.f);
  for (auto& w : W) w = bits(rng);
  for (size_t i = 0; i < S.size(); ++i) S[i] = f_to_bf16(normal(rng) * 0.02f), B[i] = f_to_bf16(normal(rng) * 0.1f);
  std::vector<float> X(size_t(nt) * 8 * K, 0.f);
  for (int j = 0; j < rows; ++j)
    for (int k = 0; k < K; ++k) X[size_t(j) * K + k] = normal(rng);
  // the staged rows as ms_stage writes them: Xb chunk J of row j at byte j * stride + 16 * ms_slot(J)
  const int stride = ms_row_bytes(K);
  std::vector<uint8_t> smem(size_t(nt) * 8 * stride, 0);
  for (int j = 0; j < nt * 8; ++j)
    for (int J = 0; J < K / 8; ++J) {
      const float* x = &X[size_t(j) * K + 8 * J];
      const uint32_t v[4] = {wg_pack_bf16x2(x[0], x[4]), wg_pack_bf16x2(x[1], x[5]), wg_pack_bf16x2(x[2], x[6]),
                             wg_pack_bf16x2(x[3], x[7])};
      std::memcpy(&smem[size_t(j) * stride + 16 * ms_slot(J)], v, 16);
    }
  // the warp: D[o][n] over all segments
  std::vector<double> D(size_t(16) * nt * 8, 0.0);
  for (int seg = 0; seg < K / MS_SEG_VALS; ++seg)
    for (int m = 0; m < 4; ++m)
      for (int h = 0; h < 2; ++h) {
        double A[16][16], Bm[16][64];
        for (int lane = 0; lane < 32; ++lane) {
          const int g = lane / 4, c = lane % 4;
          uint4 w0, w1;
          std::memcpy(&w0, &W[size_t(g) * words + seg * 16 + 4 * c], 16);
          std::memcpy(&w1, &W[size_t(g + 8) * words + seg * 16 + 4 * c], 16);
          const uint16_t* const sc[2] = {&S[size_t(g) * gpr], &S[size_t(g + 8) * gpr]};
          const uint16_t* const bi[2] = {&B[size_t(g) * gpr], &B[size_t(g + 8) * gpr]};
          ms_emu_lane(w0, w1, sc, bi, ms_group(seg, c, gshift), smem, stride, seg, m, h, g, c, nt, A, Bm);
        }
        for (int r = 0; r < 16; ++r)
          for (int col = 0; col < nt * 8; ++col) {
            double acc = 0;
            for (int k = 0; k < 16; ++k) acc += A[r][k] * Bm[k][col];
            D[size_t(r) * nt * 8 + col] += acc;
          }
      }
  // reference
  for (int o = 0; o < 16; ++o)
    for (int j = 0; j < rows; ++j) {
      double mag;
      const double ref = q4_row_dot(&W[size_t(o) * words], &S[size_t(o) * gpr], &B[size_t(o) * gpr], &X[size_t(j) * K],
                                    K, gs, mag);
      const double got = D[size_t(o) * nt * 8 + j];
      expect(std::fabs(got - ref) <= 1e-9 * (mag + 1e-30), "frag D vs reference", got, ref);
    }
  std::printf("ok  frag K=%d gs=%d rows=%d\n", K, gs, rows);
}

// ring: one warp's copies of every unit into a slot and the lanes' reads back, against direct loads.
static void ring_case(bool gated, int K, int gs, int N, int o0, std::mt19937& rng) {
  const int E = 3, e = 1, words = K / 8, gpr = K / gs, pairs = ms_pairs(gated), pair_rows = gated ? 16 : 32;
  std::uniform_int_distribution<uint32_t> bits;
  std::vector<uint32_t> W[2];
  std::vector<uint16_t> S[2], B[2];
  for (int t = 0; t < 2; ++t) {
    W[t].resize(size_t(E) * N * words), S[t].resize(size_t(E) * N * gpr), B[t].resize(S[t].size());
    for (auto& w : W[t]) w = bits(rng);
    for (size_t i = 0; i < S[t].size(); ++i) S[t][i] = uint16_t(bits(rng)), B[t][i] = uint16_t(bits(rng));
  }
  MsRing m;
  m.nseg = K / MS_SEG_VALS, m.gshift = __builtin_ctz(gs), m.pair_rows = pair_rows, m.wpr4 = K / 32, m.gpr = gpr;
  m.live_pairs = std::max(0, std::min(pairs, (N - o0) / pair_rows));
  int checked = 0;
  for (int i = 0; i < pairs * m.nseg; ++i) {
    const int p0 = i / m.nseg, seg = i % m.nseg;
    std::vector<uint8_t> slot(MS_SLOT_BYTES, 0);
    std::vector<int> owner(MS_SLOT_BYTES, -1);
    for (int lane = 0; lane < 32; ++lane) {  // the copies: the kernel's row starts + ms_ring_off
      const int g = lane / 4, c = lane % 4;
      const MsOff o = ms_ring_off(m, p0, seg, c);
      for (int t = 0; t < 2; ++t) {
        const int mt = gated ? t : 0;  // plain: both tiles of the one matrix
        m.row[t] = int64_t(e) * N + (o0 < N ? o0 : 0) + (gated ? 0 : 16 * t) + g;
        for (int h = 0; h < 2; ++h) {
          const int64_t row = m.row[t] + 8 * h, w4 = row * m.wpr4 + c + o.w4, sc = row * m.gpr + o.sc;
          expect(sc % 2 == 0 && sc + 1 < int64_t(S[mt].size()), "scale pair in range", i, lane);
          const uint32_t wa = ms_ring_w_at(2 * t + h, lane), sa = ms_ring_s_at(2 * t + h, lane);
          std::memcpy(&slot[wa], &W[mt][size_t(w4) * 4], 16);
          std::memcpy(&slot[sa], c & 1 ? &B[mt][size_t(sc)] : &S[mt][size_t(sc)], 4);
          for (uint32_t b = 0; b < 16; ++b) expect(owner[wa + b] < 0, "copies overlap", wa + b, lane), owner[wa + b] = lane;
          for (uint32_t b = 0; b < 4; ++b) expect(owner[sa + b] < 0, "copies overlap", sa + b, lane), owner[sa + b] = lane;
        }
      }
    }
    for (int lane = 0; lane < 32; ++lane) {  // the reads, against direct loads of the rows
      const int g = lane / 4, c = lane % 4;
      const int p = o0 + p0 * pair_rows < N ? p0 : 0, grp = ms_group(seg, c, m.gshift);
      const int sl = ms_ring_sc_lane(lane), bl = sl ^ 1;
      for (int t = 0; t < 2; ++t)
        for (int h = 0; h < 2; ++h) {
          const int mt = gated ? t : 0, k = 2 * t + h;
          const int64_t row = int64_t(e) * N + (o0 < N ? o0 : 0) + p * pair_rows + (gated ? 0 : 16 * t) + g + 8 * h;
          expect(std::memcmp(&slot[ms_ring_w_at(k, lane)], &W[mt][size_t(row * words + seg * 16 + 4 * c)], 16) == 0,
                 "ring weight word", i, 4 * lane + k);
          uint32_t sc, bi;
          std::memcpy(&sc, &slot[ms_ring_s_at(k, sl)], 4);
          std::memcpy(&bi, &slot[ms_ring_s_at(k, bl)], 4);
          const size_t gi = size_t(row * gpr + grp);
          const uint32_t want = uint32_t(S[mt][gi]) | (uint32_t(B[mt][gi]) << 16);
          expect(ms_ring_sb(sc, bi, grp & 1) == want, "ring scale | bias", i, 4 * lane + k);
          ++checked;
        }
    }
  }
  for (int k = 0; k < 4; ++k)  // a quarter warp: 8 lanes x 16 contiguous bytes
    for (int lane = 0; lane < 32; ++lane)
      expect(ms_ring_w_at(k, lane) == ms_ring_w_at(k, lane & ~7) + 16 * (lane & 7), "ring read contiguous", k, lane);
  expect(ms_ring_s_at(3, 31) + 4 == MS_SLOT_BYTES, "slot size", ms_ring_s_at(3, 31) + 4, MS_SLOT_BYTES);
  std::printf("ok  ring %s K=%d gs=%d N=%d o0=%d (%d reads)\n", gated ? "gated" : "plain", K, gs, N, o0, checked);
}

int main() {
  std::mt19937 rng(17);
  const int cases[][3] = {{512, 64, 5}, {2048, 64, 8}, {2048, 32, 13}, {512, 128, 32}, {2048, 128, 1}, {512, 32, 24}};
  for (const auto& cs : cases) run_case(cs[0], cs[1], cs[2], rng);
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
  ring_case(true, 2048, 64, 512, 448, rng);
  ring_case(true, 2048, 32, 512, 0, rng);
  ring_case(false, 512, 64, 2048, 1920, rng);
  ring_case(false, 512, 256, 2048, 0, rng);
  ring_case(false, 512, 128, 160, 64, rng);  // a pair past N: the last of the warp's 4 reads pair 0
  ring_case(true, 2048, 128, 48, 48, rng);   // a warp past N: its pair reads rows 0..15
  if (failures) {
    std::printf("%d failures\n", failures);
    return 1;
  }
  std::printf("all passed\n");
  return 0;
}
