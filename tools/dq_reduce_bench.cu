// Microbenchmark (tools/dq_reduce_bench.py): ways to add 64 x 256 fp32 dQ tiles into a 512 MB
// accumulator, as the D256 backward does (132 CTAs x 256 threads, each CTA 128 tiles of its own
// (sequence, head)): the L2 reduction rate by access pattern (notes/backward-d256.md).
#include <cuda_runtime.h>
#include <cstdint>
#include <cstdio>
__device__ __forceinline__ void red4(float* p, float a, float b, float c, float d) {
  atomicAdd(reinterpret_cast<float4*>(p), make_float4(a, b, c, d));
}
// mode 0: current add_dq pattern (16 rows x 32 B per instruction)
// mode 1: 8 rows x 64 B per instruction (a quad writes 64 contiguous bytes of one row)
// mode 2: 4 rows x 128 B per instruction
// mode 3: scalar red.f32, FA2-like (8 rows x 2 x 4 B... per lane 2 scalars a tile)
// mode 4: bulk reduce-add from shared memory (4 x 16 KB a tile, one thread)
// mode 5: plain v4 stores, pattern 2 (write bandwidth)
// mode 6: scalar red.f32, 32 consecutive floats a warp instruction
__global__ void __launch_bounds__(256, 1) dq_add(float* acc, int mode, int steps, int regions) {
  extern __shared__ float4 sm[];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, c = lane % 4;
  const int region = blockIdx.x % regions;
  const float v = 1e-3f * (tid + 1);
  if (mode == 4) { for (int i = tid; i < 4096; i += 256) sm[i] = make_float4(v, v, v, v); asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); __syncthreads(); }
  for (int t = 0; t < steps; ++t) {
    float* tile = acc + (int64_t(region) * 4096 + (t % 64) * 64) * 256;  // 64 rows x 256
    if (mode == 0) {
      const int wg = warp / 4, row = (warp % 4) * 16 + g;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const int col = wg * 128 + j * 8;
        if (!(c & 1)) red4(tile + row * 256 + col + 2 * c, v, v, v, v);
        else red4(tile + (row + 8) * 256 + col + 2 * c - 2, v, v, v, v);
      }
    } else if (mode == 1) {
      const int wg = warp / 4, row = (warp % 4) * 16 + g;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int col = wg * 128 + j * 16 + 4 * c;
        red4(tile + row * 256 + col, v, v, v, v);
        red4(tile + (row + 8) * 256 + col, v, v, v, v);
      }
    } else if (mode == 2 || mode == 5) {
      // warp w: rows 8w .. 8w+7, each instruction 4 rows x 128 B
#pragma unroll
      for (int k = 0; k < 16; ++k) {
        const int row = warp * 8 + (k % 2) * 4 + lane / 8, col = (k / 2) * 32 + (lane % 8) * 4;
        if (mode == 2) red4(tile + row * 256 + col, v, v, v, v);
        else *reinterpret_cast<float4*>(tile + row * 256 + col) = make_float4(v, v, v, v);
      }
    } else if (mode == 3) {
      const int wg = warp / 4, row = (warp % 4) * 16 + g;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const int col = wg * 128 + j * 8 + 2 * c;
        atomicAdd(tile + row * 256 + col, v); atomicAdd(tile + row * 256 + col + 1, v);
        atomicAdd(tile + (row + 8) * 256 + col, v); atomicAdd(tile + (row + 8) * 256 + col + 1, v);
      }
    } else if (mode == 6) {
      // scalar red.f32, a warp's 32 lanes on 32 consecutive floats (FlashAttention-2's dQ atomics)
#pragma unroll 8
      for (int k = 0; k < 64; ++k) {
        const int idx = (k * 8 + warp) * 32 + lane;  // 64 x 256 floats, one 128-byte line an instruction
        atomicAdd(tile + idx, v);
      }
    } else if (mode == 4) {
      if (tid == 0) {
        for (int q = 0; q < 4; ++q)
          asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(tile + q * 4096),
                       "r"(static_cast<uint32_t>(__cvta_generic_to_shared(sm + q * 1024))), "r"(16384) : "memory");
        asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
        asm volatile("cp.async.bulk.wait_group.read 1;\n" ::: "memory");
      }
    }
  }
  if (mode == 4 && tid == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}
extern "C" float run(float* acc, int mode, int ctas, int steps, int regions, int reps) {
  cudaFuncSetAttribute(dq_add, cudaFuncAttributeMaxDynamicSharedMemorySize, 65536);
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  dq_add<<<ctas, 256, 65536>>>(acc, mode, steps, regions);
  cudaEventRecord(a);
  for (int r = 0; r < reps; ++r) dq_add<<<ctas, 256, 65536>>>(acc, mode, steps, regions);
  cudaEventRecord(b); cudaEventSynchronize(b);
  float ms; cudaEventElapsedTime(&ms, a, b);
  cudaError_t e = cudaGetLastError(); if (e != cudaSuccess) { printf("err %s\n", cudaGetErrorString(e)); return -1; }
  return ms / reps;
}
