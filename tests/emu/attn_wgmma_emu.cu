// CPU emulator of the wgmma prefill attention's data layout (kernels/attention_wgmma.cuh): with the kernel
// header's own host-callable pieces (shared-memory offsets, awg_qk_desc, awg_v_desc0, awg_v_desc, awg_cta,
// awg_key_tiles, awg_tail_row, awg_tile_crosses, awg_acc_row / awg_acc_col, and the per-thread online
// softmax awg_mask, awg_row_max, awg_exp, awg_pack_p) it runs every CTA of a small problem
// (4 query heads, 2 KV heads, D 256) over an emulated shared memory, one key tile at a time (the
// pipeline's order and mbarriers are not emulated: the GPU run checks those):
//   TMA:    the producer's boxes {64 dims, 64 rows} (Q at (h*256 + 64 j, t0 + 64 cw), K and V at
//           (kvh*256 + 64 j, 64 i)) written as cp.async.bulk.tensor with SWIZZLE_128B writes them
//           (address row*128 + 2*dim, then bits 4-6 XOR bits 7-9), rows past the tensor zero; the box
//           count x AWG_BOX_BYTES equals the expect_tx byte counts; the V tile past pos0 + T zeroed from
//           awg_tail_row on (the cache rows there are NaN here);
//   S:      m64n64k16 wgmma read through the kernel's K-major descriptors as the PTX ISA defines the
//           128B-swizzle K-major layout (start << 4, 8-row groups SBO apart, row % 8 at + 128, element
//           k at + 2k, then the XOR);
//   P V:    m64n256k16 with A from the threads' registers as the PTX A fragment places them (thread
//           32 (row / 16) + 4 (row % 8) + (k % 8) / 2, register (row % 16) / 8 + 2 (k / 8), half k % 2)
//           and B read through awg_v_desc as the MN-major 128B-swizzle layout (element (k, n) at start +
//           (n / 64) LBO + (k / 8) SBO + (k % 8) 128 + 2 (n % 64), then the XOR);
//   both:   accumulators at the PTX m64nN f32 fragment positions (thread t: row 16 (t / 32) +
//           (t % 32) / 4 + 8 ((i / 2) % 2), column 8 (i / 4) + 2 (t % 4) + i % 2; stated here
//           independently of awg_acc_*, which are checked against it);
//   store:  the epilogue's rows and columns, inside T.
// Then the pipeline protocol (proto::): the producer, both consumer warpgroups and the TMA engine as
// actors running the kernel's operations in its order over emulated mbarriers, under random schedules
// (a deadlock the GPU would hang on shows here).
// Checks every output stored exactly once, finite, and within 1e-2 x max |o| of an fp64 reference on the
// same bf16 q, k, v (the kernel rounds p to bf16 too), and that tiles awg_tile_crosses skips hold no
// masked key. Cases: ragged T and pos0 (a V tile past pos0 + T, a partial warpgroup, a warpgroup with
// no rows, pos0 not a multiple of 64). Built with nvcc as host code; exits non-zero and prints FAIL on
// any mismatch.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <vector>

#include "cuda/kernels/attention_wgmma.cuh"

#include "emu_common.h"

using namespace lily::cuda;
using namespace lily::cuda::attn;

constexpr int NH = 4, NKV = 2, D = AWG_D;

static uint32_t swizzle128(uint32_t addr) { return addr ^ (((addr >> 7) & 7) << 4); }

// TMA box {64 cols, 64 rows} of the bf16 tensor t [rows, cols] at (c0, r0) into smem at dst; returns bytes.
static int tma_box(std::vector<uint8_t>& smem, uint32_t dst, const std::vector<uint16_t>& t, int64_t rows,
                   int64_t cols, int64_t c0, int64_t r0) {
  for (int i = 0; i < 64; ++i)
    for (int k = 0; k < 64; ++k) {
      const int64_t r = r0 + i, c = c0 + k;
      const uint16_t v = r < rows && c < cols ? t[size_t(r * cols + c)] : 0;
      std::memcpy(&smem[swizzle128(dst + uint32_t(i * 128 + 2 * k))], &v, 2);
    }
  return 64 * 64 * 2;
}

static float smem_bf16(const std::vector<uint8_t>& smem, uint32_t addr) {
  uint16_t v;
  std::memcpy(&v, &smem[swizzle128(addr)], 2);
  return bf16_to_f(v);
}
// Element (row, k) of a K-major SWIZZLE_128B operand read through descriptor d.
static float kmajor_elem(const std::vector<uint8_t>& smem, uint64_t d, int row, int k) {
  const uint32_t start = uint32_t(d & 0x3FFF) << 4, sbo = uint32_t((d >> 32) & 0x3FFF) << 4;
  return smem_bf16(smem, start + (row / 8) * sbo + (row % 8) * 128 + 2 * k);
}
// Element (k, n) of an MN-major SWIZZLE_128B B operand read through descriptor d.
static float mnmajor_elem(const std::vector<uint8_t>& smem, uint64_t d, int k, int n) {
  const uint32_t start = uint32_t(d & 0x3FFF) << 4, lbo = uint32_t((d >> 16) & 0x3FFF) << 4,
                 sbo = uint32_t((d >> 32) & 0x3FFF) << 4;
  return smem_bf16(smem, start + (n / 64) * lbo + (k / 8) * sbo + (k % 8) * 128 + 2 * (n % 64));
}
static int ptx_row(int t, int i) { return 16 * (t / 32) + (t % 32) / 4 + 8 * ((i / 2) % 2); }
static int ptx_col(int t, int i) { return 8 * (i / 4) + 2 * (t % 4) + i % 2; }

static bool run(int T, int pos0, int max_t, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  const int64_t qcols = int64_t(NH) * D, kvcols = int64_t(NKV) * D;
  std::vector<uint16_t> qb(size_t(T * qcols)), k(size_t(max_t * kvcols)), v(size_t(max_t * kvcols));
  for (auto& x : qb) x = f_to_bf16(2.f * u(rng));
  for (size_t i = 0; i < k.size(); ++i) {
    const bool seen = int64_t(i) < int64_t(pos0 + T) * kvcols;  // rows past pos0 + T: NaN (never written)
    k[i] = seen ? f_to_bf16(u(rng)) : 0xFFFF;
    v[i] = seen ? f_to_bf16(u(rng)) : 0xFFFF;
  }
  const float scale_log2 = float(1.4426950408889634 / 16.0);
  std::vector<float> o(size_t(T * qcols), NAN);
  std::vector<int> stores(o.size(), 0);
  std::vector<uint8_t> smem(static_cast<size_t>(AWG_BAR_OFF));
  expect(4 * AWG_BOX_BYTES == AWG_TILE_BYTES && 8 * AWG_BOX_BYTES == AWG_Q_BYTES, "expect_tx byte counts", 0, 0);

  const int ctas = awg_q_tiles(T) * NH;
  int skipped_tiles = 0, tail_tiles = 0;
  for (int b = 0; b < ctas; ++b) {
    const AwgCta cta = awg_cta(b, T, NH);
    const int t0 = cta.q_tile * AWG_ROWS, kvh = cta.h / (NH / NKV);
    const int n_tiles = awg_key_tiles(pos0, std::min(t0 + AWG_ROWS, T));
    for (int cw = 0; cw < (t0 + 64 < T ? 2 : 1); ++cw)  // the warpgroups that have rows
      for (int j = 0; j < 4; ++j) tma_box(smem, awg_q_off(cw, j), qb, T, qcols, cta.h * D + 64 * j, t0 + 64 * cw);
    // Per consumer warpgroup and thread: O, running max and sum.
    std::vector<float> acc(size_t(2 * 128 * 128), 0.f), m(2 * 128 * 2, -INFINITY), l(2 * 128 * 2, 0.f);
    for (int i = 0; i < n_tiles; ++i) {
      const int ks = awg_k_stage(i), vs = awg_v_stage(i);
      for (int j = 0; j < 4; ++j) {
        tma_box(smem, awg_k_off(ks, j), k, max_t, kvcols, kvh * D + 64 * j, 64 * i);
        tma_box(smem, awg_v_off(vs) + j * AWG_BOX_BYTES, v, max_t, kvcols, kvh * D + 64 * j, 64 * i);
      }
      const int tail = awg_tail_row(pos0, T, i);
      expect(tail >= 1 && tail <= 64 && (tail < 64) == (64 * i + 64 > pos0 + T), "tail row", i, tail);
      if (tail < 64) {
        ++tail_tiles;
        for (int x = tail * 8; x < 64 * 8; ++x)
          for (int j = 0; j < 4; ++j) std::memset(&smem[awg_v_off(vs) + j * AWG_BOX_BYTES + 16 * x], 0, 16);
      }
      for (int cw = 0; cw < 2; ++cw) {
        const int row0 = t0 + 64 * cw;
        const int my_tiles = row0 < T ? awg_key_tiles(pos0, std::min(row0 + 64, T)) : 0;
        if (i >= my_tiles) {  // the kernel skips it: no row of the warpgroup may see a key of it
          ++skipped_tiles;
          for (int r = row0; r < std::min(row0 + 64, T); ++r) expect(64 * i > pos0 + r, "skipped tile visible", i, r);
          continue;
        }
        const bool crosses = awg_tile_crosses(i, pos0 + row0);
        if (!crosses)
          for (int r = row0; r < std::min(row0 + 64, T); ++r)
            expect(64 * i + 63 <= pos0 + r, "uncrossed tile has a masked key", i, r);
        float sc[128][32], mx[128][2], red[128][2];
        uint32_t pa[128][4][4];
        for (int t = 0; t < 128; ++t) {
          for (int e = 0; e < 32; ++e) {  // S = Q K^T through the kernel's descriptors
            float sum = 0.f;
            for (int j = 0; j < 4; ++j)
              for (int k16 = 0; k16 < 4; ++k16) {
                const uint64_t qd = awg_qk_desc(wg_desc(awg_q_off(cw, 0)), j, k16),
                               kd = awg_qk_desc(wg_desc(awg_k_off(ks, 0)), j, k16);
                for (int kx = 0; kx < 16; ++kx)
                  sum += kmajor_elem(smem, qd, ptx_row(t, e), kx) * kmajor_elem(smem, kd, ptx_col(t, e), kx);
              }
            sc[t][e] = sum;
          }
          awg_mask(sc[t], t, i, pos0 + row0 + awg_acc_row(t, 0), crosses);
          awg_row_max(sc[t], mx[t]);
        }
        for (int t = 0; t < 128; ++t) {  // the quad's shuffles
          float q[2] = {mx[t][0], mx[t][1]};
          for (int x = 1; x < 4; ++x)
            for (int r = 0; r < 2; ++r) q[r] = std::max(q[r], mx[t ^ x][r]);
          red[t][0] = q[0], red[t][1] = q[1];
        }
        for (int t = 0; t < 128; ++t) {
          float mm[2], ll[2], al[2];
          for (int r = 0; r < 2; ++r) mm[r] = m[(cw * 128 + t) * 2 + r], ll[r] = l[(cw * 128 + t) * 2 + r];
          awg_exp(sc[t], red[t], scale_log2, mm, ll, al);
          for (int r = 0; r < 2; ++r) m[(cw * 128 + t) * 2 + r] = mm[r], l[(cw * 128 + t) * 2 + r] = ll[r];
          for (int x = 0; x < 128; ++x) acc[size_t((cw * 128 + t) * 128 + x)] *= al[(x >> 1) & 1];
          awg_pack_p(sc[t], pa[t]);
        }
        for (int t = 0; t < 128; ++t)  // O += P V
          for (int e = 0; e < 128; ++e) {
            const int row = ptx_row(t, e), n = ptx_col(t, e);
            float sum = 0.f;
            for (int kk = 0; kk < 4; ++kk) {
              const uint64_t vd = awg_v_desc(awg_v_desc0(awg_v_off(vs)), kk);
              for (int kx = 0; kx < 16; ++kx) {
                const int holder = 32 * (row / 16) + 4 * (row % 8) + (kx % 8) / 2, reg = (row % 16) / 8 + 2 * (kx / 8);
                const float p = bf16_to_f(uint16_t(pa[holder][kk][reg] >> (16 * (kx % 2))));
                sum += p * mnmajor_elem(smem, vd, kx, n);
              }
            }
            acc[size_t((cw * 128 + t) * 128 + e)] += sum;
          }
      }
    }
    for (int cw = 0; cw < 2; ++cw)  // epilogue
      for (int t = 0; t < 128; ++t) {
        float ll[2];
        for (int r = 0; r < 2; ++r) {
          ll[r] = 0.f;
          for (int x = 0; x < 4; ++x) ll[r] += l[(cw * 128 + ((t & ~3) | x)) * 2 + r];
        }
        for (int e = 0; e < 128; ++e) {
          const int row = t0 + 64 * cw + awg_acc_row(t, e);
          if (row >= T) continue;
          const size_t idx = size_t((int64_t(row) * NH + cta.h) * D + awg_acc_col(t, e));
          o[idx] = acc[size_t((cw * 128 + t) * 128 + e)] / ll[(e >> 1) & 1];
          ++stores[idx];
        }
      }
  }

  // fp64 reference on the same bf16 values.
  double omax = 0, err = 0;
  int bad = 0;
  std::vector<double> sref(size_t(pos0 + T)), ref(D);
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < NH; ++h) {
      const int kvh = h / (NH / NKV), keys = pos0 + t + 1;
      double mxv = -INFINITY, sum = 0;
      for (int j = 0; j < keys; ++j) {
        double d = 0;
        for (int e = 0; e < D; ++e)
          d += double(bf16_to_f(qb[size_t((int64_t(t) * NH + h) * D + e)])) *
               bf16_to_f(k[size_t((int64_t(j) * NKV + kvh) * D + e)]);
        sref[size_t(j)] = d / 16.0;
        mxv = std::max(mxv, sref[size_t(j)]);
      }
      std::fill(ref.begin(), ref.end(), 0.0);
      for (int j = 0; j < keys; ++j) {
        const double p = std::exp(sref[size_t(j)] - mxv);
        sum += p;
        for (int e = 0; e < D; ++e) ref[size_t(e)] += p * bf16_to_f(v[size_t((int64_t(j) * NKV + kvh) * D + e)]);
      }
      for (int e = 0; e < D; ++e) {
        const size_t idx = size_t((int64_t(t) * NH + h) * D + e);
        const double r = ref[size_t(e)] / sum;
        omax = std::max(omax, std::fabs(r));
        if (stores[idx] != 1 || !std::isfinite(o[idx])) {
          ++bad;
          expect(false, "output stored once, finite (row, col)", t, double(h * D + e));
        } else {
          err = std::max(err, std::fabs(o[idx] - r));
        }
      }
    }
  err /= omax;
  const bool ok = bad == 0 && err <= 1e-2;
  expect(err <= 1e-2, "max |o - ref| / max |ref|", err, 1e-2);
  std::printf("%s T %d, pos0 %d, cache %d rows: err %.2e, %d bad, %d skipped warpgroup tiles, %d tail tiles\n",
              ok ? "ok  " : "BAD ", T, pos0, max_t, err, bad, skipped_tiles, tail_tiles);
  return ok;
}

// ---- The pipeline protocol: producer, two consumer warpgroups and the TMA engine as actors over the
// kernel's mbarriers (count, pending arrivals, transaction bytes, phase parity), each actor's operations
// in the kernel's order, run under random schedules. Checks: no
// deadlock, every tile a consumer reads is the one it expects (zeroed past pos0 + T), no TMA write into
// a stage a consumer is still reading, and every barrier balanced at the end.
namespace proto {

enum Kind { WAIT, ARRIVE, EXPECT_TX, TMA, ZERO, BEGIN_READ, END_READ };
struct Op {
  Kind kind;
  int bar = 0, arg = 0;           // mbarrier offset; parity, arrivals or bytes
  int ring = 0, stage = 0, tile = 0;  // ring 0 = K, 1 = V (TMA, ZERO, reads)
};
struct Mbar {
  int count = 0, pending = 0, tx = 0, phase = 0;  // phase: the parity of the phase in progress
};
struct Stage {
  int tile = -1, readers = 0;
  bool zeroed = false;
};

struct Sim {
  std::map<int, Mbar> bars;
  Stage stages[2][3];
  std::vector<Op> prog[3];  // producer, consumer warpgroups 0 and 1
  size_t pc[3] = {0, 0, 0};
  std::vector<Op> tma_pending;  // issued, not landed
  int pos0 = 0, T = 0;
  bool error = false;

  void fail(const char* what, int a, int b) {
    if (!error) expect(false, what, a, b);
    error = true;
  }
  void complete_tx(int bar, int bytes) {
    Mbar& m = bars[bar];
    m.tx -= bytes;
    maybe_flip(m);
  }
  static void maybe_flip(Mbar& m) {
    if (m.pending == 0 && m.tx == 0) m.phase ^= 1, m.pending = m.count;
  }
  // try_wait.parity: the phase of that parity has completed (a fresh barrier: parity 1 has).
  bool done(int bar, int parity) { return bars[bar].phase != parity; }
  // Runs actor a's next operation if it can; false when it is blocked (or finished).
  bool step(int a) {
    if (pc[a] >= prog[a].size()) return false;
    const Op& op = prog[a][pc[a]];
    switch (op.kind) {
      case WAIT:
        if (!done(op.bar, op.arg)) return false;
        break;
      case ARRIVE: {
        Mbar& m = bars[op.bar];
        m.pending -= op.arg;
        if (m.pending < 0) fail("mbarrier over-arrived (offset, pending)", op.bar, m.pending);
        maybe_flip(m);
        break;
      }
      case EXPECT_TX: {
        Mbar& m = bars[op.bar];
        m.tx += op.arg, m.pending -= 1;
        if (m.pending < 0) fail("mbarrier over-arrived (offset, pending)", op.bar, m.pending);
        maybe_flip(m);
        break;
      }
      case TMA:
        tma_pending.push_back(op);
        break;
      case ZERO: {
        Stage& st = stages[op.ring][op.stage];
        if (st.tile != op.tile || st.readers) fail("zeroing a stage not holding its tile (tile, stage)", op.tile, op.stage);
        st.zeroed = true;
        break;
      }
      case BEGIN_READ: {
        Stage& st = stages[op.ring][op.stage];
        const bool tail = op.ring == 1 && awg_tail_row(pos0, T, op.tile) < AWG_KEYS;
        if (st.tile != op.tile || st.zeroed != tail) fail("consumer read the wrong tile (expected, found)", op.tile, st.tile);
        ++st.readers;
        break;
      }
      case END_READ:
        --stages[op.ring][op.stage].readers;
        break;
    }
    ++pc[a];
    return true;
  }
  // A landed TMA: its tile into the stage (none may be reading it), then its bytes on the mbarrier.
  void land(size_t k) {
    const Op op = tma_pending[k];
    tma_pending.erase(tma_pending.begin() + long(k));
    if (op.ring >= 0) {
      Stage& st = stages[op.ring][op.stage];
      if (st.readers) fail("TMA overwrote a stage being read (tile, stage)", op.tile, op.stage);
      st.tile = op.tile, st.zeroed = false;
    }
    complete_tx(op.bar, op.arg);
  }
};

// The kernel's operations for one CTA (q tile t0), in its order.
static void build(Sim& sm, int T, int pos0, int t0) {
  sm.T = T, sm.pos0 = pos0;
  auto init = [&](int bar, int count) { sm.bars[bar] = Mbar{count, count, 0, 0}; };
  init(awg_bar_q_full(), 1), init(awg_bar_v_tail(), 1);
  for (int s = 0; s < AWG_K_STAGES; ++s) init(awg_bar_full_k(s), 1), init(awg_bar_empty_k(s), 8);
  for (int s = 0; s < AWG_V_STAGES; ++s) init(awg_bar_full_v(s), 1), init(awg_bar_empty_v(s), 8);
  const int n_tiles = awg_key_tiles(pos0, std::min(t0 + AWG_ROWS, T));
  auto& pr = sm.prog[0];
  const int q_wgs = t0 + AWG_WG_ROWS < T ? 2 : 1;
  pr.push_back({EXPECT_TX, awg_bar_q_full(), q_wgs * AWG_TILE_BYTES});
  pr.push_back({TMA, awg_bar_q_full(), q_wgs * AWG_TILE_BYTES, -1});
  for (int i = 0; i < n_tiles; ++i) {
    const int ks = awg_k_stage(i), vs = awg_v_stage(i);
    pr.push_back({WAIT, awg_bar_empty_k(ks), int(awg_k_phase(i) ^ 1)});
    pr.push_back({EXPECT_TX, awg_bar_full_k(ks), AWG_TILE_BYTES});
    pr.push_back({TMA, awg_bar_full_k(ks), AWG_TILE_BYTES, 0, ks, i});
    pr.push_back({WAIT, awg_bar_empty_v(vs), int(awg_v_phase(i) ^ 1)});
    if (awg_tail_row(pos0, T, i) < AWG_KEYS) {
      pr.push_back({EXPECT_TX, awg_bar_v_tail(), AWG_TILE_BYTES});
      pr.push_back({TMA, awg_bar_v_tail(), AWG_TILE_BYTES, 1, vs, i});
      pr.push_back({WAIT, awg_bar_v_tail(), 0});
      pr.push_back({ZERO, 0, 0, 1, vs, i});
      pr.push_back({ARRIVE, awg_bar_full_v(vs), 1});
    } else {
      pr.push_back({EXPECT_TX, awg_bar_full_v(vs), AWG_TILE_BYTES});
      pr.push_back({TMA, awg_bar_full_v(vs), AWG_TILE_BYTES, 1, vs, i});
    }
  }
  for (int cw = 0; cw < 2; ++cw) {
    auto& c = sm.prog[1 + cw];
    const int row0 = t0 + AWG_WG_ROWS * cw;
    const int my = row0 < T ? awg_key_tiles(pos0, std::min(row0 + AWG_WG_ROWS, T)) : 0;
    auto wait_k = [&](int i) { c.push_back({WAIT, awg_bar_full_k(awg_k_stage(i)), int(awg_k_phase(i))}); };
    auto wait_v = [&](int i) { c.push_back({WAIT, awg_bar_full_v(awg_v_stage(i)), int(awg_v_phase(i))}); };
    auto read = [&](int ring, int i, bool begin) {
      c.push_back({begin ? BEGIN_READ : END_READ, 0, 0, ring, ring ? awg_v_stage(i) : awg_k_stage(i), i});
    };
    auto rel_k = [&](int i) { c.push_back({ARRIVE, awg_bar_empty_k(awg_k_stage(i)), 4}); };  // 4 warps
    auto rel_v = [&](int i) { c.push_back({ARRIVE, awg_bar_empty_v(awg_v_stage(i)), 4}); };
    c.push_back({WAIT, awg_bar_q_full(), 0});
    if (my > 0) {
      wait_k(0), read(0, 0, true), read(0, 0, false), rel_k(0);
      for (int i = 1; i < my; ++i) {
        wait_k(i), wait_v(i - 1), read(0, i, true), read(1, i - 1, true);
        read(0, i, false), rel_k(i), read(1, i - 1, false), rel_v(i - 1);
      }
      wait_v(my - 1), read(1, my - 1, true), read(1, my - 1, false), rel_v(my - 1);
    }
    for (int i = my; i < n_tiles; ++i) wait_k(i), wait_v(i), rel_k(i), rel_v(i);
  }
}

// Random schedules of one CTA; false on a deadlock or a failed check.
static bool run_cta(int T, int pos0, int t0, int seeds, std::mt19937& rng) {
  for (int seed = 0; seed < seeds; ++seed) {
    Sim sm;
    build(sm, T, pos0, t0);
    while (!sm.error) {
      // Runnable: actors that can step, and each pending TMA. Pick one at random.
      std::vector<int> choices;
      for (int a = 0; a < 3; ++a) {
        Sim probe = sm;  // an actor is runnable if its next operation proceeds
        if (probe.step(a)) choices.push_back(a);
      }
      for (size_t k = 0; k < sm.tma_pending.size(); ++k) choices.push_back(3 + int(k));
      if (choices.empty()) break;
      const int pick = choices[std::uniform_int_distribution<size_t>(0, choices.size() - 1)(rng)];
      if (pick < 3) sm.step(pick);
      else sm.land(size_t(pick - 3));
    }
    bool finished = sm.tma_pending.empty();
    for (int a = 0; a < 3; ++a) finished &= sm.pc[a] == sm.prog[a].size();
    if (!finished) sm.fail("deadlock (actor pcs: producer, consumer 0)", int(sm.pc[0]), int(sm.pc[1]));
    for (auto& [off, m] : sm.bars)
      if (m.tx != 0 || m.pending != m.count) sm.fail("mbarrier left mid-phase (offset, pending)", off, m.pending);
    if (sm.error) {
      std::printf("BAD  protocol T %d, pos0 %d, t0 %d, seed %d\n", T, pos0, t0, seed);
      return false;
    }
  }
  return true;
}

}  // namespace proto

// Every CTA of a few problems under random schedules.
static bool run_protocol(std::mt19937& rng) {
  struct Case {
    int T, pos0;
  };
  int ctas = 0;
  bool ok = true;
  for (const Case& c : {Case{200, 70}, Case{130, 192}, Case{64, 0}, Case{1000, 77}, Case{300, 2000}})
    for (int q = 0; q < awg_q_tiles(c.T); ++q) {
      ok &= proto::run_cta(c.T, c.pos0, q * AWG_ROWS, 20, rng);
      ++ctas;
    }
  std::printf("%s protocol: %d CTAs of 20 random schedules each\n", ok ? "ok  " : "BAD ", ctas);
  return ok;
}

int main() {
  for (int t = 0; t < 128; ++t)  // the kernel's accumulator mapping is the PTX fragment's
    for (int i = 0; i < 128; ++i)
      expect(awg_acc_row(t, i) == ptx_row(t, i) && awg_acc_col(t, i) == ptx_col(t, i), "awg_acc_* (t, i)", t, i);
  for (int b = 0; b < 4 * NH; ++b) {  // heaviest q tiles first, all heads of a tile together
    const AwgCta c = awg_cta(b, 4 * AWG_ROWS, NH);
    expect(c.q_tile == 3 - b / NH && c.h == b % NH, "awg_cta", b, c.q_tile);
  }
  const uint64_t vd = awg_v_desc(awg_v_desc0(AWG_V_OFF), 1);
  expect((vd & 0x3FFF) == uint64_t((AWG_V_OFF + 2048) >> 4) && ((vd >> 16) & 0x3FFF) == 8192 >> 4 &&
             ((vd >> 32) & 0x3FFF) == 1024 >> 4 && (vd >> 62) == 1 && ((vd >> 49) & 7) == 0,
         "awg_v_desc fields", double(vd & 0x3FFF), double((vd >> 16) & 0x3FFF));
  {  // the mbarriers: distinct 8-byte slots after the rings, inside the shared memory
    std::vector<int> bars = {awg_bar_q_full(), awg_bar_v_tail()};
    for (int s = 0; s < AWG_K_STAGES; ++s) bars.push_back(awg_bar_full_k(s)), bars.push_back(awg_bar_empty_k(s));
    for (int s = 0; s < AWG_V_STAGES; ++s) bars.push_back(awg_bar_full_v(s)), bars.push_back(awg_bar_empty_v(s));
    std::sort(bars.begin(), bars.end());
    expect(int(bars.size()) == AWG_NUM_BARS && bars.front() == AWG_BAR_OFF &&
               bars.back() + 8 + 1024 <= AWG_SMEM_BYTES && std::adjacent_find(bars.begin(), bars.end()) == bars.end(),
           "mbarrier slots", bars.front(), bars.back());
    for (int i = 0; i + 1 < int(bars.size()); ++i) expect(bars[i + 1] - bars[i] == 8, "mbarrier slot spacing", i, bars[i]);
  }
  std::mt19937 rng(13);
  bool ok = run(200, 70, 320, rng);  // pos0 + T = 270: a V tile past it; the last warpgroup has 8 rows
  ok &= run(130, 192, 384, rng);     // the last CTA's warpgroup 1 has no rows; pos0 a multiple of 64
  ok &= run(64, 0, 64, rng);         // one tile, the cache exactly full (no tail, warpgroup 1 empty)
  ok &= run(70, 62, 192, rng);       // first row at position 62: a tile ending one key past it
  ok &= run(70, 63, 192, rng);       // first row at position 63: the tile ends on it (no mask)
  ok &= run_protocol(rng);
  std::printf(ok && failures == 0 ? "all passed\n" : "FAILED\n");
  return ok && failures == 0 ? 0 : 1;
}
