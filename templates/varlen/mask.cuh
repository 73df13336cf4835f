// The mask, shared by the forward and the backward (its dQ kernel too): the built-in rule and
// the mask hook.
//
// Built in: key c (from the sequence's first key) is visible from query row r iff
//   r + off - left <= c <= r + off + right and c < k_len,   off = k_len - q_len,
// windows aligned bottom-right, a negative edge unbounded (causal: right = 0); k_len is
// seqused_k when given, and a paged key behind a bad page id reads as zeros (the loads).
// Only tiles that straddle an edge are masked element by element: the schedulers classify tiles
// (the forward's mask_below / mask_above, the backward's QueryTile::masked).

// Visible keys [lo, hi) of query row r (the forward, the dQ kernel: rows are queries).
struct KeyRange {
  int lo, hi;
};
template <class Params>
__device__ __forceinline__ KeyRange visible_keys(const Params& p, int r, int off, int k_len) {
  return {p.window_left >= 0 ? r + off - p.window_left : INT_MIN,
          p.window_right >= 0 ? min(k_len, r + off + p.window_right + 1) : k_len};
}

// The packed query rows of work w that see key `key` (the backward: rows are keys): key in
// [r + off - left, r + off + right] with r = row / pack, so row in [(key - off - right) * pack,
// (key - off + left + 1) * pack - 1], within [0, rows) and none past the keys (first > last:
// none; first in [0, rows], last in [-1, rows - 1]).
struct RowSpan {
  int64_t first, last;
};

template <class Params, class AnyWork>
__device__ __forceinline__ RowSpan visible_rows(const Params& p, const AnyWork& w, int64_t key) {
  const int64_t off = int64_t(w.k_len) - w.q_len;
  RowSpan v;
  v.first = p.window_right >= 0 ? min(int64_t(w.rows), max(int64_t(0), (key - off - p.window_right) * p.pack)) : 0;
  const int64_t last = p.window_left >= 0 ? (key - off + p.window_left + 1) * p.pack - 1 : int64_t(w.rows) - 1;
  v.last = key < w.k_len ? max(int64_t(-1), min(last, int64_t(w.rows) - 1)) : -1;
  return v;
}

// The mask hook (where a user mask_mod plugs in): visible(b, h, q_idx, kv_idx) on top of the
// built-in rule, for sequence b, query head h, query q_idx and key kv_idx (both from the
// sequence's start; q_idx bottom-right aligned: hooks.cuh's variant_q_idx). It runs only on tiles
// that take the element-wise mask; classify() says of a tile, queries [q_lo, q_hi] x keys [kv_lo,
// kv_hi] of sequence b and KV head kv_head, whether the hook hides all of it (TILE_EMPTY), some
// (TILE_PARTIAL) or none (TILE_FULL). The schedulers drop the empty tiles at either end of a
// work item's range (the forward's block_extent, the backward's decode_work outside
// deterministic mode), so a causal or sliding-window mask_mod runs the built-in window's tiles;
// empty tiles inside the range are computed fully masked, and the mainloops mask the tiles it
// does not call full. A mask_mod that reads captured tensors (document ids) is classified by
// evaluating it on the device instead, per call, into a mask map (mask_map.cuh). NoMaskMod, the default, is inactive: every use of it compiles away.
enum TileClass { TILE_EMPTY, TILE_PARTIAL, TILE_FULL };

// The mask map's slots (mask_map.cuh), here because the schedulers read them (plain arithmetic,
// compiled on the host by the schedule tests too): unit `unit` (sequence-major: seq * units per
// sequence + the unit's index) of KV head kv_head, 4 ints each; one set per KV head when the
// map has map_heads > 1 (the mask reads h).
constexpr int MAP_UNKNOWN = INT_MIN;  // a Work's hook run when no map gives it (interval analysis does)

// The span of non-empty tiles and the longest run of full ones, over tiles classified in
// ascending order (a mask map's slot: mask_map.cuh).
struct TileRun {
  int first = INT_MAX, end = INT_MIN, full_first = 0, full_end = 0, run = -1;
  __device__ __forceinline__ void add(int t, TileClass c) {
    if (c != TILE_EMPTY) {
      first = min(first, t);
      end = t + 1;
    }
    if (c != TILE_FULL) {
      run = -1;
      return;
    }
    if (run < 0) run = t;
    if (t + 1 - run > full_end - full_first) {
      full_first = run;
      full_end = t + 1;
    }
  }
  // Into a slot; with no non-empty tile, an empty span at `none`.
  __device__ __forceinline__ void store(int* slot, int none) const {
    const bool any = first <= end;
    slot[0] = any ? first : none;
    slot[1] = any ? end : none;
    slot[2] = full_first;
    slot[3] = full_end;
  }
};

// Runs of tiles by interval analysis, with few classify calls: passes(x, y) says every tile of
// [x, y) passes (EMPTY, or FULL) by classifying the range as one box. Boxes shrink monotonically
// (a sub-box of an EMPTY box is EMPTY), so the longest passing prefix of [a, b) is bisected in
// log2 steps down to the last two tiles, then extended tile by tile where the one box was too
// coarse (what a per-tile scan found, for a causal or windowed mask in 5-6 calls instead of one
// per tile: the scan cost the sliding-window forward a tenth of its time; a short range takes
// one call per tile, as a capture read in classify costs a memory latency per call).
template <class Passes>
__device__ __forceinline__ int passing_prefix_end(int a, int b, Passes passes) {
  int lo = a, hi = b;  // [a, lo) passes; no prefix longer than hi - a was refuted... yet
  while (hi - lo > 2) {  // a few tiles: one call each (a capture read costs a memory latency per call)
    const int mid = lo + (hi - lo + 1) / 2;
    if (passes(a, mid)) lo = mid;
    else hi = mid - 1;
  }
  while (lo < b && passes(lo, lo + 1)) ++lo;
  return lo;
}
// The start of the longest passing suffix of [a, b) (the mirror image).
template <class Passes>
__device__ __forceinline__ int passing_suffix_begin(int a, int b, Passes passes) {
  int lo = a, hi = b;  // [hi, b) passes
  while (hi - lo > 2) {
    const int mid = lo + (hi - lo) / 2;
    if (passes(mid, b)) hi = mid;
    else lo = mid + 1;
  }
  while (hi > a && passes(hi - 1, hi)) --hi;
  return hi;
}
__device__ __forceinline__ int* mask_map_slot(int* map, int map_heads, int64_t unit, int kv_head) {
  return map + 4 * (unit * map_heads + (map_heads > 1 ? kv_head : 0));
}

struct NoMaskMod {
  static constexpr bool ACTIVE = false;
  static constexpr bool DATA_DEPENDENT = false;  // a mask_mod reading captured tensors: mask_map.cuh
  static constexpr bool USES_HEAD = false;
  template <class Params>
  __device__ __forceinline__ explicit NoMaskMod(const Params&) {}
  __device__ __forceinline__ bool visible(int, int, int, int) const { return true; }
  __device__ __forceinline__ TileClass classify(int, int, int, int, int, int) const { return TILE_FULL; }
  __device__ __forceinline__ TileClass classify_warp(int, int, int, int, int, int) const { return TILE_FULL; }
  // A mask_mod's reads of sequence b's own values, loaded with the CTA's metadata (fwd_schedule.cuh).
  struct Preloaded {};
  __device__ __forceinline__ Preloaded preload(int) const { return {}; }
  __device__ __forceinline__ TileClass classify(Preloaded, int, int, int, int, int, int) const { return TILE_FULL; }
};
