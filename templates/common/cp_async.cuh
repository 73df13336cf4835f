// cp.async (sm_80+): global -> shared copies that bypass registers, grouped into pipeline stages.
#pragma once
#include <cstdint>

namespace jitattn {

// Copy 16 bytes; when `valid` is false the destination is zero-filled and nothing is read.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Wait until at most `kPending` committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// cp_async_wait<n> for a run-time n in [0, kMax] (n > kMax waits as for kMax): a uniform
// branch down to the immediate form the instruction needs.
template <int kMax>
__device__ __forceinline__ void cp_async_wait_upto(int pending) {
  if constexpr (kMax > 0) {
    if (pending >= kMax) {
      cp_async_wait<kMax>();
    } else {
      cp_async_wait_upto<kMax - 1>(pending);
    }
  } else {
    cp_async_wait<0>();
  }
}

}  // namespace jitattn
