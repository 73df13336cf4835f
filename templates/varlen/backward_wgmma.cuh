// The backward's main kernel on Hopper warpgroup MMAs (wgmma, sm_90a), included by
// backward.cu.j2 (with backward_common.cuh: loads, score math, mask, dQ atomics, epilogue).
//
// FlashAttention-3's shape: two warpgroups, each owning 64 of the CTA's 128 keys as the MMA's
// M dimension, walk the query tiles (64 packed rows) that see them. Per query tile:
//   S^T  = K Q^T and dP^T = V dO^T   shared x shared, issued back to back; P^T is computed
//                                      while dP^T still runs
//   dV  += P^T dO                     P^T from registers (the accumulators, rounded to T)
//   dS^T -> shared memory             both warpgroups' 64 keys, for dQ
//   dQ   = dS K                       dS^T read transposed (MN-major A); each warpgroup
//                                      head_dim / 2 columns of the tile's 64 rows
//   dK  += dS^T Q                     dS^T from registers; runs on while dQ is handed off
// K, V, Q, dO and dS^T sit in the 128-byte swizzle wgmma reads; Q and dO column block by
// column block (64 head_dim columns of all BLOCK_M rows, then the next), the layout a TMA box
// of 64 columns writes.
//
// PRODUCER (FlashAttention-3's data movement) adds a third warpgroup; the compute warpgroups
// then issue no copies and no atomics and meet at one named barrier a tile (dS^T written):
//   warp 8  copies query tile i into stage i % STAGES of a ring (full / empty mbarriers): Q and
//           dO by TMA (one thread; boxes of 64 columns x pack heads x BLOCK_M / pack tokens of
//           a 4-D map), lse2 / delta by the warp's lanes; cp.async when no tensor map fits
//           (BLOCK_M % pack, strides);
//   warp 9  adds each tile's dQ, which the compute warpgroups write as fp32 into one of
//           DQ_STAGES shared buffers (dq_full / dq_empty), to the accumulator with one bulk
//           reduce-add (cp.reduce.async.bulk .add.f32) issued by one thread; in deterministic
//           mode that thread waits for the tile's turn first, so the compute warpgroups never
//           wait on another CTA unless both buffers are still pending.
// The dQ buffers are a copy of the accumulator rows, whose float4s are XOR-swizzled by the
// row's index (DQ_SWIZZLE: conflict-free fragment writes; the postprocess reads it back).
// Without PRODUCER all 256 threads copy (cp.async), add (vector atomics) and meet at two CTA
// barriers a tile.

{% include "varlen/backward_wgmma_shape.cuh" %}

{% include "varlen/backward_wgmma_args.cuh" %}

// A barrier of the compute warps (all threads without PRODUCER).
__device__ __forceinline__ void consumer_sync() {
  if constexpr (PRODUCER) named_barrier(3, CONSUMERS);
  else __syncthreads();
}

__global__ void __launch_bounds__(THREADS, 1) varlen_bwd(const __grid_constant__ BwdMain args) {
  const BwdParams& p = args.p;
  extern __shared__ uint4 smem_base[];
  uint4* smem = smem_base + ((1024 - (static_cast<uint32_t>(__cvta_generic_to_shared(smem_base)) & 1023)) & 1023) / 16;
  SharedStorage& shared = *reinterpret_cast<SharedStorage*>(smem);
  uint4* k_smem = shared.k;
  uint4* v_smem = shared.v;
  uint4* q_smem = shared.q;
  uint4* do_smem = shared.dout;
  uint4* ds_smem = shared.ds;
  float* dq_smem = shared.dq_and_stats;                     // [DQ_STAGES][DQ_TILE]
  float* stats = shared.dq_and_stats + DQ_STAGES * DQ_TILE;  // [STAGES][STAT_ARRAYS][BLOCK_M]
  float* dq_scratch = shared.dq_scratch;

{% if not persistent %}
  Work w;  // the CTA's one work item (PERSISTENT: the loader decodes each into item_work)
  if (!decode_work(p, w)) return;
{% endif %}
  // warp through a shuffle: warp-uniform as far as the compiler can tell (FlashAttention-3's
  // canonical_warp_idx), so the warpgroup's wgmma descriptors live in uniform registers instead
  // of a 64-bit add and two R2UR moves per wgmma.
  const int tid = threadIdx.x, lane = tid % 32, warp = __shfl_sync(0xffffffffu, tid / 32, 0), wg = warp / 4;
  const int g = lane / 4, c = lane % 4;
  const int wg_key0 = DKV_SPLIT ? 0 : wg * WG_KEYS;  // this warpgroup's first key (the MMA's M)
  const int key0 = wg_key0 + (warp % 4) * 16;       // this warp's 16 accumulator rows (keys)
  const int q0 = DKV_SPLIT ? wg * SN : 0;           // this warpgroup's first query of S^T
  // Each role walks its work items: ITEM_BEGIN(take) names the item's Work `w`, its query tiles,
  // `ring` (the query tiles of earlier items: the rings' place) and `done` (items before it: the
  // barriers' phases). PERSISTENT: item after item, take(done) saying whether there is one; `w`
  // is the loader's decode in shared memory (item_work), read where used (held in registers
  // through the item loop it crowded the compute loop's offsets out: they spilled, and so did
  // the 24-register producer roles); ITEM_END(release) frees the slot for the loader.
  // Otherwise the CTA's one item, decoded above.
{% if persistent %}
#define ITEM_BEGIN(take)                                                                    \
  for (unsigned done = 0, ring = 0;; ++done) {                                              \
    if (!take(done)) break;                                                                 \
    const Work& w = item_work[done % ITEM_SLOTS];                                           \
    const int tiles = w.m_end - w.m_begin;
#define ITEM_END(release) \
    ring += tiles; \
    release(done); \
  }
{% else %}
  const int tiles = w.m_end - w.m_begin;
  constexpr int ring = 0, done = 0;
#define ITEM_BEGIN(take)
#define ITEM_END(release)
{% endif %}

  // PRODUCER's hand-offs. full[s] / empty[s]: query tile stage s copied (the loader's lanes
  // arrived and the TMA bytes landed) / free again (every compute warp is done with it).
  // dq_full[b] / dq_empty[b]: dQ buffer b written by every compute warp / read by the bulk add.
  // A barrier completes a phase once its count has arrived; waiters name the phase's parity.
  // The loader's first thread initializes them (it needs them first) and the producer warpgroup
  // meets on PRODUCER_BAR, then arrives on INIT_BAR, where the compute warps wait once their K / V
  // copies landed: no CTA-wide barrier, so the first query tile's TMA no longer waits behind the
  // compute warps' K / V copies being issued.
  // PERSISTENT: kv_full / kv_empty: an item's K / V copied by the loader / read by every compute
  // warp; staged / stored: its dK / dV staged by every compute warp / read out by the storer;
  // item_full / item_empty: slot n % ITEM_SLOTS (item_slot: the CTA's n-th work item, -1 past
  // the last; item_work: its decode) published by the loader / done with by every other warp
  // (at the item's end: they read its Work where they use it).
  __shared__ uint64_t full[STAGES], empty[STAGES], dq_full[2], dq_empty[2], kv_full, kv_empty, staged, stored;
  constexpr unsigned ITEM_SLOTS = 4;
  __shared__ uint64_t item_full[ITEM_SLOTS], item_empty[ITEM_SLOTS];
  __shared__ volatile int item_slot[ITEM_SLOTS];
  __shared__ Work item_work[ITEM_SLOTS];
  constexpr int ITEM_READERS = CONSUMERS / 32 + 2;  // the compute warps, the writer and the storer
  constexpr int PRODUCER_BAR = 6, INIT_BAR = 7;  // 1..5: the compute warps' own
  if constexpr (PRODUCER) {
    if (tid == LOADER_WARP * 32) {
      for (int s = 0; s < STAGES; ++s) {
        mbarrier_init(&full[s], 32);
        mbarrier_init(&empty[s], CONSUMERS / 32);
      }
      for (int b = 0; b < DQ_STAGES; ++b) {
        mbarrier_init(&dq_full[b], CONSUMERS / 32);
        mbarrier_init(&dq_empty[b], 1);
      }
      if constexpr (PERSISTENT) {
        mbarrier_init(&kv_full, 1);
        mbarrier_init(&kv_empty, CONSUMERS / 32);
        mbarrier_init(&staged, CONSUMERS / 32);
        mbarrier_init(&stored, 1);
        for (unsigned b = 0; b < ITEM_SLOTS; ++b) {
          mbarrier_init(&item_full[b], 1);
          mbarrier_init(&item_empty[b], ITEM_READERS);
        }
      }
      fence_mbarrier_init();
    }
  }
  // PERSISTENT: the loader takes the work items: the CTA's own block index first, then the next
  // of a counter past the grid whenever it starts another, so the CTA that finishes first takes
  // the next item, as the hardware launches blocks without PERSISTENT. CTAs on neighbouring key
  // tiles of one (sequence, KV head) stay close in time and can share their Q / dO tiles in L2
  // (a static snake over the grid measured about the same: notes/backward-h200.md). Every
  // other warp waits for the item the loader published
  // and, at the item's end, frees its slot.
{% if persistent %}
  auto published_item = [&](unsigned n) {
    const unsigned slot = n % ITEM_SLOTS;
    mbarrier_wait(&item_full[slot], use_parity<ITEM_SLOTS>(n));
    return item_slot[slot] >= 0;
  };
  auto release_item = [&](unsigned n) {
    __syncwarp();  // every lane done with the slot's Work
    if (lane == 0) mbarrier_arrive(&item_empty[n % ITEM_SLOTS]);
  };
  auto keep_item = [](unsigned) {};  // the loader's: it owns the slots
{% endif %}
  // With PRODUCER the compute warps copy K and V, and the loader starts on the first query
  // tiles at once instead of after K and V landed (their two memory latencies then overlap).
  if (!PRODUCER || warp < LOADER_WARP) {
{% if not persistent %}
    load_kv<Tiles, PRODUCER ? CONSUMERS : THREADS>(p, w, k_smem, v_smem, tid);
{% endif %}
{% if dq_kernel %}
    wait_for_prerequisite_grid();  // the preprocess wrote lse2 / delta
{% else %}
    wait_for_prerequisite_grid();  // the preprocess wrote lse2 / delta and zeroed dQ
{% endif %}
  }
  if constexpr (!PRODUCER) {
{% if not persistent %}
    if (tiles > 0) load_query_tile<QTiles, THREADS>(p, w, w.m_begin, q_smem, do_smem, stats, tid);
{% endif %}
  }
  cp_async_commit();
  if constexpr (PRODUCER) {
{% include "varlen/backward_wgmma_producer.cuh" %}
    set_max_registers<CONSUMER_REGS, true>();
    cp_async_wait<0>();
    fence_proxy_async_shared();  // for wgmma's (async proxy) reads
    named_barrier(INIT_BAR, THREADS);  // every compute thread's K and V copies landed; the barriers initialized
  }

  // Descriptors. K-major: K, V as A (this warpgroup's keys), Q, dO as B of S^T / dP^T (this
  // warpgroup's queries), with DKV_SPLIT P^T and dS^T as A of dV / dK. MN-major: Q, dO as B of
  // dK / dV (DKV_SPLIT: this warpgroup's head_dim columns), K as B of dQ (this warpgroup's
  // head_dim columns), dS^T as the transposed A of dQ.
  const uint64_t k_desc = wgmma_desc(k_smem + wg_key0 * ROW_CHUNKS, 16, GROUP_BYTES);
  const uint64_t v_desc = wgmma_desc(v_smem + wg_key0 * ROW_CHUNKS, 16, GROUP_BYTES);
  const uint64_t q_desc = wgmma_desc(q_smem + q0 * 8, 16, 1024);
  const uint64_t do_desc = wgmma_desc(do_smem + q0 * 8, 16, 1024);
  const int dkv_block = DKV_SPLIT ? wg * (DKV_N / 64) * QBLOCK : 0;  // first 64-column block of dK / dV
  const uint64_t qt_desc = wgmma_desc(q_smem + dkv_block, QBLOCK * 16, 1024);
  const uint64_t dot_desc = wgmma_desc(do_smem + dkv_block, QBLOCK * 16, 1024);
  const uint64_t kt_desc = wgmma_desc(k_smem + Tiles::at(0, wg * DQ_N / 8), 1024, GROUP_BYTES);
  const uint64_t ds_desc = wgmma_desc(ds_smem, 1024, DS_CHUNKS * 128);
  const uint64_t dsk_desc = wgmma_desc(ds_smem, 16, DS_CHUNKS * 128);  // DKV_SPLIT: dS^T, P^T K-major
  const uint64_t dsq_desc = wgmma_desc(ds_smem, 16, 1024);  // DQ_T: dS query-major, the K-major B of dQ^T

  const float sl2 = p.scale_log2;
  ITEM_BEGIN(published_item)
  if constexpr (PERSISTENT) mbarrier_wait(&kv_full, done & 1);  // this item's K / V copied
  float dk[D_TILES * 4], dv[D_TILES * 4];
#pragma unroll
  for (int i = 0; i < D_TILES * 4; ++i) dk[i] = dv[i] = 0.f;
  auto& dk4 = reinterpret_cast<float(&)[D_TILES][4]>(dk);
  auto& dv4 = reinterpret_cast<float(&)[D_TILES][4]>(dv);

  for (int m = w.m_begin; m < w.m_end; ++m) {
    const int i = m - w.m_begin;
    const auto q = ring + i;  // the tile's place in the rings (PERSISTENT: unsigned, so % and / are bit ops)
    const int stage = q % STAGES;
    if constexpr (PRODUCER) {
      mbarrier_wait(&full[stage], use_parity<STAGES>(q));
    } else {
      cp_async_wait<0>();
      fence_proxy_async_shared();  // the copies, before wgmma reads them
      __syncthreads();  // tile m landed for all; every MMA of tile m - 1 is done (its stage, dS^T)
      if (m + 1 < w.m_end)
        load_query_tile<QTiles, THREADS>(p, w, m + 1, q_smem + (stage ^ 1) * QT_CHUNKS, do_smem + (stage ^ 1) * QT_CHUNKS,
                                        stats + (stage ^ 1) * STAT_ARRAYS * BLOCK_M, tid);
      cp_async_commit();
    }
    const int qs = stage * QT_CHUNKS;
    // dS^T buffer of this tile: with PRODUCER (not DKV_SPLIT) two alternate, so writing tile i's
    // only needs tile i - 2's dQ done, which both warpgroups finished before meeting for tile i - 1.
    const int ds_stage = q % DS_STAGES;
    uint32_t* ds32 = reinterpret_cast<uint32_t*>(ds_smem + ds_stage * DS_TILES * DS_TILE);
    uint32_t* pt32 = ds32 + DS_TILE * 4;  // DKV_SPLIT: P^T
    const uint64_t ds_tile_desc = ds_desc + ds_stage * DS_TILES * DS_TILE;
    const uint64_t dsk_tile_desc = dsk_desc + ds_stage * DS_TILES * DS_TILE;
    const uint64_t dsq_tile_desc = dsq_desc + ds_stage * DS_TILES * DS_TILE;
    const float* lse2 = stats + stage * STAT_ARRAYS * BLOCK_M;
    const float* delta = lse2 + BLOCK_M;
    const QueryTile tile = query_tile(p, w, m);

    // S^T = K Q^T and dP^T = V dO^T, then P^T while dP^T finishes.
    float s[Q_TILES * 4], dp[Q_TILES * 4];
    wgmma_fence();
    Wgmma<T, SN>::ss<0, 0>(s, k_desc, q_desc + qs);
#pragma unroll
    for (int kt = 1; kt < HEAD_DIM / 16; ++kt) Wgmma<T, SN>::ss<1, 0>(s, k_desc + k_step(kt), q_desc + qs + q_step(kt));
    wgmma_commit();
    Wgmma<T, SN>::ss<0, 0>(dp, v_desc, do_desc + qs);
#pragma unroll
    for (int kt = 1; kt < HEAD_DIM / 16; ++kt)
      Wgmma<T, SN>::ss<1, 0>(dp, v_desc + k_step(kt), do_desc + qs + q_step(kt));
    wgmma_commit();
    auto& s4 = reinterpret_cast<float(&)[Q_TILES][4]>(s);
    auto& dp4 = reinterpret_cast<float(&)[Q_TILES][4]>(dp);
    float2 l[Q_TILES], d[Q_TILES];
    // A hook whose slope is not 1 needs the score at dS^T too: P^T and dS^T at once, after both GEMMs.
    constexpr bool BOTH_AFTER = ScoreMod::ACTIVE && !ScoreMod::KV_AFFINE &&
                                !(EARLY_UNIT_SLOPE_PROBS && ScoreMod::UNIT_SLOPE);
    if constexpr (BOTH_AFTER) {
      wgmma_wait<0>();
      wgmma_pin(s);
      wgmma_pin(dp);
      load_row_stats(l, lse2, q0, c);
      load_row_stats(d, delta, q0, c);
      scored_probs_to_dscores(p, w, m, key0, q0, g, c, s4, dp4, l, d, sl2);
    } else {
      // lse2 / delta read after the waits: lse2 read before them (under the GEMMs, 16 more
      // registers live across the wait) measured slower (notes/backward-h200.md).
      wgmma_wait<1>();
      wgmma_pin(s);
      if constexpr (ScoreMod::KV_AFFINE) {  // a bias: P^T takes it, dS^T is as without one
        affine_scores_to_probs(s4, lse2, q0, c, key0, g, sl2);
      } else if constexpr (ScoreMod::ACTIVE) {  // UNIT_SLOPE: P^T by the hook, dS^T as without one
        load_row_stats(l, lse2, q0, c);
        scored_probs_to_dscores<false>(p, w, m, key0, q0, g, c, s4, s4, l, l, sl2);
      } else {
        load_row_stats(l, lse2, q0, c);
        scores_to_probs(s4, l, sl2);
      }
      // P^T masked before dP^T is waited for: dS^T = P^T (dP^T - delta) is then 0 where P^T is,
      // and the branch keeps all of P^T's exp2s ahead of the wait. Masked after it, ptxas hoisted
      // the wait above 20 of the 32 exp2s (their MUFU time no longer under dP^T's GEMM).
      if (tile.masked) mask_hidden(p, w, m, key0, q0, g, c, tile.hook, s4, s4);
      wgmma_wait<0>();
      wgmma_pin(dp);
      load_row_stats(d, delta, q0, c);
      probs_to_dscores(s4, dp4, d);
    }
    if constexpr (BOTH_AFTER) {
      if (tile.masked) mask_hidden(p, w, m, key0, q0, g, c, tile.hook, s4, dp4);
    }

    // dS^T (DKV_SPLIT: and P^T; this warpgroup's queries) -> shared memory (T), for dQ (dV,
    // dK); else P^T and dS^T as A fragments. DKV_SPLIT with PRODUCER: one stage, which the
    // other warpgroup's MMAs of tile i - 1 read until it arrived at barrier 4 + its index.
{% if not dq_kernel %}
    if constexpr (DKV_SPLIT && PRODUCER) {
      if (i > 0) named_barrier(4 + (wg ^ 1), CONSUMERS);
    }
{% endif %}
    if constexpr (DQ_T) {
      // dS query-major (QTiles' layout, 8 keys a 16-byte chunk) by stmatrix .trans: the 8 x 8
      // blocks (queries 8 nt.., keys key0 + 8 h..) of the S^T fragments, stored transposed, four
      // a call; lane l addresses row l % 8 of block l / 8 (conflict-free: the chunk is swizzled by
      // the row).
      uint4* ds_rows = ds_smem + ds_stage * DS_TILES * DS_TILE;
      const int block = lane / 8, r8 = lane % 8;
#pragma unroll
      for (int nt = 0; nt < Q_TILES; nt += 2) {
        const uint32_t r[4] = {pack2<T>(dp4[nt][0], dp4[nt][1]), pack2<T>(dp4[nt][2], dp4[nt][3]),
                               pack2<T>(dp4[nt + 1][0], dp4[nt + 1][1]), pack2<T>(dp4[nt + 1][2], dp4[nt + 1][3])};
        stmatrix_x4_trans(ds_rows + QTiles::at(8 * (nt + block / 2) + r8, key0 / 8 + block % 2), r);
      }
    } else {
      const int sg = lane / 4, sc = lane % 4;
#pragma unroll
      for (int nt = 0; nt < Q_TILES; ++nt) {
        ds32[DsRows::at(key0 + sg, q0 / 8 + nt) * 4 + sc] = pack2<T>(dp4[nt][0], dp4[nt][1]);
        ds32[DsRows::at(key0 + sg + 8, q0 / 8 + nt) * 4 + sc] = pack2<T>(dp4[nt][2], dp4[nt][3]);
        if constexpr (DKV_SPLIT) {
          pt32[DsRows::at(key0 + sg, q0 / 8 + nt) * 4 + sc] = pack2<T>(s4[nt][0], s4[nt][1]);
          pt32[DsRows::at(key0 + sg + 8, q0 / 8 + nt) * 4 + sc] = pack2<T>(s4[nt][2], s4[nt][3]);
        }
      }
    }
    uint32_t da[DKV_SPLIT ? 1 : BLOCK_M / 16][4];
    if constexpr (!DKV_SPLIT) {
      uint32_t pa[BLOCK_M / 16][4];
#pragma unroll
      for (int kk = 0; kk < BLOCK_M / 16; ++kk) {
        a_fragment(pa[kk], s4, kk);
        a_fragment(da[kk], dp4, kk);
      }

      // dV += P^T dO.
      wgmma_pin(dv);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BLOCK_M / 16; ++kk) Wgmma<T, DKV_N>::rs<1>(dv, pa[kk], dot_desc + qs + kk * 128);
      wgmma_commit();
    }
    fence_proxy_async_shared();  // dS^T, before wgmma reads it
    named_barrier(1, CONSUMERS);  // both warpgroups' dS^T written

{% if dq_kernel %}
    // dV += P^T dO, dK += dS^T Q on this warpgroup's columns, A from shared (no dQ here).
    wgmma_pin(dk);
    wgmma_pin(dv);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BLOCK_M / 16; ++kk)
      Wgmma<T, DKV_N>::ss<1, 1>(dv, dsk_tile_desc + DS_TILE + kk * 2, dot_desc + qs + kk * 128);
#pragma unroll
    for (int kk = 0; kk < BLOCK_M / 16; ++kk)
      Wgmma<T, DKV_N>::ss<1, 1>(dk, dsk_tile_desc + kk * 2, qt_desc + qs + kk * 128);
    wgmma_commit();
{% else %}
    // dQ = dS K (this warpgroup's columns), then dK += dS^T Q. DKV_SPLIT: dQ in DQ_SLICES slices
    // of 64 columns (FlashAttention-3's Slice_dQKV_Mma: half the registers), dV before the first
    // slice's atomics and dK before the second's run under them.
    // DQ_T: dQ^T (this warpgroup's 64 head_dim rows x BLOCK_M queries), else dQ's DQ_SN columns.
    constexpr int DQ_N8 = DQ_T ? BLOCK_M / 8 : DQ_SN / 8;
    float dq[DQ_N8 * 4];
    auto& dq4 = reinterpret_cast<float(&)[DQ_N8][4]>(dq);
    auto dq_mma = [&](int slice) {
      const uint64_t kt = kt_desc + slice * 64;  // the slice's 64-column atom of K
      // (both branches compile in either mode, outside a template: each takes dq at its own width)
      if constexpr (DQ_T) {  // dQ^T = K^T dS^T: K^T the MN-major A, dS (query-major) the K-major B
        auto& dqt = reinterpret_cast<float(&)[BLOCK_M / 2]>(dq);
        Wgmma<T, BLOCK_M>::ss<0, 0, 1>(dqt, kt, dsq_tile_desc);
#pragma unroll
        for (int kk = 1; kk < BLOCK_N / 16; ++kk)
          Wgmma<T, BLOCK_M>::ss<1, 0, 1>(dqt, kt + kk * ROWS16, dsq_tile_desc + q_step(kk));
      } else {
        auto& dqs = reinterpret_cast<float(&)[DQ_SN / 2]>(dq);
        Wgmma<T, DQ_SN>::ss<0, 1, 1>(dqs, ds_tile_desc, kt);
#pragma unroll
        for (int kk = 1; kk < BLOCK_N / 16; ++kk)
          Wgmma<T, DQ_SN>::ss<1, 1, 1>(dqs, ds_tile_desc + kk * 16 * DS_CHUNKS, kt + kk * ROWS16);
      }
      wgmma_commit();
    };
    // The compute warps' own vector atomics of dQ columns col0 + [0, DQ_SN).
    auto dq_atomics = [&](int col0) {
      if constexpr (DKV_SPLIT) {
        // Rows g (half 0), then g + 8 (half 1) of this warp's 16 through its scratch: float4 f
        // of scratch row r at f ^ r (conflict-free writes of the fragments and reads of rows),
        // read back as 4 rows x 8 float4 an instruction: 4 whole lines per atomic.
        float* scratch = dq_scratch + warp * 8 * DQ_SN;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
#pragma unroll
          for (int j = 0; j < DQ_SN / 8; ++j) {
            const int f = 2 * j + c / 2;
            *reinterpret_cast<float2*>(scratch + g * DQ_SN + (f ^ g) * 4 + (c & 1) * 2) =
                make_float2(dq4[j][2 * half], dq4[j][2 * half + 1]);
          }
          __syncwarp();
#pragma unroll
          for (int k = 0; k < 2; ++k) {
            const int r = lane / 8 + 4 * k;
            float* row_g = dq_row(p, w, m * BLOCK_M + (warp % 4) * 16 + 8 * half + r);
#pragma unroll
            for (int h = 0; h < DQ_SN / 32; ++h) {
              const int f = lane % 8 + 8 * h;
              const float4 v = *reinterpret_cast<const float4*>(scratch + r * DQ_SN + (f ^ r) * 4);
              if (row_g) atomicAdd(reinterpret_cast<float4*>(row_g + col0 + f * 4), v);
            }
          }
          __syncwarp();  // the reads, before the next half's writes
        }
      } else {
        const int row = (warp % 4) * 16 + g;  // this thread's dQ rows: row, row + 8
        float* row_g = dq_row(p, w, m * BLOCK_M + row);
        float* row_g8 = dq_row(p, w, m * BLOCK_M + row + 8);
#pragma unroll
        for (int j = 0; j < DQ_SN / 8; ++j) {
          const int col = col0 + j * 8;
          add_dq(row_g ? row_g + col : nullptr, row_g8 ? row_g8 + col : nullptr, dq4[j], c);
        }
      }
    };
    wgmma_pin(dk);
    wgmma_fence();
    dq_mma(0);
    if constexpr (DKV_SPLIT) {  // dV += P^T dO, dK += dS^T Q on this warpgroup's columns, A from shared
      wgmma_pin(dv);
#pragma unroll
      for (int kk = 0; kk < BLOCK_M / 16; ++kk)
        Wgmma<T, DKV_N>::ss<1, 1>(dv, dsk_tile_desc + DS_TILE + kk * 2, dot_desc + qs + kk * 128);
      wgmma_commit();
      wgmma_wait<1>();  // dQ slice 0 done; dV runs on under its atomics
      wgmma_pin(dq);
      // Deterministic turns among the compute warps only (the producer's warps have left).
      int* sem = p.semaphores ? dq_semaphore(p, w, m) : nullptr;
      if (sem) wait_turn(sem, tile.turn, [] { consumer_sync(); });
      dq_atomics(wg * DQ_N);
      wgmma_fence();  // dq's registers, read by the atomics, before slice 1 writes them
      dq_mma(1);
#pragma unroll
      for (int kk = 0; kk < BLOCK_M / 16; ++kk)
        Wgmma<T, DKV_N>::ss<1, 1>(dk, dsk_tile_desc + kk * 2, qt_desc + qs + kk * 128);
      wgmma_commit();
      wgmma_wait<1>();  // dQ slice 1 done; dK runs on under its atomics
      wgmma_pin(dq);
      dq_atomics(wg * DQ_N + DQ_SN);
      if (sem) pass_turn(sem, [] { consumer_sync(); });
    } else {
#pragma unroll
      for (int kk = 0; kk < BLOCK_M / 16; ++kk) Wgmma<T, DKV_N>::rs<1>(dk, da[kk], qt_desc + qs + kk * 128);
      wgmma_commit();
      wgmma_wait<1>();  // dV and dQ done; dK runs on under the atomics
      wgmma_pin(dq);
      if constexpr (DQ_STAGES > 0) {
        // Hand dQ to the bulk add: into buffer i % DQ_STAGES once tile i - DQ_STAGES's was read,
        // float4 f of row r at f ^ (r % 8) with r the accumulator row (DQ_SWIZZLE): a warp's 8
        // rows x 4 lanes then write 256 bytes in two conflict-free wavefronts.
        const int row = (warp % 4) * 16 + g;  // this thread's dQ rows: row, row + 8
        const int b = q % DQ_STAGES;
        if (q >= DQ_STAGES) mbarrier_wait(&dq_empty[b], free_parity<DQ_STAGES>(q));
        if (PERSISTENT && i == 0 && done > 0) mbarrier_wait(&stored, (done - 1) & 1);  // the buffers staged dK / dV
        float* buf = dq_smem + b * DQ_TILE;
        if constexpr (DQ_T) {
          // dQ^T's element (head_dim column col, query row qr) into row qr of the buffer, float4
          // col / 4 at (col / 4) ^ (qr's accumulator row % 8): 4-byte stores, each instruction's
          // 32 lanes on 32 banks (4 rows, their swizzles 2 apart, x 8 columns).
          const int x0 = static_cast<int>(accum_row(p, w, m * BLOCK_M) & 7);
          const int col0 = wg * DQ_N + (warp % 4) * 16 + g;
#pragma unroll
          for (int j = 0; j < DQ_N8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int qr = 8 * j + 2 * c + (e & 1), col = col0 + 8 * (e / 2);
              buf[qr * HEAD_DIM + ((((col >> 2) ^ ((x0 + 2 * c + (e & 1)) & 7))) << 2) + (col & 3)] = dq4[j][e];
            }
          }
        } else {
        const int x = static_cast<int>(accum_row(p, w, row) & 7);  // rows row and row + 8 alike (BLOCK_M % 8 == 0)
        // f ^ x for f = wg * DQ_N / 4 + 2j + c / 2: x < 8 only flips f's low three bits, which
        // are (2j % 8) | c / 2, so f ^ x = wg * DQ_N / 4 + 2j - 2j % 8 + ((2j % 8) ^ y) with
        // y = c / 2 ^ x: four values a tile.
        static_assert(DQ_N % 32 == 0, "wg * DQ_N / 4 keeps the low three bits clear");
        const int y = ((c >> 1) & 1) ^ x;
#pragma unroll
        for (int j = 0; j < DQ_N / 8; ++j) {
          const int f = wg * (DQ_N / 4) + ((2 * j) & ~7) + (((2 * j) & 7) ^ y);
          *reinterpret_cast<float2*>(buf + row * HEAD_DIM + f * 4 + (c & 1) * 2) = make_float2(dq4[j][0], dq4[j][1]);
          *reinterpret_cast<float2*>(buf + (row + 8) * HEAD_DIM + f * 4 + (c & 1) * 2) = make_float2(dq4[j][2], dq4[j][3]);
        }
        }
        fence_proxy_async_shared();  // for the bulk add's (async proxy) reads
        __syncwarp();
        if (lane == 0) mbarrier_arrive(&dq_full[b]);
      } else {
        int* sem = p.semaphores ? dq_semaphore(p, w, m) : nullptr;  // (no PRODUCER here)
        if (sem) wait_turn(sem, tile.turn);
        dq_atomics(wg * DQ_N);
        if (sem) pass_turn(sem);
      }
    }
{% endif %}
    wgmma_wait<0>();
    wgmma_pin(dk);
    wgmma_pin(dv);
    if constexpr (PRODUCER) {
      if (lane == 0) mbarrier_arrive(&empty[stage]);  // this warp is done with the stage
{% if not dq_kernel %}
      if constexpr (DKV_SPLIT) {  // done reading this tile's P^T / dS^T: the other may overwrite them
        if (i + 1 < tiles) named_barrier_arrive(4 + wg, CONSUMERS);
      }
{% endif %}
    }
  }
  allow_dependent_launch();

  // Epilogue: dK (times scale) and dV through the Q / dO buffers (free once the copies landed
  // and both warpgroups are done with their last tile). PERSISTENT: K / V are free for the next
  // item's copies now; dK / dV are only staged, in the dQ buffers (once the last two bulk adds
  // read them and the storer read out the last item's), for the storer warp.
  if constexpr (PERSISTENT) {
    if (lane == 0) mbarrier_arrive(&kv_empty);
    const auto n = ring + tiles;  // dQ hand-offs so far
    if (n >= 1) mbarrier_wait(&dq_empty[(n - 1) % DQ_STAGES], use_parity<DQ_STAGES>(n - 1));
    if (n >= 2) mbarrier_wait(&dq_empty[(n - 2) % DQ_STAGES], use_parity<DQ_STAGES>(n - 2));
    if (done > 0) mbarrier_wait(&stored, (done - 1) & 1);
    stage_dk_dv<Tiles>(p, dk4, dv4, key0, g, c, [](int t) { return t; }, reinterpret_cast<uint4*>(dq_smem));
    fence_proxy_async_shared();  // for the TMA stores' (async proxy) reads
    __syncwarp();
    if (lane == 0) mbarrier_arrive(&staged);
  } else {
    cp_async_wait<0>();
    named_barrier(2, CONSUMERS);
    store_dk_dv<D_TILES, CONSUMERS>(p, w, dk4, dv4, key0, g, c,
                                    [wg](int t) { return DKV_SPLIT ? wg * D_TILES + t : t; }, q_smem, tid,
                                    [] { named_barrier(2, CONSUMERS); });
  }
  ITEM_END(release_item)
}
#undef ITEM_BEGIN
#undef ITEM_END
