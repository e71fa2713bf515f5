// Host helpers shared by the fragment emulators of the few-rows kernels (tests/emu/*_emu.cu, one translation
// unit each): a failure counter with the first ten failures printed, bf16 <-> float, and the scalar reference
// product of one 4-bit row (w = s*q + b exact) with one x row rounded to bf16 as the kernels stage it (include
// it after the kernel header: wg_pack_bf16x2).
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
// sum_k (s_g * q_k + b_g) * bf16(x_k) in double over K values of one 4-bit row (8 values a word, groups of gs:
// scale and bias s[k / gs], b[k / gs], w exact as the exact-q kernels use it); mag: sum of the products'
// magnitudes (the tolerance's scale).
static double q4_row_dot(const uint32_t* w, const uint16_t* s, const uint16_t* b, const float* x, int K, int gs,
                         double& mag) {
  double ref = 0;
  mag = 0;
  for (int k = 0; k < K; ++k) {
    const int q = int((w[k / 8] >> (4 * (k % 8))) & 0xF), grp = k / gs;
    const double wv = double(bf16_to_f(s[grp])) * q + double(bf16_to_f(b[grp]));
    const double xv = bf16_to_f(uint16_t(lily::cuda::wg_pack_bf16x2(x[k], 0.f)));
    ref += wv * xv, mag += std::fabs(wv * xv);
  }
  return ref;
}
