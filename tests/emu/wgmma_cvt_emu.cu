// CPU emulator of the converter warpgroup's layout (kernels/linear_wgmma_cvt.cuh) against the register (RS)
// path of the quantized prefill GEMM (kernels/linear_wgmma_tma.cuh). With the headers' own host-callable
// pieces (wgc_convert and its helpers on the SS side; wg_row_base, wg_row_step, wg_out_step, wg_dequant_pair,
// wg_q8_pair, fma_bf16x2, wg_desc on the RS side), per case and k-tile of a K = 256 product:
//   producer: the packed W tile as today's TMA writes it for the RS kernel (row i of R bytes at i*R; GATED:
//      rows 0-127 the gate matrix's, 128-255 the up matrix's, as load_w), and as the converter's TMA writes
//      it (the same box with SWIZZLE_32B / SWIZZLE_64B: address bits 4.. XOR bits 7..);
//   converter: wgc_convert for all 128 threads into an emulated 1024-aligned A stage, each thread's scales
//      and biases taken at (wgc_matrix, wgc_out_row, wgc_group) of its rows; every A stage byte must be
//      written exactly once, and each 16-byte load and store instruction of a warp must be conflict-free
//      (the 8 lanes of every quarter warp on 8 distinct 16-byte bank groups: one wavefront each);
//   RS: every consumer thread's A fragment registers as wg_dequant_half<H> fills them (4-bit: word m of the
//      half's 16 bytes -> register (m%2)*2 + h of step 2H + m/2, nibbles c, c+4; 8-bit: one 16-byte load a
//      step, registers h and 2 + h from words (x, y) and (z, w)), scales of output wg_row_base +
//      wg_out_step (GATED: the up matrix's for h = 1), group (kt*64 + 32 half) >> log2 gs;
//   check, bit for bit, each bf16 of each register (row 16*w4 + g + 8*(reg%2), k 2c + e + 8*(reg/2) of k16
//      step s) against the element the SS wgmma reads through the A descriptor wg_desc(A stage +
//      wgc_a_offset(BM, cw, b)) + 2s (K-major SWIZZLE_128B, as the PTX ISA defines it), and against a scalar
//      dequantization round(s*q + b) of that weight at its physical k (wg_phys_k).
// Cases: BM 64, 128 (NB 2) and 256 (NB 1); plain and GATED (BM 64, 128); groups of 32 (GS32), 64, 128;
// 4- and 8-bit (8-bit plain only, as the kernel). Built with nvcc as host code; prints "ok" per case, exits
// non-zero and prints FAIL on any mismatch.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <set>
#include <vector>

#include "cuda/kernels/linear_wgmma_cvt.cuh"
#include "cuda/kernels/xb_layout.cuh"

#include "emu_common.h"

using namespace lily::cuda;

// d rounded once to bf16 (8 significant bits, ties to even), normal range: the scalar reference.
static uint16_t bf16_of(double d) {
  if (d == 0) return 0;
  int e;
  const double m = std::frexp(d, &e);
  const float f = float(std::ldexp(std::nearbyint(m * 256.0), e - 8));
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t(u >> 16);
}

// The emulated shared memory of wgc_convert: one byte array (A stage at 0, packed stage after it), the
// addresses of every 16-byte access in issue order per thread (to count wavefronts), a write count per byte.
struct HostSmem {
  std::vector<uint8_t>* mem;
  std::vector<int>* writes;
  std::vector<uint32_t>* loads;
  std::vector<uint32_t>* stores;
  uint32_t wst;  // the packed stage's offset: loads at and after it, stores before it
  uint4 ld16(uint32_t a) const {
    uint4 v{};
    loads->push_back(a);
    const bool in = a >= wst && a + 16 <= mem->size() && a % 16 == 0;
    expect(in, "load inside the packed stage, 16-byte aligned (offset)", a, 0);
    if (in) std::memcpy(&v, &(*mem)[a], 16);
    return v;
  }
  void st16(uint32_t a, uint4 v) const {
    stores->push_back(a);
    const bool in = a + 16 <= wst && a % 16 == 0;
    expect(in, "store inside the A stage, 16-byte aligned (offset)", a, 0);
    if (!in) return;
    std::memcpy(&(*mem)[a], &v, 16);
    for (int i = 0; i < 16; ++i) ++(*writes)[a + i];
  }
};

// Wavefronts of one kind of access (acc[t] = thread t's addresses in issue order, the same count for all):
// per instruction, warp and quarter warp, the most distinct 16-byte addresses on one 16-byte bank group.
static long wavefronts(const std::vector<std::vector<uint32_t>>& acc, long& ideal) {
  long n = 0;
  ideal = 0;
  for (size_t ins = 0; ins < acc[0].size(); ++ins)
    for (int q = 0; q < WGC_THREADS / 8; ++q) {
      std::set<uint32_t> in_group[8];
      for (int l = 0; l < 8; ++l) {
        const uint32_t a = acc[8 * q + l][ins];
        in_group[(a >> 4) & 7].insert(a >> 4);
      }
      size_t worst = 0;
      for (auto& g : in_group) worst = std::max(worst, g.size());
      n += long(worst), ++ideal;
    }
  return n;
}

// Element (row, k) of a K-major SWIZZLE_128B operand of a k16 wgmma read through descriptor d, as bits.
static uint16_t desc_elem(const std::vector<uint8_t>& smem, uint64_t d, int row, int k) {
  const uint32_t start = uint32_t(d & 0x3FFF) << 4, sbo = uint32_t((d >> 32) & 0x3FFF) << 4;
  expect((d >> 62) == 1 && sbo == 1024, "descriptor layout / SBO", double(d >> 62), sbo);
  const uint32_t addr = start + (row / 8) * sbo + (row % 8) * 128 + 2 * k;
  uint16_t v;
  std::memcpy(&v, &smem[addr ^ (((addr >> 7) & 7) << 4)], 2);
  return v;
}

template <int BM, bool GATED, bool GS32, int BITS>
static void run_case(int gs) {
  constexpr int K = 256, NK = K / WG_BK, NB = wg_blocks(BM), R = tma_w_row_bytes(BITS), KW = WG_BK * BITS / 32;
  constexpr int ROWS = wg_rows(BM), MROWS = GATED ? ROWS / 2 : ROWS, NMAT = GATED ? 2 : 1, WPR = K * BITS / 32;
  const int gshift = gs == 32 ? 5 : gs == 64 ? 6 : 7, gpr = K / gs, f0 = failures;
  std::mt19937 rng(BM * 1000 + gs * 10 + BITS + GATED);
  std::uniform_real_distribution<float> U(-1.f, 1.f);
  // matrix [NMAT][MROWS] rows of WPR words, scales and biases [NMAT][MROWS][gpr]
  std::vector<uint32_t> W(size_t(NMAT) * MROWS * WPR);
  for (auto& w : W) w = rng();
  std::vector<uint16_t> S(size_t(NMAT) * MROWS * gpr), B(S.size());
  for (size_t i = 0; i < S.size(); ++i)
    S[i] = f_to_bf16(BITS == 4 ? 0.02 + 0.01 * U(rng) : 0.002 + 0.001 * U(rng)), B[i] = f_to_bf16(-0.2 + 0.05 * U(rng));
  auto sb = [&](int mat, int out, uint32_t grp) { return size_t(mat * MROWS + out) * gpr + grp; };
  auto q_at = [&](int mat, int out, int k) {  // the packed weight at physical k of the row
    const uint32_t w = W[size_t(mat * MROWS + out) * WPR + k * BITS / 32];
    return int((w >> (BITS * (k % (32 / BITS)))) & ((1u << BITS) - 1));
  };
  const uint32_t AST = 0, WST = wgc_a_bytes(BM);  // both 1024-aligned
  std::vector<uint8_t> smem(WST + tma_w_bytes(BITS, BM)), rs_stage(tma_w_bytes(BITS, BM));
  long values = 0, bad_ss = 0, bad_ref = 0, st_wf = 0, st_ideal = 0, ld_wf = 0, ld_ideal = 0;
  for (int kt = 0; kt < NK; ++kt) {
    // producer: stage row i = row (GATED: i % 128) of matrix (GATED: i / 128), its k-tile's KW words
    for (int i = 0; i < ROWS; ++i) {
      const int mat = GATED ? i / 128 : 0, out = GATED ? i % 128 : i;
      const uint8_t* src = reinterpret_cast<const uint8_t*>(&W[size_t(mat * MROWS + out) * WPR + kt * KW]);
      std::memcpy(&rs_stage[i * R], src, R);  // the RS kernel's TMA: no swizzle
      for (int o = 0; o < R; o += 16) {       // the converter's: SWIZZLE_{R}B on the stage address
        const uint32_t x = uint32_t(i * R + o), span = R / 16 - 1;
        std::memcpy(&smem[WST + (x ^ (((x >> 7) & span) << 4))], src + o, 16);
      }
    }
    // converter: all 128 threads
    std::vector<int> writes(smem.size(), 0);
    std::vector<std::vector<uint32_t>> lds(WGC_THREADS), sts(WGC_THREADS);
    for (int t = 0; t < WGC_THREADS; ++t) {
      WgcScales<GS32, wgc_rows(BM)> s;
      for (int i = 0; i < wgc_rows(BM); ++i)
        for (int h = 0; h < (GS32 ? 2 : 1); ++h) {
          const int r = wgc_stage_row(GATED, wgc_a_row(t, i), NB);
          const size_t at = sb(wgc_matrix(GATED, r), wgc_out_row(GATED, r), wgc_group(kt, 4 * h, gshift));
          s.scale[i][h] = S[at], s.bias[i][h] = B[at];
        }
      const HostSmem hm{&smem, &writes, &lds[t], &sts[t], WST};
      wgc_convert<BM, GS32, GATED, BITS>(hm, WST, AST, t, s);
    }
    for (uint32_t i = 0; i < smem.size(); ++i)
      if (writes[i] != (i < WST ? 1 : 0)) {
        expect(false, "A stage byte written once, nothing else (offset, writes)", i, writes[i]);
        break;
      }
    for (auto* acc : {&lds, &sts})
      for (auto& v : *acc) expect(v.size() == (*acc)[0].size(), "same instruction count on every thread", v.size(), 0);
    long i0, i1;
    st_wf += wavefronts(sts, i0), st_ideal += i0;
    ld_wf += wavefronts(lds, i1), ld_ideal += i1;
    // RS: every consumer thread's registers, against the SS descriptor's element and the scalar weight
    for (int cw = 0; cw < TMA_CONSUMER_WGS; ++cw)
      for (int ct = 0; ct < 128; ++ct) {
        const int w4 = ct >> 5, lane = ct & 31, g = lane >> 2, c = lane & 3;
        const int rbase = wg_row_base(GATED, cw, w4, g, NB);
        for (int b = 0; b < NB; ++b) {
          const uint64_t ad = wg_desc(AST + wgc_a_offset(BM, cw, b));
          for (int H = 0; H < 2; ++H) {
            uint32_t A[2][4];  // wg_dequant_half<H>'s registers of block b: [step in the half][reg]
            for (int h = 0; h < 2; ++h) {
              const int row = rbase + wg_row_step(GATED, b, h), mat = GATED ? h : 0;
              const int out = rbase + wg_out_step(GATED, b, h);
              const size_t at = sb(mat, out, uint32_t(kt * WG_BK + (GS32 ? H : 0) * 32) >> gshift);
              const uint32_t s2 = S[at] | uint32_t(S[at]) << 16, b2 = B[at] | uint32_t(B[at]) << 16;
              uint32_t w[8];
              std::memcpy(w, &rs_stage[row * R + (BITS == 4 ? 16 : 32) * H], BITS == 4 ? 16 : 32);
              if (BITS == 4) {
                for (int m = 0; m < 4; ++m) A[m >> 1][(m & 1) * 2 + h] = wg_dequant_pair(w[m] >> (4 * c), s2, b2);
              } else {
                for (int st = 0; st < 2; ++st) {
                  const uint32_t* x = w + 4 * st;
                  A[st][h] = fma_bf16x2(wg_q8_pair(x[0], x[1], wg_q8_sel(c)), s2, b2);
                  A[st][2 + h] = fma_bf16x2(wg_q8_pair(x[2], x[3], wg_q8_sel(c)), s2, b2);
                }
              }
              // the scalar weight of every element of this row's registers
              for (int st = 0; st < 2; ++st)
                for (int hk = 0; hk < 2; ++hk)
                  for (int e = 0; e < 2; ++e) {
                    const int lk = 16 * (2 * H + st) + 8 * hk + 2 * c + e, pk = kt * WG_BK + wg_phys_k(lk);
                    const double ref = double(bf16_to_f(S[at])) * q_at(mat, out, pk) + bf16_to_f(B[at]);
                    const uint16_t v = uint16_t(A[st][2 * hk + h] >> (16 * e));
                    bad_ref += v != bf16_of(ref);
                    expect(v == bf16_of(ref), "RS register = round(s*q + b) (stage row, logical k)", row, lk);
                  }
            }
            for (int st = 0; st < 2; ++st)
              for (int reg = 0; reg < 4; ++reg)
                for (int e = 0; e < 2; ++e) {
                  const int m = 16 * w4 + g + 8 * (reg & 1), k = 2 * c + e + 8 * (reg >> 1), step = 2 * H + st;
                  const uint16_t ss = desc_elem(smem, ad + 2 * step, m, k), rs = uint16_t(A[st][reg] >> (16 * e));
                  ++values, bad_ss += ss != rs;
                  expect(ss == rs, "SS element = RS register (A row, k of the k-tile)",
                         wgc_a_offset(BM, cw, b) / 128 + m, 16 * step + k);
                }
          }
        }
      }
  }
  expect(st_wf == st_ideal, "converter stores conflict-free (wavefronts, ideal)", st_wf, st_ideal);
  expect(ld_wf == ld_ideal, "converter loads conflict-free (wavefronts, ideal)", ld_wf, ld_ideal);
  std::printf("%s %d-bit BM %3d %-5s gs %3d: %ld A values, %ld SS != RS, %ld RS != round(s*q+b); "
              "store / load wavefronts %ld / %ld (ideal %ld / %ld)\n",
              failures == f0 ? "ok  " : "FAIL", BITS, BM, GATED ? "GATED" : "plain", gs, values, bad_ss, bad_ref, st_wf,
              ld_wf, st_ideal, ld_ideal);
}

// What the swizzled packed stage saves: a quarter warp's loads of 8 consecutive unswizzled rows (r*R + 16q).
static void unswizzled_note() {
  for (int bits : {4, 8}) {
    const int R = tma_w_row_bytes(bits);
    std::set<int> groups;
    for (int r = 0; r < 8; ++r) groups.insert(((r * R) >> 4) & 7);
    std::printf("note: unswizzled %d-bit rows: a quarter warp's 16-byte loads on %zu bank groups (%zu-way)\n", bits,
                groups.size(), 8 / groups.size());
  }
}

template <int BM, bool GATED, int BITS>
static void run_groups() {
  run_case<BM, GATED, true, BITS>(32);
  run_case<BM, GATED, false, BITS>(64);
  run_case<BM, GATED, false, BITS>(128);
}

int main() {
  run_groups<64, false, 4>();
  run_groups<128, false, 4>();
  run_groups<256, false, 4>();
  run_groups<64, true, 4>();
  run_groups<128, true, 4>();
  run_groups<64, false, 8>();
  run_groups<128, false, 8>();
  run_groups<256, false, 8>();
  unswizzled_note();
  if (failures) {
    std::printf("FAIL: %d mismatches\n", failures);
    return 1;
  }
  std::printf("all passed\n");
  return 0;
}
