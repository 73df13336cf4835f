// The forward's math on a tile of scores in registers, between S = Q K^T and O += P V: the score
// hook, the mask and the online softmax (included by kernels.cu.j2). A thread holds
// s[mt][nt][e]: rows row0 + 16 mt + g (e < 2) and + 8 (e >= 2), keys col0 + 8 nt + 2 c + (e & 1)
// of its warp's tile (mma.sync's m16n8 C layout; wgmma's per warp too).
using ScoreTile = float[M_TILES][N_TILES][4];

// A KV_AFFINE score's origin for the keys of row block w: its first row's q_idx. The tile loop
// adds kv_slope * (kv_idx - origin), whose size stays that of the bias itself near the diagonal.
__device__ __forceinline__ int affine_origin(const VarlenParams& p, const Work& w) {
  return max(w.m0, 0) / p.pack + w.k_len - w.q_len;
}

// Row (head, token)'s lse2 (log2 units) with what a KV_AFFINE tile loop left out of its scores,
// the same for all its keys (so the softmax never needed it): score(0, ..., kv_idx = origin) x
// scale_log2. The backward's recomputed scores then match lse. Other scores: lse2 as it is.
__device__ __forceinline__ float full_lse2(const VarlenParams& p, const Work& w, int head, int token, float lse2,
                                           float scale_log2) {
  if constexpr (!ScoreMod::KV_AFFINE) return lse2;
  const float left_out = ScoreMod(p).score(0.f, w.seq, head, variant_q_idx(w, token), affine_origin(p, w));
  return fmaf(left_out, scale_log2, lse2);  // -inf (no visible key) stays -inf
}

// A KV_AFFINE score's per-row terms for a thread's rows of row block w (row0: its warp's first),
// read once per block rather than per key tile: each row's kv_slope (a read of a captured tensor
// for ALiBi) and the block's origin. Empty for other scores.
struct AffineRows {
  float slope[ScoreMod::KV_AFFINE ? M_TILES : 1][2];
  int origin;
};

__device__ __forceinline__ AffineRows affine_rows(const VarlenParams& p, const Work& w, int row0, int g) {
  AffineRows rows{};
  if constexpr (ScoreMod::KV_AFFINE) {
    const ScoreMod score_mod(p);
    rows.origin = affine_origin(p, w);
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const TokenHead th = packed_row(w.m0 + row0 + mt * 16 + h * 8 + g, p.pack, w.q_start, w.kv_head);
        rows.slope[mt][h] = score_mod.kv_slope(w.seq, th.head, variant_q_idx(w, th.token));
      }
  }
  return rows;
}

template <class Score>
__device__ __forceinline__ void score_whole_tile(const Score& score_mod, ScoreTile& s) {
  score_mod.score_all(reinterpret_cast<float(&)[M_TILES * N_TILES * 4]>(s));
}

// The score hook on every logit of the tile (keys from n0; rows from the block's m0; affine:
// affine_rows of the same rows).
__device__ __forceinline__ void score_tile(const VarlenParams& p, const Work& w, ScoreTile& s, int n0, int row0,
                                           int col0, int g, int c, const AffineRows& affine) {
  const ScoreMod score_mod(p);
  if constexpr (WarpTiles<ScoreMod>::value) {  // (its indices unused: a soft cap's)
    score_whole_tile(score_mod, s);
    return;
  }
  if constexpr (ScoreMod::KV_AFFINE) {
    // s + a * (kv_idx - origin), a per row: one FMA per logit; the column's offset is exact in
    // fp32 (positions < 2^22: the variant's calls check), one conversion per tile.
    const float base = float(n0 + col0 + 2 * c - affine.origin);
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
          for (int e = 2 * h; e < 2 * h + 2; ++e)
            s[mt][nt][e] = fmaf(base + float(nt * 8 + (e & 1)), affine.slope[mt][h], s[mt][nt][e]);
    return;
  }
  if constexpr (ScoreMod::PAIR_READS) {
    if (p.pack == 1) {  // a row is a token: q_idx = the thread's first + a constant per row
      const int q0 = variant_q_idx(w, w.q_start + w.m0 + row0 + g);
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            s[mt][nt][e] = score_mod.score(s[mt][nt][e], w.seq, w.kv_head, q0 + mt * 16 + (e / 2) * 8,
                                           n0 + col0 + nt * 8 + 2 * c + (e & 1));
      return;
    }
  }
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
    for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int pr = w.m0 + row0 + mt * 16 + (e / 2) * 8 + g;
        const int kv = n0 + col0 + nt * 8 + 2 * c + (e & 1);
        const TokenHead th = packed_row(pr, p.pack, w.q_start, w.kv_head);
        s[mt][nt][e] = score_mod.score(s[mt][nt][e], w.seq, th.head, variant_q_idx(w, th.token), kv);
      }
}

// Whether the mask hook hides part of key tile n0 of row block w (the tile then takes the mask).
__device__ __forceinline__ bool mask_hook_cuts(const VarlenParams& p, const Work& w, int n0) {
  if constexpr (!MaskMod::ACTIVE) return false;
  if (w.hook_first != MAP_UNKNOWN) return n0 < w.hook_first * BLOCK_N || n0 >= w.hook_end * BLOCK_N;
  const int off = w.k_len - w.q_len;
  const int q_lo = max(w.m0, 0) / p.pack + off, q_hi = (min(w.m0 + BLOCK_M, w.rows) - 1) / p.pack + off;
  return mask_mod_of(p).classify(w.seq, w.kv_head, q_lo, q_hi, n0, n0 + BLOCK_N - 1) != TILE_FULL;
}

// Hide (-inf) the logits the mask hides: the built-in rule (mask.cuh), then the mask hook, asked
// per element only on a tile it cuts (an edge tile of the window inside the hook's full run,
// e.g. the causal diagonal of a document, needs the window's compares alone).
__device__ __forceinline__ void mask_tile(const VarlenParams& p, const Work& w, ScoreTile& s, int n0, int row0,
                                          int col0, int g, int c) {
  const MaskMod mask_mod = mask_mod_of(p);
  const bool hook = mask_hook_cuts(p, w, n0);
  const int off = w.k_len - w.q_len;
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // Visible keys [lo, hi) of this thread's query row.
      const int pr = w.m0 + row0 + mt * 16 + h * 8 + g;
      const int r = pr / p.pack;
      const KeyRange keys = visible_keys(p, r, off, w.k_len);
#pragma unroll
      for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
        for (int e = 2 * h; e < 2 * h + 2; ++e) {
          const int col = n0 + col0 + nt * 8 + 2 * c + (e & 1);
          bool hidden = col < keys.lo || col >= keys.hi;
          // || and && here, not the backward's branch-free | and &: with those the document mask's
          // forward ran slower, though it compiled faster (notes/variants-h100.md, sixth session).
          if constexpr (MaskMod::ACTIVE)
            hidden = hidden ||
                     (hook && !mask_mod.visible(w.seq, packed_row(pr, p.pack, w.q_start, w.kv_head).head, r + off, col));
          if (hidden) s[mt][nt][e] = -INFINITY;
        }
    }
}


// The tiles [x, y) of w the mask hook leaves whole: the mask map's run, or interval analysis's
// first run (block_extent found both).
__device__ __forceinline__ int2 hook_full_run(const VarlenParams&, const Work& w) {
  return make_int2(w.hook_first, w.hook_end);
}

// Online softmax over the tile: new row maxima (over the quad that shares a row), exponentiate
// in place (P, unnormalized, log2 units), running sums; each row's rescale of O into scale_o,
// applied to O here unless RESCALE_O is false (OVERLAP: once O += P V let go of O).
template <bool RESCALE_O>
__device__ __forceinline__ void online_softmax(ScoreTile& s, float (&row_max)[M_TILES][2], float (&row_sum)[M_TILES][2],
                                               float (&o)[M_TILES][CHUNKS][4], float (&scale_o)[M_TILES][2], float sl2) {
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = row_max[mt][h];
#pragma unroll
      for (int nt = 0; nt < N_TILES; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float base = mx == -INFINITY ? 0.f : mx * sl2;  // all masked so far: keep zeros
      const float alpha = fast_exp2(row_max[mt][h] * sl2 - base);
      row_max[mt][h] = mx;
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
        for (int e = 2 * h; e < 2 * h + 2; ++e) {
          const float x = fmaf(s[mt][nt][e], sl2, -base);
          s[mt][nt][e] = nt % 4 < POLY_EXP2 ? poly_exp2(x) : fast_exp2(x);  // (nt is a constant here)
          sum += s[mt][nt][e];
        }
      row_sum[mt][h] = row_sum[mt][h] * alpha + sum;
      scale_o[mt][h] = alpha;
      if constexpr (RESCALE_O) {
#pragma unroll
        for (int d = 0; d < CHUNKS; ++d) {
          o[mt][d][2 * h] *= alpha;
          o[mt][d][2 * h + 1] *= alpha;
        }
      }
    }
}
