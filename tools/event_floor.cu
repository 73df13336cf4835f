// What one call between two CUDA events can never go below on this GPU, for the decode
// benchmark's method (tools/bench_util.time_us: a GPU spin, start event, the call, end event).
// Kernels stamp %globaltimer, so the gaps are measured on the GPU's clock:
//  - spin end -> first CTA: the launch gap behind the start event;
//  - primary end -> release: a programmatic dependent's griddepcontrol.wait returning after
//    the last CTA of the kernel before it exits (decode's merge_chunks waits so);
//  - release -> loads used: reading what the primary just wrote (the partials), from L2.
// Then stream-only times: a plain kernel that only reads a decode row's K/V bytes from DRAM
// (cold L2, best of 1, 2 or 4 CTAs per SM), alone and followed by the merge stand-in, timed the
// same way: what the bytes alone cost, which decode's own overheads are judged against.
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

// Streams n16 16-byte words (grid-stride, kUnroll independent loads in flight per thread) and
// keeps a checksum so the loads stay; lets its dependent launch like decode_chunk.
constexpr int kUnroll = 8, kReadThreads = 512;
struct ReadArgs {
  const int4* src;
  long long n16;
  Buffers b;
};
__global__ void __launch_bounds__(kReadThreads) stream_read(const ReadArgs a) {
  const int4* __restrict__ src = a.src;
  const long long n16 = a.n16;
  jitattn::allow_dependent_launch();
  const long long stride = static_cast<long long>(gridDim.x) * kReadThreads;
  int acc = 0;
  for (long long i = blockIdx.x * static_cast<long long>(kReadThreads) + threadIdx.x; i < n16; i += kUnroll * stride) {
    int4 w[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) w[u] = i + u * stride < n16 ? __ldcs(src + i + u * stride) : make_int4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc ^= w[u].x ^ w[u].y ^ w[u].z ^ w[u].w;
  }
  if (blockIdx.x < kCtas && threadIdx.x < kThreads)
    a.b.partial[blockIdx.x * kThreads + threadIdx.x] = make_float4(__int_as_float(acc), 0.f, 0.f, 0.f);
}

float median(std::vector<float> x) {
  std::sort(x.begin(), x.end());
  return x[x.size() / 2];
}

// Median us between the events of `launch` (a spin first, so the host is ahead of the GPU).
template <typename Launch>
float event_us(cudaStream_t stream, cudaEvent_t start, cudaEvent_t end, int reps, Launch launch) {
  std::vector<float> us;
  for (int rep = 0; rep < reps + 5; ++rep) {
    spin<<<1, 32, 0, stream>>>(100000);
    cudaEventRecord(start, stream);
    launch(rep);
    cudaEventRecord(end, stream);
    cudaStreamSynchronize(stream);
    float ms = 0.f;
    cudaEventElapsedTime(&ms, start, end);
    if (rep >= 5) us.push_back(ms * 1e3f);  // warm-up
  }
  return median(us);
}

// Stream-only times of the decode rows the issue's acceptance names (head_dim 128, fp16 K, V).
void stream_only(cudaStream_t stream, const Buffers& buffers, cudaEvent_t start, cudaEvent_t end) {
  struct Row { const char* name; long long bytes; };
  const Row rows[] = {{"32/8 4k", 2ll * 4096 * 8 * 128 * 2}, {"32/32 4k", 2ll * 4096 * 32 * 128 * 2},
                      {"32/8 32k", 2ll * 32768 * 8 * 128 * 2}, {"32/32 32k", 2ll * 32768 * 32 * 128 * 2}};
  const long long rotation = 256ll << 20;  // input sets cover this much: no call finds its bytes in L2
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  for (const Row& row : rows) {
    const int sets = static_cast<int>(std::max(2ll, (rotation + row.bytes - 1) / row.bytes));
    int4* pool = nullptr;
    if (cudaMalloc(&pool, row.bytes * sets) != cudaSuccess) {
      std::printf("stream only, %s: no memory for %d input sets\n", row.name, sets);
      return;
    }
    cudaMemset(pool, 0x5a, row.bytes * sets);  // not zeros: real data
    const long long n16 = row.bytes / 16;
    std::printf("stream only, %s K/V (%.1f MB), 1 / 2 / 4 CTAs per SM, us between the events:", row.name,
                row.bytes / 1e6);
    for (const bool with_merge : {false, true}) {
      if (with_merge) std::printf("; with a dependent merge");
      for (const int per_sm : {1, 2, 4}) {
        const int grid = per_sm * sms;
        std::printf(" %.2f", event_us(stream, start, end, 40, [&](int rep) {
          const ReadArgs args{pool + (rep % sets) * n16, n16, buffers};
          jitattn::launch_dependent(stream_read, grid, kReadThreads, stream, args);
          if (with_merge) jitattn::launch_dependent(dependent, kDependentCtas, kThreads, stream, buffers);
        }));
      }
    }
    std::printf("\n");
    cudaFree(pool);
  }
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
  stream_only(stream, buffers, start, end);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    std::printf("CUDA error: %s\n", cudaGetErrorString(err));
    return 1;
  }
  return 0;
}
