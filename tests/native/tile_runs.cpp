// Host build of mask.cuh's tile runs, for tests/test_mask_tile_runs.py: the same source the
// kernels include, compiled with g++. stdin: cases, each
//   "P n a b limit c_0 .. c_{n-1}": the search (passing_prefix_end / passing_suffix_begin); c_i 1
//     when tile i passes on its own; a box [x, y) passes when every tile in it does and
//     y - x <= limit (interval analysis' coarseness: monotone under inclusion). Prints
//     "prefix_end suffix_begin calls_prefix calls_suffix".
//   "T first n c_0 .. c_{n-1}": a mask map's TileRun over tiles first, first + 1, ... of classes
//     c_i (0 empty, 1 partial, 2 full). Prints the slot "span_first span_end full_first full_end".
#include <algorithm>
#include <climits>
#include <cstdint>
#include <iostream>
#include <vector>

#define __device__
#define __forceinline__ inline
using std::max;
using std::min;
#include "mask.cuh"

int main() {
  char mode;
  while (std::cin >> mode) {
    if (mode == 'T') {
      int first, n;
      std::cin >> first >> n;
      TileRun run;
      for (int i = 0; i < n; ++i) {
        int c;
        std::cin >> c;
        run.add(first + i, static_cast<TileClass>(c));
      }
      int slot[4];
      run.store(slot, first);
      std::cout << slot[0] << ' ' << slot[1] << ' ' << slot[2] << ' ' << slot[3] << '\n';
      continue;
    }
    int n, a, b, limit;
    std::cin >> n >> a >> b >> limit;
    std::vector<int> tile(n);
    for (int& c : tile) std::cin >> c;
    int calls = 0;
    auto passes = [&](int x, int y) {
      ++calls;
      if (x < a || y > b || x >= y) return false;  // out of the range asked about: a bug
      if (y - x > limit) return false;
      for (int i = x; i < y; ++i)
        if (!tile[i]) return false;
      return true;
    };
    const int end = passing_prefix_end(a, b, passes);
    const int prefix_calls = calls;
    calls = 0;
    const int begin = passing_suffix_begin(a, b, passes);
    std::cout << end << ' ' << begin << ' ' << prefix_calls << ' ' << calls << '\n';
  }
  return 0;
}
