{# The mask map of a mask_mod that reads captured tensors, shared by the forward and the backward
   (included by kernels.cu.j2 and backward.cu.j2 after the hooks). #}
// A mask_mod that reads captured tensors (document ids, a per-sequence prefix) defeats the
// interval analysis of MaskMod::classify: it cannot see tensor values, so every tile would be
// partial, computed and masked element by element (8x Flex's time on document masks). Instead,
// before such a kernel, a small kernel evaluates the mask on the device, per call (no host read:
// CUDA graphs capture it), over each work unit's tiles: a unit is a row block and its key tiles
// (the forward, the dQ kernel) or a key tile and its query tiles (dK / dV). Its slot holds four
// ints:
//   {first, end, full_first, full_end}
// tiles of the unit outside [first, end) are empty for the hook (never loaded), those in
// [full_first, full_end) - the longest run of full tiles - skip the element-wise mask. Tiles in
// between are partial (or empty inside the span: computed fully masked, still correct). One slot
// per KV head when the mask reads h, else one for every head.
constexpr int MAP_THREADS = 512;  // 16 warps, a tile each: the map's CTAs are few (a unit each)

// The hook's class of one tile by evaluating it, by one warp: packed query rows [pr_lo, pr_hi]
// of KV head kv_head (row r = pr / pack of its sequence, q_idx r + off) against keys [k_lo, k_hi),
// at most BLOCK_N of them. A lane owns keys k_lo + lane + 32 i and walks the rows (the keys'
// loads stay in registers; a row's are one broadcast); a mask that ignores h runs once per token,
// not per packed row. Stops as soon as the warp saw a visible and a hidden pair.
__device__ __forceinline__ TileClass evaluate_tile(const MaskMod& mask_mod, int seq, int kv_head, int pack, int pr_lo,
                                                   int pr_hi, int off, int k_lo, int k_hi, int lane) {
  constexpr int KEYS_PER_LANE = (BLOCK_N + 31) / 32;
  bool visible = false, hidden = false;
  const int step = MaskMod::USES_HEAD ? 1 : pack;
  const int first = MaskMod::USES_HEAD ? pr_lo : pr_lo / pack * pack;
  int since_check = 0;
  for (int pr = first; pr <= pr_hi; pr += step) {
    const int r = pr / pack, head = kv_head * pack + (pr - r * pack);
#pragma unroll
    for (int i = 0; i < KEYS_PER_LANE; ++i) {
      const int key = k_lo + lane + 32 * i;
      if (key < k_hi) {
        const bool v = mask_mod.visible(seq, head, r + off, key);
        visible = visible || v;
        hidden = hidden || !v;
      }
    }
    if (++since_check == 8) {  // every 8 rows: done once the tile is known partial
      since_check = 0;
      if (__any_sync(0xffffffffu, visible) && __any_sync(0xffffffffu, hidden)) return TILE_PARTIAL;
    }
  }
  const bool any_visible = __any_sync(0xffffffffu, visible), any_hidden = __any_sync(0xffffffffu, hidden);
  return !any_visible ? TILE_EMPTY : any_hidden ? TILE_PARTIAL : TILE_FULL;
}

// A map kernel's CTA: its KV head (0 when one slot serves all), its unit within the sequence and
// its sequence (the grid: units per sequence x sequences x map heads, heads fastest).
struct MapCta {
  int kv_head, unit, seq;
};
__device__ __forceinline__ MapCta map_cta(int map_heads, int units_per_seq) {
  const int rest = blockIdx.x / map_heads;
  return {static_cast<int>(blockIdx.x % map_heads), rest % units_per_seq, rest / units_per_seq};
}

// One work unit's slot, by the whole CTA (MAP_THREADS): its tiles t in [t_lo, t_hi), each
// bounds(t) = {pr_lo, pr_hi, k_lo, k_hi} (packed rows inclusive, keys exclusive), classified by
// interval analysis where it is sure (exact for index arithmetic; classify_warp reads a capture
// over the tile's index range, so a tile inside one document or between two is sure too), else
// evaluated, a warp per tile; the span and the longest full run go into slot (an empty span at t_lo).
constexpr int MAP_WARPS = MAP_THREADS / 32, MAP_CHUNK = 256;
template <class Bounds>
__device__ __forceinline__ void map_unit(const MaskMod& mask_mod, int seq, int kv_head, int pack, int off, int t_lo,
                                         int t_hi, Bounds bounds, int* slot) {
  __shared__ unsigned char classes[MAP_CHUNK];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  TileRun run;
  for (int base = t_lo; base < t_hi; base += MAP_CHUNK) {
    const int count = min(MAP_CHUNK, t_hi - base);
    for (int i = warp; i < count; i += MAP_WARPS) {
      const int4 b = bounds(base + i);
      TileClass c = TILE_EMPTY;
      if (b.x <= b.y && b.z < b.w) {
        c = mask_mod.classify_warp(seq, kv_head, b.x / pack + off, b.y / pack + off, b.z, b.w - 1);
        if (c == TILE_PARTIAL) c = evaluate_tile(mask_mod, seq, kv_head, pack, b.x, b.y, off, b.z, b.w, lane);
      }
      if (lane == 0) classes[i] = static_cast<unsigned char>(c);
    }
    __syncthreads();
    if (threadIdx.x == 0)
      for (int i = 0; i < count; ++i) run.add(base + i, static_cast<TileClass>(classes[i]));
    __syncthreads();
  }
  if (threadIdx.x == 0) run.store(slot, t_lo);
}
