// The deterministic dQ order's turn-taking (included by backward.cu.j2): see dq_semaphore in
// backward_schedule.cuh for which counter a (KV head, query tile) uses.

__device__ __forceinline__ int load_acquire(const int* address) {
  int value;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(value) : "l"(address) : "memory");
  return value;
}

// One thread waits; the CTA barrier then holds every thread until the turn has come. A wait
// that cannot end (the lower tile never runs: only with malformed metadata) gives up after
// 2^22 nanosleeps (seconds, not forever) instead of hanging the GPU.
// `sync`: the barrier of the threads that add (default: the CTA's; thread 0 among them).
template <typename Sync>
__device__ __forceinline__ void wait_turn(const int* sem, int turn, Sync sync) {
  if (threadIdx.x == 0 && sem != nullptr) {
    for (int spin = 0; load_acquire(sem) < turn && spin < (1 << 22); ++spin) __nanosleep(1000);
  }
  sync();
}
__device__ __forceinline__ void wait_turn(const int* sem, int turn) {
  wait_turn(sem, turn, [] { __syncthreads(); });
}

// After every thread's atomics: a barrier, then one release increment (the barrier orders the
// CTA's adds before thread 0's release).
template <typename Sync>
__device__ __forceinline__ void pass_turn(int* sem, Sync sync) {
  sync();
  if (threadIdx.x == 0 && sem != nullptr) {
    __threadfence();
    atomicAdd(sem, 1);
  }
}
__device__ __forceinline__ void pass_turn(int* sem) {
  pass_turn(sem, [] { __syncthreads(); });
}
