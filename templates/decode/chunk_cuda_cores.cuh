{# decode_chunk's body on CUDA cores: q vectors, per-row dot products shuffle-reduced, online
   softmax, O += P V, and the row groups' states into shared memory (included by chunk_kernel.cuh). #}
  const int lane = tid % LANES, row_group = tid / LANES;
  const bool lane_active = lane < VECS_PER_ROW;  // false only when HEAD_DIM/VEC is not a power of 2
  const int vec = lane_active ? lane : 0, col = vec * VEC;
  // RoPE: this thread's dims are [col, col + VEC); their rotate-half partners sit D/2 away.
  const int partner_vec = (vec + VECS_PER_ROW / 2) % VECS_PER_ROW;
  const bool first_half = col < HEAD_DIM / 2;
  RopeFreq rope_rev[VEC];  // unused (and elided) without RoPE
  float rope_step_cos[VEC], rope_step_sin[VEC];  // rotation by ROW_GROUPS positions

  // This thread's q vectors (and their rotate-half partners with RoPE), all loads issued before
  // any is used, and the RoPE frequencies once per CTA in shared memory rather than VEC double
  // pows per thread: the prologue is on every chunk's critical path (notes/decode-h200.md,
  // "The query prologue").
  float q[GROUP_TILE][VEC], q_partner[ROPE ? GROUP_TILE : 1][VEC], o[GROUP_TILE][VEC], alibi2[GROUP_TILE];
  SoftmaxState state[GROUP_TILE];
#pragma unroll
  for (int g = 0; g < GROUP_TILE; ++g) {
    if (group_base + g < p.group_size && lane_active) {
      const DTypeQ* q_head = static_cast<const DTypeQ*>(p.q) + (kv_head * p.group_size + group_base + g) * p.q_stride_head;
      load_floats<DTypeQ, VEC>(q_head + col, q[g]);
      if constexpr (ROPE) load_floats<DTypeQ, VEC>(q_head + partner_vec * VEC, q_partner[g]);
    }
  }
  if constexpr (ROPE) {
    for (int i = tid; i < HEAD_DIM / 2; i += THREADS) rope_table[i] = rope_freq(i, HEAD_DIM, p.rope_turns0, p.rope_ratio);
    __syncthreads();
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      rope_rev[e] = rope_table[(col + e) % (HEAD_DIM / 2)];
      __sincosf(rope_angle(ROW_GROUPS, rope_rev[e]), &rope_step_sin[e], &rope_step_cos[e]);
    }
  }
#pragma unroll
  for (int g = 0; g < GROUP_TILE; ++g) {
    const int head = kv_head * p.group_size + group_base + g;
    const bool head_valid = group_base + g < p.group_size;
    if constexpr (ROPE) {  // q sits at position L-1
      if (head_valid && lane_active) rope_rotate<VEC>(q[g], q_partner[g], rope_rev, p.kv_end - 1, first_half);
    }
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      q[g][e] = (head_valid && lane_active) ? q[g][e] * p.q_scale : 0.f;
      o[g][e] = 0.f;
    }
    // ALiBi in log2 units, relative to the last position (write_result adds the offset back).
    alibi2[g] = ALIBI && head_valid ? alibi_slope(head, num_heads) * LOG2E : 0.f;
  }

  for (int t = 0; t < num_tiles; ++t) {
    cp_async_wait_upto<STAGES - 2>(depth - 1);
    __syncthreads();  // tile t is visible to all; everyone is done with the stage reloaded next
    const int next = t + depth;
    if (next < num_tiles) copier.load(smem.stages[next % STAGES], chunk_begin + next * TILE, chunk_end);
    cp_async_commit();

    const Stage& stage = smem.stages[t % STAGES];
    const int row0 = chunk_begin + t * TILE;
    // RoPE: the exact (cos, sin) at this thread's first row of the tile; its later rows are
    // ROW_GROUPS positions apart and step there by angle addition (one sincos per tile, not 4).
    float rot_cos[VEC], rot_sin[VEC];
    if constexpr (ROPE) {
#pragma unroll
      for (int e = 0; e < VEC; ++e)
        __sincosf(rope_angle(static_cast<uint32_t>(row0 + row_group), rope_rev[e]), &rot_sin[e], &rot_cos[e]);
    }
    float prob[ROWS_PER_THREAD][GROUP_TILE];
#pragma unroll
    for (int j = 0; j < ROWS_PER_THREAD; ++j) {
      const int r = row_group + j * ROW_GROUPS;
      float kf[VEC];
      load_floats<DTypeKV, VEC>(&stage.k[r * HEAD_DIM + swz(r, vec) * VEC], kf);
      if constexpr (ROPE) {
        float partner[VEC];
        load_floats<DTypeKV, VEC>(&stage.k[r * HEAD_DIM + swz(r, partner_vec) * VEC], partner);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          if (j > 0) {  // advance by ROW_GROUPS positions: (c, s) <- (c, s) * (step_c, step_s)
            const float c = rot_cos[e] * rope_step_cos[e] - rot_sin[e] * rope_step_sin[e];
            rot_sin[e] = rot_sin[e] * rope_step_cos[e] + rot_cos[e] * rope_step_sin[e];
            rot_cos[e] = c;
          }
          kf[e] = first_half ? kf[e] * rot_cos[e] - partner[e] * rot_sin[e] : kf[e] * rot_cos[e] + partner[e] * rot_sin[e];
        }
      }
#pragma unroll
      for (int g = 0; g < GROUP_TILE; ++g) {
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < VEC; ++e) dot = fmaf(q[g][e], kf[e], dot);
#pragma unroll
        for (int offset = LANES / 2; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
        prob[j][g] = finish_logit(p, dot, alibi2[g], row0 + r, chunk_end);
      }
    }
#pragma unroll
    for (int g = 0; g < GROUP_TILE; ++g) {
      float tile_max = prob[0][g];
#pragma unroll
      for (int j = 1; j < ROWS_PER_THREAD; ++j) tile_max = fmaxf(tile_max, prob[j][g]);
      const float m_new = fmaxf(state[g].m, tile_max);
      const float rescale = exp2_diff(state[g].m, m_new);
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < ROWS_PER_THREAD; ++j) {
        prob[j][g] = exp2_diff(prob[j][g], m_new);
        sum += prob[j][g];
      }
      state[g].d = state[g].d * rescale + sum;
      state[g].m = m_new;
#pragma unroll
      for (int e = 0; e < VEC; ++e) o[g][e] *= rescale;
    }
#pragma unroll
    for (int j = 0; j < ROWS_PER_THREAD; ++j) {
      const int r = row_group + j * ROW_GROUPS;
      float vf[VEC];
      load_floats<DTypeKV, VEC>(&stage.v[r * HEAD_DIM + swz(r, vec) * VEC], vf);
#pragma unroll
      for (int g = 0; g < GROUP_TILE; ++g)
#pragma unroll
        for (int e = 0; e < VEC; ++e) o[g][e] = fmaf(prob[j][g], vf[e], o[g][e]);
    }
  }

  // Let merge_chunks (launched as a programmatic dependent) get scheduled while we finish;
  // it still waits for this whole grid before reading any partial.
  allow_dependent_launch();
  // Merge the row groups' states through shared memory (the pipeline buffers are free now).
  cp_async_wait<0>();
  __syncthreads();
#pragma unroll
  for (int g = 0; g < GROUP_TILE; ++g) {
    if (lane_active) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) smem.merge.o[row_group][g][col + e] = o[g][e];
    }
    if (lane == 0) {
      smem.merge.m[row_group][g] = state[g].m;
      smem.merge.d[row_group][g] = state[g].d;
    }
  }
