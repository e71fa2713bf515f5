// Host helpers shared by the fragment emulators of the bf16-operand kernels (tests/emu/*_emu.cu, one
// translation unit each): a failure counter with the first ten failures printed, bf16 <-> float, and one
// element of wg_dequant_pair (4-bit q of a packed pair -> bf16(scale * q + bias), rounded once), and the
// scalar reference product of one 4-bit row with one x row as the kernels' bf16 operands (include it after
// the kernel header: wg_pack_bf16x2).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>

static int failures = 0;
static void expect(bool ok, const char* what, double a, double b) {
  if (!ok && failures++ < 10) std::printf("FAIL %s (%g, %g)\n", what, a, b);
}

static float bf16_to_f(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// Round to nearest even (through float: the fragments and the reference round alike, which is what is checked).
static uint16_t f_to_bf16(double v) {
  const float f = float(v);
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
// wg_dequant_pair of one element: q bits at 0..3 of qbits (the pair's low half) or 16..19 (high half).
static float dequant(uint32_t qbits, int half, uint16_t s, uint16_t b) {
  const int q = int((qbits >> (16 * half)) & 0xF);
  return bf16_to_f(f_to_bf16(double(bf16_to_f(s)) * q + double(bf16_to_f(b))));
}

// sum_k bf16(s_g * q_k + b_g) * bf16(x_k) in double over K values of one 4-bit row (8 values a word, groups of
// gs: scale and bias s[k / gs], b[k / gs]); mag: sum of the products' magnitudes (the tolerance's scale).
static double q4_row_dot(const uint32_t* w, const uint16_t* s, const uint16_t* b, const float* x, int K, int gs,
                         double& mag) {
  double ref = 0;
  mag = 0;
  for (int k = 0; k < K; ++k) {
    const int q = int((w[k / 8] >> (4 * (k % 8))) & 0xF), grp = k / gs;
    const double wv = bf16_to_f(f_to_bf16(double(bf16_to_f(s[grp])) * q + double(bf16_to_f(b[grp]))));
    const double xv = bf16_to_f(uint16_t(lily::cuda::wg_pack_bf16x2(x[k], 0.f)));
    ref += wv * xv, mag += std::fabs(wv * xv);
  }
  return ref;
}
