{# The wgmma backward's compile-time shape: warpgroup roles, register split, shared-memory
   budget and tile offsets (included by backward_wgmma.cuh). #}
constexpr int WARPGROUPS = 2;                  // compute warpgroups
constexpr int CONSUMERS = WARPGROUPS * 128;
constexpr int THREADS = CONSUMERS + (PRODUCER ? 128 : 0);
constexpr int LOADER_WARP = CONSUMERS / 32, WRITER_WARP = LOADER_WARP + 1;  // PRODUCER; warps 10-11 idle
constexpr int STORER_WARP = LOADER_WARP + 2;  // PERSISTENT: stores each item's dK / dV (warp 11 idle)
{# consumer_regs (VarlenBackwardSpec.default_consumer_regs): 240 lets ptxas issue D128's wgmmas back to back. #}
{% if consumer_regs == 240 %}
constexpr int PRODUCER_REGS = 24, CONSUMER_REGS = 240;  // ptxas, D128: wgmmas not serialized; the producer spills
// setmaxnreg moves registers within what the launch gave the CTA (168 a thread at 384 threads):
// asking for more than that pool waits forever (32 / 240 hung on the H200).
static_assert(128 * PRODUCER_REGS + CONSUMERS * CONSUMER_REGS <= 168 * THREADS, "register pool of the launch");
{% else %}
constexpr int PRODUCER_REGS = 56, CONSUMER_REGS = 224;  // ptxas: 4 bytes spilled at D128 (36 at 48 / 232, 288 at 72 / 216)
{% endif %}
static_assert(!PRODUCER || 128 * PRODUCER_REGS + CONSUMERS * CONSUMER_REGS <= 65536, "register budget");
// DKV_SPLIT (head_dim 256, WARPS_Q = 2; FlashAttention-3's hdim256 split): 64 keys a CTA, both
// warpgroups on all of them; each holds dK / dV of its half of the head_dim columns (64 + 64
// registers instead of 128 + 128) and computes S^T / dP^T for its half of the queries, whose P^T
// and dS^T it writes to shared memory for the other's dV / dK.
constexpr bool DKV_SPLIT = WARPS_Q == 2;
constexpr int WG_KEYS = 64;                    // keys per warpgroup (the MMA's M)
constexpr int SN = DKV_SPLIT ? BLOCK_M / WARPGROUPS : BLOCK_M;  // queries of S^T per warpgroup
constexpr int Q_TILES = SN / 8;                // n8 tiles of S^T per warp
constexpr int DKV_N = DKV_SPLIT ? HEAD_DIM / WARPGROUPS : HEAD_DIM;  // dK / dV columns per warpgroup
constexpr int D_TILES = DKV_N / 8;             // n8 tiles of dK / dV
constexpr int DQ_N = HEAD_DIM / WARPGROUPS;    // dQ columns per warpgroup
constexpr int DQ_SLICES = DKV_SPLIT ? 2 : 1;   // dQ MMAs (and atomics) a tile, DQ_SN columns each
constexpr int DQ_SN = DQ_N / DQ_SLICES;
// DQ_T (80 query rows, TILE80_HEAD_DIMS): dQ^T = K^T dS^T, since wgmma's M is 64 and dQ = dS K
// would need M = 80; dS then lies query-major (QTiles' layout, keys as the columns: the K-major
// B of dQ^T), written from the S^T-shaped fragments by stmatrix .trans; one dQ hand-off buffer.
constexpr bool DQ_T = BLOCK_M == 80;
constexpr int DS_CHUNKS = BLOCK_M / 8;         // a row of dS^T: one swizzle atom wide (not DQ_T)
constexpr int GROUP_BYTES = ROW_CHUNKS * 128;  // 8 rows of a K / V tile
constexpr int ROWS16 = 2 * GROUP_BYTES / 16;   // 16 rows of a K / V tile, in uint4
constexpr int QBLOCK = BLOCK_M * 8;            // a 64-column block of a Q / dO tile, in uint4
constexpr int KV_CHUNKS = BLOCK_N * ROW_CHUNKS;
constexpr int QT_CHUNKS = BLOCK_M * ROW_CHUNKS;
constexpr int DS_TILE = BLOCK_N * DS_CHUNKS;
constexpr int STAGES = 2;                      // query tiles in flight (Q, dO, lse2, delta)
// DKV_SPLIT: one stage, so its 16 KB hold DQ_SCRATCH (each warpgroup then waits, before writing
// a tile's P^T / dS^T, for the other to finish reading the last tile's: barriers 4 and 5).
{% if dq_kernel %}
// DQ_KERNEL (dQ by varlen_bwd_dq): no scratch, so two stages again; both warpgroups' dV / dK of
// tile i - 2 are done before either passes barrier 1 of tile i - 1 (no barriers 4 and 5).
constexpr int DS_STAGES = 2;
{% else %}
constexpr int DS_STAGES = PRODUCER && !DKV_SPLIT ? 2 : 1;
{% endif %}
constexpr int DS_TILES = DKV_SPLIT ? 2 : 1;    // a stage's dS^T, and with DKV_SPLIT P^T after it
// dQ hand-off buffers of the bulk add; 0: the compute warpgroups add dQ from registers (vector
// atomics; DKV_SPLIT: 64 KB a buffer does not fit beside two Q / dO stages, nor does
// FlashAttention-3's at hdim256).
constexpr int DQ_STAGES = PRODUCER && !DKV_SPLIT ? (DQ_T ? 1 : 2) : 0;
constexpr int DQ_TILE = BLOCK_M * HEAD_DIM;    // floats of one dQ hand-off buffer
// DKV_SPLIT: each warp's 8 rows x DQ_SN columns of dQ, where its fragments are turned into rows
// so that each vector atomic instruction adds 4 whole 128-byte lines instead of 16 rows' 32
// bytes. The L2's fp32 reductions bound this kernel (64 KB of dQ a step), and whole lines add
// faster (notes/template-figures.md, "backward_wgmma.cuh").
{% if dq_kernel %}
constexpr int DQ_SCRATCH = 0;
static_assert(DKV_SPLIT && PRODUCER, "dq_kernel: the head_dim 256 split with the producer");
{% else %}
constexpr int DQ_SCRATCH = DKV_SPLIT ? CONSUMERS / 32 * 8 * DQ_SN : 0;  // floats
{% endif %}
// wgmma's atoms must be 1024-aligned: room to align the dynamic shared memory base.
// The main kernel's dynamic shared memory (above the 1024-byte alignment of wgmma's atoms).
struct SharedStorage {
  uint4 k[KV_CHUNKS];
  uint4 v[KV_CHUNKS];
  uint4 q[STAGES * QT_CHUNKS];     // [STAGES][QT_CHUNKS]
  uint4 dout[STAGES * QT_CHUNKS];
  uint4 ds[DS_STAGES * DS_TILES * DS_TILE];  // dS^T (, P^T) [DS_STAGES][DS_TILES][BLOCK_N keys][BLOCK_M queries]
  // The dQ hand-off buffers [DQ_STAGES][DQ_TILE] (none with DKV_SPLIT), then lse2 / delta
  // [STAGES][STAT_ARRAYS][BLOCK_M]: one array, so that a zero DQ_STAGES moves nothing.
  float dq_and_stats[DQ_STAGES * DQ_TILE + STAGES * STAT_ARRAYS * BLOCK_M];
  float dq_scratch[DQ_SCRATCH > 0 ? DQ_SCRATCH : 1];  // DKV_SPLIT: [warp][8 rows][DQ_SN]
};
constexpr int SMEM_BYTES = offsetof(SharedStorage, dq_scratch) + DQ_SCRATCH * 4 + 1024;
static_assert(BLOCK_N == (DKV_SPLIT ? 64 : 128) && (BLOCK_M == 64 || (DQ_T && PRODUCER && !PERSISTENT)),
              "wgmma rung: 2 warpgroups x 64 keys (DKV_SPLIT: both on 64), 64 queries a step (80: DQ_T, "
              "with the producer, a CTA per key tile)");
static_assert(!DQ_T || (HEAD_DIM == 128 && !DKV_SPLIT && DQ_N == 64), "DQ_T: head_dim 128, each warpgroup 64 of dQ^T's rows");
static_assert(HEAD_DIM % 64 == 0 && (DKV_SPLIT ? HEAD_DIM == 256 : HEAD_DIM <= 128),
              "wgmma rung: head_dim 64 or 128, or 256 with DKV_SPLIT (dK and dV in registers)");
static_assert(ROW_CHUNKS == CHUNKS && (DQ_T || DS_CHUNKS == 8), "whole swizzle atoms");
static_assert(!DKV_SPLIT || (DQ_STAGES == 0 && DQ_SN == 64), "DKV_SPLIT: dQ by atomics, in 64-column slices");
static_assert(SMEM_BYTES <= 227 * 1024, "tile shape needs more shared memory than an SM has (227 KB)");
static_assert(2 * STAGES * QT_CHUNKS >= 2 * BLOCK_N * ROW_CHUNKS, "the dK / dV epilogue stages in the Q and dO buffers");
// PERSISTENT (VarlenBackwardSpec persistent; cuDNN's bprop launches one CTA per SM too): a CTA
// walks many key tiles (work items). Between two items the compute warps only stage dK / dV in
// shared memory and go on: the storer warp copies them out (TMA stores of 8-row boxes) under the
// next item's first tile, and the loader has copied that item's K / V and first query tiles
// meanwhile, so an item's start (K / V and first-tile latency) and most of its epilogue
// leave the critical path. The staging is the dQ hand-off buffers
// (free once the last bulk add read them; the next item's first hand-off waits for the
// storer), not the Q / dO stages the loader is filling; the stage and dQ-buffer rings run on
// across items (`ring`: the query tiles of earlier items). K / V come by the loader's TMA (a
// partial tile, zeros past the keys, by its cp.async), on kv_full / kv_empty, issued after the
// item's first query tile so that both land while the compute warps stage the last item's dK /
// dV; the staging on staged / stored.
static_assert(!PERSISTENT || (PRODUCER && !DKV_SPLIT && DQ_STAGES > 0), "persistent: the producer and the dQ bulk add");
static_assert(!PERSISTENT || 2 * BLOCK_N * ROW_CHUNKS * 16 <= DQ_STAGES * DQ_TILE * 4,
              "persistent: the dK / dV epilogue stages in the dQ hand-off buffers");
static_assert(!PERSISTENT || (HEAD_DIM % 64 == 0 && BLOCK_N % 8 == 0), "persistent: dK / dV in 8-row x 128-byte boxes");
static_assert(!PERSISTENT || (2 * KV_CHUNKS + 2 * STAGES * QT_CHUNKS + DS_STAGES * DS_TILES * DS_TILE) % 64 == 0,
              "persistent: the staging (the dQ buffers) 1024-byte aligned for the TMA stores' swizzle");

using Tiles = AtomSwizzle<ROW_CHUNKS>;
using DsRows = RowSwizzle<DS_CHUNKS>;  // = AtomSwizzle<8>
// Q / dO: 64-column blocks of all BLOCK_M rows, each block rows of one 128-byte swizzle row.
struct QTiles {
  __device__ __forceinline__ static int at(int row, int chunk) {
    return (chunk / 8) * QBLOCK + row * 8 + ((chunk % 8) ^ (row % 8));
  }
};

// Offset (uint4) of k16 step kt along a K-major tile's rows: 32 bytes within an atom's
// 128-byte row, then the next atom (K / V), or the next column block (Q / dO).
__device__ __forceinline__ int k_step(int kt) { return (kt / 4) * 64 + (kt % 4) * 2; }
__device__ __forceinline__ int q_step(int kt) { return (kt / 4) * QBLOCK + (kt % 4) * 2; }
