{# varlen_fwd's epilogue in registers (REGISTER_EPILOGUE): normalize O, write lse, stage each
   warp's rows and store them (TMA or 16-byte stores). A fragment of varlen_fwd's body. #}
  if constexpr (REGISTER_EPILOGUE) {
    // Each row lives in one warp, so normalize in registers and let each warp stage its own
    // rows (as T) in its own Q rows, which only it read: no CTA barrier.
{% if persistent %}
    // PERSISTENT: in the last tile's stage instead, once every warpgroup is done with it (Q's
    // rows may hold the next item's Q by now): the first K_STAGED_WGS warpgroups' rows in its K,
    // the others' from the start of its V; an item without tiles in its own Q rows.
    const int tiles = w.tile_end - w.tile_begin;
    const int last_stage = (ring + tiles - 1) % STAGES;
    const bool in_k = WARPS / 4 <= K_STAGED_WGS || warp / 4 < K_STAGED_WGS;
    uint4* const staging = tiles > 0 ? (in_k ? k_smem + last_stage * TILE_CHUNKS
                                             : v_smem + last_stage * TILE_CHUNKS - K_STAGED_WGS * 64 * ROW_CHUNKS)
                                     : q_smem;
    release_staging();  // (an earlier item's, when this one had no tile to do it)
    if (tiles > 0) named_barrier(EPI_BAR, WARPS * 32);
{% else %}
    uint4* const staging = q_smem;
{% endif %}
    uint32_t* stage_rows = reinterpret_cast<uint32_t*>(staging);
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = warp_m * M_TILES * 16 + mt * 16 + h * 8 + g;
        float sum = row_sum[mt][h];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const float inv = sum > 0.f ? 1.f / sum : 0.f;  // no visible key: zeros, lse = -inf
        const float row_lse2 = sum > 0.f ? row_max[mt][h] * sl2 + log2f(sum) : -INFINITY;
        const int pr = w.m0 + row;
        if (w.splits == 1) {
#pragma unroll
          for (int d = 0; d < CHUNKS; ++d)
            stage_rows[swizzle(row, d) * 4 + c] = pack2<T>(o[mt][d][2 * h] * inv, o[mt][d][2 * h + 1] * inv);
        }
        if (pr < 0 || pr >= w.rows) continue;
        const TokenHead th = packed_row(pr, p.pack, w.q_start, w.kv_head);
        const int token = th.token, head = th.head;
        const float lse2 = full_lse2(p, w, head, token, row_lse2, sl2);
        if (w.splits == 1) {
          if (p.lse && c == 0) p.lse[int64_t(head) * p.total_q + token] = lse2 * LN2;
        } else {  // fp32 partials straight from the fragments (explicit prefill splits: rare)
          float* part = p.partial_o + ((int64_t(w.split) * p.total_q + token) * p.num_heads_q + head) * HEAD_DIM;
#pragma unroll
          for (int d = 0; d < CHUNKS; ++d)
            *reinterpret_cast<float2*>(part + d * 8 + 2 * c) = make_float2(o[mt][d][2 * h] * inv, o[mt][d][2 * h + 1] * inv);
          if (c == 0) p.partial_lse[(int64_t(w.split) * p.num_heads_q + head) * p.total_q + token] = lse2;
        }
      }
    if (w.splits == 1) {
      __syncwarp();
      constexpr int WARP_ROWS = M_TILES * 16;
{% if persistent %}
      // The warp's two 8-row groups that lie wholly in the sequence leave by TMA stores (lane 0,
      // O's map: make_rows_map), the others by the lanes' 16-byte stores below. Not for an item
      // without tiles: its staging is its Q rows, which the producer refills at once.
      static_assert(WARP_ROWS == 16, "persistent: a warp's rows are two 8-row groups");
      const int group_pr = w.m0 + warp_m * WARP_ROWS;  // a multiple of pack
      const bool by_tma0 = o_by_tma && tiles > 0 && group_pr >= 0 && group_pr + 8 <= w.rows;
      const bool by_tma1 = o_by_tma && tiles > 0 && group_pr + 8 >= 0 && group_pr + 16 <= w.rows;
      if (by_tma0 || by_tma1) {
        fence_proxy_async_shared();  // this lane's staging writes, before the TMA unit reads them
        __syncwarp();
        if (lane == 0) {
          const int token = w.q_start + group_pr / p.pack;
          if (by_tma0) tma_store_5d(&map_o, staging + row_base(warp_m * WARP_ROWS), 0, 0, token, 0, w.kv_head);
          if (by_tma1)
            tma_store_5d(&map_o, staging + row_base(warp_m * WARP_ROWS + 8), 0, 0, token + 8 / p.pack, 0, w.kv_head);
          bulk_commit();
        }
        staged_stage = last_stage;  // released once the stores have read it (release_staging)
      }
      if (!by_tma0 || !by_tma1)
{% endif %}
      if constexpr (32 % CHUNKS == 0) {  // each lane stores one chunk of rows 32 / CHUNKS apart
        const int chunk = lane % CHUNKS;
        PackedRow<32 / CHUNKS> r(p.pack, w.q_start, w.m0 + warp_m * WARP_ROWS + lane / CHUNKS);
#pragma unroll
        for (int row = warp_m * WARP_ROWS + lane / CHUNKS; row < (warp_m + 1) * WARP_ROWS; row += 32 / CHUNKS) {
{% if persistent %}
          if (!(row - warp_m * WARP_ROWS < 8 ? by_tma0 : by_tma1) && r.pr >= 0 && r.pr < w.rows)
{% else %}
          if (r.pr >= 0 && r.pr < w.rows)
{% endif %}
            *reinterpret_cast<uint4*>(static_cast<T*>(p.out) + r.token * p.out_stride_token +
                                      (w.kv_head * p.pack + r.head) * p.out_stride_head + chunk * 8) =
                staging[swizzle(row, chunk)];
          r.advance(p.pack);
        }
      } else {
#pragma unroll
        for (int idx = lane; idx < WARP_ROWS * CHUNKS; idx += 32) {
          const int row = warp_m * WARP_ROWS + idx / CHUNKS, chunk = idx % CHUNKS;
          const int pr = w.m0 + row;
          if (pr < 0 || pr >= w.rows) continue;
          const TokenHead th = packed_row(pr, p.pack, w.q_start, w.kv_head);
          const int token = th.token, head = th.head;
          *reinterpret_cast<uint4*>(static_cast<T*>(p.out) + token * p.out_stride_token + head * p.out_stride_head +
                                    chunk * 8) = staging[swizzle(row, chunk)];
        }
      }
    }
