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
//   dK  += dS^T Q                     dS^T from registers; runs on while dQ is added (fp32
//                                      vector atomics, in key-tile order when deterministic)
// Q, dO, lse and delta of the next query tile are copied (cp.async) while the current one
// computes; K, V, Q, dO and dS^T sit in the 128-byte swizzle wgmma reads.
//
// PRODUCER adds a third warpgroup and takes two jobs off the compute warpgroups' path: two of
// its warps copy the query tiles into a 2-stage ring (full / empty mbarriers, as in the
// forward), the other two add each tile's dQ, which the compute warpgroups hand over as fp32
// in shared memory (dq_full / dq_empty), to the accumulator (and keep the deterministic order:
// the compute warpgroups never wait on another CTA). dS^T is double-buffered, so the compute
// warpgroups meet at one barrier a tile. Registers move to them with setmaxnreg. Without
// PRODUCER all 256 threads copy, add and meet at two CTA barriers a tile.

constexpr int WARPGROUPS = 2;                  // compute warpgroups
constexpr int CONSUMERS = WARPGROUPS * 128;
constexpr int THREADS = CONSUMERS + (PRODUCER ? 128 : 0);
constexpr int LOADERS = 64, WRITERS = 64;      // PRODUCER: warps 8-9 copy, 10-11 add dQ
constexpr int PRODUCER_REGS = 24, CONSUMER_REGS = 240;
static_assert(!PRODUCER || 128 * PRODUCER_REGS + CONSUMERS * CONSUMER_REGS <= 65536, "register budget");
constexpr int WG_KEYS = BLOCK_N / WARPGROUPS;  // keys per warpgroup (the MMA's M)
constexpr int Q_TILES = BLOCK_M / 8;           // n8 tiles of S^T per warp: every query of the tile
constexpr int D_TILES = HEAD_DIM / 8;          // n8 tiles of dK / dV
constexpr int DQ_N = HEAD_DIM / WARPGROUPS;    // dQ columns per warpgroup
constexpr int DS_CHUNKS = BLOCK_M / 8;         // a row of dS^T: one swizzle atom wide
constexpr int GROUP_BYTES = ROW_CHUNKS * 128;  // 8 rows of a K / V / Q / dO tile
constexpr int ROWS16 = 2 * GROUP_BYTES / 16;   // 16 rows of a K / V / Q / dO tile, in uint4
constexpr int KV_CHUNKS = BLOCK_N * ROW_CHUNKS;
constexpr int QT_CHUNKS = BLOCK_M * ROW_CHUNKS;
constexpr int DS_TILE = BLOCK_N * DS_CHUNKS;
constexpr int DS_STAGES = PRODUCER ? 2 : 1;
constexpr int DQ_STRIDE = HEAD_DIM + 4;        // floats a row of the dQ hand-off tile (PRODUCER)
constexpr int DQ_BYTES = PRODUCER ? BLOCK_M * DQ_STRIDE * 4 : 0;
// wgmma's atoms must be 1024-aligned: room to align the dynamic shared memory base.
constexpr int SMEM_BYTES = (2 * KV_CHUNKS + 4 * QT_CHUNKS + DS_STAGES * DS_TILE) * 16 + 2 * 2 * BLOCK_M * 4 + DQ_BYTES + 1024;
static_assert(BLOCK_N == 128 && BLOCK_M == 64, "wgmma rung: 2 warpgroups x 64 keys, 64 queries a step");
static_assert(HEAD_DIM % 64 == 0 && HEAD_DIM <= 128, "wgmma rung: head_dim 64 or 128 (dK and dV in registers)");
static_assert(ROW_CHUNKS == CHUNKS && DS_CHUNKS == 8, "whole swizzle atoms");
static_assert(SMEM_BYTES <= 227 * 1024, "tile shape needs more shared memory than an SM has (227 KB)");
static_assert(4 * QT_CHUNKS >= 2 * BLOCK_N * ROW_CHUNKS, "the dK / dV epilogue stages in the Q and dO buffers");

using Tiles = AtomSwizzle<ROW_CHUNKS>;
using DsRows = RowSwizzle<DS_CHUNKS>;  // = AtomSwizzle<8>

// Offset (uint4) of k16 step kt along a K-major tile's rows: 32 bytes within an atom's
// 128-byte row, then the next atom.
__device__ __forceinline__ int k_step(int kt) { return (kt / 4) * 64 + (kt % 4) * 2; }

__global__ void __launch_bounds__(THREADS, 1) varlen_bwd(const BwdParams p) {
  extern __shared__ uint4 smem_base[];
  uint4* smem = smem_base + ((1024 - (static_cast<uint32_t>(__cvta_generic_to_shared(smem_base)) & 1023)) & 1023) / 16;
  uint4* k_smem = smem;
  uint4* v_smem = k_smem + KV_CHUNKS;
  uint4* q_smem = v_smem + KV_CHUNKS;        // [2 stages][BLOCK_M rows]
  uint4* do_smem = q_smem + 2 * QT_CHUNKS;
  uint4* ds_smem = do_smem + 2 * QT_CHUNKS;  // dS^T [DS_STAGES][BLOCK_N keys][BLOCK_M queries]
  float* stats = reinterpret_cast<float*>(ds_smem + DS_STAGES * DS_TILE);  // [2 stages][lse2, delta][BLOCK_M]
  float* dq_smem = stats + 2 * 2 * BLOCK_M;  // PRODUCER: [BLOCK_M][DQ_STRIDE]

  Work w;
  if (!decode_work(p, w)) return;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, wg = warp / 4;
  const int g = lane / 4, c = lane % 4;
  const int key0 = wg * WG_KEYS + (warp % 4) * 16;  // this warp's 16 accumulator rows (keys)
  const int tiles = w.m_end - w.m_begin;

  // PRODUCER's hand-offs. full[s] / empty[s]: query tile stage s copied / free again (every
  // compute warp is done with it). dq_full / dq_empty: a tile's dQ is in dq_smem / was added.
  // A barrier completes a phase once its count has arrived; waiters name the phase's parity.
  __shared__ uint64_t full[2], empty[2], dq_full, dq_empty;
  if constexpr (PRODUCER) {
    if (tid == 0) {
      for (int s = 0; s < 2; ++s) {
        mbarrier_init(&full[s], LOADERS);
        mbarrier_init(&empty[s], CONSUMERS / 32);
      }
      mbarrier_init(&dq_full, CONSUMERS / 32);
      mbarrier_init(&dq_empty, WRITERS);
    }
  }
  load_kv<Tiles, THREADS>(p, w, k_smem, v_smem, tid);
  wait_for_prerequisite_grid();  // the preprocess wrote lse2 / delta and zeroed dQ
  if constexpr (!PRODUCER) {
    if (tiles > 0) load_query_tile<Tiles, THREADS>(p, w, w.m_begin, q_smem, do_smem, stats, tid);
  }
  cp_async_commit();
  if constexpr (PRODUCER) {
    cp_async_wait<0>();
    fence_proxy_async_shared();
    __syncthreads();  // K and V landed, barriers set up: the last CTA-wide barrier
    if (warp >= CONSUMERS / 32) {
      set_max_registers<PRODUCER_REGS, false>();
      if (warp < CONSUMERS / 32 + LOADERS / 32) {
        // Copier: query tile i into stage i % 2 once the compute warps freed it.
        const int ltid = tid - CONSUMERS;
        for (int i = 0; i < tiles; ++i) {
          const int s = i & 1;
          if (i >= 2) mbarrier_wait(&empty[s], ((i / 2) + 1) & 1);
          load_query_tile<Tiles, LOADERS>(p, w, w.m_begin + i, q_smem + s * QT_CHUNKS, do_smem + s * QT_CHUNKS,
                                          stats + s * 2 * BLOCK_M, ltid);
          cp_async_commit();
          cp_async_wait<0>();
          fence_proxy_async_shared();  // for wgmma's (async proxy) reads
          mbarrier_arrive(&full[s]);
        }
      } else {
        // dQ adder: each tile's dQ from dq_smem into the accumulator, 16 bytes a time, in
        // key-tile order when deterministic (one thread waits, then a barrier of the adders).
        const int atid = tid - CONSUMERS - LOADERS;
        for (int i = 0; i < tiles; ++i) {
          const int m = w.m_begin + i;
          mbarrier_wait(&dq_full, i & 1);
          int* sem = p.semaphores ? dq_semaphore(p, w, m) : nullptr;
          if (sem) {
            if (atid == 0) {
              const int turn = query_tile(p, w, m).turn;
              for (int spin = 0; load_acquire(sem) < turn && spin < (1 << 22); ++spin) __nanosleep(1000);
            }
            named_barrier(3, WRITERS);
          }
          for (int idx = atid; idx < BLOCK_M * (HEAD_DIM / 4); idx += WRITERS) {
            const int row = idx / (HEAD_DIM / 4), col = (idx % (HEAD_DIM / 4)) * 4;
            float* dst = dq_row(p, w, m * BLOCK_M + row);
            if (dst) atomicAdd(reinterpret_cast<float4*>(dst + col), *reinterpret_cast<const float4*>(dq_smem + row * DQ_STRIDE + col));
          }
          if (sem) {
            named_barrier(3, WRITERS);
            if (atid == 0) {
              __threadfence();
              atomicAdd(sem, 1);
            }
          }
          mbarrier_arrive(&dq_empty);
        }
      }
      allow_dependent_launch();
      return;
    }
    set_max_registers<CONSUMER_REGS, true>();
  }

  // Descriptors. K-major: K, V as A (this warpgroup's keys), Q, dO as B of S^T / dP^T.
  // MN-major: Q, dO as B of dK / dV, K as B of dQ (this warpgroup's head_dim columns), dS^T as
  // the transposed A of dQ.
  const uint64_t k_desc = wgmma_desc(k_smem + wg * WG_KEYS * ROW_CHUNKS, 16, GROUP_BYTES);
  const uint64_t v_desc = wgmma_desc(v_smem + wg * WG_KEYS * ROW_CHUNKS, 16, GROUP_BYTES);
  const uint64_t q_desc = wgmma_desc(q_smem, 16, GROUP_BYTES);
  const uint64_t do_desc = wgmma_desc(do_smem, 16, GROUP_BYTES);
  const uint64_t qt_desc = wgmma_desc(q_smem, 1024, GROUP_BYTES);
  const uint64_t dot_desc = wgmma_desc(do_smem, 1024, GROUP_BYTES);
  const uint64_t kt_desc = wgmma_desc(k_smem + Tiles::at(0, wg * DQ_N / 8), 1024, GROUP_BYTES);
  const uint64_t ds_desc = wgmma_desc(ds_smem, 1024, DS_CHUNKS * 128);

  float dk[D_TILES * 4], dv[D_TILES * 4];
#pragma unroll
  for (int i = 0; i < D_TILES * 4; ++i) dk[i] = dv[i] = 0.f;
  auto& dk4 = reinterpret_cast<float(&)[D_TILES][4]>(dk);
  auto& dv4 = reinterpret_cast<float(&)[D_TILES][4]>(dv);
  const float sl2 = p.scale_log2;

  for (int m = w.m_begin; m < w.m_end; ++m) {
    const int i = m - w.m_begin, stage = i & 1;
    if constexpr (PRODUCER) {
      mbarrier_wait(&full[stage], (i / 2) & 1);
    } else {
      cp_async_wait<0>();
      fence_proxy_async_shared();  // the copies, before wgmma reads them
      __syncthreads();  // tile m landed for all; every MMA of tile m - 1 is done (its stage, dS^T)
      if (m + 1 < w.m_end)
        load_query_tile<Tiles, THREADS>(p, w, m + 1, q_smem + (stage ^ 1) * QT_CHUNKS, do_smem + (stage ^ 1) * QT_CHUNKS,
                                        stats + (stage ^ 1) * 2 * BLOCK_M, tid);
      cp_async_commit();
    }
    const int qs = stage * QT_CHUNKS;
    // dS^T buffer of this tile: with PRODUCER two alternate, so writing tile i's only needs
    // tile i - 2's dQ done, which both warpgroups finished before meeting for tile i - 1.
    uint32_t* ds32 = reinterpret_cast<uint32_t*>(ds_smem + (PRODUCER ? stage : 0) * DS_TILE);
    const uint64_t ds_tile_desc = ds_desc + (PRODUCER ? stage : 0) * DS_TILE;
    const float* lse2 = stats + stage * 2 * BLOCK_M;
    const float* delta = lse2 + BLOCK_M;
    const QueryTile tile = query_tile(p, w, m);

    // S^T = K Q^T and dP^T = V dO^T, then P^T while dP^T finishes.
    float s[Q_TILES * 4], dp[Q_TILES * 4];
    wgmma_fence();
    Wgmma<T, BLOCK_M>::ss<0, 0>(s, k_desc, q_desc + qs);
#pragma unroll
    for (int kt = 1; kt < HEAD_DIM / 16; ++kt) Wgmma<T, BLOCK_M>::ss<1, 0>(s, k_desc + k_step(kt), q_desc + qs + k_step(kt));
    wgmma_commit();
    Wgmma<T, BLOCK_M>::ss<0, 0>(dp, v_desc, do_desc + qs);
#pragma unroll
    for (int kt = 1; kt < HEAD_DIM / 16; ++kt)
      Wgmma<T, BLOCK_M>::ss<1, 0>(dp, v_desc + k_step(kt), do_desc + qs + k_step(kt));
    wgmma_commit();
    auto& s4 = reinterpret_cast<float(&)[Q_TILES][4]>(s);
    auto& dp4 = reinterpret_cast<float(&)[Q_TILES][4]>(dp);
    if constexpr (SOFT_CAP) {  // dS^T needs tanh of S^T too: both at once, after both GEMMs
      wgmma_wait<0>();
      wgmma_pin(s);
      wgmma_pin(dp);
      capped_scores_to_dscores(s4, dp4, lse2, delta, sl2, p.cap_scale, 0, c);
    } else {
      wgmma_wait<1>();
      wgmma_pin(s);
      scores_to_probs(s4, lse2, sl2, 0, c);
      wgmma_wait<0>();
      wgmma_pin(dp);
      probs_to_dscores(s4, dp4, delta, 0, c);
    }
    if (tile.masked) mask_hidden(p, w, m, key0, 0, g, c, s4, dp4);

    // dS^T -> shared memory (T), for dQ; P^T and dS^T as A fragments.
#pragma unroll
    for (int nt = 0; nt < Q_TILES; ++nt) {
      ds32[DsRows::at(key0 + g, nt) * 4 + c] = pack2<T>(dp4[nt][0], dp4[nt][1]);
      ds32[DsRows::at(key0 + g + 8, nt) * 4 + c] = pack2<T>(dp4[nt][2], dp4[nt][3]);
    }
    uint32_t pa[BLOCK_M / 16][4], da[BLOCK_M / 16][4];
#pragma unroll
    for (int kk = 0; kk < BLOCK_M / 16; ++kk) {
      a_fragment(pa[kk], s4, kk);
      a_fragment(da[kk], dp4, kk);
    }

    // dV += P^T dO.
    wgmma_pin(dv);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BLOCK_M / 16; ++kk) Wgmma<T, HEAD_DIM>::rs<1>(dv, pa[kk], dot_desc + qs + kk * ROWS16);
    wgmma_commit();
    fence_proxy_async_shared();  // dS^T, before wgmma reads it
    named_barrier(1, CONSUMERS);  // both warpgroups' dS^T written

    // dQ = dS K (this warpgroup's columns), then dK += dS^T Q.
    float dq[DQ_N / 2];
    wgmma_pin(dk);
    wgmma_fence();
    Wgmma<T, DQ_N>::ss<0, 1, 1>(dq, ds_tile_desc, kt_desc);
#pragma unroll
    for (int kk = 1; kk < BLOCK_N / 16; ++kk)
      Wgmma<T, DQ_N>::ss<1, 1, 1>(dq, ds_tile_desc + kk * 16 * DS_CHUNKS, kt_desc + kk * ROWS16);
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < BLOCK_M / 16; ++kk) Wgmma<T, HEAD_DIM>::rs<1>(dk, da[kk], qt_desc + qs + kk * ROWS16);
    wgmma_commit();
    wgmma_wait<1>();  // dV and dQ done; dK runs on under the atomics
    wgmma_pin(dq);

    auto& dq4 = reinterpret_cast<float(&)[DQ_N / 8][4]>(dq);
    const int row = (warp % 4) * 16 + g;  // this thread's dQ rows: row, row + 8
    if constexpr (PRODUCER) {
      // Hand dQ to the adders: into dq_smem once they added the previous tile's.
      if (i > 0) mbarrier_wait(&dq_empty, (i - 1) & 1);
#pragma unroll
      for (int j = 0; j < DQ_N / 8; ++j) {
        const int col = wg * DQ_N + j * 8 + 2 * c;
        *reinterpret_cast<float2*>(dq_smem + row * DQ_STRIDE + col) = make_float2(dq4[j][0], dq4[j][1]);
        *reinterpret_cast<float2*>(dq_smem + (row + 8) * DQ_STRIDE + col) = make_float2(dq4[j][2], dq4[j][3]);
      }
      __syncwarp();
      if (lane == 0) mbarrier_arrive(&dq_full);
    } else {
      int* sem = p.semaphores ? dq_semaphore(p, w, m) : nullptr;
      if (sem) wait_turn(sem, tile.turn);
      float* row_g = dq_row(p, w, m * BLOCK_M + row);
      float* row_g8 = dq_row(p, w, m * BLOCK_M + row + 8);
#pragma unroll
      for (int j = 0; j < DQ_N / 8; ++j) {
        const int col = wg * DQ_N + j * 8;
        add_dq(row_g ? row_g + col : nullptr, row_g8 ? row_g8 + col : nullptr, dq4[j], c);
      }
      if (sem) pass_turn(sem);
    }
    wgmma_wait<0>();
    wgmma_pin(dk);
    wgmma_pin(dv);
    if constexpr (PRODUCER) {
      if (lane == 0) mbarrier_arrive(&empty[stage]);  // this warp is done with the stage
    }
  }
  allow_dependent_launch();

  // Epilogue: dK (times scale) and dV through the Q / dO buffers (free once the copies landed
  // and both warpgroups are done with their last tile).
  cp_async_wait<0>();
  named_barrier(2, CONSUMERS);
  store_dk_dv<D_TILES, CONSUMERS>(p, w, dk4, dv4, key0, g, c, [](int t) { return t; }, q_smem, tid,
                                  [] { named_barrier(2, CONSUMERS); });
}
