{# The forward's Q loads: packed query rows -> (token, head), copied into shared memory
   (included by kernels.cu.j2). #}
// Rows [first, first + rows) of the block's Q, copied by THREADS_Q threads (tid in [0, THREADS_Q)).
template <int THREADS_Q>
__device__ __forceinline__ void load_q(const VarlenParams& p, const Work& w, uint4* q_smem, int tid, int first,
                                       int rows) {
  const T* q = static_cast<const T*>(p.q);
  if constexpr (THREADS_Q % CHUNKS == 0) {  // each thread copies one chunk of rows THREADS_Q / CHUNKS apart
    const int chunk = tid % CHUNKS;
    PackedRow<THREADS_Q / CHUNKS> r(p.pack, w.q_start, w.m0 + first + tid / CHUNKS);
    for (int row = first + tid / CHUNKS; row < first + rows; row += THREADS_Q / CHUNKS, r.advance(p.pack)) {
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
    const TokenHead th = packed_row(pr, p.pack, w.q_start, w.kv_head);
    const int64_t off = valid ? th.token * p.q_stride_token + th.head * p.q_stride_head + chunk * 8 : 0;
    cp_async_16(q_smem + swizzle(row, chunk), q + off, valid);
  }
}
