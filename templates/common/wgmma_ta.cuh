// Hopper warpgroup MMA with a transposed (MN-major) A from shared memory, for fp16 and bf16:
// D (64 x N) (+)= A (64 x 16) * B (16 x N), A stored with its M dimension contiguous (the
// varlen backward's dS^T, read as dS for dQ = dS K). Same conventions as common/wgmma.cuh
// (128-byte swizzle descriptors, accumulator layout); include that first. Instantiated for the
// widths in `wgmma_widths` (Jinja).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

namespace jitattn {

template <typename T, int N> struct WgmmaTA;

{# Jinja: "{" + "%" would open a tag, so PTX operand braces are written as {{ "{" }}. #}
{% macro operands(first, count) %}{{ "{" }}{% for i in range(first, first + count) %}%{{ i }}{{ ", " if not loop.last }}{% endfor %}{{ "}" }}{% endmacro %}
{% macro pinned(count) %}{% for i in range(count) %}"+f"(d[{{ i }}]){{ ", " if not loop.last }}{% endfor %}{% endmacro %}
{% for n in wgmma_widths %}
{% set regs = n // 2 %}
{% for ctype, ptx in [("__half", "f16"), ("__nv_bfloat16", "bf16")] %}
template <> struct WgmmaTA<{{ ctype }}, {{ n }}> {
  // d (+)= A (shared, MN-major) * B (shared; K-major, or MN-major when TRANS_B); d is
  // overwritten when SCALE_D is 0.
  template <int SCALE_D, int TRANS_B>
  __device__ __forceinline__ static void ss(float (&d)[{{ regs }}], uint64_t a, uint64_t b) {
    asm volatile(
        "{{ "{" }}\n.reg .pred p;\nsetp.ne.b32 p, %{{ regs + 2 }}, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n{{ n }}k16.f32.{{ ptx }}.{{ ptx }} "
        "{{ operands(0, regs) }}, %{{ regs }}, %{{ regs + 1 }}, p, 1, 1, 1, %{{ regs + 3 }};\n{{ "}" }}\n"
        : {{ pinned(regs) }}
        : "l"(a), "l"(b), "n"(SCALE_D), "n"(TRANS_B));
  }
};
{% endfor %}
{% endfor %}

}  // namespace jitattn
