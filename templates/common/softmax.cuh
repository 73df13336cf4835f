// Online softmax in the base-2 domain: logits arrive pre-multiplied by log2(e), so exp2 is used
// and the log-sum-exp comes out in base 2 (FlashInfer's convention).
#pragma once
#include <cmath>

namespace jitattn {

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 2^x on the FMA and integer pipes instead of the MUFU unit (FlashAttention-4's exp2
// emulation): the kernels that are MUFU-bound (a soft cap adds a MUFU tanh to every logit's exp2)
// hand part of their exponentials here. x <= 0 (a logit less its row's max); -inf and anything
// below -127 give 0. 2^x = 2^n * 2^f with n = round(x), f in [-1/2, 1/2], 2^f by a cubic fitted
// for relative error (at most 7.5e-5, below half a bf16 or fp16 ulp of P), 2^n added to the
// exponent bits.
__device__ __forceinline__ float poly_exp2(float x) {
  const float clamped = fmaxf(x, -127.f);
  const float shifted = clamped + 12582912.f;  // 1.5 * 2^23: round to nearest into the low mantissa bits
  const float f = clamped - (shifted - 12582912.f);
  float p = fmaf(0.05517167f, f, 0.24261113f);
  p = fmaf(p, f, 0.69326097f);
  p = fmaf(p, f, 0.99992806f);
  const float y = __int_as_float(__float_as_int(p) + (__float_as_int(shifted) << 23));
  return x > -127.f ? y : 0.f;
}

// exp2(a - b) for a <= b that is 0 (not NaN) when both are -inf (an empty state).
__device__ __forceinline__ float exp2_diff(float a, float b) {
  return b == -INFINITY ? 0.f : fast_exp2(a - b);
}

// Running max `m` and denominator `d` of one softmax row, plus how to merge two of them.
struct SoftmaxState {
  float m = -INFINITY;
  float d = 0.f;

  // Fold in a partial state (m2, d2); returns the factors to rescale (ours, theirs) by.
  __device__ __forceinline__ float2 merge(float m2, float d2) {
    const float m_new = fmaxf(m, m2);
    const float a = exp2_diff(m, m_new), b = exp2_diff(m2, m_new);
    d = d * a + d2 * b;
    m = m_new;
    return make_float2(a, b);
  }

  __device__ __forceinline__ float lse2() const { return m + log2f(d); }
};

}  // namespace jitattn
