// What every binding needs from torch: the stable-ABI tensor type, op registration and the
// current CUDA stream. Only bindings include this; kernels are plain CUDA.
#pragma once
#ifndef USE_CUDA
#define USE_CUDA  // declares the CUDA entries of the AOTI shim (current stream)
#endif
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/Exception.h>
#include <cuda_runtime.h>
#include <optional>

namespace jitattn {

inline cudaStream_t current_stream(int device) {
  void* stream = nullptr;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(device, &stream));
  return static_cast<cudaStream_t>(stream);
}

}  // namespace jitattn
