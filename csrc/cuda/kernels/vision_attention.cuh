// The vision tower's attention on tensor cores: non-causal, each image's patches among themselves.
//   o[t, h, :] = sum_{s in img(t)} softmax_s(q[t, h, :] . k[s, h, :] / sqrt(D)) v[s, h, :],
//   img(t) = rows [starts[i], starts[i+1]) holding t. Matches cpu::vision_attention.
// Two kernels. vision_qkv_pack_kernel: qkv [N, 3 nH D] f32 (q | k | v, head-major) -> ws [3][nH][N][DP] bf16
// (round to nearest even; dims D..DP-1 zero, DP = D rounded up to 16), one thread per 8-value chunk.
// vision_attention_kernel<DP>: grid (tiles, nH), 128 threads; x-block b is tile b of the images' 64-row
// query tiles in image order (found by walking starts; blocks past the last tile exit), warp w owns 16 of
// its rows. Q and 64-row K/V tiles of the image stream through shared memory (cp.async, two stages;
// rows past the image zero-filled and, as keys, masked to -inf), QK^T and PV on mma.sync m16n8k16 with
// the attention_prefill fragments; the zero dims add nothing. o [N, nH D] f32, only rows of the image.
// Precision: q, k, v and p rounded to bf16 for the products, fp32 accumulation, online softmax in fp32
// (log2 units), as attention_prefill.
#pragma once
#include "attention_mma.cuh"
#include "common.cuh"

namespace lily::cuda::attn {

constexpr int kVisionThreads = 128;
constexpr int kVisionRows = 64;   // query rows per CTA (16 per warp) and key rows per stage
constexpr int kVisionStages = 2;
constexpr int kVisionMaxDP = 128;

// Head size as the tensor cores see it: D rounded up to a whole k-step of 16.
constexpr int64_t vision_padded_dim(int64_t D) { return (D + 15) / 16 * 16; }

template <int kDP>
constexpr int vision_smem_bytes() {
  return (kVisionRows + 2 * kVisionStages * kVisionRows) * (kDP + kPad) * 2;
}

struct VisionPackParams {
  const float* qkv;  // [N, 3 nH D] f32
  bf16* ws;          // [3][nH][N][DP] bf16
  int64_t n;         // 3 nH N DP/8 chunks
  int N, nH, D, DP;
};

// Chunk i = ((which nH + h) N + t) DP/8 + c: dims [8c, 8c + 8) of row t of head h of q, k or v (which).
__global__ void vision_qkv_pack_kernel(const VisionPackParams p) {
  pdl_wait();
  pdl_trigger();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= p.n) return;
  const int chunks = p.DP / 8, c = int(i % chunks);
  const int64_t r = i / chunks, t = r % p.N, wh = r / p.N;  // wh = which * nH + h
  const int64_t W = int64_t(p.nH) * p.D;
  const float* src = p.qkv + t * 3 * W + (wh / p.nH) * W + (wh % p.nH) * p.D;
  float v[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) v[e] = 8 * c + e < p.D ? src[8 * c + e] : 0.f;
  *reinterpret_cast<uint4*>(p.ws + i * 8) =
      make_uint4(pack_bf16(v[0], v[1]), pack_bf16(v[2], v[3]), pack_bf16(v[4], v[5]), pack_bf16(v[6], v[7]));
}

struct VisionAttnParams {
  const bf16* ws;         // [3][nH][N][DP] bf16 (vision_qkv_pack_kernel)
  const int32_t* starts;  // [num_images + 1] i32, checked by the op
  float* o;               // [N, nH D] f32
  int N, nH, D, num_images;
  float scale_log2;       // log2(e) / sqrt(D)
};

// The image and first query row of x-block b: tiles of ceil(len_i / 64) per image, in order. False past
// the last tile.
__device__ __forceinline__ bool vision_tile(const int32_t* starts, int num_images, int b, int& s0, int& len,
                                           int& t0) {
  for (int i = 0; i < num_images; ++i) {
    const int a = starts[i], n = starts[i + 1] - a, tiles = (n + kVisionRows - 1) / kVisionRows;
    if (b < tiles) {
      s0 = a, len = n, t0 = b * kVisionRows;
      return true;
    }
    b -= tiles;
  }
  return false;
}

template <int kDP>
__global__ void __launch_bounds__(kVisionThreads) vision_attention_kernel(const VisionAttnParams p) {
  pdl_wait();
  pdl_trigger();
  constexpr int kStride = kDP + kPad, kNT = kDP / 8, kTileNT = kVisionRows / 8, kStageElems = kVisionRows * kStride;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* q_s = reinterpret_cast<bf16*>(smem);      // [kVisionRows][kStride]
  bf16* k_s = q_s + kVisionRows * kStride;        // [kVisionStages][kVisionRows][kStride]
  bf16* v_s = k_s + kVisionStages * kStageElems;  // [kVisionStages][kVisionRows][kStride]

  int s0, len, t0;
  if (!vision_tile(p.starts, p.num_images, blockIdx.x, s0, len, t0)) return;
  const int h = blockIdx.y, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, c = lane & 3;
  const int64_t head_rows = int64_t(p.N) * kDP;  // one head of q, k or v in ws
  const bf16* q_head = p.ws + int64_t(h) * head_rows + int64_t(s0) * kDP;
  const bf16* k_head = p.ws + int64_t(p.nH + h) * head_rows + int64_t(s0) * kDP;
  const bf16* v_head = p.ws + int64_t(2 * p.nH + h) * head_rows + int64_t(s0) * kDP;
  const int num_tiles = (len + kVisionRows - 1) / kVisionRows;

  // Tile i goes to stage i % kVisionStages; one commit group per tile (empty past the last). The query
  // tile joins tile 0's group.
  const auto issue_tile = [&](int i) {
    if (i < num_tiles) {
      const int stage = (i % kVisionStages) * kStageElems;
      load_kv_tile<kVisionRows, kDP, kVisionThreads>(k_s + stage, k_head, kDP, i * kVisionRows, len);
      load_kv_tile<kVisionRows, kDP, kVisionThreads>(v_s + stage, v_head, kDP, i * kVisionRows, len);
    }
    cp_async_commit();
  };
  load_kv_tile<kVisionRows, kDP, kVisionThreads>(q_s, q_head, kDP, t0, len);
#pragma unroll
  for (int i = 0; i < kVisionStages - 1; ++i) issue_tile(i);

  // This thread's two query rows of the image: t0 + 16 warp + g and that + 8.
  const int row_a = t0 + 16 * warp + (lane >> 2);
  float o[kNT][4] = {};  // dims 8j + 2c (+1) of rows row_a, row_a + 8
  float run_m[2] = {-INFINITY, -INFINITY}, run_l[2] = {0.f, 0.f};  // run_l: this thread's columns only

  for (int tile = 0; tile < num_tiles; ++tile) {
    const int tile_row0 = tile * kVisionRows;
    cp_async_wait<kVisionStages - 2>();
    __syncthreads();  // every warp is done with tile - 1, whose stage the next issue refills
    issue_tile(tile + kVisionStages - 1);
    const bf16* k_t = k_s + (tile % kVisionStages) * kStageElems;  // [kVisionRows][kStride]
    const bf16* v_t = v_s + (tile % kVisionStages) * kStageElems;  // [kVisionRows][kStride]

    float s[kTileNT][4] = {};  // scores of rows row_a (+8) x tile keys 8n + 2c (+1)
#pragma unroll
    for (int kk = 0; kk < kDP / 16; ++kk) {
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

    // Keys past the image (zero-filled rows of the last tile) are masked; key tile_row0 < len is not, so
    // every row's running max is finite from the first tile on.
    const bool past_end = tile_row0 + kVisionRows > len;
#pragma unroll
    for (int n = 0; n < kTileNT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = tile_row0 + 8 * n + 2 * c + (e & 1);
        s[n][e] = past_end && key >= len ? -INFINITY : s[n][e] * p.scale_log2;
      }

#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float mx = run_m[i];
#pragma unroll
      for (int n = 0; n < kTileNT; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * i], s[n][2 * i + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
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
    for (int kk = 0; kk < kVisionRows / 16; ++kk) {
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

  const int64_t W = int64_t(p.nH) * p.D;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float l = run_l[i];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int row = row_a + 8 * i;
    if (row >= len) continue;
    const float inv_l = 1.f / l;
    float* dst = p.o + int64_t(s0 + row) * W + int64_t(h) * p.D;  // [D] f32
#pragma unroll
    for (int j = 0; j < kNT; ++j) {
      const int d = 8 * j + 2 * c;
      if (d < p.D) dst[d] = o[j][2 * i] * inv_l;
      if (d + 1 < p.D) dst[d + 1] = o[j][2 * i + 1] * inv_l;
    }
  }
}

}  // namespace lily::cuda::attn
