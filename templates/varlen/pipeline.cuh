// The producer / consumer pipelines' ring arithmetic, shared by the forward and the backward
// (FlashAttention-3's PipelineState, as functions of a running use count n): use n of a ring of
// ROUND stages (or work-item slots) sits in slot n % ROUND; the slot's full barrier completes
// once per round, so use n waits for its phase (n / ROUND) & 1 (use_parity), and its empty
// barrier, freed by use n - ROUND, one round behind: (n / ROUND + 1) & 1 (free_parity).
// n keeps its type: unsigned counts make the % and / bit operations.
template <int ROUND, class N>
__device__ __forceinline__ auto use_parity(N n) {
  return (n / ROUND) & 1;
}
template <int ROUND, class N>
__device__ __forceinline__ auto free_parity(N n) {
  return (n / ROUND + 1) & 1;
}
