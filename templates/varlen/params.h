// Arguments of one varlen launch; filled by the binding, read by the kernels.
// Packed rows: a CTA's query rows are (token, head) pairs of one KV head's GQA group, row
// pr = token * pack + (query head within the group), so one K/V tile serves the whole group.
struct VarlenParams {
  const void* q;              // (T_q, H_q, D): element at token * q_stride_token + head * q_stride_head
  const void* k;              // (T_k, H_kv, D), or a page pool (pages, page_size, H_kv, D)
  const void* v;
  void* out;                  // (T_q, H_q, D), dtype of q
  float* lse;                 // (H_q, T_q) natural log, or nullptr
  float* partial_o;           // (num_splits, T_q, H_q, D) fp32 when num_splits > 1
  float* partial_lse;         // (num_splits, H_q, T_q), log2 units
  const int* cu_seq_q;        // (N + 1,)
  const int* cu_seq_k;        // (N + 1,), nullptr when paged
  const int* seqused_k;       // (N,) or nullptr
  const int* block_table;     // (N, max_pages) when paged
  int* bad_page;              // debug: {flag, sequence, logical page} of an out-of-range page id
  int* work_counter;          // persistent kernels: items taken past each CTA's first (zeroed per call)
  int* mask_map;              // a mask_mod reading captures: (sequence, row block, KV head or 1) slots (mask_map.cuh)
  int mask_map_heads;         // the map's slots per row block: num_heads_kv when the mask reads h, else 1
  int64_t q_stride_token, q_stride_head;
  int64_t out_stride_token, out_stride_head;
  int64_t k_stride_page, k_stride_token, k_stride_head;  // unpaged: k_stride_page unused
  int64_t v_stride_page, v_stride_token, v_stride_head;
  int64_t block_table_stride;
  int num_seqs, num_heads_q, num_heads_kv, total_q, total_k;  // total_k: T_k, or pages when paged
  int pack;                   // query heads per KV head packed into a CTA's rows (the GQA group)
  int num_m_blocks;           // row blocks per (sequence, KV head): ceil(max_q * pack / BLOCK_M)
  int num_splits;             // KV splits per row block in the grid (>1: fp32 partials, then merge_splits)
  int split_min_tiles;        // 0: every block takes num_splits; else the automatic split: a block takes
                              // at most num_splits, none shorter than this many of its own key tiles
  int window_left, window_right;  // -1: unbounded on that side
  int page_shift, page_mask;  // page_size = 1 << page_shift
  float scale_log2;           // softmax scale * log2(e); with a soft cap, cap * log2(e)
  float cap_scale;            // soft cap: the factor of s in tanh's argument (score.cuh's SoftCapScore)
  float scale;                // softmax scale, natural units (a user score_mod sees scale * q.k)
  int device;
#if JITATTN_CAPTURES > 0  // the variants' captured tensors (hooks.cuh; capture.h)
  jitattn_variant::Capture captures[JITATTN_CAPTURES];
#endif
};
