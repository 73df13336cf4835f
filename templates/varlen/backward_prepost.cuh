// The backward's preprocess and postprocess kernels (included by backward.cu.j2), one thread
// per 16-byte chunk of a (token, head) row.

// Threads per row in the preprocess: CHUNKS rounded up to a power of two (the row's dot
// product is reduced with xor shuffles inside those lanes).
constexpr int PRE_LANES = CHUNKS <= 1 ? 1 : CHUNKS <= 2 ? 2 : CHUNKS <= 4 ? 4 : CHUNKS <= 8 ? 8 : CHUNKS <= 16 ? 16 : 32;
constexpr int PRE_THREADS = 256;
constexpr int PRE_ROWS = PRE_THREADS / PRE_LANES;  // rows per CTA
static_assert(CHUNKS <= 32, "a row's chunks fit one warp");

__device__ __forceinline__ int64_t packed_row(const BwdParams& p, int token, int head) {
  const int kv_head = head / p.pack;
  return int64_t(kv_head) * p.dq_rows + int64_t(token) * p.pack + (head - kv_head * p.pack);
}

// The CTAs of the preprocess past pre_row_ctas zero the dK / dV rows of the key tokens no CTA of
// the main kernel writes (key_written), a warp per token: dk / dv come from torch.empty.
constexpr int ZERO_TOKENS = PRE_THREADS / 32;  // key tokens per CTA
__host__ __device__ inline int64_t pre_row_ctas(const BwdParams& p) {
  return (int64_t(p.total_q) * p.num_heads_q + PRE_ROWS - 1) / PRE_ROWS;
}
inline int64_t pre_ctas(const BwdParams& p) {
  return pre_row_ctas(p) + (int64_t(p.total_k) + ZERO_TOKENS - 1) / ZERO_TOKENS;
}

__device__ __forceinline__ void zero_unwritten_keys(const BwdParams& p, int64_t cta) {
  const int token = static_cast<int>(cta * ZERO_TOKENS + threadIdx.x / 32), lane = threadIdx.x % 32;
  if (token >= p.total_k || key_written(p, token)) return;
  const float zeros[8] = {};
  for (int i = lane; i < p.num_heads_kv * CHUNKS; i += 32) {
    const int head = i / CHUNKS, chunk = i - head * CHUNKS;
    store_floats<T, 8>(static_cast<T*>(p.dk) + token * p.dk_stride_token + head * p.dk_stride_head + chunk * 8, zeros);
    store_floats<T, 8>(static_cast<T*>(p.dv) + token * p.dv_stride_token + head * p.dv_stride_head + chunk * 8, zeros);
  }
}

// delta = rowsum(dO * O) - dlse, lse2 = lse * log2(e) (+inf where lse = -inf: P = 0 there),
// and the row's dQ accumulator zeroed. Every (token, head) of the tensors, in or out of a
// sequence (rows outside every sequence are never read by the main kernel, and their dQ
// comes out zero). The CTAs after those rows' zero dK / dV rows (zero_unwritten_keys).
__global__ void __launch_bounds__(PRE_THREADS) varlen_bwd_pre(const BwdParams p) {
  allow_dependent_launch();  // the main kernel waits for this grid before reading its results
  if (p.work_counter && blockIdx.x == 0 && threadIdx.x == 0) *p.work_counter = 0;
  const int64_t row_ctas = pre_row_ctas(p);
  if (blockIdx.x >= row_ctas) {
    zero_unwritten_keys(p, blockIdx.x - row_ctas);
    return;
  }
  const int row = blockIdx.x * PRE_ROWS + threadIdx.x / PRE_LANES;
  const int part = threadIdx.x % PRE_LANES;
  const bool valid = row < p.total_q * p.num_heads_q;
  const int token = valid ? row / p.num_heads_q : 0, head = valid ? row - token * p.num_heads_q : 0;
  float dot = 0.f;
  if (valid && part < CHUNKS) {
    float o[8], d[8];
    load_floats<T, 8>(static_cast<const T*>(p.out) + token * p.out_stride_token + head * p.out_stride_head + part * 8, o);
    load_floats<T, 8>(static_cast<const T*>(p.dout) + token * p.dout_stride_token + head * p.dout_stride_head + part * 8, d);
#pragma unroll
    for (int e = 0; e < 8; ++e) dot = fmaf(o[e], d[e], dot);
  }
#pragma unroll
  for (int width = PRE_LANES / 2; width > 0; width /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, width);
  if (!valid) return;
  const int64_t prow = packed_row(p, token, head);
{% if dq_kernel %}
  // No accumulator: varlen_bwd_dq writes the dq rows of every sequence, this the others' zeros
  // (tokens before cu_seq_q[0] or from cu_seq_q[N] on).
  if (part < CHUNKS && (token < p.cu_seq_q[0] || token >= p.cu_seq_q[p.num_seqs])) {
    const float zeros[8] = {};
    store_floats<T, 8>(static_cast<T*>(p.dq) + token * p.dq_stride_token + head * p.dq_stride_head + part * 8, zeros);
  }
{% else %}
  if (part < CHUNKS) {
    float4* acc = reinterpret_cast<float4*>(p.dq_accum + prow * HEAD_DIM + part * 8);
    acc[0] = make_float4(0.f, 0.f, 0.f, 0.f);
    acc[1] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
{% endif %}
  if (part == 0) {
    const float lse = p.lse[head * p.lse_stride_head + token * p.lse_stride_token];
    const float dlse = p.dlse ? p.dlse[head * p.dlse_stride_head + token * p.dlse_stride_token] : 0.f;
    p.delta[prow] = dot - dlse;
    p.lse2[prow] = lse == -INFINITY ? INFINITY : lse * LOG2E;
  }
}

{% if not dq_kernel %}
// Row `row` = token * H_q + head of a (T_q, H_q, D) tensor: its token and head, by a 32-bit
// division where every row fits (a 64-bit one is a long software sequence).
__device__ __forceinline__ void token_head(const BwdParams& p, int64_t row, int& token, int& head) {
  const bool narrow = int64_t(p.total_q) * p.num_heads_q <= int64_t(UINT_MAX);
  token = static_cast<int>(narrow ? int64_t(unsigned(row) / unsigned(p.num_heads_q)) : row / p.num_heads_q);
  head = static_cast<int>(row - int64_t(token) * p.num_heads_q);
}

// dQ = scale * accumulator, in q's dtype, for every (token, head) (DQ_SWIZZLE: its float4s
// permuted within the row, as the main kernel's bulk add left them). A thread converts
// POST_UNROLL 16-byte chunks of dq, POST_THREADS apart, all its loads issued before its first
// store (more bytes in flight per thread: the kernel is a stream).
constexpr int POST_THREADS = 256, POST_UNROLL = 4;
inline int64_t post_ctas(const BwdParams& p) {
  const int64_t chunks = int64_t(p.total_q) * p.num_heads_q * CHUNKS;
  return (chunks + POST_THREADS * POST_UNROLL - 1) / (POST_THREADS * POST_UNROLL);
}

__global__ void __launch_bounds__(POST_THREADS) varlen_bwd_post(const BwdParams p) {
  wait_for_prerequisite_grid();
  const int64_t rows = int64_t(p.total_q) * p.num_heads_q;
  const int64_t first = int64_t(blockIdx.x) * (POST_THREADS * POST_UNROLL) + threadIdx.x;
  float4 lo[POST_UNROLL], hi[POST_UNROLL];
  T* dst[POST_UNROLL];
#pragma unroll
  for (int u = 0; u < POST_UNROLL; ++u) {
    const int64_t idx = first + u * POST_THREADS;
    dst[u] = nullptr;
    if (idx >= rows * CHUNKS) continue;
    const int64_t row = idx / CHUNKS;
    const int chunk = static_cast<int>(idx - row * CHUNKS);
    int token, head;
    token_head(p, row, token, head);
    const int64_t prow = packed_row(p, token, head);
    const float4* src = reinterpret_cast<const float4*>(p.dq_accum + prow * HEAD_DIM);
    const int x = DQ_SWIZZLE ? static_cast<int>(prow & 7) : 0;  // float4 f of the row sits at f ^ x
    lo[u] = src[(2 * chunk) ^ x];
    hi[u] = src[(2 * chunk + 1) ^ x];
    dst[u] = static_cast<T*>(p.dq) + token * p.dq_stride_token + head * p.dq_stride_head + chunk * 8;
  }
#pragma unroll
  for (int u = 0; u < POST_UNROLL; ++u) {
    if (!dst[u]) continue;
    const float vals[8] = {lo[u].x * p.scale, lo[u].y * p.scale, lo[u].z * p.scale, lo[u].w * p.scale,
                           hi[u].x * p.scale, hi[u].y * p.scale, hi[u].z * p.scale, hi[u].w * p.scale};
    store_floats<T, 8>(dst[u], vals);
  }
}
{% endif %}
{% if mask_map %}

// The dK / dV kernel's mask map (mask_map.cuh): one CTA per (key tile j, sequence, KV head or 1),
// over the query tiles key_tile_work gives it, before the preprocess (stream order).
__global__ void __launch_bounds__(MAP_THREADS) varlen_bwd_mask_map(const BwdParams p) {
  const MapCta cta = map_cta(p.mask_map_heads, p.num_n_blocks);
  const int j = cta.unit;
  Work w;
  w.kv_head = cta.kv_head;
  w.seq = cta.seq;
  w.descending = false;
  const bool any = key_tile_work<false>(p, w, j);
  const int rows = any ? w.rows : 0, n0 = any ? w.n0 : 0, k_hi = any ? min(w.n0 + BLOCK_N, w.k_len) : 0;
  map_unit(mask_mod_of(p), w.seq, w.kv_head, p.pack, any ? w.k_len - w.q_len : 0, any ? w.m_begin : 0,
           any ? w.m_end : 0,
           [&](int m) { return make_int4(m * BLOCK_M, min((m + 1) * BLOCK_M, rows) - 1, n0, k_hi); },
           mask_map_slot(p.mask_map, p.mask_map_heads, int64_t(w.seq) * p.num_n_blocks + j, w.kv_head));
}
{% endif %}
