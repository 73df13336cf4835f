// Positional encodings applied inside attention kernels: rotate-half RoPE (Llama) and ALiBi.
#pragma once
#include <cuda_runtime.h>

namespace jitattn {

// RoPE frequency of dimension d, in revolutions per position: theta^(-2i/D) / scale / (2 pi),
// i = d mod D/2. Kept in double: positions reach 1e5+ and the angle must stay exact mod 2 pi.
__device__ __forceinline__ double rope_revolutions(int d, int head_dim, double theta, double scale) {
  const int i = d % (head_dim / 2);
  return pow(theta, -2.0 * i / head_dim) / scale / 6.283185307179586;
}

// x <- x rotated at position `pos`; `partner` holds the elements D/2 away (the rotate-half
// pair), `first_half` says whether x sits in dims [0, D/2).
template <int N>
__device__ __forceinline__ void rope_rotate(float (&x)[N], const float (&partner)[N], const double (&rev)[N],
                                            int pos, bool first_half) {
#pragma unroll
  for (int e = 0; e < N; ++e) {
    const double turns = pos * rev[e];
    const float angle = static_cast<float>((turns - rint(turns)) * 6.283185307179586);  // in [-pi, pi]
    float s, c;
    __sincosf(angle, &s, &c);
    x[e] = first_half ? x[e] * c - partner[e] * s : x[e] * c + partner[e] * s;
  }
}

// ALiBi slope of query head h out of num_heads (the ALiBi paper's, as FlashInfer indexes them).
__device__ __forceinline__ float alibi_slope(int h, int num_heads) {
  const int n = 1 << (31 - __clz(num_heads));  // largest power of two <= num_heads
  return h < n ? exp2f(-8.f * (h + 1) / n) : exp2f(-4.f * (2 * (h + 1 - n) - 1) / n);
}

}  // namespace jitattn
