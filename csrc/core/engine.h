// The engine: config and weights on one device, and the layer loop that runs a chunk of tokens.
#pragma once
#include <memory>

#include "config.h"
#include "session.h"
#include "weights.h"

namespace lily {

class Engine {
 public:
  Engine(ModelConfig config, std::unique_ptr<WeightStore> weights);
  const ModelConfig& config() const { return config_; }
  const WeightStore& weights() const { return *weights_; }
  Device device() const { return weights_->device(); }

  // Runs T <= session.chunk() tokens at the session's position; logits of the last token (or all
  // tokens) are written to host memory.
  void forward_chunk(Session& s, const int32_t* ids, int64_t T, float* logits, bool all_logits) const;

 private:
  void gdn_layer(Session& s, const LayerWeights& L, LayerState& st, int64_t T) const;
  void attention_layer(Session& s, const LayerWeights& L, LayerState& st, int64_t T) const;
  void write_logits(Session& s, int64_t row0, int64_t n, float* out) const;
  ModelConfig config_;
  std::unique_ptr<WeightStore> weights_;
};

}  // namespace lily
