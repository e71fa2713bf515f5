// Host helpers shared by the fragment emulators of the bf16-operand kernels (tests/emu/*_emu.cu, one
// translation unit each): a failure counter with the first ten failures printed, bf16 <-> float, and one
// element of wg_dequant_pair (4-bit q of a packed pair -> bf16(scale * q + bias), rounded once).
#pragma once
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
