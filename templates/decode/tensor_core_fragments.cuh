{# The tensor-core path's register fragments: which dims an MMA register holds, fp8 widening and
   RoPE on fp8 K fragments (included by kernels.cu.j2 when tensor_cores). #}
// Dim of q (and k) that the A-operand registers of k-step kk hold for this quad (half 0: a0/a1,
// half 1: a2/a3; +1 for the second element). fp16/bf16 K follows PTX's m16n8k16 layout. fp8 K
// is loaded 16 dims (one 16-byte vector) per k-step, where ldmatrix hands each thread 4
// consecutive fp8 values; Q's registers take the same dims (the dot product does not care about
// the order of its terms), so K needs no shuffling.
__device__ __forceinline__ int frag_dim(int kk, int quad, int half) {
  return FP8 ? 16 * kk + 4 * quad + 2 * half : 16 * kk + 2 * quad + 8 * half;
}

// Dim of the output accumulator o[j][e] (e = 0, 1; rows a and b alike). fp8 V comes through
// ldmatrix.trans in 16-bit units (two fp8 dims of two keys); a byte permute splits it into an
// even-dim and an odd-dim fragment, so block 2v + parity holds dims 16v + 2n + parity.
__device__ __forceinline__ int o_dim(int j, int quad, int e) {
  return FP8 ? 16 * (j / 2) + 4 * quad + 2 * e + j % 2 : 8 * j + 2 * quad + e;
}

// Four fp8 values in one register -> two registers of the MMA type: lo holds values (0, 1),
// hi (2, 3). Every fp8 value is exact in fp16 and bf16.
// (Templates on the K/V type, so that their fp8 code is only instantiated for fp8.)
template <typename KV>
__device__ __forceinline__ void widen_fp8x4(uint32_t x, uint32_t& lo, uint32_t& hi) {
  if constexpr (sizeof(KV) == 1) {
    const __half2_raw h0 = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(x & 0xffffu), ElemTraits<KV>::kKind);
    const __half2_raw h1 = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(x >> 16), ElemTraits<KV>::kKind);
    if constexpr (MmaType<DTypeMMA>::kBf16) {
      const float2 f0 = __half22float2(*reinterpret_cast<const __half2*>(&h0));
      const float2 f1 = __half22float2(*reinterpret_cast<const __half2*>(&h1));
      lo = pack2<DTypeMMA>(f0.x, f0.y);
      hi = pack2<DTypeMMA>(f1.x, f1.y);
    } else {
      lo = *reinterpret_cast<const uint32_t*>(&h0);
      hi = *reinterpret_cast<const uint32_t*>(&h1);
    }
  }
}

// RoPE on fp8 K fragments: x holds dims d..d+3 (d = 16v + 4 quad) of this thread's key row and
// y their rotate-half partners; both are widened, rotated by `r` in fp32 and rounded to the MMA
// type (x -> x_lo/x_hi, y -> y_lo/y_hi, as widen_fp8x4 lays them out).
template <typename KV>
__device__ __forceinline__ void rope_rotate_fp8(uint32_t x, uint32_t y, const RopeRotation<4>& r,
                                                uint32_t& x_lo, uint32_t& x_hi, uint32_t& y_lo, uint32_t& y_hi) {
  if constexpr (sizeof(KV) == 1) {
    auto widen = [](uint32_t w, float (&out)[4]) {  // exact: fp8 -> MMA type -> fp32
      uint32_t lo, hi;
      widen_fp8x4<KV>(w, lo, hi);
      const float2 f0 = ElemTraits<DTypeMMA>::to_float2(lo), f1 = ElemTraits<DTypeMMA>::to_float2(hi);
      out[0] = f0.x;
      out[1] = f0.y;
      out[2] = f1.x;
      out[3] = f1.y;
    };
    float a[4], b[4], ra[4], rb[4];
    widen(x, a);
    widen(y, b);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      ra[e] = a[e] * r.c[e] - b[e] * r.s[e];
      rb[e] = b[e] * r.c[e] + a[e] * r.s[e];
    }
    x_lo = pack2<DTypeMMA>(ra[0], ra[1]);
    x_hi = pack2<DTypeMMA>(ra[2], ra[3]);
    y_lo = pack2<DTypeMMA>(rb[0], rb[1]);
    y_hi = pack2<DTypeMMA>(rb[2], rb[3]);
  }
}
