// The engine: config and weights on one device, and the layer loop that runs a chunk of tokens.
#pragma once
#include <memory>

#include "config.h"
#include "forward.h"
#include "weights.h"

namespace lily {

class Engine {
 public:
  Engine(ModelConfig config, std::unique_ptr<WeightStore> weights);
  const ModelConfig& config() const { return config_; }
  const WeightStore& weights() const { return *weights_; }
  Device device() const { return weights_->device(); }

  // A session hands itself over as a ForwardContext (forward.h): its state, scratch and position.
  // Runs T <= f.chunk tokens whose ids are in device memory at f.position, leaving the final residual
  // stream in f.scratch; advances the device position (the session advances its own count).
  void forward_chunk(const ForwardContext& f, const Tensor& ids, int64_t T) const;
  // Logits of residual rows [row0, row0 + n) into the scratch's logits, n <= logit_rows.
  void logits_rows(const ForwardContext& f, int64_t row0, int64_t n) const;
  // Logits of rows [row0, row0 + n) downloaded to out [n, V].
  void write_logits(const ForwardContext& f, int64_t row0, int64_t n, float* out) const;

 private:
  // A mixer's output projection, not yet applied: the caller adds w x into the residual stream.
  struct Projection {
    const QMatrix* w;
    Tensor x;
  };
  Projection gdn_layer(const ForwardContext& f, const LayerWeights& L, LayerState& st, int64_t T) const;
  Projection attention_layer(const ForwardContext& f, const LayerWeights& L, LayerState& st, int64_t T) const;
  ModelConfig config_;
  std::unique_ptr<WeightStore> weights_;
};

}  // namespace lily
