// Launcher-level pieces of linear.cu that moe.cu reuses: the weight view of a QMatrix, the tiled
// product over (possibly grouped) rows and the GEMV sizing; and norms.cu's for kernels that end in a norm.
// Host code (a .h, included by .cu files only: it needs the kernel headers' parameter types); the kernels
// are in kernels/linear_*.cuh and kernels/norms.cuh.
#pragma once
#include "../ops/weights.h"
#include "gemv_plan.h"
#include "kernels/linear_common.cuh"
#include "kernels/norms.cuh"

namespace lily::cuda {

WeightView weight_view(const QMatrix& w);

// X of the products as the wgmma GEMM reads it: BF16 [rows, K] in `data` (`capacity` elements, the op's
// workspace). linear_tiles converts a product's X rows into it when that product takes the wgmma GEMM,
// unless it holds them already (same x, ldx, rows and K: later products over the same X reuse the
// copy). One copy at a time: converting another X overwrites it. Valid within one op, while X is not
// written.
struct XbCopy {
  uint16_t* data = nullptr;
  int64_t capacity = 0;
  const float* x = nullptr;  // the X it holds (null: none)
  int64_t ldx = 0, rows = 0, K = 0;
};

// Runs a.tiles over `max_tiles` row tiles of GENERIC_TILE_ROWS (= GEMM_BM) rows: the tensor-core
// GEMM where the weight variant and alignment allow it, the generic kernel otherwise. x_count: the
// rows of a.x the product reads (dense: M; gathered: the rows x_rows names; grouped: the bound on
// product rows). A gated product (a.up set, LinearArgs) runs as one where the wgmma GEMM's GATED
// instances take it, else as the gate product into a.y, then the up product with swiglu.
void linear_tiles(const LinearArgs& a, int64_t max_tiles, int64_t x_count, XbCopy& xb);

// ops::linear (y = x W_e^T, every kernel choice the same) with the caller's XbCopy, whose data lies in
// `workspace`: products of one op over the same x share one bf16 conversion (moe.cu: the router, the
// shared-expert gate and the expert products over h). ops::linear is this with a fresh XbCopy.
void linear_with_xb(const QMatrix& w, int64_t e, const Tensor& x, const Tensor& y, const Tensor& workspace,
                    XbCopy& xb);

// X handed over as bf16 (LinearArgs::xb, ::yb; docs/cuda.md, "Xb hand-over"): linear_reads_xb(a) holds
// when a, with a.xb set, runs on the wgmma GEMM (the only kernel reading a.xb); linear_writes_xb(a) when
// the gated product a runs as one GATED wgmma product (the only kernel writing a.yb). linear_tiles fails on
// an a.xb or a.yb that its predicate rejects: a producer sets them only where both hold.
bool linear_reads_xb(const LinearArgs& a);
bool linear_writes_xb(const LinearArgs& a);
// Whether the product a (plain: no up matrix, no swiglu) runs on the wgmma GEMM's plain epilogue, which writes
// a.y16 (bf16 rows in pair order instead of y: W's rows a multiple of 16, ldy even, y16 4-byte aligned; never
// split-K: with_split_k leaves a y16 product whole). linear_tiles fails on
// an a.y16 it rejects.
bool linear_writes_bf16(const LinearArgs& a);

// Whether linear_tiles runs every product of a on the wgmma GEMM (a gated a as one GATED product or as its
// gate and up products): the only kernel reading X through the XbCopy, so x's F32 rows stay unread when the
// copy holds them already (moe.cu, moe_xb_only_supported).
bool linear_tiles_on_wgmma(const LinearArgs& a);

// Product rows per tile of linear_tiles (the MoE tile map is built with it).
constexpr int LINEAR_TILE_ROWS = 64;
// A grouped tile map may have LINEAR_WIDE_TILE_ROWS rows per tile (RowTiles::tile_rows) when every
// product run over it satisfies linear_wide_tiles (the wgmma kernel has a 128-row instance for it).
constexpr int LINEAR_WIDE_TILE_ROWS = 128;
bool linear_wide_tiles(const LinearArgs& a);
// ... and LINEAR_MERGE_TILE_ROWS (an expert's last 128-row tile and a remainder of at most 32 rows as one tile:
// the MoE down product's merge map, moe_scatter_kernel) for a plain product (no gate, no gathered rows) that
// satisfies linear_wide_tiles: the wgmma kernel's BM = 160 instances.
constexpr int LINEAR_MERGE_TILE_ROWS = LINEAR_WIDE_TILE_ROWS + 32;

// 4/8-bit affine with BF16 scales, cols % 32 == 0 and 16-byte aligned words: every row (and every
// stack entry) starts on a 16-byte chunk, the form the GEMV kernels read.
bool is_fast_affine(const WeightView& w);
bool is_aligned16(const void* p);

// The tail of a kernel that ends in ops::add_rms_norm (kernels/norms.cuh, grid_tail_rms_norm): x [1, D] the
// residual row the kernel adds into, y = rms_norm(x) * weight, sync the I32 [1] completion counter; the
// thread mapping add_rms_norm would use for D (norms.cu).
NormTail norm_tail(const Tensor& x, const Tensor& weight, float eps, const Tensor& y, const Tensor& sync);

// add_rms_norm_xb's kernel parameters (norms.cu) for x += res, y = rms_norm(x) * weight (y empty: not written)
// with y's Xb into xb (checked: D % 8 == 0, xb 16-byte aligned), and whether add_rms_norm_kernel takes them on
// its float4 path (vec4): a kernel ending in add_rms_norm_row gives add_rms_norm's bits on that same path only
// (moe.cu: moe_combine_add_rms_norm_kernel, float4 only, with res empty).
struct AddRmsNormLaunch {
  AddRmsNormParams p;
  bool vec4;
};
AddRmsNormLaunch add_rms_norm_xb_launch(const Tensor& x, const Tensor& res, const Tensor& weight, float eps,
                                        const Tensor& y, const Tensor& xb);

// GEMV sizing (kernels/linear_gemv.cuh): threads per row slot for rows of `chunks` 16-byte chunks,
// and the CTA count for `passes` independent passes of `kernel` (256 threads, `smem` dynamic bytes).
int gemv_tpr(int64_t chunks);
int gemv_grid(const void* kernel, size_t smem, int64_t passes);

// The integer tensor-core GEMV (kernels/gemv_mma.cuh): weight-group halves per 64-byte row segment
// (1 or 2; 0: the group size does not fit it), log2 of a power of two, and the launch plan
// (mma_plan_for) of `kernel` over `tiles` 16-row tiles of `segments` segments each, when grid_rows grid
// rows share the device (dependent: the weights' addresses come from the kernel before).
int mma_group_halves(int bits, int64_t group_size);
int log2_of(int64_t v);
MmaPlan mma_plan(const void* kernel, size_t smem, int64_t tiles, int64_t segments, int64_t grid_rows,
                 bool dependent = false);

// Largest dynamic shared memory of one GEMV CTA (staged activations).
constexpr size_t GEMV_MAX_SMEM = 96 * 1024;

}  // namespace lily::cuda
