// The weight operands of the ops, on the device in the checkpoint's own storage form (dense float or
// MLX affine packed): a stack of matrices (QMatrix, what ops::linear and ops::embedding multiply by)
// and the matrices of one MoE block (ops::moe). engine/weights.h builds the model's views from them.
#pragma once
#include <string>

#include "../runtime/tensor.h"

namespace lily {

// A stack of num_stack matrices, each [rows, cols] = [out, in] (nn.Linear convention).
// Dense: weight holds float values (F32/F16/BF16) [num_stack, rows, cols].
// Affine (MLX): weight U32 [num_stack, rows, cols*bits/32], little-endian bit stream per row;
// scales, biases [num_stack, rows, cols/group_size] in scale_dtype; w = scale*q + bias.
struct QMatrix {
  int64_t num_stack = 1, rows = 0, cols = 0;
  DType dtype = DType::F32;  // storage of weight: U32 when quantized
  int bits = 0;              // 0 = dense
  int group_size = 0;
  DType scale_dtype = DType::F32;
  Buffer weight, scales, biases;

  bool quantized() const { return bits > 0; }
  int64_t words_per_row() const { return cols * bits / 32; }
  int64_t groups_per_row() const { return cols / group_size; }
  std::string describe() const;
};

struct MoeWeights {
  const QMatrix* router;                      // [E, H]
  const QMatrix *gate_proj, *up_proj;         // stacks [E, I, H]
  const QMatrix* down_proj;                   // stack [E, H, I]
  const QMatrix *shared_gate_proj, *shared_up_proj;  // [Is, H]
  const QMatrix* shared_down_proj;            // [H, Is]
  const QMatrix* shared_expert_gate;          // [1, H]
  // [router; shared_expert_gate] stacked by rows when they share one storage format, else null
  // (as GdnWeights::in_proj in engine/weights.h): the decode step's one GEMV over the shared input.
  const QMatrix* router_gates = nullptr;
  // M = router_gates diag(post-attention norm multiplier) O [E + 1, A] F32, O the mixer's output projection
  // [H, A]: the one-token router folded through that projection (ops::linear_add_moe_rms_normed_add; built at
  // load on CUDA where ops::router_fold_supported, else null). Derived from the weights, not a checkpoint tensor.
  const QMatrix* router_fold = nullptr;
};

}  // namespace lily
