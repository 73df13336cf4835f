// Arguments of one varlen backward launch; filled by the binding, read by the three kernels.
// Packed rows, as in the forward: the query rows of one KV head's GQA group are (token, head)
// pairs, packed row pr = token * pack + (query head within the group). The workspace keeps
// them in that order per KV head, so a CTA's rows are contiguous there:
//   row index of (kv_head, token, h) = kv_head * dq_rows + token * pack + h, dq_rows = T_q * pack.
struct BwdParams {
  const void* q;              // (T_q, H_q, D)
  const void* k;              // (T_k, H_kv, D)
  const void* v;
  const void* out;            // forward output (T_q, H_q, D)
  const void* dout;           // gradient of out (T_q, H_q, D)
  const float* lse;           // (H_q, T_q) natural log, as the forward returned it
  const float* dlse;          // gradient of lse (H_q, T_q), or nullptr
  void* dq;                   // (T_q, H_q, D), dtype of q
  void* dk;                   // (T_k, H_kv, D); rows no CTA writes get zeros from the preprocess
  void* dv;
  float* dq_accum;            // workspace (H_kv, dq_rows, D) fp32: zeroed by the preprocess
  float* lse2;                // workspace (H_kv, dq_rows): lse in log2 units, +inf for lse = -inf
  float* delta;               // workspace (H_kv, dq_rows): rowsum(dO * O) - dlse
  int* semaphores;            // deterministic: (H_kv, sem_stride) ints, zeroed; else nullptr
  int* work_counter;         // persistent main kernel: work items taken past the grid (zeroed by the preprocess), or nullptr
  int* mask_map;              // a mask_mod reading captures: (sequence, key tile j, KV head or 1) slots (mask_map.cuh)
  int mask_map_heads;         // the map's slots per key tile: num_heads_kv when the mask reads h, else 1
  const int* cu_seq_q;        // (N + 1,)
  const int* cu_seq_k;        // (N + 1,)
  const int* seqused_k;       // (N,) or nullptr
  int64_t q_stride_token, q_stride_head;
  int64_t k_stride_token, k_stride_head;
  int64_t v_stride_token, v_stride_head;
  int64_t out_stride_token, out_stride_head;
  int64_t dout_stride_token, dout_stride_head;
  int64_t lse_stride_head, lse_stride_token;
  int64_t dlse_stride_head, dlse_stride_token;
  int64_t dq_stride_token, dq_stride_head;
  int64_t dk_stride_token, dk_stride_head;
  int64_t dv_stride_token, dv_stride_head;
  int64_t dq_rows;            // T_q * pack
  int num_seqs, num_heads_q, num_heads_kv, total_q, total_k;
  int pack;                   // H_q / H_kv
  int num_n_blocks;           // key tiles per (sequence, KV head) in the grid: ceil(max_k / BLOCK_N)
  int sem_stride;             // semaphores per KV head: T_q * pack / BLOCK_M + N + 1
  int window_left, window_right;  // -1: unbounded on that side (clamped to 2^30 by the host)
  float scale;                // softmax scale (dQ and dK are scaled by it)
  float scale_log2;           // scale * log2(e); with a soft cap, cap * log2(e)
  float cap_scale;            // soft cap: the factor of s in tanh's argument (score.cuh's SoftCapScore)
  int device;
#if JITATTN_CAPTURES > 0  // the variants' captured tensors (hooks.cuh; capture.h)
  jitattn_variant::Capture captures[JITATTN_CAPTURES];
#endif
};
