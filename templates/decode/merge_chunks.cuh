{# merge_chunks, the split combine kernel: one CTA per query head folds the chunks' partials in a
   fixed order (included by kernels.cu.j2). #}
// One CTA per query head: out = sum_c w_c o_c / sum_c w_c with w_c = 2^(lse_c - max lse).
// Latency-bound (a few KB from L2 per head), so each head column gets MERGE_SLICES independent
// load streams: thread (slice, col) folds chunks c = slice (mod MERGE_SLICES) of a float4
// column with online softmax, then the slices' states are folded in slice order. A thread
// issues the loads of MERGE_BATCH of its chunks before it folds any (predicated, not behind a
// loop branch), so up to MERGE_SLICES * MERGE_BATCH chunks cost one L2 round trip rather than
// one per chunk (notes/decode-h200.md, "merge_chunks"). The order is fixed, so the result never
// depends on scheduling (deterministic).
constexpr int COLS = HEAD_DIM / 4;
constexpr int MERGE_SLICES = 4;
constexpr int MERGE_BATCH = 4;
constexpr int MERGE_THREADS = MERGE_SLICES * COLS;

__device__ __forceinline__ float4 fold4(float4 acc, float a, float4 o, float b) {
  return make_float4(acc.x * a + o.x * b, acc.y * a + o.y * b, acc.z * a + o.z * b, acc.w * a + o.w * b);
}

__global__ void __launch_bounds__(MERGE_THREADS) merge_chunks(const DecodeParams p) {
  __shared__ float4 slice_o[MERGE_SLICES][COLS];
  __shared__ float slice_m[MERGE_SLICES], slice_d[MERGE_SLICES];
  const int head = blockIdx.x, num_heads = p.num_kv_heads * p.group_size;
  const int slice = threadIdx.x / COLS, col = threadIdx.x % COLS;
  // This thread's partials of chunk `slice`; those of chunk c + MERGE_SLICES sit `step` head rows on.
  const int64_t step = int64_t(MERGE_SLICES) * num_heads;
  const float4* partial_o = reinterpret_cast<const float4*>(p.partial_o + (slice * int64_t(num_heads) + head) * HEAD_DIM) + col;
  const float* partial_lse = p.partial_lse + slice * num_heads + head;
  wait_for_prerequisite_grid();
  SoftmaxState state;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int base = slice; base < p.num_chunks; base += MERGE_SLICES * MERGE_BATCH) {
    float lse[MERGE_BATCH];
    float4 o[MERGE_BATCH];
#pragma unroll
    for (int i = 0; i < MERGE_BATCH; ++i) {
      const bool valid = base + i * MERGE_SLICES < p.num_chunks;
      lse[i] = valid ? *partial_lse : -INFINITY;
      o[i] = valid ? *partial_o : make_float4(0.f, 0.f, 0.f, 0.f);
      partial_lse += step;
      partial_o += step * COLS;
    }
#pragma unroll
    for (int i = 0; i < MERGE_BATCH; ++i) {
      if (base + i * MERGE_SLICES < p.num_chunks) {
        const float2 f = state.merge(lse[i], 1.f);  // a chunk's lse is its (log2) weight
        acc = fold4(acc, f.x, o[i], f.y);
      }
    }
  }
  slice_o[slice][col] = acc;
  if (col == 0) {
    slice_m[slice] = state.m;
    slice_d[slice] = state.d;
  }
  __syncthreads();
  if (slice == 0) {
    SoftmaxState total;
    acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int s = 0; s < MERGE_SLICES; ++s) {
      const float2 f = total.merge(slice_m[s], slice_d[s]);
      acc = fold4(acc, f.x, slice_o[s][col], f.y);
    }
    const float inv = p.v_scale / total.d;
    reinterpret_cast<uint2*>(static_cast<DTypeQ*>(p.out) + head * HEAD_DIM)[col] =
        make_uint2(ElemTraits<DTypeQ>::from_float2(acc.x * inv, acc.y * inv),
                   ElemTraits<DTypeQ>::from_float2(acc.z * inv, acc.w * inv));
    if (col == 0 && p.lse != nullptr) {
      float lse2 = total.lse2();
      if constexpr (ALIBI) lse2 += alibi_slope(head, num_heads) * LOG2E * (p.kv_end - 1);
      p.lse[head] = lse2;
    }
  }
}
