{# The forward's Q loads: packed query rows -> (token, head), copied into shared memory
   (included by kernels.cu.j2). #}
// A packed row pr of the block and its token and query head (pr / pack and pr % pack, floored:
// rows before 0 exist in a causal block's head), stepped STEP rows at a time by additions. The
// Q copies and the epilogue's stores had an integer division by pack per row: at D128 a CTA
// took 1.8 us from setmaxnreg to its last Q copy issued and 2.2 us for the epilogue, of 18 us
// at 8 key tiles (clock stamps on the H200, notes/forward-h200.md).
template <int STEP>
struct PackedRow {
  int pr, token, head;
  int step_tokens, step_heads;
  __device__ __forceinline__ PackedRow(const VarlenParams& p, const Work& w, int row) : pr(w.m0 + row) {
    const int t = (pr >= 0 ? pr : pr - p.pack + 1) / p.pack;
    token = w.q_start + t;
    head = pr - t * p.pack;  // in [0, pack)
    step_tokens = STEP / p.pack;
    step_heads = STEP - step_tokens * p.pack;
  }
  __device__ __forceinline__ void advance(const VarlenParams& p) {
    pr += STEP;
    token += step_tokens;
    head += step_heads;
    if (head >= p.pack) {
      head -= p.pack;
      ++token;
    }
  }
};

// Rows [first, first + rows) of the block's Q, copied by THREADS_Q threads (tid in [0, THREADS_Q)).
template <int THREADS_Q>
__device__ __forceinline__ void load_q(const VarlenParams& p, const Work& w, uint4* q_smem, int tid, int first,
                                       int rows) {
  const T* q = static_cast<const T*>(p.q);
  if constexpr (THREADS_Q % CHUNKS == 0) {  // each thread copies one chunk of rows THREADS_Q / CHUNKS apart
    const int chunk = tid % CHUNKS;
    PackedRow<THREADS_Q / CHUNKS> r(p, w, first + tid / CHUNKS);
    for (int row = first + tid / CHUNKS; row < first + rows; row += THREADS_Q / CHUNKS, r.advance(p)) {
      const bool valid = r.pr >= 0 && r.pr < w.rows;
      const int64_t off =
          valid ? r.token * p.q_stride_token + (w.kv_head * p.pack + r.head) * p.q_stride_head + chunk * 8 : 0;
      cp_async_16(q_smem + swizzle(row, chunk), q + off, valid);
    }
    return;
  }
  for (int idx = tid; idx < rows * CHUNKS; idx += THREADS_Q) {
    const int row = first + idx / CHUNKS, chunk = idx % CHUNKS;
    const int pr = w.m0 + row;
    const bool valid = pr >= 0 && pr < w.rows;
    const int token = w.q_start + pr / p.pack, head = w.kv_head * p.pack + pr % p.pack;
    const int64_t off = valid ? token * p.q_stride_token + head * p.q_stride_head + chunk * 8 : 0;
    cp_async_16(q_smem + swizzle(row, chunk), q + off, valid);
  }
}
