// Arguments of one decode launch, packed by jitattn/_kernel.py (DECODE_PARAMS: keep the two
// in sync; the binding's static_asserts pin the layout).
struct DecodeParams {
  const void* q;       // [num_qo_heads, HEAD_DIM], head stride q_stride_head
  const void* k;       // kv rows: element (token t, kv head h) at t * k_stride_token + h * k_stride_head
  const void* v;
  void* out;           // [num_qo_heads, HEAD_DIM] contiguous, dtype of q
  float* lse;          // [num_qo_heads], base 2; null when the caller did not ask for it
  float* partial_o;    // [num_chunks, num_qo_heads, HEAD_DIM] when num_chunks > 1
  float* partial_lse;  // [num_chunks, num_qo_heads]
  int64_t q_stride_head;
  int64_t k_stride_token, k_stride_head;
  int64_t v_stride_token, v_stride_head;
  int kv_begin, kv_end;  // rows taking part: the window [kv_begin, kv_end); kv_end = kv_len
  int num_kv_heads, group_size, num_group_tiles;
  int chunk_len, num_chunks;
  float q_scale;       // multiplies q: sm_scale*q_scale*k_scale*log2(e), or .../cap with a soft cap
  float cap_log2e;     // cap*log2(e) (soft cap only)
  float v_scale;       // multiplies the output
  double rope_turns0;  // RoPE: 1 / (rope_scale * 2 pi), dim 0's turns per position
  double rope_ratio;   // RoPE: rope_theta^(-2 / HEAD_DIM), one dim's frequency over the previous one's
  int device;
};
