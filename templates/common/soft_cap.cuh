// Logit soft cap (Gemma-2's attn_logit_softcapping): s' = cap * tanh(s / cap).
#pragma once

namespace jitattn {

// tanh(x) from u = 2 x log2(e), as 1 - 2 / (1 + 2^u) (needs softmax.cuh's fast_exp2): absolute
// error ~3e-7, where tanh.approx.f32's 2^-11 would move a logit capped at 50 by up to 0.025.
// Saturates to +-1 (2^u -> inf or 0). The MUFU reciprocal stays: a Newton one on the FMA pipe
// measured slower (notes/template-figures.md, "soft_cap.cuh").
__device__ __forceinline__ float tanh_from_exp2(float u) { return 1.f - __fdividef(2.f, 1.f + fast_exp2(u)); }

// tanh(x) by the hardware's tanh.approx.f32 (sm_75+): one MUFU operation where tanh_from_exp2
// takes two, at a relative error of about 2^-11 (FlashAttention-3's and FlashInfer's soft cap;
// the accuracy against float64: notes/softcap.md).
__device__ __forceinline__ float tanh_approx(float x) {
#ifdef __CUDA_ARCH__
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else  // host builds of the hooks (tests/native/score_hook.cpp)
  return std::tanh(x);
#endif
}

}  // namespace jitattn
