"""A call's variants as the custom ops carry them: each traced score_mod / mask_mod as its
canonical text (a str argument: data, validated again when the op rebuilds it) and their
captured tensors as one list (the score_mod's first), so torch.compile, dispatch modes and the
autograd formula see plain op arguments, never a Python function."""
from __future__ import annotations

import functools

import torch

# The ops' schema tail for the variants (jitattn/varlen/ops.py, jitattn/varlen/backward.py).
VARIANT_ARGS = "str? score_mod=None, str? mask_mod=None, Tensor[]? captures=None"


@functools.lru_cache(maxsize=256)
def _parsed(text: str, kind: str):
    from jitattn.variants import parse_tree

    return parse_tree(text, kind)


def variants_of(score_text: str | None, mask_text: str | None, captures) -> tuple[object, object]:
    """(score_mod, mask_mod) Variants rebuilt from an op's arguments (None where absent), each
    with its captured tensors: a ValueError naming the argument when the texts do not parse or
    the list does not hold one tensor per captured slot."""
    captures = list(captures or ())
    variants = []
    for name, text in (("score_mod", score_text), ("mask_mod", mask_text)):
        if text is None or text == "":
            variants.append(None)
            continue
        if not isinstance(text, str):
            raise TypeError(f"{name} must be a traced variant's canonical text (str) or None, got {type(text).__name__}")
        variant = _parsed(text, name)
        count = len(variant.captures)
        if len(captures) < count:
            raise ValueError(f"captures holds {len(captures)} tensors, fewer than {name}'s {count} captured slots")
        variants.append(variant.bind(captures[:count]))
        captures = captures[count:]
    if captures:
        raise ValueError(f"captures holds {len(captures)} more tensors than the variants capture")
    return variants[0], variants[1]


def op_arguments(score_mod, mask_mod) -> tuple[str | None, str | None, list | None]:
    """(score_mod text, mask_mod text, captures) for an op call from the API's arguments (functions,
    traced Variants, or None); functions are traced (jitattn/variants caches the trace per function)."""
    if score_mod is None and mask_mod is None:
        return None, None, None
    from jitattn.variants import trace_mask_mod, trace_score_mod

    score = _traced(score_mod, trace_score_mod)
    mask = _traced(mask_mod, trace_mask_mod)
    return texts_and_captures(score, mask)


def texts_and_captures(score, mask) -> tuple[str | None, str | None, list | None]:
    """The ops' variant arguments of traced Variants (or None): attribute reads only, so
    torch.compile traces this with fullgraph=True (the captured tensors become graph inputs)."""
    captures = [*(score.tensors if score is not None else ()), *(mask.tensors if mask is not None else ())]
    return (score.key_text if score is not None else None, mask.key_text if mask is not None else None,
            captures or None)


def _traced(value, trace):
    from jitattn.variants import Variant

    return value if value is None or isinstance(value, Variant) else trace(value)


def op_arguments_outside_trace(score_mod, mask_mod):
    """op_arguments, run by Python rather than traced by torch.compile: Variants are read in the
    graph; a function is traced outside it (a graph break: the tracer's proxies are not something
    dynamo can follow; pass jitattn.variants.trace_score_mod(fn) for fullgraph=True)."""
    from jitattn.variants import Variant

    if all(v is None or isinstance(v, Variant) for v in (score_mod, mask_mod)):
        return texts_and_captures(score_mod, mask_mod)
    return _untraced()(score_mod, mask_mod)


@functools.cache
def _untraced():
    return torch.compiler.disable(op_arguments, recursive=True)
