{# The wgmma backward's kernel argument (params and tensor maps) and its host-side encoding
   (included by backward_wgmma.cuh). #}
// The main kernel's argument: with PRODUCER the tensor maps of Q and dO, (D, pack, H_kv, T_q)
// with the strides of the tensors, boxes of 64 x pack x 1 x BLOCK_M / pack (tma: whether they
// were encoded; else the loader warp copies with cp.async).
struct BwdMain {
  BwdParams p;
  CUtensorMap q_map, do_map;
  CUtensorMap dk_map, dv_map;  // PERSISTENT: (D, H_kv, T_k), boxes of 64 x 1 x 8 rows
  int tma;
  int tma_store;  // dk_map / dv_map encoded (else the storer warp copies with 16-byte stores)
  int items;  // work items: key tiles x KV heads x sequences (the grid's size unless PERSISTENT)
{% if persistent %}
  // PERSISTENT: K / V as 5-D maps (64 columns x 8 tokens x D / 64 atoms x BLOCK_N / 8 groups x
  // KV head: a box lands in Tiles' order), for the loader's one-thread copies of whole key tiles.
  CUtensorMap k_map, v_map;
  int tma_kv;  // both encoded (else, and for a sequence's partial last tile, the loader's cp.async)
{% endif %}
};

// The host side of BwdMain: encodes the maps where the shape allows.
inline BwdMain main_kernel_args(const BwdParams& p) {
  BwdMain a;
  a.p = p;
  a.tma = 0;
  a.items = p.num_n_blocks * p.num_seqs * p.num_heads_kv;  // <= INT_MAX: launch_varlen_bwd checks
  if (!PRODUCER) return a;
  const EncodeTiled encode = encode_tiled();
  const int64_t e = sizeof(T);
  auto encode_map = [&](CUtensorMap* map, const void* base, int64_t stride_token, int64_t stride_head) {
    const bool fits = BLOCK_M % p.pack == 0 && reinterpret_cast<uintptr_t>(base) % 16 == 0 &&
                      (stride_token * e) % 16 == 0 && (stride_head * e) % 16 == 0 && stride_head > 0;
    if (!encode || !fits) return false;
    const cuuint64_t dims[4] = {cuuint64_t(HEAD_DIM), cuuint64_t(p.pack), cuuint64_t(p.num_heads_kv),
                                cuuint64_t(p.total_q)};
    const cuuint64_t strides[3] = {cuuint64_t(stride_head * e), cuuint64_t(stride_head * p.pack * e),
                                   cuuint64_t(stride_token * e)};
    const cuuint32_t box[4] = {64, cuuint32_t(p.pack), 1, cuuint32_t(BLOCK_M / p.pack)};
    const cuuint32_t unit[4] = {1, 1, 1, 1};
    return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, const_cast<void*>(base), dims, strides, box, unit,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
  };
  a.tma = encode_map(&a.q_map, p.q, p.q_stride_token, p.q_stride_head) &&
          encode_map(&a.do_map, p.dout, p.dout_stride_token, p.dout_stride_head);
  a.tma_store = 0;
  if (!PERSISTENT) return a;
  auto encode_out = [&](CUtensorMap* map, void* base, int64_t stride_token, int64_t stride_head) {
    const bool fits = reinterpret_cast<uintptr_t>(base) % 16 == 0 && (stride_token * e) % 16 == 0 &&
                      (stride_head * e) % 16 == 0 && stride_head > 0 && p.total_k > 0;
    if (!encode || !fits) return false;
    const cuuint64_t dims[3] = {cuuint64_t(HEAD_DIM), cuuint64_t(p.num_heads_kv), cuuint64_t(p.total_k)};
    const cuuint64_t strides[2] = {cuuint64_t(stride_head * e), cuuint64_t(stride_token * e)};
    const cuuint32_t box[3] = {64, 1, 8};
    const cuuint32_t unit[3] = {1, 1, 1};
    return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 3, base, dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                  CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
  };
  a.tma_store = encode_out(&a.dk_map, p.dk, p.dk_stride_token, p.dk_stride_head) &&
                encode_out(&a.dv_map, p.dv, p.dv_stride_token, p.dv_stride_head);
{% if persistent %}
  // Only whole key tiles go by these maps: a box's 8-token groups step past dims[1], which
  // bounds the first token only, so a tile must lie inside its sequence's keys.
  auto encode_kv = [&](CUtensorMap* map, const void* base, int64_t stride_token, int64_t stride_head) {
    if (p.num_heads_kv == 1) stride_head = HEAD_DIM;  // unused, but must be a valid stride
    const bool fits = reinterpret_cast<uintptr_t>(base) % 16 == 0 && stride_token > 0 && stride_head > 0 &&
                      (stride_token * e) % 16 == 0 && (stride_head * e) % 16 == 0 && p.total_k > 0;
    if (!encode || !fits) return false;
    const cuuint64_t dims[5] = {64, cuuint64_t(p.total_k), HEAD_DIM / 64, BLOCK_N / 8, cuuint64_t(p.num_heads_kv)};
    const cuuint64_t strides[4] = {cuuint64_t(stride_token * e), 128, cuuint64_t(8 * stride_token * e),
                                   cuuint64_t(stride_head * e)};
    const cuuint32_t box[5] = {64, 8, HEAD_DIM / 64, BLOCK_N / 8, 1};
    const cuuint32_t unit5[5] = {1, 1, 1, 1, 1};
    return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 5, const_cast<void*>(base), dims, strides, box, unit5,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
  };
  a.tma_kv = encode_kv(&a.k_map, p.k, p.k_stride_token, p.k_stride_head) &&
             encode_kv(&a.v_map, p.v, p.v_stride_token, p.v_stride_head);
{% endif %}
  return a;
}
