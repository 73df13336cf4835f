// Element types and 16-byte vector conversions shared by every kernel family.
// One 16-byte vector holds 8 fp16/bf16 or 16 fp8 elements; kernels convert to fp32 right after
// loading (fp8 through the hardware fp8x2 -> f16x2 conversion on sm_89+).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cstdint>

namespace jitattn {

template <typename T> struct ElemTraits;
template <> struct ElemTraits<__half> {
  __device__ __forceinline__ static float2 to_float2(uint32_t bits) {
    return __half22float2(*reinterpret_cast<const __half2*>(&bits));
  }
  __device__ __forceinline__ static uint32_t from_float2(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  __device__ __forceinline__ static __half from_float(float x) { return __float2half_rn(x); }
  __device__ __forceinline__ static float to_float(__half x) { return __half2float(x); }
};
template <> struct ElemTraits<__nv_bfloat16> {
  __device__ __forceinline__ static float2 to_float2(uint32_t bits) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits));
  }
  __device__ __forceinline__ static uint32_t from_float2(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  __device__ __forceinline__ static __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
  __device__ __forceinline__ static float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
};
template <> struct ElemTraits<__nv_fp8_e4m3> {
  static constexpr __nv_fp8_interpretation_t kKind = __NV_E4M3;
};
template <> struct ElemTraits<__nv_fp8_e5m2> {
  static constexpr __nv_fp8_interpretation_t kKind = __NV_E5M2;
};

// Elements of T in one 16-byte vector.
template <typename T> constexpr int kPerVec = 16 / sizeof(T);

// One 16-byte vector of T -> kPerVec<T> floats.
template <typename T>
__device__ __forceinline__ void unpack_vec(const uint4& raw, float* out) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (sizeof(T) == 2) {
      const float2 f = ElemTraits<T>::to_float2(words[i]);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    } else {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
            static_cast<__nv_fp8x2_storage_t>(words[i] >> (16 * half)), ElemTraits<T>::kKind);
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
        out[4 * i + 2 * half] = f.x;
        out[4 * i + 2 * half + 1] = f.y;
      }
    }
  }
}

// N elements of T at a 16-byte aligned address (global or shared) -> N floats.
template <typename T, int N>
__device__ __forceinline__ void load_floats(const T* ptr, float (&out)[N]) {
  static_assert(N % kPerVec<T> == 0, "whole 16-byte vectors only");
#pragma unroll
  for (int v = 0; v < N / kPerVec<T>; ++v)
    unpack_vec<T>(reinterpret_cast<const uint4*>(ptr)[v], out + v * kPerVec<T>);
}

// N floats -> N elements of a 2-byte T at a 16-byte aligned address (round to nearest even).
template <typename T, int N>
__device__ __forceinline__ void store_floats(T* ptr, const float (&in)[N]) {
  static_assert(sizeof(T) == 2 && N % 8 == 0, "16-bit outputs, whole vectors");
#pragma unroll
  for (int v = 0; v < N / 8; ++v) {
    const float* x = in + 8 * v;
    reinterpret_cast<uint4*>(ptr)[v] =
        make_uint4(ElemTraits<T>::from_float2(x[0], x[1]), ElemTraits<T>::from_float2(x[2], x[3]),
                   ElemTraits<T>::from_float2(x[4], x[5]), ElemTraits<T>::from_float2(x[6], x[7]));
  }
}

template <typename T>
__device__ __forceinline__ T from_float(float x) {
  return ElemTraits<T>::from_float(x);
}

template <typename T>
__device__ __forceinline__ float to_float(T x) {
  return ElemTraits<T>::to_float(x);
}

}  // namespace jitattn
