// Launcher-level pieces of linear.cu that moe.cu reuses: the weight view of a QMatrix and the
// tiled product over (possibly grouped) rows. Host-side; the kernels are in kernels/linear_*.cuh.
#pragma once
#include "../core/weights.h"
#include "kernels/linear_common.cuh"

namespace lily::cuda {

WeightView weight_view(const QMatrix& w);

// Runs a.tiles over `max_tiles` row tiles of GENERIC_TILE_ROWS (= GEMM_BM) rows: the tensor-core
// GEMM where the weight variant and alignment allow it, the generic kernel otherwise.
void linear_tiles(const LinearArgs& a, int64_t max_tiles);

// Product rows per tile of linear_tiles (the MoE tile map is built with it).
constexpr int LINEAR_TILE_ROWS = 64;

}  // namespace lily::cuda
