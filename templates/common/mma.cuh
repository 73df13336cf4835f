// Tensor-core building blocks (sm_80+): ldmatrix fragment loads and mma.sync with fp32
// accumulators, for fp16 and bf16 operands. Fragment layouts are PTX's (m16n8k16 / m16n8k8):
//   A rows  lane/4 and lane/4 + 8, columns 2*(lane%4) + {0,1} (and + 8 for k16),
//   B column lane/4, rows 2*(lane%4) + {0,1} (and + 8 for k16),
//   C rows  lane/4 (c0, c1) and lane/4 + 8 (c2, c3), columns 2*(lane%4) + {0,1}.
#pragma once
// (Jinja: the asm operand lists below open with a brace-percent pair, so this file renders raw.)
{% raw %}
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

namespace jitattn {

// Four 8x8 16-bit matrices; lane l supplies the address of row l%8 of matrix l/8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row_address) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(row_address));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// The same, each matrix transposed (rows become columns).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row_address) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(row_address));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// Store four 8x8 b16 matrices transposed (sm_90 stmatrix): lane l's r[i] holds row l / 4,
// columns 2 (l % 4) and + 1 of matrix i (an mma accumulator's fragment layout); lanes 8i to
// 8i + 7 give the shared addresses of matrix i's stored rows (its columns), 16 bytes each.
__device__ __forceinline__ void stmatrix_x4_trans(void* row_address, const uint32_t (&r)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(row_address));
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(a), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
#endif
}

template <typename T> struct MmaType;
template <> struct MmaType<__half> { static constexpr bool kBf16 = false; };
template <> struct MmaType<__nv_bfloat16> { static constexpr bool kBf16 = true; };

// c += a (16x16, row) * b (16x8, col).
template <typename T>
__device__ __forceinline__ void mma_16x8x16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (MmaType<T>::kBf16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// c += a (16x8, row) * b (8x8, col).
template <typename T>
__device__ __forceinline__ void mma_16x8x8(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t b0) {
  if constexpr (MmaType<T>::kBf16) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a0), "r"(a1), "r"(b0));
  } else {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a0), "r"(a1), "r"(b0));
  }
}

// Two floats -> one register of two 16-bit values (low = first).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  return ElemTraits<T>::from_float2(lo, hi);
}

}  // namespace jitattn
{% endraw %}
