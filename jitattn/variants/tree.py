"""The variant expression tree: its nodes, their types, validation, and the canonical text form.

A variant (a user's score_mod or mask_mod) is data, never code: a small tree of whitelisted
operations that jitattn validates here and renders itself (render.py). The tree is a spec field,
so this module is also the validator for trees that arrive as text (a manifest, a record, the CLI).

Nodes are nested tuples ``(op, *children)`` (lists in JSON). Leaves:

- ``("arg", name)``: ``score`` (float; score_mod only), ``b``, ``h``, ``q_idx``, ``kv_idx`` (int).
- ``("const", value)``: a finite float, an int in int32 range, a bool, or the strings ``"inf"`` /
  ``"-inf"`` (float infinities, which JSON cannot spell; ``float("-inf")`` in a ``where`` is common).
- ``("load", slot, i0, ..., i{ndim-1})``: element of captured tensor ``slot`` at int indices.

Typing (every node has exactly one type, ``float``, ``int`` or ``bool``). The tree is explicit: an
operation's operands already have the types it takes; the tracer inserts the ``float`` casts that
torch's promotion implies (int with float gives float), so one meaning has one tree.

- ``add sub mul min max``: (int, int) -> int, (float, float) -> float. ``div``: floats only (the
  tracer casts ints, as torch's true division does). ``floordiv mod``: ints, Python floor
  semantics, and 0 for a zero divisor. ``neg abs``: int -> int, float -> float.
- ``lt le gt ge``: two ints or two floats -> bool. ``eq ne``: two of one type (bools too) -> bool.
- ``where(cond, a, b)``: cond bool, a and b of one type -> that type.
- ``and or``: bools -> bool; ``not``: bool -> bool.
- ``exp exp2 log tanh sigmoid sqrt``: float -> float. ``float``: int or bool -> float.
- ``load``: float32/float16/bfloat16 captures read as float, int32/int64 as int (int64 values
  are taken modulo 2**32, like every int here: ints are 32-bit and wrap), bool as bool.

A score_mod's tree is float, a mask_mod's bool. ``pow`` has no node: the tracer expands small
integer powers into multiplications.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

INT32_MIN, INT32_MAX = -(2 ** 31), 2 ** 31 - 1
MAX_TEXT_BYTES = 16 * 1024
MAX_DEPTH = 48
MAX_NODES = 1024
MAX_CAPTURES = 8
MAX_CAPTURE_NDIM = 4

KINDS = ("score_mod", "mask_mod")
INT_ARGS = ("b", "h", "q_idx", "kv_idx")
ARGS = {"score_mod": ("score", *INT_ARGS), "mask_mod": INT_ARGS}
CAPTURE_DTYPES = {"float32": "float", "float16": "float", "bfloat16": "float",
                  "int32": "int", "int64": "int", "bool": "bool"}
INFINITIES = {"inf": math.inf, "-inf": -math.inf}

ARITHMETIC = ("add", "sub", "mul", "min", "max")
COMPARISONS = ("lt", "le", "gt", "ge", "eq", "ne")
FLOAT_FUNCTIONS = ("exp", "exp2", "log", "tanh", "sigmoid", "sqrt")
ARITY = {**{op: 2 for op in (*ARITHMETIC, "div", "floordiv", "mod", *COMPARISONS, "and", "or")},
         **{op: 1 for op in ("neg", "abs", "not", "float", *FLOAT_FUNCTIONS)}, "where": 3}
OPS = tuple(sorted((*ARITY, "arg", "const", "load")))


class VariantError(ValueError):
    """A variant function or tree jitattn cannot compile: the message names the operation or the
    part of the tree at fault."""


def const_value(value: Any) -> float | int | bool:
    """The Python value of a constant leaf's payload (``"inf"`` -> math.inf)."""
    return INFINITIES[value] if isinstance(value, str) else value


def const_type(value: Any) -> str:
    """The type of a constant payload, or VariantError when it is not a valid constant."""
    if type(value) is bool:
        return "bool"
    if type(value) is int:
        if not INT32_MIN <= value <= INT32_MAX:
            raise VariantError(f"integer constant {value} is outside the int32 range")
        return "int"
    if type(value) is float:
        if not math.isfinite(value):
            raise VariantError(f"float constant {value!r} must be finite (spell infinities \"inf\" / \"-inf\")")
        return "float"
    if isinstance(value, str) and value in INFINITIES:
        return "float"
    raise VariantError(f"constant {value!r:.60} is not a number, a bool, \"inf\" or \"-inf\"")


def _result_type(op: str, types: list[str]) -> str | None:
    """The type of ``op`` applied to operands of ``types``; None when the operands do not fit."""
    if op in ARITHMETIC:
        return types[0] if types[0] == types[1] and types[0] in ("int", "float") else None
    if op == "div":
        return "float" if types == ["float", "float"] else None
    if op in ("floordiv", "mod"):
        return "int" if types == ["int", "int"] else None
    if op in ("neg", "abs"):
        return types[0] if types[0] in ("int", "float") else None
    if op in ("lt", "le", "gt", "ge"):
        return "bool" if types[0] == types[1] and types[0] in ("int", "float") else None
    if op in ("eq", "ne"):
        return "bool" if types[0] == types[1] else None
    if op == "where":
        return types[1] if types[0] == "bool" and types[1] == types[2] else None
    if op in ("and", "or"):
        return "bool" if types == ["bool", "bool"] else None
    if op == "not":
        return "bool" if types == ["bool"] else None
    if op in FLOAT_FUNCTIONS:
        return "float" if types == ["float"] else None
    if op == "float":
        return "float" if types[0] in ("int", "bool") else None
    raise AssertionError(op)


class _Checker:
    """One walk over a tree: checks ops, arity, leaves, slots and types, within the bounds."""

    def __init__(self, kind: str, captures: tuple):
        self.kind, self.captures, self.nodes = kind, captures, 0

    def type_of(self, node: Any, depth: int = 1) -> str:
        if depth > MAX_DEPTH:
            raise VariantError(f"the tree is deeper than {MAX_DEPTH} levels")
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise VariantError(f"the tree has more than {MAX_NODES} nodes")
        if not isinstance(node, (tuple, list)) or not node or not isinstance(node[0], str):
            raise VariantError(f"a node must be a list [op, ...], got {_short(node)}")
        op, children = node[0], node[1:]
        if op == "arg":
            if len(children) != 1 or children[0] not in ARGS[self.kind]:
                raise VariantError(f"{_short(node)}: a {self.kind} argument is one of {', '.join(ARGS[self.kind])}")
            return "float" if children[0] == "score" else "int"
        if op == "const":
            if len(children) != 1:
                raise VariantError(f"{_short(node)}: a constant has one value")
            return const_type(children[0])
        if op == "load":
            return self._load_type(node, depth)
        if op not in ARITY:
            raise VariantError(f"unknown operation {op!r:.40}; supported: {', '.join(OPS)}")
        if len(children) != ARITY[op]:
            raise VariantError(f"{op} takes {ARITY[op]} operand(s), got {len(children)}")
        types = [self.type_of(child, depth + 1) for child in children]
        result = _result_type(op, types)
        if result is None:
            raise VariantError(f"{op} does not take operands of types ({', '.join(types)})")
        return result

    def _load_type(self, node: Any, depth: int) -> str:
        if len(node) < 2 or type(node[1]) is not int or not 0 <= node[1] < len(self.captures):
            raise VariantError(f"{_short(node)}: load's slot must be a capture number in [0, {len(self.captures)})")
        dtype, ndim = self.captures[node[1]]
        if len(node) - 2 != ndim:
            raise VariantError(f"load of capture {node[1]} (ndim {ndim}) has {len(node) - 2} indices")
        for index in node[2:]:
            if self.type_of(index, depth + 1) != "int":
                raise VariantError(f"load of capture {node[1]}: indices must be ints")
        return CAPTURE_DTYPES[dtype]


def _short(value: Any) -> str:
    text = json.dumps(value, default=str) if isinstance(value, (list, tuple, dict)) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _as_tuples(node: Any) -> Any:
    return tuple(_as_tuples(child) for child in node) if isinstance(node, (list, tuple)) else node


def check_captures(captures: Any) -> tuple:
    """The capture table as a tuple of (dtype_name, ndim), or VariantError."""
    if not isinstance(captures, (list, tuple)) or len(captures) > MAX_CAPTURES:
        raise VariantError(f"captures must be a list of at most {MAX_CAPTURES} [dtype, ndim] pairs")
    table = []
    for entry in captures:
        if not isinstance(entry, (list, tuple)) or len(entry) != 2:
            raise VariantError(f"capture {_short(entry)} must be a [dtype, ndim] pair")
        dtype, ndim = entry
        if not isinstance(dtype, str) or dtype not in CAPTURE_DTYPES:
            raise VariantError(f"capture dtype {dtype!r:.40} is not one of {', '.join(CAPTURE_DTYPES)}")
        if type(ndim) is not int or not 0 <= ndim <= MAX_CAPTURE_NDIM:
            raise VariantError(f"capture ndim {ndim!r:.40} is not an int in [0, {MAX_CAPTURE_NDIM}]")
        table.append((dtype, ndim))
    return tuple(table)


def check_tree(kind: str, tree: Any, captures: tuple) -> str:
    """Validate ``tree`` for ``kind`` and the capture table; returns its type or raises VariantError."""
    if kind not in KINDS:
        raise VariantError(f"kind must be one of {', '.join(KINDS)}, got {kind!r:.40}")
    result = _Checker(kind, captures).type_of(tree)
    wanted = "float" if kind == "score_mod" else "bool"
    if result != wanted:
        raise VariantError(f"a {kind} must give a {wanted}, this tree gives a {result}")
    return result


@dataclass(frozen=True, eq=False)
class Variant:
    """A validated score_mod or mask_mod: kind, tree and capture table (the key), plus the
    captured tensors in slot order (not part of the key: new values never recompile).

    Two variants are equal when their key texts are equal."""

    kind: str
    tree: tuple
    captures: tuple = ()
    tensors: tuple = field(default=(), repr=False)

    def __post_init__(self):
        captures = check_captures(self.captures)
        check_tree(self.kind, self.tree, captures)  # bounded first: a DAG cannot expand past it
        tree = _as_tuples(self.tree)
        _check_tensors(self.tensors, captures)
        object.__setattr__(self, "captures", captures)
        object.__setattr__(self, "tree", tree)
        object.__setattr__(self, "tensors", tuple(self.tensors))
        self.key_text  # noqa: B018  (made now, not on first use: a call under torch.compile reads it
        # in the traced region, where json.dumps cannot be traced)

    def bind(self, tensors) -> "Variant":
        """This variant with ``tensors`` as its captures (e.g. one parsed from a record, given
        the call's tensors); each must match its slot's dtype and ndim."""
        tensors = tuple(tensors)
        if len(tensors) != len(self.captures):
            raise VariantError(f"{len(tensors)} tensors for {len(self.captures)} capture slots")
        _check_tensors(tensors, self.captures)
        bound = object.__new__(Variant)
        for name in ("kind", "tree", "captures", "key_text"):  # (key_text: the cached property's value)
            object.__setattr__(bound, name, getattr(self, name))
        object.__setattr__(bound, "tensors", tensors)
        return bound

    @cached_property
    def key_text(self) -> str:
        """Compact, sorted JSON of kind, tree and captures: the canonical form hashed into keys."""
        return json.dumps({"kind": self.kind, "tree": self.tree, "captures": self.captures},
                          sort_keys=True, separators=(",", ":"), allow_nan=False)

    @cached_property
    def digest(self) -> str:
        """The first 12 hex digits of sha256(key_text), for spec names."""
        return hashlib.sha256(self.key_text.encode()).hexdigest()[:12]

    def __repr__(self):
        captures = ", ".join(f"{ndim}-d {dtype}" for dtype, ndim in self.captures)
        return f"Variant({self.kind} {self.digest}: {expression(self.tree)}" + \
            (f"; captures: {captures})" if captures else ")")

    def __eq__(self, other):
        return isinstance(other, Variant) and self.key_text == other.key_text

    def __hash__(self):
        return hash(self.key_text)


def _check_tensors(tensors, captures: tuple) -> None:
    if not tensors:
        return
    if len(tensors) != len(captures):
        raise VariantError(f"{len(tensors)} captured tensors for {len(captures)} capture slots")
    for slot, (tensor, (dtype, ndim)) in enumerate(zip(tensors, captures)):
        got = (str(getattr(tensor, "dtype", type(tensor).__name__)).removeprefix("torch."),
               tensor.dim() if hasattr(tensor, "dim") else None)
        if got != (dtype, ndim):
            raise VariantError(f"capture {slot} must be a {ndim}-d {dtype} tensor, got {got[1]}-d {got[0]}")


def parse_tree(text: str, kind: str) -> Variant:
    """The Variant that ``text`` (a key_text) spells, validated; VariantError naming the problem.

    This is the door for trees from outside the process (manifests, records, the CLI): the text,
    the depth, the node count and the capture table are bounded before anything else is done."""
    if kind not in KINDS:
        raise VariantError(f"kind must be one of {', '.join(KINDS)}, got {kind!r:.40}")
    if not isinstance(text, str):
        raise VariantError(f"a variant's text must be a str, got {type(text).__name__}")
    if len(text.encode("utf-8", "surrogatepass")) > MAX_TEXT_BYTES:
        raise VariantError(f"a variant's text is limited to {MAX_TEXT_BYTES} bytes")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as error:
        raise VariantError(f"a variant's text is not valid JSON: {str(error)[:120]}") from None
    if not isinstance(data, dict) or set(data) != {"kind", "tree", "captures"}:
        raise VariantError('a variant\'s text is a JSON object with exactly "kind", "tree" and "captures"')
    if data["kind"] != kind:
        raise VariantError(f"expected a {kind}, the text holds a {_short(data['kind'])}")
    try:
        return Variant(kind, data["tree"], data["captures"])
    except RecursionError:
        raise VariantError(f"the tree is deeper than {MAX_DEPTH} levels") from None


def linear_positions(node: tuple, max_offset: int) -> tuple[int, int, int] | None:
    """An int node as (coefficient of q_idx, of kv_idx, constant) when it is made of +, -,
    negation, the two positions and int constants of at most max_offset in size; else None."""
    op = node[0]
    if op == "arg":
        return {"q_idx": (1, 0, 0), "kv_idx": (0, 1, 0)}.get(node[1])
    if op == "const":
        value = node[1]
        return (0, 0, value) if type(value) is int and abs(value) <= max_offset else None
    if op == "neg":
        inner = linear_positions(node[1], max_offset)
        return None if inner is None else tuple(-x for x in inner)
    if op in ("add", "sub"):
        a, b = linear_positions(node[1], max_offset), linear_positions(node[2], max_offset)
        if a is None or b is None:
            return None
        sign = 1 if op == "add" else -1
        return tuple(x + sign * y for x, y in zip(a, b))
    return None


def children(node: tuple) -> tuple:
    """The child nodes of a node (a load's indices; none for leaves)."""
    if node[0] == "load":
        return node[2:]
    return () if node[0] in ("arg", "const") else node[1:]


class Shared:
    """The distinct nodes of a valid tree, children first, each numbered once, with its type.

    Equal subtrees (same ops, constants of the same type and value: 1, 1.0 and True differ)
    share a number, and a subtree reached many times (traces and derivatives are DAGs in memory)
    is visited once, so the work is linear in distinct nodes, never in the expanded tree."""

    def __init__(self, tree, captures):
        self.captures = captures
        self.nodes: list = []
        self.types: list = []
        self._numbers: dict = {}
        self._by_id: dict = {}
        self._alive: list = []  # the nodes behind _by_id, so their ids stay theirs
        if tree is not None:
            self.number(tree)

    def number(self, node: tuple) -> int:
        known = self._by_id.get(id(node))
        if known is not None:
            return known
        kids = tuple(self.number(child) for child in children(node))
        op = node[0]
        if op == "const":
            structural = ("const", type(node[1]).__name__, repr(node[1]))
            kind = const_type(node[1])
        elif op == "arg":
            structural, kind = ("arg", node[1]), "float" if node[1] == "score" else "int"
        elif op == "load":
            structural, kind = ("load", node[1], kids), CAPTURE_DTYPES[self.captures[node[1]][0]]
        else:
            structural, kind = (op, kids), _result_type(op, [self.types[k] for k in kids])
            if kind is None:
                raise VariantError(f"{op} does not take operands of types "
                                   f"({', '.join(self.types[k] for k in kids)})")
        number = self._numbers.get(structural)
        if number is None:
            number = self._numbers[structural] = len(self.nodes)
            self.nodes.append(node)
            self.types.append(kind)
        self._by_id[id(node)] = number
        self._alive.append(node)
        return number

    def type(self, node: tuple) -> str:
        return self.types[self.number(node)]


def derived_variant(kind: str, tree: tuple, captures: tuple, tensors: tuple = ()) -> Variant:
    """A Variant of a tree jitattn built itself from a valid one (a derivative): typed like any
    other, but not held to MAX_DEPTH / MAX_NODES, which bound trees that come from outside (its
    expanded form may be larger than its DAG)."""
    shared = Shared(tree, captures)
    wanted = "float" if kind == "score_mod" else "bool"
    if shared.type(tree) != wanted:
        raise VariantError(f"a {kind} must give a {wanted}, this tree gives a {shared.type(tree)}")
    v = object.__new__(Variant)
    for name, value in (("kind", kind), ("tree", tree), ("captures", captures), ("tensors", tuple(tensors))):
        object.__setattr__(v, name, value)
    return v


_INFIX = {"add": "+", "sub": "-", "mul": "*", "div": "/", "floordiv": "//", "mod": "%", "lt": "<", "le": "<=",
          "gt": ">", "ge": ">=", "eq": "==", "ne": "!=", "and": "&", "or": "|"}


def expression(tree: tuple, limit: int = 400) -> str:
    """A readable one-line form of a tree for logs and errors (``score + float(q_idx - kv_idx)``;
    a capture read is ``c0[h, q_idx]``), cut at ``limit`` characters."""
    out: list[str] = []
    size = [0]

    def emit(text):
        out.append(text)
        size[0] += len(text)

    def show(node, parent_infix=False):
        if size[0] > limit:
            return
        op = node[0]
        if op == "arg":
            emit(node[1])
        elif op == "const":
            emit(repr(node[1]) if not isinstance(node[1], str) else ("-inf" if node[1] == "-inf" else "inf"))
        elif op == "load":
            emit(f"c{node[1]}")
            if len(node) > 2:
                emit("[")
                for i, index in enumerate(node[2:]):
                    emit(", " if i else "")
                    show(index)
                emit("]")
        elif op in _INFIX:
            emit("(" if parent_infix else "")
            show(node[1], True)
            emit(f" {_INFIX[op]} ")
            show(node[2], True)
            emit(")" if parent_infix else "")
        elif op in ("neg", "not"):
            emit("-" if op == "neg" else "~")
            show(node[1], True)
        else:
            emit(f"{op}(")
            for i, child in enumerate(node[1:]):
                emit(", " if i else "")
                show(child)
            emit(")")

    show(tree)
    text = "".join(out)
    return text if len(text) <= limit else text[:limit - 3] + "..."
