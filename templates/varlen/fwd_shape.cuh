{# varlen_fwd's compile-time shape: the spec's choices as constants, the warp layout, the
   shared-memory swizzle and the budget checks (included by kernels.cu.j2). #}
using T = {{ CTYPES[dtype] }};
constexpr int HEAD_DIM = {{ head_dim }};
constexpr bool PAGED = {{ "true" if paged else "false" }};
constexpr bool DECODE = {{ "true" if decode else "false" }};
// Hopper rung: S = Q K^T and O += P V as warpgroup MMAs (wgmma, sm_90a) straight from shared
// memory, each warpgroup 64 rows; everything else (schedule, loads, masks, softmax, epilogue)
// is the same code as the mma.sync rung.
constexpr bool WGMMA = {{ "true" if wgmma else "false" }};
// The logit soft cap is the score hook's ScoreMod (hooks.cuh, score.cuh).
constexpr float LN2 = 0.6931471805599453f;

// Tile shape (VarlenSpec: warps_m, m_tiles, block_n, stages; decode shapes: warps_n = block_n / 16).
constexpr int WARPS_M = {{ warps_m }};
constexpr int WARPS_N = {{ warps_n }};
constexpr int M_TILES = {{ m_tiles }};  // 16-row MMA tiles per warp
constexpr int BLOCK_N = {{ block_n }};
constexpr int STAGES = {{ stages }};
// Of every 4 key columns of 8 in a tile, how many take their exponentials on the FMA pipe
// (softmax.cuh's poly_exp2) instead of the MUFU unit: 0 keeps every exp2 on the MUFU.
constexpr int POLY_EXP2 = {{ poly_exp2 }};
constexpr int WARPS = WARPS_M * WARPS_N;  // the warps that compute
// wgmma: one more warpgroup, the producer, does every K/V copy and hands stages to the compute
// warpgroups through mbarriers, so they never wait on each other (a CTA barrier per tile held
// the two warpgroups in lockstep). Registers are moved from it to them (setmaxnreg): 128 x
// PRODUCER_REGS + WARPS x 32 x COMPUTE_REGS fit the 64K register file. At D64 a cp.async
// producer (one CTA per SM) loses to two CTAs without one; a TMA one wins, so D64 takes the
// producer only with TMA (VarlenSpec.has_producer; why: notes/forward-h200.md).
constexpr bool PRODUCER = {{ "true" if has_producer else "false" }};
constexpr int THREADS = WARPS * 32 + (PRODUCER ? 128 : 0);
constexpr int LOADERS = PRODUCER ? 128 : THREADS;  // threads that copy K/V tiles
// TMA (VarlenSpec tma): the producer's full tiles of K and V come as bulk tensor copies (one
// box per tile, or per page of it, issued by lanes of its first warp) that complete on full[s]
// by bytes, so up to STAGES tiles fly at once and no thread waits on them. A sequence's last
// tile when it is not full (rows past the keys must be zeros: the next sequence's V can hold
// NaN), tiles with a bad page id and pages under 8 rows still take cp.async. VarlenSpec.takes_tma
// says which calls take it (why: notes/paged-h200.md).
constexpr bool TMA = {{ "true" if uses_tma else "false" }};
// The decode tile (no producer: its warps copy and compute in lockstep) takes TMA too: thread 0
// issues a tile's boxes onto full[stage] and every warp waits there as well as on its own
// cp.async group (tiles that still take cp.async complete full[stage] by a plain arrival).
constexpr bool LOCKSTEP_TMA = TMA && !PRODUCER;
// TMA writes the wgmma layout (1024-byte atoms of 8 rows x 64 columns), so the mma.sync
// decode tile reads that one when it takes TMA (see swizzle).
constexpr bool ATOMS = WGMMA || TMA;
// With the producer, two schedules of the compute warpgroups' GEMMs (VarlenSpec pingpong, overlap):
// PINGPONG: the warpgroups take turns on the tensor cores (named barriers PINGPONG_BAR + 0/1):
//   one issues its tile's S = Q K^T and the previous tile's O += P V while the other runs its
//   softmax, so the exp2 work of one hides behind the GEMMs of the other (FA3's ping-pong).
// OVERLAP: inside a warpgroup, the softmax of tile j runs while O += P_{j-1} V_{j-1} is still in
//   flight (S_j awaited alone, O rescaled once that MMA is done); P_{j-1} stays in registers.
// Either defers a tile's O += P V to the next tile's turn (DEFER_PV).
constexpr bool PINGPONG = {{ "true" if pingpong else "false" }};
constexpr bool OVERLAP = {{ "true" if overlap else "false" }};
// SPLIT_KV (VarlenSpec split_kv): K and V of a stage complete and come free on their own
// mbarriers (FlashAttention-3's two pipelines): a tile's K is handed back once its S = Q K^T is
// done, a tile earlier than its V (after O += P V), and the warps wait for V only before O += P V.
constexpr bool SPLIT_KV = {{ "true" if split_kv else "false" }};
constexpr bool DEFER_PV = PINGPONG || OVERLAP;
// PERSISTENT (VarlenSpec persistent; cuDNN's fprop launches one CTA per SM too): a grid of as
// many CTAs as fit walks the row blocks (work items) of decode_work's heaviest-first order, each
// CTA its own index first, then the next untaken one, so an item's start and end leave the
// critical path: the producer decodes the next item into a shared-memory slot (item_work,
// item_full / item_empty), loads its Q by TMA as soon as each compute warpgroup's last
// S = Q K^T of the current item is done (q_full / q_empty), and its first K / V tiles into the
// stages the current item has let go of; the compute warpgroups stage O in the last tile's
// stage (every warpgroup done with it: EPI_BAR; the first K_STAGED_WGS warpgroups' rows in its
// K, the others' in its V), from where whole 8-row groups leave by TMA stores whose reads are
// waited for under the next item's first S = Q K^T, and only then is the stage handed back
// (the warps' own 16-byte stores measured slower: notes/forward-h200.md). The stage ring runs
// on across items (`ring`: tiles of earlier items).
// Each item's arithmetic is a CTA's of the other schedule: the same bits.
constexpr bool PERSISTENT = {{ "true" if persistent else "false" }};
constexpr int ITEM_SLOTS = 2;
constexpr int K_STAGED_WGS = BLOCK_N / 64;  // PERSISTENT: warpgroups whose 64 rows of O fit the K stage
constexpr int PINGPONG_BAR = 3;  // 1 and 2: each warpgroup's Q
// PRODUCER: the producer's own threads, then the compute warps meeting it once (both after the
// stage barriers are initialized); above every warpgroup's Q barrier (1..3) and PINGPONG_BAR + 1.
constexpr int PRODUCER_BAR = 5, INIT_BAR = 6;
constexpr int EPI_BAR = 7;  // PERSISTENT: every compute warpgroup is done with an item's last stage
{% if warps_m == 12 %}
static_assert(!PINGPONG && (!OVERLAP || PRODUCER), "three compute warpgroups: overlap (with the producer), no pingpong (two turns)");
{% else %}
static_assert(!DEFER_PV || (PRODUCER && WARPS == 8), "pingpong/overlap: two compute warpgroups and the producer");
{% endif %}
static_assert(!SPLIT_KV || (PRODUCER && !DEFER_PV), "split_kv: the producer, the plain GEMM order");
constexpr int BLOCK_M = WARPS_M * M_TILES * 16;
constexpr int WARP_N = BLOCK_N / WARPS_N;  // keys of a tile one warp computes
constexpr int N_TILES = WARP_N / 8;        // n8 MMA tiles of S per warp
constexpr int CHUNKS = HEAD_DIM / 8;       // 16-byte chunks per row
constexpr int ROW_CHUNKS = (CHUNKS + 7) / 8 * 8;  // shared row, padded to whole swizzle groups
// Ask for 2 CTAs per SM when the O accumulators (M_TILES * HEAD_DIM / 2 registers; with wgmma
// also all of S, BLOCK_N / 2) leave room; VarlenSpec.min_blocks asks for its own count instead.
constexpr int ACC_REGS = WGMMA ? HEAD_DIM / 2 + BLOCK_N / 2 : M_TILES * HEAD_DIM / 2;
constexpr int MIN_BLOCKS = {{ min_blocks }} > 0 ? {{ min_blocks }} : ACC_REGS + 64 <= 65536 / (2 * THREADS) ? 2 : 1;
static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM <= 256, "head_dim: a multiple of 16, at most 256");
static_assert(N_TILES % 2 == 0, "ldmatrix.x4 loads two n8 tiles of K at a time");
static_assert(STAGES >= 2, "the ring needs a stage to load while one computes");
// With wgmma a tile's O += P V runs on while the next tile's S = Q K^T is issued; both are
// awaited together, and only then is the tile's stage free (handed back to the producer, or,
// in the lockstep loop, refilled a tile later: copies run AHEAD = STAGES - 2 tiles ahead).
constexpr int AHEAD = WGMMA ? STAGES - 2 : STAGES - 1;
static_assert(AHEAD >= 1 || PRODUCER, "the lockstep wgmma loop needs 3 stages");
static_assert(!WGMMA || (M_TILES == 1 && WARPS_M % 4 == 0 && WARPS_N == 1 && HEAD_DIM % 64 == 0 &&
                         BLOCK_N % 16 == 0 && BLOCK_N <= 256),
              "wgmma: whole warpgroups of 16-row warps, head_dim a multiple of 64, BLOCK_N <= 256");

// 16-byte chunk `chunk` of row `row` in a swizzled tile: the XOR spreads the 8 rows that one
// ldmatrix reads at the same column over all 8 bank groups. With wgmma (or TMA: ATOMS) the same
// XOR is the hardware's 128-byte swizzle, which wants each 8 rows x 64 columns as one 1024-byte
// atom: the atoms of an 8-row group side by side (GROUP_BYTES), then the next group.
// Either way 16 rows are 16 * ROW_CHUNKS chunks on, and chunk + 8 is CHUNK8_STEP on.
constexpr int GROUP_BYTES = ROW_CHUNKS * 128;
constexpr int CHUNK8_STEP = ATOMS ? 64 : 8;
__device__ __forceinline__ int row_base(int row) {
  return ATOMS ? (row / 8) * (ROW_CHUNKS * 8) + (row % 8) * 8 : row * ROW_CHUNKS;
}
__device__ __forceinline__ int swizzle(int row, int chunk) {
  return row_base(row) + (chunk / 8) * CHUNK8_STEP + ((chunk % 8) ^ (row % 8));
}

constexpr int TILE_CHUNKS = BLOCK_N * ROW_CHUNKS;
constexpr int PIPE_BYTES = (BLOCK_M + 2 * STAGES * BLOCK_N) * ROW_CHUNKS * 16;
// Epilogue: each warp column's unnormalized o and (m, l) per row, in fp32; rows padded by 4
// floats so the fragment writes of a warp's 8 row groups fall in different banks.
constexpr int EPI_STRIDE = HEAD_DIM + 4;
constexpr int EPI_BYTES = WARPS_N * BLOCK_M * (EPI_STRIDE + 2) * 4;
// Prefill shapes at head_dim > 128 finish in registers instead (one CTA per SM there, so the
// epilogue is not hidden behind another CTA), and so do all wgmma shapes (their warps share no
// CTA barrier after the start). The mma.sync kernels at D64/128 keep this one: theirs measured
// no better in registers (the main loop's register allocation changes; notes/forward-h200.md).
constexpr bool REGISTER_EPILOGUE = WARPS_N == 1 && (HEAD_DIM > 128 || WGMMA);
// wgmma's atoms must be 1024-aligned: room to align the dynamic shared memory base.
// varlen_fwd's dynamic shared memory: Q and the K / V stage rings while the tiles run; after
// them (every copy landed), the merge of the warp columns' states (epilogue, WARPS_N > 1).
struct SharedStorage {
  struct Pipeline {
    uint4 q[BLOCK_M * ROW_CHUNKS];
    uint4 k[STAGES * TILE_CHUNKS];  // [STAGES][TILE_CHUNKS]
    uint4 v[STAGES * TILE_CHUNKS];
  };
  struct Merge {
    float o[WARPS_N * BLOCK_M * EPI_STRIDE];  // [WARPS_N][BLOCK_M][EPI_STRIDE]
    float ml[WARPS_N * BLOCK_M * 2];          // [WARPS_N][BLOCK_M][max, sum]
  };
  union {
    Pipeline pipe;
    Merge merge;
  };
};
static_assert(sizeof(SharedStorage) == (PIPE_BYTES > EPI_BYTES ? PIPE_BYTES : EPI_BYTES), "SharedStorage: no padding");
constexpr int SMEM_BYTES = sizeof(SharedStorage) + (ATOMS ? 1024 : 0);
static_assert(SMEM_BYTES <= 227 * 1024, "tile shape needs more shared memory than an SM has (227 KB)");
static_assert(!PERSISTENT || (PRODUCER && TMA && !DECODE && !DEFER_PV && REGISTER_EPILOGUE &&
                              (WARPS / 4 - K_STAGED_WGS) * 64 <= BLOCK_N),
              "persistent: the prefill producer with TMA, the plain GEMM order, O staged in a K / V stage");
