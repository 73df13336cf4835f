// Host build of the varlen backward's schedule (templates/varlen/backward_schedule.cuh), for
// tests/test_varlen_backward_schedule.py: the same source the kernels include, compiled with
// g++ and driven over a grid on the CPU. Build with -DBLOCK_N_=.. -DBLOCK_M_=.. and
// -I templates/varlen.
//
// stdin: num_seqs num_heads_kv pack total_q total_k num_n_blocks window_left window_right
//        deterministic has_seqused, then cu_seq_q (N+1), cu_seq_k (N+1), seqused_k (N, when
//        has_seqused).
// stdout, per CTA that has work:   B block seq kv_head n_block m_begin m_end
//         per query tile it walks: M m masked turn semaphore_index (-1: not deterministic)
//         per key of its tile (kv_head 0): K key first last (visible_rows; keys from the sequence's 0)
//         then per key token:        W token written (key_written: 1 if a CTA writes its dK / dV)
#include <algorithm>
#include <climits>
#include <cstdint>
#include <iostream>
#include <vector>

#define __device__
#define __forceinline__ inline
using std::max;
using std::min;
struct { unsigned x; } blockIdx;
constexpr int BLOCK_N = BLOCK_N_;
constexpr int BLOCK_M = BLOCK_M_;

#include "backward_params.h"
#include "tile_scheduler.cuh"
#include "mask.cuh"
using MaskMod = NoMaskMod;  // (hooks.cuh: the default)
template <class Params>
MaskMod mask_mod_of(const Params& p) { return MaskMod(p); }  // (hooks.cuh)
#include "backward_schedule.cuh"

int main() {
  BwdParams p{};
  int has_used = 0, deterministic = 0;
  std::cin >> p.num_seqs >> p.num_heads_kv >> p.pack >> p.total_q >> p.total_k >> p.num_n_blocks >> p.window_left >>
      p.window_right >> deterministic >> has_used;
  std::vector<int> cu_q(p.num_seqs + 1), cu_k(p.num_seqs + 1), used(p.num_seqs);
  for (int& x : cu_q) std::cin >> x;
  for (int& x : cu_k) std::cin >> x;
  if (has_used)
    for (int& x : used) std::cin >> x;
  p.cu_seq_q = cu_q.data();
  p.cu_seq_k = cu_k.data();
  p.seqused_k = has_used ? used.data() : nullptr;
  p.dq_rows = int64_t(p.total_q) * p.pack;
  p.sem_stride = static_cast<int>(int64_t(p.total_q) * p.pack / BLOCK_M + p.num_seqs + 1);
  static int base;  // semaphore pointers are reported as indices from here
  p.semaphores = deterministic ? &base : nullptr;
  const int64_t ctas = int64_t(p.num_n_blocks) * p.num_seqs * p.num_heads_kv;
  for (int64_t b = 0; b < ctas; ++b) {
    blockIdx.x = static_cast<unsigned>(b);
    Work w;
    if (!decode_work(p, w)) continue;
    std::cout << "B " << b << ' ' << w.seq << ' ' << w.kv_head << ' ' << w.n_block << ' ' << w.m_begin << ' '
              << w.m_end << '\n';
    for (int m = w.m_begin; m < w.m_end; ++m) {
      const QueryTile t = query_tile(p, w, m);
      const int* sem = p.semaphores ? dq_semaphore(p, w, m) : nullptr;
      std::cout << "M " << m << ' ' << int(t.masked) << ' ' << t.turn << ' ' << (sem ? sem - &base : -1) << '\n';
    }
    for (int key = w.n0; w.kv_head == 0 && key < w.n0 + BLOCK_N; ++key) {
      const RowSpan v = visible_rows(p, w, key);
      std::cout << "K " << key << ' ' << v.first << ' ' << v.last << '\n';
    }
  }
  for (int token = 0; token < p.total_k; ++token) std::cout << "W " << token << ' ' << int(key_written(p, token)) << '\n';
  return 0;
}
