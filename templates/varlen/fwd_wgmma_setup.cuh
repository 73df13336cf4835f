{# The Hopper rung's wgmma descriptors and, with pingpong / overlap, the deferred O += P V.
   A fragment of varlen_fwd's body (included there). #}
  // wgmma descriptors (K-major Q and K, MN-major V), and the offsets (16-byte units, added to
  // the start address) of the k16 steps: 32 bytes along a 128-byte atom row, then the next atom.
  const uint64_t q_desc = wgmma_desc(q_smem + (warp / 4) * 64 * ROW_CHUNKS, 16, GROUP_BYTES);
  const uint64_t k_desc = wgmma_desc(k_smem, 16, GROUP_BYTES);
  const uint64_t v_desc = wgmma_desc(v_smem, 1024, GROUP_BYTES);
  auto k_step = [](int kt) { return (kt / 4) * 64 + (kt % 4) * 2; };
  constexpr int V_STEP = 2 * GROUP_BYTES / 16;  // 16 keys of V
{% if pingpong or overlap %}
  // The previous tile's P (A fragments of its O += P V, issued in this tile's turn).
  uint32_t p_frag[N_TILES / 2][4];
  const int wg = warp / 4;
  auto issue_pv = [&](int pv_stage) {
    float(&acc)[CHUNKS * 4] = reinterpret_cast<float(&)[CHUNKS * 4]>(o);
    wgmma_pin(acc);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < N_TILES / 2; ++kk)
      Wgmma<T, HEAD_DIM>::rs<1>(acc, p_frag[kk], v_desc + pv_stage * TILE_CHUNKS + kk * V_STEP);
    wgmma_commit();
  };
  // Turns: warpgroup 0 goes first. Each warpgroup takes tiles + 1 turns (the last one is the
  // last tile's O += P V); every turn but warpgroup 1's last hands the next to the other, so
  // no arrival is left over.
  if (PINGPONG && wg == 1 && w.tile_begin < w.tile_end) named_barrier_arrive(PINGPONG_BAR, 256);
{% endif %}
