// Hopper warpgroup MMA (sm_90a): wgmma.mma_async with fp32 accumulators, for fp16 and bf16.
// A warpgroup (4 consecutive warps) computes D (64 x N) += A (64 x 16) * B (16 x N) per call.
// The accumulator layout per warp is mma.sync's m16n8 C layout repeated over N/8 columns:
// d[4j + {0,1}] = row 16*warp + lane/4, columns 8j + 2*(lane%4) + {0,1}; d[4j + {2,3}] = row + 8.
// A in registers has mma.sync's m16n8k16 A layout (each warp its 16 rows).
//
// Shared operands are read through 64-bit descriptors, here always with the 128-byte swizzle:
// 8 rows of 128 bytes form a 1024-byte atom (1024-aligned) whose 16-byte chunk j of row r sits
// at chunk j ^ r. K-major operands (Q, K: the reduction dim contiguous) step the start address
// by 32 bytes per k16 inside an atom's row; MN-major ones (V, transposed) by 16 rows.
// Instantiated for the widths in `wgmma_widths` (Jinja), since the register list is the width.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

namespace jitattn {

// Descriptor: start address >> 4 (bits 0-13), leading byte offset >> 4 (16-29), stride byte
// offset >> 4 (32-45), swizzle mode (62-63; 1 = 128 bytes). Offsets added later stay in the
// start field as long as the address stays below 256 KB (all of shared memory).
__device__ __forceinline__ uint64_t wgmma_desc(const void* smem, uint32_t leading_bytes, uint32_t stride_bytes) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  return uint64_t((addr & 0x3FFFF) >> 4) | uint64_t(leading_bytes >> 4) << 16 | uint64_t(stride_bytes >> 4) << 32 |
         uint64_t(1) << 62;
}

// Orders this thread's generic-proxy shared memory writes (cp.async, st.shared) before later
// async-proxy reads (wgmma operands). Each writer runs it, then the CTA barrier.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// mbarriers (shared memory, 8 bytes each) hand pipeline stages between a producer warp and the
// consumer warpgroups without CTA-wide barriers. A barrier completes a phase when `count`
// arrivals have come; waiters name the phase they wait for by its parity (0, 1, 0, ...).
__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_address(bar)), "r"(count) : "memory");
}
// Makes barrier inits visible to other threads' and the async proxy's (TMA) operations on them.
__device__ __forceinline__ void fence_mbarrier_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_address(bar)) : "memory");
}
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait_loop:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_loop;\n}\n" ::"r"(smem_address(bar)), "r"(parity) : "memory");
}
// Hand registers between warpgroups (all of a warpgroup's threads run it): the per-thread
// register count becomes REGS, raised (INC) or lowered.
template <int REGS, bool INC>
__device__ __forceinline__ void set_max_registers() {
  if constexpr (INC) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
  else asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
}

// Barrier among `count` threads (whole warps) on hardware barrier `id` (0 is __syncthreads').
__device__ __forceinline__ void named_barrier(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
// Arrive at barrier `id` without waiting: with bar.sync from other warps, a one-way signal.
__device__ __forceinline__ void named_barrier_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// Make register writes visible to the wgmma that follow (accumulators, A fragments).
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving accesses to accumulator registers across the async MMAs.
template <int N>
__device__ __forceinline__ void wgmma_pin(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

template <typename T, int N> struct Wgmma;

{# Jinja: "{" + "%" would open a tag, so PTX operand braces are written as {{ "{" }}. #}
{% macro operands(first, count) %}{{ "{" }}{% for i in range(first, first + count) %}%{{ i }}{{ ", " if not loop.last }}{% endfor %}{{ "}" }}{% endmacro %}
{% macro pinned(count) %}{% for i in range(count) %}"+f"(d[{{ i }}]){{ ", " if not loop.last }}{% endfor %}{% endmacro %}
{% for n in wgmma_widths %}
{% set regs = n // 2 %}
{% for ctype, ptx in [("__half", "f16"), ("__nv_bfloat16", "bf16")] %}
template <> struct Wgmma<{{ ctype }}, {{ n }}> {
  // d (+)= A (shared; K-major, or MN-major when TRANS_A: the varlen backward's dS^T read as dS)
  // * B (shared; K-major, or MN-major when TRANS_B); d is overwritten when SCALE_D is 0.
  template <int SCALE_D, int TRANS_B, int TRANS_A = 0>
  __device__ __forceinline__ static void ss(float (&d)[{{ regs }}], uint64_t a, uint64_t b) {
    asm volatile(
        "{{ "{" }}\n.reg .pred p;\nsetp.ne.b32 p, %{{ regs + 2 }}, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n{{ n }}k16.f32.{{ ptx }}.{{ ptx }} "
        "{{ operands(0, regs) }}, %{{ regs }}, %{{ regs + 1 }}, p, 1, 1, %{{ regs + 4 }}, %{{ regs + 3 }};\n{{ "}" }}\n"
        : {{ pinned(regs) }}
        : "l"(a), "l"(b), "n"(SCALE_D), "n"(TRANS_B), "n"(TRANS_A));
  }
  // d += A (registers: four 16-bit pairs) * B (shared; MN-major when TRANS_B).
  template <int TRANS_B>
  __device__ __forceinline__ static void rs(float (&d)[{{ regs }}], const uint32_t (&a)[4], uint64_t b) {
    asm volatile(
        "{{ "{" }}\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n{{ n }}k16.f32.{{ ptx }}.{{ ptx }} "
        "{{ operands(0, regs) }}, {{ operands(regs, 4) }}, %{{ regs + 4 }}, p, 1, 1, %{{ regs + 5 }};\n{{ "}" }}\n"
        : {{ pinned(regs) }}
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(TRANS_B));
  }
};
{% endfor %}
{% endfor %}

}  // namespace jitattn
