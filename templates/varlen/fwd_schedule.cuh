{# The forward's tile scheduler: a work item (row block x KV split) decoded heaviest first from
   a CTA's (or, persistent, a taken item's) index (included by kernels.cu.j2). #}
// What one CTA works on (PERSISTENT: one of its items), decoded from its index (decode_work).
struct Work {
  int kv_head, seq, split, m0;
  int q_start, rows, q_len;  // rows = q_len * pack (packed)
  int k_start, k_len;
  int splits;                // splits of this row block's keys (<= p.num_splits; see block_extent)
  int tile_begin, tile_end;  // this split's key tiles
  int mask_below, mask_above;  // tiles at n0 < mask_below or n0 + BLOCK_N > mask_above need a mask
  int hook_first, hook_end;    // tiles the mask hook leaves whole (the mask map's run, or interval analysis's)
};

// Row blocks come in bands of M_BAND (about 1024 query rows). Bands run heaviest first (the
// last rows see the most keys when causal, and only long sequences have high blocks); inside
// a band the blocks of one (sequence, KV head) are adjacent, so the CTAs that stream the same
// K/V run side by side and share it in L2 (KV head fastest instead re-read K/V from DRAM
// once per resident row block: notes/template-figures.md, "fwd_schedule.cuh"). Then KV
// heads, whose rows sit side by side in memory (one DRAM burst for a token's heads), then
// splits and sequences.
constexpr int M_BAND = 1024 / BLOCK_M > 1 ? 1024 / BLOCK_M : 1;

// The sequence of row block (w.seq, w.m0) and the key tiles [t_lo, t_hi) its rows' windows see;
// false when the block holds no row. Also how many splits the tiles are spread over: exactly
// num_splits when the caller asked for it, else (split_min_tiles > 0) at most num_splits (what
// the grid has room for) and no split shorter than split_min_tiles of the block's own tiles. So
// a sequence's reduction order follows its own lengths and window, never max_k's slack or how
// its keys are stored: paged and packed keys give the same bits. merge_splits asks here too, and
// the mask map's kernel (USE_MAP false: it builds the map from the tiles given here).
template <bool USE_MAP = true>
__device__ __forceinline__ bool block_extent(const VarlenParams& p, Work& w, int& t_lo, int& t_hi) {
  const int m_block = w.m0 / BLOCK_M;
  // Every metadata load first, so they share one memory latency: the key side's behind the
  // early return below cost a second one (clock stamps: notes/forward-h200.md).
  // With a mask hook, whose code follows that return, ptxas sank the key side's end below it, and
  // the hook's reads of the sequence's own values (whole[b]) came after both: two more latencies
  // per CTA, on one-tile sentences most of what the CTA waits for (SASS: notes/transformers-host.md,
  // tenth session). So there both are volatile loads, which stay where they are written.
  const MaskMod mask_mod = mask_mod_of(p);
  const MaskMod::Preloaded own = mask_mod.preload(w.seq);
  w.q_start = p.cu_seq_q[w.seq];
  const int q_end = p.cu_seq_q[w.seq + 1];
  const int used = p.seqused_k ? p.seqused_k[w.seq] : 0;
  const int k_start = PAGED ? 0 : p.cu_seq_k[w.seq];
  const int k_end = PAGED ? 0 : MaskMod::ACTIVE ? int(*static_cast<const volatile int*>(p.cu_seq_k + w.seq + 1))
                                                : int(p.cu_seq_k[w.seq + 1]);
  // Clamp to the tensors, so malformed metadata can never index outside them.
  w.q_len = max(0, min(q_end, p.total_q) - w.q_start);
  w.rows = w.q_len * p.pack;
  // With a right window edge (causal), row blocks end at the sequence's last row: the partial
  // block is then the first, whose rows see the fewest keys, instead of the last, which sees the
  // most (at 8 x 4k, D64's 192-row blocks run 363 block x key tiles instead of 384); a mask_mod
  // may be causal too. Its rows before 0 are zeros, never stored. It follows the sequence's own
  // rows only (batch invariant).
  if (p.window_right >= 0 || MaskMod::ACTIVE) w.m0 -= (BLOCK_M - w.rows % BLOCK_M) % BLOCK_M;
  if (w.m0 >= w.rows || w.q_start < 0) return false;
  w.k_start = k_start;
  if constexpr (PAGED) {
    w.k_len = used;
  } else {
    w.k_len = p.seqused_k ? used : k_end - k_start;
    w.k_len = k_start < 0 ? 0 : min(w.k_len, p.total_k - k_start);
  }
  w.k_len = max(0, w.k_len);
  // Key range of the block's rows [r_lo, r_hi].
  const int off = w.k_len - w.q_len;
  const int r_lo = max(w.m0, 0) / p.pack, r_hi = (min(w.m0 + BLOCK_M, w.rows) - 1) / p.pack;
  int k_lo = 0, k_hi = w.k_len;
  w.mask_below = INT_MIN;
  if (p.window_left >= 0) {
    k_lo = max(0, r_lo + off - p.window_left);
    w.mask_below = r_hi + off - p.window_left;
  }
  if (p.window_right >= 0) k_hi = max(0, min(w.k_len, r_hi + off + p.window_right + 1));
  w.mask_above = p.window_right >= 0 ? min(w.k_len, r_lo + off + p.window_right + 1) : w.k_len;
  t_lo = k_lo / BLOCK_N;
  t_hi = k_hi > k_lo ? (k_hi + BLOCK_N - 1) / BLOCK_N : t_lo;
  w.hook_first = w.hook_end = MAP_UNKNOWN;
  if (MaskMod::DATA_DEPENDENT && USE_MAP && p.mask_map) {  // the map's span and full run
    const int* slot = mask_map_slot(p.mask_map, p.mask_map_heads, int64_t(w.seq) * p.num_m_blocks + m_block, w.kv_head);
    t_lo = max(t_lo, slot[0]);
    t_hi = max(t_lo, min(t_hi, slot[1]));
    w.hook_first = slot[2];
    w.hook_end = slot[3];
  } else if constexpr (MaskMod::ACTIVE) {
    // By interval analysis: the mask hook's empty tiles at either end are never loaded, and its
    // first run of full tiles skips the element-wise mask (mask.cuh's bisection: few classify
    // calls, made once per work item: the persistent kernel's producer thread decodes).
    auto tiles_are = [&](TileClass c) {
      return [&, c](int a, int b) {
        return mask_mod.classify(own, w.seq, w.kv_head, r_lo + off, r_hi + off, a * BLOCK_N, b * BLOCK_N - 1) == c;
      };
    };
    // The whole range first: one call settles a mask that hides or shows all of it (a padded
    // sentence's few tiles: each call may read a capture, a memory latency).
    const TileClass all = t_lo < t_hi ? mask_mod.classify(own, w.seq, w.kv_head, r_lo + off, r_hi + off,
                                                          t_lo * BLOCK_N, t_hi * BLOCK_N - 1)
                                      : TILE_EMPTY;
    if (all == TILE_EMPTY) t_hi = t_lo;
    if (all != TILE_PARTIAL) {
      w.hook_first = t_lo;
      w.hook_end = t_hi;
    } else {
      t_lo = passing_prefix_end(t_lo, t_hi, tiles_are(TILE_EMPTY));
      t_hi = passing_suffix_begin(t_lo, t_hi, tiles_are(TILE_EMPTY));
      int first_full = t_lo;
      while (first_full < t_hi && !tiles_are(TILE_FULL)(first_full, first_full + 1)) ++first_full;
      w.hook_first = first_full;
      w.hook_end = passing_prefix_end(first_full, t_hi, tiles_are(TILE_FULL));
    }
  }
  w.splits = p.num_splits;
  if (p.split_min_tiles > 0)
    w.splits = max(1, min(p.num_splits, (t_hi - t_lo + p.split_min_tiles - 1) / p.split_min_tiles));
  return true;
}

__device__ __forceinline__ bool decode_work(const VarlenParams& p, Work& w, unsigned item) {
  const int per_block = p.num_seqs * p.num_heads_kv * p.num_splits;  // CTAs per row block
  const HeaviestFirst order = heaviest_first<M_BAND>(item, per_block, p.num_m_blocks);
  const int m_block = p.num_m_blocks - 1 - order.position;  // the last row blocks first
  int rest = order.rest;
  w.kv_head = rest % p.num_heads_kv;
  rest /= p.num_heads_kv;
  w.split = rest % p.num_splits;
  w.seq = rest / p.num_splits;
  w.m0 = m_block * BLOCK_M;
  int t_lo, t_hi;
  if (!block_extent(p, w, t_lo, t_hi) || w.split >= w.splits) return false;  // the grid's spare splits
  const int per_split = (t_hi - t_lo + w.splits - 1) / w.splits;
  w.tile_begin = min(t_hi, t_lo + w.split * per_split);
  w.tile_end = min(t_hi, w.tile_begin + per_split);
  return true;
}
{% if mask_map and unit == "mask_map.cu" %}

// The forward's mask map (mask_map.cuh): one CTA per (row block, sequence, KV head or 1), over the
// key tiles block_extent gives the block, before varlen_fwd (stream order).
__global__ void __launch_bounds__(MAP_THREADS) varlen_fwd_mask_map(const VarlenParams p) {
  const MapCta cta = map_cta(p.mask_map_heads, p.num_m_blocks);
  const int m_block = cta.unit;
  Work w;
  w.kv_head = cta.kv_head;
  w.seq = cta.seq;
  w.split = 0;
  w.m0 = m_block * BLOCK_M;
  int t_lo = 0, t_hi = 0;
  const bool any = block_extent<false>(p, w, t_lo, t_hi);
  const int pr_lo = max(w.m0, 0), pr_hi = any ? min(w.m0 + BLOCK_M, w.rows) - 1 : -1, k_len = any ? w.k_len : 0;
  map_unit(mask_mod_of(p), w.seq, w.kv_head, p.pack, any ? w.k_len - w.q_len : 0, t_lo, any ? t_hi : t_lo,
           [&](int t) { return make_int4(pr_lo, pr_hi, t * BLOCK_N, min(t * BLOCK_N + BLOCK_N, k_len)); },
           mask_map_slot(p.mask_map, p.mask_map_heads, int64_t(w.seq) * p.num_m_blocks + m_block, w.kv_head));
}
{% endif %}
