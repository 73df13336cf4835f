// Positional encodings applied inside attention kernels: rotate-half RoPE (Llama) and ALiBi.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

namespace jitattn {

// RoPE frequency of dimension d as a 64-bit fixed-point fraction of a turn per position:
// theta^(-2i/D) / scale / (2 pi) * 2^64, i = d mod D/2, split into (high, low) 32-bit words.
// Integer products wrap modulo one turn, so the angle at position p is exact for any p with
// two integer multiplies: no double arithmetic and no argument reduction in the inner loop.
struct RopeFreq {
  uint32_t hi, lo;
};

// The host passes turns0 = 1 / (scale * 2 pi) (dim 0's turns per position) and
// ratio = theta^(-2/D); dim i's turns are turns0 * ratio^i, ratio^i by squaring: at most
// 2 log2(D/2) dependent double multiplies. A double pow and two divisions here had cost each
// RoPE CTA a long dependent chain before its first tile. Relative error <= ~i ulp of ratio,
// ~3e-5 rad at position 2^31 and far less at real lengths.
__device__ __forceinline__ RopeFreq rope_freq(int d, int head_dim, double turns0, double ratio) {
  int i = d % (head_dim / 2);
  double turns = turns0;
#pragma unroll
  for (int bit = 0; bit < 8; ++bit, ratio *= ratio, i >>= 1)  // head_dim <= 512: i < 2^8
    if (i & 1) turns *= ratio;
  const double scaled = (turns - floor(turns)) * 4294967296.0;  // 2^32 * fractional turns
  const double hi = floor(scaled);
  return {static_cast<uint32_t>(hi), static_cast<uint32_t>(floor((scaled - hi) * 4294967296.0))};
}

// Angle in radians, in [-pi, pi), of position `pos` at frequency `f`.
__device__ __forceinline__ float rope_angle(uint32_t pos, RopeFreq f) {
  // Bits [32, 64) of pos * (hi * 2^32 + lo), modulo 2^64: the top 32 bits of the turn fraction.
  const uint32_t frac = pos * f.hi + __umulhi(pos, f.lo);
  return static_cast<float>(static_cast<int32_t>(frac)) * (6.283185307179586f / 4294967296.0f);
}

// x <- x rotated at position `pos`; `partner` holds the elements D/2 away (the rotate-half
// pair), `first_half` says whether x sits in dims [0, D/2).
template <int N>
__device__ __forceinline__ void rope_rotate(float (&x)[N], const float (&partner)[N], const RopeFreq (&freq)[N],
                                            int pos, bool first_half) {
#pragma unroll
  for (int e = 0; e < N; ++e) {
    float s, c;
    __sincosf(rope_angle(static_cast<uint32_t>(pos), freq[e]), &s, &c);
    x[e] = first_half ? x[e] * c - partner[e] * s : x[e] * c + partner[e] * s;
  }
}

// (cos, sin) of the RoPE angles of N consecutive dims at one position.
template <int N>
struct RopeRotation {
  float c[N], s[N];
};

// The rotation of dims [d, d + N) at position `pos`: one sincos per dim.
template <int N>
__device__ __forceinline__ RopeRotation<N> rope_rotation(const RopeFreq* freq, int d, int pos) {
  RopeRotation<N> r;
#pragma unroll
  for (int e = 0; e < N; ++e) __sincosf(rope_angle(static_cast<uint32_t>(pos), freq[d + e]), &r.s[e], &r.c[e]);
  return r;
}

// Advance `r` (dims [d, d + N)) by the per-dim rotation `step` ((cos, sin) of a fixed position
// distance): angle addition, four multiplies instead of a sincos for rows that distance apart.
template <int N>
__device__ __forceinline__ void rope_advance(RopeRotation<N>& r, const float2* step, int d) {
#pragma unroll
  for (int e = 0; e < N; ++e) {
    const float2 t = step[d + e];
    const float c = r.c[e] * t.x - r.s[e] * t.y;
    r.s[e] = r.s[e] * t.x + r.c[e] * t.y;
    r.c[e] = c;
  }
}

// The rotation of dims [d, d + N) for key block `block` of a warp whose key blocks sit 8
// positions apart (`step8`: (cos, sin) of 8 positions per dim): exact at `pos0` for block 0,
// then advanced from the previous block's.
template <int N>
__device__ __forceinline__ void rope_key_block(RopeRotation<N>& r, int block, const RopeFreq* freq,
                                               const float2* step8, int d, int pos0) {
  if (block == 0) {
    r = rope_rotation<N>(freq, d, pos0);
  } else {
    rope_advance(r, step8, d);
  }
}

// Rotate two rotate-half pairs held as packed 2-element registers of T: `lo` holds dims
// (d, d + 1) and `hi` their partners (d + D/2, d + 1 + D/2); `r` is the rotation of (d, d + 1).
// For K fragments on the tensor-core path: rotated where they are loaded, then rounded back to
// T for the MMA.
template <typename T>
__device__ __forceinline__ void rope_rotate_pairs(uint32_t& lo, uint32_t& hi, const RopeRotation<2>& r) {
  const float2 x = ElemTraits<T>::to_float2(lo), y = ElemTraits<T>::to_float2(hi);
  lo = ElemTraits<T>::from_float2(x.x * r.c[0] - y.x * r.s[0], x.y * r.c[1] - y.y * r.s[1]);
  hi = ElemTraits<T>::from_float2(y.x * r.c[0] + x.x * r.s[0], y.y * r.c[1] + x.y * r.s[1]);
}

// ALiBi slope of query head h out of num_heads (the ALiBi paper's, as FlashInfer indexes them).
__device__ __forceinline__ float alibi_slope(int h, int num_heads) {
  const int n = 1 << (31 - __clz(num_heads));  // largest power of two <= num_heads
  return h < n ? exp2f(-8.f * (h + 1) / n) : exp2f(-4.f * (2 * (h + 1 - n) - 1) / n);
}

}  // namespace jitattn
