"""User-defined attention variants (FlexAttention's score_mod / mask_mod): traced into a validated
expression tree (tree.py, trace.py), differentiated (derivative.py) and rendered to the kernels'
C++ hooks (render.py). See docs/variants.md."""
from jitattn.variants.derivative import derivative
from jitattn.variants.reference import reference_mask, reference_score
from jitattn.variants.render import kv_affine, mask_map_needs, render_mask_mod, render_score_mod
from jitattn.variants.trace import trace_mask_mod, trace_score_mod
from jitattn.variants.tree import Variant, VariantError, parse_tree

__all__ = ["Variant", "VariantError", "derivative", "kv_affine", "mask_map_needs", "parse_tree", "reference_mask",
           "reference_score", "render_mask_mod", "render_score_mod", "trace_mask_mod", "trace_score_mod"]
