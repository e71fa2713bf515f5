// CPU emulator of moe_scatter_kernel's tile maps (kernels/moe_routing.cuh): map 1 of tile_rows-row tiles
// and, with tail_rows > 0, map 2 of one tail tile per expert whose remainder is 1..tail_rows rows. Runs
// the kernel header's own host-callable pieces: moe_tile_counts and moe_write_tiles over the experts in
// the order of warp 0's scan (exclusive prefix sums of rows and of both maps' tile counts), then reads
// every tile back with find_tile (linear_common.cuh) as the GEMM does (BM 128 for map 1, 64 for map 2),
// and checks, for routings drawn uniform (the synthetic checkpoint's near-uniform router), skewed and
// hand-picked edge counts, at (tile_rows, tail_rows) = (128, 64), (128, 0) and (64, 0):
//   cover:  every grouped row is in exactly one tile of one map, of its own expert; no tile is empty;
//   tails:  a map-2 tile has at most tail_rows rows, a map-1 tile more than tail_rows unless it is whole
//           or tail_rows = 0;
//   starts: the tile starts of both maps together are those of the map without tails (ceil(n / tile_rows)
//           tiles at start + i * tile_rows): a row sits at the same position of its tile as before, only
//           the tail's BM is 64 (so its wgmma column is unchanged);
//   bounds: map 1 within moe.cu's max_routed_tiles, map 2 within min(E, rows).
// Prints the tile counts and fill (real rows / tile rows) of both maps for the 4K prefill (T = 4096,
// top-8 of 256) and T = 2048. Built with nvcc as host code; exits non-zero and prints FAIL on any mismatch.
#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include "cuda/kernels/linear_common.cuh"
#include "cuda/kernels/moe_routing.cuh"

using namespace lily::cuda;

static int failures = 0;
static void expect(bool ok, const char* what, long a, long b) {
  if (!ok && failures++ < 10) std::printf("FAIL %s (%ld, %ld)\n", what, a, b);
}

struct Maps {
  std::vector<int32_t> te, tr, ue, ur, row_end, num;  // map 1, map 2, [E], [2]
};

// The tables moe_scatter_kernel writes for expert row counts n (all CTAs together).
static Maps build(const std::vector<int>& n, int tile_rows, int tail_rows, int64_t max_tiles, int64_t max_tails) {
  const int E = int(n.size());
  Maps m;
  m.te.assign(max_tiles, -1), m.tr.assign(max_tiles, -1), m.ue.assign(max_tails, -1), m.ur.assign(max_tails, -1);
  m.row_end.assign(E, 0), m.num.assign(2, 0);
  MoeScatterParams p{};
  p.tile_expert = m.te.data(), p.tile_row0 = m.tr.data(), p.tail_expert = m.ue.data(), p.tail_row0 = m.ur.data();
  p.tile_rows = tile_rows, p.tail_rows = tail_rows;
  int start = 0, tile = 0, tail = 0;
  for (int e = 0; e < E; ++e) {
    const MoeExpertTiles t = moe_tile_counts(n[e], tile_rows, tail_rows);
    expect(tile + t.wide <= max_tiles && tail + t.tail <= max_tails, "tile count within the allocation", tile, tail);
    if (tile + t.wide > max_tiles || tail + t.tail > max_tails) break;
    m.row_end[e] = start + n[e];
    moe_write_tiles(p, e, start, t, tile, tail);
    start += n[e], tile += t.wide, tail += t.tail;
  }
  m.num[0] = tile, m.num[1] = tail;
  return m;
}

// Checks one routing; returns {map-1 tiles, map-2 tiles}.
static std::pair<int, int> check(const std::vector<int>& n, int tile_rows, int tail_rows) {
  const int64_t E = int64_t(n.size()), rows = std::accumulate(n.begin(), n.end(), int64_t(0));
  // moe.cu's max_routed_tiles and max_tail_tiles (top_k folded into rows)
  const int64_t max_tiles = (rows + 63) / 64 + std::min(E, rows), max_tails = std::min(E, rows);
  const Maps m = build(n, tile_rows, tail_rows, max_tiles, max_tails);
  std::vector<int> owner(rows, -1), hits(rows, 0);
  {
    int64_t r = 0;
    for (int64_t e = 0; e < E; ++e)
      for (int i = 0; i < n[e]; ++i) owner[r++] = int(e);
  }
  std::vector<int64_t> starts;
  for (int map = 0; map < 2; ++map) {
    RowTiles rt;
    rt.tile_expert = map ? m.ue.data() : m.te.data();
    rt.tile_row0 = map ? m.ur.data() : m.tr.data();
    rt.row_end = m.row_end.data();
    rt.num_tiles = m.num.data() + map;
    rt.tile_rows = map ? tail_rows : tile_rows;
    const int64_t ub = map ? max_tails : max_tiles;
    int64_t prev = -1;
    for (int64_t t = 0; t < ub; ++t) {
      Tile tile;
      const bool real = find_tile(rt, t, rt.tile_rows, tile);
      expect(real == (t < m.num[map]), "tiles below the count are real, the others empty", map, t);
      if (!real) continue;
      expect(tile.expert > prev || (map == 0 && tile.expert == prev), "tiles ascend by expert", map, t);
      prev = tile.expert;
      expect(map == 0 || tile.rows <= tail_rows, "a tail has at most tail_rows rows", tile.rows, tail_rows);
      expect(map == 1 || tail_rows == 0 || tile.rows == tile_rows || tile.rows > tail_rows,
             "a ragged map-1 tile has more than tail_rows rows", tile.rows, tail_rows);
      starts.push_back(tile.row0);
      for (int64_t r = tile.row0; r < tile.row0 + tile.rows; ++r) {
        ++hits[r];
        expect(owner[r] == tile.expert, "a tile's rows are its expert's", r, tile.expert);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) expect(hits[r] == 1, "every row in exactly one tile", r, hits[r]);
  std::vector<int64_t> old;  // the map without tails: ceil(n / tile_rows) tiles per expert
  for (int64_t e = 0, s = 0; e < E; s += n[e], ++e)
    for (int64_t r0 = s; r0 < s + n[e]; r0 += tile_rows) old.push_back(r0);
  std::sort(starts.begin(), starts.end());
  expect(starts == old, "tile starts equal the map without tails", long(starts.size()), long(old.size()));
  return {m.num[0], m.num[1]};
}

// T tokens x top_k distinct experts of E, expert e drawn with weight w[e] (sampling without replacement).
static std::vector<int> route(int64_t T, int top_k, const std::vector<double>& w, std::mt19937_64& rng) {
  std::vector<int> n(w.size(), 0);
  std::vector<double> left(w.size());
  for (int64_t t = 0; t < T; ++t) {
    left = w;
    for (int k = 0; k < top_k; ++k) {
      std::discrete_distribution<int> pick(left.begin(), left.end());
      const int e = pick(rng);
      ++n[e];
      left[e] = 0;
    }
  }
  return n;
}

int main() {
  std::mt19937_64 rng(7);
  const int layouts[3][2] = {{128, 64}, {128, 0}, {64, 0}};
  // edge counts around the tile and tail sizes (and empty experts)
  const std::vector<int> edges = {0, 1, 63, 64, 65, 127, 128, 129, 191, 192, 193, 255, 256, 257, 320, 0, 5};
  for (const auto& l : layouts) check(edges, l[0], l[1]);
  for (int E : {1, 3, 8}) {
    std::vector<int> n(E);
    for (int trial = 0; trial < 200; ++trial) {
      for (int& v : n) v = int(rng() % 400);
      for (const auto& l : layouts) check(n, l[0], l[1]);
    }
  }
  std::printf("ok   edge and random counts (E = 17 edges; 1, 3, 8 random), maps (128, 64), (128, 0), (64, 0)\n");

  const int E = 256, top_k = 8;
  std::vector<double> uniform(E, 1.0), skew(E);
  std::normal_distribution<double> z;
  for (double& v : skew) v = std::exp(0.5 * z(rng));
  for (const auto& [name, w] : {std::make_pair("uniform", uniform), std::make_pair("skew 0.5", skew)})
    for (int64_t T : {2048, 4096}) {
      const std::vector<int> n = route(T, top_k, w, rng);
      const double rows = double(T * top_k);
      const auto [old_tiles, none] = check(n, 128, 0);
      const auto [wide, tails] = check(n, 128, 64);
      expect(none == 0 && wide + tails == old_tiles, "the tails split the same tiles", wide + tails, old_tiles);
      std::printf("ok   %-8s T = %4lld: 128-row map %d tiles, fill %.3f; with 64-row tails %d + %d tiles, fill %.3f\n",
                  name, (long long)T, old_tiles, rows / (128.0 * old_tiles), wide, tails,
                  rows / (128.0 * wide + 64.0 * tails));
    }
  if (failures) {
    std::printf("FAIL: %d mismatches\n", failures);
    return 1;
  }
  std::printf("all passed\n");
  return 0;
}
