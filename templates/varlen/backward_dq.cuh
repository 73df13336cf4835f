// The backward's dQ kernel (VarlenBackwardSpec.dq_kernel; sm_90a warpgroup MMAs), included by
// backward.cu.j2 after backward_wgmma.cuh, whose main kernel then computes dK / dV only.
//
// Why a kernel of its own: with 64 keys a CTA the main kernel adds every query tile's dQ into an
// fp32 accumulator once per key tile, and the L2's reduction rate made that the kernel's whole
// time (notes/backward-d256.md). Query-major, the sum over keys stays in registers: no
// accumulator, no atomics, no postprocess, and a fixed order (bitwise deterministic as it is).
// It recomputes S and dP: 3 GEMMs a (query, key) tile here beside the main kernel's 4.
//
// One CTA per (query tile of DQ_ROWS packed rows, KV head, sequence), heaviest first as the main
// kernel orders its key tiles (dq_work). Two compute warpgroups of 64 rows walk the visible key
// tiles (DQ_KEYS keys each; fully hidden ones skipped, boundary ones masked):
//   S  = Q K^T, dP = dO V^T          shared x shared (K-major), n = DQ_KEYS
//   P  = exp2(S * scale_log2 - lse2), dS = P * (dP - delta)   (soft cap: as the main kernel)
//   dQ += dS K                        dS from registers, K the MN-major B (as V in the forward's
//                                     O += P V), n = head_dim: 64 x 256 fp32 = 128 registers
// and write dQ * scale as T. dQ of tile j runs on while S / dP of tile j + 1 are issued.
// A producer warp copies Q and dO once (TMA, 4-D maps as the main kernel's) and streams K / V
// (TMA, 5-D maps as the forward's; a sequence's last partial tile by cp.async, zeros past the
// keys): K in DQ_K_STAGES stages (it lives through S and dQ), V in one (through dP only).

constexpr int DQ_ROWS = 128;                   // packed query rows a CTA (two warpgroups of 64)
constexpr int DQ_KEYS = 64;                    // keys a step
constexpr int DQ_K_STAGES = 2, DQ_V_STAGES = 1;
constexpr int DQ_THREADS = 3 * 128;            // two compute warpgroups and the producer's
constexpr int DQ_CONSUMER_REGS = 240, DQ_PRODUCER_REGS = 24;
// setmaxnreg.inc waits until the producer's setmaxnreg.dec gave back enough registers: from the
// launch's per-thread count (65536 / 384 rounded down to 8: 168) the two must balance, or the
// compute warpgroups wait forever (32 / 240 hung on the H200). ptxas: 24 / 240 spills 12 bytes (the loader warp: 0 with 32 / 240); 32 / 232 serializes every wgmma (advisory C7512).
constexpr int DQ_LAUNCH_REGS = 65536 / DQ_THREADS / 8 * 8;
static_assert(128 * (DQ_LAUNCH_REGS - DQ_PRODUCER_REGS) >= 256 * (DQ_CONSUMER_REGS - DQ_LAUNCH_REGS), "register budget");
constexpr int DQ_QBLOCK = DQ_ROWS * 8;         // a 64-column block of Q / dO, in uint4
constexpr int DQ_QT_CHUNKS = DQ_ROWS * ROW_CHUNKS;
constexpr int DQ_KV_CHUNKS = DQ_KEYS * ROW_CHUNKS;
constexpr int DQ_S_TILES = DQ_KEYS / 8;        // n8 tiles of S / dP a warp
constexpr int DQ_D_TILES = HEAD_DIM / 8;       // n8 tiles of dQ a warp
// varlen_bwd_dq's dynamic shared memory (above the 1024-byte alignment of wgmma's atoms).
struct DqSharedStorage {
  uint4 q[DQ_QT_CHUNKS];
  uint4 dout[DQ_QT_CHUNKS];
  uint4 k[DQ_K_STAGES * DQ_KV_CHUNKS];  // [DQ_K_STAGES][DQ_KV_CHUNKS]
  uint4 v[DQ_V_STAGES * DQ_KV_CHUNKS];  // [DQ_V_STAGES][DQ_KV_CHUNKS]
};
constexpr int DQ_SMEM_BYTES = sizeof(DqSharedStorage) + 1024;
constexpr int DQ_N_BAND = 2048 / DQ_ROWS;      // query tiles of one (sequence, KV head) side by side
static_assert(HEAD_DIM == 256, "dq_kernel: head_dim 256 (the width measured)");
static_assert(DQ_SMEM_BYTES <= 227 * 1024, "dq_kernel: shared memory");

// Q / dO of DQ_ROWS rows: 64-column blocks (the layout of the 4-D maps' boxes), as QTiles.
struct DqRows {
  __device__ __forceinline__ static int at(int row, int chunk) {
    return (chunk / 8) * DQ_QBLOCK + row * 8 + ((chunk % 8) ^ (row % 8));
  }
};
__device__ __forceinline__ int dq_q_step(int kt) { return (kt / 4) * DQ_QBLOCK + (kt % 4) * 2; }

struct DqArgs {
  BwdParams p;
  CUtensorMap q_map, do_map, k_map, v_map;
  int tma;           // all four maps encoded; else every copy by cp.async
  int num_m_blocks;  // query tiles per (sequence, KV head) in the grid: ceil(max_q * pack / DQ_ROWS)
};

// The host side of DqArgs: Q / dO as the main kernel's maps (boxes of DQ_ROWS / pack tokens),
// K / V as the forward's 5-D maps (64 columns x 8 tokens x D / 64 atoms x DQ_KEYS / 8 groups,
// which lands in AtomSwizzle's order).
inline DqArgs dq_kernel_args(const BwdParams& p, int num_m_blocks) {
  DqArgs a;
  a.p = p;
  a.num_m_blocks = num_m_blocks;
  a.tma = 0;
  const EncodeTiled encode = encode_tiled();
  if (!encode || DQ_ROWS % p.pack != 0 || p.total_k <= 0) return a;
  const int64_t e = sizeof(T);
  const cuuint32_t unit[5] = {1, 1, 1, 1, 1};
  auto aligned = [&](const void* base, int64_t st, int64_t sh) {
    return reinterpret_cast<uintptr_t>(base) % 16 == 0 && st > 0 && sh > 0 && (st * e) % 16 == 0 && (sh * e) % 16 == 0;
  };
  auto q_map = [&](CUtensorMap* map, const void* base, int64_t st, int64_t sh) {
    if (!aligned(base, st, sh)) return false;
    const cuuint64_t dims[4] = {cuuint64_t(HEAD_DIM), cuuint64_t(p.pack), cuuint64_t(p.num_heads_kv), cuuint64_t(p.total_q)};
    const cuuint64_t strides[3] = {cuuint64_t(sh * e), cuuint64_t(sh * p.pack * e), cuuint64_t(st * e)};
    const cuuint32_t box[4] = {64, cuuint32_t(p.pack), 1, cuuint32_t(DQ_ROWS / p.pack)};
    return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, const_cast<void*>(base), dims, strides, box, unit,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
  };
  auto kv_map = [&](CUtensorMap* map, const void* base, int64_t st, int64_t sh) {
    if (p.num_heads_kv == 1) sh = HEAD_DIM;
    if (!aligned(base, st, sh)) return false;
    const cuuint64_t dims[5] = {64, cuuint64_t(p.total_k), HEAD_DIM / 64, DQ_KEYS / 8, cuuint64_t(p.num_heads_kv)};
    const cuuint64_t strides[4] = {cuuint64_t(st * e), 128, cuuint64_t(8 * st * e), cuuint64_t(sh * e)};
    const cuuint32_t box[5] = {64, 8, HEAD_DIM / 64, DQ_KEYS / 8, 1};
    return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 5, const_cast<void*>(base), dims, strides, box, unit,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
  };
  a.tma = q_map(&a.q_map, p.q, p.q_stride_token, p.q_stride_head) &&
          q_map(&a.do_map, p.dout, p.dout_stride_token, p.dout_stride_head) &&
          kv_map(&a.k_map, p.k, p.k_stride_token, p.k_stride_head) &&
          kv_map(&a.v_map, p.v, p.v_stride_token, p.v_stride_head);
  return a;
}

// What one dQ CTA covers: query tile m of (sequence, KV head) and the key tiles its rows see.
struct DqWork {
  int seq, kv_head, m;
  int q_start, q_len, rows;   // rows = q_len * pack (packed)
  int k_start, k_len;
  int n_begin, n_end;         // key tiles (DQ_KEYS) a row of the tile sees
  int r_lo, r_hi;             // the tile's first and last token (in the sequence)
};

// blockIdx.x -> work, heaviest first: j counts query tiles from the end of their sequence (with
// a right window edge, causal among them, the last rows see the most keys) and runs from 0 up, in
// bands of DQ_N_BAND within which the tiles of one (sequence, KV head) are adjacent, so CTAs
// streaming the same K / V run side by side (as decode_work orders the main kernel's key tiles).
__device__ __forceinline__ bool dq_work(const BwdParams& p, int num_m_blocks, DqWork& w) {
  const int per_j = p.num_seqs * p.num_heads_kv;
  const int band = blockIdx.x / (per_j * DQ_N_BAND);
  int rest = blockIdx.x - band * per_j * DQ_N_BAND;
  const int band_blocks = min(DQ_N_BAND, num_m_blocks - band * DQ_N_BAND);
  const int j = band * DQ_N_BAND + rest % band_blocks;
  rest /= band_blocks;
  w.kv_head = rest % p.num_heads_kv;
  w.seq = rest / p.num_heads_kv;
  w.q_start = p.cu_seq_q[w.seq];
  w.q_len = w.q_start < 0 ? 0 : max(0, min(p.cu_seq_q[w.seq + 1], p.total_q) - w.q_start);
  w.rows = w.q_len * p.pack;
  w.k_start = p.cu_seq_k[w.seq];
  w.k_len = key_len(p, w.seq);
  const int m_tiles = (w.rows + DQ_ROWS - 1) / DQ_ROWS;
  w.m = m_tiles - 1 - j;
  if (w.m < 0) return false;
  w.r_lo = w.m * DQ_ROWS / p.pack;
  w.r_hi = (min((w.m + 1) * DQ_ROWS, w.rows) - 1) / p.pack;
  const int off = w.k_len - w.q_len;
  const int64_t k_lo = p.window_left >= 0 ? max(int64_t(0), int64_t(w.r_lo) + off - p.window_left) : 0;
  const int64_t k_hi = p.window_right >= 0 ? min(int64_t(w.k_len), int64_t(w.r_hi) + off + p.window_right + 1)
                                           : int64_t(w.k_len);
  if (k_lo >= k_hi) {
    w.n_begin = w.n_end = 0;  // no key visible: dQ is zero
  } else {
    w.n_begin = static_cast<int>(k_lo / DQ_KEYS);
    w.n_end = static_cast<int>((k_hi + DQ_KEYS - 1) / DQ_KEYS);
  }
  if constexpr (MaskMod::ACTIVE) {  // the mask hook's empty key tiles at either end are never loaded
    const MaskMod mask_mod = mask_mod_of(p);
    auto empty = [&](int n) {
      return mask_mod.classify(w.seq, w.kv_head, w.r_lo + off, w.r_hi + off, n * DQ_KEYS, n * DQ_KEYS + DQ_KEYS - 1) ==
             TILE_EMPTY;
    };
    while (w.n_begin < w.n_end && empty(w.n_begin)) ++w.n_begin;
    while (w.n_end > w.n_begin && empty(w.n_end - 1)) --w.n_end;
  }
  return true;
}

// Whether some (row, key) pair of key tile n is hidden (then the tile is masked element-wise).
__device__ __forceinline__ bool dq_tile_masked(const BwdParams& p, const DqWork& w, int n) {
  const int n0 = n * DQ_KEYS, off = w.k_len - w.q_len;
  return n0 + DQ_KEYS > w.k_len || (p.window_left >= 0 && n0 < w.r_hi + off - p.window_left) ||
         (p.window_right >= 0 && n0 + DQ_KEYS - 1 > w.r_lo + off + p.window_right) ||
         (MaskMod::ACTIVE && mask_mod_of(p).classify(w.seq, w.kv_head, w.r_lo + off, w.r_hi + off, n0,
                                                     n0 + DQ_KEYS - 1) != TILE_FULL);
}

// Key tile n's K and V into AtomSwizzle rows (zeros past the keys), by one warp's cp.async.
__device__ __forceinline__ void dq_copy_kv(const BwdParams& p, const DqWork& w, int n, uint4* k_smem, uint4* v_smem,
                                           bool k, bool v, int lane) {
  const T* kp = static_cast<const T*>(p.k);
  const T* vp = static_cast<const T*>(p.v);
  for (int idx = lane; idx < DQ_KEYS * CHUNKS; idx += 32) {
    const int row = idx / CHUNKS, chunk = idx % CHUNKS;
    const int key = n * DQ_KEYS + row;
    const bool valid = key < w.k_len;
    const int64_t token = valid ? int64_t(w.k_start) + key : 0;
    const int at = AtomSwizzle<ROW_CHUNKS>::at(row, chunk);
    if (k) cp_async_16(k_smem + at, kp + token * p.k_stride_token + w.kv_head * p.k_stride_head + chunk * 8, valid);
    if (v) cp_async_16(v_smem + at, vp + token * p.v_stride_token + w.kv_head * p.v_stride_head + chunk * 8, valid);
  }
}

// The tile's Q and dO rows by one warp's cp.async (zeros past the sequence's rows).
__device__ __forceinline__ void dq_copy_q(const BwdParams& p, const DqWork& w, uint4* q_smem, uint4* do_smem, int lane) {
  const T* q = static_cast<const T*>(p.q);
  const T* dout = static_cast<const T*>(p.dout);
  for (int idx = lane; idx < DQ_ROWS * CHUNKS; idx += 32) {
    const int row = idx / CHUNKS, chunk = idx % CHUNKS;
    const int pr = w.m * DQ_ROWS + row;
    const bool valid = pr < w.rows;
    int64_t q_off = 0, do_off = 0;
    if (valid) {
      const TokenHead th = packed_row(pr, p.pack, w.q_start, w.kv_head);
      const int64_t token = th.token;
      const int head = th.head;
      q_off = token * p.q_stride_token + head * p.q_stride_head + chunk * 8;
      do_off = token * p.dout_stride_token + head * p.dout_stride_head + chunk * 8;
    }
    cp_async_16(q_smem + DqRows::at(row, chunk), q + q_off, valid);
    cp_async_16(do_smem + DqRows::at(row, chunk), dout + do_off, valid);
  }
}

__global__ void __launch_bounds__(DQ_THREADS, 1) varlen_bwd_dq(const __grid_constant__ DqArgs args) {
  const BwdParams& p = args.p;
  extern __shared__ uint4 smem_base[];
  uint4* smem = smem_base + ((1024 - (static_cast<uint32_t>(__cvta_generic_to_shared(smem_base)) & 1023)) & 1023) / 16;
  DqSharedStorage& shared = *reinterpret_cast<DqSharedStorage*>(smem);
  uint4* q_smem = shared.q;
  uint4* do_smem = shared.dout;
  uint4* k_smem = shared.k;
  uint4* v_smem = shared.v;

  DqWork w;
  if (!dq_work(p, args.num_m_blocks, w)) return;
  // warp through a shuffle, warp-uniform to the compiler: descriptors in uniform registers (as in varlen_bwd).
  const int tid = threadIdx.x, lane = tid % 32, warp = __shfl_sync(0xffffffffu, tid / 32, 0), wg = warp / 4;
  const int g = lane / 4, c = lane % 4;
  const int tiles = w.n_end - w.n_begin;

  // q_full: Q / dO landed. k_full[s] / k_empty[s], v_full[s] / v_empty[s]: a key tile's K (V)
  // in stage s landed / read by every compute warp (K: its dQ GEMM done, V: its dP GEMM).
  __shared__ uint64_t q_full, k_full[DQ_K_STAGES], k_empty[DQ_K_STAGES], v_full[DQ_V_STAGES], v_empty[DQ_V_STAGES];
  if (tid == 0) {
    mbarrier_init(&q_full, 1);
    for (int s = 0; s < DQ_K_STAGES; ++s) {
      mbarrier_init(&k_full[s], 1);
      mbarrier_init(&k_empty[s], 8);
    }
    for (int s = 0; s < DQ_V_STAGES; ++s) {
      mbarrier_init(&v_full[s], 1);
      mbarrier_init(&v_empty[s], 8);
    }
    fence_proxy_async_shared();
  }
  __syncthreads();

  if (warp >= 8) {
    set_max_registers<DQ_PRODUCER_REGS, false>();
    if (warp == 8) {
      // Inputs only (no earlier kernel writes them): the copies start before the wait below.
      if (args.tma) {
        if (lane == 0) {
          mbarrier_arrive_expect_tx(&q_full, 2 * DQ_QT_CHUNKS * 16);
          const int token = w.q_start + w.m * (DQ_ROWS / p.pack);
#pragma unroll
          for (int cb = 0; cb < HEAD_DIM / 64; ++cb) {
            tma_load_4d(q_smem + cb * DQ_QBLOCK, &args.q_map, &q_full, cb * 64, 0, w.kv_head, token);
            tma_load_4d(do_smem + cb * DQ_QBLOCK, &args.do_map, &q_full, cb * 64, 0, w.kv_head, token);
          }
        }
      } else {
        dq_copy_q(p, w, q_smem, do_smem, lane);
        cp_async_commit();
        cp_async_wait<0>();
        fence_proxy_async_shared();
        __syncwarp();
        if (lane == 0) mbarrier_arrive(&q_full);
      }
      for (int i = 0; i < tiles; ++i) {
        const int n = w.n_begin + i, ks = i % DQ_K_STAGES, vs = i % DQ_V_STAGES;
        const bool whole = args.tma && (n + 1) * DQ_KEYS <= w.k_len;  // else cp.async: zeros past the keys
        for (int part = 0; part < 2; ++part) {  // K, then V
          uint64_t* full = part ? &v_full[vs] : &k_full[ks];
          const int stages = part ? DQ_V_STAGES : DQ_K_STAGES;
          if (i >= stages) mbarrier_wait(part ? &v_empty[vs] : &k_empty[ks], ((i / stages) + 1) & 1);
          uint4* dst = part ? v_smem + vs * DQ_KV_CHUNKS : k_smem + ks * DQ_KV_CHUNKS;
          if (whole) {
            if (lane == 0) {
              mbarrier_arrive_expect_tx(full, DQ_KV_CHUNKS * 16);
              tma_load_5d(dst, part ? &args.v_map : &args.k_map, full, 0, w.k_start + n * DQ_KEYS, 0, 0, w.kv_head);
            }
          } else {
            dq_copy_kv(p, w, n, dst, dst, part == 0, part == 1, lane);
            cp_async_commit();
            cp_async_wait<0>();
            fence_proxy_async_shared();
            __syncwarp();
            if (lane == 0) mbarrier_arrive(full);
          }
        }
      }
    }
    return;
  }
  set_max_registers<DQ_CONSUMER_REGS, true>();

  // This thread's rows: row0 + {0, 8} of the tile (accumulator rows g and g + 8 of its warp).
  const int row0 = wg * 64 + (warp % 4) * 16 + g;
  const int pr0 = w.m * DQ_ROWS + row0;
  wait_for_prerequisite_grid();  // the preprocess wrote lse2 / delta
  const int64_t stat0 = accum_row(p, w, pr0);
  // Rows past the sequence: P = 0 (their dQ is never stored; this keeps them finite).
  const float lse2[2] = {pr0 < w.rows ? p.lse2[stat0] : INFINITY, pr0 + 8 < w.rows ? p.lse2[stat0 + 8] : INFINITY};
  const float delta[2] = {pr0 < w.rows ? p.delta[stat0] : 0.f, pr0 + 8 < w.rows ? p.delta[stat0 + 8] : 0.f};
  const float sl2 = p.scale_log2;
  const int off = w.k_len - w.q_len;
  KeyRange keys[2];  // visible keys of this thread's rows (mask.cuh)
#pragma unroll
  for (int h = 0; h < 2; ++h) keys[h] = visible_keys(p, (pr0 + 8 * h) / p.pack, off, w.k_len);

  const uint64_t q_desc = wgmma_desc(q_smem + wg * 64 * 8, 16, 1024);
  const uint64_t do_desc = wgmma_desc(do_smem + wg * 64 * 8, 16, 1024);
  const uint64_t k_desc = wgmma_desc(k_smem, 16, GROUP_BYTES);    // K-major B of S
  const uint64_t v_desc = wgmma_desc(v_smem, 16, GROUP_BYTES);    // K-major B of dP
  const uint64_t kt_desc = wgmma_desc(k_smem, 1024, GROUP_BYTES);  // MN-major B of dQ

  float dq[DQ_D_TILES * 4];
#pragma unroll
  for (int i = 0; i < DQ_D_TILES * 4; ++i) dq[i] = 0.f;
  uint32_t da[DQ_KEYS / 16][4];  // dS of the last tile as A fragments, read by its dQ GEMM
  float s[DQ_S_TILES * 4], dp[DQ_S_TILES * 4];
  auto& s4 = reinterpret_cast<float(&)[DQ_S_TILES][4]>(s);
  auto& dp4 = reinterpret_cast<float(&)[DQ_S_TILES][4]>(dp);

  mbarrier_wait(&q_full, 0);
  for (int i = 0; i < tiles; ++i) {
    const int n = w.n_begin + i, ks = i % DQ_K_STAGES, vs = i % DQ_V_STAGES;
    const uint64_t kd = k_desc + ks * DQ_KV_CHUNKS, vd = v_desc + vs * DQ_KV_CHUNKS;
    mbarrier_wait(&k_full[ks], use_parity<DQ_K_STAGES>(i));
    wgmma_fence();
    Wgmma<T, DQ_KEYS>::ss<0, 0>(s, q_desc, kd);
#pragma unroll
    for (int kt = 1; kt < HEAD_DIM / 16; ++kt) Wgmma<T, DQ_KEYS>::ss<1, 0>(s, q_desc + dq_q_step(kt), kd + k_step(kt));
    wgmma_commit();
    mbarrier_wait(&v_full[vs], use_parity<DQ_V_STAGES>(i));
    Wgmma<T, DQ_KEYS>::ss<0, 0>(dp, do_desc, vd);
#pragma unroll
    for (int kt = 1; kt < HEAD_DIM / 16; ++kt) Wgmma<T, DQ_KEYS>::ss<1, 0>(dp, do_desc + dq_q_step(kt), vd + k_step(kt));
    wgmma_commit();
    // The last tile's dQ GEMM and this S are done (groups complete in order): its K stage is free.
    wgmma_wait<1>();
    wgmma_pin(s);
    wgmma_pin(dq);
    if (i > 0 && lane == 0) mbarrier_arrive(&k_empty[(i - 1) % DQ_K_STAGES]);
    if constexpr (!ScoreMod::ACTIVE) {
#pragma unroll
      for (int t = 0; t < DQ_S_TILES; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) s4[t][e] = fast_exp2(fmaf(s4[t][e], sl2, -lse2[e / 2]));
    }
    wgmma_wait<0>();
    wgmma_pin(dp);
    if (lane == 0) mbarrier_arrive(&v_empty[vs]);
#pragma unroll
    for (int t = 0; t < DQ_S_TILES; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if constexpr (ScoreMod::ACTIVE) {  // the score hook (score.cuh): dS takes its slope
          const int kv = n * DQ_KEYS + t * 8 + 2 * c + (e & 1);
          const TokenHead th = packed_row(pr0 + 8 * (e / 2), p.pack, w.q_start, w.kv_head);
          const ScoreMod score_mod(p);
          const float raw = s4[t][e];
          const int q_idx = variant_q_idx(w, th.token);
          const float score = score_mod.score(raw, w.seq, th.head, q_idx, kv);
          s4[t][e] = fast_exp2(fmaf(score, sl2, -lse2[e / 2]));
          dp4[t][e] = s4[t][e] * (dp4[t][e] - delta[e / 2]) *
                      score_mod.dscore(raw, score, w.seq, th.head, q_idx, kv);
        } else {
          dp4[t][e] = s4[t][e] * (dp4[t][e] - delta[e / 2]);
        }
      }
    if (dq_tile_masked(p, w, n)) {
#pragma unroll
      for (int t = 0; t < DQ_S_TILES; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = n * DQ_KEYS + t * 8 + 2 * c + (e & 1);
          bool hidden = key < keys[e / 2].lo || key >= keys[e / 2].hi;
          if constexpr (MaskMod::ACTIVE) {  // the mask hook (mask.cuh)
            const TokenHead th = packed_row(pr0 + 8 * (e / 2), p.pack, w.q_start, w.kv_head);
            hidden = hidden | !mask_mod_of(p).visible(w.seq, th.head, variant_q_idx(w, th.token), key);
          }
          if (hidden) dp4[t][e] = 0.f;
        }
    }
#pragma unroll
    for (int kk = 0; kk < DQ_KEYS / 16; ++kk) a_fragment(da[kk], dp4, kk);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < DQ_KEYS / 16; ++kk)
      Wgmma<T, HEAD_DIM>::rs<1>(dq, da[kk], kt_desc + ks * DQ_KV_CHUNKS + kk * ROWS16);
    wgmma_commit();
  }
  wgmma_wait<0>();
  wgmma_pin(dq);

  // dQ * scale as T through this warpgroup's own rows of the Q buffer (only its S GEMMs read
  // them, all done), then 16-byte rows to dq for the rows of the sequence.
  uint32_t* q32 = reinterpret_cast<uint32_t*>(q_smem);
  auto& dq4 = reinterpret_cast<float(&)[DQ_D_TILES][4]>(dq);
#pragma unroll
  for (int t = 0; t < DQ_D_TILES; ++t) {
    q32[DqRows::at(row0, t) * 4 + c] = pack2<T>(dq4[t][0] * p.scale, dq4[t][1] * p.scale);
    q32[DqRows::at(row0 + 8, t) * 4 + c] = pack2<T>(dq4[t][2] * p.scale, dq4[t][3] * p.scale);
  }
  named_barrier(1 + wg, 128);
  for (int idx = tid % 128; idx < 64 * CHUNKS; idx += 128) {
    const int row = wg * 64 + idx / CHUNKS, chunk = idx % CHUNKS;
    const int pr = w.m * DQ_ROWS + row;
    if (pr >= w.rows) continue;
    const TokenHead th = packed_row(pr, p.pack, w.q_start, w.kv_head);
    const int64_t token = th.token;
    const int head = th.head;
    *reinterpret_cast<uint4*>(static_cast<T*>(p.dq) + token * p.dq_stride_token + head * p.dq_stride_head + chunk * 8) =
        q_smem[DqRows::at(row, chunk)];
  }
}
