// Programmatic dependent launch (sm_90+): a kernel launched with launch_dependent may start
// before the kernel ahead of it on the stream has finished (once that one's CTAs have all called
// allow_dependent_launch or exited), so its launch latency hides behind the other's tail. The
// dependent must call wait_for_prerequisite_grid() before it touches global memory the other
// kernel may read or write; the wait returns once that kernel is complete and its writes are
// visible (at once when there is no such kernel).
#pragma once
#include <cuda_runtime.h>
#include <stdexcept>
#include <string>

namespace jitattn {

// Let `kernel` take `bytes` of dynamic shared memory. A kernel whose dynamic and static shared
// memory together pass what a block may use on the device gets an error that names them here,
// not a launch's bare "invalid argument" later (a template change that outgrew the budget).
template <typename Kernel>
void allow_dynamic_smem(Kernel kernel, int bytes, const char* name, int device) {
  const cudaError_t status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (status == cudaSuccess) return;
  cudaGetLastError();  // clear a non-sticky error for the caller's later checks
  if (status != cudaErrorInvalidValue)  // e.g. an earlier launch's error, reported here
    throw std::runtime_error(std::string(name) + ": " + cudaGetErrorString(status));
  cudaFuncAttributes attributes = {};
  cudaFuncGetAttributes(&attributes, kernel);
  int limit = 0;
  cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  throw std::runtime_error(std::string(name) + " needs " + std::to_string(bytes) + " bytes of dynamic shared memory beside " +
                           std::to_string(attributes.sharedSizeBytes) + " static, and a block may use " +
                           std::to_string(limit) + " on device " + std::to_string(device));
}

__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_prerequisite_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

template <typename Kernel, typename Params>
void launch_dependent(Kernel kernel, dim3 grid, int block, cudaStream_t stream, const Params& params, size_t smem = 0) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(block);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  cudaLaunchKernelEx(&config, kernel, params);
}

}  // namespace jitattn
