"""The interval analysis behind MaskMod::classify, in Python: the mirror of variant.cuh's iv_*
helpers, one function per helper with the same logic, and an evaluator over a tree.

classify must be sound above all: a tile called EMPTY has no visible element, one called FULL no
hidden one (PARTIAL is always safe). Over a tile (b fixed, h in the KV head's group, q and kv in
ranges) each int node gets a range [lo, hi], each bool node (may_true, may_false):

- ranges are computed in 64-bit and widened to all of int32 when they leave it (the kernel's ints
  wrap there); a single value wraps as the kernel's int does, so an exact index stays exact;
- a captured tensor read at indices that are all exact (``prefix_len[b]``) is read, exactly;
  otherwise an int read is any int32 and a bool read may be either, except in the mask map's
  classify_warp (``ranges``): there a read whose one inexact index spans at most RANGE_READS
  values is the [min, max] of the elements it spans (bools: whether any is true, any false);
- floats are not tracked: a comparison that involves one may be either.

Causal, sliding-window and prefix-LM masks classify boxes exactly (EMPTY / FULL whenever brute
force says so); masks that compare two reads (document ids) are PARTIAL unless the reads are exact,
or (ranges) the ranges' values settle it: disjoint ids are EMPTY, one id on both sides FULL.
The renderer (render.py) emits the same walk as C++ calls of the helpers these functions mirror.
"""
from __future__ import annotations

from jitattn.variants.tree import INT32_MAX, INT32_MIN, Shared, Variant, children, const_value

FULL_INT = (INT32_MIN, INT32_MAX)
UNKNOWN_BOOL = (True, True)
FLOAT = ()  # floats carry no information

EMPTY, PARTIAL, FULL = "TILE_EMPTY", "TILE_PARTIAL", "TILE_FULL"
RANGE_READS = 1024  # variant.cuh's: the longest index range a ranges read spans


def iv_fit(lo: int, hi: int) -> tuple:
    if lo == hi:  # one value: the kernel's int wraps, so the exact value does too (as preload's exact int does)
        return iv_exact((lo - INT32_MIN) % 2**32 + INT32_MIN)
    return FULL_INT if lo < INT32_MIN or hi > INT32_MAX else (lo, hi)


def iv_exact(value: int) -> tuple:
    return (value, value)


def iv_add(a, b):
    return iv_fit(a[0] + b[0], a[1] + b[1])


def iv_sub(a, b):
    return iv_fit(a[0] - b[1], a[1] - b[0])


def iv_mul(a, b):
    corners = [a[0] * b[0], a[0] * b[1], a[1] * b[0], a[1] * b[1]]
    return iv_fit(min(corners), max(corners))


def iv_neg(a):
    return iv_fit(-a[1], -a[0])


def iv_abs(a):
    if a[0] >= 0:
        return a
    if a[1] <= 0:
        return iv_neg(a)
    return iv_fit(0, max(-a[0], a[1]))


def iv_min(a, b):
    return (min(a[0], b[0]), min(a[1], b[1]))


def iv_max(a, b):
    return (max(a[0], b[0]), max(a[1], b[1]))


def floordiv64(x: int, y: int) -> int:
    return x // y  # Python's // is floor division, as the C++ helper computes it


def iv_floordiv(a, d):
    lo, hi = None, None
    parts = []
    if d[0] <= 0 <= d[1]:
        lo, hi = 0, 0  # a zero divisor gives 0
    if d[0] <= -1:
        parts.append((d[0], min(d[1], -1)))
    if d[1] >= 1:
        parts.append((max(d[0], 1), d[1]))
    for p, r in parts:
        for x in a:
            for y in (p, r):
                q = floordiv64(x, y)
                lo = q if lo is None else min(lo, q)
                hi = q if hi is None else max(hi, q)
    return iv_fit(lo, hi)


def iv_mod(a, d):
    if d[0] == d[1] and d[0] not in (0, -1):
        m = d[0]
        if floordiv64(a[0], m) == floordiv64(a[1], m):
            return (a[0] - m * floordiv64(a[0], m), a[1] - m * floordiv64(a[1], m))
        return (0, m - 1) if m > 0 else (m + 1, 0)
    lo = d[0] + 1 if d[0] <= -1 else 0
    hi = d[1] - 1 if d[1] >= 1 else 0
    return (min(lo, 0), max(hi, 0))


def iv_where(c, a, b):
    if c[0] and not c[1]:
        return a
    if c[1] and not c[0]:
        return b
    return (min(a[0], b[0]), max(a[1], b[1]))


def iv_bwhere(c, a, b):
    if c[0] and not c[1]:
        return a
    if c[1] and not c[0]:
        return b
    return (a[0] or b[0], a[1] or b[1])


def iv_lt(a, b):
    return (a[0] < b[1], a[1] >= b[0])


def iv_le(a, b):
    return (a[0] <= b[1], a[1] > b[0])


def iv_gt(a, b):
    return iv_lt(b, a)


def iv_ge(a, b):
    return iv_le(b, a)


def iv_eq(a, b):
    return (a[0] <= b[1] and b[0] <= a[1], not (a[0] == a[1] == b[0] == b[1]))


def iv_ne(a, b):
    t, f = iv_eq(a, b)
    return (f, t)


def iv_beq(a, b):
    return ((a[0] and b[0]) or (a[1] and b[1]), (a[0] and b[1]) or (a[1] and b[0]))


def iv_bne(a, b):
    t, f = iv_beq(a, b)
    return (f, t)


def iv_and(a, b):
    return (a[0] and b[0], a[1] or b[1])


def iv_or(a, b):
    return (a[0] or b[0], a[1] and b[1])


def iv_not(a):
    return (a[1], a[0])


def iv_bool(value: bool) -> tuple:
    return (bool(value), not value)


INT_HELPERS = {"add": iv_add, "sub": iv_sub, "mul": iv_mul, "neg": iv_neg, "abs": iv_abs, "min": iv_min,
               "max": iv_max, "floordiv": iv_floordiv, "mod": iv_mod, "where": iv_where}
BOOL_HELPERS = {"lt": iv_lt, "le": iv_le, "gt": iv_gt, "ge": iv_ge, "eq": iv_eq, "ne": iv_ne, "and": iv_and,
                "or": iv_or, "not": iv_not, "where": iv_bwhere}


def read(tensor, indices: list):
    """One element as the kernel's loads read it: 0 outside the bounds, ints wrapped to int32."""
    if len(indices) != tensor.dim():
        raise ValueError("index count does not match the tensor")
    if any(not 0 <= i < size for i, size in zip(indices, tensor.shape)):
        value = 0
    else:
        value = tensor[tuple(indices)].item()
    if tensor.dtype.is_floating_point:
        return float(value)
    if isinstance(value, bool) or str(tensor.dtype) == "torch.bool":
        return bool(value)
    return (int(value) + 2 ** 31) % 2 ** 32 - 2 ** 31


def iv_read(tensor, indices: list, ranges: bool):
    """A read over index intervals, as variant.cuh's iv_read (ranges) or classify's exact read;
    ints give a range, bools (may_true, may_false)."""
    is_bool = str(tensor.dtype) == "torch.bool"
    spans = [k for k, i in enumerate(indices) if i[0] != i[1]]
    if not spans:
        element = read(tensor, [i[0] for i in indices])
        return iv_bool(element) if is_bool else iv_exact(element)
    k = spans[0]
    if not ranges or len(spans) > 1 or indices[k][1] - indices[k][0] >= RANGE_READS:
        return UNKNOWN_BOOL if is_bool else FULL_INT
    at = [i[0] for i in indices]
    values = [int(read(tensor, at[:k] + [x] + at[k + 1:])) for x in range(indices[k][0], indices[k][1] + 1)]
    return (max(values) != 0, min(values) == 0) if is_bool else (min(values), max(values))


def abstract(v: Variant, b: int, kv_head: int, pack: int, q_lo: int, q_hi: int, kv_lo: int, kv_hi: int,
             tensors=None, ranges: bool = False):
    """The abstract value of ``v``'s tree over the tile (an int range, a bool pair or FLOAT);
    ranges: classify_warp's reads (iv_read)."""
    tensors = v.tensors if tensors is None else tuple(tensors)
    args = {"b": iv_exact(b), "h": (kv_head * pack, kv_head * pack + pack - 1), "q_idx": (q_lo, q_hi),
            "kv_idx": (kv_lo, kv_hi)}
    shared, values = Shared(v.tree, v.captures), []
    for node, kind in zip(shared.nodes, shared.types):
        op = node[0]
        kids = [values[shared.number(c)] for c in children(node)]
        if op == "arg":
            value = args[node[1]]
        elif op == "const":
            c = const_value(node[1])
            value = FLOAT if kind == "float" else iv_bool(c) if kind == "bool" else iv_exact(c)
        elif op == "load":
            value = FLOAT if kind == "float" else iv_read(tensors[node[1]], kids, ranges)
        elif kind == "float":
            value = FLOAT
        elif any(shared.type(c) == "float" for c in children(node)):
            value = UNKNOWN_BOOL  # a comparison of floats
        elif kind == "int":
            value = INT_HELPERS[op](*kids)
        elif op in ("eq", "ne") and shared.type(node[1]) == "bool":
            value = (iv_beq if op == "eq" else iv_bne)(*kids)
        else:
            value = BOOL_HELPERS[op](*kids)
        values.append(value)
    return values[shared.number(v.tree)]


def classify(v: Variant, b: int, kv_head: int, pack: int, q_lo: int, q_hi: int, kv_lo: int, kv_hi: int,
             tensors=None, ranges: bool = False) -> str:
    """TILE_EMPTY / TILE_PARTIAL / TILE_FULL for mask_mod ``v`` over the tile, as the kernel's
    classify() computes it (ranges: its classify_warp)."""
    may_true, may_false = abstract(v, b, kv_head, pack, q_lo, q_hi, kv_lo, kv_hi, tensors, ranges)
    return EMPTY if not may_true else FULL if not may_false else PARTIAL
