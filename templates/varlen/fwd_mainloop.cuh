{# varlen_fwd's mainloop step: one K/V tile of the consumer warps (wait for the stage; S = Q K^T;
   score hook; mask; online softmax; O += P V). A fragment of varlen_fwd's body (included there). #}
  const float sl2 = p.scale_log2;
  // One tile of the main loop. MASK says at compile time whether the tile needs the mask
  // (MASK_EDGE), not (MASK_NONE), or to check (MASK_CHECK).
  auto step = [&](const int tile, auto mask_mode) {
    constexpr int MASK = decltype(mask_mode)::value;
    const int stage = (ring + tile - w.tile_begin) % STAGES;
{% if has_producer %}
    mbarrier_wait(&full[stage], use_parity<STAGES>(ring + tile - w.tile_begin));
{% else %}
    cp_async_wait<AHEAD - 1>();
{% if wgmma %}
    fence_proxy_async_shared();  // the copies, before wgmma reads them
{% endif %}
{% if uses_tma %}
    mbarrier_wait(&full[stage], use_parity<STAGES>(ring + tile - w.tile_begin));
    // As below, and whether the next tile's page ids (in `pages`) are all good.
    const bool ids_ok = __syncthreads_and(page_ids_ok(p, pages));
{% else %}
    __syncthreads();  // tile's data visible to all; the stage refilled below is free
{% endif %}
    {
      const int next = tile + AHEAD;
      const int next_stage = (next - w.tile_begin) % STAGES;
      if (next < w.tile_end) {
{% if uses_tma %}
        copy_tile(next, next_stage, ids_ok);
{% else %}
        load_kv_tile(p, w, cursor, next, pages, k_smem + next_stage * TILE_CHUNKS, v_smem + next_stage * TILE_CHUNKS, tid);
{% endif %}
        if (next + 1 < w.tile_end) fetch_page_ids(p, w, next + 1, pages, tid);
      }
      cp_async_commit();
    }
{% endif %}
{% if not wgmma %}
    const uint4* ks = k_smem + stage * TILE_CHUNKS;
    const uint4* vs = v_smem + stage * TILE_CHUNKS;
{% endif %}

    // S = Q K^T for this warp's rows and keys.
    float s[M_TILES][N_TILES][4];
{% if wgmma %}
    {
      float(&acc)[N_TILES * 4] = reinterpret_cast<float(&)[N_TILES * 4]>(s);
{% if pingpong or overlap %}
      if constexpr (PINGPONG) named_barrier(PINGPONG_BAR + wg, 256);  // our turn
{% endif %}
      wgmma_fence();
      Wgmma<T, BLOCK_N>::ss<0, 0>(acc, q_desc, k_desc + stage * TILE_CHUNKS);
#pragma unroll
      for (int kt = 1; kt < HEAD_DIM / 16; ++kt)
        Wgmma<T, BLOCK_N>::ss<1, 0>(acc, q_desc + k_step(kt), k_desc + stage * TILE_CHUNKS + k_step(kt));
      wgmma_commit();
{% if pingpong or overlap %}
      // Then the other warpgroup's turn. OVERLAP waits for S alone (the older group): O += P V
      // runs on under the softmax. (ptxas serializes every wgmma, C7514, unless OVERLAP's
      // branches each hand over the turn and the plain wait stays outside any branch.)
      if constexpr (OVERLAP) {
        if (tile > w.tile_begin) {
          issue_pv((ring + tile - 1 - w.tile_begin) % STAGES);
          if constexpr (PINGPONG) named_barrier_arrive(PINGPONG_BAR + 1 - wg, 256);
          wgmma_wait<1>();
        } else {
          if constexpr (PINGPONG) named_barrier_arrive(PINGPONG_BAR + 1 - wg, 256);
          wgmma_wait<0>();
        }
      } else {
        if (tile > w.tile_begin) issue_pv((ring + tile - 1 - w.tile_begin) % STAGES);
        if constexpr (PINGPONG) named_barrier_arrive(PINGPONG_BAR + 1 - wg, 256);
        wgmma_wait<0>();
        wgmma_pin(reinterpret_cast<float(&)[CHUNKS * 4]>(o));
      }
{% else %}
      wgmma_wait<0>();
{% endif %}
      wgmma_pin(acc);
{% if has_producer %}
{% if split_kv %}
      // S is done with this tile's K (PERSISTENT: but an item's last K stage holds its O), and
      // the previous tile's O += P V with its V.
      if (lane == 0) {
        if (!PERSISTENT || tile != w.tile_end - 1) mbarrier_arrive(&empty[stage]);
        if (tile > w.tile_begin) mbarrier_arrive(&empty_v[(ring + tile - 1 - w.tile_begin) % STAGES]);
      }
{% else %}
      // The previous tile's O += P V finished with it: its stage is free.
      if (!OVERLAP && tile > w.tile_begin && lane == 0) mbarrier_arrive(&empty[(ring + tile - 1 - w.tile_begin) % STAGES]);
{% endif %}
{% if persistent %}
      if (tile == w.tile_end - 1 && lane == 0) mbarrier_arrive(&q_empty[warp / 4]);  // the item's last S: Q is free
      if (tile == w.tile_begin) release_staging();  // the last item's stores have read their stage by now
{% endif %}
{% endif %}
    }
{% else %}
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
#pragma unroll
    for (int kt = 0; kt < HEAD_DIM / 16; ++kt) {
      uint32_t a[M_TILES][4];
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt)
        ldmatrix_x4(a[mt], q_smem + q_frag[kt % 4] + mt * 16 * ROW_CHUNKS + (kt / 4) * CHUNK8_STEP);
#pragma unroll
      for (int np = 0; np < N_TILES / 2; ++np) {
        uint32_t b[4];
        ldmatrix_x4(b, ks + k_frag[kt % 4] + np * 16 * ROW_CHUNKS + (kt / 4) * CHUNK8_STEP);
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
          mma_16x8x16<T>(s[mt][2 * np], a[mt], b[0], b[1]);
          mma_16x8x16<T>(s[mt][2 * np + 1], a[mt], b[2], b[3]);
        }
      }
    }
{% endif %}

    // The score hook (the soft cap, or nothing), the mask on the tiles that straddle a window
    // edge or the end of the keys (or that the mask hook cuts), the online softmax.
    const int n0 = tile * BLOCK_N;
    const int row0 = warp_m * M_TILES * 16, col0 = warp_n * WARP_N;
    if constexpr (ScoreMod::ACTIVE) score_tile(p, w, s, n0, row0, col0, g, c, affine);
    if (MASK == MASK_EDGE ||
        (MASK == MASK_CHECK && (n0 < w.mask_below || n0 + BLOCK_N > w.mask_above || mask_hook_cuts(p, w, n0))))
      mask_tile(p, w, s, n0, row0, col0, g, c);
    float scale_o[M_TILES][2];  // OVERLAP: each row's rescale of O, once O += P V let go of it
    online_softmax<!OVERLAP>(s, row_max, row_sum, o, scale_o, sl2);
{% if overlap %}
    // The previous tile's O += P V is done: O and P's registers and its stage are free.
    wgmma_wait<0>();
    wgmma_pin(reinterpret_cast<float(&)[CHUNKS * 4]>(o));
#pragma unroll
    for (int kk = 0; kk < N_TILES / 2; ++kk)
#pragma unroll
      for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(p_frag[kk][i])::"memory");
    if (tile > w.tile_begin && lane == 0) mbarrier_arrive(&empty[(ring + tile - 1 - w.tile_begin) % STAGES]);
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int d = 0; d < CHUNKS; ++d)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[mt][d][e] *= scale_o[mt][e / 2];
{% endif %}

    // O += P V: the S accumulators of two n8 tiles are the A fragment of one k16 step.
{% if pingpong or overlap %}
#pragma unroll
    for (int kk = 0; kk < N_TILES / 2; ++kk) {  // issued in the next tile's turn
      p_frag[kk][0] = pack2<T>(s[0][2 * kk][0], s[0][2 * kk][1]);
      p_frag[kk][1] = pack2<T>(s[0][2 * kk][2], s[0][2 * kk][3]);
      p_frag[kk][2] = pack2<T>(s[0][2 * kk + 1][0], s[0][2 * kk + 1][1]);
      p_frag[kk][3] = pack2<T>(s[0][2 * kk + 1][2], s[0][2 * kk + 1][3]);
    }
{% elif wgmma %}
    {
      uint32_t a[N_TILES / 2][4];
#pragma unroll
      for (int kk = 0; kk < N_TILES / 2; ++kk) {
        a[kk][0] = pack2<T>(s[0][2 * kk][0], s[0][2 * kk][1]);
        a[kk][1] = pack2<T>(s[0][2 * kk][2], s[0][2 * kk][3]);
        a[kk][2] = pack2<T>(s[0][2 * kk + 1][0], s[0][2 * kk + 1][1]);
        a[kk][3] = pack2<T>(s[0][2 * kk + 1][2], s[0][2 * kk + 1][3]);
      }
      float(&acc)[CHUNKS * 4] = reinterpret_cast<float(&)[CHUNKS * 4]>(o);
{% if split_kv %}
      mbarrier_wait(&full_v[stage], use_parity<STAGES>(ring + tile - w.tile_begin));
{% endif %}
      wgmma_pin(acc);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < N_TILES / 2; ++kk)
        Wgmma<T, HEAD_DIM>::rs<1>(acc, a[kk], v_desc + stage * TILE_CHUNKS + kk * V_STEP);
      wgmma_commit();  // awaited with the next tile's S
    }
{% else %}
#pragma unroll
    for (int kk = 0; kk < N_TILES / 2; ++kk) {
      uint32_t a[M_TILES][4];
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt) {
        a[mt][0] = pack2<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        a[mt][1] = pack2<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        a[mt][2] = pack2<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        a[mt][3] = pack2<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < CHUNKS / 2; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, vs + v_frag[dp % 4] + kk * 16 * ROW_CHUNKS + (dp / 4) * CHUNK8_STEP);
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
          mma_16x8x16<T>(o[mt][2 * dp], a[mt], b[0], b[1]);
          mma_16x8x16<T>(o[mt][2 * dp + 1], a[mt], b[2], b[3]);
        }
      }
    }
{% endif %}
  };
