// CPU emulator of the Xb hand-over (docs/cuda.md, "Xb hand-over"): a producer writing the wgmma GEMM's
// bf16 X itself must leave the bits wgx_bf16_kernel writes from the same F32 rows. Runs, with the kernel
// headers' own host-callable pieces (wg_pack_bf16x2, wg_bf16, wg_xb_pos, wg_phys_k):
//   wgx:    wgx_bf16_kernel's loop body for every row (the conversion the hand-over replaces), checked
//           against an independent round-to-nearest-even on the bits;
//   gated:  wg_store_gated's yb stores for every thread of every (row tile, 128-output column tile) of a
//           GATED product (BM 64 and 128; ragged row and output ends), checked to write every element
//           exactly once and the same bits as wgx;
//   norm:   gated_rms_norm_xb's stores (kernels/norms.cuh: thread j of a head row [D] packs its values
//           8j+c and 8j+c+4 into word c of one 16-byte store at 8j), checked against wgx of the matrix
//           [T, heads*D] that out_proj reads (the same Xb when D % 8 == 0).
// Built with nvcc as host code; exits non-zero and prints FAIL on any mismatch.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "cuda/kernels/linear_wgmma_tma.cuh"

using namespace lily::cuda;

static int failures = 0;
static void expect(bool ok, const char* what, long a, long b) {
  if (!ok && failures++ < 10) std::printf("FAIL %s (%ld, %ld)\n", what, a, b);
}

// Round to nearest even on the bits; NaN to a quiet NaN of the same sign.
static uint16_t rne(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// F32 values that stress the rounding: ties (low half exactly 0x8000) on odd and even, just below and
// above a tie, subnormals, signed zeros, infinities, the largest finite value, ordinary values.
static std::vector<float> values(size_t n, std::mt19937& rng) {
  std::vector<float> v(n);
  std::uniform_int_distribution<uint32_t> bits;
  std::normal_distribution<float> normal(0.f, 3.f);
  for (size_t i = 0; i < n; ++i) {
    uint32_t u = bits(rng);
    switch (i % 8) {
      case 0: u = (u & 0xffff0000u) | 0x8000u; break;  // a tie
      case 1: u = (u & 0xffff0000u) | 0x7fffu; break;
      case 2: u = (u & 0xffff0000u) | 0x8001u; break;
      case 3: u &= 0x807fffffu; break;                 // subnormal or zero
      case 4: {
        const float s[] = {0.f, -0.f, INFINITY, -INFINITY, std::numeric_limits<float>::max(), 1.f, -1.5f, 65504.f};
        float f = s[(i / 8) % 8];
        std::memcpy(&u, &f, 4);
        break;
      }
      default: {
        float f = normal(rng);
        std::memcpy(&u, &f, 4);
      }
    }
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x7fffffu)) u &= 0xff800000u;  // no NaN inputs
    std::memcpy(&v[i], &u, 4);
  }
  return v;
}

// wgx_bf16_kernel's body for every row of x [rows, K] (ldx = K).
static std::vector<uint16_t> wgx(const std::vector<float>& x, int64_t rows, int64_t K) {
  std::vector<uint16_t> xb(size_t(rows * K));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < K / 8; ++j) {
      const float* lo = &x[size_t(r * K + 8 * j)];
      const float* hi = lo + 4;
      const uint32_t v[4] = {wg_pack_bf16x2(lo[0], hi[0]), wg_pack_bf16x2(lo[1], hi[1]),
                             wg_pack_bf16x2(lo[2], hi[2]), wg_pack_bf16x2(lo[3], hi[3])};
      std::memcpy(&xb[size_t(r * K + 8 * j)], v, 16);
    }
  return xb;
}

static void check_wgx(const std::vector<float>& x, const std::vector<uint16_t>& xb, int64_t rows, int64_t K) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t p = 0; p < K; ++p) {
      const int64_t k = (p & ~int64_t(63)) | wg_phys_k(int(p & 63));  // Xb position p holds X's wg_phys_k(p)
      expect(xb[size_t(r * K + p)] == rne(x[size_t(r * K + k)]), "wgx: Xb != rne(X[wg_phys_k])", long(r), long(p));
    }
}

static bool check_positions() {
  const int before = failures;
  for (int p = 0; p < 64; ++p) expect(wg_xb_pos(wg_phys_k(p)) == p, "wg_xb_pos(wg_phys_k(p)) != p", p, 0);
  for (int64_t k = 0; k < 4096; ++k) {
    const int64_t p = wg_xb_pos(k);
    expect(p / 8 == k / 8 && p >= 0, "wg_xb_pos leaves the block of 8", long(k), long(p));
    expect(((p & ~int64_t(63)) | wg_phys_k(int(p & 63))) == k, "wg_phys_k(wg_xb_pos(k)) != k", long(k), long(p));
  }
  std::printf("%s positions\n", failures == before ? "ok  " : "FAIL");
  return failures == before;
}

// wg_store_gated with a.yb: consumer warpgroup cw, warp w4, lane (g = lane/4, c = lane%4) of a CTA on the
// tile (row0, rows) x (n0: 128 outputs) stores v(row0 + r, o) for r = 8j + 2c + e < rows, o = o0 + 8h < N,
// o0 = n0 + 16*w4 + g + cw*64, at yb[(row0 + r) * N + wg_xb_pos(o)] as wg_bf16(v).
template <int BM>
static bool run_gated(int64_t M, int64_t N, std::mt19937& rng) {
  const int before = failures;
  const std::vector<float> y = values(size_t(M * N), rng);  // the F32 values the epilogue computes
  const std::vector<uint16_t> ref = wgx(y, M, N);
  check_wgx(y, ref, M, N);
  std::vector<uint16_t> yb(size_t(M * N), 0xdead);
  std::vector<int> writes(size_t(M * N), 0);
  for (int64_t row0 = 0; row0 < M; row0 += BM) {
    const int64_t rows = std::min<int64_t>(BM, M - row0);
    for (int64_t n0 = 0; n0 < N; n0 += WG_BN / 2)
      for (int cw = 0; cw < 2; ++cw)
        for (int w4 = 0; w4 < 4; ++w4)
          for (int lane = 0; lane < 32; ++lane) {
            const int g = lane >> 2, c = lane & 3;
            const int64_t o0 = n0 + 16 * w4 + g + cw * 64;
            for (int j = 0; j < BM / 8; ++j)
              for (int e = 0; e < 2; ++e) {
                const int r = 8 * j + 2 * c + e;
                if (r >= rows) continue;
                for (int h = 0; h < 2; ++h) {
                  const int64_t o = o0 + 8 * h;
                  if (o >= N) continue;
                  const size_t at = size_t((row0 + r) * N + wg_xb_pos(o));
                  yb[at] = wg_bf16(y[size_t((row0 + r) * N + o)]);
                  ++writes[at];
                }
              }
          }
  }
  for (size_t i = 0; i < yb.size(); ++i) {
    expect(writes[i] == 1, "gated: element not written exactly once", long(i), writes[i]);
    expect(yb[i] == ref[i], "gated: yb != wgx", long(i), long(yb[i]) << 16 | ref[i]);
  }
  std::printf("%s gated BM %d, M %ld, N %ld\n", failures == before ? "ok  " : "FAIL", BM, long(M), long(N));
  return failures == before;
}

// gated_rms_norm_xb over head rows [T*heads, D]: row i, thread j stores {pack(v[8j+c], v[8j+c+4]), c = 0..3}
// at xb[i*D + 8j]; also each element sits at wg_xb_pos of its column in [T, heads*D].
static bool run_norm(int64_t T, int64_t heads, int64_t D, std::mt19937& rng) {
  const int before = failures;
  const int64_t K = heads * D;
  const std::vector<float> y = values(size_t(T * K), rng);
  const std::vector<uint16_t> ref = wgx(y, T, K);
  std::vector<uint16_t> xb(size_t(T * K), 0xdead);
  for (int64_t i = 0; i < T * heads; ++i)
    for (int64_t j = 0; j < D / 8; ++j) {
      const float* v = &y[size_t(i * D + 8 * j)];
      const uint32_t q[4] = {wg_pack_bf16x2(v[0], v[4]), wg_pack_bf16x2(v[1], v[5]), wg_pack_bf16x2(v[2], v[6]),
                             wg_pack_bf16x2(v[3], v[7])};
      std::memcpy(&xb[size_t(i * D + 8 * j)], q, 16);
    }
  for (size_t i = 0; i < xb.size(); ++i) expect(xb[i] == ref[i], "norm: xb != wgx", long(i), long(xb[i]));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k)
      expect(xb[size_t(t * K + wg_xb_pos(k))] == wg_bf16(y[size_t(t * K + k)]), "norm: X[t, k] not at wg_xb_pos(k)",
             long(t), long(k));
  std::printf("%s norm T %ld, heads %ld, D %ld\n", failures == before ? "ok  " : "FAIL", long(T), long(heads), long(D));
  return failures == before;
}

int main() {
  std::mt19937 rng(7);
  bool ok = check_positions();
  ok &= run_gated<64>(64, 128, rng);
  ok &= run_gated<64>(200, 512, rng);
  ok &= run_gated<128>(300, 512, rng);
  ok &= run_gated<128>(77, 200, rng);  // ragged outputs: the last column tile's outputs past N unstored
  ok &= run_norm(5, 32, 128, rng);
  ok &= run_norm(3, 4, 24, rng);
  std::printf(ok && failures == 0 ? "all passed\n" : "FAILED\n");
  return ok && failures == 0 ? 0 : 1;
}
