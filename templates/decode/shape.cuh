{# decode_chunk's compile-time shape: the spec's choices as constants, the tile and pipeline
   depth of each compute path, the prefetch depth and the K/V swizzle (included by kernels.cu.j2). #}
using DTypeQ = {{ CTYPES[dtype_q] }};
using DTypeKV = {{ CTYPES[dtype_kv] }};
constexpr int HEAD_DIM = {{ head_dim }};
constexpr int GROUP_TILE = {{ group_tile }};
constexpr bool SOFT_CAP = {{ "true" if soft_cap else "false" }};
constexpr bool ROPE = {{ "true" if pos_encoding == "ROPE_LLAMA" else "false" }};
constexpr bool ALIBI = {{ "true" if pos_encoding == "ALIBI" else "false" }};
constexpr bool TENSOR_CORES = {{ "true" if tensor_cores else "false" }};
constexpr float LOG2E = 1.4426950408889634f;

constexpr int pow2_ceil(int x) { return x <= 1 ? 1 : 2 * pow2_ceil((x + 1) / 2); }

constexpr int THREADS = 128;
constexpr int VEC = kPerVec<DTypeKV>;                    // kv elements per 16-byte vector
constexpr int VECS_PER_ROW = HEAD_DIM / VEC;
static_assert(HEAD_DIM % VEC == 0 && HEAD_DIM <= 256, "head_dim must be whole 16-byte vectors, at most 256");
static_assert(!ROPE || (HEAD_DIM / 2) % VEC == 0, "RoPE pairs (d, d + D/2) must sit in whole vectors");
{% if tensor_cores %}
constexpr int WARPS = THREADS / 32;
// Key rows per warp and tile, in n8 blocks. RoPE and fp8 K/V take two (up to 128 dims): each
// warp then has two independent chains of per-key work (rotations, widening) to interleave,
// and P is a full k16 A operand for O += P V (half the MMAs, rescales and shuffles per key).
// fp16/bf16 without RoPE keeps one block and its deeper pipeline of 16 KB stages, as fast or
// faster. Rows above 128 dims keep one: two would not fit twice per SM.
// Why: notes/decode-h200.md, "KEY_BLOCKS".
constexpr int KEY_BLOCKS = (ROPE || sizeof(DTypeKV) == 1) && HEAD_DIM <= 128 ? 2 : 1;
constexpr int WARP_ROWS = 8 * KEY_BLOCKS;
// RoPE with two key blocks can compute tile t + 1's logits beside tile t's softmax and P V: two
// independent chains per warp for a loop that is latency-bound at 8 warps per SM, for one tile
// less of prefetch. That pays once a chunk is long enough for the steady state to dominate, and
// costs shorter chunks, so the kernel switches per chunk at PIPELINE_MIN_TILES tiles
// (why: notes/decode-h200.md, "PIPELINED_LOGITS and the prefetch commit").
constexpr bool PIPELINED_LOGITS = ROPE && KEY_BLOCKS == 2;
constexpr int PIPELINE_MIN_TILES = 48;
constexpr int TILE = WARP_ROWS * WARPS;                  // rows per stage
constexpr int STATE_SETS = WARPS;                        // each warp keeps its own softmax states
constexpr int STATE_ROWS = 16;                           // query heads = the MMA's 16 rows
static_assert(HEAD_DIM % 32 == 0 && GROUP_TILE <= 16, "tensor-core path shape");
constexpr bool FP8 = sizeof(DTypeKV) == 1;  // fp8 K/V: fragments are widened to q's type for the MMA
// Padding of a state row in shared memory, so that a warp's stores of its accumulator at the
// end (float2 per thread, float4 with fp8: o_dim) hit every bank once per phase. Unpadded, the
// 8 rows of a store shared their banks: 8-way conflicts at the end of every CTA.
// Why: notes/decode-h200.md, "STATE_PAD".
constexpr int STATE_PAD = FP8 ? 16 : 8;
using DTypeMMA = DTypeQ;                      // the MMA's operand type (K/V have it unless fp8)
{% else %}
constexpr int LANES = pow2_ceil(VECS_PER_ROW);           // threads per row (shuffle-reduce width)
constexpr int ROW_GROUPS = THREADS / LANES;              // rows computed side by side
constexpr int ROWS_PER_THREAD = 4;
constexpr int TILE = ROW_GROUPS * ROWS_PER_THREAD;       // rows per pipeline stage (8 KB of K)
constexpr int STATE_SETS = ROW_GROUPS;
constexpr int STATE_ROWS = GROUP_TILE;
constexpr int STATE_PAD = 0;
static_assert(LANES <= 32, "a row fits in one warp");
{% endif %}
// Pipeline depth: the tensor-core path (little math per byte) keeps about 96 KB of K/V per
// CTA in 3 to 6 stages, which still fits 2 CTAs per SM (D128: 3 stages of 32 KB; with 32-row
// tiles 6 stages of 16 KB had measured 5-15% faster than 3 on the H200 at 4k-32k). The
// CUDA-core path is compute-heavier and keeps 4 CTAs per SM at 3 stages; 4 or 6 were slower.
constexpr int STAGE_BYTES = 2 * TILE * HEAD_DIM * static_cast<int>(sizeof(DTypeKV));
constexpr int MAX_STAGES = sizeof(DTypeKV) == 1 ? 12 : 6;  // fp8 rows are half as long: as many bytes in flight
constexpr int STAGES = !TENSOR_CORES ? 3 : (96 * 1024 / STAGE_BYTES < 3 ? 3 : 96 * 1024 / STAGE_BYTES > MAX_STAGES ? MAX_STAGES : 96 * 1024 / STAGE_BYTES);
// Tiles in flight ahead of the one being computed: STAGES - 1, except that the deep rings of
// the tensor-core kernel (6 stages at D128: 16-bit K/V without RoPE, fp8) keep
// SHORT_CHUNK_DEPTH on chunks of at most SHORT_CHUNK_TILES. There every CTA's first tile waits
// behind the whole grid's opening burst of prefetches (32/8: 128 CTAs x 5 tiles = 10 MB), and a
// shallower start lets compute begin sooner; long chunks want the deep ring.
// Why (and the thresholds tried): notes/decode-h200.md, "SHORT_CHUNK_TILES".
constexpr int SHORT_CHUNK_TILES = 12, SHORT_CHUNK_DEPTH = 3;
__device__ __forceinline__ int prefetch_depth(int num_tiles) {
  return STAGES - 1 > SHORT_CHUNK_DEPTH && num_tiles <= SHORT_CHUNK_TILES ? SHORT_CHUNK_DEPTH : STAGES - 1;
}
constexpr int TILE_VECS = TILE * VECS_PER_ROW;
constexpr int LOADS_PER_THREAD = (TILE_VECS + THREADS - 1) / THREADS;

// Physical 16-byte slot of vector `c` of row `r`: XOR-swizzled within groups of 8 so that the
// 8 rows an ldmatrix reads at one column hit 8 different bank groups.
__device__ __forceinline__ int swz(int r, int c) { return VECS_PER_ROW % 8 == 0 ? c ^ (r & 7) : c; }
