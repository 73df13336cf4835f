// Programmatic dependent launch (sm_90+): a second kernel on the same stream is launched before
// the first one finishes, so its launch latency hides behind the first one's tail. The
// dependent calls wait_for_prerequisite_grid() before it reads anything the first one wrote.
#pragma once
#include <cuda_runtime.h>

namespace jitattn {

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
void launch_dependent(Kernel kernel, int grid, int block, cudaStream_t stream, const Params& params) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(block);
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  cudaLaunchKernelEx(&config, kernel, params);
}

}  // namespace jitattn
