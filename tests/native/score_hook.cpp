// Host build of the varlen kernels' score hook (templates/varlen/score.cuh, with the soft cap's
// tanh from templates/common/soft_cap.cuh), for tests/test_varlen_template_parts.py: the same
// source the kernels include, with the device intrinsics it uses replaced by their exact host
// counterparts. Build with -I templates.
//
// argv: scale cap; stdin: raw logits s. stdout per s: s score dscore (SoftCapScore), then the
// same for IdentityScore, then SoftCapScore::score_all's value for s (JITATTN_POLY_TANH; the
// logits taken 8 at a time, as one thread's tile of a one-lane warp; else score's again).
#include <math.h>

#include <cmath>
#include <cstdlib>
#include <iostream>
#include <type_traits>
#include <vector>

#define __device__
#define __forceinline__ inline
namespace jitattn {
inline float fast_exp2(float x) { return std::exp2(x); }
}  // namespace jitattn
inline float __fdividef(float a, float b) { return a / b; }
inline bool __any_sync(unsigned, bool predicate) { return predicate; }  // a warp of one lane
using std::fmaf;
#include "common/soft_cap.cuh"
using namespace jitattn;
#include "varlen/score.cuh"  // JITATTN_EXACT_SOFT_CAP from the command line (-D), as the entry templates set it

struct Params {
  float cap_scale;  // as the bindings set it: 2 * scale * log2(e) / cap (exact tanh), scale / cap (tanh.approx)
};

int main(int argc, char** argv) {
  const double scale = std::atof(argv[1]), cap = std::atof(argv[2]);
  const Params p{static_cast<float>((EXACT_SOFT_CAP ? 2.0 * 1.4426950408889634 : 1.0) * scale / cap)};
  const SoftCapScore capped(p);
  const IdentityScore identity(p);
  std::vector<float> logits;
  for (float s; std::cin >> s;) logits.push_back(s);
  std::vector<float> tiled = logits;
  for (size_t at = 0; at + 8 <= tiled.size(); at += 8) {
    float tile[8];
    for (int i = 0; i < 8; ++i) tile[i] = tiled[at + i];
    if constexpr (POLY_TANH) capped.score_all(tile);
    else for (float& t : tile) t = capped.score(t, 0, 0, 0, 0);
    for (int i = 0; i < 8; ++i) tiled[at + i] = tile[i];
  }
  for (size_t at = tiled.size() / 8 * 8; at < tiled.size(); ++at) tiled[at] = capped.score(tiled[at], 0, 0, 0, 0);
  std::cout.precision(9);
  for (size_t n = 0; n < logits.size(); ++n) {
    const float s = logits[n], c = capped.score(s, 0, 0, 0, 0), i = identity.score(s, 0, 0, 0, 0);
    std::cout << s << ' ' << c << ' ' << capped.dscore(s, c, 0, 0, 0, 0) << ' ' << i << ' '
              << identity.dscore(s, i, 0, 0, 0, 0) << ' ' << tiled[n] << '\n';
  }
}
