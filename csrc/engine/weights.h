// The model's weights on the device: the per-layer views of ModelWeights, and the WeightStore that
// holds the named tensors the Python loader hands over. The matrices are ops::-level QMatrix stacks
// (ops/weights.h), in the checkpoint's own storage form (dense float or MLX affine packed).
#pragma once
#include <map>
#include <string>
#include <vector>

#include "../ops/weights.h"
#include "../runtime/tensor.h"
#include "config.h"

namespace lily {

// A float32 vector parameter (norm weights, conv taps, A_log, dt_bias).
struct Vector {
  std::vector<int64_t> shape;
  Buffer data;
  int64_t numel() const;
  Tensor view() const;
};

struct GdnWeights {
  const QMatrix *in_proj_qkv, *in_proj_z, *in_proj_b, *in_proj_a, *out_proj;
  // [qkv; z; b; a] stacked by rows (the four above are views into it) when they share one storage
  // format, else null: the decode step's one GEMV over the shared input.
  const QMatrix* in_proj = nullptr;
  // [b; a]: in_proj's last rows as one matrix (a view; null without in_proj): a prompt's one product for
  // both 32-row projections where they run on their own (engine.cpp's project, its tail)
  const QMatrix* in_proj_ba = nullptr;
  const Vector *conv1d;  // [conv_dim, K]
  const Vector *A_log, *dt_bias;  // [Hv]
  const Vector *norm;    // [Dv], plain multiplier
};

struct AttentionWeights {
  const QMatrix *q_proj, *k_proj, *v_proj, *o_proj;
  const QMatrix* qkv_proj = nullptr;  // [q; k; v] stacked by rows, as GdnWeights::in_proj
  const Vector *q_norm, *k_norm;  // [D], stored as the 1+w multiplier
};

struct LayerWeights {
  bool is_full_attention;
  const Vector *input_layernorm, *post_attention_layernorm;  // [H], 1+w multipliers
  GdnWeights gdn{};
  AttentionWeights attn{};
  MoeWeights moe{};
};

// A linear layer with a bias: y = x W^T + b (the vision tower's layers all have one).
struct BiasedLinear {
  const QMatrix* w = nullptr;  // [out, in], dense
  const Vector* b = nullptr;   // [out]
};

struct LayerNormWeights {
  const Vector *weight = nullptr, *bias = nullptr;  // [W] each
};

struct VisionBlockWeights {
  LayerNormWeights norm1, norm2;
  BiasedLinear qkv;   // [3W, W]: q | k | v, each head-major
  BiasedLinear proj;  // [W, W]
  BiasedLinear fc1;   // [I, W]
  BiasedLinear fc2;   // [W, I]
};

// The vision tower (docs/model.md section 8); empty (no blocks) without one.
struct VisionWeights {
  BiasedLinear patch_embed;           // [W, C*tp*p*p]: the Conv3d as a matrix over flattened patches
  const Vector* pos_embed = nullptr;  // [side*side, W] learned positions
  std::vector<VisionBlockWeights> blocks;
  LayerNormWeights merger_norm;       // [W]
  BiasedLinear merger_fc1;            // [4W, 4W]
  BiasedLinear merger_fc2;            // [H, 4W]
};

// The model's tensors as per-layer views (engine/tensors.h says which name fills which view).
struct ModelWeights {
  const QMatrix* embed_tokens = nullptr;  // [V, H]
  const Vector* final_norm = nullptr;     // [H]
  const QMatrix* lm_head = nullptr;       // [V, H]
  std::vector<LayerWeights> layers;
  VisionWeights vision;
};

// Named tensors handed over by the Python loader, then resolved into the views of ModelWeights.
class WeightStore : public ModelWeights {
 public:
  explicit WeightStore(Device device) : device_(device) {}
  void set_matrix(const std::string& name, QMatrix m) { matrices_[name] = std::move(m); }
  void set_vector(const std::string& name, Vector v) { vectors_[name] = std::move(v); }
  Device device() const { return device_; }

  // Checks every tensor of the config's model_tensors() is present with its shape (throws naming
  // it), fills the views, and stacks the same-input projections.
  void resolve(const ModelConfig& cfg);

  size_t nbytes() const;  // owned bytes (stacked matrices once)
  // One line per tensor: name, storage form and shape, and the hex of a few bytes read at its start,
  // middle and end (weight, scales, biases): the model identity that snapshot files record, cheap to
  // compute (a few small downloads per tensor) and the same for a checkpoint on any device.
  std::string signature() const;

 private:
  const QMatrix* matrix(const std::string& name, const std::vector<int64_t>& shape) const;
  const Vector* vector(const std::string& name, const std::vector<int64_t>& shape) const;
  // Moves the single-entry matrices `parts` (resolved views of this store) into one matrix `name`
  // stacked by rows and leaves views of it in their place; null (nothing moved) when their formats differ.
  const QMatrix* stack_rows(const std::string& name, const std::vector<const QMatrix*>& parts);
  // Rows [row0, row0 + rows) of the single-entry matrix m as a view `name` (not part of signature() or nbytes():
  // it owns nothing and adds no tensor).
  const QMatrix* row_block(const std::string& name, const QMatrix& m, int64_t row0, int64_t rows);
  Device device_;
  std::map<std::string, QMatrix> matrices_;
  std::map<std::string, QMatrix> row_blocks_;  // row_block's views
  std::map<std::string, QMatrix> folds_;       // MoeWeights::router_fold (derived: not in signature())
  std::map<std::string, Vector> vectors_;
};

}  // namespace lily
