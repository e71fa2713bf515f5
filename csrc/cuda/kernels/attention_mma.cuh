// Tensor-core building blocks of the attention kernels: mma.sync m16n8k16 (bf16 x bf16 -> f32),
// ldmatrix fragment loads from padded shared tiles, cp.async copies of K/V cache tiles.
// Fragment layout (PTX ISA, mma.m16n8k16), lane = 4 g + c:
//   A 16x16 row-major: a0 = (g, 2c..2c+1), a1 = (g+8, 2c..), a2 = (g, 2c+8..), a3 = (g+8, 2c+8..)
//   B 16x8:            b0 = (k 2c..2c+1, n g), b1 = (k 2c+8..2c+9, n g)
//   C 16x8 f32:        c0,c1 = (g, 2c..2c+1), c2,c3 = (g+8, 2c..2c+1)
// The lower-index element of a pair sits in the low 16 bits. Shared tiles are row-major bf16 with
// rows padded by kPad elements (16 bytes), so the eight 16-byte rows of one ldmatrix phase fall
// in distinct banks.
#pragma once
#include <cuda_bf16.h>
#include <cstdint>

namespace lily::cuda::attn {

using bf16 = __nv_bfloat16;

constexpr int kPad = 8;  // bf16 elements of padding per shared row

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// d += a * b for one 16x8 tile.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr(p)));
}

// A fragment of rows [m0, m0+16) x cols [k0, k0+16) of a row-major tile (lane l addresses matrix l/8).
__device__ __forceinline__ void load_a_frag(uint32_t (&a)[4], const bf16* tile, int stride, int m0, int k0) {
  const int l = threadIdx.x & 31;
  ldmatrix_x4(a, tile + (m0 + (l & 7) + ((l >> 3) & 1) * 8) * stride + k0 + (l >> 4) * 8);
}

// B fragments of two n-tiles for B = tile^T, tile rows [n0, n0+16) x cols [k0, k0+16):
// {b[0], b[1]} is n-tile n0, {b[2], b[3]} is n-tile n0+8 (K rows as the columns of Q K^T).
__device__ __forceinline__ void load_bt_frag_x2n(uint32_t (&b)[4], const bf16* tile, int stride, int n0, int k0) {
  const int l = threadIdx.x & 31;
  ldmatrix_x4(b, tile + (n0 + (l & 7) + (l >> 4) * 8) * stride + k0 + ((l >> 3) & 1) * 8);
}

// One n-tile of the above: tile rows [n0, n0+8) (lanes 16..31 supply no address).
__device__ __forceinline__ void load_bt_frag_x1n(uint32_t (&b)[2], const bf16* tile, int stride, int n0, int k0) {
  const int l = threadIdx.x & 15;
  ldmatrix_x2(b, tile + (n0 + (l & 7)) * stride + k0 + (l >> 3) * 8);
}

// B fragments of two n-tiles for B = tile, tile rows [k0, k0+16) x cols [n0, n0+16):
// {b[0], b[1]} is cols n0..n0+7, {b[2], b[3]} cols n0+8.. (V rows as the k axis of P V).
__device__ __forceinline__ void load_b_frag_x2n(uint32_t (&b)[4], const bf16* tile, int stride, int k0, int n0) {
  const int l = threadIdx.x & 31;
  ldmatrix_x4_trans(b, tile + (k0 + (l & 7) + ((l >> 3) & 1) * 8) * stride + n0 + (l >> 4) * 8);
}

// One n-tile of the above (lanes 16..31 supply no address).
__device__ __forceinline__ void load_b_frag_x1n(uint32_t (&b)[2], const bf16* tile, int stride, int k0, int n0) {
  const int l = threadIdx.x & 15;
  ldmatrix_x2_trans(b, tile + (k0 + (l & 7) + ((l >> 3) & 1) * 8) * stride + n0);
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// 16-byte async copy; src_bytes = 0 zero-fills the destination without reading src.
__device__ __forceinline__ void cp_async_16(bf16* dst, const bf16* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending)); }

// Cache rows [row0, row0 + kRows) of one KV head into a shared tile [kRows][kD + kPad] bf16.
// head: cache + kvh * kD, row_stride = nKV * kD. Rows at or past row_end are zero-filled: they
// are masked out of the softmax, and zeros keep stale or out-of-range memory (NaN bit patterns
// included) out of the products.
template <int kRows, int kD, int kThreads>
__device__ __forceinline__ void load_kv_tile(bf16* tile, const bf16* head, int64_t row_stride, int row0,
                                             int row_end) {
  constexpr int kChunks = kD / 8;  // 16-byte chunks per row
  static_assert((kRows * kChunks) % kThreads == 0, "tile copy must split evenly over the threads");
#pragma unroll
  for (int k = 0; k < kRows * kChunks / kThreads; ++k) {
    const int i = k * kThreads + threadIdx.x, r = i / kChunks, ch = i % kChunks;
    const bool valid = row0 + r < row_end;
    const bf16* src = valid ? head + int64_t(row0 + r) * row_stride + ch * 8 : head;
    cp_async_16(tile + r * (kD + kPad) + ch * 8, src, valid);
  }
}

}  // namespace lily::cuda::attn
