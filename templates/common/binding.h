// What every binding needs from torch: the stable-ABI tensor type, op registration and the
// current CUDA stream. Only bindings include this; kernels are plain CUDA.
#pragma once
#ifndef USE_CUDA
#define USE_CUDA  // declares the CUDA entries of the AOTI shim (current stream)
#endif
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>
#include <cuda_runtime.h>
#include <initializer_list>
#include <optional>
#include <tuple>

#include <stdexcept>
#include <string>

// Our own shim-call check: STABLE_TORCH_ERROR_CODE_CHECK only exists in newer torch headers,
// and the binding must build against every torch from the ABI target (2.10) on.
#define JITATTN_SHIM_CHECK(call)                                                          \
  do {                                                                                    \
    if ((call) != AOTI_TORCH_SUCCESS)                                                     \
      throw std::runtime_error(std::string("jitattn: torch shim call failed: ") + #call); \
  } while (0)

namespace jitattn {

// A new contiguous tensor from torch's caching allocator (AOTI shim: no dispatcher round trip,
// and safe under CUDA graph capture like any torch allocation).
inline torch::stable::Tensor new_cuda_tensor(std::initializer_list<int64_t> sizes, int32_t dtype, int device) {
  int64_t shape[4], strides[4];
  const int64_t ndim = static_cast<int64_t>(sizes.size());
  int64_t i = 0;
  for (int64_t s : sizes) shape[i++] = s;
  int64_t stride = 1;
  for (i = ndim - 1; i >= 0; --i) {
    strides[i] = stride;
    stride *= shape[i];
  }
  AtenTensorHandle handle = nullptr;
  JITATTN_SHIM_CHECK(aoti_torch_empty_strided(ndim, shape, strides, dtype,
                                                         aoti_torch_device_type_cuda(), device, &handle));
  return torch::stable::Tensor(handle);
}

inline int32_t dtype_of(const torch::stable::Tensor& t) {
  int32_t dtype = 0;
  JITATTN_SHIM_CHECK(aoti_torch_get_dtype(t.get(), &dtype));
  return dtype;
}

inline cudaStream_t current_stream(int device) {
  void* stream = nullptr;
  JITATTN_SHIM_CHECK(aoti_torch_get_current_cuda_stream(device, &stream));
  return static_cast<cudaStream_t>(stream);
}

}  // namespace jitattn
