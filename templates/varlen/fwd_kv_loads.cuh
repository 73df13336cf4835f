{# The forward's mainloop loads: K/V tiles by cp.async (packed, paged, paged decode slots) or
   TMA, and the page ids they read (included by kernels.cu.j2). #}
// Rows of a K/V tile one thread copies (16 bytes each): LOAD_ITERS rows, `CHUNKS` threads a row.
constexpr int LOAD_ITERS = (BLOCK_N * CHUNKS + LOADERS - 1) / LOADERS;

// When LOADERS is a multiple of CHUNKS, each thread copies the same 16-byte chunk of rows
// ROW_STEP apart, so its source addresses are a fixed base plus a per-tile and a per-row step:
// one 64-bit add per copy instead of recomputing token * stride (which, in 64 bits, cost as
// many instructions per tile as the tile's math).
// (And only when the threads cover the tile's chunks evenly: otherwise the last copies would
// land past the tile.)
constexpr bool FIXED_CHUNK = LOADERS % CHUNKS == 0 && BLOCK_N * CHUNKS % LOADERS == 0;
constexpr int ROW_STEP = FIXED_CHUNK ? LOADERS / CHUNKS : 1;

// Page ids of the rows a thread copies for one tile, fetched a tile ahead of the copies so the
// table lookups' latency hides behind a tile of compute instead of delaying the copies.
// The producer (WARP_PAGES) fetches one id per lane instead of one per row: a warp's threads
// copy RPW rows per step, RPW * LOAD_ITERS rows a tile, so lane j holds the id of the warp's
// j-th row and each copy takes its row's id by a shuffle (16 table loads per thread and tile
// became 1 at D128).
constexpr int RPW = CHUNKS <= 32 && 32 % CHUNKS == 0 ? 32 / CHUNKS : 0;  // rows a warp copies per step
constexpr bool WARP_PAGES = PAGED && PRODUCER && FIXED_CHUNK && RPW > 0 && RPW * LOAD_ITERS <= 32;
struct PageIds {
  int id[WARP_PAGES ? 1 : LOAD_ITERS];
};
// Paged, a producer that kept all of a tile's page ids (one per row) spilled 84 bytes at 40
// registers (D128; 48 at D256) and needed 72 (compute 216); with one id per lane 56 (compute
// 224) leave at most a word (at 40 ptxas spilled 10-19). The paged TMA producer keeps 56 too:
// 40 / 232 measured no gain (notes/paged-h200.md).
{% if has_producer and warps_m == 12 %}
// Three compute warpgroups (192 rows): 512 threads launch with 128 registers each, split as
// FlashAttention-3 does (32 / 160). At 152 / 40 ptxas serialized every wgmma (D64, 44 DEPBARs),
// so the paged producer takes 32 too (not the 56 of two warpgroups), spills and all.
constexpr int PRODUCER_REGS = 32, COMPUTE_REGS = 160;
static_assert(128 * PRODUCER_REGS + WARPS * 32 * COMPUTE_REGS <= 128 * THREADS, "register budget");
{% elif has_producer and not paged and head_dim <= 128 and head_dim // 2 + block_n // 2 > 144 %}
// Wide key tiles (S and O over 144 accumulators a thread: D128 past 160 keys): the S of the
// next tile, the P and the O of this one are live across the GEMMs, and at 232 ptxas spilled
// in the main loop (D128 176 keys: 22 spill ops) or serialized every wgmma (192 keys: C7512,
// 60 DEPBARs). 240 / 24 (FlashAttention-3's split) keeps them pipelined; the producer's
// spills are off the TMA path's critical work.
constexpr int PRODUCER_REGS = 24, COMPUTE_REGS = 240;
static_assert(128 * PRODUCER_REGS + WARPS * 32 * COMPUTE_REGS <= 168 * THREADS, "register budget");
{% else %}
constexpr int PRODUCER_REGS = PAGED ? (WARP_PAGES ? 56 : 72) : 40, COMPUTE_REGS = PAGED ? (WARP_PAGES ? 224 : 216) : 232;
// The pool setmaxnreg moves registers in is what the CTA launched with (__launch_bounds__:
// 168 per thread at 384 threads), not the whole register file.
static_assert(!PRODUCER || 128 * PRODUCER_REGS + WARPS * 32 * COMPUTE_REGS <= 168 * THREADS, "register budget");
{% endif %}
static_assert(!(TMA && PAGED && PRODUCER) || WARP_PAGES, "the paged TMA producer takes the page ids per lane");

__device__ __forceinline__ void fetch_page_ids(const VarlenParams& p, const Work& w, int tile, PageIds& pages, int tid) {
  if constexpr (WARP_PAGES) {
    const int j = tid % 32;
    const int row = (tid / 32) * RPW + j % RPW + ROW_STEP * (j / RPW);
    const int n = tile * BLOCK_N + row;
    pages.id[0] = j < RPW * LOAD_ITERS && n < w.k_len
                      ? p.block_table[w.seq * p.block_table_stride + (n >> p.page_shift)] : -1;
  } else if constexpr (PAGED) {
#pragma unroll
    for (int i = 0; i < LOAD_ITERS; ++i) {
      const int idx = tid + i * LOADERS;
      const int n = tile * BLOCK_N + idx / CHUNKS;
      pages.id[i] = idx < BLOCK_N * CHUNKS && n < w.k_len
                        ? p.block_table[w.seq * p.block_table_stride + (n >> p.page_shift)] : -1;
    }
  }
}

// The page id of the i-th row (of LOAD_ITERS) thread tid copies.
__device__ __forceinline__ int page_id(const PageIds& pages, int i, int tid) {
  if constexpr (WARP_PAGES) return __shfl_sync(0xffffffffu, pages.id[0], (tid % 32) / CHUNKS + RPW * i);
  else return pages.id[i];
}

// Offsets of key n of the work's sequence in k and v; false when it must not be read (past the
// sequence, or a page id outside the pool: never read, and reported when debugging).
__device__ __forceinline__ bool kv_row(const VarlenParams& p, const Work& w, int n, int page, int64_t& k_off,
                                       int64_t& v_off) {
  if (n >= w.k_len) return false;
  if constexpr (PAGED) {
    if (static_cast<unsigned>(page) >= static_cast<unsigned>(p.total_k)) {
      if (p.bad_page && atomicExch(p.bad_page, 1) == 0) {
        p.bad_page[1] = w.seq;
        p.bad_page[2] = n >> p.page_shift;
      }
      return false;
    }
    const int in_page = n & p.page_mask;
    k_off = page * p.k_stride_page + in_page * p.k_stride_token + w.kv_head * p.k_stride_head;
    v_off = page * p.v_stride_page + in_page * p.v_stride_token + w.kv_head * p.v_stride_head;
  } else {
    const int64_t token = w.k_start + n;
    k_off = token * p.k_stride_token + w.kv_head * p.k_stride_head;
    v_off = token * p.v_stride_token + w.kv_head * p.v_stride_head;
  }
  return true;
}

struct KvCursor {
  const T* k;  // this thread's chunk of its first row (unpaged) or of the KV head (paged)
  const T* v;
  int64_t k_step, v_step;  // ROW_STEP rows
  int row0, chunk;
};

__device__ __forceinline__ KvCursor make_kv_cursor(const VarlenParams& p, const Work& w, int tid) {
  KvCursor cur;
  cur.row0 = tid / CHUNKS;
  cur.chunk = tid % CHUNKS;
  const int64_t first = PAGED ? 0 : int64_t(w.k_start) + cur.row0;
  cur.k = static_cast<const T*>(p.k) + first * p.k_stride_token + w.kv_head * p.k_stride_head + cur.chunk * 8;
  cur.v = static_cast<const T*>(p.v) + first * p.v_stride_token + w.kv_head * p.v_stride_head + cur.chunk * 8;
  cur.k_step = ROW_STEP * p.k_stride_token;
  cur.v_step = ROW_STEP * p.v_stride_token;
  return cur;
}

// K and V rows of tile `tile` -> one pipeline stage (zero-filled past the valid keys).
__device__ __forceinline__ void load_kv_tile(const VarlenParams& p, const Work& w, const KvCursor& cur, int tile,
                                             const PageIds& pages, uint4* k_smem, uint4* v_smem, int tid) {
  if constexpr (FIXED_CHUNK) {
    const int n0 = tile * BLOCK_N + cur.row0;
    const int64_t k_tile = PAGED ? 0 : int64_t(tile * BLOCK_N) * p.k_stride_token;
    const int64_t v_tile = PAGED ? 0 : int64_t(tile * BLOCK_N) * p.v_stride_token;
#pragma unroll
    for (int i = 0; i < LOAD_ITERS; ++i) {
      const int row = cur.row0 + i * ROW_STEP, n = n0 + i * ROW_STEP;
      const T* k_src = cur.k + k_tile + i * cur.k_step;
      const T* v_src = cur.v + v_tile + i * cur.v_step;
      bool valid = n < w.k_len;
      if constexpr (PAGED) {
        int64_t k_off = 0, v_off = 0;
        valid = kv_row(p, w, n, page_id(pages, i, tid), k_off, v_off);
        k_src = cur.k + (k_off - w.kv_head * p.k_stride_head);  // kv_row's offsets include the head
        v_src = cur.v + (v_off - w.kv_head * p.v_stride_head);
      }
      cp_async_16(k_smem + swizzle(row, cur.chunk), k_src, valid);
      cp_async_16(v_smem + swizzle(row, cur.chunk), v_src, valid);
    }
  } else {
    const T* k = static_cast<const T*>(p.k);
    const T* v = static_cast<const T*>(p.v);
#pragma unroll
    for (int i = 0; i < LOAD_ITERS; ++i) {
      const int idx = tid + i * LOADERS;
      if (idx < BLOCK_N * CHUNKS) {
        const int row = idx / CHUNKS, chunk = idx % CHUNKS;
        int64_t k_off = 0, v_off = 0;
        const bool valid = kv_row(p, w, tile * BLOCK_N + row, PAGED ? page_id(pages, i, tid) : 0, k_off, v_off);
        cp_async_16(k_smem + swizzle(row, chunk), k + k_off + chunk * 8, valid);
        cp_async_16(v_smem + swizzle(row, chunk), v + v_off + chunk * 8, valid);
      }
    }
  }
}

// Paged decode tile (PAGE_SLOTS). The per-row path above makes each of a thread's 8 rows a
// tile a branch region (the bad-page report) with its own table lookup and 64-bit page math:
// that loop ran ~1135 SASS instructions a tile against packed keys' 384 (bf16 D128, 32 x 3),
// and ncu saw it issue-bound (0.51 warps issued per scheduler, packed 0.20). Here a thread's
// rows are cut into slots of rows that lie on one page, each with one table lookup, one check
// and one page delta: row n of slot s is read at k + delta[s] + n * stride_token, the packed
// copy plus one add. Slots of one row serve every page size; slots of WIDE_ROWS rows (2 a tile
// at block_n 32) serve pages of at least WIDE_ROWS rows. The lookups are issued a tile ahead
// and nothing reads them until that tile's copy: checking them at once stalled the warps on
// the table load (a third of ncu's stall samples). Why: notes/paged-decode-h200.md.
constexpr bool PAGE_SLOTS = PAGED && DECODE && FIXED_CHUNK && !TMA;
constexpr int WIDE_ROWS = 16, WIDE_SHIFT = 4;
constexpr int WIDE_RUN = WIDE_ROWS % ROW_STEP == 0 ? WIDE_ROWS / ROW_STEP : 1;  // rows of a wide slot a thread copies
constexpr bool HAS_WIDE = PAGE_SLOTS && WIDE_RUN > 1 && LOAD_ITERS % WIDE_RUN == 0;
constexpr int WIDE_IPS = HAS_WIDE ? WIDE_RUN : 1;  // (the slot code also builds, unused, where !PAGE_SLOTS)
struct PageSlots {
  int id[LOAD_ITERS];  // the page id of each slot of the next tile to copy (in flight until then)
  const int* table;    // the sequence's block_table row (set once: ptxas recomputed it per slot)
};
using TilePages = std::conditional_t<PAGE_SLOTS, PageSlots, PageIds>;

__device__ __forceinline__ void init_pages(const VarlenParams& p, const Work& w, PageSlots& ps) {
  ps.table = p.block_table + w.seq * p.block_table_stride;
}
__device__ __forceinline__ void init_pages(const VarlenParams&, const Work&, PageIds&) {}

// Whether the pool's pages hold at least WIDE_ROWS rows (the same in every thread).
__device__ __forceinline__ bool wide_pages(const VarlenParams& p) { return HAS_WIDE && p.page_shift >= WIDE_SHIFT; }

// The first row of slot s of `tile` this thread copies.
template <int IPS>
__device__ __forceinline__ int slot_row(int tile, int row0, int s) { return tile * BLOCK_N + row0 + s * IPS * ROW_STEP; }

template <int IPS>
__device__ __forceinline__ void fetch_page_slots(const VarlenParams& p, const Work& w, int tile, PageSlots& ps,
                                                 int tid) {
#pragma unroll
  for (int s = 0; s < LOAD_ITERS / IPS; ++s) {
    const int n = slot_row<IPS>(tile, tid / CHUNKS, s);
    ps.id[s] = tile < w.tile_end && n < w.k_len ? __ldg(ps.table + (n >> p.page_shift)) : -1;
  }
}

__device__ __forceinline__ void fetch_page_ids(const VarlenParams& p, const Work& w, int tile, PageSlots& ps, int tid) {
  if (wide_pages(p)) fetch_page_slots<WIDE_IPS>(p, w, tile, ps, tid);
  else fetch_page_slots<1>(p, w, tile, ps, tid);
}

// A bad page id among a tile's slots into p.bad_page (debug). Out of line, and reached
// once a tile at most: the copy carries one branch for it.
__device__ __noinline__ void report_bad_page(int* bad_page, int seq, int page) {
  if (atomicExch(bad_page, 1) == 0) {
    bad_page[1] = seq;
    bad_page[2] = page;
  }
}

template <int IPS>
__device__ __forceinline__ void load_page_slots(const VarlenParams& p, const Work& w, const KvCursor& cur, int tile,
                                                const PageSlots& ps, uint4* k_smem, uint4* v_smem) {
  constexpr int SLOTS = LOAD_ITERS / IPS;
  int64_t k_delta[SLOTS], v_delta[SLOTS];
  bool ok[SLOTS];
  int bad = -1;  // the logical page of a bad id this thread holds
#pragma unroll
  for (int s = 0; s < SLOTS; ++s) {
    const int n = slot_row<IPS>(tile, cur.row0, s);
    ok[s] = static_cast<unsigned>(ps.id[s]) < static_cast<unsigned>(p.total_k);
    if (!ok[s] && n < w.k_len) bad = n >> p.page_shift;
    // Unsigned 32 x 64-bit products (both factors >= 0): half the multiplies of signed int64
    // ones, the same bits mod 2^64. A bad id reads nothing; page 0 keeps the address in the pool.
    const uint64_t page = ok[s] ? static_cast<unsigned>(ps.id[s]) : 0u, first = static_cast<unsigned>(n & ~p.page_mask);
    k_delta[s] = static_cast<int64_t>(page * uint64_t(p.k_stride_page) - first * uint64_t(p.k_stride_token));
    v_delta[s] = static_cast<int64_t>(page * uint64_t(p.v_stride_page) - first * uint64_t(p.v_stride_token));
  }
  if (bad >= 0 && p.bad_page) report_bad_page(p.bad_page, w.seq, bad);
  const int n0 = tile * BLOCK_N + cur.row0;
  const T* k = cur.k + int64_t(n0) * p.k_stride_token;
  const T* v = cur.v + int64_t(n0) * p.v_stride_token;
#pragma unroll
  for (int i = 0; i < LOAD_ITERS; ++i) {
    const int row = cur.row0 + i * ROW_STEP, s = i / IPS;
    const bool valid = ok[s] && n0 + i * ROW_STEP < w.k_len;
    cp_async_16(k_smem + swizzle(row, cur.chunk), k + k_delta[s] + i * cur.k_step, valid);
    cp_async_16(v_smem + swizzle(row, cur.chunk), v + v_delta[s] + i * cur.v_step, valid);
  }
}

__device__ __forceinline__ void load_kv_tile(const VarlenParams& p, const Work& w, const KvCursor& cur, int tile,
                                             const PageSlots& ps, uint4* k_smem, uint4* v_smem, int) {
  if (wide_pages(p)) load_page_slots<WIDE_IPS>(p, w, cur, tile, ps, k_smem, v_smem);
  else load_page_slots<1>(p, w, cur, tile, ps, k_smem, v_smem);
}

{% if uses_tma %}
// Tile `tile` of K and V by TMA, run by the producer's first warp: lane 0 arrives on `bar` with
// the tile's bytes, lane c < BLOCK_N / rows copies rows [c * rows, (c + 1) * rows) of each (one
// page when paged). The map (make_kv_maps) reads a box of `rows` rows as swizzle() lays them
// out: 8-row groups of D / 64 atoms. rows: the tile (unpaged), else the largest power of two
// that divides BLOCK_N and the page (8 at least).
// PARTS: 1 K, 2 V, 3 both (onto the one barrier).
template <int PARTS = 3>
__device__ __forceinline__ void tma_kv_tile(const CUtensorMap& map_k, const CUtensorMap& map_v, int rows,
                                            const VarlenParams& p, const Work& w, int tile, const PageIds& pages,
                                            uint4* k_smem, uint4* v_smem, uint64_t* bar, int lane) {
  static_assert(!PRODUCER || (BLOCK_N % 8 == 0 && BLOCK_N / 8 <= 32), "TMA: a lane per box");
  constexpr int TENSORS = (PARTS & 1) + (PARTS >> 1);
  if (lane == 0) mbarrier_arrive_expect_tx(bar, TENSORS * BLOCK_N * HEAD_DIM * sizeof(T));
  __syncwarp();
  const int row = lane * rows, n = tile * BLOCK_N + row;
  int token;
  if constexpr (PAGED) {  // the page id of row r (a multiple of ROW_STEP, make_kv_maps): lane RPW * (r / ROW_STEP) of warp 0 holds it
    const int page = __shfl_sync(0xffffffffu, pages.id[0], (RPW * (row / ROW_STEP)) % 32);
    token = page * (p.page_mask + 1) + (n & p.page_mask);
  } else {
    token = w.k_start + n;
  }
  if (row < BLOCK_N) {
    if constexpr ((PARTS & 1) != 0) tma_load_5d(k_smem + row * ROW_CHUNKS, &map_k, bar, 0, token, 0, 0, w.kv_head);
    if constexpr ((PARTS & 2) != 0) tma_load_5d(v_smem + row * ROW_CHUNKS, &map_v, bar, 0, token, 0, 0, w.kv_head);
  }
}

// The same for the lockstep (decode) tile, run by thread 0 alone: it copies rows ROW_STEP
// apart from row 0, so it holds the page id of every 8th row, the first of each box.
__device__ __forceinline__ void tma_kv_tile_lockstep(const CUtensorMap& map_k, const CUtensorMap& map_v, int rows,
                                                     const VarlenParams& p, const Work& w, int tile,
                                                     const PageIds& pages, uint4* k_smem, uint4* v_smem, uint64_t* bar) {
  static_assert(!LOCKSTEP_TMA || (FIXED_CHUNK && !WARP_PAGES && 8 % ROW_STEP == 0),
                "lockstep TMA: thread 0 holds each box's page id (VarlenSpec checks the tile)");
  fence_proxy_async_shared();  // the warps' reads of this stage (a tile ago), before the async writes
  mbarrier_arrive_expect_tx(bar, 2 * BLOCK_N * HEAD_DIM * sizeof(T));
#pragma unroll
  for (int i = 0; i < LOAD_ITERS; ++i) {
    const int row = i * ROW_STEP;
    if (row % 8 != 0 || (row & (rows - 1)) != 0) continue;
    const int n = tile * BLOCK_N + row;
    int token;
    if constexpr (PAGED) token = pages.id[i] * (p.page_mask + 1) + (n & p.page_mask);
    else token = w.k_start + n;
    tma_load_5d(k_smem + row * ROW_CHUNKS, &map_k, bar, 0, token, 0, 0, w.kv_head);
    tma_load_5d(v_smem + row * ROW_CHUNKS, &map_v, bar, 0, token, 0, 0, w.kv_head);
  }
}

// Whether every page id this thread fetched for a full tile is a page of the pool (lockstep
// TMA: a tile with a bad id takes cp.async, which zero-fills and reports it).
__device__ __forceinline__ bool page_ids_ok(const VarlenParams& p, const PageIds& pages) {
  bool ok = true;
  if constexpr (PAGED && !WARP_PAGES) {
#pragma unroll
    for (int i = 0; i < LOAD_ITERS; ++i) ok &= static_cast<unsigned>(pages.id[i]) < static_cast<unsigned>(p.total_k);
  }
  return ok;
}

{% endif %}
