// One GDN decode token from the layer input to the gated norm in one kernel: the stacked in_proj GEMV
// (gemv_mma.cuh) and the decode mixer (gdn_decode.cuh) of each key head in one thread-block cluster,
// the in_proj rows handed over through distributed shared memory instead of device memory (device code,
// and the residency check the launcher in gated_delta.cu and benchmarks/gdn_fused_lab.cu share).
//   proj = W x_in   (W the stacked in_proj [q | k | v | z | b | a] rows, x_in = h, or with NORM_IN
//                    rms_norm(res) * in_norm staged as linear_rms_normed's GEMV stages it)
//   y, conv_state_out, state_out = gdn_decode_mixer(qkv = proj[:C], z, b, a of proj, ...)
// Shapes (the model's, fixed here): Dk = Dv = 128, Hv = 2 Hk, conv kernel 4; W 4-bit MLX affine, groups
// of 64 (two a 128-value segment), [R = C + Vd + 2 Hv, cols] with C = 2 Hk Dk + Hv Dv, Vd = Hv Dv.
// Key head kh reads 772 rows of W; in head-local order lr (GIPM_*: q 128 | k 128 | v 256 | z 256 |
// b 2 | a 2, gipm_row gives the global row) they are 49 tiles of 16 rows, the last one of 4.
//
// Grid Hk x 16 CTAs (1-D), block 256 (MMA_THREADS), clusters of 16 (GIPM_CLUSTER, a non-portable size)
// = one key head: rank = blockIdx.x % 16, kh = blockIdx.x / 16. The launcher takes the kernel only where
// Hk such clusters are resident at once at 2 CTAs an SM (gipm_clusters_fit: 8 SMs of a GPC a cluster),
// else the op runs its parts (a cluster size chosen at run time cost ~9 registers: 128 and spills).
// All 16 ranks run the GEMV, so the grid has the GEMV's occupancy: 256 CTAs at 2 an SM, as linear's 264
// on 132 SMs (with 8 CTAs a key head, 128 CTAs, the in_proj streamed at about half linear's rate:
// perf-notes). Ranks 0-7 (GIPM_MIX) also run the mixer with its geometry (gdn_decode.cuh) and twice its
// threads: rank = slice + 4 hr, columns [32 slice, +32) of value head h = 2 kh + hr. Ranks 8-15 only
// compute rows: they store into ranks 0-7 and no CTA ever reads or writes their shared memory, so they
// leave after phase 1 (they arrive at phase 2 first). Ranks 0-7 keep the unfused mixer's per-CTA work;
// 2 clusters of 8 a key head would compute q and k twice or hand rows over through device memory, and
// 16-column mixer slices would change the mixer's mapping.
// 1. Before the PDL wait: cluster barrier phase 0 arrive; ranks 0-7: cp.async of the CTA's mixer operands
//    into shared memory (its 128 x 32 slice of S, the key head's q/k conv taps and conv state, its 32 v
//    channels' taps, conv state and norm weights, A_log and dt_bias of its value head; S and the conv
//    state read from L2 as the mixer reads them, .cg); every rank: an L2 prefetch of every weight row its
//    GEMV passes will read; the GEMV's first two units of weights into registers (mma_gemv_body). The
//    weights are constant, the state is the previous token's (see gdn_decode.cuh).
// 2. pdl_wait, pdl_trigger; stage x_in (mma_stage_x or mma_stage_normed_x: digits, e_u, xsum_u, bit for
//    bit linear's); phase 0 wait (every CTA of the cluster runs, so DSMEM may be written).
// 3. The GEMV: mma_gemv_body over the cluster's 49 tiles, passes strided over the 16 ranks (MmaCtas; rank
//    r takes passes gipm_gemv_id(r), + 16, ...: the 49th tile's pass goes to rank 8, not to a mixer rank),
//    with the K split ks of linear's plan for the whole matrix (launcher: linear_gemv_mma_ks), so every
//    row sums its segments, quads and K-parts in linear_gemv_mma_kernel's order (which CTA sums a row does
//    not enter it): each row bit for bit linear's. A finished row lr goes to hin[lr] of each rank whose
//    mixer reads it (gipm_ranks: q, k ranks 0-7; v and z column j of value head hr the rank of (j / 32,
//    hr); b, a of hr the 4 ranks of hr).
// 4. cp.async wait; phase 1 arrive (release: the row stores) and wait (acquire): hin holds the rows.
//    Ranks 8-15 then arrive at phase 2 (nothing to release) and exit.
// 5. Ranks 0-7, the mixer of gdn_decode_mixer_kernel on the local copies: thread t < 256 convolves q/k
//    channel t; threads < 128 (GDN_THREADS, the mixer's lane -> (column, rows) mapping) convolve their v
//    channel, load their S rows from shared memory, run gdn_qk_factors and gdn_column_step, store o_j into
//    ohead of the head's 4 ranks; phase 2 arrive; S stores; phase 2 wait; gdn_head_scale; y, v conv state;
//    rank 0 the q/k conv state (threads 0-255). The same functions on the same values as the unfused kernel.
// Precision: fp32 (integer-exact tensor-core products inside the GEMV, gemv_mma.cuh). Bit-identical to
// linear(_rms_normed) + gdn_decode_mixer on CUDA: the same staged x, the same per-row sum order (same ks),
// the mixer's device functions on the same inputs; the norm's float4 order is chosen as gdn_decode_mixer
// chooses it for the engine's aligned z row (launcher).
#pragma once
#include "gdn_decode.cuh"
#include "gemv_mma.cuh"

namespace lily::cuda {

constexpr int GIPM_DK = 128, GIPM_DV = 128, GIPM_GROUP = 2, GIPM_K = 4, GIPM_BITS = 4, GIPM_NG = 2;
constexpr int GIPM_NS = GIPM_DV / GDN_COLS;                              // column slices of a value head
constexpr int GIPM_MIX = GIPM_NS * GIPM_GROUP;                           // mixer CTAs of a key head: ranks 0-7
constexpr int GIPM_CLUSTER = 2 * GIPM_MIX;                               // CTAs of a key head (GEMV: all)
constexpr int GIPM_VZ = GIPM_GROUP * GIPM_DV;                            // v (or z) rows of a key head
constexpr int GIPM_V0 = 2 * GIPM_DK, GIPM_Z0 = GIPM_V0 + GIPM_VZ, GIPM_B0 = GIPM_Z0 + GIPM_VZ;
constexpr int GIPM_A0 = GIPM_B0 + GIPM_GROUP, GIPM_ROWS = GIPM_A0 + GIPM_GROUP;  // 772
constexpr int GIPM_TILES = (GIPM_ROWS + 15) / 16;                        // 49
constexpr int GIPM_SPAD = GDN_COLS + 4;  // floats per row of the S slice in shared memory (2-way banks)
static_assert(GIPM_MIX <= GDN_DECODE_MAX_CLUSTER && 2 * GIPM_DK == MMA_THREADS, "one q/k channel a thread");

// The in_proj row of head-local row lr of key head kh (Hk key heads): q, k, v, z head-major as the
// mixer reads them (gdn_decode.cuh), then b, a [Hv].
__host__ __device__ inline int64_t gipm_row(int lr, int kh, int Hk) {
  const int64_t qk = int64_t(Hk) * GIPM_DK, Hv = int64_t(Hk) * GIPM_GROUP, C = 2 * qk + Hv * GIPM_DV;
  if (lr < GIPM_DK) return int64_t(kh) * GIPM_DK + lr;
  if (lr < GIPM_V0) return qk + int64_t(kh) * GIPM_DK + (lr - GIPM_DK);
  if (lr < GIPM_Z0) return 2 * qk + int64_t(kh) * GIPM_VZ + (lr - GIPM_V0);
  if (lr < GIPM_B0) return C + int64_t(kh) * GIPM_VZ + (lr - GIPM_Z0);
  if (lr < GIPM_A0) return C + Hv * GIPM_DV + int64_t(kh) * GIPM_GROUP + (lr - GIPM_B0);
  return C + Hv * GIPM_DV + Hv + int64_t(kh) * GIPM_GROUP + (lr - GIPM_A0);
}

// The cluster ranks (bit r) whose mixer reads head-local row lr: rank slice + GIPM_NS * hr (< GIPM_MIX)
// holds columns [32 slice, +32) of value head 2 kh + hr.
__host__ __device__ inline unsigned gipm_ranks(int lr) {
  if (lr < GIPM_V0) return (1u << GIPM_MIX) - 1;                            // q, k: every mixer rank
  if (lr < GIPM_B0) return 1u << ((lr - GIPM_V0) % GIPM_VZ / GDN_COLS);     // v, z of (hr, column)
  return ((1u << GIPM_NS) - 1) << (GIPM_NS * ((lr - GIPM_B0) % GIPM_GROUP));  // b, a of hr
}

// The first GEMV pass of rank r (passes gipm_gemv_id(r) + 16 i): ranks 8-15 first, so that a pass count
// that is not a multiple of 16 (49 tiles at ks = 8) loads the GEMV-only ranks, not the mixer's.
__host__ __device__ inline int gipm_gemv_id(int rank) { return (rank + GIPM_MIX) % GIPM_CLUSTER; }

struct GipmParams {
  const uint32_t* w;  // in_proj [R, cols * 4 / 32]
  const uint16_t* scales;  // [R, cols / 64] BF16
  const uint16_t* biases;
  const float* x;     // [cols]: h, or with NORM_IN the residual row (16-byte aligned)
  NormIn norm_in;     // NORM_IN: the input norm's weight [cols] and eps
  int cols, group_shift, ks;  // ks: linear's K-parts per tile for W (linear_gemv_mma_ks)
  GdnDecodeParams m;  // the mixer's (m.u, m.z, m.a, m.b unused: the GEMV's rows; Dv = 128, Hv = 2 Hk)
};

// Rows of a key head (mma_gemv_body's policy): tile t, row r is head-local row 16 t + r (past the end:
// the last row); a finished row is stored into hin[lr] of the ranks that read it (DSMEM).
struct GipmRows {
  const uint32_t* w;
  const uint16_t* s;
  const uint16_t* b;
  int wpr, gpr, group_shift, kh, Hk;
  float* hin;  // this CTA's [GIPM_ROWS]; the same offset in every rank
  using Ref = MmaRowRef;
  __device__ __forceinline__ Ref base(int tile, int r) const {
    return mma_affine_row(w, s, b, gipm_row(min(tile * 16 + r, GIPM_ROWS - 1), kh, Hk), wpr, gpr);
  }
  __device__ __forceinline__ MmaRowRef at(const Ref& ref, int seg) const {
    return mma_affine_at<GIPM_BITS>(ref, seg, group_shift);
  }
  template <class Sum>
  __device__ __forceinline__ void finish(int tile, int r, const Sum& row_sum) const {
    const int lr = tile * 16 + r;
    if (lr >= GIPM_ROWS) return;
    const float v = row_sum(r);
    const unsigned ranks = gipm_ranks(lr);
#pragma unroll
    for (int t = 0; t < GIPM_MIX; ++t)
      if (ranks >> t & 1u) static_cast<float*>(__cluster_map_shared_rank(hin, unsigned(t)))[lr] = v;
  }
};

__device__ __forceinline__ void gipm_cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(unsigned(__cvta_generic_to_shared(dst))),
               "l"(src));
}

__device__ __forceinline__ void gipm_cp_async4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(unsigned(__cvta_generic_to_shared(dst))),
               "l"(src));
}

__device__ __forceinline__ void gipm_prefetch_l2(const void* p, unsigned bytes) {  // 16-byte aligned, bytes % 16 = 0
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes) : "memory");
}

template <bool NORM_IN>
__global__ void __launch_bounds__(MMA_THREADS, MMA_MIN_CTAS) gdn_in_proj_mixer_kernel(const GipmParams p) {
  using Sg = MmaSeg<GIPM_BITS>;
  constexpr int DK = GIPM_DK, DV = GIPM_DV, K = GIPM_K, VB = Sg::VALS / GIPM_NG, RPT = DK / GDN_KSPLIT;
  extern __shared__ uint2 xd[];  // [cols/8][3] digits, then xe, xsum [cols/VB]
  float* xe = reinterpret_cast<float*>(xd + p.cols / 8 * 3);
  float* xsum = xe + p.cols / VB;
  __shared__ alignas(16) float sS[DK][GIPM_SPAD];  // S[h][:, 32 slice + c], c < 32
  __shared__ float4 taps_qk[2 * DK], taps_v[GDN_COLS];
  __shared__ alignas(16) float cs_qk[K - 1][2 * DK], cs_v[K - 1][GDN_COLS];
  __shared__ alignas(16) float hin[GIPM_ROWS];
  __shared__ float4 qk[2][DK / 4];
  __shared__ alignas(16) float ohead[DV], nw_s[GDN_COLS], gate_s[2];  // norm_w[32 slice + c]; A_log, dt_bias of h
  __cluster_barrier_arrive_relaxed();  // phase 0: this CTA has started
  const GdnDecodeParams& m = p.m;
  const int rank = int(blockIdx.x) % GIPM_CLUSTER, kh = int(blockIdx.x) / GIPM_CLUSTER;
  const bool mixes = rank < GIPM_MIX;  // ranks 0-7: GEMV and mixer; the others GEMV only (slice, hr, h unused)
  const int slice = rank % GIPM_NS, hr = rank / GIPM_NS % GIPM_GROUP, h = kh * GIPM_GROUP + hr;
  const int tid = int(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const bool mixer = tid < GDN_THREADS;  // warps 0-3: the mixer's threads
  const int ks = lane & (GDN_KSPLIT - 1), jl = (warp & 3) * (32 / GDN_KSPLIT) + lane / GDN_KSPLIT;
  const int j = slice * GDN_COLS + jl;
  const int64_t C = 2 * int64_t(m.Hk) * DK + int64_t(m.Hv) * DV;
  const int64_t vc0 = 2 * int64_t(m.Hk) * DK + int64_t(h) * DV + slice * GDN_COLS;  // the CTA's first v channel
  auto qk_channel = [&](int i) { return int64_t(i / DK) * m.Hk * DK + int64_t(kh) * DK + i % DK; };

  // 1. Before the wait: the mixer's operands into shared memory, the GEMV's weights towards L2.
  if (mixes) {
    const float* S = m.state + int64_t(h) * DK * DV + slice * GDN_COLS;
    for (int q = tid; q < DK * GDN_COLS / 4; q += MMA_THREADS)
      gipm_cp_async16(&sS[q / 8][4 * (q % 8)], S + (q / 8) * DV + 4 * (q % 8));
    gipm_cp_async16(&taps_qk[tid], m.conv_w + qk_channel(tid) * K);
    if (tid < GDN_COLS) gipm_cp_async16(&taps_v[tid], m.conv_w + (vc0 + tid) * K);
    constexpr int QK4 = 2 * DK / 4, V4 = GDN_COLS / 4;  // 16-byte chunks of a conv state row
    for (int q = tid; q < (K - 1) * (QK4 + V4); q += MMA_THREADS) {
      const int t = q / (QK4 + V4), c = q % (QK4 + V4);
      if (c < QK4) gipm_cp_async16(&cs_qk[t][4 * c], m.conv_state + t * C + qk_channel(4 * c));
      else gipm_cp_async16(&cs_v[t][4 * (c - QK4)], m.conv_state + t * C + vc0 + 4 * (c - QK4));
    }
    if (tid < GDN_COLS) gipm_cp_async4(&nw_s[tid], m.norm_w + slice * GDN_COLS + tid);
    if (tid < 2) gipm_cp_async4(&gate_s[tid], (tid == 0 ? m.A_log : m.dt_bias) + h);
    asm volatile("cp.async.commit_group;\n" ::);
  }
  const int gid = gipm_gemv_id(rank);
  const int Sg_n = p.cols / Sg::VALS, wpr = p.cols * GIPM_BITS / 32, gpr = p.cols >> p.group_shift;
  const MmaSplit sp(p.ks, Sg_n);
  {
    const int rows_per_pass = sp.rt * 16, passes = (GIPM_TILES + sp.rt - 1) / sp.rt;
    for (int q = tid;; q += MMA_THREADS) {  // the rows of passes gid, gid + 16, ...
      const int pass = gid + GIPM_CLUSTER * (q / rows_per_pass), lr = pass * rows_per_pass + q % rows_per_pass;
      if (pass >= passes) break;
      if (lr >= GIPM_ROWS) continue;
      const int64_t row = gipm_row(lr, kh, m.Hk);
      gipm_prefetch_l2(p.w + row * wpr, unsigned(wpr * 4));
      gipm_prefetch_l2(p.scales + row * gpr, unsigned(gpr * 2));
      gipm_prefetch_l2(p.biases + row * gpr, unsigned(gpr * 2));
    }
  }

  // 2.-3. The wait, x staged, the GEMV; rows into the readers' hin.
  const GipmRows rows{p.w, p.scales, p.biases, wpr, gpr, p.group_shift, kh, m.Hk, hin};
  auto stage = [&] {  // the weights of units 0 and 1 are on their way meanwhile
    auto wait = [] {
      pdl_wait();
      pdl_trigger();
    };
    if constexpr (NORM_IN) {
      mma_stage_normed_x<GIPM_BITS, VB>(p.x, p.norm_in, p.cols, xd, xe, xsum, wait);
    } else {
      wait();
      mma_stage_x<GIPM_BITS, VB>([&](int o) { return p.x + 8 * o; }, p.cols, xd, xe, xsum);
    }
    __syncthreads();
    __cluster_barrier_wait();  // phase 0: every CTA of the cluster has started (DSMEM stores from here)
  };
  mma_gemv_body<GIPM_BITS, GIPM_NG>(rows, GIPM_TILES, Sg_n, sp, xd, xe, xsum, [] {}, stage, MmaTokens{1, 0, 0},
                                    MmaCtas{gid, GIPM_CLUSTER});
  asm volatile("cp.async.wait_all;\n" ::: "memory");
  __cluster_barrier_arrive();  // phase 1, release: this CTA's rows are in their readers' hin
  __cluster_barrier_wait();    // phase 1, acquire: hin holds the key head's rows; the cp.async copies landed
  if (!mixes) {  // no CTA accesses this one's shared memory: it may leave once counted in phase 2
    __cluster_barrier_arrive_relaxed();
    return;
  }

  // 5. The mixer (gdn_decode_mixer_kernel's steps on the local copies).
  float* qkf = reinterpret_cast<float*>(qk);
  const float4 tq = taps_qk[tid];
  const float wq[K] = {tq.x, tq.y, tq.z, tq.w}, sq[K - 1] = {cs_qk[0][tid], cs_qk[1][tid], cs_qk[2][tid]};
  const float uq = hin[tid];  // q | k element tid = head-local row tid
  qkf[tid] = conv_silu_token<K>(wq, sq, uq);
  const float4 tv = taps_v[jl];
  const float wv[K] = {tv.x, tv.y, tv.z, tv.w}, sv[K - 1] = {cs_v[0][jl], cs_v[1][jl], cs_v[2][jl]};
  const float uv = hin[GIPM_V0 + hr * DV + j], z = hin[GIPM_Z0 + hr * DV + j];
  const float2 gate = gdn_gates_of(hin[GIPM_A0 + hr], hin[GIPM_B0 + hr], gate_s[0], gate_s[1]);  // (alpha, beta)
  const float v = conv_silu_token<K>(wv, sv, uv);
  auto row = [&](int r, int c) { return 4 * (ks + GDN_KSPLIT * r) + c; };  // S row of s[4r + c]
  float s[RPT];
#pragma unroll
  for (int r = 0; r < RPT / 4; ++r)
#pragma unroll
    for (int c = 0; c < 4; ++c) s[4 * r + c] = sS[row(r, c)][jl];
  __syncthreads();
  float out = 0.f;
  if (mixer) {
    const float2 f = gdn_qk_factors<DK>(qkf, lane);
    out = gdn_column_step<DK>(s, qk, ks, f.x, f.y, gate.x, gate.y, v);
    // o_j into ohead[j] of the head's ranks: lane ks of the column's quad stores to slice ks
    static_assert(GIPM_NS == GDN_KSPLIT, "one store a lane");
    static_cast<float*>(__cluster_map_shared_rank(ohead, unsigned(ks + GIPM_NS * hr)))[j] = out;
  }
  __cluster_barrier_arrive();  // phase 2, release: the o_j stores
  if (mixer) {
    float* So = m.state_out + int64_t(h) * DK * DV + j;  // column j of the output copy
    asm("" : "+l"(So));
#pragma unroll
    for (int r = 0; r < RPT / 4; ++r)
#pragma unroll
      for (int c = 0; c < 4; ++c) __stcg(So + row(r, c) * DV, s[4 * r + c]);
  }
  __cluster_barrier_wait();  // phase 2, acquire: ohead holds head h
  if (mixer) {
    const float sc = gdn_head_scale<DV>(ohead, DV, m.norm_vec4, m.eps, lane);
    if (ks == 0) {
      m.y[int64_t(h) * DV + j] = norm_out<true>(out, sc, nw_s[jl], z);
      conv_state_store<K>(m.conv_state_out, C, vc0 + jl, sv, uv);
    }
  }
  if (rank == 0) conv_state_store<K>(m.conv_state_out, C, qk_channel(tid), sq, uq);  // the key head's q/k
}

// Whether Hk clusters of GIPM_CLUSTER CTAs (a non-portable size, allowed here) of `kernel` (an instance of
// gdn_in_proj_mixer_kernel) with `smem` bytes of staged x are resident at once (cudaOccupancyMaxActiveClusters:
// the GEMV phase in one wave). Host code; `clusters` gets the count (0: refused).
template <class Kernel>
inline bool gipm_clusters_fit(Kernel kernel, size_t smem, int Hk, int* clusters) {
  *clusters = 0;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess) {
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = unsigned(GIPM_CLUSTER);
    attr.val.clusterDim.y = attr.val.clusterDim.z = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(unsigned(GIPM_CLUSTER));
    cfg.blockDim = dim3(unsigned(MMA_THREADS));
    cfg.dynamicSmemBytes = smem;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    if (cudaOccupancyMaxActiveClusters(clusters, kernel, &cfg) != cudaSuccess) *clusters = 0;
  }
  (void)cudaGetLastError();  // a refused attribute or query is an answer, not a launch error
  return *clusters >= Hk;
}

}  // namespace lily::cuda
