// CPU check of the fused GDN decode layer's row mapping (csrc/cuda/kernels/gdn_in_proj_mixer.cuh): for the
// model's dims (Hk = 16, Hv = 32, Dk = Dv = 128, hidden 2048) and every K split ks the launcher may take
// (1, 2, 4, 8), mma_gemv_body's passes over a cluster's 49 tiles (strided over the 16 ranks from
// gipm_gemv_id, MmaCtas) and GipmRows' finish (row 16 tile + r into hin[lr] of the ranks of gipm_ranks) are
// replayed, and
//  - every in_proj row (12,352) is computed exactly once, by the cluster of its key head;
//  - DSMEM stores go only into the mixer ranks 0-7 (ranks 8-15 exit after phase 1), and no mixer rank
//    runs more GEMV passes than the most loaded GEMV-only rank;
//  - every value a CTA's mixer reads from hin (q/k channels, its v and z columns, a and b of its value
//    head) was stored there, and is the in_proj row that gdn_decode_mixer_kernel reads from qkv, z, a, b
//    (its qk_channel, vc and at indices over the split [qkv | z | b | a] row); nothing else is stored;
//  - the L2 prefetch loop of each CTA names exactly the rows its passes compute.
// Built with nvcc as host code; prints FAIL on any mismatch.
#include <cstdio>
#include <map>
#include <set>
#include <vector>

#include "cuda/gemv_plan.h"
#include "cuda/kernels/gdn_in_proj_mixer.cuh"

using namespace lily::cuda;

static int failures = 0;
static void check(bool ok, const char* what, int ks) {
  if (!ok) ++failures, std::printf("FAIL  ks %d: %s\n", ks, what);
}

int main() {
  constexpr int Hk = 16, Hv = 32, DK = GIPM_DK, DV = GIPM_DV, H = 2048;
  constexpr int64_t C = 2 * Hk * DK + Hv * DV, Vd = Hv * DV, R = C + Vd + 2 * Hv;
  static_assert(R == 12352 && GIPM_ROWS == 772 && GIPM_TILES == 49, "the model's in_proj");
  const int S = H / MmaSeg<GIPM_BITS>::VALS;
  for (int ks = 1; ks <= MMA_WARPS; ks *= 2) {
    const MmaSplit sp(ks, S);
    const int passes = (GIPM_TILES + sp.rt - 1) / sp.rt;
    std::vector<int> computed(R, 0);
    bool own_head = true, prefetch_same = true, reads_ok = true, stores_read = true, into_mixers = true;
    int stores = 0, max_passes = 0, min_passes = 1 << 30, mixer_max = 0, gemv_only_max = 0;
    for (int kh = 0; kh < Hk; ++kh) {
      // hin[rank][lr] of the mixer ranks = the in_proj row stored there (-1: none)
      std::vector<std::vector<int64_t>> hin(GIPM_MIX, std::vector<int64_t>(GIPM_ROWS, -1));
      for (int rank = 0; rank < GIPM_CLUSTER; ++rank) {
        std::set<int64_t> rows_done, rows_prefetched;
        int my_passes = 0;
        const int gid = gipm_gemv_id(rank);
        for (int pass = gid; pass < passes; pass += GIPM_CLUSTER, ++my_passes)
          for (int tid = 0; tid < sp.rt * 16; ++tid) {  // mma_gemv_body's finish threads
            const int tile = pass * sp.rt + tid / 16, r = tid % 16;
            if (tile >= GIPM_TILES) continue;
            const int lr = tile * 16 + r;
            if (lr >= GIPM_ROWS) continue;
            const int64_t row = gipm_row(lr, kh, Hk);
            ++computed[row];
            rows_done.insert(row);
            const unsigned ranks = gipm_ranks(lr);
            into_mixers &= (ranks >> GIPM_MIX) == 0;
            for (int t = 0; t < GIPM_MIX; ++t)
              if (ranks >> t & 1u) hin[t][lr] = row, ++stores;
          }
        max_passes = std::max(max_passes, my_passes), min_passes = std::min(min_passes, my_passes);
        int& group_max = rank < GIPM_MIX ? mixer_max : gemv_only_max;
        group_max = std::max(group_max, my_passes);
        const int rows_per_pass = sp.rt * 16;  // the kernel's prefetch loop, every thread
        for (int tid = 0; tid < MMA_THREADS; ++tid)
          for (int q = tid;; q += MMA_THREADS) {
            const int pass = gid + GIPM_CLUSTER * (q / rows_per_pass), lr = pass * rows_per_pass + q % rows_per_pass;
            if (pass >= passes) break;
            if (lr >= GIPM_ROWS) continue;
            rows_prefetched.insert(gipm_row(lr, kh, Hk));
          }
        prefetch_same &= rows_done == rows_prefetched;
      }
      for (int rank = 0; rank < GIPM_MIX; ++rank) {
        const int slice = rank % GIPM_NS, hr = rank / GIPM_NS, h = kh * GIPM_GROUP + hr;
        std::vector<bool> read(GIPM_ROWS, false);
        auto reads = [&](int lr, int64_t want) {
          read[lr] = true;
          reads_ok &= hin[rank][lr] == want;
        };
        for (int i = 0; i < 2 * DK; ++i)  // gdn_decode_mixer_kernel's qk_channel(i)
          reads(i, int64_t(i / DK) * Hk * DK + int64_t(kh) * DK + i % DK);
        for (int jl = 0; jl < GDN_COLS; ++jl) {
          const int j = slice * GDN_COLS + jl;
          reads(GIPM_V0 + hr * DV + j, 2 * int64_t(Hk) * DK + int64_t(h) * DV + j);  // u[vc]
          reads(GIPM_Z0 + hr * DV + j, C + int64_t(h) * DV + j);                      // z[at]
        }
        reads(GIPM_B0 + hr, C + Vd + h);       // b[h]
        reads(GIPM_A0 + hr, C + Vd + Hv + h);  // a[h]
        for (int lr = 0; lr < GIPM_ROWS; ++lr) stores_read &= read[lr] == (hin[rank][lr] >= 0);
      }
      for (int lr = 0; lr < GIPM_ROWS; ++lr) {
        const int64_t row = gipm_row(lr, kh, Hk);
        own_head &= row >= 0 && row < R;
      }
    }
    bool once = true;
    for (int64_t r = 0; r < R; ++r) once &= computed[r] == 1;
    check(once, "every in_proj row computed exactly once", ks);
    check(own_head, "head-local rows inside the matrix", ks);
    check(reads_ok, "every mixer read finds the row the unfused mixer reads", ks);
    check(stores_read, "every stored value is read (no stray DSMEM store)", ks);
    check(prefetch_same, "the L2 prefetch names the rows computed", ks);
    check(into_mixers, "DSMEM stores only into the mixer ranks", ks);
    check(mixer_max <= gemv_only_max, "the mixer ranks no more loaded than the GEMV-only ones", ks);
    check(stores == Hk * (2 * DK * GIPM_MIX + 2 * GIPM_VZ + 2 * GIPM_GROUP * GIPM_NS), "DSMEM store count", ks);
    if (failures == 0)
      std::printf("ok  ks %d: %d passes, %d-%d a rank (mixer ranks at most %d), %d DSMEM stores a cluster\n", ks,
                  passes, min_passes, max_passes, mixer_max, stores / Hk);
  }
  // the plan linear takes for the stacked in_proj at 1, 2 and 3 CTAs per SM on 132 SMs
  for (int per_sm = 1; per_sm <= 3; ++per_sm)
    std::printf("plan: %d CTAs/SM -> ks %d\n", per_sm, mma_plan_for((R + 15) / 16, S, 132 * per_sm).ks);
  if (failures == 0) std::printf("all passed\n");
  return failures ? 1 : 0;
}
