// The engine: config and weights on one device, and the layer loop that runs a chunk of tokens.
#pragma once
#include <array>
#include <memory>
#include <vector>

#include "config.h"
#include "forward.h"
#include "weights.h"

namespace lily {

struct LayerInput;  // engine.cpp: a layer's input to its projections

class Engine {
 public:
  Engine(ModelConfig config, std::unique_ptr<WeightStore> weights);
  const ModelConfig& config() const { return config_; }
  const WeightStore& weights() const { return *weights_; }
  Device device() const { return weights_->device(); }

  // A session hands itself over as a ForwardContext (forward.h): its state, scratch and position.
  // Runs T <= f.chunk tokens whose ids are in device memory at f.position, leaving the final residual
  // stream in f.scratch and the GDN layers' new state in f.next; advances the device position (the
  // session advances its own count). images:
  // the prompt's images when the chunk is part of one with images (its rows [t0, t0 + T)), else null.
  void forward_chunk(const ForwardContext& f, const Tensor& ids, int64_t T, const PromptImages* images = nullptr,
                     int64_t t0 = 0) const;
  // Logits of residual rows [row0, row0 + n) into the scratch's logits, n <= logit_rows.
  void logits_rows(const ForwardContext& f, int64_t row0, int64_t n) const;
  // Logits of rows [row0, row0 + n) downloaded to out [n, V].
  void write_logits(const ForwardContext& f, int64_t row0, int64_t n, float* out) const;

  // The vision tower (docs/model.md section 8, engine/vision.cpp) on n images: pixels [N, patch_dim] host
  // floats, the patches of every image in merge-block order, image after image; grids[i] = (t, h, w),
  // image i's grid in patches (t = 1). Writes the merged tokens [N / m^2, hidden_size] to out (host).
  // Allocates its work space per call (on the engine's device) and raises without a vision tower.
  void encode_images(const float* pixels, int64_t N, const std::vector<std::array<int, 3>>& grids, float* out) const;

 private:
  // A mixer's output projection, not yet applied: the caller adds w x into the residual stream. x_in_xb:
  // the mixer wrote x as bf16 into the linear workspace (ops::linear_xb reads it; x is empty then).
  struct Projection {
    const QMatrix* w;
    Tensor x;
    bool x_in_xb = false;
  };
  // st: the layer's state before the chunk; out: where its new state goes (st itself: in place).
  Projection gdn_layer(const ForwardContext& f, const LayerWeights& L, const LayerState& st, LayerState& out,
                       const LayerInput& in) const;
  // rope_pos: the chunk's (t, h, w) positions [T, 3] when its prompt has images (multimodal RoPE), else null.
  Projection attention_layer(const ForwardContext& f, const LayerWeights& L, LayerState& st, const LayerInput& in,
                             const Tensor* rope_pos) const;
  ModelConfig config_;
  std::unique_ptr<WeightStore> weights_;
};

}  // namespace lily
