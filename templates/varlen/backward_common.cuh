// Pieces both rungs of the backward's main kernel share (included by backward.cu.j2): the
// tile loads, the step from scores to gradients on MMA accumulators, the mask, the dQ
// atomics and the dK / dV epilogue.
//
// Accumulator fragments are mma.sync's m16n8 C layout (wgmma's too, per warp): tile t holds
// rows g and g + 8 (g = lane / 4) and columns 8t + 2c, 8t + 2c + 1 (c = lane % 4) in elements
// {0, 1} and {2, 3}. In S^T, dP^T, P^T and dS^T the rows are keys and the columns queries.

constexpr int ROW_CHUNKS = (CHUNKS + 7) / 8 * 8;  // shared row of K, V, Q, dO: whole swizzle groups

// 16-byte chunk `chunk` of row `row` of a tile with RC chunks a row, XOR-swizzled so the 8 rows
// one ldmatrix (or one wgmma core matrix) reads at the same column fall in distinct bank groups.
// RowSwizzle: rows one after the other (mma.sync rung). AtomSwizzle: the layout of wgmma's
// 128-byte swizzle, each 8 rows x 64 columns one 1024-byte atom, the atoms of an 8-row group
// side by side, then the next group (Hopper rung); for RC = 8 the two are the same.
template <int RC>
struct RowSwizzle {
  __device__ __forceinline__ static int at(int row, int chunk) { return row * RC + (chunk ^ (row & 7)); }
};
template <int RC>
struct AtomSwizzle {
  __device__ __forceinline__ static int at(int row, int chunk) {
    return (row / 8) * (RC * 8) + (chunk / 8) * 64 + (row % 8) * 8 + ((chunk % 8) ^ (row % 8));
  }
};

__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(gmem));
}

// The key tile's K and V (zero past the sequence's keys), `threads` threads.
template <typename Layout, int THREADS_>
__device__ __forceinline__ void load_kv(const BwdParams& p, const Work& w, uint4* k_smem, uint4* v_smem, int tid) {
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  for (int idx = tid; idx < BLOCK_N * CHUNKS; idx += THREADS_) {
    const int row = idx / CHUNKS, chunk = idx % CHUNKS;
    const int n = w.n0 + row;
    const bool valid = n < w.k_len;
    const int64_t token = valid ? int64_t(w.k_start) + n : 0;
    cp_async_16(k_smem + Layout::at(row, chunk), k + token * p.k_stride_token + w.kv_head * p.k_stride_head + chunk * 8,
                valid);
    cp_async_16(v_smem + Layout::at(row, chunk), v + token * p.v_stride_token + w.kv_head * p.v_stride_head + chunk * 8,
                valid);
  }
}

// A stage's per-row stats: lse2 and delta, and with a KV_AFFINE score (score.cuh) its slope:
// [STAT_ARRAYS][BLOCK_M] (affine_row_terms). One more array is all the D128 wgmma rung's shared
// memory has room for (80 bytes left with it, beside the static barriers).
constexpr int STAT_ARRAYS = ScoreMod::KV_AFFINE ? 3 : 2;

// A KV_AFFINE score's terms of packed row pr for the key tile at w.n0: its slope along the keys and
// its score at kv_idx = n0 with s = 0, both times scale_log2 (.x, .y). The row's logit at key
// n0 + j (log2 units) is then s * scale_log2 + slope2 * j + bias2: the stats hold slope2 in their
// third array and lse2 - bias2 in place of lse2, so that a recomputed probability costs two FMAs
// (affine_scores_to_probs) instead of the hook per element. The forward's split (fwd_softmax.cuh)
// with the key tile's first key as origin, so the terms stay the size of the bias near the tile.
__device__ __forceinline__ float2 affine_row_terms(const BwdParams& p, const Work& w, int pr) {
  const ScoreMod score_mod(p);
  const TokenHead th = packed_row(pr, p.pack, w.q_start, w.kv_head);
  const int q_idx = variant_q_idx(w, th.token);
  return make_float2(score_mod.kv_slope(w.seq, th.head, q_idx) * p.scale_log2,
                     score_mod.score(0.f, w.seq, th.head, q_idx, w.n0) * p.scale_log2);
}

// Query tile m's Q and dO rows (zero past the sequence) and its lse2 / delta (+inf / 0 past it,
// so those rows get P = 0 even where no mask runs): stats[row] and stats[BLOCK_M + row] (with a
// KV_AFFINE score, lse2 less the row's bias, read at once, and the slope: affine_row_terms).
template <typename Layout, int THREADS_>
__device__ __forceinline__ void load_query_tile(const BwdParams& p, const Work& w, int m, uint4* q_smem,
                                                uint4* do_smem, float* stats, int tid) {
  const T* q = static_cast<const T*>(p.q);
  const T* dout = static_cast<const T*>(p.dout);
  const int pr0 = m * BLOCK_M;
  for (int idx = tid; idx < BLOCK_M * CHUNKS; idx += THREADS_) {
    const int row = idx / CHUNKS, chunk = idx % CHUNKS;
    const int pr = pr0 + row;
    const bool valid = pr < w.rows;
    int64_t q_off = 0, do_off = 0;
    if (valid) {
      const TokenHead th = packed_row(pr, p.pack, w.q_start, w.kv_head);
      const int64_t token = th.token;
      const int head = th.head;
      q_off = token * p.q_stride_token + head * p.q_stride_head + chunk * 8;
      do_off = token * p.dout_stride_token + head * p.dout_stride_head + chunk * 8;
    }
    cp_async_16(q_smem + Layout::at(row, chunk), q + q_off, valid);
    cp_async_16(do_smem + Layout::at(row, chunk), dout + do_off, valid);
  }
  for (int row = tid; row < BLOCK_M; row += THREADS_) {
    const int pr = pr0 + row;
    if (pr < w.rows) {
      const int64_t at = accum_row(p, w, pr);
      if constexpr (ScoreMod::KV_AFFINE) {
        const float2 terms = affine_row_terms(p, w, pr);
        stats[row] = p.lse2[at] - terms.y;
        stats[2 * BLOCK_M + row] = terms.x;
      } else {
        cp_async_4(stats + row, p.lse2 + at);
      }
      cp_async_4(stats + BLOCK_M + row, p.delta + at);
    } else {
      stats[row] = INFINITY;
      stats[BLOCK_M + row] = 0.f;
      if constexpr (ScoreMod::KV_AFFINE) stats[2 * BLOCK_M + row] = 0.f;
    }
  }
}

// A thread's lse2 or delta values (shared memory): queries q0 + 8t + 2c and + 1 of its TILES
// column tiles, the columns of its S^T / dP^T accumulators.
template <int TILES>
__device__ __forceinline__ void load_row_stats(float2 (&v)[TILES], const float* stats, int q0, int c) {
#pragma unroll
  for (int t = 0; t < TILES; ++t) v[t] = *reinterpret_cast<const float2*>(stats + q0 + t * 8 + 2 * c);
}

// S^T -> P^T = exp2(S^T * scale_log2 - lse2) in place, for TILES tiles of queries q0 + 8t
// (l: load_row_stats of lse2).
template <int TILES>
__device__ __forceinline__ void scores_to_probs(float (&s)[TILES][4], const float2 (&l)[TILES], float sl2) {
#pragma unroll
  for (int t = 0; t < TILES; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[t][e] = fast_exp2(fmaf(s[t][e], sl2, -((e & 1) ? l[t].y : l[t].x)));
}

// With a KV_AFFINE score, S^T -> P^T in place from the stage's stats (lse2 less the row's bias,
// and its slope: affine_row_terms) for the thread's keys key0 + g and + 8 of the tile: two FMAs
// an element. The score's slope is 1 (score +- a bias), so dS^T is probs_to_dscores' as without a hook.
template <int TILES>
__device__ __forceinline__ void affine_scores_to_probs(float (&s)[TILES][4], const float* stats, int q0, int c,
                                                       int key0, int g, float sl2) {
  const float key[2] = {float(key0 + g), float(key0 + g + 8)};
#pragma unroll
  for (int t = 0; t < TILES; ++t) {
    const int col = q0 + t * 8 + 2 * c;
    const float2 shift = *reinterpret_cast<const float2*>(stats + col);  // +inf past the rows: P = 0
    const float2 slope2 = *reinterpret_cast<const float2*>(stats + 2 * BLOCK_M + col);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float a = (e & 1) ? slope2.y : slope2.x, b = (e & 1) ? shift.y : shift.x;
      s[t][e] = fast_exp2(fmaf(s[t][e], sl2, fmaf(a, key[e / 2], -b)));
    }
  }
}

// dP^T -> dS^T = P^T * (dP^T - delta) in place (d: load_row_stats of delta).
template <int TILES>
__device__ __forceinline__ void probs_to_dscores(const float (&pt)[TILES][4], float (&dp)[TILES][4],
                                                 const float2 (&d)[TILES]) {
#pragma unroll
  for (int t = 0; t < TILES; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) dp[t][e] = pt[t][e] * (dp[t][e] - ((e & 1) ? d[t].y : d[t].x));
}

// Element (t, e) of scored_probs_to_dscores from its score: P^T, then (DSCORES) dS^T times the
// hook's slope there (slope(): called only then).
template <bool DSCORES, int TILES, class Slope>
__device__ __forceinline__ void scored_element(float (&s)[TILES][4], float (&dp)[TILES][4], const float2 (&l)[TILES],
                                               const float2 (&d)[TILES], float sl2, int t, int e, float score,
                                               Slope slope) {
  s[t][e] = fast_exp2(fmaf(score, sl2, -((e & 1) ? l[t].y : l[t].x)));
  if constexpr (DSCORES) dp[t][e] = s[t][e] * (dp[t][e] - ((e & 1) ? d[t].y : d[t].x)) * slope();
}

// scored_probs_to_dscores for a hook that scores a whole tile (WarpTiles: the soft cap with
// poly_tanh), whose score and slope read no index: the scores by score_all, each the value
// score() gives it, so P^T matches the forward's lse.
template <bool DSCORES, class Score, int TILES>
__device__ __forceinline__ void scored_tile_to_dscores(const Score& score_mod, float (&s)[TILES][4],
                                                       float (&dp)[TILES][4], const float2 (&l)[TILES],
                                                       const float2 (&d)[TILES], float sl2) {
  float score[TILES][4];
#pragma unroll
  for (int t = 0; t < TILES; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) score[t][e] = s[t][e];
  score_mod.score_all(reinterpret_cast<float(&)[TILES * 4]>(score));
#pragma unroll
  for (int t = 0; t < TILES; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float raw = s[t][e], th = score[t][e];
      scored_element<DSCORES>(s, dp, l, d, sl2, t, e, th, [&] { return score_mod.dscore(raw, th, 0, 0, 0, 0); });
    }
}

// With the score hook (ScoreMod, score.cuh: the soft cap), S^T and dP^T -> P^T and dS^T in
// place in one pass: P^T from the hook's score, dS^T times its slope dscore (scale is applied to
// dQ and dK later), so the score is needed at both steps and never stored. Element (t, e): key
// key0 + g (+ 8 for e >= 2) of the key tile, packed row m * BLOCK_M + q0 + 8 t + 2 c + (e & 1).
// DSCORES = false: P^T alone (dp and d untouched), for a UNIT_SLOPE hook whose dS^T is then
// probs_to_dscores' as without one (EARLY_UNIT_SLOPE_PROBS).
template <bool DSCORES = true, int TILES>
__device__ __forceinline__ void scored_probs_to_dscores(const BwdParams& p, const Work& w, int m, int key0, int q0,
                                                        int g, int c, float (&s)[TILES][4], float (&dp)[TILES][4],
                                                        const float2 (&l)[TILES], const float2 (&d)[TILES],
                                                        float sl2) {
  const ScoreMod score_mod(p);
  if constexpr (WarpTiles<ScoreMod>::value) {  // the soft cap's tanh, a tile at once (score.cuh)
    scored_tile_to_dscores<DSCORES>(score_mod, s, dp, l, d, sl2);
    return;
  }
  // Element (t, e) of query head `head` and position q_idx: P^T, then dS^T times the hook's slope.
  auto element = [&](int t, int e, int head, int q_idx) {
    const int kv = w.n0 + key0 + g + 8 * (e / 2);
    const float raw = s[t][e];
    const float score = score_mod.score(raw, w.seq, head, q_idx, kv);
    scored_element<DSCORES>(s, dp, l, d, sl2, t, e, score,
                            [&] { return score_mod.dscore(raw, score, w.seq, head, q_idx, kv); });
  };
  // The thread's query columns, base + 8 t and base + 8 t + 1, stepped rather than divided by
  // pack per element (a user score_mod reads their token and head).
  const int base = m * BLOCK_M + q0 + 2 * c;
  if constexpr (ScoreMod::PAIR_READS) {
    if (p.pack == 1) {  // a column is a token: q_idx = the thread's first + a constant (score.cuh)
      const int q_first = variant_q_idx(w, w.q_start + base);
#pragma unroll
      for (int t = 0; t < TILES; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) element(t, e, w.kv_head, q_first + 8 * t + (e & 1));
      return;
    }
  }
  PackedRow<8> even(p.pack, w.q_start, base), odd(p.pack, w.q_start, base + 1);
#pragma unroll
  for (int t = 0; t < TILES; ++t) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const PackedRow<8>& col = (e & 1) ? odd : even;
      element(t, e, w.kv_head * p.pack + col.head, variant_q_idx(w, col.token));
    }
    even.advance(p.pack);
    odd.advance(p.pack);
  }
}

// Zero P^T and dS^T where the (key, query) pair is hidden (mask.cuh): past the sequence's rows
// or keys, outside the window, or by the mask hook (asked per element only when `hook`: the tile's
// QueryTile says the hook cuts it). Only boundary tiles run it. Each of the thread's two keys sees one
// interval of packed rows (visible_rows), so an element costs two compares against its
// compile-time column offset, instead of a division by pack for each of the thread's query columns.
// pt and ds may be one array: the wgmma rung masks P^T alone, before dS^T is computed from it.
template <int TILES>
__device__ __forceinline__ void mask_hidden(const BwdParams& p, const Work& w, int m, int key0, int q0, int g, int c,
                                            bool hook, float (&pt)[TILES][4], float (&ds)[TILES][4]) {
  const int base = m * BLOCK_M + q0 + 2 * c;  // element (t, e)'s packed row: base + 8 t + (e & 1)
  int lo[2], hi[2];                           // visible rows of keys g and g + 8, less base
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const RowSpan v = visible_rows(p, w, w.n0 + key0 + g + 8 * h);
    lo[h] = static_cast<int>(v.first - base);
    hi[h] = static_cast<int>(v.last - base);
  }
  // With the mask hook: the thread's query columns stepped, not divided per element (as above).
  PackedRow<8> even(p.pack, w.q_start, base), odd(p.pack, w.q_start, base + 1);
#pragma unroll
  for (int t = 0; t < TILES; ++t) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int d = 8 * t + (e & 1);
      bool hidden = d < lo[e / 2] || d > hi[e / 2];
      if constexpr (MaskMod::ACTIVE) {  // the mask hook (mask.cuh)
        const PackedRow<8>& col = (e & 1) ? odd : even;
        // | and &: the reads are safe at any index (variant.cuh), and short-circuits cost a branch
        // and unshared reads per element: a slower compile, no faster run (notes/variants-h100.md).
        hidden = hidden | (hook & !mask_mod_of(p).visible(w.seq, w.kv_head * p.pack + col.head,
                                                             variant_q_idx(w, col.token), w.n0 + key0 + g + 8 * (e / 2)));
      }
      if (hidden) pt[t][e] = ds[t][e] = 0.f;
    }
    if constexpr (MaskMod::ACTIVE) {
      even.advance(p.pack);
      odd.advance(p.pack);
    }
  }
}

// The A fragment (m16n8k16) of k-step kk from accumulator tiles 2kk and 2kk + 1, rounded to T.
template <int TILES>
__device__ __forceinline__ void a_fragment(uint32_t (&a)[4], const float (&acc)[TILES][4], int kk) {
  a[0] = pack2<T>(acc[2 * kk][0], acc[2 * kk][1]);
  a[1] = pack2<T>(acc[2 * kk][2], acc[2 * kk][3]);
  a[2] = pack2<T>(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
  a[3] = pack2<T>(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
}

// Add one n8 tile of dQ (this thread: rows g and g + 8, columns 2c, 2c + 1) into the fp32
// accumulator rows `row_g` / `row_g8` (nullptr: outside the sequence). On sm_90 lanes c and
// c ^ 1 first swap halves so each adds four adjacent floats with one vector atomic.
__device__ __forceinline__ void add_dq(float* row_g, float* row_g8, const float (&acc)[4], int c) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const bool odd = c & 1;
  const float y0 = __shfl_xor_sync(0xffffffffu, odd ? acc[0] : acc[2], 1);
  const float y1 = __shfl_xor_sync(0xffffffffu, odd ? acc[1] : acc[3], 1);
  if (!odd) {
    if (row_g) atomicAdd(reinterpret_cast<float4*>(row_g + 2 * c), make_float4(acc[0], acc[1], y0, y1));
  } else {
    if (row_g8) atomicAdd(reinterpret_cast<float4*>(row_g8 + 2 * c - 2), make_float4(y0, y1, acc[2], acc[3]));
  }
#else
  if (row_g) {
    atomicAdd(row_g + 2 * c, acc[0]);
    atomicAdd(row_g + 2 * c + 1, acc[1]);
  }
  if (row_g8) {
    atomicAdd(row_g8 + 2 * c, acc[2]);
    atomicAdd(row_g8 + 2 * c + 1, acc[3]);
  }
#endif
}

// The dQ accumulator's row of packed row pr of query tile m's sequence, or nullptr past it.
__device__ __forceinline__ float* dq_row(const BwdParams& p, const Work& w, int pr) {
  if (pr >= w.rows) return nullptr;
  return p.dq_accum + accum_row(p, w, pr) * HEAD_DIM;
}

// Epilogue, first half: dK (times scale) and dV as T into shared memory (`staging`: 2 * BLOCK_N
// rows of ROW_CHUNKS chunks, dK's then dV's, laid out by Layout::at(row, chunk)). Each thread
// passes its TILES accumulator tiles of dK and dV (rows key0 + g (+ 8)) and the head_dim chunk
// of each (chunk_of(t) < 0: none).
template <typename Layout, int TILES, typename ChunkOf>
__device__ __forceinline__ void stage_dk_dv(const BwdParams& p, const float (&dk)[TILES][4], const float (&dv)[TILES][4],
                                            int key0, int g, int c, ChunkOf chunk_of, uint4* staging) {
  uint32_t* dk32 = reinterpret_cast<uint32_t*>(staging);
  uint32_t* dv32 = dk32 + BLOCK_N * ROW_CHUNKS * 4;
#pragma unroll
  for (int t = 0; t < TILES; ++t) {
    const int chunk = chunk_of(t);
    if (chunk < 0) continue;
    dk32[Layout::at(key0 + g, chunk) * 4 + c] = pack2<T>(dk[t][0] * p.scale, dk[t][1] * p.scale);
    dk32[Layout::at(key0 + g + 8, chunk) * 4 + c] = pack2<T>(dk[t][2] * p.scale, dk[t][3] * p.scale);
    dv32[Layout::at(key0 + g, chunk) * 4 + c] = pack2<T>(dv[t][0], dv[t][1]);
    dv32[Layout::at(key0 + g + 8, chunk) * 4 + c] = pack2<T>(dv[t][2], dv[t][3]);
  }
}

// Epilogue, second half: staged rows [row_begin, BLOCK_N) as 16-byte stores onto the keys of the
// sequence (rows past it skipped), `threads` threads from thread `tid`.
template <typename Layout>
__device__ __forceinline__ void copy_dk_dv(const BwdParams& p, const Work& w, const uint4* staging, int row_begin,
                                           int tid, int threads) {
  const uint4* dk_rows = staging;
  const uint4* dv_rows = staging + BLOCK_N * ROW_CHUNKS;
  for (int idx = row_begin * CHUNKS + tid; idx < BLOCK_N * CHUNKS; idx += threads) {
    const int row = idx / CHUNKS, chunk = idx % CHUNKS;
    const int n = w.n0 + row;
    if (n >= w.k_len) continue;
    const int64_t token = int64_t(w.k_start) + n;
    *reinterpret_cast<uint4*>(static_cast<T*>(p.dk) + token * p.dk_stride_token + w.kv_head * p.dk_stride_head +
                              chunk * 8) = dk_rows[Layout::at(row, chunk)];
    *reinterpret_cast<uint4*>(static_cast<T*>(p.dv) + token * p.dv_stride_token + w.kv_head * p.dv_stride_head +
                              chunk * 8) = dv_rows[Layout::at(row, chunk)];
  }
}

// Epilogue: both halves through `staging` (free now, row-swizzled: conflict-free writes), all
// THREADS_ threads (tid < THREADS_) copying after `sync()`, a barrier among exactly them.
template <int TILES, int THREADS_, typename ChunkOf, typename Sync>
__device__ __forceinline__ void store_dk_dv(const BwdParams& p, const Work& w, const float (&dk)[TILES][4],
                                            const float (&dv)[TILES][4], int key0, int g, int c, ChunkOf chunk_of,
                                            uint4* staging, int tid, Sync sync) {
  using Rows = RowSwizzle<ROW_CHUNKS>;
  stage_dk_dv<Rows>(p, dk, dv, key0, g, c, chunk_of, staging);
  sync();
  copy_dk_dv<Rows>(p, w, staging, 0, tid, THREADS_);
}
