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
