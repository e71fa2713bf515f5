// Chunked (WY) Gated DeltaNet prefill (device code only; launcher in gated_delta.cu). The algebra
// is derived in docs/gdn-prefill.md; the result matches the sequential cpu/gated_delta.cpp.
// Per value head h (key head kh = h / (Hv/Hk)), chunks of C = 64 tokens, state S [Dk, Dv] at the
// chunk's start, rows = tokens of the chunk (q, k L2-normalised, q also scaled by 1/sqrt(Dk)):
//   G_t = sum_{s<=t} g_s (log of the cumulative decay),  beta_t = sigmoid(b_t)
//   A[t, s] = beta_t exp(G_t - G_s) (k_t . k_s) for s < t (else 0);   Tinv = (I + A)^-1
//   U = Tinv (beta * V),  W = Tinv ((beta exp(G)) * K),  P[t, s] = exp(G_t - G_s) (q_t . k_s), s <= t
//   Delta = U - W S;  O = (exp(G) * Q) S + P Delta;  S <- exp(G_last) S + (exp(G_last - G) * K)^T Delta
// Two kernels: prep_kernel (parallel over chunks and heads) writes U, W, P and the per-token row
// factors of q and k to a workspace; scan_kernel runs the chunks in order and reads q, k straight
// from qkv. Only Dk = Dv = 128 (the model's). G in fp64.
//
// Tensor cores, 3xBF16. Every matrix product (K K^T, Q K^T and the substitution's in the prep; W S, Q S,
// P Delta, K^T Delta in the scan) runs on mma.sync.m16n8k16 bf16 with fp32 accumulation, each fp32 operand x split as
// x = hi + lo, hi = bf16(x), lo = bf16(x - hi) (cvt.rn.bf16x2.f32, round to nearest even; x - hi is
// exact), and a b = a_lo b_hi + a_hi b_lo + a_hi b_hi: the dropped a_lo b_lo and the rounding of lo are
// each <= 2^-16 |a b| (3xTF32, the kernels' first form, left <= 2^-22; one tf32 product 2^-11) at 3
// tensor-core ops per 16-deep k-step, 3xTF32's 6. The host emulation (benchmarks/gdn_emu.cpp) measures
// 6-8e-6 from fp64 on o and state at T = 64..4096, within the 2e-5 chunked-vs-token-kernel tolerance
// (docs/gdn-prefill.md, "Error budget"). The forward substitution (I + A) X = B runs blocked: the
// products with A's blocks below the diagonal and with the inverses of its 16 x 16 diagonal blocks on
// the tensor cores, those inverses in fp32 SIMT FMA (prep step 4). The kernels take
// the form of each product as a compile-time Precision (below); the engine's is EnginePrecision, and
// gdn_emu's sweep measures the others.
//
// Fragment layout of mma.m16n8k16 .bf16 (PTX ISA), g = lane / 4, c = lane % 4; a register holds two
// bf16, the lower k in its low half:
//   A [16 x 16]: a0 (g, k 2c, 2c+1)  a1 (g+8, 2c, 2c+1)  a2 (g, 2c+8, 2c+9)  a3 (g+8, 2c+8, 2c+9)
//   B [16 x 8]:  b0 (k 2c, 2c+1; n = g)  b1 (k 2c+8, 2c+9; n = g)
//   C [16 x 8]:  c0 (g, 2c)  c1 (g, 2c+1)  c2 (g+8, 2c)  c3 (g+8, 2c+1)
// k order: a product's sum over k does not depend on which mma slot a k index takes, as long as A and B
// agree. Here slot pair p of a 16-deep k-step (the register halves a0/b0 hold for p = c, a2/b1 for
// p = 4 + c) takes k = p and p + 8 of the step: the columns c, c + 8 and c + 4, c + 12 that two
// ldmatrix.x4 of a row-major fp32 tile (columns 0-7, 8-15) hand lane (g, c), and the rows g, g + 8 that
// a C fragment holds, so S and Delta (the next products' B, k = their rows) are stored as such pairs,
// and so is W (the scan's A of W S), which the prep writes already split.
#pragma once
#include <cstddef>  // offsetof
#ifndef LILY_GDN_HOST_EMU  // benchmarks/gdn_emu.cpp compiles this file on the host with its own shim
#include "gated_delta.cuh"
#endif

// Everything of the chunked prefill lives in this namespace: the sizes, the workspace layout, the
// 3xBF16 and cp.async helpers and the two kernels (gated_delta.cu says gdn_chunk::C, ...).
namespace lily::cuda::gdn_chunk {

constexpr int C = 64;          // tokens per chunk
constexpr int D = 128;         // Dk = Dv
constexpr int THREADS = 256;   // 8 warps: a scan role, a prep head (both kernels run 2 x THREADS)
constexpr int COLS = 32;       // state columns per scan CTA
// Shared row strides (32-bit words: floats, or bf16 pairs in S^T and Delta^T), chosen for conflict-free
// fragment loads: a row-major A fragment or a [n][k] B fragment is read by ldmatrix (8 rows of 16 bytes
// per matrix) -> ld % 32 == 4, which also makes the scalar stores of a C fragment transposed
// ((2c + e) * ld + g) conflict-free; a transposed A fragment reads (c * ld + g) -> ld % 32 == 8; a C
// fragment read in place (g * ld + 2c) too.
constexpr int LD = D + 4;      // [64, 128] tiles read as A or as [n][k] B (132)
constexpr int KLD = D + 8;     // the scan's K tile, read transposed (136)
constexpr int PLD = C + 4;     // [64, 64] tiles read as A (68)
// The prep's step 4 reads B fragments in natural k order as float2 (g * ld + 2c, the C-fragment pattern
// above) -> ld % 32 == 8:
constexpr int ALD = C + 8;     // the prep's A [64, 64] (72)
constexpr int TLD = 16 + 8;    // the prep's T [64, 16]: the four 16 x 16 diagonal blocks of Tinv, less I (24)
constexpr int NLD = COLS + 8;  // the scan's U tile [64, 32], read in C-fragment order (40)
constexpr int SLD = D / 2 + 4; // the scan's S^T [32 columns][64 pairs of rows], read as [n][k] B (68)
constexpr int DLD = C / 2 + 4; // the scan's Delta^T [32 columns][32 pairs of tokens], read as [n][k] B (36)

// Workspace: one block of BLOCK floats per (chunk c, value head h) at (c * Hv + h) * BLOCK, tiles
// row-major with rows = the chunk's tokens; rows past the end of the prompt are zeros. WS_* are the
// offsets (floats) of its pieces.
constexpr int WS_W = 0;               // [C, D] W, split: per row and 16-column k-step the 8 hi words
                                      // (word p: bf16 of columns p, p + 8, the k slot pair p of the
                                      // table at the top), then the 8 lo words; bit patterns in floats
constexpr int WS_U = C * D;           // [C, D] U
constexpr int WS_P = 2 * C * D;       // [C, C] P: zero above the diagonal inside the 8-column tiles it
                                      // touches; tiles wholly above (8 nt > 16 mt + 15) are never
                                      // written nor read
constexpr int WS_FQ = WS_P + C * C;   // [C] exp(G_t) / sqrt(Dk) / |q_t|   (0 past the prompt)
constexpr int WS_FK = WS_FQ + C;      // [C] exp(G_last - G_t) / |k_t|      (0 past the prompt)
constexpr int WS_GC = WS_FK + C;      // exp(G_last), then 3 floats of padding
constexpr int BLOCK = WS_GC + 4;      // floats; a multiple of 4 (16-byte blocks)

struct Params {
  const float* qkv;      // [T, 2*Hk*D + Hv*D]
  const float* a;        // [T, Hv]
  const float* b;        // [T, Hv]
  const float* A_log;    // [Hv]
  const float* dt_bias;  // [Hv]
  float* state;          // [Hv, D, D] (k-major), read and written once per call
  float* o;              // [T, Hv*D]
  float* ws;             // [num_chunks * Hv * BLOCK]
  int T, Hk, Hv, num_chunks;
  // The conv in the prep (conv_gated_delta_rule; null u: qkv holds the conv's output already). u [T, Wd]: the
  // conv's input; conv_w [Wd, CONV_K]; conv_state [CONV_K - 1, Wd] (the inputs before token 0, oldest first);
  // conv_state_out [CONV_K - 1, Wd] (conv_state itself or apart) gets the last CONV_K - 1 inputs. The prep
  // applies conv1d_silu's arithmetic (conv_silu_out) to the rows it loads and writes q and k's conv rows to
  // qkv (y_qk: qkv, writable) for the scan; v's only to its shared tiles. Needs Hv <= 2 Hk (one prep CTA a key
  // head and a chunk: no other CTA reads the state columns that CTA's chunk-0 instance overwrites).
  const float* u = nullptr;
  const float* conv_w = nullptr;
  const float* conv_state = nullptr;
  float* conv_state_out = nullptr;
  float* y_qk = nullptr;
};
constexpr int CONV_K = 4;  // the fused conv's taps (the model's linear_conv_kernel_dim)

__device__ __forceinline__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ void st4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
__device__ __forceinline__ float4 scale4(float f, float4 v) { return make_float4(f * v.x, f * v.y, f * v.z, f * v.w); }
__device__ __forceinline__ void st2(float* p, float x, float y) { *reinterpret_cast<float2*>(p) = make_float2(x, y); }

// ---- 3xBF16 pieces ----------------------------------------------------------------------------
struct Split {  // a fragment register's hi and lo halves (each two bf16)
  uint32_t hi, lo;
};
#ifndef LILY_GDN_HOST_EMU
// d += a b, one m16n8k16 bf16 mma (fragments as in the table at the top).
__device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// bf16(x0) in the low half, bf16(x1) in the high half (round to nearest even)
__device__ __forceinline__ uint32_t bf16x2(float x0, float x1) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(x1), "f"(x0));
  return r;
}
// the shared-space address (32 bits) of a pointer into shared memory
__device__ __forceinline__ uint32_t saddr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
// 16 bytes from src to the shared address dst
__device__ __forceinline__ void cp16(uint32_t dst, const float* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
// 16 bytes from src if valid, else 16 zero bytes (src is not read then, but must be a valid address).
__device__ __forceinline__ void cp16z(uint32_t dst, const float* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
// ldmatrix .x4 (four 8 x 8 b16 matrices, here read as 8 rows x 4 32-bit words): lanes 8 i .. 8 i + 7
// give the row addresses (16 bytes each) of matrix i, and lane l receives in r[i] the b16 pair at
// columns 2 (l % 4), 2 (l % 4) + 1 of row l / 4 of matrix i, i.e. word l % 4 of that row, unchanged.
__device__ __forceinline__ void ldsm4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
// hints, nothing waits for them: the L2 fetches bytes (a multiple of 16) at src (16-byte aligned; one
// request, best from one thread: it takes a uniform address), or the 128-byte line holding src
__device__ __forceinline__ void prefetch_l2(const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(src), "r"(bytes));
}
__device__ __forceinline__ void prefetch_line(const void* src) { asm volatile("prefetch.global.L2 [%0];\n" ::"l"(src)); }
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>  // this thread's cp.async groups but the newest N have landed
__device__ __forceinline__ void wait_group() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
// named barrier id of n threads: wait for all n (bar.sync), or count this thread's arrival and go on
// (bar.arrive); the shared-memory accesses before either are visible to the threads past the bar.sync
__device__ __forceinline__ void bar_sync(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void bar_arrive(int id, int n) { asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ unsigned char* smem() {
  extern __shared__ __align__(16) unsigned char dyn_smem[];
  return dyn_smem;
}
#endif

// the split of two values: x0 to the low halves (the lower k slot), x1 to the high ones
__device__ __forceinline__ Split split2(float x0, float x1) {
  const uint32_t hi = bf16x2(x0, x1);  // x - hi is exact in fp32
  return {hi, bf16x2(x0 - __uint_as_float(hi << 16), x1 - __uint_as_float(hi & 0xffff0000u))};
}

// How a product a b is formed from the splits a = a_hi + a_lo, b = b_hi + b_lo (one choice per
// product, a compile-time Precision; benchmarks/gdn_emu.cpp measures each against fp64):
enum Prec : int {
  X1,  // a_hi b_hi: 1 mma; both operands' bf16 roundings (<= 2^-9 each) stay
  XA,  // a_hi b_hi + a_lo b_hi: 2 mma; b's rounding stays (a split, b hi only)
  XB,  // a_hi b_hi + a_hi b_lo: 2 mma; a's rounding stays (b split, a hi only)
  X3,  // a_hi b_hi + a_lo b_hi + a_hi b_lo: 3 mma (the dropped terms <= ~2^-16 |a b|)
};
__host__ __device__ constexpr bool uses_a_lo(Prec m) { return m == XA || m == X3; }
__host__ __device__ constexpr bool uses_b_lo(Prec m) { return m == XB || m == X3; }
// One Prec per product: K K^T, Q K^T (prep); W S, (fq Q) S, P Delta, (fk K)^T Delta (scan); FS: the
// prep's blocked forward substitution (A_ij X_j and (T_ii - I) R_i, step 4).
template <Prec KK_, Prec QK_, Prec WS_, Prec QS_, Prec PD_, Prec KD_, Prec FS_>
struct Precision {
  static constexpr Prec KK = KK_, QK = QK_, WS = WS_, QS = QS_, PD = PD_, KD = KD_, FS = FS_;
};
using EnginePrecision = Precision<X3, X3, X3, X3, X3, X3, X3>;

// a b in precision M: big += a_hi b_hi, small += the cross terms M keeps; the caller adds small to big
// after its k loop. Two accumulators make two independent mma chains per output tile (mma.sync
// latency, not throughput, bounds a warp with few tiles). Halves M does not use are never read.
template <Prec M>
__device__ __forceinline__ void mma_p(float (&big)[4], float (&small)[4], const Split (&a)[4], Split b0, Split b1) {
  if constexpr (uses_a_lo(M)) mma(small, a[0].lo, a[1].lo, a[2].lo, a[3].lo, b0.hi, b1.hi);
  mma(big, a[0].hi, a[1].hi, a[2].hi, a[3].hi, b0.hi, b1.hi);
  if constexpr (uses_b_lo(M)) mma(small, a[0].hi, a[1].hi, a[2].hi, a[3].hi, b0.lo, b1.lo);
}
// Fragments by ldmatrix (ldsm4 above) of fp32 tiles: a row-major tile X [m][k] holds a 16-row x
// 8-column block as four 8-row x 4-word matrices, rows 0-7 | 8-15 x words 0-3 | 4-7, so that lane
// (g, c) receives X[g][c], X[g+8][c], X[g][c+4], X[g+8][c+4]; lane l gives the address of row l % 16,
// word 4 (l / 16) (lsm_a). Two of them (columns 0-7, 8-15) make an A fragment of a k-step. A tile
// stored [n][k] gives the B fragment of an n8 tile and a k-step as four matrices, words 0-3, 4-7, 8-11,
// 12-15 of rows n 0-7: lane (g, c) receives Y[g][c], Y[g][c+4], Y[g][c+8], Y[g][c+12]; lane l gives
// row l % 8, word 4 (l / 8) (lsm_b4). The words arrive unchanged: the same values as element-wise loads.
// Pre-split B tiles (S, Delta) hold bf16 pairs, 8 words a k-step: rows n 0-7 | 8-15 x words 0-3 | 4-7
// are b0, b1 of two n8 tiles; lane l gives row l % 8 + 8 (l / 16), word 4 ((l / 8) % 2) (lsm_b2). The
// pre-split A tile (W: 8 hi words, then 8 lo words a k-step) takes lsm_a's pattern: the hi words where
// an fp32 tile has its columns 0-7, the lo words where it has 8-15 (frag_a_pre).
template <int LD>  // this lane's ldmatrix offset (words) from the block's (row 0, word 0)
__device__ __forceinline__ int lsm_a(int lane) { return (lane & 15) * LD + 4 * (lane >> 4); }
template <int LD>
__device__ __forceinline__ int lsm_b4(int lane) { return (lane & 7) * LD + 4 * (lane >> 3); }
template <int LD>
__device__ __forceinline__ int lsm_b2(int lane) { return ((lane & 7) + 8 * (lane >> 4)) * LD + 4 * ((lane >> 3) & 1); }
// A fragment of a k-step (16 columns) of a row-major fp32 tile (addr: this lane's lsm_a address at the
// step's column 0); rows g and g + 8 scaled by f0, f1 (1.f: exact).
__device__ __forceinline__ void frag_a(Split (&a)[4], uint32_t addr, float f0 = 1.f, float f1 = 1.f) {
  uint32_t r[4], t[4];
  ldsm4(r, addr);       // columns 0-7
  ldsm4(t, addr + 32);  // columns 8-15
  a[0] = split2(f0 * __uint_as_float(r[0]), f0 * __uint_as_float(t[0]));  // row g, k c and c + 8
  a[1] = split2(f1 * __uint_as_float(r[1]), f1 * __uint_as_float(t[1]));  // row g + 8
  a[2] = split2(f0 * __uint_as_float(r[2]), f0 * __uint_as_float(t[2]));  // row g, k c + 4 and c + 12
  a[3] = split2(f1 * __uint_as_float(r[3]), f1 * __uint_as_float(t[3]));
}
// A fragment of a k-step of a pre-split row-major tile (W): per row and k-step 8 hi words, word p the
// pair (k p, p + 8) as a0 / a2 hold it, then the 8 lo words (addr: this lane's lsm_a address at the
// step's hi words; the lo words, 32 bytes on, read only if LO). The fp32 form's ldmatrix pattern, no cvt.
template <bool LO>
__device__ __forceinline__ void frag_a_pre(Split (&a)[4], uint32_t addr) {
  uint32_t hi[4], lo[4] = {};
  ldsm4(hi, addr);
  if constexpr (LO) ldsm4(lo, addr + 32);
#pragma unroll
  for (int i = 0; i < 4; ++i) a[i] = {hi[i], lo[i]};
}
// A fragment of a k-step of the transpose of a row-major tile X [k][m]: A[m][k] = fk[k] X[k][m]; t points
// at X[k0][m0], fk at fk[k0].
template <int LD>
__device__ __forceinline__ void frag_at(Split (&a)[4], const float* t, const float* fk, int g, int c) {
  const float f0 = fk[c], f1 = fk[c + 8], f2 = fk[c + 4], f3 = fk[c + 12];
  a[0] = split2(f0 * t[c * LD + g], f1 * t[(c + 8) * LD + g]);
  a[1] = split2(f0 * t[c * LD + g + 8], f1 * t[(c + 8) * LD + g + 8]);
  a[2] = split2(f2 * t[(c + 4) * LD + g], f3 * t[(c + 12) * LD + g]);
  a[3] = split2(f2 * t[(c + 4) * LD + g + 8], f3 * t[(c + 12) * LD + g + 8]);
}
// B fragment of a k-step of an n8 tile of an fp32 tile stored [n][k] (B = X^T; addr: this lane's lsm_b4
// address).
__device__ __forceinline__ void frag_bt(Split& b0, Split& b1, uint32_t addr) {
  uint32_t r[4];
  ldsm4(r, addr);
  b0 = split2(__uint_as_float(r[0]), __uint_as_float(r[2]));  // k c and c + 8
  b1 = split2(__uint_as_float(r[1]), __uint_as_float(r[3]));  // k c + 4 and c + 12
}
// B fragments {b0, b1} of two n8 tiles t0, t1 of a pre-split [n][k] tile: the hi words at addr (this
// lane's lsm_b2 address), the lo words lo_off bytes further (read only if LO).
template <bool LO>
__device__ __forceinline__ void frag_b2_pre(Split (&t0)[2], Split (&t1)[2], uint32_t addr, uint32_t lo_off) {
  uint32_t hi[4], lo[4] = {};
  ldsm4(hi, addr);
  if constexpr (LO) ldsm4(lo, addr + lo_off);
  t0[0] = {hi[0], lo[0]};
  t0[1] = {hi[1], lo[1]};
  t1[0] = {hi[2], lo[2]};
  t1[1] = {hi[3], lo[3]};
}
// stores the split of the pair (x0, x1) at hi/lo word i (the lo word only if LO)
template <bool LO>
__device__ __forceinline__ void st_pair(uint32_t* th, uint32_t* tl, int i, float x0, float x1) {
  const Split sx = split2(x0, x1);
  th[i] = sx.hi;
  if constexpr (LO) tl[i] = sx.lo;
}

// cp.async of this thread's 8 float4 of a [64, 128] tile of q, k or v rows (rows warp + 8 i, float4 lane):
// dst = its row-warp shared address (rows LD floats apart), src = its row-warp source, step = 8 rows of
// source; in a partial chunk (n < C, the last) rows >= n are zero-filled, their source then `safe` (a
// valid address).
template <int LD>
__device__ __forceinline__ void copy_rows(uint32_t dst, const float* src, int64_t step, int n, int warp,
                                          const float* safe) {
  if (n == C) {
#pragma unroll
    for (int i = 0; i < 8; ++i, src += step) cp16(dst + 8 * LD * 4 * i, src);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i, src += step) {
      const bool ok = warp + 8 * i < n;
      cp16z(dst + 8 * LD * 4 * i, ok ? src : safe, ok);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// prep_kernel: one CTA per (chunk c, pair of value heads of one key head), grid (num_chunks,
// prep_pairs(Hk, Hv)), block 512 (16 warps), 1 CTA/SM. Key head kh's R = Hv / Hk value heads kh R ..
// kh R + R - 1 go two to a CTA: with y = blockIdx.y and P = ceil(R / 2), kh = y / P and the heads
// h0 = kh R + 2 (y % P) (slot 0) and h0 + 1 (slot 1; none when R is odd and h0 is kh's last head). Both
// read the same q, k rows, so the CTA loads and normalises them once and forms the raw products K K^T and
// Q K^T once (the model's R = 2: every pair shares them); the gates, G, the epilogues and step 4 are per
// head. Warps 8 s .. 8 s + 7 are slot s's for its v rows (step 1) and step 4; warp 8 + s runs its step 2.
//   1. q and k rows (rows r < 64 are q, r >= 64 are k; warp w does r = w + 16 i, i < 8), loaded and
//      L2-normalised (a float4 per lane), staged in shared memory with their norm factors; rows >= n
//      are zeros; beta, g of slot tid / 64, token tid % 64 (threads 0..127). All 8 rows of a warp and the
//      gate inputs are loaded before any is used. Then, its rows in hand, each warp of slot s requests its
//      8 of the head's 64 raw v rows by cp.async into v[s]: issued once the warp's q, k rows have arrived
//      (the norms used them), so that these 64 KB a CTA do not compete with the rows on the critical path;
//      they land during steps 2-3.
//   2. G = inclusive prefix sum of g in fp64 (warp 8 + s for slot s, a shuffle scan; before its step-3
//      tiles, while the other warps run theirs): exp(G_t - G_s) is formed from an fp64 difference, so a
//      chunk whose early tokens decay hard (G ~ -1000) keeps exact late decays. Row factors
//      fq = exp(G) / sqrt(Dk) / |q|, fk = exp(G_last - G) / |k| and exp(G_last) to the head's workspace
//      block (the scan applies them to the raw q, k rows of qkv).
//   3. K K^T and Q K^T on the tensor cores, 3xBF16, once for both heads. Only the 20 of 32 m16n8 tiles
//      [16 mt, 8 nt] with nt <= 2 mt + 1 touch the lower triangle; the 2 x 20 tiles (K K^T's 0-19, Q K^T's
//      20-39) are dealt round-robin, warp w doing tiles w + 16 i < 40 (3 on warps 0-7, 2 on warps 8-15,
//      which ran step 2), each a K = 128 loop of 8 k-steps (A fragment from q or k rows, B = K^T from k
//      rows), the raw accumulators kept in registers over the barrier after which G is ready. Epilogue
//      per head and element (t, s): A = beta_t exp(G_t - G_s) acc if s < t < n, else 0 (to nA[slot],
//      stored negated: step 4 subtracts); P = exp(G_t - G_s) acc if s <= t < n, else 0 (to the head's
//      workspace block); exp of a positive exponent is never taken.
//   4. Per head, on its slot's 8 warps (w8 = w % 8 below): (I + A) X = B, X = [U | W] and
//      B = [beta V | beta exp(G) K] (64 x 256), by forward substitution blocked by the four 16-token blocks
//      i (rows 16 i ..): R_i = B_i - sum_{j<i} A_ij X_j, X_i = T_ii R_i, T_ii = (I + A_ii)^-1. First warps
//      w8 = 4-5 form T_ii - I into T[slot] (a thread per column of a diagonal block: a 16 x 16 unit lower
//      solve, <= 120 fp32 FMA). Then warp w8 owns 32 columns of X (0-3 of U, 4-7 of W) and runs, on the
//      tensor cores in the form PR::FS (3xBF16, one accumulator), the transpose block by block:
//      R_i^T = B_i^T - sum_{j<i} X_j^T A_ij^T, then X_i^T = R_i^T + R_i^T (T_ii - I)^T (the identity part
//      exact: R_i is the accumulator's start). m = the warp's columns (two m16 tiles), n = block i's
//      tokens (two n8 tiles), k = block j's tokens (one k-step): 10 k-steps x 4 tiles x 3 mma a warp,
//      where the fp32 form took 2,016 dependent FMA a column. The transposed form needs no exchange
//      between warps or lanes: the C fragments of X_j^T (columns g, g + 8; tokens 2c, 2c + 1 of each n8
//      tile) are, as they stand, the A fragment of block j's k-step in natural k order (k 2c, 2c + 1 in
//      a0 / a1; 2c + 8, 2c + 9 in a2 / a3), kept split in the warp's own columns of a stash tile laid out
//      as B's rows, block j's 16 rows: for U the head's v rows themselves (block j's are used up by then),
//      for W a tile of its own (slot 0: q's rows, free after step 3; slot 1: xw), the k rows being read by
//      both heads' W warps. The B fragments (element (k s, n t) = -A[t][s], or T's) are float2 loads of
//      row t, columns 2c and 2c + 8 (ALD, TLD). B_i^T: the v or k rows times the row factor; X to the
//      workspace from the C fragments (scalar stores, 32-byte runs of 8 columns): U as it is, W split for
//      the scan (a lane's columns g, g + 8 of an m16 tile are the pair p = g of a k-step: its hi word
//      where column g goes, its lo word where g + 8 does, the layout of WS_W; the same split2 the scan did
//      at load). The block loop stays rolled (unrolled, ptxas hoists the later blocks' loads and spills).
// Each head's every value is formed as the one-head CTA (grid (num_chunks, Hv), 256 threads, 2 CTAs/SM,
// until 2026-12-03) formed it: the same products, epilogue and substitution in the same order; a CTA now
// does the q, k loads, norms and step 3's 40 tiles once for two heads (docs/perf-notes.md, "the GDN prep
// once per key head").
// A global load whose use follows it in the same branch (`if (t < n) x = beta * v[t]`) costs the warp
// a full memory latency each: the loads here are unconditional, use-free in their branch or cp.async,
// and ptxas then issues them back to back (check the SASS after editing these loops).
// Rows >= n of every output are zeros (zero q, k, beta and decay factors), so the scan needs no masks
// but on its writes of o.
constexpr int PREP_THREADS = 2 * THREADS;
// prep CTAs along y: ceil(R / 2) pairs of value heads for each of the Hk key heads, R = Hv / Hk
__host__ __device__ constexpr int prep_pairs(int Hk, int Hv) { return Hk * ((Hv / Hk + 1) / 2); }
struct PrepSmem {
  float q[C][LD];     // normalised, scaled q rows (steps 1-3); slot 0's W stash (step 4, rows 0-47)
  float k[C][LD];     // normalised k rows
  float v[2][C][LD];  // raw v rows of slot s's head (cp.async from step 1); its U stash (step 4)
  float xw[3 * 16][LD];  // slot 1's W stash (step 4)
  float nA[2][C][ALD];   // -A of slot s's head, strictly lower (tiles above the diagonal unwritten, never read)
  float T[2][C][TLD];    // T_ii - I, block i in rows 16 i .. (strictly lower, zeros above)
  double G[2][C];        // cumulative log decay
  float g[2][C], beta[2][C], eG[2][C], rq[C], rk[C];  // g, beta, exp(G) (0 past n); norm factors
};
static_assert(sizeof(PrepSmem) <= 227 * 1024, "the prep's shared memory exceeds the 227 KB opt-in");

// The fused conv (Params::u) of 4 channels (a float4 of each row, from column col) over a window of
// CONV_K - 1 + NT rows: win[i] holds row t - (CONV_K - 1) + i of the chunk (token t0 + that of the prompt; zeros
// from row n on; the inputs before the prompt's token 0 from conv_state), wt[e] the taps of channel col + e.
// conv_at(i) is the conv of row t + i: conv1d_silu's value of each channel (conv_silu_out).
template <int NT>
__device__ __forceinline__ void conv_window(const Params& p, int64_t Wd, int t0, int t, int n, int64_t col,
                                            float4 (&win)[CONV_K - 1 + NT], float4 (&wt)[4]) {
#pragma unroll
  for (int e = 0; e < 4; ++e) wt[e] = ld4(p.conv_w + (col + e) * CONV_K);
#pragma unroll
  for (int i = 0; i < CONV_K - 1 + NT; ++i) {
    const int r = t - (CONV_K - 1) + i, g = t0 + r;
    win[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (r < n) win[i] = g >= 0 ? ld4(p.u + g * Wd + col) : ld4(p.conv_state + (CONV_K - 1 + g) * Wd + col);
  }
}
__device__ __forceinline__ float comp4(float4 v, int e) { return e == 0 ? v.x : e == 1 ? v.y : e == 2 ? v.z : v.w; }
template <int NT>
__device__ __forceinline__ float4 conv_at(const float4 (&win)[CONV_K - 1 + NT], const float4 (&wt)[4], int i) {
  float r[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float w[CONV_K] = {wt[e].x, wt[e].y, wt[e].z, wt[e].w};
    float in[CONV_K - 1];
#pragma unroll
    for (int j = 0; j + 1 < CONV_K; ++j) in[j] = comp4(win[i + j], e);
    r[e] = conv_silu_out<CONV_K>(w, in, comp4(win[i + CONV_K - 1], e));
  }
  return make_float4(r[0], r[1], r[2], r[3]);
}

// conv_state_out's columns of this CTA (q and k of key head kh, v of heads h0 .. h0 + nh - 1), written by chunk
// 0's CTA once it has read conv_state (in place: no other CTA reads these columns): the prompt's last
// CONV_K - 1 inputs (T >= C > CONV_K - 1); thread tid a column.
__device__ __forceinline__ void prep_conv_state(const Params& p, int kh, int h0, int nh, int tid) {
  const int64_t Wd = 2 * int64_t(p.Hk) * D + int64_t(p.Hv) * D;
  const int part = tid / D, i = tid % D;  // part 0: q, 1: k, 2 + s: v of slot s
  if (part >= 2 + nh) return;
  const int64_t col = part < 2 ? part * int64_t(p.Hk) * D + int64_t(kh) * D + i
                               : 2 * int64_t(p.Hk) * D + int64_t(h0 + part - 2) * D + i;
#pragma unroll
  for (int r = 0; r + 1 < CONV_K; ++r) p.conv_state_out[r * Wd + col] = p.u[(p.T - (CONV_K - 1) + r) * Wd + col];
}

// The prep's step 1 rows with the conv applied (Params::u; 16 warps): warp w takes tokens 4w .. 4w + 3 of q and
// of k (a 7-row window each, both requested before any use), normalises them as the unfused path does and writes
// the conv rows of q and k to y_qk for the scan (rows past n: zeros, not written); then v's tokens 8 (w % 8) ..
// + 7 of slot w / 8 < nh (an 11-row window) into sm.v.
__device__ __forceinline__ void prep_conv_rows(const Params& p, PrepSmem& sm, int t0, int n, int kh, int h0, int nh,
                                               int warp, int lane, float q_scale) {
  const int64_t Wd = 2 * int64_t(p.Hk) * D + int64_t(p.Hv) * D;
  {  // q and k, tokens 4 warp .. 4 warp + 3
    const int t = 4 * warp;
    float4 wq[CONV_K - 1 + 4], wk[CONV_K - 1 + 4], tq[4], tk[4];
    const int64_t cq = int64_t(kh) * D + 4 * lane, ck = int64_t(p.Hk) * D + cq;
    conv_window<4>(p, Wd, t0, t, n, cq, wq, tq);
    conv_window<4>(p, Wd, t0, t, n, ck, wk, tk);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float4 x = h == 0 ? conv_at<4>(wq, tq, i) : conv_at<4>(wk, tk, i);
        const int r = t + i;
        const float4 xv = r < n ? x : make_float4(0.f, 0.f, 0.f, 0.f);  // rows past n: zeros, as unfused
        if (r < n) st4(p.y_qk + (t0 + r) * Wd + (h == 0 ? cq : ck), xv);
        const float ss = warp_sum(xv.x * xv.x + xv.y * xv.y + xv.z * xv.z + xv.w * xv.w);
        const float f = (h == 1 ? 1.f : q_scale) / sqrtf(ss + 1e-6f);
        st4((h == 1 ? sm.k[r] : sm.q[r]) + 4 * lane, scale4(f, xv));
        if (lane == 0) (h == 1 ? sm.rk : sm.rq)[r] = f;
      }
    }
  }
  const int s = warp / 8, t = 8 * (warp % 8);  // v of slot s, tokens t .. t + 7
  if (s >= nh) return;
  const int64_t cv = 2 * int64_t(p.Hk) * D + int64_t(h0 + s) * D + 4 * lane;
  float4 wv[CONV_K - 1 + 8], tv[4];
  conv_window<8>(p, Wd, t0, t, n, cv, wv, tv);
#pragma unroll
  for (int i = 0; i < 8; ++i)
    st4(&sm.v[s][t + i][4 * lane], t + i < n ? conv_at<8>(wv, tv, i) : make_float4(0.f, 0.f, 0.f, 0.f));
}

// one m16n8 tile of phase 3 in precision M: acc = X Y^T over K = 128 (xa, xb: this lane's ldmatrix
// addresses of the A rows and the B = Y^T rows at k-step 0)
template <Prec M>
__device__ __forceinline__ void prep_tile(float (&acc)[4], uint32_t xa, uint32_t xb) {
  float sml[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int e = 0; e < 4; ++e) acc[e] = 0.f;
#pragma unroll 2
  for (int ks = 0; ks < D / 16; ++ks) {  // k-step ks: 16 floats = 64 bytes on
    Split a[4], b0, b1;
    frag_a(a, xa + 64 * ks);
    frag_bt(b0, b1, xb + 64 * ks);
    mma_p<M>(acc, sml, a, b0, b1);
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) acc[e] += sml[e];
}

// step 3's tile idx (0..39): Q K^T (else K K^T), rows 16 mt .., columns 8 nt ..
struct PrepTile {
  int is_qk, mt, nt;
};
__device__ __forceinline__ PrepTile prep_tile_of(int idx) {
  const int is_qk = idx >= 20, j = idx - 20 * is_qk;
  const int mt = (j >= 2) + (j >= 6) + (j >= 12);  // tiles of row mt: 2 mt + 2
  return {is_qk, mt, j - mt * (mt + 1)};
}

template <class PR = EnginePrecision>
__global__ void __launch_bounds__(PREP_THREADS, 1) prep_kernel(Params p) {
  pdl_wait();
  pdl_trigger();
  PrepSmem& sm = *reinterpret_cast<PrepSmem*>(smem());
  const int R = p.Hv / p.Hk, pairs = (R + 1) / 2;
  const int ch = blockIdx.x, kh = blockIdx.y / pairs, h0 = kh * R + 2 * (blockIdx.y % pairs);
  const int nh = min(2, (kh + 1) * R - h0);     // heads in this CTA: slots 0 .. nh - 1
  const int t0 = ch * C, n = min(C, p.T - t0);  // tokens [t0, t0 + n) of this chunk
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, slot = warp >> 3, w8 = warp & 7;
  const int64_t Wd = 2 * int64_t(p.Hk) * D + int64_t(p.Hv) * D;  // qkv row width
  float* const blk0 = p.ws + (int64_t(ch) * p.Hv + h0) * BLOCK;  // slot s's workspace block: blk0 + s BLOCK

  // 1. q and k rows (rows r < 64 are q, r >= 64 are k; warp w does r = w + 16 i); gates; v rows. Every
  // global load of the q, k phase is issued before the first use of any (one memory latency per warp): the
  // gate inputs of slot tid / 64, token tid % 64 first, the gates computed after the rows.
  const int gs = tid / C, gt = tid % C;  // threads 0..127: slot, token of the gates
  float b_in = 0.f, a_in = 0.f, A_log = 0.f, dt_bias = 0.f;
  if (gs < nh && gt < n) {
    const int64_t i = int64_t(t0 + gt) * p.Hv + h0 + gs;
    b_in = p.b[i];
    a_in = p.a[i];
    A_log = p.A_log[h0 + gs];
    dt_bias = p.dt_bias[h0 + gs];
  }
  constexpr int WARPS = PREP_THREADS / 32, ROWS_PER_WARP = 2 * C / WARPS;  // 16, 8
  const float q_scale = 1.f / sqrtf(float(D));
  if (p.u != nullptr) {
    prep_conv_rows(p, sm, t0, n, kh, h0, nh, warp, lane, q_scale);
  } else {
    float4 x[ROWS_PER_WARP];
#pragma unroll
    for (int i = 0; i < ROWS_PER_WARP; ++i) {
      const int r = warp + WARPS * i, t = r % C, is_k = r / C;
      x[i] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (t < n) x[i] = ld4(p.qkv + (t0 + t) * Wd + is_k * int64_t(p.Hk) * D + int64_t(kh) * D + 4 * lane);
    }
#pragma unroll
    for (int i = 0; i < ROWS_PER_WARP; ++i) {
      const int r = warp + WARPS * i, t = r % C, is_k = r / C;
      const float ss = warp_sum(x[i].x * x[i].x + x[i].y * x[i].y + x[i].z * x[i].z + x[i].w * x[i].w);
      const float f = (is_k ? 1.f : q_scale) / sqrtf(ss + 1e-6f);  // rows past n: 0 * f = 0
      st4((is_k ? sm.k[t] : sm.q[t]) + 4 * lane, scale4(f, x[i]));
      if (lane == 0) (is_k ? sm.rk : sm.rq)[t] = f;
    }
  }
  if (slot < nh && p.u == nullptr)  // rows w8 + 8 i of slot's head (the fused conv wrote them above)
    copy_rows<LD>(saddr(&sm.v[slot][w8][4 * lane]),
                  p.qkv + int64_t(t0 + w8) * Wd + 2 * int64_t(p.Hk) * D + int64_t(h0 + slot) * D + 4 * lane, 8 * Wd, n,
                  w8, p.qkv);
  commit();
  if (tid < 2 * C) {
    float beta = 0.f, g = 0.f;
    if (gs < nh && gt < n) {
      beta = 1.f / (1.f + expf(-b_in));
      g = -expf(A_log) * softplus(a_in + dt_bias);
    }
    sm.beta[gs][gt] = beta;
    sm.g[gs][gt] = g;
  }
  __syncthreads();
  if (p.u != nullptr && ch == 0) prep_conv_state(p, kh, h0, nh, tid);  // this CTA's conv state reads are done

  // 2. G, exp(G) and the row factors of slot s's head (warp 8 + s; lane l holds tokens 2l, 2l+1)
  if (warp >= 8 && warp - 8 < nh) {
    const int s = warp - 8;
    float* blk = blk0 + s * BLOCK;
    const double g0 = sm.g[s][2 * lane], g1 = sm.g[s][2 * lane + 1];
    double sum = g0 + g1;  // inclusive scan of the pair sums
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const double y = __shfl_up_sync(0xffffffffu, sum, o);
      if (lane >= o) sum += y;
    }
    double before = __shfl_up_sync(0xffffffffu, sum, 1);  // sum of tokens < 2l
    if (lane == 0) before = 0.0;
    sm.G[s][2 * lane] = before + g0;
    sm.G[s][2 * lane + 1] = before + g0 + g1;
    __syncwarp();
    const double Gl = sm.G[s][n - 1];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int t = 2 * lane + u;
      const float eG = t < n ? expf(float(sm.G[s][t])) : 0.f;
      sm.eG[s][t] = eG;
      blk[WS_FQ + t] = eG * sm.rq[t];
      blk[WS_FK + t] = t < n ? expf(float(Gl - sm.G[s][t])) * sm.rk[t] : 0.f;
    }
    if (lane == 0) blk[WS_GC] = expf(float(Gl));
  }

  // 3. K K^T, Q K^T: 40 tiles, warp w takes w, w + 16 and (w < 8) w + 32; raw products for both heads
  const int g = lane >> 2, c = lane & 3;
  constexpr int ROUNDS = (40 + WARPS - 1) / WARPS;  // 3
  float acc[ROUNDS][4];
#pragma unroll
  for (int i = 0; i < ROUNDS; ++i) {
    const int idx = warp + WARPS * i;
    if (idx < 40) {
      const PrepTile tl = prep_tile_of(idx);
      const uint32_t xa = saddr(&(tl.is_qk ? sm.q : sm.k)[16 * tl.mt][0]) + 4 * lsm_a<LD>(lane);  // this lane's rows
      const uint32_t xb = saddr(&sm.k[8 * tl.nt][0]) + 4 * lsm_b4<LD>(lane);
      if constexpr (PR::KK == PR::QK) prep_tile<PR::KK>(acc[i], xa, xb);
      else if (tl.is_qk) prep_tile<PR::QK>(acc[i], xa, xb);
      else prep_tile<PR::KK>(acc[i], xa, xb);
    }
  }
  __syncthreads();  // G of both heads
#pragma unroll
  for (int i = 0; i < ROUNDS; ++i) {
    const int idx = warp + WARPS * i;
    if (idx < 40) {
      const PrepTile tl = prep_tile_of(idx);
#pragma unroll 1
      for (int hs = 0; hs < nh; ++hs) {
        float* blk = blk0 + hs * BLOCK;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int t = 16 * tl.mt + g + 8 * (e >> 1), s = 8 * tl.nt + 2 * c + (e & 1);
          if (tl.is_qk) {
            const float dec = (t < n && s <= t) ? expf(float(sm.G[hs][t] - sm.G[hs][s])) : 0.f;
            blk[WS_P + t * C + s] = dec * acc[i][e];
          } else {
            const float dec = (t < n && s < t) ? expf(float(sm.G[hs][t] - sm.G[hs][s])) : 0.f;  // exponent <= 0
            sm.nA[hs][t][s] = -(sm.beta[hs][t] * dec * acc[i][e]);  // (stored negated: step 4 subtracts)
          }
        }
      }
    }
  }
  __syncthreads();  // A complete; q free

  // 4. (I + A) X = B, blocked, per head on its slot's warps. Warps w8 = 4-5: thread 16 i + j (of 64) column j of
  // T_ii - I
  if (slot < nh && (w8 == 4 || w8 == 5)) {
    const int i = (tid - (8 * slot + 4) * 32) >> 4, j = tid & 15;
    const float* nL = &sm.nA[slot][16 * i][16 * i];
    float x[16];  // column j of T_ii: (I + A_ii) x = e_j, column by column of A_ii (x[r < j] stay 0)
#pragma unroll
    for (int r = 0; r < 16; ++r) x[r] = r == j ? 1.f : 0.f;
#pragma unroll
    for (int s = 0; s < 15; ++s)
#pragma unroll
      for (int r = s + 1; r < 16; ++r) x[r] = fmaf(nL[r * ALD + s], x[s], x[r]);
#pragma unroll
    for (int r = 0; r < 16; ++r) sm.T[slot][16 * i + r][j] = r == j ? 0.f : x[r];
  }
  wait_group<0>();
  __syncthreads();  // v rows landed, T complete
  if (slot < nh) {
    const int is_w = w8 >= 4, d0 = 32 * (w8 & 3);  // columns d0.. of U or W
    // per-lane bases: element e of tile [mt][nt] of block i is column 16 mt + g + 8 (e >> 1), token
    // 16 i + 8 nt + 2 c + (e & 1), at 16 i rows + at(mt, nt, e, row stride) from this lane's base
    auto at = [](int mt, int nt, int e, int ld) { return (8 * nt + (e & 1)) * ld + 16 * mt + 8 * (e >> 1); };
    const float* Y = (is_w ? &sm.k[2 * c][d0] : &sm.v[slot][2 * c][d0]) + g;  // B = the row factor times Y's rows
    float* Z = (is_w ? (slot ? &sm.xw[2 * c][d0] : &sm.q[2 * c][d0]) : &sm.v[slot][2 * c][d0]) + g;  // the stash
    float* out = blk0 + slot * BLOCK + (is_w ? WS_W : WS_U) + 2 * c * D + d0 + g;
    const float* beta = sm.beta[slot];
    const float* eG = sm.eG[slot];
    auto factor = [&](int t) { return beta[t] * (is_w ? eG[t] : 1.f); };  // B's row factor of token t
    // The A fragments of X_j^T [32 columns, 16 tokens] (m16 tile mt: a0 column g, tokens 2c, 2c + 1; a1
    // column g + 8; a2, a3 tokens 2c + 8, 2c + 9) are C fragments' pairs (e, e + 1), split; they wait in
    // the stash's block j (this warp's columns, only it reads them: each lane reads back the words it
    // wrote, hi at the place of e, lo at that of e + 1), registers being short.
    auto stash = [&](float* y, const float (&x)[2][2][4]) {
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; e += 2) {
            const Split sx = split2(x[mt][nt][e], x[mt][nt][e + 1]);
            y[at(mt, nt, e, LD)] = __uint_as_float(sx.hi);
            y[at(mt, nt, e + 1, LD)] = __uint_as_float(sx.lo);
          }
    };
    auto unstash = [&](Split (&a)[2][4], const float* y) {
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; e += 2)
            a[mt][2 * nt + e / 2] = {__float_as_uint(y[at(mt, nt, e, LD)]), __float_as_uint(y[at(mt, nt, e + 1, LD)])};
    };
    // acc[mt][nt] += a[mt] M^T over the k-step, m: M's row g, column 2c (rows 8 nt + g at m + 8 nt ldm);
    // one accumulator (registers: four tiles of independent chains are in flight anyway)
    auto prod = [&](float (&acc)[2][2][4], const Split (&a)[2][4], const float* m, int ldm) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const float* r = m + 8 * nt * ldm;
        const Split b0 = split2(r[0], r[1]), b1 = split2(r[8], r[9]);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) mma_p<PR::FS>(acc[mt][nt], acc[mt][nt], a[mt], b0, b1);
      }
    };
#pragma unroll 1
    for (int i = 0; i < 4; ++i, Y += 16 * LD, Z += 16 * LD, out += 16 * D) {
      float acc[2][2][4];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {  // R_i^T = B_i^T
        const int t = 16 * i + 8 * nt + 2 * c;
        const float f0 = factor(t), f1 = factor(t + 1);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[mt][nt][e] = (e & 1 ? f1 : f0) * Y[at(mt, nt, e, LD)];
      }
      const float* nAij = &sm.nA[slot][16 * i + g][2 * c];
#pragma unroll 1
      for (int j = 0; j < i; ++j, nAij += 16) {  // R_i^T -= X_j^T A_ij^T
        Split xa[2][4];
        unstash(xa, Z - 16 * LD * (i - j));
        prod(acc, xa, nAij, ALD);
      }
      Split ra[2][4];  // R_i^T's A fragments
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; e += 2) ra[mt][2 * nt + e / 2] = split2(acc[mt][nt][e], acc[mt][nt][e + 1]);
      prod(acc, ra, &sm.T[slot][16 * i + g][2 * c], TLD);  // X_i^T = R_i^T + R_i^T (T_ii - I)^T
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {  // U as it is; W split, its hi word at the place of e, lo at e + 2's
            float x0 = acc[mt][nt][e], x1 = acc[mt][nt][e + 2];  // columns g, g + 8: the scan's pair
            if (is_w) {
              const Split sx = split2(x0, x1);
              x0 = __uint_as_float(sx.hi), x1 = __uint_as_float(sx.lo);
            }
            out[at(mt, nt, e, D)] = x0;
            out[at(mt, nt, e + 2, D)] = x1;
          }
      if (i < 3) stash(Z, acc);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// scan_kernel: one CTA per (value head h, slice of 32 state columns j0 = 32 * blockIdx.y), grid
// (Hv, D/32), block 512 (16 warps in two roles of 8), 1 CTA/SM; loops over the chunks in order. Columns
// of S are independent here, so the CTA needs only its [128, 32] slice of S and of U. Per chunk ci, on
// the tensor cores (3xBF16, m16n8k16), g = lane / 4, c = lane % 4, w = the warp's index in its role:
//   recurrence warps (0-7), the chain from chunk to chunk:
//   (a) Delta [64, 32] = U - W S: warp w owns rows 16 (w/2) .. +15, columns 16 (w%2) .. +15 (two n8
//       tiles sharing each A fragment), 8 k-steps over Dk; Delta to shared memory.
//   (c) S [128, 32] <- exp(G_last) S + (fk * K)^T Delta: warp w owns S rows 16 w .. +15, all 32
//       columns (four n8 tiles) as mma accumulators in registers across the whole loop; the A operand is
//       K^T, read transposed from the raw k rows, times fk = exp(G_last - G) / |k|; then S to shared
//       memory for the next (a).
//   output warps (8-15), off the chain: chunk ci's output needs only S at the chunk's start and Delta,
//   so it runs while the recurrence warps go on to chunk ci + 1:
//   (b) O [64, 32] = (fq * Q) S + P Delta, (a)'s tiles; Q is the raw q rows of qkv times the row factor
//       fq = exp(G) / sqrt(Dk) / |q| at fragment load; P Delta runs only the k-steps ks <= mt (P is
//       zero above the diagonal). Rows < T written to o as float2.
// (The 8-warp form ran (a), (b), (c) in turn on every warp, 2 warps a scheduler each waiting its mma
// chains: 4.8 us a chunk at 4K against ~1.5 us of tensor-core issue.) Every product, its operands and
// its order of summation are as they were: the same bits.
// S and Delta, the B operands, are kept in shared memory already split into bf16 hi and lo words
// (split once when written, not at each of their two or three reads), transposed ([column][k]) and
// paired (word 8 b + p of a column holds its rows 16 b + p and 16 b + p + 8: the k slot pairs of the
// table at the top, and a C fragment's rows g, g + 8), so that ldmatrix reads their B fragments (two n8
// tiles per ldmatrix.x4). W, (a)'s A operand, comes split from the prep (WS_W): two ldmatrix.x4 a
// k-step as for an fp32 tile, no cvt on the chain. Q, P are read by ldmatrix too and split at load, K
// (transposed A) by scalar loads. Every shared address the loops use is a per-lane base set before the
// chunk loop plus a constant per k-step (and the buffer's offset).
// S and Delta have two buffers each, chunk ci's in buffer ci % 2. Hand-overs by named barriers (bar.sync
// waits, bar.arrive only counts; both order the shared-memory accesses before them for the threads that
// wait): the recurrence warps arrive at FULL[b] once Delta of chunk ci (and S of its start, written at the
// end of chunk ci - 1) lies in buffer b, the output warps wait there; the output warps arrive at EMPTY[b]
// once their (b) of chunk ci has read buffer b, and the recurrence warps wait there before writing S of
// chunk ci + 2's start into it (in chunk ci + 1's (c)). Within a role, REC or OUT (256 threads).
// Tiles arrive by cp.async, each soon after its role's phase reading it is done: W and U (recurrence)
// during (c) of the previous chunk, K, fk (two buffers) a chunk ahead, both requested after the first
// k-step's mma of a recurrence phase (behind the loads that start it); Q, fq (output) during the P
// Delta half of the previous (b), P during the wait for FULL. Two chunks ahead the L2 is asked (hints,
// cp.async.bulk.prefetch.L2 and prefetch.global.L2) for the workspace block, by the recurrence, a quarter a
// CTA, and for the q rows, by the output warps, 16 rows a CTA, so that those copies (from HBM: the prep's
// workspace outgrows the L2 at 4K) find the L2. A role commits its groups in a fixed order,
// always, so that wait_group 0 at the top of a recurrence chunk and wait_group 1 before each half of (b)
// mean its own tiles have landed. Shared memory 219 KB (K's second buffer: 35 KB). q,
// k rows past the prompt are zero-filled copies (their factors are 0 too).
constexpr int SCAN_THREADS = 2 * THREADS;
enum ScanBarrier : int { BAR_REC = 1, BAR_OUT = 2, BAR_FULL = 3, BAR_EMPTY = 5 };  // FULL, EMPTY: + buffer
struct ScanSmem {
  uint32_t W[C][LD];  // split (WS_W)
  float Q[C][LD];     // raw q rows
  float K[2][C][KLD]; // raw k rows, chunk ci's in K[ci % 2] (the recurrence loads them a chunk ahead)
  float P[C][PLD];
  float U[C][NLD];    // this CTA's columns of U
  struct SBuf {       // this CTA's columns of S, [column][pair of rows], split (lo words after the hi)
    uint32_t h[COLS][SLD], l[COLS][SLD];
  } S[2];
  struct DBuf {       // Delta, [column][pair of tokens], split
    uint32_t h[COLS][DLD], l[COLS][DLD];
  } Dt[2];
  float fq[C], fk[2][C];
};
// Byte offsets in a split S (Delta) buffer: the lo words after the hi words; buffer b at b * S_BUF (D_BUF).
constexpr uint32_t S_LO = sizeof(ScanSmem::SBuf::h), D_LO = sizeof(ScanSmem::DBuf::h), S_BUF = sizeof(ScanSmem::SBuf),
                   D_BUF = sizeof(ScanSmem::DBuf);
static_assert(sizeof(ScanSmem::SBuf) % 16 == 0 && sizeof(ScanSmem::DBuf) % 16 == 0 && offsetof(ScanSmem, S) % 16 == 0,
              "ldmatrix rows of every buffer 16-byte aligned");
static_assert(sizeof(ScanSmem) <= 227 * 1024, "the scan's shared memory exceeds the 227 KB opt-in");

// What both roles share: the CTA's head and columns, the row width of qkv and their lane coordinates
// (tid: the thread's index in its role, 0..255).
struct ScanCtx {
  int h, j0, kh, tid, lane, warp, g, c;
  int64_t Wd, chunk_rows, step8, blk_step;
};

template <class PR>
__device__ __forceinline__ void scan_recurrence(const Params& p, ScanSmem& sm, const ScanCtx& x) {
  const int lane = x.lane, warp = x.warp, g = x.g, c = x.c, tid = x.tid;
  const float* kg = p.qkv + int64_t(p.Hk) * D + int64_t(x.kh) * D;  // k of token 0
  const int mt = warp >> 1, nb = 16 * (warp & 1);                    // (a): rows 16 mt.., columns nb..
  // this lane's ldmatrix addresses at k-step 0 of buffer 0: A of W (rows 16 mt..), B of S^T (columns
  // nb..) and of Delta^T (columns 0..); the lo words S_LO, D_LO bytes after the hi words
  const uint32_t aW = saddr(&sm.W[16 * mt][0]) + 4 * lsm_a<LD>(lane),
                 bS = saddr(&sm.S[0].h[nb][0]) + 4 * lsm_b2<SLD>(lane), bD = saddr(&sm.Dt[0].h[0][0]) + 4 * lsm_b2<DLD>(lane);
  // the lo words of S (Delta) are stored only if a product reads them
  constexpr bool SL = uses_b_lo(PR::WS) || uses_b_lo(PR::QS), DL = uses_b_lo(PR::PD) || uses_b_lo(PR::KD);
  // (c): S rows 16 warp + g (+8), columns 8 nt + 2c (+1): s[nt] is that n8 tile's accumulator
  float* Sg = p.state + int64_t(x.h) * D * D + x.j0;  // S[h][.][j0], row stride D
  float s[4][4];
  auto store_s = [&](int b) {  // s, split, to buffer b: rows 16 warp + g, + 8 of a column are its word 8 warp + g
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        st_pair<SL>(&sm.S[b].h[0][0], &sm.S[b].l[0][0], (8 * nt + 2 * c + e) * SLD + 8 * warp + g, s[nt][e], s[nt][e + 2]);
  };
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    const int r = 16 * warp + g, col = 8 * nt + 2 * c;
    const float2 lo = *reinterpret_cast<const float2*>(Sg + r * D + col);
    const float2 hi = *reinterpret_cast<const float2*>(Sg + (r + 8) * D + col);
    s[nt][0] = lo.x, s[nt][1] = lo.y, s[nt][2] = hi.x, s[nt][3] = hi.y;
  }
  store_s(0);
  // cp.async plan: every chunk copies the same tile positions, so this thread's shared destinations
  // (32-bit addresses) and offsets in a workspace block are set once here; per chunk only the block,
  // the k row pointer and K's buffer move. W, K: rows warp + 8 i (i < 8), float4 lane; U: rows tid / 8 +
  // 32 i (i < 2), float4 tid % 8; fk: tid < 16.
  const uint32_t sW = saddr(&sm.W[warp][4 * lane]), sK = saddr(&sm.K[0][warp][4 * lane]),
                 sU = saddr(&sm.U[tid / 8][4 * (tid % 8)]), sfk = saddr(sm.fk[0]) + 16 * tid;
  constexpr uint32_t K_BUF = sizeof(ScanSmem::K[0]), FK_BUF = sizeof(ScanSmem::fk[0]);
  const int oW = WS_W + warp * D + 4 * lane, oU = WS_U + (tid / 8) * D + x.j0 + 4 * (tid % 8);
  auto issue_wu = [&](const float* wsb) {
#pragma unroll
    for (int i = 0; i < 8; ++i) cp16(sW + 8 * LD * 4 * i, wsb + oW + 8 * D * i);
#pragma unroll
    for (int i = 0; i < 2; ++i) cp16(sU + 32 * NLD * 4 * i, wsb + oU + 32 * D * i);
  };
  // wsb: the chunk's workspace block, rows: this thread's first k row of it, n: the chunk's tokens, kb: the
  // K buffer
  auto issue_k = [&](const float* wsb, const float* rows, int n, int kb) {
    copy_rows<KLD>(sK + kb * K_BUF, rows, x.step8, n, warp, kg);
    if (tid < C / 4) cp16(sfk + kb * FK_BUF, wsb + WS_FK + 4 * tid);
  };
  // The L2 is asked for a chunk's workspace block two chunks ahead (one if it is chunk 1), so that the
  // cp.async of W, U, P and the row factors find it there: the head's D / COLS CTAs take a share each of
  // its 16-byte units (CTA y the y-th), thread 0 of the role asking.
  constexpr uint32_t PF = (BLOCK * 4 / 16 + D / COLS - 1) / (D / COLS) * 16;  // bytes a share
  const uint32_t pf_off = (x.j0 / COLS) * PF, pf_bytes = min(PF, uint32_t(BLOCK * 4) - pf_off);
  auto prefetch_blk = [&](const float* wsb) {
    if (tid == 0) prefetch_l2(reinterpret_cast<const unsigned char*>(wsb) + pf_off, pf_bytes);
  };
  const float* blk = p.ws + int64_t(x.h) * BLOCK;  // chunk 0's workspace block
  const float* krow = kg + warp * x.Wd + 4 * lane;  // this thread's k rows of chunk 0
  issue_wu(blk);
  commit();
  issue_k(blk, krow, min(C, p.T), 0);
  commit();
  if (p.num_chunks > 1) prefetch_blk(blk + x.blk_step);
  // Per chunk two barriers of the recurrence warps: the first (W, U and K landed, S of the chunk's start
  // written, every warp done with the previous chunk's K buffer), then K of the next chunk goes out into
  // the other buffer; the second after (a) (Delta complete, W and U free), then W and U of the next chunk.
  // Both phases are software-pipelined: k-step ks + 1's fragments are requested before k-step ks's mma
  // (two register buffers, ks % 2), and a phase's cp.async requests go out after its first k-step's mma,
  // behind the loads that start the chain. The same products in the same order: the same bits.
  for (int ci = 0; ci < p.num_chunks; ++ci, blk += x.blk_step, krow += x.chunk_rows) {
    const int b = ci & 1;  // S, Delta and K buffer
    const bool more = ci + 1 < p.num_chunks;
    const int n_next = min(C, p.T - (ci + 1) * C);
    const float gC = blk[WS_GC];
    wait_group<0>();
    bar_sync(BAR_REC, THREADS);  // W, U, K of chunk ci landed; S of its start in buffer b; K[b ^ 1] free

    // (a) Delta = U - W S
    {
      float acc[2][4] = {}, sml[2][4] = {};
      Split a[2][4], bb[2][2][2];  // k-step ks's fragments in [ks % 2]
      auto load = [&](int ks) {    // k-step ks: 64 bytes on in W, 32 in S^T
        frag_a_pre<uses_a_lo(PR::WS)>(a[ks & 1], aW + 64 * ks);
        frag_b2_pre<uses_b_lo(PR::WS)>(bb[ks & 1][0], bb[ks & 1][1], bS + b * S_BUF + 32 * ks, S_LO);
      };
      load(0);
      const int r = 16 * mt + g;  // rows r, r + 8 of a column: its word 8 mt + g
      float2 u[2][2];             // U at this lane's Delta elements (rows r, r + 8; columns nb + 8 j + 2 c, + 1)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        u[j][0] = *reinterpret_cast<const float2*>(&sm.U[r][nb + 8 * j + 2 * c]);
        u[j][1] = *reinterpret_cast<const float2*>(&sm.U[r + 8][nb + 8 * j + 2 * c]);
      }
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        if (ks + 1 < D / 16) load(ks + 1);
#pragma unroll
        for (int j = 0; j < 2; ++j) mma_p<PR::WS>(acc[j], sml[j], a[ks & 1], bb[ks & 1][j][0], bb[ks & 1][j][1]);
        if (ks == 0) {
          if (more) issue_k(blk + x.blk_step, krow + x.chunk_rows, n_next, b ^ 1);
          commit();
          if (ci + 2 < p.num_chunks) prefetch_blk(blk + 2 * x.blk_step);
        }
      }
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] += sml[j][e];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int col = nb + 8 * j + 2 * c;
        st_pair<DL>(&sm.Dt[b].h[0][0], &sm.Dt[b].l[0][0], col * DLD + 8 * mt + g, u[j][0].x - acc[j][0],
                    u[j][1].x - acc[j][2]);
        st_pair<DL>(&sm.Dt[b].h[0][0], &sm.Dt[b].l[0][0], (col + 1) * DLD + 8 * mt + g, u[j][0].y - acc[j][1],
                    u[j][1].y - acc[j][3]);
      }
    }
    bar_sync(BAR_REC, THREADS);  // Delta complete; W, U free
    bar_arrive(BAR_FULL + b, SCAN_THREADS);  // S and Delta of chunk ci to the output warps

    // (c) S <- exp(G_last) S + (fk * K)^T Delta
    {
      float sml[4][4] = {};
      Split a[2][4], bb[2][4][2];  // k-step ks's fragments in [ks % 2]
      auto load = [&](int ks) {
        frag_at<KLD>(a[ks & 1], &sm.K[b][16 * ks][16 * warp], &sm.fk[b][16 * ks], g, c);
        frag_b2_pre<uses_b_lo(PR::KD)>(bb[ks & 1][0], bb[ks & 1][1], bD + b * D_BUF + 32 * ks, D_LO);
        frag_b2_pre<uses_b_lo(PR::KD)>(bb[ks & 1][2], bb[ks & 1][3], bD + b * D_BUF + 16 * DLD * 4 + 32 * ks, D_LO);
      };
      load(0);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] *= gC;
#pragma unroll
      for (int ks = 0; ks < C / 16; ++ks) {
        if (ks + 1 < C / 16) load(ks + 1);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) mma_p<PR::KD>(s[nt], sml[nt], a[ks & 1], bb[ks & 1][nt][0], bb[ks & 1][nt][1]);
        if (ks == 0) {
          if (more) issue_wu(blk + x.blk_step);
          commit();
        }
      }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] += sml[nt][e];
    }
    if (more) {
      if (ci >= 1) bar_sync(BAR_EMPTY + (b ^ 1), SCAN_THREADS);  // the output warps are done with chunk ci - 1
      store_s(b ^ 1);
    }
  }
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    const int r = 16 * warp + g, col = 8 * nt + 2 * c;
    st2(Sg + r * D + col, s[nt][0], s[nt][1]);
    st2(Sg + (r + 8) * D + col, s[nt][2], s[nt][3]);
  }
}

template <class PR>
__device__ __forceinline__ void scan_output(const Params& p, ScanSmem& sm, const ScanCtx& x) {
  const int lane = x.lane, warp = x.warp, g = x.g, c = x.c, tid = x.tid;
  const int64_t o_row = int64_t(p.Hv) * D, o_row8 = 8 * o_row, chunk_rows_o = C * o_row;
  const float* qg = p.qkv + int64_t(x.kh) * D;  // q of token 0
  const int mt = warp >> 1, nb = 16 * (warp & 1);  // rows 16 mt.., columns nb..
  // this lane's ldmatrix addresses at k-step 0 of buffer 0: A of Q, P (rows 16 mt..), B of S^T (columns
  // nb..) and of Delta^T (columns nb..)
  const uint32_t aQ = saddr(&sm.Q[16 * mt][0]) + 4 * lsm_a<LD>(lane), aP = saddr(&sm.P[16 * mt][0]) + 4 * lsm_a<PLD>(lane),
                 bS = saddr(&sm.S[0].h[nb][0]) + 4 * lsm_b2<SLD>(lane), bD = saddr(&sm.Dt[0].h[nb][0]) + 4 * lsm_b2<DLD>(lane);
  // cp.async plan (as the recurrence's): Q: rows warp + 8 i (i < 8), float4 lane; P: rows tid / 16 + 16 i
  // (i < 4), float4 tid % 16; fq: tid < 16.
  const uint32_t sQ = saddr(&sm.Q[warp][4 * lane]), sP = saddr(&sm.P[tid / 16][4 * (tid % 16)]),
                 sfq = saddr(sm.fq) + 16 * tid;
  const int oP = WS_P + (tid / 16) * C + 4 * (tid % 16);
  auto issue_q = [&](const float* wsb, const float* rows, int n) {
    copy_rows<LD>(sQ, rows, x.step8, n, warp, qg);
    if (tid < C / 4) cp16(sfq, wsb + WS_FQ + 4 * tid);
  };
  auto issue_p = [&](const float* wsb) {
#pragma unroll
    for (int i = 0; i < 4; ++i) cp16(sP + 16 * PLD * 4 * i, wsb + oP + 16 * C * i);
  };
  // the q rows of chunk cj asked of the L2 (as the recurrence's blocks): CTA y's 16 of the 64, a 128-byte
  // line a thread
  auto prefetch_q = [&](int cj) {
    const int t = cj * C + (x.j0 / COLS) * 16 + tid / 4;
    if (tid < 64 && cj < p.num_chunks && t < p.T) prefetch_line(qg + t * x.Wd + 32 * (tid % 4));
  };
  const float* blk = p.ws + int64_t(x.h) * BLOCK;  // chunk 0's workspace block
  const float* qrow = qg + warp * x.Wd + 4 * lane;  // this thread's q rows of chunk 0
  float* orow = p.o + (16 * mt + g) * o_row + int64_t(x.h) * D + x.j0 + nb + 2 * c;  // o of chunk 0
  issue_q(blk, qrow, min(C, p.T));
  commit();
  issue_p(blk);
  commit();
  prefetch_q(1);
  for (int ci = 0; ci < p.num_chunks; ++ci, blk += x.blk_step, qrow += x.chunk_rows, orow += chunk_rows_o) {
    const int b = ci & 1;
    const bool more = ci + 1 < p.num_chunks;
    const int n = min(C, p.T - ci * C), n_next = min(C, p.T - (ci + 1) * C);
    wait_group<1>();
    bar_sync(BAR_OUT, THREADS);  // Q, fq of chunk ci landed
    bar_sync(BAR_FULL + b, SCAN_THREADS);  // S of its start and its Delta in buffer b
    float acc[2][4] = {}, sml[2][4] = {};
    {  // (b), first half: (fq * Q) S
      const float f0 = sm.fq[16 * mt + g], f1 = sm.fq[16 * mt + g + 8];
#pragma unroll 2
      for (int ks = 0; ks < D / 16; ++ks) {
        Split a[4], bb[2][2];
        frag_a(a, aQ + 64 * ks, f0, f1);
        frag_b2_pre<uses_b_lo(PR::QS)>(bb[0], bb[1], bS + b * S_BUF + 32 * ks, S_LO);
#pragma unroll
        for (int j = 0; j < 2; ++j) mma_p<PR::QS>(acc[j], sml[j], a, bb[j][0], bb[j][1]);
      }
    }
    bar_sync(BAR_OUT, THREADS);  // Q, fq free
    if (more) issue_q(blk + x.blk_step, qrow + x.chunk_rows, n_next);
    commit();
    prefetch_q(ci + 2);
    wait_group<1>();
    bar_sync(BAR_OUT, THREADS);  // P of chunk ci landed
#pragma unroll 1
    for (int ks = 0; ks <= mt; ++ks) {  // (b), second half: P Delta, the k-steps at or left of the diagonal
      Split a[4], bb[2][2];
      frag_a(a, aP + 64 * ks);
      frag_b2_pre<uses_b_lo(PR::PD)>(bb[0], bb[1], bD + b * D_BUF + 32 * ks, D_LO);
#pragma unroll
      for (int j = 0; j < 2; ++j) mma_p<PR::PD>(acc[j], sml[j], a, bb[j][0], bb[j][1]);
    }
    if (ci + 2 < p.num_chunks) bar_arrive(BAR_EMPTY + b, SCAN_THREADS);  // buffer b free for chunk ci + 2
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] += sml[j][e];
    const int r = 16 * mt + g;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      if (r < n) st2(orow + 8 * j, acc[j][0], acc[j][1]);
      if (r + 8 < n) st2(orow + o_row8 + 8 * j, acc[j][2], acc[j][3]);
    }
    bar_sync(BAR_OUT, THREADS);  // P free
    if (more) issue_p(blk + x.blk_step);
    commit();
  }
}

template <class PR = EnginePrecision>
__global__ void __launch_bounds__(SCAN_THREADS, 1) scan_kernel(Params p) {
  pdl_wait();
  pdl_trigger();
  ScanSmem& sm = *reinterpret_cast<ScanSmem*>(smem());
  ScanCtx x;
  x.h = blockIdx.x, x.j0 = blockIdx.y * COLS, x.kh = x.h / (p.Hv / p.Hk);
  x.tid = threadIdx.x % THREADS, x.lane = x.tid & 31, x.warp = x.tid >> 5, x.g = x.lane >> 2, x.c = x.lane & 3;
  x.Wd = 2 * int64_t(p.Hk) * D + int64_t(p.Hv) * D;
  x.chunk_rows = C * x.Wd, x.step8 = 8 * x.Wd, x.blk_step = int64_t(p.Hv) * BLOCK;
  if (threadIdx.x < THREADS) scan_recurrence<PR>(p, sm, x);
  else scan_output<PR>(p, sm, x);
}

}  // namespace lily::cuda::gdn_chunk
