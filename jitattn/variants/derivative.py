"""d(score_mod)/d(score) as a tree: the chain rule over the variant's tree, then simplified.

The backward multiplies dS by this (render.py emits it as ScoreMod::dscore). Subtrees that do not
depend on ``score`` have derivative zero and are dropped, so ``where(cond, score, -inf)`` gives
``where(cond, 1.0, 0.0)``. Derivative nodes reuse the forward's own nodes (``tanh(x)`` in
``1 - tanh(x)^2``), so the renderer can share them with the value the forward already returned.
At ties and kinks the rules follow torch's autograd: min/max split the gradient in half at
equal operands, abs has slope 0 at 0.
"""
from __future__ import annotations

import math

from jitattn.variants.tree import Variant, const_value, derived_variant

ONE, ZERO, HALF = ("const", 1.0), ("const", 0.0), ("const", 0.5)
LN2 = ("const", math.log(2.0))


def _is_const(node, value=None) -> bool:
    if node[0] != "const" or type(const_value(node[1])) is not float:
        return False
    return value is None or const_value(node[1]) == value


def _fold(op: str, *values):
    """The value of a float op on constants, or None when folding would need a rule (inf, nan)."""
    try:
        result = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
                  "div": lambda a, b: a / b, "neg": lambda a: -a}[op](*values)
    except (KeyError, OverflowError, ZeroDivisionError):
        return None
    return result if math.isfinite(result) else None


def simplify(node: tuple) -> tuple:
    """Local algebra on float nodes that never changes a finite result: constants folded, x*1,
    x+0, x-0, 0-x, --x, where with equal branches or a constant condition."""
    op = node[0]
    if op in ("add", "sub", "mul", "div"):
        a, b = node[1], node[2]
        if _is_const(a) and _is_const(b):
            folded = _fold(op, const_value(a[1]), const_value(b[1]))
            if folded is not None:
                return ("const", folded)
        if op == "add" and _is_const(a, 0.0):
            return b
        if op in ("add", "sub") and _is_const(b, 0.0):
            return a
        if op == "sub" and _is_const(a, 0.0):
            return simplify(("neg", b))
        if op == "mul" and _is_const(a, 1.0):
            return b
        if op == "mul" and _is_const(b, 1.0):
            return a
        if op == "mul" and (_is_const(a) or _is_const(b)):
            return _gather_constants(node)
    if op == "neg":
        if node[1][0] == "neg":
            return node[1][1]
        if _is_const(node[1]) and _fold("neg", const_value(node[1][1])) is not None:
            return ("const", -const_value(node[1][1]))
    if op == "where":
        if node[2] is node[3] or (node[2][0] == node[3][0] == "const" and repr(node[2]) == repr(node[3])):
            return node[2]
        if node[1][0] == "const":
            return node[2] if node[1][1] else node[3]
    return node


def _gather_constants(node: tuple) -> tuple:
    """c1 * (x * c2) -> x * (c1 * c2), in any order of the operands: one constant per product."""
    c, x = (node[1], node[2]) if _is_const(node[1]) else (node[2], node[1])
    if x[0] == "mul" and (_is_const(x[1]) or _is_const(x[2])):
        c2, y = (x[1], x[2]) if _is_const(x[1]) else (x[2], x[1])
        folded = _fold("mul", const_value(c[1]), const_value(c2[1]))
        if folded is not None:
            return y if folded == 1.0 else ("mul", y, ("const", folded))
    return node


def _mul(a, b):
    if a is None or b is None:
        return None
    return simplify(("mul", a, b))


def _add(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return simplify(("add", a, b))


def _neg(a):
    return None if a is None else simplify(("neg", a))


def _zero(a):
    return ZERO if a is None else a


def d(node: tuple, memo: dict | None = None):
    """The derivative of a float node with respect to the ``score`` argument; None where it is zero
    (the node does not depend on score, or is not a float). ``memo`` (by node identity) makes a
    shared subtree's derivative one shared node."""
    memo = {} if memo is None else memo
    known = memo.get(id(node))
    if known is not None:
        return known[1]
    result = _d(node, memo)
    memo[id(node)] = (node, result)  # the node itself keeps its id from being reused
    return result


def _d(node: tuple, memo: dict):
    op = node[0]
    if op == "arg":
        return ONE if node[1] == "score" else None
    if op in ("const", "load", "float"):
        return None
    if op in ("add", "sub"):
        da, db = d(node[1], memo), d(node[2], memo)
        return _add(da, db if op == "add" else _neg(db))
    if op == "mul":
        a, b = node[1], node[2]
        return _add(_mul(d(a, memo), b), _mul(a, d(b, memo)))
    if op == "div":
        a, b = node[1], node[2]
        da, db = d(a, memo), d(b, memo)
        quotient = None if da is None else simplify(("div", da, b))
        if db is None:
            return quotient
        # (a / b)' = a'/b - (a/b) * b'/b
        return _add(quotient, _neg(_mul(node, simplify(("div", db, b)))))
    if op == "neg":
        return _neg(d(node[1], memo))
    if op == "abs":
        dx = d(node[1], memo)
        if dx is None:
            return None
        x = node[1]
        return simplify(("where", ("lt", x, ZERO), _neg(dx), simplify(("where", ("gt", x, ZERO), dx, ZERO))))
    if op in ("min", "max"):
        a, b = node[1], node[2]
        da, db = d(a, memo), d(b, memo)
        if da is None and db is None:
            return None
        first = ("lt", a, b) if op == "min" else ("gt", a, b)
        tie = simplify(("mul", HALF, _add(da, db)))
        return simplify(("where", first, _zero(da), simplify(("where", ("eq", a, b), tie, _zero(db)))))
    if op == "where":
        da, db = d(node[2], memo), d(node[3], memo)
        if da is None and db is None:
            return None
        return simplify(("where", node[1], _zero(da), _zero(db)))
    inner = d(node[1], memo) if op in ("exp", "exp2", "log", "tanh", "sigmoid", "sqrt") else None
    if inner is None:
        return None
    x = node[1]
    if op == "exp":
        outer = node
    elif op == "exp2":
        outer = simplify(("mul", node, LN2))
    elif op == "log":
        outer = ("div", ONE, x)
    elif op == "tanh":
        outer = ("sub", ONE, ("mul", node, node))
    elif op == "sigmoid":
        outer = ("mul", node, ("sub", ONE, node))
    else:  # sqrt
        outer = ("div", HALF, node)
    return _mul(outer, inner)


def derivative(v: Variant) -> Variant:
    """d f / d score of score_mod ``v`` as a score_mod Variant (same captures and tensors), so
    reference_score and the renderer apply to it unchanged."""
    if v.kind != "score_mod":
        raise ValueError(f"derivative takes a score_mod variant, got a {v.kind}")
    return derived_variant("score_mod", _zero(d(v.tree)), v.captures, v.tensors)
