// Causal GQA flash attention for a chunk of new tokens (prefill) on tensor cores.
//   o[t, h, :] = sum_{j <= pos0+t} softmax_j(q[t, h, :] . k[j, kvh, :] / sqrt(D)) v[j, kvh, :],
//   kvh = h / group. Matches cpu::attention.
// q, o [T, nH*D] f32; k_cache, v_cache [maxT, nKV*D] bf16 (rows < pos0 hold earlier chunks,
// rows [pos0, pos0+T) this chunk); pos [1] i32 on the device.
// Grid (ceil(T/64), nH), 128 threads: CTA (tile, h) owns query rows [64 tile, 64 tile + 64) of
// head h (the last query tiles, which see the most keys, are launched first); warp w owns 16 of
// them. K/V tiles of 64 rows (32 at D = 256) stream through shared memory (cp.async, two stages)
// up to the causal limit pos0 + last row, read from the device position.
// Precision: q and p are rounded to bf16 for the products (fp32 accumulation); the online softmax
// (running max, sum, rescale) is fp32 in log2 units.
#pragma once
#include "attention_mma.cuh"

namespace lily::cuda::attn {

constexpr int kPrefillThreads = 128;
constexpr int kPrefillRows = 64;  // query rows per CTA (16 per warp)
// Cache rows per pipeline stage: 32 at D = 256 keeps o [64 floats x 2 rows] plus the scores in
// registers without spilling.
template <int kD>
constexpr int prefill_tile() { return kD == 256 ? 32 : 64; }

struct PrefillParams {
  const float* q;        // [T, nH*D] f32
  const bf16* k_cache;   // [maxT, nKV*D] bf16
  const bf16* v_cache;   // [maxT, nKV*D] bf16
  float* o;              // [T, nH*D] f32
  const int32_t* pos;    // [1] i32
  int T, nH, nKV, group;
  float scale_log2;      // log2(e) / sqrt(D)
};

constexpr int kPrefillStages = 2;  // keeps two CTAs per multiprocessor at every head_dim

template <int kD>
constexpr int prefill_smem_bytes() {
  return (kPrefillRows + 2 * kPrefillStages * prefill_tile<kD>()) * (kD + kPad) * 2;
}

template <int kD>
__global__ void __launch_bounds__(kPrefillThreads) attention_prefill_kernel(const PrefillParams p) {
  pdl_wait();
  pdl_trigger();
  constexpr int kPrefillTile = prefill_tile<kD>();
  constexpr int kStride = kD + kPad, kNT = kD / 8, kTileNT = kPrefillTile / 8, kStageElems = kPrefillTile * kStride;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* q_s = reinterpret_cast<bf16*>(smem);       // [kPrefillRows][kStride]
  bf16* k_s = q_s + kPrefillRows * kStride;        // [kPrefillStages][kPrefillTile][kStride]
  bf16* v_s = k_s + kPrefillStages * kStageElems;  // [kPrefillStages][kPrefillTile][kStride]

  const int q_tile = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, kvh = h / p.group, tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const int pos0 = *p.pos, t0 = q_tile * kPrefillRows;
  const int kv_end = pos0 + min(t0 + kPrefillRows, p.T);  // rows [0, kv_end) are visible to the tile
  const int num_tiles = (kv_end + kPrefillTile - 1) / kPrefillTile;
  const int64_t row_stride = int64_t(p.nKV) * kD;
  const bf16* k_head = p.k_cache + kvh * kD;
  const bf16* v_head = p.v_cache + kvh * kD;

  // Tile i goes to stage i % kPrefillStages; one commit group per tile (empty past the last).
  const auto issue_tile = [&](int i) {
    if (i < num_tiles) {
      const int stage = (i % kPrefillStages) * kStageElems;
      load_kv_tile<kPrefillTile, kD, kPrefillThreads>(k_s + stage, k_head, row_stride, i * kPrefillTile, kv_end);
      load_kv_tile<kPrefillTile, kD, kPrefillThreads>(v_s + stage, v_head, row_stride, i * kPrefillTile, kv_end);
    }
    cp_async_commit();
  };
#pragma unroll
  for (int i = 0; i < kPrefillStages - 1; ++i) issue_tile(i);

  for (int i = tid; i < kPrefillRows * (kD / 4); i += kPrefillThreads) {
    const int r = i / (kD / 4), d = (i % (kD / 4)) * 4;
    float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
    if (t0 + r < p.T) x = *reinterpret_cast<const float4*>(p.q + (int64_t(t0 + r) * p.nH + h) * kD + d);
    *reinterpret_cast<uint2*>(q_s + r * kStride + d) = make_uint2(pack_bf16(x.x, x.y), pack_bf16(x.z, x.w));
  }

  // This thread's two query rows: t0 + 16 warp + g and that + 8 (positions pos0 + row).
  const int row_a = t0 + 16 * warp + g;
  float o[kNT][4] = {};  // dims 8j + 2c (+1) of rows row_a, row_a + 8
  float run_m[2] = {-INFINITY, -INFINITY}, run_l[2] = {0.f, 0.f};  // run_l: this thread's columns only

  for (int tile = 0; tile < num_tiles; ++tile) {
    const int tile_row0 = tile * kPrefillTile;
    cp_async_wait<kPrefillStages - 2>();
    __syncthreads();  // every warp is done with tile - 1, whose stage the next issue refills
    issue_tile(tile + kPrefillStages - 1);
    const bf16* k_t = k_s + (tile % kPrefillStages) * kStageElems;  // [kPrefillTile][kStride]
    const bf16* v_t = v_s + (tile % kPrefillStages) * kStageElems;  // [kPrefillTile][kStride]

    float s[kTileNT][4] = {};  // scores of rows row_a (+8) x tile cols 8n + 2c (+1)
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      uint32_t a[4];
      load_a_frag(a, q_s, kStride, 16 * warp, 16 * kk);
#pragma unroll
      for (int n = 0; n < kTileNT; n += 2) {
        uint32_t b[4];
        load_bt_frag_x2n(b, k_t, kStride, 8 * n, 16 * kk);
        mma_bf16(s[n], a, b[0], b[1]);
        mma_bf16(s[n + 1], a, b[2], b[3]);
      }
    }

    // Causal mask only where the tile reaches past the CTA's first query position.
    const bool crosses_diagonal = tile_row0 + kPrefillTile - 1 > pos0 + t0;
#pragma unroll
    for (int n = 0; n < kTileNT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = tile_row0 + 8 * n + 2 * c + (e & 1), query = row_a + (e >> 1) * 8;
        s[n][e] = crosses_diagonal && key > pos0 + query ? -INFINITY : s[n][e] * p.scale_log2;
      }

#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float mx = run_m[i];
#pragma unroll
      for (int n = 0; n < kTileNT; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * i], s[n][2 * i + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      // Key 0 is visible to every row, so mx is finite from the first tile on.
      const float alpha = exp2f(run_m[i] - mx);
      run_m[i] = mx;
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < kTileNT; ++n) {
        s[n][2 * i] = exp2f(s[n][2 * i] - mx);
        s[n][2 * i + 1] = exp2f(s[n][2 * i + 1] - mx);
        sum += s[n][2 * i] + s[n][2 * i + 1];
      }
      run_l[i] = run_l[i] * alpha + sum;
#pragma unroll
      for (int j = 0; j < kNT; ++j) {
        o[j][2 * i] *= alpha;
        o[j][2 * i + 1] *= alpha;
      }
    }

    // The score C fragments of n-tiles 2kk, 2kk+1 are the A fragment of k-step kk.
#pragma unroll
    for (int kk = 0; kk < kPrefillTile / 16; ++kk) {
      const uint32_t a[4] = {pack_bf16(s[2 * kk][0], s[2 * kk][1]), pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                             pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int j = 0; j < kNT; j += 2) {
        uint32_t b[4];
        load_b_frag_x2n(b, v_t, kStride, 16 * kk, 8 * j);
        mma_bf16(o[j], a, b[0], b[1]);
        mma_bf16(o[j + 1], a, b[2], b[3]);
      }
    }
  }

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float l = run_l[i];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int row = row_a + 8 * i;
    if (row >= p.T) continue;
    const float inv_l = 1.f / l;
    float* dst = p.o + (int64_t(row) * p.nH + h) * kD;  // [D] f32
#pragma unroll
    for (int j = 0; j < kNT; ++j)
      *reinterpret_cast<float2*>(dst + 8 * j + 2 * c) = make_float2(o[j][2 * i] * inv_l, o[j][2 * i + 1] * inv_l);
  }
}

}  // namespace lily::cuda::attn
