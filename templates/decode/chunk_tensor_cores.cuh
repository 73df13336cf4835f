{# decode_chunk's body on tensor cores (TENSOR_CORES): q fragments, S = Q K^T, online softmax,
   O += P V, and the warps' states into shared memory (included by chunk_kernel.cuh). #}
  const int warp = tid / 32, lane = tid % 32, quad = lane % 4;
  const int row_a = lane / 4, row_b = row_a + 8;  // this thread's two MMA rows (query heads)
  const bool valid_a = row_a < GROUP_TILE && group_base + row_a < p.group_size;
  const bool valid_b = row_b < GROUP_TILE && group_base + row_b < p.group_size;
  const int head_a = kv_head * p.group_size + group_base + row_a, head_b = head_a + 8;

  // Q as the MMA's A operand: HEAD_DIM/16 k-steps of 4 registers (dims: frag_dim), unscaled
  // (scaled on S). A register holds dims (d, d + 1) of one row, d even: one 32-bit load (rows
  // are 16-byte aligned), all of them issued together before any is used. This prologue runs
  // once per CTA on the critical path of every chunk. It had loaded element by element, and with
  // RoPE each load fed its rotation at once, so the loads waited on each other
  // (notes/decode-h200.md, "The query prologue").
  uint32_t qa[HEAD_DIM / 16][4];
  {
    // Dims split as frag_dim(kk, 0, half) (a constant: an immediate load offset) plus this
    // quad's offset, which the row pointers take once.
    const int quad_dim = frag_dim(0, quad, 0);
    const DTypeQ* q_a = static_cast<const DTypeQ*>(p.q) + head_a * p.q_stride_head + quad_dim;
    const DTypeQ* q_b = static_cast<const DTypeQ*>(p.q) + head_b * p.q_stride_head + quad_dim;
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
      const int d0 = frag_dim(kk, 0, 0), d1 = frag_dim(kk, 0, 1);
      qa[kk][0] = valid_a ? *reinterpret_cast<const uint32_t*>(q_a + d0) : 0u;
      qa[kk][1] = valid_b ? *reinterpret_cast<const uint32_t*>(q_b + d0) : 0u;
      qa[kk][2] = valid_a ? *reinterpret_cast<const uint32_t*>(q_a + d1) : 0u;
      qa[kk][3] = valid_b ? *reinterpret_cast<const uint32_t*>(q_b + d1) : 0u;
    }
  }
  if constexpr (ROPE) {
    // The D/2 frequencies, once per CTA (overlaps the loads above).
    for (int i = tid; i < HEAD_DIM / 2; i += THREADS) {
      rope_table[i] = rope_freq(i, HEAD_DIM, p.rope_turns0, p.rope_ratio);
      __sincosf(rope_angle(8, rope_table[i]), &rope_step[i].y, &rope_step[i].x);
    }
    __syncthreads();
    // q sits at position L-1. The rotate-half partner of k-step kk's dims is k-step
    // kk + HEAD_DIM/32 (frag_dim is linear in kk), so each pair is already in registers; rows a
    // and b share their rotation.
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 32; ++kk) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const RopeRotation<2> r = rope_rotation<2>(rope_table, frag_dim(kk, quad, half), p.kv_end - 1);
        rope_rotate_pairs<DTypeQ>(qa[kk][2 * half], qa[kk + HEAD_DIM / 32][2 * half], r);
        rope_rotate_pairs<DTypeQ>(qa[kk][2 * half + 1], qa[kk + HEAD_DIM / 32][2 * half + 1], r);
      }
    }
  }
  const float alibi_a = ALIBI && valid_a ? alibi_slope(head_a, num_heads) * LOG2E : 0.f;
  const float alibi_b = ALIBI && valid_b ? alibi_slope(head_b, num_heads) * LOG2E : 0.f;

  float o[HEAD_DIM / 8][4] = {};
  SoftmaxState state_a, state_b;
  const int warp_row = warp * WARP_ROWS;  // this warp's first row in a tile
  // The logits (log2 units, masked) of tile t for this warp's KEY_BLOCKS n8 blocks of keys.
  auto tile_logits = [&](Stage& stage, int t, float (&s)[KEY_BLOCKS][4]) {
    const int row0 = chunk_begin + t * TILE;
    // S (16 heads x this warp's KEY_BLOCKS n8 blocks of keys) = Q K^T, two k-steps per
    // ldmatrix.x4; even and odd k-steps go to separate accumulators so consecutive MMAs do not
    // wait on each other.
    float s_odd[KEY_BLOCKS][4] = {};
#pragma unroll
    for (int nb = 0; nb < KEY_BLOCKS; ++nb) s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.f;
    if constexpr (FP8) {
      // fp8 K: one 16-byte vector is one k-step (frag_dim); each register from ldmatrix holds
      // 4 fp8 values and widens to the k-step's two B registers.
      if constexpr (ROPE) {
        // x4 = two vectors of the first half and their partners D/2 later (when the first half
        // has an odd number of vectors, the last load repeats its pair).
        constexpr int HALF = VECS_PER_ROW / 2;
#pragma unroll
        for (int v0 = 0; v0 < HALF; v0 += 2) {
          RopeRotation<4> rot[2];  // dims 16 (v0 + i) + 4 quad + [0, 4) at this thread's key position
#pragma unroll
          for (int nb = 0; nb < KEY_BLOCKS; ++nb) {
            const int k_row = warp_row + nb * 8 + lane % 8, m = lane / 8;
            const int vec = v0 + (v0 + 1 < HALF ? m / 2 : 0) + (m % 2) * HALF;
            uint32_t b[4];
            ldmatrix_x4(b, &stage.k[k_row * HEAD_DIM + swz(k_row, vec) * VEC]);
#pragma unroll
            for (int i = 0; i < 2; ++i) {
              if (v0 + i < HALF) {
                const int d = 16 * (v0 + i) + 4 * quad;
                rope_key_block(rot[i], nb, rope_table, rope_step, d, row0 + warp_row + lane / 4);
                uint32_t x_lo, x_hi, y_lo, y_hi;
                rope_rotate_fp8<DTypeKV>(b[2 * i], b[2 * i + 1], rot[i], x_lo, x_hi, y_lo, y_hi);
                mma_16x8x16<DTypeMMA>(s[nb], qa[v0 + i], x_lo, x_hi);
                mma_16x8x16<DTypeMMA>(s_odd[nb], qa[v0 + i + HALF], y_lo, y_hi);
              }
            }
          }
        }
      } else {
        // x4 = four vectors (two when only two are left: the last load repeats them).
#pragma unroll
        for (int v0 = 0; v0 < VECS_PER_ROW; v0 += 4) {
#pragma unroll
          for (int nb = 0; nb < KEY_BLOCKS; ++nb) {
            const int k_row = warp_row + nb * 8 + lane % 8;
            const int vec = v0 + (lane / 8) % (VECS_PER_ROW - v0 >= 4 ? 4 : 2);
            uint32_t b[4];
            ldmatrix_x4(b, &stage.k[k_row * HEAD_DIM + swz(k_row, vec) * VEC]);
#pragma unroll
            for (int m = 0; m < 4; ++m) {
              if (v0 + m < VECS_PER_ROW) {
                uint32_t lo, hi;
                widen_fp8x4<DTypeKV>(b[m], lo, hi);
                mma_16x8x16<DTypeMMA>(m % 2 ? s_odd[nb] : s[nb], qa[v0 + m], lo, hi);
              }
            }
          }
        }
      }
    } else {
#pragma unroll
      for (int kk = 0; kk < HEAD_DIM / 32; ++kk) {
        RopeRotation<2> rot[2];  // RoPE: dims 16 kk + 2 quad (+ 8) + [0, 2) at this thread's key
#pragma unroll
        for (int nb = 0; nb < KEY_BLOCKS; ++nb) {
          const int k_row = warp_row + nb * 8 + lane % 8;
          uint32_t b[4];
          if constexpr (ROPE) {
            // Each x4 load takes a k-step of the first half and its rotate-half partner D/2
            // later: a thread then holds both elements of each (d, d + D/2) pair of its key row
            // in the same register slot, and rotates K in registers before the MMA (no pass over
            // shared memory, no extra barrier). One exact sincos per pair for the first key
            // block; the second, 8 positions later, advances it by angle addition.
            const int vec = 2 * kk + (lane / 8) % 2 + (lane / 16) * (HEAD_DIM / 16);
            ldmatrix_x4(b, &stage.k[k_row * HEAD_DIM + swz(k_row, vec) * VEC]);
#pragma unroll
            for (int h = 0; h < 2; ++h)
              rope_key_block(rot[h], nb, rope_table, rope_step, 16 * kk + 8 * h + 2 * quad, row0 + warp_row + lane / 4);
            rope_rotate_pairs<DTypeMMA>(b[0], b[2], rot[0]);
            rope_rotate_pairs<DTypeMMA>(b[1], b[3], rot[1]);
            mma_16x8x16<DTypeMMA>(s[nb], qa[kk], b[0], b[1]);
            mma_16x8x16<DTypeMMA>(s_odd[nb], qa[kk + HEAD_DIM / 32], b[2], b[3]);
          } else {
            ldmatrix_x4(b, &stage.k[k_row * HEAD_DIM + swz(k_row, 4 * kk + lane / 8) * VEC]);
            mma_16x8x16<DTypeMMA>(s[nb], qa[2 * kk], b[0], b[1]);
            mma_16x8x16<DTypeMMA>(s_odd[nb], qa[2 * kk + 1], b[2], b[3]);
          }
        }
      }
    }
    // Logits; the 4 lanes of a quad share a row.
#pragma unroll
    for (int nb = 0; nb < KEY_BLOCKS; ++nb) {
      float (&x)[4] = s[nb];
      const int col_row = row0 + warp_row + nb * 8 + 2 * quad;  // kv rows of x[0]/x[2] (+1 for x[1]/x[3])
      x[0] = finish_logit(p, (x[0] + s_odd[nb][0]) * p.q_scale, alibi_a, col_row, chunk_end);
      x[1] = finish_logit(p, (x[1] + s_odd[nb][1]) * p.q_scale, alibi_a, col_row + 1, chunk_end);
      x[2] = finish_logit(p, (x[2] + s_odd[nb][2]) * p.q_scale, alibi_b, col_row, chunk_end);
      x[3] = finish_logit(p, (x[3] + s_odd[nb][3]) * p.q_scale, alibi_b, col_row + 1, chunk_end);
    }
  };
  // Online softmax over logits `s` (overwritten with probabilities), then O += P V from `stage`.
  auto attend_tile = [&](Stage& stage, float (&s)[KEY_BLOCKS][4]) {
    // Online softmax over the warp's KEY_BLOCKS * 8 columns; the 4 lanes of a quad share a row.
    float max_a = -INFINITY, max_b = -INFINITY;
#pragma unroll
    for (int nb = 0; nb < KEY_BLOCKS; ++nb) {
      max_a = fmaxf(max_a, fmaxf(s[nb][0], s[nb][1]));
      max_b = fmaxf(max_b, fmaxf(s[nb][2], s[nb][3]));
    }
#pragma unroll
    for (int offset = 1; offset < 4; offset *= 2) {
      max_a = fmaxf(max_a, __shfl_xor_sync(0xffffffffu, max_a, offset));
      max_b = fmaxf(max_b, __shfl_xor_sync(0xffffffffu, max_b, offset));
    }
    const float m_a = fmaxf(state_a.m, max_a), m_b = fmaxf(state_b.m, max_b);
    const float rescale_a = exp2_diff(state_a.m, m_a), rescale_b = exp2_diff(state_b.m, m_b);
    float sum_a = 0.f, sum_b = 0.f;
#pragma unroll
    for (int nb = 0; nb < KEY_BLOCKS; ++nb) {
      float (&x)[4] = s[nb];
      x[0] = exp2_diff(x[0], m_a);
      x[1] = exp2_diff(x[1], m_a);
      x[2] = exp2_diff(x[2], m_b);
      x[3] = exp2_diff(x[3], m_b);
      sum_a += x[0] + x[1];
      sum_b += x[2] + x[3];
    }
#pragma unroll
    for (int offset = 1; offset < 4; offset *= 2) {
      sum_a += __shfl_xor_sync(0xffffffffu, sum_a, offset);
      sum_b += __shfl_xor_sync(0xffffffffu, sum_b, offset);
    }
    state_a.d = state_a.d * rescale_a + sum_a;
    state_b.d = state_b.d * rescale_b + sum_b;
    state_a.m = m_a;
    state_b.m = m_b;
#pragma unroll
    for (int j = 0; j < HEAD_DIM / 8; ++j) {
      o[j][0] *= rescale_a;
      o[j][1] *= rescale_a;
      o[j][2] *= rescale_b;
      o[j][3] *= rescale_b;
    }
    // O += P V. P's accumulator layout is already an A operand: 16 x 16 for mma.m16n8k16 with
    // two key blocks, 16 x 8 for mma.m16n8k8 with one. fp8 V: each ldmatrix.trans register
    // holds dims (2n, 2n + 1) of keys (2 quad, 2 quad + 1); a byte permute regroups it by dim
    // into an even-dim and an odd-dim B register (o blocks 2v and 2v + 1: o_dim).
    auto split_fp8_v = [](uint32_t x, uint32_t& even, uint32_t& odd) {
      widen_fp8x4<DTypeKV>(__byte_perm(x, 0u, 0x3120), even, odd);
    };
    if constexpr (KEY_BLOCKS == 2) {
      const uint32_t pa[4] = {pack2<DTypeMMA>(s[0][0], s[0][1]), pack2<DTypeMMA>(s[0][2], s[0][3]),
                              pack2<DTypeMMA>(s[1][0], s[1][1]), pack2<DTypeMMA>(s[1][2], s[1][3])};
      // x4.trans: matrices (keys 0-7, vector v), (keys 8-15, v), then the same for v + 1.
      const int v_row = warp_row + ((lane / 8) % 2) * 8 + lane % 8;
#pragma unroll
      for (int jj = 0; jj < VECS_PER_ROW / 2; ++jj) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, &stage.v[v_row * HEAD_DIM + swz(v_row, 2 * jj + lane / 16) * VEC]);
        if constexpr (FP8) {
#pragma unroll
          for (int i = 0; i < 2; ++i) {  // vector 2 jj + i: keys 0-7 in b[2i], keys 8-15 in b[2i + 1]
            uint32_t even_lo, odd_lo, even_hi, odd_hi;
            split_fp8_v(b[2 * i], even_lo, odd_lo);
            split_fp8_v(b[2 * i + 1], even_hi, odd_hi);
            mma_16x8x16<DTypeMMA>(o[2 * (2 * jj + i)], pa, even_lo, even_hi);
            mma_16x8x16<DTypeMMA>(o[2 * (2 * jj + i) + 1], pa, odd_lo, odd_hi);
          }
        } else {
          mma_16x8x16<DTypeMMA>(o[2 * jj], pa, b[0], b[1]);
          mma_16x8x16<DTypeMMA>(o[2 * jj + 1], pa, b[2], b[3]);
        }
      }
    } else {
      const uint32_t p_a = pack2<DTypeMMA>(s[0][0], s[0][1]), p_b = pack2<DTypeMMA>(s[0][2], s[0][3]);
      const int v_row = warp_row + lane % 8;
      if constexpr (FP8) {
        // x4.trans: four vectors of the warp's 8 keys (two when only two are left: the last
        // load repeats them).
#pragma unroll
        for (int v0 = 0; v0 < VECS_PER_ROW; v0 += 4) {
          const int vec = v0 + (lane / 8) % (VECS_PER_ROW - v0 >= 4 ? 4 : 2);
          uint32_t b[4];
          ldmatrix_x4_trans(b, &stage.v[v_row * HEAD_DIM + swz(v_row, vec) * VEC]);
#pragma unroll
          for (int m = 0; m < 4; ++m) {
            if (v0 + m < VECS_PER_ROW) {
              uint32_t even, odd;
              split_fp8_v(b[m], even, odd);
              mma_16x8x8<DTypeMMA>(o[2 * (v0 + m)], p_a, p_b, even);
              mma_16x8x8<DTypeMMA>(o[2 * (v0 + m) + 1], p_a, p_b, odd);
            }
          }
        }
      } else {
#pragma unroll
        for (int jj = 0; jj < HEAD_DIM / 32; ++jj) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, &stage.v[v_row * HEAD_DIM + swz(v_row, 4 * jj + lane / 8) * VEC]);
#pragma unroll
          for (int m = 0; m < 4; ++m) mma_16x8x8<DTypeMMA>(o[4 * jj + m], p_a, p_b, b[m]);
        }
      }
    }
  };
  if (!PIPELINED_LOGITS || num_tiles < PIPELINE_MIN_TILES) {
    for (int t = 0; t < num_tiles; ++t) {
      cp_async_wait_upto<STAGES - 2>(depth - 1);
      __syncthreads();  // tile t is visible to all; everyone is done with the stage reloaded next
      const int next = t + depth;
      if (next < num_tiles) copier.load(smem.stages[next % STAGES], chunk_begin + next * TILE, chunk_end);
      cp_async_commit();
      float s[KEY_BLOCKS][4];
      tile_logits(smem.stages[t % STAGES], t, s);
      attend_tile(smem.stages[t % STAGES], s);
    }
  } else {
    // Tile t + 1's logits are computed beside tile t's softmax and P V: two independent chains
    // per warp for the scheduler to interleave, for one tile less of prefetch. (Chunks this
    // long prefetch the whole ring: depth == STAGES - 1.)
    static_assert(PIPELINE_MIN_TILES > SHORT_CHUNK_TILES, "the pipelined loop assumes the full prefetch depth");
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // tile 0 is visible to all
    float s[KEY_BLOCKS][4];
    tile_logits(smem.stages[0], 0, s);
    for (int t = 0; t < num_tiles; ++t) {
      cp_async_wait<STAGES - 3>();
      __syncthreads();  // tile t + 1 is visible to all; everyone is done with tile t - 1's stage
      const int next = t + STAGES - 1;
      if (next < num_tiles) copier.load(smem.stages[next % STAGES], chunk_begin + next * TILE, chunk_end);
      cp_async_commit();
      float s_next[KEY_BLOCKS][4];  // past the last tile: computed from a stale stage, never used
      tile_logits(smem.stages[(t + 1) % STAGES], t + 1, s_next);
      attend_tile(smem.stages[t % STAGES], s);
#pragma unroll
      for (int nb = 0; nb < KEY_BLOCKS; ++nb)
#pragma unroll
        for (int i = 0; i < 4; ++i) s[nb][i] = s_next[nb][i];
    }
  }
  allow_dependent_launch();
  cp_async_wait<0>();
  __syncthreads();
  // Only the rows merge_states_and_write reads (this CTA's query heads), in vector stores.
  float* const o_a = smem.merge.o[warp][row_a];
  float* const o_b = smem.merge.o[warp][row_b];
#pragma unroll
  for (int j = 0; j < HEAD_DIM / 8; j += FP8 ? 2 : 1) {
    const int c = o_dim(j, quad, 0);
    if constexpr (FP8) {  // blocks j, j + 1 hold dims c + {0, 2} and c + {1, 3}
      if (valid_a) *reinterpret_cast<float4*>(o_a + c) = make_float4(o[j][0], o[j + 1][0], o[j][1], o[j + 1][1]);
      if (valid_b) *reinterpret_cast<float4*>(o_b + c) = make_float4(o[j][2], o[j + 1][2], o[j][3], o[j + 1][3]);
    } else {  // dims c, c + 1
      if (valid_a) *reinterpret_cast<float2*>(o_a + c) = make_float2(o[j][0], o[j][1]);
      if (valid_b) *reinterpret_cast<float2*>(o_b + c) = make_float2(o[j][2], o[j][3]);
    }
  }
  if (quad == 0) {
    smem.merge.m[warp][row_a] = state_a.m;
    smem.merge.d[warp][row_a] = state_a.d;
    smem.merge.m[warp][row_b] = state_b.m;
    smem.merge.d[warp][row_b] = state_b.d;
  }
