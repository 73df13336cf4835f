// A variant's captured tensor (a bias table, ALiBi slopes, document ids) as the kernels read it:
// filled per call by the binding, so new values never recompile. Dims past the tensor's: size 1,
// stride 0. Host and device code both include it, before params.h (the bindings, the kernels).
#pragma once
#include <cstdint>

// Captured tensors of this kernel's variants (0: none; Params then has no `captures`).
#define JITATTN_CAPTURES {{ num_captures }}

namespace jitattn_variant {
struct Capture {
  const void* data;
  int64_t stride[4];  // elements
  int size[4];
};
}  // namespace jitattn_variant
#define JITATTN_CAPTURE_STRUCT 1  // (variant.cuh defines the same struct only without this file)
