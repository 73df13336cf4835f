// The backward's schedule and window arithmetic, shared by its rungs (included by backward.cu.j2).
//
// One CTA per (key tile, KV head, sequence). blockIdx.x decodes heaviest first: key tiles are
// counted from the end of their sequence (j = n_tiles - 1 - n), and j runs from the largest
// down, so the first CTAs are the first key tiles of the longest sequences: with a causal
// mask those see the most query rows, and without one every tile of a long sequence is as
// heavy as any. j comes in bands of N_BAND; inside a band the tiles of one (sequence, KV
// head) are adjacent, so CTAs that stream the same Q and dO rows run side by side and share
// them in L2. Within one (sequence, KV head) a higher key tile has a higher block index.
//
// Deterministic mode orders each query tile's dQ additions by key tile, and a CTA only ever
// waits on CTAs with lower block indices (they start first: no deadlock). With a right window
// edge (causal, sliding, general windows) the walk of key tile n starts at the query tiles of
// its own keys, so a query tile is reached by the highest key tile first and by tile 0 last:
// the order there is descending (highest key tile adds first) and the key tiles of a
// (sequence, KV head) are laid out highest first too (j ascending). Ascending, it would run the
// tiles of a sequence as a wavefront, one tile behind the other (measured far slower:
// notes/backward-h200.md). Without a right edge every tile starts at query
// tile 0, and the order is ascending.
//
// Plain arithmetic on BwdParams (no device intrinsics), so tests compile it on the host too
// (tests/test_varlen_backward_schedule.py). The deterministic order's waits: backward_sync.cuh.
//
// Masks: the rule shared with the forward (mask.cuh).

struct Work {
  int seq, kv_head;
  int n_block, n0;            // this CTA's key tile and its first key
  int q_start, q_len, rows;   // rows = q_len * pack (packed)
  int k_start, k_len;
  int m_begin, m_end;         // query tiles (BLOCK_M packed rows) that see a key of the tile
  int n_tiles;                // key tiles of the sequence
  int t_first;                // lowest key tile of this (sequence, KV head) that has a CTA
  bool descending;            // deterministic dQ order: highest key tile first (see above)
  int hook_first, hook_end;   // query tiles the mask hook leaves whole (the mask map's), or MAP_UNKNOWN
};

constexpr int N_BAND = 2048 / BLOCK_N > 1 ? 2048 / BLOCK_N : 1;

// Keys of sequence `seq` the backward sees: seqused_k or the sequence's slots, clamped to the
// tensors (malformed metadata never indexes outside them).
__device__ __forceinline__ int key_len(const BwdParams& p, int seq) {
  const int k_start = p.cu_seq_k[seq];
  const int k_len = p.seqused_k ? p.seqused_k[seq] : p.cu_seq_k[seq + 1] - k_start;
  return k_start < 0 ? 0 : max(0, min(k_len, p.total_k - k_start));
}

// The lowest key tile of a sequence with n_tiles that has a CTA: 0 unless max_k is too small.
__device__ __forceinline__ int first_launched_tile(int n_tiles, const BwdParams& p) {
  return max(0, n_tiles - p.num_n_blocks);
}

template <bool USE_MAP = true>
__device__ __forceinline__ bool key_tile_work(const BwdParams& p, Work& w, int j);

// Work item `index` (a CTA's blockIdx.x, or an item a persistent CTA took).
__device__ __forceinline__ bool decode_work(const BwdParams& p, Work& w, unsigned index) {
  const int per_j = p.num_seqs * p.num_heads_kv;
  const int J = p.num_n_blocks;
  const HeaviestFirst order = heaviest_first<N_BAND>(index, per_j, J);
  const int position = order.position;  // in the order of j
  w.descending = p.semaphores != nullptr && p.window_right >= 0;
  const int j = w.descending ? position : J - 1 - position;
  int rest = order.rest;
  w.kv_head = rest % p.num_heads_kv;
  w.seq = rest / p.num_heads_kv;
  return key_tile_work(p, w, j);
}

// The rest of work item (w.seq, w.kv_head) at j (key tile n_tiles - 1 - j): false when the
// sequence has no such tile. The mask map's kernel calls it with USE_MAP false (it builds the
// map from the query tiles given here).
template <bool USE_MAP>
__device__ __forceinline__ bool key_tile_work(const BwdParams& p, Work& w, int j) {
  // Clamp to the tensors, so malformed metadata can never index outside them.
  w.q_start = p.cu_seq_q[w.seq];
  w.q_len = w.q_start < 0 ? 0 : max(0, min(p.cu_seq_q[w.seq + 1], p.total_q) - w.q_start);
  w.rows = w.q_len * p.pack;
  w.k_start = p.cu_seq_k[w.seq];
  w.k_len = key_len(p, w.seq);
  const int n_tiles = (w.k_len + BLOCK_N - 1) / BLOCK_N;
  w.n_tiles = n_tiles;
  w.n_block = n_tiles - 1 - j;
  if (w.n_block < 0) return false;
  w.t_first = first_launched_tile(n_tiles, p);
  w.n0 = w.n_block * BLOCK_N;
  // Query rows that see a key of [n0, n1): [r_min, r_max].
  const int64_t n1 = min(w.n0 + BLOCK_N, w.k_len);
  const int64_t off = int64_t(w.k_len) - w.q_len;
  const int64_t r_min = p.window_right >= 0 ? max(int64_t(0), w.n0 - off - p.window_right) : 0;
  const int64_t r_max = p.window_left >= 0 ? min(int64_t(w.q_len) - 1, n1 - 1 - off + p.window_left)
                                           : int64_t(w.q_len) - 1;
  if (r_min > r_max) {
    w.m_begin = w.m_end = 0;  // no query sees these keys: zero dK and dV
  } else {
    w.m_begin = static_cast<int>(r_min * p.pack / BLOCK_M);
    w.m_end = static_cast<int>(((r_max + 1) * p.pack - 1) / BLOCK_M) + 1;
  }
  // The mask hook's empty query tiles at either end are never loaded, outside deterministic mode
  // (whose dQ order counts every query tile the window gives a key tile: backward_sync.cuh).
  w.hook_first = w.hook_end = MAP_UNKNOWN;
  if (MaskMod::DATA_DEPENDENT && USE_MAP && p.mask_map) {  // the map's span and full run
    const int* slot = mask_map_slot(p.mask_map, p.mask_map_heads, int64_t(w.seq) * p.num_n_blocks + j, w.kv_head);
    if (p.semaphores == nullptr) {
      w.m_begin = max(w.m_begin, slot[0]);
      w.m_end = max(w.m_begin, min(w.m_end, slot[1]));
    }
    w.hook_first = slot[2];
    w.hook_end = slot[3];
  } else if constexpr (MaskMod::ACTIVE) {
    if (p.semaphores == nullptr) {  // by bisection (mask.cuh): a box of query tiles at a time
      const MaskMod mask_mod = mask_mod_of(p);
      auto empty = [&](int a, int b) {  // query tiles [a, b)
        const int r_first = a * BLOCK_M / p.pack, r_last = (min(b * BLOCK_M, w.rows) - 1) / p.pack;
        return mask_mod.classify(w.seq, w.kv_head, r_first + int(off), r_last + int(off), w.n0, w.n0 + BLOCK_N - 1) ==
               TILE_EMPTY;
      };
      if (w.m_begin < w.m_end && empty(w.m_begin, w.m_end)) {  // one call for a wholly hidden key tile
        w.m_end = w.m_begin;
      } else if (w.m_end - w.m_begin > 1) {
        w.m_begin = passing_prefix_end(w.m_begin, w.m_end, empty);
        w.m_end = passing_suffix_begin(w.m_begin, w.m_end, empty);
      }
    }
  }
  return true;
}

__device__ __forceinline__ bool decode_work(const BwdParams& p, Work& w) {
  return decode_work(p, w, blockIdx.x);
}

// The row of packed query row pr of work w (Work, or the dQ kernel's DqWork) in the preprocess's
// lse2 / delta and the dQ accumulator (KV head-major: each KV head's rows are the packed rows of
// every sequence).
template <class AnyWork>
__device__ __forceinline__ int64_t accum_row(const BwdParams& p, const AnyWork& w, int64_t pr) {
  return int64_t(w.kv_head) * p.dq_rows + int64_t(w.q_start) * p.pack + pr;
}

// Whether a CTA of the main kernel writes key token `token`'s dK / dV (every KV head): the token
// lies in its sequence's first key_len keys, at or above the lowest key tile that has a CTA. The
// preprocess zeroes the rows of every other token (before the first sequence, past the last, past
// seqused_k), so dk / dv need no zero fill.
__device__ __forceinline__ bool key_written(const BwdParams& p, int token) {
  const int* cu = p.cu_seq_k;
  if (p.num_seqs <= 0 || token < cu[0] || token >= cu[p.num_seqs]) return false;
  int s = 0, hi = p.num_seqs - 1;  // the last sequence starting at or before the token
  while (s < hi) {
    const int mid = (s + hi + 1) / 2;
    if (cu[mid] <= token) s = mid;
    else hi = mid - 1;
  }
  const int k_start = cu[s], k_len = key_len(p, s);
  const int t_first = first_launched_tile((k_len + BLOCK_N - 1) / BLOCK_N, p);
  return token >= k_start + t_first * BLOCK_N && token < k_start + k_len;
}

// What query tile m of work w needs: whether any (row, key) pair of the block is hidden (only
// such boundary blocks are masked element by element), and, for the deterministic dQ order,
// its turn: how many key tiles add to the query tile before this one (the active tiles below
// it, or above it when descending; the active key tiles of a query tile are contiguous).
struct QueryTile {
  bool masked;
  bool hook;  // the mask hook cuts the tile: its per-element test runs (else the window's alone)
  int turn;
};

__device__ __forceinline__ QueryTile query_tile(const BwdParams& p, const Work& w, int m) {
  const int pr0 = m * BLOCK_M, pr_last = min(pr0 + BLOCK_M, w.rows) - 1;  // the tile's packed rows
  const int off = w.k_len - w.q_len;
  QueryTile t;
  // Its rows r_lo = pr0 / pack and r_hi = pr_last / pack against the window, without dividing
  // (for a >= 0 and integer x: a / pack < x iff a < x * pack, a / pack > x iff a >= (x + 1) *
  // pack): a division by the run-time pack each tile showed in ncu's profile of a causal backward.
  t.masked = w.n0 + BLOCK_N > w.k_len ||
             (p.window_left >= 0 && pr_last >= (int64_t(w.n0) - off + p.window_left + 1) * p.pack) ||
             (p.window_right >= 0 && pr0 < (int64_t(w.n0) + BLOCK_N - 1 - off - p.window_right) * p.pack);
  t.hook = false;
  if constexpr (MaskMod::ACTIVE) {  // the mask hook (mask.cuh) cuts the tile: by the map, or classify
    if (w.hook_first != MAP_UNKNOWN)
      t.hook = m < w.hook_first || m >= w.hook_end;
    else
      t.hook = mask_mod_of(p).classify(w.seq, w.kv_head, pr0 / p.pack + off, pr_last / p.pack + off, w.n0,
                                       w.n0 + BLOCK_N - 1) != TILE_FULL;
    t.masked = t.masked || t.hook;
  }
  if (w.descending) {
    const int k_hi = min(w.k_len, pr_last / p.pack + off + p.window_right + 1);  // window_right >= 0 here
    t.turn = min(w.n_tiles - 1, (k_hi - 1) / BLOCK_N) - w.n_block;
  } else {
    const int k_lo = p.window_left >= 0 ? max(0, pr0 / p.pack + off - p.window_left) : 0;
    t.turn = w.n_block - max(k_lo / BLOCK_N, w.t_first);
  }
  return t;
}

// Deterministic dQ: CTAs add a query tile's dQ in ascending key-tile order. Each (KV head,
// query tile) has a counter of the key tiles that added; a CTA waits until it equals the
// number of tiles before its own, adds, then counts itself. Query tile m of sequence s is
// counter (q_start * pack) / BLOCK_M + s + m of its KV head: sequences never share one.
__device__ __forceinline__ int* dq_semaphore(const BwdParams& p, const Work& w, int m) {
  const int64_t index = int64_t(w.q_start) * p.pack / BLOCK_M + w.seq + m;
  if (index < 0 || index >= p.sem_stride) return nullptr;  // malformed metadata: no order, no hang
  return p.semaphores + int64_t(w.kv_head) * p.sem_stride + index;
}
