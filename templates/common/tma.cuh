// Hopper bulk copies (sm_90): the tensor memory accelerator (TMA) and its bulk reductions.
// A tensor copy reads a box of a tensor described by a CUtensorMap (encoded on the host, passed
// as a __grid_constant__ kernel argument) into shared memory and counts its bytes on an
// mbarrier; a bulk reduction adds a contiguous run of shared memory into global memory without
// any thread issuing atomics. Both run in the async proxy: generic-proxy writes a bulk op reads
// need fence_proxy_async_shared first. Include after wgmma.cuh (smem_address). Rendered by Jinja:
// a brace never directly precedes a percent sign.
#pragma once
#include <cuda.h>
#include <cstdint>

namespace jitattn {

// Announce `bytes` of copies the barrier's current phase must see land (before issuing them).
__device__ __forceinline__ void mbarrier_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(smem_address(bar)), "r"(bytes)
               : "memory");
}

// Arrive on `bar` and announce `bytes` more that must land before its phase completes.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_address(bar)), "r"(bytes)
               : "memory");
}

// Box at coordinates (c0 innermost .. c3) of a 4-D tensor map into shared memory (1024-aligned
// for the 128-byte swizzle); completes `bytes` of the barrier's expected transaction count.
__device__ __forceinline__ void tma_load_4d(void* smem, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2,
                                            int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {" "%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(smem_address(smem)),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_address(bar))
      : "memory");
}

// Box at coordinates (c0 innermost .. c4) of a 5-D tensor map, as above.
__device__ __forceinline__ void tma_load_5d(void* smem, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2,
                                            int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {" "%2, %3, %4, %5, "
      "%6}], [%7];\n" ::"r"(smem_address(smem)),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(smem_address(bar))
      : "memory");
}

// Shared memory (1024-aligned for the 128-byte swizzle) into the box at coordinates (c0
// innermost .. c2) of a 3-D tensor map, one thread, in its current bulk group.
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, const void* smem, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {" "%1, %2, %3}], [%4];\n" ::"l"(map),
               "r"(c0), "r"(c1), "r"(c2), "r"(smem_address(smem))
               : "memory");
}

// The same into the box at coordinates (c0 innermost .. c4) of a 5-D tensor map.
__device__ __forceinline__ void tma_store_5d(const CUtensorMap* map, const void* smem, int c0, int c1, int c2, int c3,
                                             int c4) {
  asm volatile("cp.async.bulk.tensor.5d.global.shared::cta.bulk_group [%0, {" "%1, %2, %3, %4, %5}], [%6];\n" ::"l"(map),
               "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(smem_address(smem))
               : "memory");
}

// global[0, bytes) += shared[0, bytes) as fp32 (16-byte aligned, bytes a multiple of 16), one thread.
__device__ __forceinline__ void bulk_reduce_add_f32(float* gmem, const void* smem, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(gmem),
               "r"(smem_address(smem)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Until at most kPending of this thread's bulk groups still read shared memory (READ) or are
// not complete at all.
template <int kPending, bool READ>
__device__ __forceinline__ void bulk_wait() {
  if constexpr (READ) asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
  else asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
}
// Orders this thread's completed async-proxy global writes before its later generic ones (a
// release that other CTAs acquire).
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

// cuTensorMapEncodeTiled from the driver (no link against libcuda): nullptr if unavailable.
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
inline EncodeTiled encode_tiled() {
  static EncodeTiled fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      return EncodeTiled(nullptr);
    return reinterpret_cast<EncodeTiled>(f);
  }();
  return fn;
}

}  // namespace jitattn
