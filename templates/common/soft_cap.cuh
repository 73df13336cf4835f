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

// tanh(x) on the FMA pipe for |x| <= 1: x * Q(x^2), Q a cubic fitted for the least largest
// relative error there (8.2e-5 in fp32, against tanh.approx's 2^-11 = 4.9e-4). Six issue slots
// and no MUFU operation, where tanh.approx takes one slot and as much of the MUFU unit as the
// softmax's exp2: a capped D128 forward issues two MUFU operations per logit, which the tensor
// cores' time per logit only just covers (notes/softcap.md). Beyond |x| = 1 the cubic drifts.
constexpr float TANH_POLY_REACH = 1.f;
__device__ __forceinline__ float tanh_poly(float x) {
  const float v = x * x;
  return x * fmaf(fmaf(fmaf(-0.026630526408553123f, v, 0.11889863014221191f), v, -0.3306546211242676f), v,
                  0.9999185800552368f);
}

// tanh(x): the FMA pipe's within its reach, the hardware's beyond it; each x's value depends on
// x alone, so a kernel that computes some logits one way (SoftCapScore::score_all) and a
// backward that recomputes them elementwise agree exactly.
__device__ __forceinline__ float tanh_split(float x) {
  return fabsf(x) <= TANH_POLY_REACH ? tanh_poly(x) : tanh_approx(x);
}

}  // namespace jitattn
