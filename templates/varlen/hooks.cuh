{# The two hook points of the varlen kernels, forward and backward: the score hook (ScoreMod,
   varlen/score.cuh) and the mask hook (MaskMod, varlen/mask.cuh). A spec that renders a user
   function passes its C++ source as score_mod_source / mask_mod_source, defining ScoreMod /
   MaskMod with the same members as the defaults; without one, the defaults are today's kernels
   (the soft cap, or nothing; no extra mask), compiled to the same code. #}
// The hooks this kernel was rendered with (varlen/score.cuh, varlen/mask.cuh).
{% if score_mod_source is defined %}
{{ score_mod_source }}
{% else %}
using ScoreMod = {{ "SoftCapScore" if soft_cap else "IdentityScore" }};
{% endif %}
{% if mask_mod_source is defined %}
{{ mask_mod_source }}
{% else %}
using MaskMod = NoMaskMod;
{% endif %}
