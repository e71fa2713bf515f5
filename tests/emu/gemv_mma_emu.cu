// CPU emulator of the integer tensor-core GEMV (csrc/cuda/kernels/gemv_mma.cuh): runs the kernel's own
// host-callable pieces (block scale, octet digits and their staged order, A and B fragments, accumulator
// chaining and combination, lane constants, column epilogue) for every lane of a warp, with mma.sync m16n8k32 u8 x s8 emulated from the PTX ISA's
// fragment tables, and compares one 16-row tile's y with an fp64 product of the dequantized weights.
// Built with nvcc as host code; exits non-zero and prints FAIL on any mismatch.
//   A 16x32: a0 row g, k 4t..4t+3 | a1 row g+8, k 4t.. | a2 row g, k 16+4t.. | a3 row g+8, k 16+4t..
//   B 32x8:  b0 col g, k 4t..4t+3 | b1 col g, k 16+4t..
//   C 16x8:  c0, c1 row g, cols 2t, 2t+1 | c2, c3 row g+8, cols 2t, 2t+1        (g = lane/4, t = lane%4)
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/gemv_plan.h"
#include "cuda/kernels/gemv_mma_tokens.cuh"

using namespace lily::cuda;

static int8_t sbyte(uint32_t w, int i) { return int8_t((w >> (8 * i)) & 0xFF); }
static uint8_t ubyte(uint32_t w, int i) { return uint8_t((w >> (8 * i)) & 0xFF); }

// D += A B for one warp: a[lane][4], b[lane][2] -> c[lane][4], per the tables above.
static void emulate_mma(const uint32_t (*a)[4], const uint32_t (*b)[2], int (*c)[4]) {
  int A[16][32], B[32][8];
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; ++i) {
      A[g][4 * t + i] = ubyte(a[lane][0], i);
      A[g + 8][4 * t + i] = ubyte(a[lane][1], i);
      A[g][16 + 4 * t + i] = ubyte(a[lane][2], i);
      A[g + 8][16 + 4 * t + i] = ubyte(a[lane][3], i);
      B[4 * t + i][g] = sbyte(b[lane][0], i);
      B[16 + 4 * t + i][g] = sbyte(b[lane][1], i);
    }
  }
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    for (int e = 0; e < 4; ++e) {
      const int row = g + (e >= 2 ? 8 : 0), col = 2 * t + (e & 1);
      int64_t d = 0;
      for (int k = 0; k < 32; ++k) d += int64_t(A[row][k]) * B[k][col];
      c[lane][e] += int(d);
    }
  }
}

static uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t(u >> 16);  // truncation: any BF16 value is a valid test scale
}
static float from_bf16(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Stages x [K] as mma_stage_x does, per octet (block max and sum over the block's octets), into xd
// [K/8][3], xe and xsum [K/VB]; checks that the digits reconstruct rint(v * inv) exactly.
template <int BITS, int NG>
static bool stage_row(const float* x, int K, uint2* xd, float* xe, float* xsum) {
  constexpr int VB = MmaSeg<BITS>::VALS / NG;
  for (int u = 0; u < K / VB; ++u) {
    float m = 0.f, s = 0.f;
    for (int j = u * VB; j < (u + 1) * VB; ++j) m = std::fmax(m, std::fabs(x[j])), s += x[j];
    float e;
    const float inv = mma_block_scale(m, e);
    xe[u] = e, xsum[u] = s;
    for (int o = u * VB / 8; o < (u + 1) * VB / 8; ++o) {
      float v[8];
      for (int k = 0; k < 8; ++k) v[k] = x[8 * o + k];
      uint2 dg[3];
      mma_octet_digits<BITS>(v, inv, dg);
      for (int d = 0; d < 3; ++d) mma_xd_store<BITS>(reinterpret_cast<uint32_t*>(xd), o, d, dg[d]);
      // the digits must reconstruct rint(v * inv) exactly
      for (int k = 0; k < 8; ++k) {
        const int byte = BITS == 4 ? (k % 2) * 4 + k / 2 : k;  // position of value k in (b0, b1)
        int X = 0;
        for (int d = 2; d >= 0; --d) {
          const uint32_t word = byte < 4 ? dg[d].x : dg[d].y;
          X = X * 256 + sbyte(word, byte % 4);
        }
        if (X != int(std::rint(v[k] * inv))) {
          std::printf("FAIL digits: value %d of octet %d: %d vs %d\n", k, o, X, int(std::rint(v[k] * inv)));
          return false;
        }
      }
    }
  }
  return true;
}

// One warp over all segments of a 16-row tile (w [16][wpr], sc / bi [16][gpr]) with the staged x (xd,
// xe, xsum): each lane's accumulators acc[lane][2] as mma_segment leaves them.
template <int BITS, int NG>
static void tile_acc(const std::vector<uint32_t>& w, const std::vector<uint16_t>& sc, const std::vector<uint16_t>& bi,
                     int K, int group, const uint2* xd, const float* xe, const float* xsum, float (&acc)[32][2]) {
  using S = MmaSeg<BITS>;
  const int wpr = K * BITS / 32, gpr = K / group, Sg = K / S::VALS;
  for (auto& a : acc) a[0] = a[1] = 0.f;
  alignas(16) uint32_t xz[MMA_XD_ZERO_WORDS] = {};  // mma_gemv_body's zero block
  for (int seg = 0; seg < Sg; ++seg) {
    uint4 wl[32][2];
    uint32_t sbits[32][2], bbits[32][2];
    for (int lane = 0; lane < 32; ++lane) {
      const int g = lane / 4, t = lane % 4;
      for (int r = 0; r < 2; ++r) {
        const int row = g + 8 * r;
        const uint32_t* p = &w[row * wpr + seg * 16 + 4 * t];
        wl[lane][r] = make_uint4(p[0], p[1], p[2], p[3]);
        const int gi = row * gpr + (seg * S::VALS) / group;
        sbits[lane][r] = NG == 2 ? uint32_t(sc[gi]) | uint32_t(sc[gi + 1]) << 16 : sc[gi];
        bbits[lane][r] = NG == 2 ? uint32_t(bi[gi]) | uint32_t(bi[gi + 1]) << 16 : bi[gi];
      }
    }
    int cs[32][2][4] = {};  // the kernel's accumulators (mma_acc_of), per lane
    for (int m = 0; m < S::MMAS; ++m) {
      uint32_t a[32][4], b[32][2];
      int c[32][4];
      for (int lane = 0; lane < 32; ++lane) {
        MmaLane<BITS, NG> L(lane);
        L.xz = xz;
        mma_a_frag<BITS>(wl[lane][0], wl[lane][1], m, a[lane]);
        const int k = BITS == 4 ? (m & 1) : 0;
        const uint4 q = mma_xd_pair<BITS>(mma_xd_lane(L, reinterpret_cast<const uint32_t*>(xd)), seg, k);
        const uint2 v = mma_b_frag<BITS>(q, m);
        b[lane][0] = v.x, b[lane][1] = v.y;
        for (int e = 0; e < 4; ++e) c[lane][e] = cs[lane][mma_acc_of<BITS>(m)][e];
      }
      emulate_mma(a, b, c);
      for (int lane = 0; lane < 32; ++lane)
        for (int e = 0; e < 4; ++e) cs[lane][mma_acc_of<BITS>(m)][e] = c[lane][e];
    }
    for (int lane = 0; lane < 32; ++lane) {
      int c[4];
      for (int e = 0; e < 4; ++e) c[e] = mma_combine<BITS>(cs[lane], e);
      mma_columns<BITS, NG>(MmaLane<BITS, NG>(lane), c, sbits[lane], bbits[lane], seg, xe, xsum, acc[lane]);
    }
  }
}

// Row `row` of a tile from the lane accumulators: the quad sum in mma_gemv_body's xor-shuffle order.
static float quad_sum(const float (&acc)[32][2], int row) {
  const int g = row % 8, r = row / 8;
  return (acc[4 * g][r] + acc[4 * g + 1][r]) + (acc[4 * g + 2][r] + acc[4 * g + 3][r]);
}

template <int BITS, int NG>
static bool run_case(int K, int group, float xscale, std::mt19937& rng) {
  using S = MmaSeg<BITS>;
  constexpr int VB = S::VALS / NG;
  const int rows = 16, wpr = K * BITS / 32, gpr = K / group;
  std::vector<uint32_t> w(rows * wpr);
  std::vector<uint16_t> sc(rows * gpr), bi(rows * gpr);
  std::vector<float> x(K);
  for (uint32_t& v : w) v = rng();
  for (uint16_t& v : sc) v = to_bf16(std::uniform_real_distribution<float>(0.5f, 1.5f)(rng) / ((1 << BITS) - 1));
  for (uint16_t& v : bi) v = to_bf16(std::uniform_real_distribution<float>(-0.6f, -0.4f)(rng));
  // activations with a spread of magnitudes across blocks, and outliers
  for (int j = 0; j < K; ++j) {
    const float mag = std::exp2(float(int(rng() % 9) - 4)) * xscale;
    x[j] = std::normal_distribution<float>(0.f, 1.f)(rng) * mag;
    if (rng() % 97 == 0) x[j] *= 50.f;
  }
  std::vector<uint2> xd(K / 8 * 3);
  std::vector<float> xe(K / VB), xsum(K / VB);
  if (!stage_row<BITS, NG>(x.data(), K, xd.data(), xe.data(), xsum.data())) return false;
  float acc[32][2];
  tile_acc<BITS, NG>(w, sc, bi, K, group, xd.data(), xe.data(), xsum.data(), acc);
  // quad sums (lane t of each g), against fp64
  double num = 0, den = 0, num32 = 0;
  for (int row = 0; row < rows; ++row) {
    const float y = quad_sum(acc, row);
    double ref = 0;
    float y32 = 0.f;  // the fp32 product in natural order, for scale
    for (int j = 0; j < K; ++j) {
      const uint32_t word = w[row * wpr + j * BITS / 32];
      const int q = int((word >> ((j * BITS) % 32)) & ((1u << BITS) - 1));
      const int gi = row * gpr + j / group;
      ref += (double(from_bf16(sc[gi])) * q + double(from_bf16(bi[gi]))) * double(x[j]);
      y32 = std::fma(std::fma(from_bf16(sc[gi]), float(q), from_bf16(bi[gi])), x[j], y32);
    }
    num += (y - ref) * (y - ref), den += ref * ref, num32 += (y32 - ref) * (y32 - ref);
  }
  // inputs with 2^-4..2^4 spread and x50 outliers inside a block: ~1e-6 (the fp32 loop: ~1e-7..1e-6);
  // a mapping error shows as O(1)
  const double err = std::sqrt(num / den), err32 = std::sqrt(num32 / den);
  const bool ok = err < 1e-5;
  std::printf("%s bits %d group %3d NG %d K %5d xscale %-6g rel err %.2e (fp32 loop %.2e)\n", ok ? "ok  " : "FAIL",
              BITS, group, NG, K, xscale, err, err32);
  return ok;
}

// T tokens as linear_gemv_mma_tokens_kernel stages them (one mma_stage_x over the concatenated row x[0] |
// ... | x[T-1]: digits [T][K/8][3], then e and xsum [T][K/VB]) and reads them (mma_token_x): each token's
// tile must equal its one-token product (the token staged alone) bit for bit.
template <int BITS, int NG>
static bool run_tokens_case(int K, int group, int T, std::mt19937& rng) {
  constexpr int VB = MmaSeg<BITS>::VALS / NG;
  const int rows = 16, wpr = K * BITS / 32, gpr = K / group;
  std::vector<uint32_t> w(rows * wpr);
  std::vector<uint16_t> sc(rows * gpr), bi(rows * gpr);
  std::vector<float> x(size_t(T) * K);
  for (uint32_t& v : w) v = rng();
  for (uint16_t& v : sc) v = to_bf16(std::uniform_real_distribution<float>(0.5f, 1.5f)(rng) / ((1 << BITS) - 1));
  for (uint16_t& v : bi) v = to_bf16(std::uniform_real_distribution<float>(-0.6f, -0.4f)(rng));
  for (float& v : x) v = std::normal_distribution<float>(0.f, 1.f)(rng) * std::exp2(float(int(rng() % 21) - 10));
  // the kernel's shared memory: one buffer of mma_x_bytes(T * K, VB) bytes, split as the kernel splits it
  std::vector<uint2> smem(mma_x_bytes(int64_t(T) * K, VB) / sizeof(uint2));
  uint2* xd = smem.data();
  float* xe = reinterpret_cast<float*>(xd + T * (K / 8 * 3));
  float* xsum = xe + T * (K / VB);
  if (reinterpret_cast<char*>(xsum + T * (K / VB)) != reinterpret_cast<char*>(smem.data() + smem.size())) {
    std::printf("FAIL tokens: mma_x_bytes(T * K) is not the staged layout's size\n");
    return false;
  }
  if (!stage_row<BITS, NG>(x.data(), T * K, xd, xe, xsum)) return false;
  const MmaTokens tok = mma_tokens(T, K, VB);
  int mismatches = 0;
  for (int k = 0; k < T; ++k) {
    const MmaTokenX v = mma_token_x(xd, xe, xsum, tok, k);
    if (reinterpret_cast<uintptr_t>(v.xd) % 16 != 0) {
      std::printf("FAIL tokens: token %d's digits are not 16-byte aligned\n", k);
      return false;
    }
    float acc_t[32][2], acc_1[32][2];
    tile_acc<BITS, NG>(w, sc, bi, K, group, v.xd, v.xe, v.xsum, acc_t);
    std::vector<uint2> xd1(K / 8 * 3);
    std::vector<float> xe1(K / VB), xsum1(K / VB);
    if (!stage_row<BITS, NG>(x.data() + size_t(k) * K, K, xd1.data(), xe1.data(), xsum1.data())) return false;
    tile_acc<BITS, NG>(w, sc, bi, K, group, xd1.data(), xe1.data(), xsum1.data(), acc_1);
    for (int row = 0; row < rows; ++row) {
      const float a = quad_sum(acc_t, row), b = quad_sum(acc_1, row);
      if (std::memcmp(&a, &b, 4) != 0) ++mismatches;
    }
  }
  const bool ok = mismatches == 0;
  std::printf("%s tokens bits %d group %3d NG %d K %5d T %2d: %d of %d rows differ from one-token\n",
              ok ? "ok  " : "FAIL", BITS, group, NG, K, T, mismatches, T * rows);
  return ok;
}

// Which short prompts take the multi-token GEMV (gemv_plan.h's mma_tokens_shape): every layer matrix of
// the model at T = 2..16 (its 4-bit parts, the largest 8192 x 2048, and out_proj's 2048 x 4096); not one
// token or 17; not the 8-bit 257-row router or one-row shared gate; not the 248,320-row lm_head at any T
// (all_logits' 16-row blocks: the wgmma GEMM streams its weights once), nor a matrix past 2^28
// multiply-adds.
static bool run_tokens_shape_case() {
  struct Case {
    int bits;
    int64_t rows, cols, T;
    bool taken;
  };
  const Case cases[] = {
      {4, 8192, 2048, 16, true},  {4, 8192, 2048, 2, true},     {4, 4096, 2048, 11, true},
      {4, 2048, 4096, 16, true},  {4, 32, 2048, 16, true},      {4, 512, 2048, 9, true},
      {8, 1024, 2048, 16, true},  {4, 8192, 2048, 1, false},    {4, 8192, 2048, 17, false},
      {8, 257, 2048, 4, false},   {8, 1, 2048, 4, false},       {4, 248320, 2048, 16, false},
      {4, 248320, 2048, 12, false}, {4, 248320, 2048, 2, false}, {4, 12352, 2048, 16, false},
      {4, 16400, 2048, 12, false},
  };
  int wrong = 0;
  for (const Case& c : cases)
    if (mma_tokens_shape(c.bits, c.rows, c.cols, c.T) != c.taken) {
      std::printf("FAIL tokens shape: %d-bit %lld x %lld, T %lld: %s\n", c.bits, (long long)c.rows,
                  (long long)c.cols, (long long)c.T, c.taken ? "not taken" : "taken");
      ++wrong;
    }
  std::printf("%s tokens shapes: %d of %d routed wrongly\n", wrong ? "FAIL" : "ok  ", wrong,
              int(sizeof(cases) / sizeof(cases[0])));
  return wrong == 0;
}

int main() {
  std::mt19937 rng(7);
  bool ok = true;
  for (float xs : {1.f, 1e-3f, 3e4f}) {
    ok &= run_case<4, 2>(2048, 64, xs, rng);
    ok &= run_case<4, 1>(512, 128, xs, rng);
    ok &= run_case<4, 1>(256, 256, xs, rng);
    ok &= run_case<8, 1>(2048, 64, xs, rng);
    ok &= run_case<8, 2>(512, 32, xs, rng);
    ok &= run_case<8, 1>(256, 128, xs, rng);
  }
  for (int T : {2, 5, 8}) {
    ok &= run_tokens_case<4, 2>(2048, 64, T, rng);
    ok &= run_tokens_case<4, 1>(384, 128, T, rng);
    ok &= run_tokens_case<8, 2>(512, 32, T, rng);
    ok &= run_tokens_case<8, 1>(256, 128, T, rng);
  }
  ok &= run_tokens_shape_case();
  std::printf(ok ? "gemv_mma_emu: all passed\n" : "gemv_mma_emu: FAILED\n");
  return ok ? 0 : 1;
}
