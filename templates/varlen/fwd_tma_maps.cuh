{# Host side: the tensor maps varlen_fwd's TMA copies and stores read (included by kernels.cu.j2). #}
// The tensor maps of K and V (see tma_kv_tile) and the rows of their box; 0 when TMA cannot
// read them (alignment, strides, pages under 8 rows or not back to back) and every tile takes
// cp.async. A 5-D map over (64 columns, tokens, D / 64 atoms 128 bytes apart, rows / 8 groups
// 8 tokens apart, heads) with box (64, 8, D / 64, rows / 8, 1) and the 128-byte swizzle writes
// exactly swizzle()'s order (8-row x 64-column 1024-byte atoms, a group's atoms side by side);
// the token and group dimensions overlap, so only full boxes inside a sequence are read (the
// kernel's TMA tiles). Rebuilt per call (two encodes on the host, no driver round trip).
int make_kv_maps(const VarlenParams& p, CUtensorMap (&maps)[2]) {
  const EncodeTiled encode = encode_tiled();
  if (!encode) return 0;
  const int64_t page = int64_t(1) << p.page_shift;
  // A box is 8 rows at least, and warp 0 holds the page ids of rows ROW_STEP apart only (16 at D64).
  if (PAGED && page < (ROW_STEP > 8 ? ROW_STEP : 8)) return 0;
  // Paged, a box stays inside a page: the largest power of two dividing BLOCK_N (a multiple of 16), at most the page.
  // (Should a driver refuse the overlapping dimensions of a box over several groups: 8 rows.)
  const int rows = PAGED ? static_cast<int>(std::min<int64_t>(BLOCK_N & -BLOCK_N, page)) : BLOCK_N;
  const uint64_t tokens = PAGED ? uint64_t(p.total_k) * page : uint64_t(p.total_k);
  const uint64_t heads = p.num_heads_kv;
  const CUtensorMapDataType type =
      std::is_same<T, __half>::value ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const cuuint32_t ones[5] = {1, 1, 1, 1, 1};
  int64_t ts[2], hs[2];
  for (int t = 0; t < 2; ++t) {
    const int64_t ps = t ? p.v_stride_page : p.k_stride_page;
    ts[t] = t ? p.v_stride_token : p.k_stride_token;
    hs[t] = heads == 1 ? HEAD_DIM : t ? p.v_stride_head : p.k_stride_head;
    if (reinterpret_cast<uintptr_t>(t ? p.v : p.k) % 16 || ts[t] <= 0 || hs[t] <= 0 || (ts[t] * sizeof(T)) % 16 ||
        (hs[t] * sizeof(T)) % 16 || (PAGED && ps != page * ts[t]) || tokens == 0 || tokens > (uint64_t(1) << 31))
      return 0;
  }
  auto make = [&](int box_rows) {
    for (int t = 0; t < 2; ++t) {
      const cuuint64_t dims[5] = {64, tokens, HEAD_DIM / 64, uint64_t(box_rows / 8), heads};
      const cuuint64_t strides[4] = {ts[t] * sizeof(T), 128, 8 * ts[t] * sizeof(T), hs[t] * sizeof(T)};
      const cuuint32_t box[5] = {64, 8, HEAD_DIM / 64, cuuint32_t(box_rows / 8), 1};
      if (encode(&maps[t], type, 5, const_cast<void*>(t ? p.v : p.k), dims, strides, box, ones,
                 CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                 CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
        return false;
    }
    return true;
  };
  return make(rows) ? rows : rows > 8 && make(8) ? 8 : 0;
}

// The tensor map of Q (or, `out`, of O) for the producer kernels: a 5-D map over (64 columns,
// pack query heads of a KV head, tokens, D / 64 atoms 128 bytes apart, KV heads) whose box (64,
// pack, 8 / pack, D / 64, 1) is one 8-row group of packed rows (row = token * pack + head) in
// swizzle()'s order. False (cp.async, or 16-byte stores) when pack does not divide 8 or the
// layout does not fit.
bool make_rows_map(const VarlenParams& p, CUtensorMap& map, bool out) {
  if (!PRODUCER || !ATOMS || 8 % p.pack != 0) return false;
  const EncodeTiled encode = encode_tiled();
  void* const base = out ? p.out : const_cast<void*>(p.q);
  // A single query head's stride is never used (and may be anything): any valid one will do.
  const int64_t e = sizeof(T), ts = out ? p.out_stride_token : p.q_stride_token;
  const int64_t hs = p.num_heads_q == 1 ? HEAD_DIM : out ? p.out_stride_head : p.q_stride_head;
  if (!encode || reinterpret_cast<uintptr_t>(base) % 16 || ts <= 0 || hs <= 0 || (ts * e) % 16 || (hs * e) % 16 ||
      p.total_q <= 0)
    return false;
  const CUtensorMapDataType type =
      std::is_same<T, __half>::value ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const cuuint64_t dims[5] = {64, uint64_t(p.pack), uint64_t(p.total_q), HEAD_DIM / 64, uint64_t(p.num_heads_kv)};
  const cuuint64_t strides[4] = {uint64_t(hs * e), uint64_t(ts * e), 128, uint64_t(hs * p.pack * e)};
  const cuuint32_t box[5] = {64, cuuint32_t(p.pack), cuuint32_t(8 / p.pack), HEAD_DIM / 64, 1};
  const cuuint32_t ones[5] = {1, 1, 1, 1, 1};
  return encode(&map, type, 5, base, dims, strides, box, ones, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

