// Logit soft cap (Gemma-2's attn_logit_softcapping): s' = cap * tanh(s / cap).
#pragma once

namespace jitattn {

// tanh(x) from u = 2 x log2(e), as 1 - 2 / (1 + 2^u) (needs softmax.cuh's fast_exp2): absolute
// error ~3e-7, where tanh.approx.f32's 2^-11 would move a logit capped at 50 by up to 0.025.
// Saturates to +-1 (2^u -> inf or 0). A reciprocal by three Newton steps on the FMA pipe
// instead of the MUFU rcp measured slower on the H200 (capped D128 prefill 2.10x the uncapped
// time against 1.62x), so the special function unit is not what the cap costs.
__device__ __forceinline__ float tanh_from_exp2(float u) { return 1.f - __fdividef(2.f, 1.f + fast_exp2(u)); }

}  // namespace jitattn
