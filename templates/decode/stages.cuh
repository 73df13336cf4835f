{# Shared memory (the K/V stage ring, the merge scratch over it) and TileCopier, the cp.async
   copies that fill the ring (included by kernels.cu.j2). #}
struct __align__(16) Stage {
  DTypeKV k[TILE * HEAD_DIM];
  DTypeKV v[TILE * HEAD_DIM];
};
struct MergeScratch {  // the softmax states of the row groups (or warps), merged at the end
  float o[STATE_SETS][STATE_ROWS][HEAD_DIM + STATE_PAD];
  float m[STATE_SETS][STATE_ROWS];
  float d[STATE_SETS][STATE_ROWS];
};
union SharedStorage {
  Stage stages[STAGES];
  MergeScratch merge;
};

// Queues one thread's cp.async copies of K/V tiles, tile after tile (rows >= row_end are
// zero-filled). When VECS_PER_ROW divides THREADS (every power-of-two row: D 32/64/128/256), a
// thread copies the same column of rows ROW_STEP apart in every tile, so its source pointers
// just advance by ROW_STEP rows per copy and its shared-memory slots are constants: the 64-bit
// address arithmetic of recomputing each copy had been a third of the tensor-core loop's
// instructions (faster wherever the loop does not wait on memory: notes/decode-h200.md,
// "TileCopier"). Other head dims recompute each copy's address.
class TileCopier {
 public:
  __device__ __forceinline__ TileCopier(const DecodeParams& p, int kv_head, int chunk_begin, int tid)
      : p_(p), tid_(tid), kv_head_(kv_head) {
    if constexpr (kUniform) {
      row_ = tid / VECS_PER_ROW;
      vec_ = tid % VECS_PER_ROW;
      k_ = k_head() + (chunk_begin + row_) * p.k_stride_token + vec_ * VEC;
      v_ = v_head() + (chunk_begin + row_) * p.v_stride_token + vec_ * VEC;
    }
  }

  // The copies of rows [row0, row0 + TILE): call once per tile, tiles in order.
  __device__ __forceinline__ void load(Stage& stage, int row0, int row_end) {
    if constexpr (kUniform) {
      if (row0 + TILE <= row_end) {
        copy_rows<true>(stage, row0, row_end);
      } else {
        copy_rows<false>(stage, row0, row_end);
      }
    } else {
#pragma unroll
      for (int i = 0; i < LOADS_PER_THREAD; ++i) {
        const int c = i * THREADS + tid_;
        if (TILE_VECS % THREADS == 0 || c < TILE_VECS) {
          const int r = c / VECS_PER_ROW, col = (c % VECS_PER_ROW) * VEC;
          const bool valid = row0 + r < row_end;
          const int64_t row = valid ? row0 + r : row0;  // an address that exists even when unused
          const int slot = r * HEAD_DIM + swz(r, col / VEC) * VEC;
          cp_async_16(&stage.k[slot], k_head() + row * p_.k_stride_token + col, valid);
          cp_async_16(&stage.v[slot], v_head() + row * p_.v_stride_token + col, valid);
        }
      }
    }
  }

 private:
  static constexpr bool kUniform = THREADS % VECS_PER_ROW == 0;
  static constexpr int ROW_STEP = THREADS / VECS_PER_ROW;  // rows between a thread's copies
  static_assert(!kUniform || TILE == ROW_STEP * LOADS_PER_THREAD, "a thread's copies tile the stage exactly");

  __device__ __forceinline__ const DTypeKV* k_head() const {
    return static_cast<const DTypeKV*>(p_.k) + kv_head_ * p_.k_stride_head;
  }
  __device__ __forceinline__ const DTypeKV* v_head() const {
    return static_cast<const DTypeKV*>(p_.v) + kv_head_ * p_.v_stride_head;
  }

  template <bool kAllValid>
  __device__ __forceinline__ void copy_rows(Stage& stage, int row0, int row_end) {
    const int rows_left = row_end - row0 - row_;  // copy i is in range iff i * ROW_STEP < rows_left
#pragma unroll
    for (int i = 0; i < LOADS_PER_THREAD; ++i) {
      const int r = i * ROW_STEP;
      // Rows past the end read nothing (zero-fill) from an address that exists all the same.
      const bool valid = kAllValid || r < rows_left;
      const int slot = (row_ + r) * HEAD_DIM + swz(row_ + r, vec_) * VEC;
      cp_async_16(&stage.k[slot], valid ? k_ : k_head(), valid);
      cp_async_16(&stage.v[slot], valid ? v_ : v_head(), valid);
      k_ += ROW_STEP * p_.k_stride_token;
      v_ += ROW_STEP * p_.v_stride_token;
    }
  }

  const DecodeParams& p_;
  const int tid_, kv_head_;
  const DTypeKV* k_ = nullptr;  // this thread's next copy (uniform rows)
  const DTypeKV* v_ = nullptr;
  int row_ = 0, vec_ = 0;       // the row (in a tile) of its first copy and its column vector
};
