// What one call between two CUDA events can never go below on this GPU, for the decode
// benchmark's method (tools/bench_util.time_us: a GPU spin, start event, the call, end event).
// Kernels stamp %globaltimer, so the gaps are measured on the GPU's clock:
//  - spin end -> first CTA: the launch gap behind the start event;
//  - primary end -> release: a programmatic dependent's griddepcontrol.wait returning after
//    the last CTA of the kernel before it exits (decode's merge_chunks waits so);
//  - release -> loads used: reading what the primary just wrote (the partials), from L2.
// Build and run on the GPU machine: nvcc -O2 -arch=native tools/event_floor.cu -o /tmp/floor
// && /tmp/floor (tools/device_check.sh does, with BENCH=decode).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "../templates/common/launch.cuh"  // the launch and the PDL calls decode's kernels use

namespace {

constexpr int kCtas = 128, kThreads = 128, kDependentCtas = 32;
__device__ unsigned long long g_stamp[4 * 1024];  // spin end | primary start, end | dependent release, done
struct Buffers {
  float4* partial;  // [kCtas * kThreads], written by primary
  float* sink;      // [kDependentCtas * kThreads], written by dependent
};

__device__ __forceinline__ unsigned long long now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void spin(unsigned long long ns) {
  const unsigned long long start = now();
  while (now() - start < ns) {
  }
  g_stamp[0] = now();
}

// A decode_chunk stand-in: every CTA writes a partial and lets its dependent launch.
__global__ void primary(const Buffers b) {
  if (threadIdx.x == 0) g_stamp[1 + blockIdx.x] = now();
  b.partial[blockIdx.x * kThreads + threadIdx.x] = make_float4(threadIdx.x, 1.f, 2.f, 3.f);
  jitattn::allow_dependent_launch();
  if (threadIdx.x == 0) g_stamp[1024 + blockIdx.x] = now();
}

// A merge_chunks stand-in: waits for the primary, then reads four of its partials.
__global__ void dependent(const Buffers b) {
  jitattn::wait_for_prerequisite_grid();
  if (threadIdx.x == 0) g_stamp[2048 + blockIdx.x] = now();
  float4 v[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) v[k] = b.partial[((blockIdx.x * 7 + k * 33) % kCtas) * kThreads + threadIdx.x];
  float acc = 0.f;
#pragma unroll
  for (int k = 0; k < 4; ++k) acc += v[k].x + v[k].y * v[k].z;
  __syncthreads();
  if (threadIdx.x == 0) g_stamp[3072 + blockIdx.x] = now();
  b.sink[blockIdx.x * kThreads + threadIdx.x] = acc;
}

float median(std::vector<float> x) {
  std::sort(x.begin(), x.end());
  return x[x.size() / 2];
}

}  // namespace

int main() {
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  Buffers buffers;
  cudaMalloc(&buffers.partial, sizeof(float4) * kCtas * kThreads);
  cudaMalloc(&buffers.sink, sizeof(float) * kDependentCtas * kThreads);
  cudaEvent_t start, end;
  cudaEventCreate(&start);
  cudaEventCreate(&end);
  for (const bool with_dependent : {false, true}) {
    std::vector<float> event_us, launch_gap, release, loads;
    std::vector<unsigned long long> stamp(4 * 1024);
    for (int rep = 0; rep < 60; ++rep) {
      spin<<<1, 32, 0, stream>>>(100000);  // 100 us: the host is far ahead of the GPU
      cudaEventRecord(start, stream);
      jitattn::launch_dependent(primary, kCtas, kThreads, stream, buffers);  // as decode launches
      if (with_dependent) jitattn::launch_dependent(dependent, kDependentCtas, kThreads, stream, buffers);
      cudaEventRecord(end, stream);
      cudaStreamSynchronize(stream);
      float ms = 0.f;
      cudaEventElapsedTime(&ms, start, end);
      cudaMemcpyFromSymbol(stamp.data(), g_stamp, stamp.size() * sizeof(stamp[0]));
      if (rep < 10) continue;  // warm-up
      const auto first = *std::min_element(stamp.begin() + 1, stamp.begin() + 1 + kCtas);
      const auto last = *std::max_element(stamp.begin() + 1024, stamp.begin() + 1024 + kCtas);
      event_us.push_back(ms * 1e3f);
      launch_gap.push_back((first - stamp[0]) * 1e-3f);
      if (with_dependent) {
        const auto released = *std::max_element(stamp.begin() + 2048, stamp.begin() + 2048 + kDependentCtas);
        const auto done = *std::max_element(stamp.begin() + 3072, stamp.begin() + 3072 + kDependentCtas);
        release.push_back((released - last) * 1e-3f);
        loads.push_back((done - released) * 1e-3f);
      }
    }
    std::printf("event floor, %s: %.2f us between the events; spin end -> first CTA %.2f us",
                with_dependent ? "two kernels (the second a programmatic dependent)" : "one kernel of 128 CTAs",
                median(event_us), median(launch_gap));
    if (with_dependent) std::printf("; primary end -> release %.2f us; release -> loads used %.2f us", median(release), median(loads));
    std::printf("\n");
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    std::printf("CUDA error: %s\n", cudaGetErrorString(err));
    return 1;
  }
  return 0;
}
