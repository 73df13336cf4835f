{# varlen_bwd's producer warpgroup (PRODUCER): the loader warp (K / V, query tiles by TMA), the
   dQ writer warp (bulk reduce-add) and, PERSISTENT, the dK / dV storer warp. A fragment of
   varlen_bwd's body (included there): it ends the producer's threads with a return. #}
    if (warp >= LOADER_WARP) {
      named_barrier(PRODUCER_BAR, 128);  // the barriers initialized, for the loader and the writer
      named_barrier_arrive(INIT_BAR, THREADS);
      set_max_registers<PRODUCER_REGS, false>();
      if (warp == LOADER_WARP) {
        // Query tile i of an item (the ring's q-th) into stage q % STAGES once the compute warps
        // freed it. PERSISTENT: first the item's K / V, once the compute warps are done with the
        // last item's, published after its first query tile went out.
{% if persistent %}
        int next = static_cast<int>(blockIdx.x);
        auto fetch_item = [&] {  // the next item past the grid, or -1
          if (static_cast<int>(gridDim.x) >= args.items) return -1;
          int taken = 0;
          if (lane == 0) {
            wait_for_prerequisite_grid();  // the preprocess zeroed the counter
            taken = atomicAdd(p.work_counter, 1);
          }
          const int item = static_cast<int>(gridDim.x) + __shfl_sync(0xffffffffu, taken, 0);
          return item < args.items ? item : -1;
        };
        auto take = [&](unsigned n) {  // the n-th item with work, published
          if (n > 0) next = fetch_item();
          Work probe;
          while (next >= 0 && !decode_work(p, probe, static_cast<unsigned>(next))) next = fetch_item();
          const unsigned slot = n % ITEM_SLOTS;
          if (n >= ITEM_SLOTS) mbarrier_wait(&item_empty[slot], free_parity<ITEM_SLOTS>(n));
          if (lane == 0) {
            item_work[slot] = probe;
            item_slot[slot] = next;
            mbarrier_arrive(&item_full[slot]);
          }
          __syncwarp();  // the slot's Work, for the other lanes
          return next >= 0;
        };
{% endif %}
        ITEM_BEGIN(take)
{% if persistent %}
        // The item's K / V once the compute warps are done with the last item's (kv_empty), after
        // its first query tile (whose stage is free a tile earlier): whole tiles by two TMA boxes
        // on kv_full, so they land while the compute warps stage the last item's dK / dV; a
        // partial last tile (zeros past the keys) by the warp's cp.async.
        auto copy_kv = [&] {
          if (done > 0) mbarrier_wait(&kv_empty, (done - 1) & 1);
          if (args.tma_kv && w.n0 + BLOCK_N <= w.k_len) {
            if (lane == 0) {
              mbarrier_arrive_expect_tx(&kv_full, 2 * KV_CHUNKS * 16);
              tma_load_5d(k_smem, &args.k_map, &kv_full, 0, w.k_start + w.n0, 0, 0, w.kv_head);
              tma_load_5d(v_smem, &args.v_map, &kv_full, 0, w.k_start + w.n0, 0, 0, w.kv_head);
            }
          } else {
            load_kv<Tiles, 32>(p, w, k_smem, v_smem, lane);
            cp_async_commit();
            cp_async_wait<0>();
            fence_proxy_async_shared();  // for wgmma's (async proxy) reads
            __syncwarp();
            if (lane == 0) mbarrier_arrive(&kv_full);
          }
        };
        if (tiles == 0) copy_kv();
{% endif %}
        for (int i = 0; i < tiles; ++i) {
          const auto q = ring + i;  // unsigned when PERSISTENT: the rings' % and / are bit ops
          const int s = q % STAGES, m = w.m_begin + i;
          if (q >= STAGES) mbarrier_wait(&empty[s], free_parity<STAGES>(q));
          float* st = stats + s * STAT_ARRAYS * BLOCK_M;
          // A sequence's last tile, when partial, by cp.async: its rows past the sequence must
          // be zeros (TMA would read the next sequence's, or the unused tail's, rows; a NaN
          // there times P = 0 would reach dK / dV).
          if (args.tma && (m + 1) * BLOCK_M <= w.rows) {
            if (lane == 0) {
              mbarrier_expect_tx(&full[s], 2 * QT_CHUNKS * 16);
              const int token = w.q_start + m * (BLOCK_M / p.pack);
#pragma unroll
              for (int cb = 0; cb < HEAD_DIM / 64; ++cb) {
                tma_load_4d(q_smem + s * QT_CHUNKS + cb * QBLOCK, &args.q_map, &full[s], cb * 64, 0, w.kv_head, token);
                tma_load_4d(do_smem + s * QT_CHUNKS + cb * QBLOCK, &args.do_map, &full[s], cb * 64, 0, w.kv_head, token);
              }
            }
            // lse2 / delta of the tile's rows (all in the sequence), which the preprocess wrote
            // (Q / dO are inputs: their first TMA flies before that wait); every load issued
            // before any store, so they share one memory latency. Each lane arrives after its
            // own stores.
            if (q == 0) wait_for_prerequisite_grid();
            constexpr int PER_LANE = (BLOCK_M + 31) / 32;  // rows lane + 32 k below BLOCK_M (80: the last k in part)
            const int64_t rows_at = accum_row(p, w, m * BLOCK_M + lane);
            const float* lse2_rows = p.lse2 + rows_at;
            const float* delta_rows = p.delta + rows_at;
            float l2[PER_LANE], dl[PER_LANE];
#pragma unroll
            for (int k = 0; k < PER_LANE; ++k) {
              if (BLOCK_M % 32 == 0 || lane + 32 * k < BLOCK_M) {
                l2[k] = lse2_rows[32 * k];
                dl[k] = delta_rows[32 * k];
              }
            }
#pragma unroll
            for (int k = 0; k < PER_LANE; ++k) {
              if (BLOCK_M % 32 != 0 && lane + 32 * k >= BLOCK_M) continue;
              if constexpr (ScoreMod::KV_AFFINE) {  // lse2 less the row's bias, and its slope
                const float2 terms = affine_row_terms(p, w, m * BLOCK_M + lane + 32 * k);
                l2[k] -= terms.y;
                st[2 * BLOCK_M + lane + 32 * k] = terms.x;
              }
              st[lane + 32 * k] = l2[k];
              st[BLOCK_M + lane + 32 * k] = dl[k];
            }
          } else {
            if (q == 0) wait_for_prerequisite_grid();
            load_query_tile<QTiles, 32>(p, w, m, q_smem + s * QT_CHUNKS, do_smem + s * QT_CHUNKS, st, lane);
            cp_async_commit();
            cp_async_wait<0>();
            fence_proxy_async_shared();  // for wgmma's (async proxy) reads
          }
          mbarrier_arrive(&full[s]);
{% if persistent %}
          if (i == 0) copy_kv();
{% endif %}
        }
        ITEM_END(keep_item)
      } else if (DQ_STAGES > 0 && warp == WRITER_WARP && lane == 0) {
        // Tile i's dQ from buffer i % 2 onto the accumulator rows of its sequence: one bulk
        // reduce-add (the buffer is those rows, swizzled as they are), in key-tile order when
        // deterministic.
        wait_for_prerequisite_grid();  // the preprocess zeroed the accumulator
        ITEM_BEGIN(published_item)
        for (int i = 0; i < tiles; ++i) {
          const auto q = ring + i;
          const int b = q % DQ_STAGES, m = w.m_begin + i;
          mbarrier_wait(&dq_full[b], use_parity<DQ_STAGES>(q));
          int* sem = p.semaphores ? dq_semaphore(p, w, m) : nullptr;
          if (sem) {
            const int turn = query_tile(p, w, m).turn;
            for (int spin = 0; load_acquire(sem) < turn && spin < (1 << 22); ++spin) __nanosleep(200);
          }
          const int rows = min(BLOCK_M, w.rows - m * BLOCK_M);
          bulk_reduce_add_f32(p.dq_accum + accum_row(p, w, m * BLOCK_M) * HEAD_DIM, dq_smem + b * DQ_TILE,
                              rows * HEAD_DIM * 4);
          bulk_commit();
          if (sem) {
            bulk_wait<0, false>();  // the adds performed, before the next key tile's turn
            fence_proxy_async_global();
            __threadfence();
            atomicAdd(sem, 1);
          } else {
            bulk_wait<0, true>();
          }
          mbarrier_arrive(&dq_empty[b]);
        }
        ITEM_END(release_item)
        bulk_wait<0, false>();
      } else if (PERSISTENT && warp == STORER_WARP) {
        // Each item's dK / dV once every compute warp staged them: the 8-row groups inside the
        // sequence by TMA stores (lane 0), the rest (a partial last group) by 16-byte stores.
        const uint4* staging = reinterpret_cast<const uint4*>(dq_smem);
        ITEM_BEGIN(published_item)
        mbarrier_wait(&staged, done & 1);
        const int groups = args.tma_store ? max(0, min(BLOCK_N, w.k_len - w.n0)) / 8 : 0;
        if (lane == 0) {
          for (int gi = 0; gi < groups; ++gi) {
            const int token = w.k_start + w.n0 + gi * 8;
#pragma unroll
            for (int h = 0; h < HEAD_DIM / 64; ++h) {
              const uint4* box = staging + Tiles::at(gi * 8, h * 8);  // a 1024-byte swizzle atom
              tma_store_3d(&args.dk_map, box, h * 64, w.kv_head, token);
              tma_store_3d(&args.dv_map, box + BLOCK_N * ROW_CHUNKS, h * 64, w.kv_head, token);
            }
          }
          bulk_commit();
        }
        copy_dk_dv<Tiles>(p, w, staging, groups * 8, lane, 32);
        if (lane == 0) bulk_wait<0, true>();  // the stores read the staging
        __syncwarp();
        if (lane == 0) mbarrier_arrive(&stored);
        ITEM_END(release_item)
        if (lane == 0) bulk_wait<0, false>();
      }
      allow_dependent_launch();
      return;
    }
