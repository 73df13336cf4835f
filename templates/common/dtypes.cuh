// Element types and 16-byte vector conversions shared by every kernel family.
// One 16-byte vector holds 8 fp16/bf16 elements; kernels convert to fp32 right after loading.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cstdint>

namespace jitattn {

constexpr int kVecBytes = 16;

template <typename T> struct ElemTraits;
template <> struct ElemTraits<__half> {
  __device__ __forceinline__ static float2 to_float2(uint32_t bits) {
    return __half22float2(*reinterpret_cast<const __half2*>(&bits));
  }
  __device__ __forceinline__ static uint32_t from_float2(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};
template <> struct ElemTraits<__nv_bfloat16> {
  __device__ __forceinline__ static float2 to_float2(uint32_t bits) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits));
  }
  __device__ __forceinline__ static uint32_t from_float2(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

// 8 elements packed in a uint4 -> 8 floats.
template <typename T>
__device__ __forceinline__ void unpack8(const uint4& raw, float (&out)[8]) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 f = ElemTraits<T>::to_float2(words[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// 8 floats -> 8 elements packed in a uint4 (round to nearest even).
template <typename T>
__device__ __forceinline__ uint4 pack8(const float (&in)[8]) {
  return make_uint4(ElemTraits<T>::from_float2(in[0], in[1]), ElemTraits<T>::from_float2(in[2], in[3]),
                    ElemTraits<T>::from_float2(in[4], in[5]), ElemTraits<T>::from_float2(in[6], in[7]));
}

}  // namespace jitattn

namespace jitattn {
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
}  // namespace jitattn
