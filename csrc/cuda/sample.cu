// Launchers of the sampler kernels (kernels/sample.cuh, token_mask.cuh): the draw, the token mask of
// constrained decoding, prompt marking and the device position counter. All stay on the device: the
// next decode step reads state.token from there.
#include "cuda_ops.h"
#include "kernels/sample.cuh"
#include "kernels/sample_greedy.cuh"
#include "kernels/token_mask.cuh"
#include "../runtime/cuda_device.h"

namespace lily::cuda {

static bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// The sampler's cluster size (greedy without logprobs runs greedy_kernel instead, no cluster): greedy with
// logprobs (the argmax and the logprob passes) SAMPLE_CTAS_PORTABLE; a draw SAMPLE_CTAS where the
// device grants that non-portable size and such a cluster can be resident (asked once), else the portable size.
// Greedy on 16 CTAs measured 0.010 ms a decode step slower (H200, 4K: 1.615-1.626 against 1.609-1.613 ms), the
// draws' extra passes gain from it (perf-notes, "the sampler on a 16-CTA cluster"). Fixed per device and
// sampler kind, so a given device draws the same bits run after run (the full passes' float sums group by CTA).
static int sample_cluster_ctas(bool draws) {
  if (!draws) return SAMPLE_CTAS_PORTABLE;
  static const int wide = cluster_fits(sample_kernel, SAMPLE_CTAS, SAMPLE_THREADS) ? SAMPLE_CTAS : SAMPLE_CTAS_PORTABLE;
  return wide;
}

void sample(const Tensor& logits, const ops::SamplerParams& params, uint64_t step, const ops::SamplerState& state) {
  const int64_t V = logits.dim(0);
  LILY_CHECK(V > 0 && V <= (int64_t(1) << 30), "sample: vocabulary size ", V, " outside the CUDA sampler's range");
  LILY_CHECK(aligned16(logits.data) && aligned16(state.counts.data) && aligned16(state.seen.data),
             "sample: logits, counts and seen must be 16-byte aligned on CUDA");
  SampleParams p{};
  p.logits = logits.ptr<float>();
  p.counts = state.counts.ptr<int32_t>();
  p.seen = state.seen.ptr<int32_t>();
  p.token = state.token.ptr<int32_t>();
  p.logprob_ids = state.logprob_ids.ptr<int32_t>();
  p.logprob_values = state.logprob_values.ptr<float>();
  p.V = int(V);
  p.top_k = params.top_k;
  p.num_logprobs = params.num_logprobs;
  p.max_logprobs = ops::MAX_LOGPROBS;
  p.temperature = params.temperature;
  p.top_p = params.top_p;
  p.min_p = params.min_p;
  p.presence = params.presence_penalty;
  p.frequency = params.frequency_penalty;
  p.repetition = params.repetition_penalty;
  // Without penalties the scores are the logits and counts/seen are not read while drawing.
  p.has_penalty = params.repetition_penalty != 1.f || params.presence_penalty != 0.f ||
                  params.frequency_penalty != 0.f;
  p.seed = params.seed;
  p.step = step;
  if (p.temperature == 0.f && p.num_logprobs < 0) {  // greedy, no logprobs: one pass on a plain grid
    launch(greedy_kernel, dim3(GREEDY_CTAS), dim3(GREEDY_THREADS), 0, p);
    LILY_CUDA_LAUNCHED();
    return;
  }
  const unsigned n = unsigned(sample_cluster_ctas(p.temperature != 0.f));  // one cluster
  launch_clustered(sample_kernel, dim3(n), dim3(SAMPLE_THREADS), dim3(n), 0, p);
  LILY_CUDA_LAUNCHED();
}

void apply_token_mask(const Tensor& logits, const Tensor& mask) {
  const int64_t V = logits.dim(0);
  LILY_CHECK(V > 0 && V <= (int64_t(1) << 30), "apply_token_mask: vocabulary size ", V, " out of range");
  constexpr int THREADS = 256;
  const int64_t words = (V + 31) / 32;
  apply_token_mask_kernel<<<unsigned(ceil_div<int64_t>(words, THREADS)), THREADS, 0, stream()>>>(
      logits.ptr<float>(), reinterpret_cast<const uint32_t*>(mask.ptr<int32_t>()), int(V));
  LILY_CUDA_LAUNCHED();
}

void sampler_mark_seen(const Tensor& ids, const ops::SamplerState& state) {
  const int64_t n = ids.dim(0);
  LILY_CHECK(n <= 0x7fffffff, "sampler_mark_seen: too many ids (", n, ")");
  if (n == 0) return;
  constexpr int THREADS = 256;
  mark_seen_kernel<<<unsigned(ceil_div<int64_t>(n, THREADS)), THREADS, 0, stream()>>>(
      ids.ptr<int32_t>(), int(n), state.seen.ptr<int32_t>(), int(state.seen.dim(0)));
  LILY_CUDA_LAUNCHED();
}

void advance_position(int32_t* pos, int64_t T) {
  LILY_CHECK(T >= -0x7fffffff && T <= 0x7fffffff, "advance_position: step of ", T, " tokens out of range");
  advance_position_kernel<<<1, 1, 0, stream()>>>(pos, int(T));
  LILY_CUDA_LAUNCHED();
}

}  // namespace lily::cuda
