// Constrained decoding's token mask (device code only; launcher in sample.cu):
//   logits[v] = -inf  where  (mask[v / 32] >> (v % 32)) & 1 == 0,  in place.
// logits [V] f32, mask [ceil(V/32)] u32 (llguidance's bitmask layout: bit i of word w = id 32w + i).
// One thread per mask word: it reads the word once and writes only the ids it forbids (a mask that
// allows most ids writes almost nothing); Qwen3.6's V = 248320 is 7760 threads.
#pragma once
#include <cstdint>

namespace lily::cuda {

__global__ void apply_token_mask_kernel(float* __restrict__ logits, const uint32_t* __restrict__ mask, int V) {
  const int w = blockIdx.x * blockDim.x + threadIdx.x;
  const int v0 = w * 32;
  if (v0 >= V) return;
  const uint32_t forbidden = ~mask[w];
  if (forbidden == 0u) return;
  const int n = min(32, V - v0);
  for (int i = 0; i < n; ++i)
    if ((forbidden >> i) & 1u) logits[v0 + i] = -INFINITY;
}

}  // namespace lily::cuda
