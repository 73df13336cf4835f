{# varlen_fwd's epilogue through shared memory (decode tiles: several warp columns): merge the
   warp columns' softmax states, normalize, store O and lse. A fragment of varlen_fwd's body. #}
  // Otherwise merge the warp columns' states through shared memory (the pipeline buffers are
  // free once every copy landed).
  __syncthreads();
  float* epi_o = shared.merge.o;
  float* epi_ml = shared.merge.ml;
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = warp_m * M_TILES * 16 + mt * 16 + h * 8 + g;
      float* dst = epi_o + (warp_n * BLOCK_M + row) * EPI_STRIDE;
#pragma unroll
      for (int d = 0; d < CHUNKS; ++d)
        *reinterpret_cast<float2*>(dst + d * 8 + 2 * c) = make_float2(o[mt][d][2 * h], o[mt][d][2 * h + 1]);
      float sum = row_sum[mt][h];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      if (c == 0) {
        epi_ml[(warp_n * BLOCK_M + row) * 2] = row_max[mt][h];
        epi_ml[(warp_n * BLOCK_M + row) * 2 + 1] = sum;
      }
    }
  __syncthreads();

  // Each thread finishes 8 columns of a row: merge the warp columns' states, normalize, store.
  for (int idx = tid; idx < BLOCK_M * CHUNKS; idx += THREADS) {
    const int row = idx / CHUNKS, chunk = idx % CHUNKS;
    const int pr = w.m0 + row;
    if (pr < 0 || pr >= w.rows) continue;
    float mx = -INFINITY;
#pragma unroll
    for (int wn = 0; wn < WARPS_N; ++wn) mx = fmaxf(mx, epi_ml[(wn * BLOCK_M + row) * 2]);
    const float base = mx == -INFINITY ? 0.f : mx * sl2;
    float acc[8] = {}, total = 0.f;
#pragma unroll
    for (int wn = 0; wn < WARPS_N; ++wn) {
      const float weight = fast_exp2(epi_ml[(wn * BLOCK_M + row) * 2] * sl2 - base);
      total += weight * epi_ml[(wn * BLOCK_M + row) * 2 + 1];
      const float* src = epi_o + (wn * BLOCK_M + row) * EPI_STRIDE + chunk * 8;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] += weight * src[e];
    }
    const float inv = total > 0.f ? 1.f / total : 0.f;  // no visible key: zeros, lse = -inf
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] *= inv;
    const TokenHead th = packed_row(pr, p.pack, w.q_start, w.kv_head);
    const int token = th.token, head = th.head;
    const float lse2 = full_lse2(p, w, head, token, total > 0.f ? base + log2f(total) : -INFINITY, sl2);
    if (w.splits == 1) {
      T* out = static_cast<T*>(p.out) + token * p.out_stride_token + head * p.out_stride_head + chunk * 8;
      store_floats<T, 8>(out, acc);
      if (p.lse && chunk == 0) p.lse[int64_t(head) * p.total_q + token] = lse2 * LN2;
    } else {
      float* part = p.partial_o + ((int64_t(w.split) * p.total_q + token) * p.num_heads_q + head) * HEAD_DIM + chunk * 8;
      reinterpret_cast<float4*>(part)[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
      reinterpret_cast<float4*>(part)[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
      if (chunk == 0) p.partial_lse[(int64_t(w.split) * p.num_heads_q + head) * p.total_q + token] = lse2;
    }
  }
