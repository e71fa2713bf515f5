// CPU emulator of chain_lab's consumer math (benchmarks/chain_lab_math.cuh): the policies' own step functions
// run for the 32 lanes of a warp (one host thread a lane), with mma.sync m16n8k32 u8 x s8 and m16n8k16 bf16
// emulated from the PTX ISA's fragment tables at each call (the lanes meet at a barrier, every lane's
// registers are assembled into A, B and C, each lane takes its D), then the quad sums, against fp64:
//   for PsDigits<2>, PsDigits<4> (variant a) and PsBf3 (variant b), K = 4096 (two chunk items: the phase's
//   segment index passes the chunk), x over 6 binades, steps of STEP segments (the warp-a-tile loop) and of
//   2 (the 8-warp loop), three seeds: max |y - y64| / max |y64| <= 1e-6 (PsDigits), 5e-6 (PsBf3: its fp32
//   sums carry the 128 offset; each emulated mma rounds once);
//   PsBf3's staged B reads: the 8 lanes of each quarter warp read 16-byte units at distinct bank positions
//   (or the same unit), the zero units included, for every segment and m: conflict-free ld.shared.v4;
//   the timeline's reduction (chain_lab_timeline.h) on synthetic stamps: 8 CTAs x 128 phases with known
//   intervals, each SM's clock64 at its own rate and origin, %globaltimer ticking at 1 us from ~1.7e18 ns:
//   every median within 30 ns of the truth, the fitted clock within 0.1%;
//   part 3 (chain_lab_phase.cuh): the flat dealing's walks (check_flat) and the producers' staging protocol
//   (check_producer_staging: every 64-row block staged once by its last contributor, bytes = staging y whole).
// The staged x is written as the policies' stage() writes it (PsDigits: gemv_mma's mma_block_scale /
// mma_octet_digits / mma_xd_store; PsBf3: store_octet), with the same octet sum tree. Host code only (nvcc,
// -std=c++20); exits non-zero and prints FAIL on any mismatch.
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "../../benchmarks/chain_lab_math.cuh"
#include "../../benchmarks/chain_lab_phase.cuh"
#include "../../benchmarks/chain_lab_timeline.h"

using namespace lily::cuda;
using namespace lily::cuda::lab;

static int failures = 0;

// One warp's mma.sync calls: every lane deposits its registers, the lanes meet, each computes its own D
// from the assembled matrices (double sums, rounded once to the accumulator type), the lanes meet again.
struct EmuMma {
  static inline std::barrier<>* bar = nullptr;
  static inline thread_local int lane = 0;
  static inline uint32_t a[32][4], b[32][2];
  static uint16_t half(uint32_t w, int i) { return uint16_t(w >> (16 * i)); }
  static double bf(uint16_t h) {
    const uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static void s8(int (&c)[4], const uint32_t (&ar)[4], uint32_t b0, uint32_t b1) {
    for (int i = 0; i < 4; ++i) a[lane][i] = ar[i];
    b[lane][0] = b0, b[lane][1] = b1;
    bar->arrive_and_wait();
    int A[16][32], B[32][8];
    for (int l = 0; l < 32; ++l) {
      const int g = l / 4, t = l % 4;
      for (int i = 0; i < 4; ++i) {
        A[g][4 * t + i] = uint8_t(a[l][0] >> (8 * i)), A[g + 8][4 * t + i] = uint8_t(a[l][1] >> (8 * i));
        A[g][16 + 4 * t + i] = uint8_t(a[l][2] >> (8 * i)), A[g + 8][16 + 4 * t + i] = uint8_t(a[l][3] >> (8 * i));
        B[4 * t + i][g] = int8_t(b[l][0] >> (8 * i)), B[16 + 4 * t + i][g] = int8_t(b[l][1] >> (8 * i));
      }
    }
    const int g = lane / 4, t = lane % 4;
    for (int e = 0; e < 4; ++e) {
      const int row = g + (e >= 2 ? 8 : 0), col = 2 * t + (e & 1);
      int64_t d = 0;
      for (int k = 0; k < 32; ++k) d += int64_t(A[row][k]) * B[k][col];
      c[e] += int(d);
    }
    bar->arrive_and_wait();
  }
  static void bf16(float (&d)[4], const uint32_t (&ar)[4], uint32_t b0, uint32_t b1) {
    for (int i = 0; i < 4; ++i) a[lane][i] = ar[i];
    b[lane][0] = b0, b[lane][1] = b1;
    bar->arrive_and_wait();
    double A[16][16], B[16][8];
    for (int l = 0; l < 32; ++l) {
      const int g = l / 4, c = l % 4;
      for (int e = 0; e < 2; ++e) {
        A[g][2 * c + e] = bf(half(a[l][0], e)), A[g + 8][2 * c + e] = bf(half(a[l][1], e));
        A[g][2 * c + 8 + e] = bf(half(a[l][2], e)), A[g + 8][2 * c + 8 + e] = bf(half(a[l][3], e));
        B[2 * c + e][g] = bf(half(b[l][0], e)), B[2 * c + 8 + e][g] = bf(half(b[l][1], e));
      }
    }
    const int g = lane / 4, c = lane % 4;
    for (int e = 0; e < 4; ++e) {
      const int row = g + (e >= 2 ? 8 : 0), col = 2 * c + (e & 1);
      double s = d[e];
      for (int k = 0; k < 16; ++k) s += A[row][k] * B[k][col];
      d[e] = float(s);
    }
    bar->arrive_and_wait();
  }
};

static uint16_t to_bf16(float f) {  // truncation: any BF16 is a valid test scale
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t(u >> 16);
}
static float octet_sum(const float* v) { return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])); }
// The block sum of 8 octet sums as mma_stage_octet's xor tree leaves it in the block's first lane.
static float block_sum(const float* s) {
  float t[8];
  for (int i = 0; i < 8; ++i) t[i] = s[i];
  for (int off = 1; off < 8; off <<= 1) {
    float n[8];
    for (int i = 0; i < 8; ++i) n[i] = t[i] + t[i ^ off];
    for (int i = 0; i < 8; ++i) t[i] = n[i];
  }
  return t[0];
}

// Block u (values v[64]) of x staged as PsDigits stages it (K: the staged vector's length).
static void stage_block_host(const float* v, int u, int K, uint8_t* xs) {
  const auto view = PsDigits<1>::view(xs, K);
  uint2* xd = const_cast<uint2*>(view.xd);
  float *xe = const_cast<float*>(view.xe), *xsum = const_cast<float*>(view.xsum);
  float m = 0.f, s[8];
  for (int k = 0; k < 64; ++k) m = std::fmax(m, std::fabs(v[k]));
  float e;
  const float inv = mma_block_scale(m, e);
  for (int j = 0; j < 8; ++j) {
    float oct[8];
    for (int k = 0; k < 8; ++k) oct[k] = v[8 * j + k];
    uint2 dg[3];
    mma_octet_digits<4>(oct, inv, dg);
    for (int d = 0; d < 3; ++d) mma_xd_store<4>(reinterpret_cast<uint32_t*>(xd), 8 * u + j, d, dg[d]);
    s[j] = octet_sum(oct);
  }
  xe[u] = e, xsum[u] = block_sum(s);
}
template <int S>
static void stage_host(PsDigits<S>*, const std::vector<float>& x, int K, std::vector<uint8_t>& xs) {
  xs.assign(PsDigits<S>::x_bytes(K), 0);
  for (int u = 0; u < K / 64; ++u) stage_block_host(x.data() + 64 * u, u, K, xs.data());
}
static void stage_host(PsBf3*, const std::vector<float>& x, int K, std::vector<uint8_t>& xs) {
  xs.assign(PsBf3::x_bytes(K), 0);
  float* xsum = const_cast<float*>(PsBf3::xsum_of(xs.data(), K));
  for (int u = 0; u < K / 64; ++u) {
    float s[8];
    for (int j = 0; j < 8; ++j) {
      const int o = 8 * u + j;
      float oct[8];
      for (int k = 0; k < 8; ++k) oct[k] = x[8 * o + k];
      PsBf3::store_octet(oct, o, xs.data());
      s[j] = octet_sum(oct);
    }
    xsum[u] = block_sum(s);
  }
}

// One warp over the 16 rows of a K-value tile (items chunk-major), steps of N segments; returns y [16].
template <class M, int N>
static std::vector<float> run_warp(const std::vector<uint8_t>& items, const std::vector<uint8_t>& xs, int K) {
  constexpr int ITEM = PS_ITEM_W + 2 * PS_ITEM_S;
  std::vector<float> part(64);  // [lane][2]
  std::barrier<> bar(32);
  EmuMma::bar = &bar;
  std::vector<std::thread> th;
  for (int lane = 0; lane < 32; ++lane)
    th.emplace_back([&, lane] {
      EmuMma::lane = lane;
      const typename M::Lane ln(lane);
      float acc[2] = {0.f, 0.f};
      for (int h = 0; h < K / PS_CHUNK_VALS; ++h)
        for (int ls = 0; ls < PS_CSEG; ls += N)
          M::template step<N, EmuMma>(ln, items.data() + size_t(h) * ITEM, ls, h * PS_CSEG + ls, xs.data(), K, acc);
      part[2 * lane] = acc[0], part[2 * lane + 1] = acc[1];
    });
  for (auto& t : th) t.join();
  std::vector<float> y(16);
  for (int g = 0; g < 8; ++g) {
    float r0 = 0.f, r1 = 0.f;
    for (int t = 0; t < 4; ++t) r0 += part[2 * (4 * g + t)], r1 += part[2 * (4 * g + t) + 1];
    y[g] = r0, y[g + 8] = r1;
  }
  return y;
}

template <class M, int N>
static void check_case(const char* name, double tol, std::mt19937& rng) {
  const int K = 4096, chunks = K / PS_CHUNK_VALS;
  constexpr int ITEM = PS_ITEM_W + 2 * PS_ITEM_S;
  std::vector<uint8_t> items(size_t(chunks) * ITEM);
  std::uniform_int_distribution<uint32_t> bits;
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> unit(0.f, 1.f);
  for (size_t i = 0; i < items.size(); i += 4) {
    const uint32_t w = bits(rng);
    std::memcpy(&items[i], &w, 4);
  }
  for (int h = 0; h < chunks; ++h)  // scales and biases: BF16 of N(0, 0.01), N(0, 0.05)
    for (int i = 0; i < 2 * PS_ITEM_S / 2; ++i) {
      const uint16_t v = to_bf16(normal(rng) * (i < PS_ITEM_S / 2 ? 0.01f : 0.05f));
      std::memcpy(&items[size_t(h) * ITEM + PS_ITEM_W + 2 * i], &v, 2);
    }
  std::vector<float> x(K);
  for (int k = 0; k < K; ++k) x[k] = normal(rng) * std::exp2(std::floor(6.f * unit(rng)) - 3.f);
  std::vector<uint8_t> xs;
  stage_host(static_cast<M*>(nullptr), x, K, xs);
  const std::vector<float> y = run_warp<M, N>(items, xs, K);
  double err = 0, mx = 0;
  for (int r = 0; r < 16; ++r) {
    double y64 = 0;
    for (int k = 0; k < K; ++k) {
      const uint8_t* it = items.data() + size_t(k / PS_CHUNK_VALS) * ITEM;
      const int kk = k % PS_CHUNK_VALS;
      uint32_t w;
      std::memcpy(&w, it + r * PS_CHUNK_W + kk / 2 / 4 * 4, 4);
      const int q = int(w >> (4 * (kk % 8))) & 15;
      uint16_t s, b;
      std::memcpy(&s, it + PS_ITEM_W + r * PS_CHUNK_G + kk / 64 * 2, 2);
      std::memcpy(&b, it + PS_ITEM_W + PS_ITEM_S + r * PS_CHUNK_G + kk / 64 * 2, 2);
      y64 += (EmuMma::bf(s) * q + EmuMma::bf(b)) * double(x[k]);
    }
    err = std::fmax(err, std::fabs(y[r] - y64)), mx = std::fmax(mx, std::fabs(y64));
  }
  const bool ok = err / mx <= tol;
  if (!ok) ++failures;
  std::printf("%s %s, steps of %d: max |y - y64| / max |y64| = %.2e\n", ok ? "ok  " : "FAIL", name, N, err / mx);
}

// PsBf3's B reads of each quarter warp: distinct 16-byte units at distinct bank positions.
static void check_bf3_banks() {
  bool ok = true;
  for (int seg = 0; seg < 32; ++seg)
    for (int m = 0; m < 4; ++m)
      for (int q = 0; q < 4; ++q) {
        uint32_t unit_at[8];
        bool used[8] = {};
        for (int l = 8 * q; l < 8 * q + 8; ++l) {
          const PsBf3::Lane ln(l);
          const uint32_t u = (ln.xoff + seg * ln.sstride + m * ln.mstride) / 16, pos = u % 8;
          if (used[pos] && unit_at[pos] != u) ok = false;
          used[pos] = true, unit_at[pos] = u;
        }
      }
  if (!ok) ++failures;
  std::printf("%s PsBf3 staged B reads conflict-free per quarter warp\n", ok ? "ok  " : "FAIL");
}

// Synthetic run: phase p of CTA c waits hand-over + 10c ns after the previous phase's last count, then the
// stage, math, store and count intervals of its kind (A or B, + 5c ns each); clock64 of CTA c runs at
// 1.9 + 0.01c GHz from its own origin; %globaltimer = the true time floored to 1 us, plus 1.7e18.
static void check_timeline() {
  const int G = 8, phases = 128;
  const double iv[2][5] = {{700, 900, 3300, 300, 400}, {650, 1300, 1000, 250, 450}};
  std::vector<PsStamp> st(size_t(phases) * G * PS_TL_STAMPS);
  double last = 5e5;
  for (int p = 0; p < phases; ++p) {
    double next = 0;
    for (int c = 0; c < G; ++c) {
      double t = last;
      for (int k = 0; k < PS_TL_STAMPS; ++k) {
        t += iv[p % 2][k] + (k == 0 ? 10.0 * c : 5.0 * c);
        const double ghz = 1.9 + 0.01 * c;
        st[(size_t(p) * G + c) * PS_TL_STAMPS + k] = {1700000000000000000ull + uint64_t(std::floor(t / 1000.0)) * 1000ull,
                                                      uint64_t(1e9 * (c + 1) + t * ghz)};
      }
      next = std::max(next, t);
    }
    last = next;
  }
  const PsTimeline r = ps_timeline(st, phases, G);
  bool ok = std::fabs(r.ghz / 1.94 - 1.0) < 1e-3 && r.step == 1000;  // the upper median CTA: c = 4, 1.94 GHz
  for (int kind = 0; kind < 2; ++kind) {
    for (int k = 0; k < 5; ++k) {  // the median CTA: c = 4 (of 0..7, the upper median)
      const double want = iv[kind][k] + (k == 0 ? 40.0 : 20.0);
      if (std::fabs(r.med[kind][k] - want) > 30.0) ok = false, std::printf("  kind %d interval %d: %.0f, want %.0f\n", kind, k, r.med[kind][k], want);
    }
    double span = 0;  // phase: the last CTA's (c = 7) five intervals
    for (int k = 0; k < 5; ++k) span += iv[kind][k] + (k == 0 ? 70.0 : 35.0);
    if (std::fabs(r.med[kind][5] - span) > 30.0) ok = false, std::printf("  kind %d phase: %.0f, want %.0f\n", kind, r.med[kind][5], span);
  }
  if (!ok) ++failures;
  std::printf("%s timeline from synthetic stamps (fit %.3f GHz, rms %.0f ns, step %llu ns)\n", ok ? "ok  " : "FAIL", r.ghz,
              r.rms, r.step);
}

// PS_FLAT (chain_lab_phase.cuh): for nt = 1..8 tiles of C = 1, 2 chunks, the 8 warps' walks (ps_flat_walk)
// cover every segment of every tile once; each item's slot gets PS_CSEG arrivals; a warp's partials (per tile
// it touches, slot ps_flat_slot) are exactly what the reduction of each tile reads (warps ps_flat_first ..
// ps_flat_last), every slot read was written for that tile, and a phase's items fit the ring where the lab uses
// it (nt C <= PS_SLOTS is checked by chain_lab's host).
static void check_flat() {
  bool ok = true;
  for (int C = 1; C <= 2; ++C)
    for (int nt = 1; nt <= 8; ++nt) {
      const int segs = PS_CSEG * C;  // a tile's
      std::vector<int> cover(size_t(nt) * segs, 0), arrivals(size_t(nt) * C, 0);
      std::vector<int> part_tile(MMA_WARPS * 2, -1);           // [warp][slot]: the tile of the partial
      std::vector<std::vector<int>> part_segs(MMA_WARPS * 2);  // its segments (tile-local)
      for (int w = 0; w < MMA_WARPS; ++w) {
        std::vector<int> cur;
        ps_flat_walk(nt, C, w, [&](int i, int l0, int l1, bool done) {
          if (i < 0 || i >= nt * C || l0 < 0 || l1 > PS_CSEG || l0 >= l1) ok = false;
          arrivals[i] += l1 - l0;
          for (int ls = l0; ls < l1; ++ls) {
            const int seg = (i % C) * PS_CSEG + ls;
            ++cover[size_t(i / C) * segs + seg];
            cur.push_back(seg);
          }
          if (done) {
            const int j = i / C, sl = j == ps_flat_tile_of(nt, C, w) ? 0 : 1;
            if (part_tile[2 * w + sl] != -1) ok = false;  // a slot written twice
            part_tile[2 * w + sl] = j, part_segs[2 * w + sl] = cur, cur.clear();
          }
        });
        if (!cur.empty()) ok = false;  // segments never written to a partial
      }
      for (int v : cover) ok = ok && v == 1;
      for (int a : arrivals) ok = ok && a == PS_CSEG;
      int reads = 0, written = 0;
      for (int t : part_tile) written += t >= 0;
      for (int j = 0; j < nt; ++j) {
        std::vector<int> seen(segs, 0);
        for (int w = ps_flat_first(nt, C, j); w <= ps_flat_last(nt, C, j); ++w) {
          const int sl = ps_flat_slot(nt, C, w, j);
          ++reads;
          if (w < 0 || w >= MMA_WARPS || part_tile[2 * w + sl] != j) {
            ok = false;
            continue;
          }
          for (int seg : part_segs[2 * w + sl]) ++seen[seg];
        }
        for (int v : seen) ok = ok && v == 1;
      }
      if (reads != written) ok = false;
      if (!ok) {
        std::printf("  flat dealing wrong at nt %d, C %d\n", nt, C);
        break;
      }
    }
  if (!ok) ++failures;
  std::printf("%s PS_FLAT: 8 warps' walks cover each segment once, partials = the reduction's reads\n", ok ? "ok  " : "FAIL");
}

// PS_XST (chain_lab_phase.cuh): producers of rows x G CTAs (tiles dealt as the kernel deals them) in a random
// order, each storing its rows, then its warp 0's protocol: blocks wholly its own staged at once, a shared
// block's rows added to its counter, the adder completing 64 stages it (ps_block_* and ps_stage_pick as
// ps_stage_y uses them, lane group k the k-th block of the ballot); a staged octet reads own rows from the
// CTA's copy and the others' from "global" y (NaN until stored: a read before its producer fails). Every block
// staged exactly once, the staged bytes equal staging y whole (stage_host), and the consumers' copy
// (ps_x_units 16-byte units) covers them.
static void check_producer_staging(std::mt19937& rng) {
  bool ok = true;
  const int cases[][2] = {{12352, 132}, {2048, 132}, {4096, 132}, {12352, 114}, {2048, 60}, {1024, 9}};
  for (const auto& cs : cases) {
    const int rows = cs[0], G = cs[1], tiles = rows / 16;
    std::normal_distribution<float> normal(0.f, 1.f);
    std::uniform_real_distribution<float> unit(0.f, 1.f);
    std::vector<float> y(rows), gy(rows, NAN);
    for (float& v : y) v = normal(rng) * std::exp2(std::floor(8.f * unit(rng)) - 4.f);
    std::vector<int> order(G), staged(rows / 64, 0);
    std::vector<unsigned> blk(rows / 64, 0);
    for (int c = 0; c < G; ++c) order[c] = c;
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<uint8_t> ys(PsDigits<1>::x_bytes(rows), 0), ref;
    for (int c : order) {
      const int t0 = int(int64_t(tiles) * c / G), nt = int(int64_t(tiles) * (c + 1) / G) - t0;
      const int r0 = 16 * t0, r1 = r0 + 16 * nt;
      if (nt > 8) ok = false;
      const std::vector<float> own(y.begin() + r0, y.begin() + r1);
      for (int r = r0; r < r1; ++r) gy[r] = y[r];
      const int b0 = ps_block_first(r0), nb = ps_block_count(r0, r1);
      if (nb > 3) ok = false;
      unsigned mine = 0;
      for (int lane = 0; lane < nb; ++lane) {
        const int b = b0 + lane, n = ps_block_rows(r0, r1, b);
        bool last = n == 64;
        if (!last) last = (blk[b] += unsigned(n)) == 64u;
        if (last) mine |= 1u << lane;
      }
      for (int k = 0; k < 4; ++k) {
        const int pick = ps_stage_pick(mine, nb, k);
        if (pick < 0) continue;
        const int b = b0 + pick;
        ++staged[b];
        float v[64];
        for (int j = 0; j < 8; ++j) {
          const int row = 64 * b + 8 * j;
          const bool is_own = row >= r0 && row < r1;
          for (int q = 0; q < 8; ++q) v[8 * j + q] = is_own ? own[row - r0 + q] : gy[row + q];
        }
        for (float f : v) ok = ok && !std::isnan(f);
        stage_block_host(v, b, rows, ys.data());
      }
    }
    for (int s : staged) ok = ok && s == 1;
    stage_host(static_cast<PsDigits<1>*>(nullptr), y, rows, ref);
    const size_t units = size_t(ps_x_units(rows)) * 16;  // the consumers' copy: whole units, at most 15 bytes over
    ok = ok && ref == ys && units >= ys.size() && units < ys.size() + 16;
    if (!ok) {
      std::printf("  producer staging wrong at %d rows, %d CTAs\n", rows, G);
      break;
    }
  }
  if (!ok) ++failures;
  std::printf("%s PS_XST: producers stage every block once, bytes equal staging y whole\n", ok ? "ok  " : "FAIL");
}

int main() {
  std::mt19937 rng(7);
  for (int rep = 0; rep < 3; ++rep) {
    check_case<PsDigits<2>, 2>("PsDigits<2>", 1e-6, rng);
    check_case<PsDigits<4>, 4>("PsDigits<4>", 1e-6, rng);
    check_case<PsDigits<4>, 2>("PsDigits<4>", 1e-6, rng);
    check_case<PsBf3, 4>("PsBf3", 5e-6, rng);
    check_case<PsBf3, 2>("PsBf3", 5e-6, rng);
    check_case<PsBf3, 1>("PsBf3", 5e-6, rng);
  }
  check_bf3_banks();
  check_timeline();
  check_flat();
  check_producer_staging(rng);
  if (failures) return 1;
  std::printf("all passed\n");
  return 0;
}
