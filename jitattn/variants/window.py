"""Masks that are windows. A mask_mod made only of bounds on q_idx - kv_idx (causal, a sliding
window, a band: comparisons of q_idx and kv_idx with integer offsets, joined by `&`) says exactly
what the built-in window (left, right) says: key kv_idx is visible from q_idx iff
q_idx - left <= kv_idx <= q_idx + right, with the same bottom-right alignment. The kernels mask
a window by two compares per row and count its tiles arithmetically; the mask hook asks the mask
per element on the edge tiles and classifies tiles by interval analysis, 3-15% slower on the same
tiles (notes/variants-h100.md). So the launch layer (jitattn/varlen/forward.py, backward_launch.py)
lowers such a mask to the window, intersected with the call's own; JITATTN_LOWER_WINDOWS=0 keeps
the hook (tests of the hook itself, comparisons)."""
from __future__ import annotations

from jitattn.variants.tree import Variant, linear_positions

_MAX_OFFSET = 1 << 24
_FLIP = {"ge": "le", "gt": "lt", "le": "ge", "lt": "gt", "eq": "eq"}  # comparisons, and each mirrored


def _linear(node) -> tuple[int, int, int] | None:
    """node as coef_q * q_idx + coef_kv * kv_idx + const over ints (small offsets only: q_idx + c
    never wraps the kernels' int32 where it would not here), or None."""
    return linear_positions(node, _MAX_OFFSET)


def _bounds(node, lo: int | None, hi: int | None):
    """(lo, hi) on e = q_idx - kv_idx after the conjunction `node` (None: unbounded), or False
    when node is not such a conjunction."""
    op = node[0]
    if op == "const" and node[1] is True:
        return lo, hi
    if op == "and":
        first = _bounds(node[1], lo, hi)
        return False if first is False else _bounds(node[2], *first)
    if op not in _FLIP:
        return False
    a, b = _linear(node[1]), _linear(node[2])
    if a is None or b is None:
        return False
    coef_q, coef_kv, const = (x - y for x, y in zip(a, b))  # coef_q q + coef_kv kv + const OP 0
    if coef_q == -coef_kv == -1:
        coef_q, coef_kv, const, op = 1, -1, -const, _FLIP[op]
    if not coef_q == -coef_kv == 1:
        return False
    bound = -const  # e OP bound
    if op in ("ge", "gt", "eq"):
        new = bound + (op == "gt")
        lo = new if lo is None else max(lo, new)
    if op in ("le", "lt", "eq"):
        new = bound - (op == "lt")
        hi = new if hi is None else min(hi, new)
    return lo, hi


def _window_of_tree(tree: tuple) -> tuple[int, int] | None:
    found = _bounds(tree, None, None)
    if found is False:
        return None
    lo, hi = found
    if (lo is not None and lo > 0) or (hi is not None and hi < 0) or (lo is not None and hi is not None and lo > hi):
        return None  # not a window the kernels take (it would hide the diagonal side entirely)
    return (-1 if hi is None else hi, -1 if lo is None else -lo)


_WINDOWS: dict[str, tuple[int, int] | None] = {}  # by key text: every call asks (a dict lookup)


def window_of(mask: Variant) -> tuple[int, int] | None:
    """The built-in window (left, right) mask_mod `mask` equals, or None (it reads tensors, b or
    h, or is not a conjunction of bounds on q_idx - kv_idx that contains the diagonal)."""
    if not isinstance(mask, Variant) or mask.kind != "mask_mod" or mask.captures:
        return None
    key = mask.key_text
    if key not in _WINDOWS:
        if len(_WINDOWS) >= 1024:  # bounded: a process tracing masks without end
            _WINDOWS.clear()
        _WINDOWS[key] = _window_of_tree(mask.tree)
    return _WINDOWS[key]


def _tighter(a: int, b: int) -> int:
    """The tighter of two window edges (-1: unbounded)."""
    return b if a < 0 else a if b < 0 else min(a, b)


def lower_window(mask, left: int, right: int, enabled: bool = True):
    """(mask, left, right) for the kernels: a mask that is a window becomes None and the window
    the intersection of both; anything else passes unchanged."""
    window = window_of(mask) if enabled and mask is not None else None
    if window is None:
        return mask, left, right
    return None, _tighter(left, window[0]), _tighter(right, window[1])
