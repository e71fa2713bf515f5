// The one description of the model's tensors (docs/model.md section 4): every tensor of the text
// model by canonical name and shape, each with the view of ModelWeights it fills.
// WeightStore::resolve checks a checkpoint against this table; Python reads it through
// lily._core.model_tensors (src/lily/checkpoint/tensors.py), so the loader, the converter and the
// synthetic checkpoints use the same names and shapes as the engine.
#pragma once
#include <string>
#include <vector>

#include "config.h"
#include "weights.h"

namespace lily {

struct TensorSpec {
  std::string name;                  // canonical: no model prefix, no ".weight" ("layers.3.mlp.experts.gate_proj",
                                     // "visual.blocks.0.attn.qkv", its bias "visual.blocks.0.attn.qkv.bias")
  std::vector<int64_t> shape;        // matrices [out, in], expert stacks [E, out, in]; vectors 1-D, conv1d [C, K]
  const QMatrix** matrix = nullptr;  // the view a matrix fills, or
  const Vector** vector = nullptr;   // the view a vector fills
};

// Every tensor of the model in Hugging Face checkpoint order: the text model's (mtp excluded), then
// the vision tower's (`visual.*`) when the config has one (c.vision.present());
// sizes views.layers to the config's layers and points each entry at its view there. Throws
// lily::Error naming the field of an inconsistent config (ModelConfig::validate).
std::vector<TensorSpec> model_tensors(const ModelConfig& c, ModelWeights& views);

}  // namespace lily
