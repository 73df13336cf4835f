{# The consumer warps' fixed ldmatrix offsets of Q, K and V fragments. A fragment of
   varlen_fwd's body (included there). #}
  // ldmatrix addresses without per-load swizzle math. Every row a lane addresses has
  // row % 8 == lane % 8, and chunk 2k + bit (bit = lane / 16 for Q and V, (lane / 8) % 2 for
  // K) XORed with lane % 8 only changes its low 3 bits: it is CHUNK8_STEP * (k / 4) + ((2 * (k % 4) + bit)
  // ^ lane % 8). So four offsets per operand, fixed for the whole kernel, plus compile-time
  // immediates for the k-step, the 16-row tile and the stage reach every fragment.
  int q_frag[4], k_frag[4], v_frag[4];  // uint4 offsets for k-step (or d-pair) % 4
  {
    const int q_row = warp_m * M_TILES * 16 + lane % 16;
    const int k_row = warp_n * WARP_N + (lane / 16) * 8 + lane % 8;
    const int v_row = warp_n * WARP_N + ((lane / 8) % 2) * 8 + lane % 8;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      q_frag[k] = row_base(q_row) + ((2 * k + lane / 16) ^ (lane % 8));
      k_frag[k] = row_base(k_row) + ((2 * k + (lane / 8) % 2) ^ (lane % 8));
      v_frag[k] = row_base(v_row) + ((2 * k + lane / 16) ^ (lane % 8));
    }
  }
