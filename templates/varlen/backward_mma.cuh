// The backward's main kernel on mma.sync (m16n8k16; sm_80 and later), included by backward.cu.j2
// (with backward_common.cuh: loads, score math, mask, dQ atomics, epilogue).
//
// A CTA holds one tile of BLOCK_N keys (K and V in shared memory) and walks the query tiles
// that see them, BLOCK_M packed rows at a time, Q / dO / lse / delta double-buffered through
// cp.async. With the keys as the MMA rows, per query tile:
//   S^T  = K Q^T, dP^T = V dO^T                      (fp32 accumulators)
//   P^T  = exp2(S^T * scale_log2 - lse2)              (0 where masked)
//   dS^T = P^T * (dP^T - delta)
//   (SOFT_CAP: S^T is first capped, tanh(scale S^T / cap), and dS^T takes its slope 1 - tanh^2)
//   dV  += P^T dO, dK += dS^T Q                       (registers, the whole walk)
//   dQ  += dS K  -> fp32 atomics into the accumulator (dS^T through shared memory)
// Warps: WARPS_N x WARPS_Q. Each warp owns 16 keys; with WARPS_Q = 1 (head_dim <= 128) it
// computes S^T for all BLOCK_M queries and keeps P^T / dS^T in registers as the A operand of
// dV / dK, with all head_dim columns of dK and dV. With WARPS_Q = 2 the two warps of a key
// group split the queries for S^T and the head_dim columns for dK / dV (half the
// accumulators: head_dim 256 fits), so P^T goes through shared memory too. dQ is computed
// by all warps over (16-row tiles x column groups) from dS^T in shared memory.

constexpr int WARPS_N = BLOCK_N / 16;
constexpr int WARPS = WARPS_N * WARPS_Q;
constexpr int THREADS = WARPS * 32;
constexpr int DS_CHUNKS = BLOCK_M / 8;            // shared row of dS^T / P^T (BLOCK_M queries)
constexpr int WARP_Q = BLOCK_M / WARPS_Q;         // queries of S^T per warp
constexpr int Q_TILES = WARP_Q / 8;               // n8 tiles of S^T per warp
constexpr int D_PAIRS = HEAD_DIM / 16;            // 16-column pairs of n8 tiles along head_dim
constexpr int KV_PAIRS = (D_PAIRS + WARPS_Q - 1) / WARPS_Q;  // dK / dV pairs per warp (pair warp_q + i * WARPS_Q)
constexpr int ROW_TILES = BLOCK_M / 16;           // dQ: 16-row tiles
constexpr int DQ_GROUPS = WARPS / ROW_TILES;      // dQ: column groups (pair group + i * DQ_GROUPS)
constexpr int DQ_PAIRS = (D_PAIRS + DQ_GROUPS - 1) / DQ_GROUPS;
constexpr int DQ_CHUNK = 4;                       // dQ pairs accumulated at a time (32 floats)
constexpr int DQ_CHUNKS = (DQ_PAIRS + DQ_CHUNK - 1) / DQ_CHUNK;
static_assert(BLOCK_N % 16 == 0 && (BLOCK_M == 64 || BLOCK_M == 128), "tile shape");
static_assert(WARPS_Q == 1 || WARPS_Q == 2, "warps_q is 1 or 2");
static_assert(Q_TILES % 2 == 0, "ldmatrix.x4 loads two n8 tiles of Q at a time");
static_assert(WARPS % ROW_TILES == 0, "dQ: whole column groups of 16-row warps");
static_assert(BLOCK_N <= 2 * BLOCK_M, "the dK / dV epilogue stages in the Q and dO buffers");

constexpr int KV_CHUNKS = BLOCK_N * ROW_CHUNKS;
constexpr int QT_CHUNKS = BLOCK_M * ROW_CHUNKS;   // one stage of Q (or dO)
constexpr int DS_TILE = BLOCK_N * DS_CHUNKS;
// The main kernel's dynamic shared memory.
struct SharedStorage {
  uint4 k[KV_CHUNKS];
  uint4 v[KV_CHUNKS];
  uint4 q[2 * QT_CHUNKS];     // [2 stages][BLOCK_M][ROW_CHUNKS]
  uint4 dout[2 * QT_CHUNKS];
  uint4 ds[(WARPS_Q == 2 ? 2 : 1) * DS_TILE];  // dS^T [BLOCK_N][DS_CHUNKS], then (WARPS_Q == 2) P^T
  float stats[2 * STAT_ARRAYS * BLOCK_M];      // [2 stages][STAT_ARRAYS][BLOCK_M]
};
constexpr int SMEM_BYTES = sizeof(SharedStorage);
static_assert(SMEM_BYTES <= 227 * 1024, "tile shape needs more shared memory than an SM has (227 KB)");

using Rows = RowSwizzle<ROW_CHUNKS>;
using DsRows = RowSwizzle<BLOCK_M / 8>;

__global__ void __launch_bounds__(THREADS, 1) varlen_bwd(const BwdParams p) {
  extern __shared__ uint4 smem[];
  SharedStorage& shared = *reinterpret_cast<SharedStorage*>(smem);
  uint4* k_smem = shared.k;
  uint4* v_smem = shared.v;
  uint4* q_smem = shared.q;
  uint4* do_smem = shared.dout;
  uint4* ds_smem = shared.ds;
  uint4* pt_smem = shared.ds + DS_TILE;  // P^T, WARPS_Q == 2 only
  float* stats = shared.stats;

  Work w;
  if (!decode_work(p, w)) return;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int warp_n = warp % WARPS_N, warp_q = warp / WARPS_N;
  const int g = lane / 4, c = lane % 4, l7 = lane % 8;
  const int key0 = warp_n * 16;                        // this warp's keys in the tile
  const int q0 = WARPS_Q == 1 ? 0 : warp_q * WARP_Q;   // its queries of S^T

  load_kv<Rows, THREADS>(p, w, k_smem, v_smem, tid);
  wait_for_prerequisite_grid();  // the preprocess wrote lse2 / delta and zeroed dQ
  if (w.m_begin < w.m_end) load_query_tile<Rows, THREADS>(p, w, w.m_begin, q_smem, do_smem, stats, tid);
  cp_async_commit();

  // ldmatrix offsets (uint4 units) for k-step (or column pair) k % 4, as in the forward: every
  // row a lane addresses has row % 8 == lane % 8, so chunk 2k + bit of it sits at
  // 8 * (k / 4) + ((2 * (k % 4) + bit) ^ lane % 8).
  int a_frag[4];   // A from [rows][k] (K, V: this warp's 16 keys)
  int b_frag[4];   // B pairs from [n][k] (Q, dO for S^T / dP^T: 16 queries)
  int t_frag[4];   // B pairs from [k][n], transposed (dO, Q for dV / dK; K for dQ)
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    a_frag[k] = (key0 + lane % 16) * ROW_CHUNKS + ((2 * k + lane / 16) ^ l7);
    b_frag[k] = (q0 + (lane / 16) * 8 + l7) * ROW_CHUNKS + ((2 * k + (lane / 8) % 2) ^ l7);
    t_frag[k] = (((lane / 8) % 2) * 8 + l7) * ROW_CHUNKS + ((2 * k + lane / 16) ^ l7);
  }
  // P^T / dS^T as A from [keys][queries] (WARPS_Q == 2), and dS as A for dQ (transposed).
  int pt_frag[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) pt_frag[k] = (key0 + lane % 16) * DS_CHUNKS + ((2 * k + lane / 16) ^ l7);
  const int dq_tile = warp % ROW_TILES, dq_group = warp / ROW_TILES;
  const int dq_frag = ((lane / 16) * 8 + l7) * DS_CHUNKS + ((2 * dq_tile + (lane / 8) % 2) ^ l7);

  float dk[KV_PAIRS * 2][4], dv[KV_PAIRS * 2][4];
#pragma unroll
  for (int i = 0; i < KV_PAIRS * 2; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[i][e] = dv[i][e] = 0.f;

  const float sl2 = p.scale_log2;
  uint32_t* ds32 = reinterpret_cast<uint32_t*>(ds_smem);
  uint32_t* pt32 = reinterpret_cast<uint32_t*>(pt_smem);

  for (int m = w.m_begin; m < w.m_end; ++m) {
    const int stage = (m - w.m_begin) & 1;
    cp_async_wait<0>();
    __syncthreads();  // tile m landed for all; everyone is done with tile m - 1 (its stage, dS^T)
    if (m + 1 < w.m_end)
      load_query_tile<Rows, THREADS>(p, w, m + 1, q_smem + (stage ^ 1) * QT_CHUNKS, do_smem + (stage ^ 1) * QT_CHUNKS,
                                     stats + (stage ^ 1) * STAT_ARRAYS * BLOCK_M, tid);
    cp_async_commit();
    const uint4* qs = q_smem + stage * QT_CHUNKS;
    const uint4* dos = do_smem + stage * QT_CHUNKS;
    const float* lse2 = stats + stage * STAT_ARRAYS * BLOCK_M;
    const float* delta = lse2 + BLOCK_M;
    const QueryTile tile = query_tile(p, w, m);

    // S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys and WARP_Q queries.
    float s[Q_TILES][4], dp[Q_TILES][4];
#pragma unroll
    for (int nt = 0; nt < Q_TILES; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = dp[nt][e] = 0.f;
#pragma unroll
    for (int kt = 0; kt < HEAD_DIM / 16; ++kt) {
      uint32_t ka[4], va[4];
      ldmatrix_x4(ka, k_smem + a_frag[kt % 4] + (kt / 4) * 8);
      ldmatrix_x4(va, v_smem + a_frag[kt % 4] + (kt / 4) * 8);
#pragma unroll
      for (int np = 0; np < Q_TILES / 2; ++np) {
        uint32_t b[4];
        ldmatrix_x4(b, qs + b_frag[kt % 4] + np * 16 * ROW_CHUNKS + (kt / 4) * 8);
        mma_16x8x16<T>(s[2 * np], ka, b[0], b[1]);
        mma_16x8x16<T>(s[2 * np + 1], ka, b[2], b[3]);
        ldmatrix_x4(b, dos + b_frag[kt % 4] + np * 16 * ROW_CHUNKS + (kt / 4) * 8);
        mma_16x8x16<T>(dp[2 * np], va, b[0], b[1]);
        mma_16x8x16<T>(dp[2 * np + 1], va, b[2], b[3]);
      }
    }

    // P^T and dS^T (in place of S^T and dP^T); masked only on boundary tiles.
    {
      float2 l[Q_TILES], d[Q_TILES];
      load_row_stats(l, lse2, q0, c);
      load_row_stats(d, delta, q0, c);
      if constexpr (ScoreMod::KV_AFFINE) {
        affine_scores_to_probs(s, lse2, q0, c, key0, g, sl2);
        probs_to_dscores(s, dp, d);
      } else if constexpr (ScoreMod::ACTIVE) {
        scored_probs_to_dscores(p, w, m, key0, q0, g, c, s, dp, l, d, sl2);
      } else {
        scores_to_probs(s, l, sl2);
        probs_to_dscores(s, dp, d);
      }
    }
    if (tile.masked) mask_hidden(p, w, m, key0, q0, g, c, tile.hook, s, dp);

    // dS^T -> shared memory (T), for dQ; with WARPS_Q = 2 also P^T, for the partner warp.
#pragma unroll
    for (int nt = 0; nt < Q_TILES; ++nt) {
      const int chunk = (q0 + nt * 8) / 8;
      ds32[DsRows::at(key0 + g, chunk) * 4 + c] = pack2<T>(dp[nt][0], dp[nt][1]);
      ds32[DsRows::at(key0 + g + 8, chunk) * 4 + c] = pack2<T>(dp[nt][2], dp[nt][3]);
      if constexpr (WARPS_Q == 2) {
        pt32[DsRows::at(key0 + g, chunk) * 4 + c] = pack2<T>(s[nt][0], s[nt][1]);
        pt32[DsRows::at(key0 + g + 8, chunk) * 4 + c] = pack2<T>(s[nt][2], s[nt][3]);
      }
    }

    // dV += P^T dO and dK += dS^T Q over the tile's BLOCK_M queries (16 at a time).
    if constexpr (WARPS_Q == 1) {
#pragma unroll
      for (int kk = 0; kk < BLOCK_M / 16; ++kk) {
        uint32_t pa[4], da[4];
        a_fragment(pa, s, kk);
        a_fragment(da, dp, kk);
#pragma unroll
        for (int i = 0; i < KV_PAIRS; ++i) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, dos + t_frag[i % 4] + kk * 16 * ROW_CHUNKS + (i / 4) * 8);
          mma_16x8x16<T>(dv[2 * i], pa, b[0], b[1]);
          mma_16x8x16<T>(dv[2 * i + 1], pa, b[2], b[3]);
          ldmatrix_x4_trans(b, qs + t_frag[i % 4] + kk * 16 * ROW_CHUNKS + (i / 4) * 8);
          mma_16x8x16<T>(dk[2 * i], da, b[0], b[1]);
          mma_16x8x16<T>(dk[2 * i + 1], da, b[2], b[3]);
        }
      }
      __syncthreads();  // dS^T complete
    } else {
      __syncthreads();  // P^T and dS^T complete
#pragma unroll
      for (int kk = 0; kk < BLOCK_M / 16; ++kk) {
        uint32_t pa[4], da[4];
        ldmatrix_x4(pa, pt_smem + pt_frag[kk % 4] + (kk / 4) * 8);
        ldmatrix_x4(da, ds_smem + pt_frag[kk % 4] + (kk / 4) * 8);
#pragma unroll
        for (int i = 0; i < KV_PAIRS; ++i) {
          const int pair = warp_q + i * WARPS_Q;
          if (pair < D_PAIRS) {
            uint32_t b[4];
            ldmatrix_x4_trans(b, dos + t_frag[pair % 4] + kk * 16 * ROW_CHUNKS + (pair / 4) * 8);
            mma_16x8x16<T>(dv[2 * i], pa, b[0], b[1]);
            mma_16x8x16<T>(dv[2 * i + 1], pa, b[2], b[3]);
            ldmatrix_x4_trans(b, qs + t_frag[pair % 4] + kk * 16 * ROW_CHUNKS + (pair / 4) * 8);
            mma_16x8x16<T>(dk[2 * i], da, b[0], b[1]);
            mma_16x8x16<T>(dk[2 * i + 1], da, b[2], b[3]);
          }
        }
      }
    }

    // dQ += dS K: this warp's 16 rows (dq_tile) and column pairs dq_group + i * DQ_GROUPS,
    // DQ_CHUNK pairs at a time, added to the fp32 accumulator (in key-tile order when
    // deterministic: the first chunk is computed before the wait).
    int* sem = p.semaphores ? dq_semaphore(p, w, m) : nullptr;
    const int pr_g = m * BLOCK_M + dq_tile * 16 + g;
    float* row_g = dq_row(p, w, pr_g);
    float* row_g8 = dq_row(p, w, pr_g + 8);
#pragma unroll
    for (int ci = 0; ci < DQ_CHUNKS; ++ci) {
      float acc[DQ_CHUNK * 2][4];
#pragma unroll
      for (int i = 0; i < DQ_CHUNK * 2; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
        uint32_t a[4];
        ldmatrix_x4_trans(a, ds_smem + dq_frag + kk * 16 * DS_CHUNKS);
#pragma unroll
        for (int i = 0; i < DQ_CHUNK; ++i) {
          const int pair = dq_group + (ci * DQ_CHUNK + i) * DQ_GROUPS;
          if (ci * DQ_CHUNK + i < DQ_PAIRS && pair < D_PAIRS) {
            uint32_t b[4];
            ldmatrix_x4_trans(b, k_smem + t_frag[pair % 4] + kk * 16 * ROW_CHUNKS + (pair / 4) * 8);
            mma_16x8x16<T>(acc[2 * i], a, b[0], b[1]);
            mma_16x8x16<T>(acc[2 * i + 1], a, b[2], b[3]);
          }
        }
      }
      if (ci == 0 && sem) wait_turn(sem, tile.turn);
#pragma unroll
      for (int i = 0; i < DQ_CHUNK; ++i) {
        const int pair = dq_group + (ci * DQ_CHUNK + i) * DQ_GROUPS;
        if (ci * DQ_CHUNK + i < DQ_PAIRS && pair < D_PAIRS) {
          add_dq(row_g ? row_g + pair * 16 : nullptr, row_g8 ? row_g8 + pair * 16 : nullptr, acc[2 * i], c);
          add_dq(row_g ? row_g + pair * 16 + 8 : nullptr, row_g8 ? row_g8 + pair * 16 + 8 : nullptr, acc[2 * i + 1], c);
        }
      }
    }
    if (sem) pass_turn(sem);
  }
  allow_dependent_launch();

  // Epilogue: dK (times scale) and dV through the Q / dO buffers (free once the copies landed).
  cp_async_wait<0>();
  __syncthreads();
  store_dk_dv<KV_PAIRS * 2, THREADS>(p, w, dk, dv, key0, g, c, [&](int t) {
    const int pair = WARPS_Q == 1 ? t / 2 : warp_q + (t / 2) * WARPS_Q;
    return pair < D_PAIRS ? pair * 2 + t % 2 : -1;
  }, q_smem, tid, [] { __syncthreads(); });
}
