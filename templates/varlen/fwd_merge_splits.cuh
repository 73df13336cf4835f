{# The split-KV combine kernel (included by kernels.cu.j2). #}
// Combine the splits of each row: o = sum_s w_s o_s / sum_s w_s, w_s = 2^(lse_s - max lse), in
// split order (deterministic). Same grid decoding as varlen_fwd (with one split), so rows outside
// every sequence are left alone, as varlen_fwd leaves them; blocks of one split wrote their rows
// themselves.
__global__ void __launch_bounds__(128) merge_splits(const VarlenParams p) {
  wait_for_prerequisite_grid();
  int bid = blockIdx.x;
  Work w;
  w.kv_head = bid % p.num_heads_kv;
  bid /= p.num_heads_kv;
  w.seq = bid % p.num_seqs;
  w.m0 = (bid / p.num_seqs) * BLOCK_M;
  int t_lo, t_hi;
  if (!block_extent(p, w, t_lo, t_hi) || w.splits == 1) return;
  for (int idx = threadIdx.x; idx < BLOCK_M * CHUNKS; idx += 128) {
    const int pr = w.m0 + idx / CHUNKS, chunk = idx % CHUNKS;
    if (pr < 0 || pr >= w.rows) continue;
    const TokenHead th = packed_row(pr, p.pack, w.q_start, w.kv_head);
    const int token = th.token, head = th.head;
    const float* lse_col = p.partial_lse + int64_t(head) * p.total_q + token;
    const int64_t lse_step = int64_t(p.num_heads_q) * p.total_q;
    float mx = -INFINITY;
    for (int s = 0; s < w.splits; ++s) mx = fmaxf(mx, lse_col[s * lse_step]);
    const float base = mx == -INFINITY ? 0.f : mx;
    float acc[8] = {}, total = 0.f;
    for (int s = 0; s < w.splits; ++s) {
      const float weight = fast_exp2(lse_col[s * lse_step] - base);
      total += weight;
      const float4* src = reinterpret_cast<const float4*>(
          p.partial_o + ((int64_t(s) * p.total_q + token) * p.num_heads_q + head) * HEAD_DIM + chunk * 8);
      const float4 x0 = src[0], x1 = src[1];
      acc[0] += weight * x0.x; acc[1] += weight * x0.y; acc[2] += weight * x0.z; acc[3] += weight * x0.w;
      acc[4] += weight * x1.x; acc[5] += weight * x1.y; acc[6] += weight * x1.z; acc[7] += weight * x1.w;
    }
    const float inv = mx == -INFINITY ? 0.f : 1.f / total;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] *= inv;
    T* out = static_cast<T*>(p.out) + token * p.out_stride_token + head * p.out_stride_head + chunk * 8;
    store_floats<T, 8>(out, acc);
    if (p.lse && chunk == 0) p.lse[int64_t(head) * p.total_q + token] = mx == -INFINITY ? -INFINITY : (base + log2f(total)) * LN2;
  }
}
