{# varlen_fwd's producer warpgroup (PRODUCER): every K/V copy of the CTA's items, STAGES tiles
   ahead at most, handed to the compute warpgroups through the stage mbarriers. A fragment of
   varlen_fwd's body (included there): it ends the producer's threads with a return. #}
  if (warp >= WARPS) {  // the producer: every K/V copy of the block, STAGES tiles ahead at most
    named_barrier(PRODUCER_BAR, 128);  // every copier sees the barriers initialized
    named_barrier_arrive(INIT_BAR, THREADS);
    set_max_registers<PRODUCER_REGS, false>();
    const int loader = tid - WARPS * 32;
    // Each copier publishes its part of a tile once it landed, fenced for wgmma's (async
    // proxy) reads; the stage is full when all have. At most one tile is copied but not yet
    // published, and it is published before the producer blocks on a free stage: the warps
    // need it next. (Blocking with it in flight, two tiles in flight instead of one, delayed
    // it until the stage came free: notes/template-figures.md, "fwd_producer.cuh".)
    int unpublished = -1;
    auto publish = [&](auto landed) {
      if (unpublished < 0) return;
      landed();
      fence_proxy_async_shared();
      mbarrier_arrive(&full[unpublished % STAGES]);
{% if split_kv %}
      mbarrier_arrive(&full_v[unpublished % STAGES]);
{% endif %}
      unpublished = -1;
    };
{% if persistent %}
    if (loader == 0) {
      if (tma_rows != 0) {
        prefetch_map(&map_k);
        prefetch_map(&map_v);
      }
      if (q_by_tma) prefetch_map(&map_q);
    }
    const unsigned items = unsigned(p.num_m_blocks) * p.num_splits * p.num_seqs * p.num_heads_kv;
    unsigned ring = 0;  // tiles of the earlier items: the stage ring's place
    // Item after item (the loop's body is not indented: its tile loop is the one-item kernel's).
    // The first thread takes the items: the CTA's own index first, then the next untaken one
    // (work_counter), so the CTAs walk decode_work's heaviest-first order together, as a grid of
    // a CTA per item does (a fixed stride of gridDim.x, measured first, let them drift apart
    // over a causal batch: notes/forward-h200.md); the others read its slot.
    for (unsigned done = 0, item = blockIdx.x;; ++done) {
    Work w;
    const unsigned slot = done % ITEM_SLOTS;
    if (loader == 0) {
      bool have = false;
      for (; item < items && !(have = decode_work(p, w, item));)
        item = gridDim.x + atomicAdd(p.work_counter, 1);
      if (have) item = gridDim.x + atomicAdd(p.work_counter, 1);  // the next one, under this item
      if (done >= ITEM_SLOTS) mbarrier_wait(&item_empty[slot], free_parity<ITEM_SLOTS>(done));
      if (!have) w.seq = -1;  // no more items: every role stops there
      item_work[slot] = w;
      mbarrier_arrive(&item_full[slot]);  // (release: after the slot's writes)
    } else {
      mbarrier_wait(&item_full[slot], use_parity<ITEM_SLOTS>(done));
      w = item_work[slot];
    }
    __syncwarp();
    if (lane == 0) mbarrier_arrive(&item_empty[slot]);  // this warp has read the slot
    if (w.seq < 0) break;
    // The last item's last tile, if it came by cp.async, before any wait below: the compute
    // warps need it to reach their last S = Q K^T, which q_empty waits for.
    publish([] { cp_async_wait<0>(); });
    // The item's Q into each warpgroup's rows once that warpgroup's last S = Q K^T of the
    // previous item is done: by TMA, lanes 0..15 an 8-row group each (as the other schedule's
    // compute warps copy it), else by all 128 threads' cp.async.
    if (q_by_tma) {
      if (loader < 32) {
        const int wg = loader / 8, row = loader * 8, pr = w.m0 + row;  // pr: a multiple of pack
        if (loader < 8 * (WARPS / 4)) {
          if (done > 0) mbarrier_wait(&q_empty[wg], (done + 1) & 1);
          if (loader % 8 == 0) mbarrier_arrive_expect_tx(&q_full[wg], 64 * HEAD_DIM * sizeof(T));
        }
        __syncwarp();
        if (loader < 8 * (WARPS / 4))  // the token: exact, also below 0 (causal blocks' head)
          tma_load_5d(q_smem + row_base(row), &map_q, &q_full[wg], 0, 0, w.q_start + pr / p.pack, 0, w.kv_head);
      }
    } else {
      for (int i = 0; i < WARPS / 4 && done > 0; ++i) mbarrier_wait(&q_empty[i], (done + 1) & 1);
      load_q<128>(p, w, q_smem, loader, 0, BLOCK_M);
      cp_async_commit();
      cp_async_wait<0>();
      fence_proxy_async_shared();  // for wgmma's (async proxy) reads
      named_barrier(PRODUCER_BAR, 128);
      if (loader == 0)
        for (int i = 0; i < WARPS / 4; ++i) mbarrier_arrive(&q_full[i]);
    }
    const KvCursor cursor = make_kv_cursor(p, w, loader);
    PageIds pages, next_pages;
    const int tiles = w.tile_end - w.tile_begin;
    if (tiles > 0) fetch_page_ids(p, w, w.tile_begin, pages, loader);
{% else %}
    const KvCursor cursor = make_kv_cursor(p, w, loader);
    PageIds pages, next_pages;
    const int tiles = w.tile_end - w.tile_begin;
    if (tiles > 0) fetch_page_ids(p, w, w.tile_begin, pages, loader);
{% if uses_tma %}
    if (tma_rows != 0 && loader == 0) {
      prefetch_map(&map_k);
      prefetch_map(&map_v);
    }
{% endif %}
    constexpr int ring = 0;
{% endif %}
    for (int i = 0; i < tiles; ++i) {
      const int s = (ring + i) % STAGES;
      // The next tile's page ids, before this tile's copies, so they never queue behind them
      // (no measurable difference either way: notes/forward-tma.md).
      if (i + 1 < tiles) fetch_page_ids(p, w, w.tile_begin + i + 1, next_pages, loader);
      if (ring + i >= STAGES) {
        publish([] { cp_async_wait<0>(); });
        mbarrier_wait(&empty[s], free_parity<STAGES>(ring + i));  // the stage's previous tile is done (SPLIT_KV: its K)
      }
{% if uses_tma %}
      const int tile = w.tile_begin + i;
      bool by_tma = tma_rows != 0 && (tile + 1) * BLOCK_N <= w.k_len;
      if constexpr (PAGED)  // every warp holds ids of every page of the tile (pages >= 8 rows)
        by_tma = by_tma && __all_sync(0xffffffffu, loader % 32 >= RPW * LOAD_ITERS ||
                                                       static_cast<unsigned>(pages.id[0]) < static_cast<unsigned>(p.total_k));
      if (by_tma) {
{% if split_kv %}
        // K into the stage now, V once the stage's previous V is done (a tile after its K). No
        // wait here holds back a cp.async tile: it is published above before the first wait.
        if (loader < 32)
          tma_kv_tile<1>(map_k, map_v, tma_rows, p, w, tile, pages, k_smem + s * TILE_CHUNKS, v_smem + s * TILE_CHUNKS,
                         &full[s], loader);
        if (loader != 0) mbarrier_arrive(&full[s]);  // lane 0 arrived with the bytes
        if (ring + i >= STAGES) mbarrier_wait(&empty_v[s], free_parity<STAGES>(ring + i));
        if (loader < 32)
          tma_kv_tile<2>(map_k, map_v, tma_rows, p, w, tile, pages, k_smem + s * TILE_CHUNKS, v_smem + s * TILE_CHUNKS,
                         &full_v[s], loader);
        if (loader != 0) mbarrier_arrive(&full_v[s]);
{% else %}
        if (loader < 32)
          tma_kv_tile(map_k, map_v, tma_rows, p, w, tile, pages, k_smem + s * TILE_CHUNKS, v_smem + s * TILE_CHUNKS,
                      &full[s], loader);
{% endif %}
        cp_async_commit();  // an empty group, so wait<1> still means "all but this tile"
        publish([] { cp_async_wait<1>(); });
{% if not split_kv %}
        if (loader != 0) mbarrier_arrive(&full[s]);  // lane 0 arrived with the bytes
{% endif %}
        pages = next_pages;
        continue;
      }
{% endif %}
{% if split_kv %}
      if (ring + i >= STAGES) mbarrier_wait(&empty_v[s], free_parity<STAGES>(ring + i));  // cp.async copies K and V together
{% endif %}
      load_kv_tile(p, w, cursor, w.tile_begin + i, pages, k_smem + s * TILE_CHUNKS, v_smem + s * TILE_CHUNKS, loader);
      cp_async_commit();
      publish([] { cp_async_wait<1>(); });  // the previous tile, while this one's copies fly
      unpublished = ring + i;
      pages = next_pages;
    }
{% if persistent %}
      ring += tiles;
    }
{% endif %}
    publish([] { cp_async_wait<0>(); });
    return;
  }
