// Logit soft cap (Gemma-2's attn_logit_softcapping): s' = cap * tanh(s / cap).
#pragma once

namespace jitattn {

// tanh(x) from u = 2 x log2(e) (needs softmax.cuh's fast_exp2), with one MUFU op: the special
// function unit already runs the softmax's exp2 for every logit, and a second and third (rcp)
// there cost the capped H200 prefill 1.3-1.8x. With e = 2^-|u| in (0, 1],
// tanh|x| = (1 - e) / (1 + e); 1 / (1 + e) on (1, 2] is a linear first guess (error <= 1/17)
// refined by three Newton steps on the FMA pipe. Absolute error ~1.3e-7 over all x (where
// tanh.approx.f32's 2^-11 would move a logit capped at 50 by up to 0.025); saturates to +-1.
__device__ __forceinline__ float tanh_from_exp2(float u) {
  const float e = fast_exp2(-fabsf(u));
  const float d = 1.f + e;
  float r = fmaf(-8.f / 17.f, d, 24.f / 17.f);
#pragma unroll
  for (int i = 0; i < 3; ++i) r = fmaf(r, fmaf(-d, r, 1.f), r);
  return copysignf((1.f - e) * r, u);
}

}  // namespace jitattn
