{# The two hook points of the varlen kernels, forward and backward: the score hook (ScoreMod,
   varlen/score.cuh) and the mask hook (MaskMod, varlen/mask.cuh). A spec with a user variant
   (jitattn/variants: a traced score_mod / mask_mod) passes the C++ that jitattn's renderer wrote
   from its validated tree as score_mod_source / mask_mod_source, defining ScoreMod / MaskMod with
   the same members as the built-in ones; without one, the defaults are the built-in kernels (the
   soft cap, or nothing; no extra mask), compiled to the same code. The captured tensors of both
   sit in Params::captures, the score_mod's first (its slots from 0), the mask_mod's after them. #}
// The hooks this kernel was rendered with (varlen/score.cuh, varlen/mask.cuh).
{% if score_mod_source or mask_mod_source %}
{% include "varlen/variant.cuh" %}
{% endif %}
{% if score_mod_source %}
{{ score_mod_source }}
{% else %}
using ScoreMod = {{ "SoftCapScore" if soft_cap else "IdentityScore" }};
{% endif %}
{% if mask_mod_source %}
{{ mask_mod_source }}
{% else %}
using MaskMod = NoMaskMod;
{% endif %}

// The mask hook of a kernel's Params: a user mask_mod reads its captures past the score_mod's.
template <class Params>
__device__ __forceinline__ MaskMod mask_mod_of(const Params& p) {
{% if mask_mod_source and num_captures > score_mod_captures %}
  struct {
    const jitattn_variant::Capture* captures;
    int pack;
  } view{p.captures + {{ score_mod_captures }}, p.pack};
  return MaskMod(view);
{% else %}
  return MaskMod(p);
{% endif %}
}

// A variant's q_idx of query token `token` of work w: bottom-right aligned like the windows (the
// query's row in its sequence plus k_len - q_len), so q_idx >= kv_idx is the built-in causal rule.
template <class AnyWork>
__device__ __forceinline__ int variant_q_idx(const AnyWork& w, int token) {
  return token - w.q_start + (w.k_len - w.q_len);
}
