// Causal GQA flash attention for a chunk of new tokens (prefill) at head_dim 256 on Hopper warpgroup
// MMA (wgmma, sm_90a), FlashAttention-3's structure (attention.cu launches it for every prefill at D = 256
// given a workspace; benchmarks/attn_lab.cu times it against the mma.sync kernel):
//   o[t, h, :] = sum_{j <= pos0+t} softmax_j(q[t, h, :] . k[j, kvh, :] / sqrt(256)) v[j, kvh, :],
//   kvh = h / group: attention_prefill_kernel<256>'s result (kernels/attention_prefill.cuh).
// Shapes: qb [T, nH*256] bf16 (q rounded to bf16 by attention_q_bf16_kernel, as the mma.sync kernel
//   rounds it); k_cache, v_cache [maxT, nKV*256] bf16 (rows < pos0 hold earlier chunks, rows [pos0,
//   pos0+T) this chunk); o [T, nH*256] f32; pos [1] i32 on the device (pos0). All three operands are
//   read by TMA through 2-D tensor maps (csrc/cuda/tensor_map.h, make_xb_tensor_map: box {64 cols,
//   64 rows}, SWIZZLE_128B): qb [T rows, nH*256 cols], k/v [maxT rows, nKV*256 cols]; rows past the
//   map's extent read as zero.
// Grid: ceil(T/128) * nH CTAs of 384 threads, one CTA per (128-query-row tile, head); CTA b takes
//   q tile ceil(T/128) - 1 - b / nH and head b % nH (the tiles that see the most keys first, all heads
//   of a tile together: the 8 heads of a KV head read the same K/V tiles from L2).
// Shared memory (1024-aligned; every part a multiple of 1024 B):
//   Q    [2 warpgroups][4 dim blocks][64 rows][128 B]   64 KB (loaded once)
//   K    [2 stages][4 dim blocks][64 keys][128 B]        2 x 32 KB
//   V    [3 stages][4 dim blocks][64 keys][128 B]        3 x 32 KB (a warpgroup holds V_{i-1} while
//                                                        it works on tile i)
//   mbarriers q_full, v_tail, full_k[2], empty_k[2], full_v[3], empty_v[3]: 225 KB in all.
//   A [64 rows][128 B] block is one TMA box {64 dims, 64 rows} as SWIZZLE_128B writes it: 16-byte
//   chunk j of row r at r*128 + ((j ^ (r & 7)) << 4) (wg_swz).
// Warp roles:
//   warpgroup 0, warp 0 = producer (setmaxnreg 24; the other three warps exit): loads the CTA's Q
//     (4 boxes per warpgroup that has rows, on q_full), then for key tile i = 0.. (64 keys each, up to pos0 + the CTA's last row)
//     waits empty_k[i%2] and loads K's 4 boxes on full_k[i%2], then waits empty_v[i%3] and loads V's 4
//     boxes on full_v[i%3] (32768 bytes each, zero-filled box rows counted too). Use number i / stages
//     of a stage has parity (i / stages) & 1 (awg_k_phase / awg_v_phase). The one V tile that
//     reaches past pos0 + T (when (pos0 + T) % 64 != 0) lands on v_tail instead: the warp zeroes its
//     rows >= pos0 + T (cache rows no query may see, possibly never written: NaN * 0 would poison o),
//     fences them for the async proxy and arrives on full_v itself.
//   warpgroups 1, 2 = consumers cw = 0, 1 (setmaxnreg 240), query rows t0 + 64 cw .. + 64, with
//     FlashAttention-3's intra-warpgroup overlap: per key tile i, S_i = Q K_i^T (16 m64n64k16 wgmma,
//     both operands by K-major SWIZZLE_128B descriptors: dim block j, k16 step s at block + 32 s bytes)
//     and O += P_{i-1} V_{i-1} (4 m64n256k16 wgmma, P from registers as bf16, V by an MN-major
//     SWIZZLE_128B descriptor: LBO 8192 B between dim blocks, SBO 1024 B between 8-key groups, k16 step
//     kk at + 2048 kk bytes) are queued together; wait for S_i, release K_i (empty_k: one arrival per
//     warp, count 8); the online softmax of S_i in registers while the tensor cores do P_{i-1} V_{i-1};
//     wait, release V_{i-1} (empty_v); O rescaled by tile i's factor. P alternates between two fragment
//     sets (P_{i-1} is read by the running wgmma while P_i is written). A warpgroup whose rows end
//     before a key tile (warpgroup 0 of a tile on the diagonal) waits for and releases that tile
//     without computing on it. The consumers wait without the time-out trap (awg_wait).
//   Measured slower and removed (docs/perf-notes.md, "prefill attention on wgmma, lab"): S, softmax and
//     P V in sequence, P V as m64n64k16 per dim block, and FA3's inter-warpgroup pingpong turns.
// Thread mapping (consumer thread wt = 0..127 of its warpgroup, w = wt / 32, g = (wt % 32) / 4,
//   c = wt % 4): accumulator i of an m64nN wgmma is (row 16 w + g + 8 ((i / 2) % 2), column
//   8 (i / 4) + 2 c + i % 2) (awg_acc_row / awg_acc_col). S: 32 floats (64 keys), O: 128 floats (256
//   dims); a thread owns rows g and g + 8 of its warp's 16: row statistics reduce over the 4 lanes of
//   a quad. P's A fragment of k16 step kk, register r = S accumulators 8 kk + 2 r (low half) and
//   8 kk + 2 r + 1 (awg_p_acc): the accumulator and A-fragment layouts coincide.
// Precision: as attention_prefill_kernel: q and p rounded to bf16 for the products, fp32
//   accumulation, the online softmax (running max, sum, rescale) fp32 in log2 units; o = O / l.
//   The summation order differs (64-key tiles, wgmma's order), and exp2's argument is one FFMA
//   (s * scale_log2 - m) with ex2.approx.ftz, so results match it to ~1e-3, not bitwise.
#pragma once
#include <cuda.h>  // CUtensorMap (the type only; maps are encoded on the host, csrc/cuda/tensor_map.h)

#include <cmath>
#include <cstdint>

#include "common.cuh"
#include "wgmma.cuh"
#include "xb_layout.cuh"  // wg_pack_bf16x2

namespace lily::cuda::attn {

constexpr int AWG_D = 256;           // head_dim
constexpr int AWG_ROWS = 128;        // query rows per CTA
constexpr int AWG_WG_ROWS = 64;      // query rows per consumer warpgroup
constexpr int AWG_KEYS = 64;         // keys per K/V tile
constexpr int AWG_K_STAGES = 2;      // K tiles in flight
constexpr int AWG_V_STAGES = 3;      // V tiles in flight (a warpgroup holds V_{i-1} until tile i's softmax is done)
constexpr int AWG_THREADS = 384, AWG_PRODUCER_REGS = 24, AWG_CONSUMER_REGS = 240;
constexpr int AWG_BOX_BYTES = 64 * 128;                      // one TMA box {64 dims, 64 rows}
constexpr int AWG_TILE_BYTES = (AWG_D / 64) * AWG_BOX_BYTES;  // 64 rows x 256 dims: 32768
constexpr int AWG_Q_BYTES = 2 * AWG_TILE_BYTES;
constexpr int AWG_K_OFF = AWG_Q_BYTES, AWG_V_OFF = AWG_K_OFF + AWG_K_STAGES * AWG_TILE_BYTES;
constexpr int AWG_BAR_OFF = AWG_V_OFF + AWG_V_STAGES * AWG_TILE_BYTES;
constexpr int AWG_NUM_BARS = 2 + 2 * AWG_K_STAGES + 2 * AWG_V_STAGES;
constexpr int AWG_SMEM_BYTES = 1024 + AWG_BAR_OFF + 8 * AWG_NUM_BARS;  // + alignment slack
static_assert(AWG_SMEM_BYTES <= 227 * 1024, "the attention ring exceeds the 227 KB opt-in shared memory");
static_assert(AWG_TILE_BYTES % 1024 == 0 && AWG_K_OFF % 1024 == 0 && AWG_V_OFF % 1024 == 0,
              "SWIZZLE_128B tiles start at multiples of 1024 B");

// mbarrier byte offsets (from the 1024-aligned base).
__host__ __device__ constexpr int awg_bar_q_full() { return AWG_BAR_OFF; }
__host__ __device__ constexpr int awg_bar_v_tail() { return AWG_BAR_OFF + 8; }
__host__ __device__ constexpr int awg_bar_full_k(int s) { return AWG_BAR_OFF + 16 + 8 * s; }
__host__ __device__ constexpr int awg_bar_empty_k(int s) { return AWG_BAR_OFF + 16 + 8 * (AWG_K_STAGES + s); }
__host__ __device__ constexpr int awg_bar_full_v(int s) { return AWG_BAR_OFF + 16 + 8 * (2 * AWG_K_STAGES + s); }
__host__ __device__ constexpr int awg_bar_empty_v(int s) {
  return AWG_BAR_OFF + 16 + 8 * (2 * AWG_K_STAGES + AWG_V_STAGES + s);
}
// Key tile i's K and V stages and the parity of its use of them (the ring's pass i / stages).
__host__ __device__ constexpr int awg_k_stage(int i) { return i % AWG_K_STAGES; }
__host__ __device__ constexpr uint32_t awg_k_phase(int i) { return uint32_t(i / AWG_K_STAGES) & 1; }
__host__ __device__ constexpr int awg_v_stage(int i) { return i % AWG_V_STAGES; }
__host__ __device__ constexpr uint32_t awg_v_phase(int i) { return uint32_t(i / AWG_V_STAGES) & 1; }

// Byte offsets of dim block j (64 dims) of consumer cw's Q rows, and of K/V stage s.
__host__ __device__ constexpr int awg_q_off(int cw, int j) { return cw * AWG_TILE_BYTES + j * AWG_BOX_BYTES; }
__host__ __device__ constexpr int awg_k_off(int s, int j) { return AWG_K_OFF + s * AWG_TILE_BYTES + j * AWG_BOX_BYTES; }
__host__ __device__ constexpr int awg_v_off(int s) { return AWG_V_OFF + s * AWG_TILE_BYTES; }

// S = Q K^T, k16 step 4 j + s (dims 64 j + 16 s ..): K-major SWIZZLE_128B descriptors of the Q / K dim
// block j, start + 32 s bytes, as the dense GEMM steps through a 64-k tile; desc0 = wg_desc(dim block
// 0), so + 512 j + 2 s on the start field (in 16 B units; no carry: shared addresses < 256 KB).
__host__ __device__ constexpr uint64_t awg_qk_desc(uint64_t desc0, int j, int s) {
  return desc0 + uint64_t((j * AWG_BOX_BYTES) >> 4) + 2 * s;
}
// O += P V: the V stage [4 dim blocks][64 keys][128 B] at v_saddr as an MN-major SWIZZLE_128B B
// operand: 64-dim atoms LBO = 8192 B apart (N direction), 8-key groups SBO = 1024 B apart (K direction).
__host__ __device__ constexpr uint64_t awg_v_desc0(uint32_t v_saddr) {
  return uint64_t((v_saddr & 0x3FFFF) >> 4) | (uint64_t(AWG_BOX_BYTES >> 4) << 16) | (uint64_t(1024 >> 4) << 32) |
         (uint64_t(1) << 62);
}
// k16 step kk (keys 16 kk ..): start + 2048 kk.
__host__ __device__ constexpr uint64_t awg_v_desc(uint64_t desc0, int kk) { return desc0 + uint64_t(2048 >> 4) * kk; }

// m64nN f32 accumulator i of warpgroup thread wt: its row (0..63) and column.
__host__ __device__ constexpr int awg_acc_row(int wt, int i) { return 16 * (wt >> 5) + ((wt & 31) >> 2) + 8 * ((i >> 1) & 1); }
__host__ __device__ constexpr int awg_acc_col(int wt, int i) { return 8 * (i >> 2) + 2 * (wt & 3) + (i & 1); }
// P's A fragment, k16 step kk, register r (0..3) = bf16x2(S[awg_p_acc(kk, r)], S[awg_p_acc(kk, r) + 1]).
__host__ __device__ constexpr int awg_p_acc(int kk, int r) { return 8 * kk + 2 * r; }

// Work of CTA b: q tile (128 rows) and head.
struct AwgCta {
  int q_tile, h;
};
__host__ __device__ constexpr int awg_q_tiles(int T) { return (T + AWG_ROWS - 1) / AWG_ROWS; }
__host__ __device__ constexpr AwgCta awg_cta(int b, int T, int nH) { return {awg_q_tiles(T) - 1 - b / nH, b % nH}; }
// Key tiles that query rows [.., row_end) see (row_end <= T, exclusive): keys [0, pos0 + row_end).
__host__ __device__ constexpr int awg_key_tiles(int pos0, int row_end) { return (pos0 + row_end + AWG_KEYS - 1) / AWG_KEYS; }
// First row of key tile i the producer zeroes (rows >= pos0 + T), or AWG_KEYS when the tile has none.
__host__ __device__ constexpr int awg_tail_row(int pos0, int T, int i) {
  return pos0 + T - AWG_KEYS * i >= AWG_KEYS ? AWG_KEYS : pos0 + T - AWG_KEYS * i;
}
// A key of tile i is masked for the query at position qpos when key > qpos; only tiles reaching past the
// position of the warpgroup's first row (qpos0) need the test.
__host__ __device__ constexpr bool awg_tile_crosses(int i, int qpos0) { return AWG_KEYS * i + AWG_KEYS - 1 > qpos0; }

// ---- the online softmax of one consumer thread (host-callable: tests/emu/attn_wgmma_emu.cu runs it) ----
// 2^x: MUFU.EX2 with denormal results flushed to zero on the device (exp2f adds range fix-ups; a p
// below 2^-126 is nothing next to the row maximum's 1), exp2f on the host.
__host__ __device__ inline float awg_exp2(float x) {
#ifdef __CUDA_ARCH__
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return exp2f(x);
#endif
}
// s[32]: this thread's raw scores of key tile `tile` (awg_acc_row / awg_acc_col); qpos_g: the position
// (pos0 + row) of its row g (row g + 8 is qpos_g + 8). Masks key > qpos to -inf where the tile crosses
// the diagonal; the scale is applied in awg_exp.
__host__ __device__ inline void awg_mask(float (&s)[32], int wt, int tile, int qpos_g, bool crosses) {
  if (!crosses) return;
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    const int key = AWG_KEYS * tile + awg_acc_col(wt, i), qpos = qpos_g + 8 * ((i >> 1) & 1);
    if (key > qpos) s[i] = -INFINITY;
  }
}
// This thread's share of the raw row maxima (rows g, g + 8): two chains a row.
__host__ __device__ inline void awg_row_max(const float (&s)[32], float (&mx)[2]) {
  float c[2][2] = {{-INFINITY, -INFINITY}, {-INFINITY, -INFINITY}};
#pragma unroll
  for (int i = 0; i < 32; ++i) c[(i >> 1) & 1][(i >> 2) & 1] = fmaxf(c[(i >> 1) & 1][(i >> 2) & 1], s[i]);
  mx[0] = fmaxf(c[0][0], c[0][1]), mx[1] = fmaxf(c[1][0], c[1][1]);
}
// With the quad's raw row maxima mx: the running maxima in log2 units m' = max(m, mx * scale_log2)
// (finite: key 0 is visible to every row and tile 0 comes first), s = exp2(s * scale_log2 - m') in one
// FFMA, l = l * alpha + this thread's sum, alpha = exp2(m - m'); m = m'.
__host__ __device__ inline void awg_exp(float (&s)[32], const float (&mx)[2], float scale_log2, float (&m)[2],
                                        float (&l)[2], float (&alpha)[2]) {
  float mn[2], sum[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
#pragma unroll
  for (int r = 0; r < 2; ++r) mn[r] = fmaxf(m[r], mx[r] * scale_log2);
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    s[i] = awg_exp2(fmaf(s[i], scale_log2, -mn[(i >> 1) & 1]));
    sum[(i >> 1) & 1][(i >> 2) & 1] += s[i];
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    alpha[r] = awg_exp2(m[r] - mn[r]);
    m[r] = mn[r];
    l[r] = l[r] * alpha[r] + (sum[r][0] + sum[r][1]);
  }
}
// P as the A fragments of the 4 k16 steps of the P V product.
__host__ __device__ inline void awg_pack_p(const float (&s)[32], uint32_t (&pa)[4][4]) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
#pragma unroll
    for (int r = 0; r < 4; ++r) pa[kk][r] = wg_pack_bf16x2(s[awg_p_acc(kk, r)], s[awg_p_acc(kk, r) + 1]);
}

struct AwgParams {
  float* o;             // [T, nH*256] f32
  const int32_t* pos;   // [1] i32: pos0
  int T, nH, nKV, group;
  float scale_log2;     // log2(e) / 16
};

#ifdef __CUDACC__

// qb = bf16_rn(q), 8 values a thread (one 16-byte store); n % 8 == 0.
__global__ void attention_q_bf16_kernel(const float* __restrict__ q, uint16_t* __restrict__ qb, int64_t n) {
  pdl_wait();
  pdl_trigger();
  const int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
  if (i >= n) return;
  const float4 a = *reinterpret_cast<const float4*>(q + i), b = *reinterpret_cast<const float4*>(q + i + 4);
  *reinterpret_cast<uint4*>(qb + i) =
      make_uint4(wg_pack_bf16x2(a.x, a.y), wg_pack_bf16x2(a.z, a.w), wg_pack_bf16x2(b.x, b.y), wg_pack_bf16x2(b.z, b.w));
}

// The consumers' mbarrier wait: mbar_wait without its time-out trap. A trap on the consumers' path makes
// ptxas drop the setmaxnreg register budget (240) for the kernel's launch bound (168: spills, and C7512
// wgmma serialization); the producer keeps mbar_wait, so a protocol bug on its side still traps, while
// one that leaves a full barrier short hangs the consumers (the lab runs under a time-out).
__device__ __forceinline__ void awg_wait(uint32_t bar, uint32_t parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}

template <int N>
__device__ __forceinline__ void awg_fence_acc(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) fence_reg(d[i]);
}

__global__ void __launch_bounds__(AWG_THREADS, 1)
    attention_prefill_wgmma_kernel(const AwgParams p, const __grid_constant__ CUtensorMap tmap_q,
                                   const __grid_constant__ CUtensorMap tmap_k, const __grid_constant__ CUtensorMap tmap_v) {
  pdl_wait();
  pdl_trigger();
  extern __shared__ uint8_t smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + 1023) & ~1023u;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  if (tid == 0) {
    mbar_init(base + awg_bar_q_full(), 1);
    mbar_init(base + awg_bar_v_tail(), 1);
    for (int s = 0; s < AWG_K_STAGES; ++s) {
      mbar_init(base + awg_bar_full_k(s), 1);
      mbar_init(base + awg_bar_empty_k(s), 8);  // one arrival per consumer warp
    }
    for (int s = 0; s < AWG_V_STAGES; ++s) {
      mbar_init(base + awg_bar_full_v(s), 1);
      mbar_init(base + awg_bar_empty_v(s), 8);
    }
    mbar_init_fence();
  }
  __syncthreads();

  const AwgCta cta = awg_cta(blockIdx.x, p.T, p.nH);
  const int pos0 = *p.pos, t0 = cta.q_tile * AWG_ROWS, kvh = cta.h / p.group;
  const int n_tiles = awg_key_tiles(pos0, min(t0 + AWG_ROWS, p.T));

  if (warp < 4) {  // ---------------- producer ----------------
    setmaxnreg_dec<AWG_PRODUCER_REGS>();
    if (warp != 0) return;
    if (lane == 0) {  // Q rows of the warpgroups that have rows (warpgroup 0 always has)
      const int q_wgs = t0 + AWG_WG_ROWS < p.T ? 2 : 1;
      mbar_arrive_expect_tx(base + awg_bar_q_full(), q_wgs * AWG_TILE_BYTES);
      for (int cw = 0; cw < q_wgs; ++cw)
        for (int j = 0; j < AWG_D / 64; ++j)
          tma_load_2d(base + awg_q_off(cw, j), &tmap_q, base + awg_bar_q_full(), cta.h * AWG_D + 64 * j,
                      t0 + AWG_WG_ROWS * cw);
    }
    for (int i = 0; i < n_tiles; ++i) {
      const int ks = awg_k_stage(i), s = awg_v_stage(i);
      if (lane == 0) {  // a fresh barrier's "previous" phase (parity 1) counts as complete: no wait at first
        mbar_wait(base + awg_bar_empty_k(ks), awg_k_phase(i) ^ 1);
        mbar_arrive_expect_tx(base + awg_bar_full_k(ks), AWG_TILE_BYTES);
        for (int j = 0; j < AWG_D / 64; ++j)
          tma_load_2d(base + awg_k_off(ks, j), &tmap_k, base + awg_bar_full_k(ks), kvh * AWG_D + 64 * j, AWG_KEYS * i);
      }
      const int tail = awg_tail_row(pos0, p.T, i);
      const uint32_t vbar = base + (tail < AWG_KEYS ? awg_bar_v_tail() : awg_bar_full_v(s));
      if (lane == 0) {
        mbar_wait(base + awg_bar_empty_v(s), awg_v_phase(i) ^ 1);
        mbar_arrive_expect_tx(vbar, AWG_TILE_BYTES);
        for (int j = 0; j < AWG_D / 64; ++j)
          tma_load_2d(base + awg_v_off(s) + j * AWG_BOX_BYTES, &tmap_v, vbar, kvh * AWG_D + 64 * j, AWG_KEYS * i);
      }
      if (tail < AWG_KEYS) {  // the one tile past pos0 + T (its phase 0 of v_tail): zero rows >= tail
        __syncwarp();
        mbar_wait(base + awg_bar_v_tail(), 0);
        // Whole 128-byte rows: the swizzle permutes chunks inside a row, so row r of a block is
        // bytes [r*128, r*128 + 128) of it.
        for (int x = tail * 8 + lane; x < AWG_KEYS * 8; x += 32)  // 16-byte chunks of rows tail..63
          for (int j = 0; j < AWG_D / 64; ++j)
            st_shared_v4(base + awg_v_off(s) + j * AWG_BOX_BYTES + 16 * x, 0.f, 0.f, 0.f, 0.f);
        fence_proxy_async();  // the async proxy (wgmma) reads what these generic stores wrote
        __syncwarp();
        if (lane == 0) mbar_arrive(base + awg_bar_full_v(s));
      }
    }
    return;
  }

  // ---------------- consumers ----------------
  setmaxnreg_inc<AWG_CONSUMER_REGS>();
  const int cw = warp / 4 - 1, wt = tid - 128 * (cw + 1);
  const int row0 = t0 + AWG_WG_ROWS * cw;                                  // this warpgroup's first row
  const int my_tiles = row0 < p.T ? awg_key_tiles(pos0, min(row0 + AWG_WG_ROWS, p.T)) : 0;
  const int qpos_g = pos0 + row0 + awg_acc_row(wt, 0);                     // position of row g
  const uint32_t q_block = base + awg_q_off(cw, 0);
  float o[128];
#pragma unroll
  for (int x = 0; x < 128; ++x) o[x] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // l: this thread's columns only
  const auto release = [&](int bar) {
    if (lane == 0) mbar_arrive(base + bar);
  };
  const auto wait_k = [&](int i) { awg_wait(base + awg_bar_full_k(awg_k_stage(i)), awg_k_phase(i)); };
  const auto wait_v = [&](int i) { awg_wait(base + awg_bar_full_v(awg_v_stage(i)), awg_v_phase(i)); };
  // Queues S = Q K_i^T into sc (one commit group; K_i has landed: wait_k).
  const auto issue_qk = [&](int i, float (&sc)[32]) {
    const int s = awg_k_stage(i);
#pragma unroll
    for (int x = 0; x < 32; ++x) sc[x] = 0.f;
    // The descriptor bases opaque, the steps added per instruction: hoisted out of the loop, the 32
    // descriptors would hold 64 registers (spills).
    uint64_t qd = wg_desc(q_block), kd = wg_desc(base + awg_k_off(s, 0));
    asm volatile("" : "+l"(qd), "+l"(kd));
    awg_fence_acc(sc);
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < AWG_D / 64; ++j)
#pragma unroll
      for (int k16 = 0; k16 < 4; ++k16) wgmma_m64n64k16_ss(sc, awg_qk_desc(qd, j, k16), awg_qk_desc(kd, j, k16));
    wgmma_commit();
  };
  // Queues O += P_i V_i (one commit group; V_i has landed: wait_v).
  const auto issue_pv = [&](int i, const uint32_t (&pa)[4][4]) {
    const int s = awg_v_stage(i);
    uint64_t vd = awg_v_desc0(base + awg_v_off(s));
    asm volatile("" : "+l"(vd));
    awg_fence_acc(o);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_m64n256k16_rA<1>(o, pa[kk], awg_v_desc(vd, kk));  // d += P V, B MN-major
    wgmma_commit();
  };
  // The online softmax of the finished S_i: P_i into pa, the rescale factor of O into alpha.
  const auto softmax = [&](int i, float (&sc)[32], uint32_t (&pa)[4][4], float (&alpha)[2]) {
    awg_mask(sc, wt, i, qpos_g, awg_tile_crosses(i, pos0 + row0));
    float mx[2];
    awg_row_max(sc, mx);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    }
    awg_exp(sc, mx, p.scale_log2, m, l, alpha);
    awg_pack_p(sc, pa);
  };
  const auto rescale = [&](const float (&alpha)[2]) {
#pragma unroll
    for (int x = 0; x < 128; ++x) o[x] *= alpha[(x >> 1) & 1];
  };
  awg_wait(base + awg_bar_q_full(), 0);

  float sc[32], alpha[2];
  uint32_t pa[4][4];
  if (my_tiles > 0) {
    // Tile i's softmax runs while the tensor cores do P_{i-1} V_{i-1}; O is rescaled by tile i's alpha
    // once that product is done (it is relative to the previous maximum).
    wait_k(0);
    issue_qk(0, sc);
    wgmma_wait<0>();
    awg_fence_acc(sc);
    release(awg_bar_empty_k(0));
    softmax(0, sc, pa, alpha);  // O is still zero: no rescale
    uint32_t pb[4][4];
    // Step i: S_i and P_{i-1} V_{i-1} queued (P_{i-1} in p_prev), the softmax of S_i into p_next while
    // the product runs, O rescaled once it is done.
    const auto step = [&](int i, const uint32_t (&p_prev)[4][4], uint32_t (&p_next)[4][4]) {
      wait_k(i);
      wait_v(i - 1);
      issue_qk(i, sc);
      issue_pv(i - 1, p_prev);
      wgmma_wait<1>();  // S_i done (groups retire in order); P_{i-1} V_{i-1} may still run
      awg_fence_acc(sc);
      release(awg_bar_empty_k(awg_k_stage(i)));
      softmax(i, sc, p_next, alpha);
      wgmma_wait<0>();
      awg_fence_acc(o);
      release(awg_bar_empty_v(awg_v_stage(i - 1)));
      rescale(alpha);
    };
    // P alternates between pa and pb. A copy pb -> pa would let ptxas give the next P the registers of
    // the one in flight, which it then serialises (C7513).
    int i = 1;
#pragma unroll 1
    for (; i + 1 < my_tiles; i += 2) {
      step(i, pa, pb);
      step(i + 1, pb, pa);
    }
    if (i < my_tiles) step(i, pa, pb);
    wait_v(my_tiles - 1);
    if (i < my_tiles) issue_pv(my_tiles - 1, pb);
    else issue_pv(my_tiles - 1, pa);
    wgmma_wait<0>();
    awg_fence_acc(o);
    release(awg_bar_empty_v(awg_v_stage(my_tiles - 1)));
  }
  // Tiles no row of this warpgroup sees (warpgroup 0 on the diagonal, or a warpgroup with no rows):
  // release them once they have landed.
#pragma unroll 1
  for (int i = my_tiles; i < n_tiles; ++i) {
    wait_k(i);
    wait_v(i);
    release(awg_bar_empty_k(awg_k_stage(i)));
    release(awg_bar_empty_v(awg_v_stage(i)));
  }

  // o = O / l for this thread's rows g, g + 8 (l summed over the quad's columns).
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + awg_acc_row(wt, 2 * r);
    if (row >= p.T) continue;
    const float inv_l = 1.f / l[r];
    float* dst = p.o + (int64_t(row) * p.nH + cta.h) * AWG_D;
#pragma unroll
    for (int x = 2 * r; x < 128; x += 4)
      *reinterpret_cast<float2*>(dst + awg_acc_col(wt, x)) = make_float2(o[x] * inv_l, o[x + 1] * inv_l);
  }
}

#endif  // __CUDACC__

}  // namespace lily::cuda::attn
