{# The lockstep kernel's prologue (no producer): Q and the first AHEAD K/V tiles, by cp.async
   or (decode) TMA. A fragment of varlen_fwd's body (included there). #}
  // Prologue: Q and the first AHEAD tiles, one commit group per tile (Q rides in the first).
  load_q<THREADS>(p, w, q_smem, tid, 0, BLOCK_M);
  const KvCursor cursor = make_kv_cursor(p, w, tid);
  TilePages pages;
  init_pages(p, w, pages);
{% if uses_tma %}
  // LOCKSTEP_TMA: full[s] completes once per tile of stage s, by its boxes' bytes or by thread
  // 0's plain arrival when the tile takes cp.async (full, sequence-end or bad-id tiles).
  __shared__ uint64_t full[STAGES];
  if (tid == 0)
    for (int s = 0; s < STAGES; ++s) mbarrier_init(&full[s], 1);
  // Tile t into stage s; ids_ok (the same in every thread): all its page ids are good.
  auto copy_tile = [&](int t, int s, bool ids_ok) {
    uint4* ks = k_smem + s * TILE_CHUNKS;
    uint4* vs = v_smem + s * TILE_CHUNKS;
    if (tma_rows != 0 && ids_ok && (t + 1) * BLOCK_N <= w.k_len) {
      if (tid == 0) tma_kv_tile_lockstep(map_k, map_v, tma_rows, p, w, t, pages, ks, vs, &full[s]);
      return;
    }
    if (tid == 0) mbarrier_arrive(&full[s]);
    load_kv_tile(p, w, cursor, t, pages, ks, vs, tid);
  };
{% endif %}
#pragma unroll
  for (int s = 0; s < AHEAD; ++s) {
    if (w.tile_begin + s < w.tile_end) {
      fetch_page_ids(p, w, w.tile_begin + s, pages, tid);
{% if uses_tma %}
      copy_tile(w.tile_begin + s, s, __syncthreads_and(page_ids_ok(p, pages)));  // also: full[] initialized
{% else %}
      load_kv_tile(p, w, cursor, w.tile_begin + s, pages, k_smem + s * TILE_CHUNKS, v_smem + s * TILE_CHUNKS, tid);
{% endif %}
    }
    cp_async_commit();
  }
  // From here on `pages` holds the ids of the next tile to copy.
  fetch_page_ids(p, w, w.tile_begin + AHEAD, pages, tid);
