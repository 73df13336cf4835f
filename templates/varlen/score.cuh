// The score hook, shared by the forward and the backward (its dQ kernel too): where a user
// score_mod plugs in, and the logit soft cap, its first user.
//
// For the raw logit s = q . k of query q_idx, key kv_idx (from the sequence's start), query head
// h and sequence b, the kernels' logit L (natural units) is given by
//   L * log2(e) = scale_log2 * score(s, b, h, q_idx, kv_idx),
// and the backward multiplies dS by dscore(s, score(s, ...), b, h, q_idx, kv_idx) = (dL / ds) /
// scale (it applies scale to dQ and dK once, after the tile loop). Index arguments a hook does
// not read cost nothing: they are dead code once it is inlined. IdentityScore (no cap, no user
// function) is inactive: every use of it compiles away. KV_AFFINE: score(s, b, h, q_idx, kv_idx)
// = s + kv_slope(b, h, q_idx) * kv_idx + (a part free of kv_idx), which the forward's tile loop
// turns into one FMA per logit (fwd_softmax.cuh's score_tile); only a user's bias can be.
// PAIR_READS: score() reads a captured tensor at an index of both q_idx and kv_idx (a relative
// position table); without GQA packing the kernels then step q_idx by constants, so that the
// compiler sees equal q_idx - kv_idx as one read. UNIT_SLOPE: dscore() is 1 (score + a bias of
// the indices alone, KV_AFFINE or not: a bias table's), so the backward's dS^T is as without a hook.
// WARP_TILES (optional: false where a hook does not declare it): the forward hands a thread's
// whole tile to score_all (the soft cap with poly_tanh: one warp vote a tile decides whether any
// logit needs the hardware tanh).

// Whether a score hook takes a thread's whole tile at once (score_all: SoftCapScore with
// poly_tanh); hooks that do not say are elementwise.
template <class Score, class = void>
struct WarpTiles : std::false_type {};
template <class Score>
struct WarpTiles<Score, std::void_t<decltype(Score::WARP_TILES)>> : std::bool_constant<Score::WARP_TILES> {};

struct IdentityScore {
  static constexpr bool ACTIVE = false;
  static constexpr bool KV_AFFINE = false;
  static constexpr bool PAIR_READS = false;
  static constexpr bool UNIT_SLOPE = true;
  template <class Params>
  __device__ __forceinline__ explicit IdentityScore(const Params&) {}
  __device__ __forceinline__ float score(float s, int, int, int, int) const { return s; }
  __device__ __forceinline__ float dscore(float, float, int, int, int, int) const { return 1.f; }
  __device__ __forceinline__ float kv_slope(int, int, int) const { return 0.f; }
};

// Logit soft cap (Gemma-2): L = cap * tanh(scale * s / cap). The host folds cap * log2(e) into
// scale_log2 and the factor of s into cap_scale: scale / cap for the hardware tanh (the default),
// 2 * scale * log2(e) / cap for tanh_from_exp2 (exact_soft_cap, one more MUFU operation per
// logit), so the score is tanh(scale * s / cap) and its slope 1 - tanh^2.
constexpr bool EXACT_SOFT_CAP = JITATTN_EXACT_SOFT_CAP;  // (set by the entry template from the spec)
// poly_tanh: the hardware tanh only where the FMA pipe's cubic does not reach (soft_cap.cuh's
// tanh_split; exclusive with the exact tanh), so that a forward whose logits all lie within it
// issues one MUFU operation per logit, the softmax's exp2.
constexpr bool POLY_TANH = JITATTN_POLY_TANH;

struct SoftCapScore {
  static constexpr bool ACTIVE = true;
  static constexpr bool KV_AFFINE = false;
  static constexpr bool PAIR_READS = false;
  static constexpr bool UNIT_SLOPE = false;
  static constexpr bool WARP_TILES = POLY_TANH;  // the forward's tiles go through score_all
  float cap_scale;
  template <class Params>
  __device__ __forceinline__ explicit SoftCapScore(const Params& p) : cap_scale(p.cap_scale) {}
  __device__ __forceinline__ float score(float s, int, int, int, int) const {
    return EXACT_SOFT_CAP ? tanh_from_exp2(s * cap_scale) : POLY_TANH ? tanh_split(s * cap_scale)
                                                                      : tanh_approx(s * cap_scale);
  }
  // score() of every logit of a thread's tile (POLY_TANH): the same values, with the hardware tanh
  // issued only when some logit of the warp's tile is beyond the cubic's reach (one vote a tile;
  // with a cap well above the logits, never), instead of tanh_split's select computing both.
  template <int N>
  __device__ __forceinline__ void score_all(float (&s)[N]) const {
    float widest = 0.f;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      s[i] *= cap_scale;
      widest = fmaxf(widest, fabsf(s[i]));  // (a NaN is left out: the cubic passes it on)
    }
    if (__any_sync(0xffffffffu, widest > TANH_POLY_REACH)) {
#pragma unroll
      for (int i = 0; i < N; ++i) s[i] = tanh_split(s[i]);
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) s[i] = tanh_poly(s[i]);
    }
  }
  __device__ __forceinline__ float dscore(float, float th, int, int, int, int) const { return fmaf(-th, th, 1.f); }
  __device__ __forceinline__ float kv_slope(int, int, int) const { return 0.f; }
};
