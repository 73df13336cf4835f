// Device helpers for user variants: the code jitattn/variants/render.py emits for a score_mod /
// mask_mod calls only these (and plain C++ operators on its own SSA values).
//
// - Captures: a captured tensor is a Capture (data pointer, strides in elements, sizes; the dims
//   past its ndim have size 1, stride 0; a 0-d tensor has them all so). A read outside [0, size)
//   in any dim gives 0 (false for bool): no fault, whatever the index expression computes.
//   int64 captures are read modulo 2^32, like every int here.
// - Ints are 32-bit and wrap (iadd/isub/imul/ineg through unsigned: defined behaviour); // and %
//   follow Python (floor), and give 0 for a zero divisor.
// - Fast math (vexp, vexp2, vtanh, vsigmoid): ex2.approx based; error estimates beside each.
// - Intervals (iv_*): the analysis behind MaskMod::classify; jitattn/variants/interval.py is its
//   Python mirror (same functions, same logic) that the tests check against brute force.
// Everything is __host__ __device__ so a host program can test the same code.
#pragma once
#include <climits>
#include <cmath>
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace jitattn_variant {

#define JITATTN_VARIANT_FN __host__ __device__ __forceinline__

#ifdef JITATTN_CAPTURE_STRUCT  // the kernels' (capture.h, at global scope: the Params hold it)
using Capture = ::jitattn_variant::Capture;
#else  // a host build of this file alone
struct Capture {
  const void* data;
  int64_t stride[4];
  int size[4];
};
#endif

// ------------------------------------------------------------------ capture reads
// The raw bits of the element at an index, 0 outside the capture (torch builds with
// __CUDA_NO_HALF_CONVERSIONS__, so a half has no T(0): the loads below convert the bits).
// Outside, the read loads the capture's first element (or, from an empty one, whose data the
// binding passes as null, a zero) and drops it: every read is one plain load with no branch
// around it, so the compiler shares equal reads (a relative-position table's along a diagonal),
// which it does for neither a load behind a branch nor __ldg (notes/variants-h100.md, "capture reads").
// NOW: a volatile load, which goes out where it is written (MaskMod::preload: a plain one, used only
// past a CTA's early return, was sunk below it by ptxas, a second memory latency per CTA).
template <class Bits, bool NOW = false>
JITATTN_VARIANT_FN Bits bits_at(const Capture& c, int i0, int i1, int i2, int i3) {
  const bool inside = (unsigned(i0) < unsigned(c.size[0])) & (unsigned(i1) < unsigned(c.size[1])) &
                      (unsigned(i2) < unsigned(c.size[2])) & (unsigned(i3) < unsigned(c.size[3]));
  const int64_t at = i0 * c.stride[0] + i1 * c.stride[1] + i2 * c.stride[2] + i3 * c.stride[3];
#ifdef __CUDA_ARCH__
  static const Bits zero = 0;  // in global memory, once per type
  const Bits* base = c.data ? static_cast<const Bits*>(c.data) : &zero;
  const Bits* element = base + (inside ? at : 0);
  Bits value;
  if constexpr (NOW) value = *static_cast<const volatile Bits*>(element);
  else value = *element;
  return inside ? value : Bits(0);
#else
  return inside ? static_cast<const Bits*>(c.data)[at] : Bits(0);
#endif
}

template <bool NOW = false>
JITATTN_VARIANT_FN float load_float32(const Capture& c, int i0 = 0, int i1 = 0, int i2 = 0, int i3 = 0) {
  const uint32_t bits = bits_at<uint32_t, NOW>(c, i0, i1, i2, i3);
  float value;
  __builtin_memcpy(&value, &bits, 4);
  return value;
}
template <bool NOW = false>
JITATTN_VARIANT_FN float load_float16(const Capture& c, int i0 = 0, int i1 = 0, int i2 = 0, int i3 = 0) {
  return __half2float(__ushort_as_half(bits_at<unsigned short, NOW>(c, i0, i1, i2, i3)));
}
template <bool NOW = false>
JITATTN_VARIANT_FN float load_bfloat16(const Capture& c, int i0 = 0, int i1 = 0, int i2 = 0, int i3 = 0) {
  return __bfloat162float(__ushort_as_bfloat16(bits_at<unsigned short, NOW>(c, i0, i1, i2, i3)));
}
template <bool NOW = false>
JITATTN_VARIANT_FN int load_int32(const Capture& c, int i0 = 0, int i1 = 0, int i2 = 0, int i3 = 0) {
  return int(bits_at<uint32_t, NOW>(c, i0, i1, i2, i3));
}
template <bool NOW = false>
JITATTN_VARIANT_FN int load_int64(const Capture& c, int i0 = 0, int i1 = 0, int i2 = 0, int i3 = 0) {
  return int(uint32_t(bits_at<uint64_t, NOW>(c, i0, i1, i2, i3)));
}
template <bool NOW = false>
JITATTN_VARIANT_FN bool load_bool(const Capture& c, int i0 = 0, int i1 = 0, int i2 = 0, int i3 = 0) {
  return bits_at<uint8_t, NOW>(c, i0, i1, i2, i3) != 0;
}

// ------------------------------------------------------------------ ints (32-bit, wrapping)
JITATTN_VARIANT_FN int iadd(int a, int b) { return int(unsigned(a) + unsigned(b)); }
JITATTN_VARIANT_FN int isub(int a, int b) { return int(unsigned(a) - unsigned(b)); }
JITATTN_VARIANT_FN int imul(int a, int b) { return int(unsigned(a) * unsigned(b)); }
JITATTN_VARIANT_FN int ineg(int a) { return int(0u - unsigned(a)); }
JITATTN_VARIANT_FN int iabs(int a) { return a < 0 ? ineg(a) : a; }
JITATTN_VARIANT_FN int imin(int a, int b) { return a < b ? a : b; }
JITATTN_VARIANT_FN int imax(int a, int b) { return a < b ? b : a; }

// Python's a // b (floor); 0 when b == 0; INT_MIN // -1 wraps to INT_MIN.
JITATTN_VARIANT_FN int floordiv(int a, int b) {
  if (b == 0) return 0;
  if (b == -1) return ineg(a);
  const int q = a / b;
  return (q * b != a && ((a < 0) != (b < 0))) ? q - 1 : q;
}

// Python's a % b (the sign of b); 0 when b == 0.
JITATTN_VARIANT_FN int mod(int a, int b) {
  if (b == 0 || b == -1) return 0;
  const int r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}

// ------------------------------------------------------------------ floats
// NaN-propagating min / max, as torch.minimum / torch.maximum (fminf would drop the NaN).
JITATTN_VARIANT_FN float fminimum(float a, float b) { return a != a ? a : b != b ? b : fminf(a, b); }
JITATTN_VARIANT_FN float fmaximum(float a, float b) { return a != a ? a : b != b ? b : fmaxf(a, b); }

// 2^x by ex2.approx (relative error about 2 ulp; subnormal results flush to 0).
JITATTN_VARIANT_FN float vexp2(float x) {
#ifdef __CUDA_ARCH__
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return exp2f(x);
#endif
}

JITATTN_VARIANT_FN float fast_divide(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdividef(a, b);
#else
  return a / b;
#endif
}

// e^x as 2^(x log2 e): the rounding of x log2 e adds a relative error of about |x| ulp.
JITATTN_VARIANT_FN float vexp(float x) { return vexp2(x * 1.44269504088896341f); }

// Accurate libm versions: log and sqrt are rare in variants and cheap enough exact.
JITATTN_VARIANT_FN float vlog(float x) { return logf(x); }
JITATTN_VARIANT_FN float vsqrt(float x) { return sqrtf(x); }

// tanh: for |x| >= 1/4, 1 - 2 / (1 + e^(2|x|)) with the sign of x (absolute error a few 1e-8,
// relative a few ulp at |x| = 1/4 and less above; saturates to +-1); below, the odd Taylor
// polynomial through x^9 (truncation under 1e-8 relative), which avoids 1 - 2/(1 + e)'s
// cancellation near 0.
JITATTN_VARIANT_FN float vtanh(float x) {
#ifdef __CUDA_ARCH__
  // On the GPU the hardware tanh.approx.f32 (one MUFU operation, relative error about 2^-11), as
  // the built-in soft cap (common/soft_cap.cuh) and FlashAttention-3 / FlashInfer take it: the
  // formula below costs two MUFU operations and a polynomial (notes/variants-h100.md).
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
  const float ax = fabsf(x);
  const float x2 = x * x;
  const float series =
      x * (1.f + x2 * (-0.333333333f + x2 * (0.133333333f + x2 * (-0.0539682540f + x2 * 0.0218694885f))));
  const float far = 1.f - fast_divide(2.f, 1.f + vexp2(2.88539008177792681f * ax));
  return ax < 0.25f ? series : copysignf(far, x);
}

// sigmoid(x) = 1 / (1 + e^-x): relative error a few ulp (plus vexp's |x| ulp); 0 for x -> -inf.
JITATTN_VARIANT_FN float vsigmoid(float x) { return fast_divide(1.f, 1.f + vexp2(-1.44269504088896341f * x)); }

// ------------------------------------------------------------------ intervals (classify)
// An int node over a tile: [lo, hi] in 64-bit, widened to all of int32 when it leaves int32
// (the kernel's ints wrap). A bool node: whether it may be true, whether it may be false.
// Floats are not tracked.
struct IInt {
  long long lo, hi;
};
struct IBool {
  bool may_true, may_false;
};
struct IFloat {};

// A single value wraps as the kernel's int does (preload's exact reads see the wrapped index too).
JITATTN_VARIANT_FN IInt iv_fit(long long lo, long long hi) {
  if (lo == hi) return IInt{int(unsigned(lo)), int(unsigned(lo))};
  return (lo < INT_MIN || hi > INT_MAX) ? IInt{INT_MIN, INT_MAX} : IInt{lo, hi};
}
JITATTN_VARIANT_FN IInt iv_exact(long long v) { return IInt{v, v}; }
JITATTN_VARIANT_FN IInt iv_full() { return IInt{INT_MIN, INT_MAX}; }
JITATTN_VARIANT_FN bool iv_is_exact(IInt a) { return a.lo == a.hi; }
JITATTN_VARIANT_FN IBool iv_bool(bool v) { return IBool{v, !v}; }
JITATTN_VARIANT_FN IBool iv_unknown() { return IBool{true, true}; }

JITATTN_VARIANT_FN long long min2(long long a, long long b) { return a < b ? a : b; }
JITATTN_VARIANT_FN long long max2(long long a, long long b) { return a < b ? b : a; }

JITATTN_VARIANT_FN IInt iv_add(IInt a, IInt b) { return iv_fit(a.lo + b.lo, a.hi + b.hi); }
JITATTN_VARIANT_FN IInt iv_sub(IInt a, IInt b) { return iv_fit(a.lo - b.hi, a.hi - b.lo); }
JITATTN_VARIANT_FN IInt iv_mul(IInt a, IInt b) {
  const long long c0 = a.lo * b.lo, c1 = a.lo * b.hi, c2 = a.hi * b.lo, c3 = a.hi * b.hi;
  return iv_fit(min2(min2(c0, c1), min2(c2, c3)), max2(max2(c0, c1), max2(c2, c3)));
}
JITATTN_VARIANT_FN IInt iv_neg(IInt a) { return iv_fit(-a.hi, -a.lo); }
JITATTN_VARIANT_FN IInt iv_abs(IInt a) {
  if (a.lo >= 0) return a;
  if (a.hi <= 0) return iv_neg(a);
  return iv_fit(0, max2(-a.lo, a.hi));
}
JITATTN_VARIANT_FN IInt iv_min(IInt a, IInt b) { return IInt{min2(a.lo, b.lo), min2(a.hi, b.hi)}; }
JITATTN_VARIANT_FN IInt iv_max(IInt a, IInt b) { return IInt{max2(a.lo, b.lo), max2(a.hi, b.hi)}; }

JITATTN_VARIANT_FN long long floordiv64(long long x, long long y) {
  const long long q = x / y;
  return (q * y != x && ((x < 0) != (y < 0))) ? q - 1 : q;
}

// floor(a / d) is monotone in each operand where d keeps its sign: the extremes are at corners
// of each sign's part of d; a zero divisor adds 0.
JITATTN_VARIANT_FN IInt iv_floordiv(IInt a, IInt d) {
  bool any = false;
  long long lo = 0, hi = 0;
  if (d.lo <= 0 && d.hi >= 0) any = true;
  const long long parts[2][2] = { {d.lo, min2(d.hi, -1)}, {max2(d.lo, 1), d.hi} };  // spaced: Jinja reads this file
  const bool has[2] = {d.lo <= -1, d.hi >= 1};
  for (int p = 0; p < 2; ++p) {
    if (!has[p]) continue;
    const long long xs[2] = {a.lo, a.hi};
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 2; ++j) {
        const long long q = floordiv64(xs[i], parts[p][j]);
        lo = any ? min2(lo, q) : q;
        hi = any ? max2(hi, q) : q;
        any = true;
      }
  }
  return iv_fit(lo, hi);
}

JITATTN_VARIANT_FN IInt iv_mod(IInt a, IInt d) {
  if (d.lo == d.hi && d.lo != 0 && d.lo != -1) {
    const long long m = d.lo, qa = floordiv64(a.lo, m), qb = floordiv64(a.hi, m);
    if (qa == qb) return IInt{a.lo - m * qa, a.hi - m * qb};
    return m > 0 ? IInt{0, m - 1} : IInt{m + 1, 0};
  }
  const long long lo = d.lo <= -1 ? d.lo + 1 : 0, hi = d.hi >= 1 ? d.hi - 1 : 0;
  return IInt{min2(lo, 0), max2(hi, 0)};
}

JITATTN_VARIANT_FN IInt iv_where(IBool c, IInt a, IInt b) {
  if (c.may_true && !c.may_false) return a;
  if (c.may_false && !c.may_true) return b;
  return IInt{min2(a.lo, b.lo), max2(a.hi, b.hi)};
}
JITATTN_VARIANT_FN IBool iv_bwhere(IBool c, IBool a, IBool b) {
  if (c.may_true && !c.may_false) return a;
  if (c.may_false && !c.may_true) return b;
  return IBool{a.may_true || b.may_true, a.may_false || b.may_false};
}

JITATTN_VARIANT_FN IBool iv_lt(IInt a, IInt b) { return IBool{a.lo < b.hi, a.hi >= b.lo}; }
JITATTN_VARIANT_FN IBool iv_le(IInt a, IInt b) { return IBool{a.lo <= b.hi, a.hi > b.lo}; }
JITATTN_VARIANT_FN IBool iv_gt(IInt a, IInt b) { return iv_lt(b, a); }
JITATTN_VARIANT_FN IBool iv_ge(IInt a, IInt b) { return iv_le(b, a); }
JITATTN_VARIANT_FN IBool iv_eq(IInt a, IInt b) {
  return IBool{a.lo <= b.hi && b.lo <= a.hi, !(a.lo == a.hi && b.lo == b.hi && a.lo == b.lo)};
}
JITATTN_VARIANT_FN IBool iv_ne(IInt a, IInt b) {
  const IBool e = iv_eq(a, b);
  return IBool{e.may_false, e.may_true};
}
JITATTN_VARIANT_FN IBool iv_beq(IBool a, IBool b) {
  return IBool{(a.may_true && b.may_true) || (a.may_false && b.may_false),
               (a.may_true && b.may_false) || (a.may_false && b.may_true)};
}
JITATTN_VARIANT_FN IBool iv_bne(IBool a, IBool b) {
  const IBool e = iv_beq(a, b);
  return IBool{e.may_false, e.may_true};
}
JITATTN_VARIANT_FN IBool iv_and(IBool a, IBool b) {
  return IBool{a.may_true && b.may_true, a.may_false || b.may_false};
}
JITATTN_VARIANT_FN IBool iv_or(IBool a, IBool b) {
  return IBool{a.may_true || b.may_true, a.may_false && b.may_false};
}
JITATTN_VARIANT_FN IBool iv_not(IBool a) { return IBool{a.may_false, a.may_true}; }

// A capture read over index intervals (MaskMod::classify_warp, the mask map's): with every index
// exact, the element; with one index spanning at most RANGE_READS values and the rest exact, the
// [min, max] of the elements it spans (0 outside the capture, as load(...) reads them); else
// unknown. A document-id mask's tiles then classify by two range reads instead of an evaluation
// per element. On the device the warp's 32 lanes split the range and share the result: the whole
// warp calls it with the same arguments. A host build (the tests) walks the range alone.
constexpr long long RANGE_READS = 1024;
template <class Load>
JITATTN_VARIANT_FN IInt iv_read(const Load& load, IInt i0, IInt i1 = IInt{0, 0}, IInt i2 = IInt{0, 0},
                                IInt i3 = IInt{0, 0}) {
  const IInt at[4] = {i0, i1, i2, i3};
  int span = -1;
  for (int k = 0; k < 4; ++k) {
    if (at[k].lo == at[k].hi) continue;
    if (span >= 0 || at[k].hi - at[k].lo >= RANGE_READS) return iv_full();
    span = k;
  }
  if (span < 0) return iv_exact(load(int(i0.lo), int(i1.lo), int(i2.lo), int(i3.lo)));
#ifdef __CUDA_ARCH__
  const int first = threadIdx.x % 32, step = 32;
#else
  const int first = 0, step = 1;
#endif
  long long lo = LLONG_MAX, hi = LLONG_MIN;
  for (long long x = at[span].lo + first; x <= at[span].hi; x += step) {
    const int i = int(x);
    const long long v = load(span == 0 ? i : int(i0.lo), span == 1 ? i : int(i1.lo), span == 2 ? i : int(i2.lo),
                             span == 3 ? i : int(i3.lo));
    lo = min2(lo, v);
    hi = max2(hi, v);
  }
#ifdef __CUDA_ARCH__
  for (int offset = 16; offset > 0; offset /= 2) {
    lo = min2(lo, __shfl_xor_sync(0xffffffffu, lo, offset));
    hi = max2(hi, __shfl_xor_sync(0xffffffffu, hi, offset));
  }
#endif
  return IInt{lo, hi};
}
// A bool read's iv_read (its elements as 0 / 1; unknown: all of int32): whether one may be true,
// one may be false.
JITATTN_VARIANT_FN IBool iv_bool_of(IInt a) { return IBool{a.lo != 0 || a.hi != 0, a.lo <= 0 && a.hi >= 0}; }

#undef JITATTN_VARIANT_FN

}  // namespace jitattn_variant
