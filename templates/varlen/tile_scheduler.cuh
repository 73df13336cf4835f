// The tile scheduler's order, shared by the forward (row blocks) and the backward (key tiles):
// work items are numbered heaviest first along one axis (`positions`: the forward's row blocks
// from the last, the backward's key tiles from the sequence's end), in bands of BAND positions;
// inside a band the positions of one (sequence, KV head) are adjacent, so CTAs that stream the
// same K/V (forward) or Q/dO (backward) run side by side and share it in L2.

struct HeaviestFirst {
  int position;  // along the heavy axis, 0 = the heaviest
  int rest;      // the item's index among the per_position items of its position
};

// Item `index` of positions x per_position items.
template <int BAND>
__device__ __forceinline__ HeaviestFirst heaviest_first(unsigned index, int per_position, int positions) {
  const int band = index / (per_position * BAND);  // bands before the last are full
  const int rest = index - band * per_position * BAND;
  const int band_positions = min(BAND, positions - band * BAND);
  return {band * BAND + rest % band_positions, rest / band_positions};
}
