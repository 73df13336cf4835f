{# decode_chunk, the split-KV kernel (and finish_logit, the logit both paths share): its prologue
   around one of the two compute paths, then the merge of its states (included by kernels.cu.j2). #}
// Logit (log2 units) of one (query head, kv row) pair from the raw dot product.
__device__ __forceinline__ float finish_logit(const DecodeParams& p, float dot, float alibi2, int row, int chunk_end) {
  if constexpr (SOFT_CAP) dot = p.cap_log2e * tanhf(dot);
  if constexpr (ALIBI) dot += alibi2 * static_cast<float>(row - (p.kv_end - 1));
  return row < chunk_end ? dot : -INFINITY;
}

// Min blocks 1 spelled out: ptxas then schedules for ILP rather than register economy
// (occupancy is set by shared memory anyway). Why: notes/decode-h200.md, "__launch_bounds__".
__global__ void __launch_bounds__(THREADS, 1) decode_chunk(const DecodeParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);
  // RoPE: each dim's frequency, computed once per CTA (rope_freq).
  __shared__ RopeFreq rope_table[ROPE ? HEAD_DIM / 2 : 1];
{% if tensor_cores %}
  // RoPE, read by every thread in the loop: each dim's rotation over 8 positions, which takes a
  // warp's second key block from its first (rope_advance: half the sincos; notes/decode-h200.md,
  // "rope_step").
  __shared__ __align__(16) float2 rope_step[ROPE ? HEAD_DIM / 2 : 1];
{% endif %}
  const int tid = threadIdx.x;
  const int chunk = blockIdx.x, kv_head = blockIdx.y, group_base = blockIdx.z * GROUP_TILE;
  const int chunk_begin = p.kv_begin + chunk * p.chunk_len;
  const int chunk_end = min(chunk_begin + p.chunk_len, p.kv_end);
  const int num_tiles = (chunk_end - chunk_begin + TILE - 1) / TILE;
  const int num_heads = p.num_kv_heads * p.group_size;
  TileCopier copier(p, kv_head, chunk_begin, tid);

  // Launched as a programmatic dependent: the kernel ahead on the stream may still be running
  // (it may be what wrote q/k/v, or still reading memory that out reuses), so nothing touches
  // global memory before this wait. In a model's layer-after-layer decode this hides most of the
  // launch gap after the previous kernel (notes/decode-h200.md, "Programmatic dependent launch").
  wait_for_prerequisite_grid();
  // Start the copies first: the query setup below overlaps with them. STAGES - 1 groups, the
  // first `depth` of them holding tiles. The loops wait with depth - 1 groups pending, so with a
  // short chunk's shallow prefetch tile 0 waits for all `depth` of the first tiles (the empty
  // groups are the newest), and every later tile for itself. Committing only `depth` groups, so
  // that tile 0 waits for itself alone, measured no faster (notes/decode-h200.md, "PIPELINED_LOGITS
  // and the prefetch commit").
  const int depth = prefetch_depth(num_tiles);
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < depth && s < num_tiles) copier.load(smem.stages[s], chunk_begin + s * TILE, chunk_end);
    cp_async_commit();
  }
{% if tensor_cores %}
{% include "decode/chunk_tensor_cores.cuh" %}
{% else %}
{% include "decode/chunk_cuda_cores.cuh" %}
{% endif %}
  __syncthreads();
  merge_states_and_write(smem.merge, p, chunk, kv_head, group_base, tid);
}
