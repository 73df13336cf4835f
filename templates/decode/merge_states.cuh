{# The end of every decode_chunk CTA: merge its row groups' (warps') softmax states and write
   the output or the split's fp32 partial (included by kernels.cu.j2). #}
// The output of one head, elements [col, col + N): v_scale applied, written as DTypeQ (single
// chunk) or as an fp32 partial (split). `lse2` is base 2, relative to the ALiBi offset when ALIBI.
template <int N>
__device__ __forceinline__ void write_result(const DecodeParams& p, int chunk, int head, int col,
                                             float (&acc)[N], float lse2) {
  const int num_heads = p.num_kv_heads * p.group_size;
  if (p.num_chunks == 1) {
#pragma unroll
    for (int e = 0; e < N; ++e) acc[e] *= p.v_scale;
    store_floats<DTypeQ, N>(static_cast<DTypeQ*>(p.out) + head * HEAD_DIM + col, acc);
    if (col == 0 && p.lse != nullptr) {
      if constexpr (ALIBI) lse2 += alibi_slope(head, num_heads) * LOG2E * (p.kv_end - 1);
      p.lse[head] = lse2;
    }
  } else {
    float4* dst = reinterpret_cast<float4*>(p.partial_o + (int64_t(chunk) * num_heads + head) * HEAD_DIM + col);
#pragma unroll
    for (int e = 0; e < N; e += 4) dst[e / 4] = make_float4(acc[e], acc[e + 1], acc[e + 2], acc[e + 3]);
    if (col == 0) p.partial_lse[chunk * num_heads + head] = lse2;
  }
}

// Merge the STATE_SETS partial softmax states of each query head (in shared memory) and write
// the head's result. Called by all threads after the states are stored. It runs at the end of
// every CTA, on the critical path of the last ones: the max over the sets comes first, so every
// set's weight is independent of the others (a fold of the sets one by one was a chain of
// STATE_SETS dependent rescales), and each thread takes MERGE_VEC elements (one 16-byte store).
constexpr int MERGE_VEC = 8;
__device__ __forceinline__ void merge_states_and_write(const MergeScratch& scratch, const DecodeParams& p,
                                                       int chunk, int kv_head, int group_base, int tid) {
  constexpr int PIECES = HEAD_DIM / MERGE_VEC;  // per head
  for (int idx = tid; idx < GROUP_TILE * PIECES; idx += THREADS) {
    const int g = idx / PIECES, out_col = (idx % PIECES) * MERGE_VEC;
    if (group_base + g >= p.group_size) continue;
    float m = -INFINITY;
#pragma unroll
    for (int set = 0; set < STATE_SETS; ++set) m = fmaxf(m, scratch.m[set][g]);
    float d = 0.f, acc[MERGE_VEC] = {};
#pragma unroll
    for (int set = 0; set < STATE_SETS; ++set) {
      const float w = exp2_diff(scratch.m[set][g], m);  // 0 for a set that saw no row
      d += scratch.d[set][g] * w;
#pragma unroll
      for (int e = 0; e < MERGE_VEC; ++e) acc[e] += scratch.o[set][g][out_col + e] * w;
    }
    const float inv = 1.f / d;
#pragma unroll
    for (int e = 0; e < MERGE_VEC; ++e) acc[e] *= inv;
    write_result(p, chunk, kv_head * p.group_size + group_base + g, out_col, acc, m + log2f(d));
  }
}
