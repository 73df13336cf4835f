"""C++ for the kernels' hooks from a validated Variant: ScoreMod (score, dscore) and MaskMod
(visible, classify), with the members of templates/varlen/score.cuh's and mask.cuh's built-ins.

The output is straight SSA (``const float t3 = ...;``), each distinct node once, calling only
templates/varlen/variant.cuh's helpers and C++ operators. Nothing from the user reaches the text
but through this module's printing of validated nodes: op names map to fixed C++ through tables
here, constants are printed from their numeric value, argument names are ours.
"""
from __future__ import annotations

import functools
import math
import struct

from jitattn.variants.derivative import derivative
from jitattn.variants.tree import INT32_MIN, Shared, Variant, children, const_value, linear_positions

NS = "jitattn_variant::"
CTYPE = {"float": "float", "int": "int", "bool": "bool"}
IV_CTYPE = {"float": NS + "IFloat", "int": NS + "IInt", "bool": NS + "IBool"}
FLOAT_FUNCTIONS = {"exp": "vexp", "exp2": "vexp2", "log": "vlog", "tanh": "vtanh", "sigmoid": "vsigmoid",
                   "sqrt": "vsqrt", "abs": "fabsf"}
INT_FUNCTIONS = {"add": "iadd", "sub": "isub", "mul": "imul", "neg": "ineg", "abs": "iabs", "min": "imin",
                 "max": "imax", "floordiv": "floordiv", "mod": "mod"}
FLOAT_OPERATORS = {"add": "+", "sub": "-", "mul": "*"}
COMPARE = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
BOOL_INFIX = {**COMPARE, "and": "&&", "or": "||"}  # bool-valued infix operators


def float_literal(value: float) -> str:
    """An fp32 C++ literal of exactly the float nearest ``value`` (%.9g round-trips fp32)."""
    try:
        f32 = struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        f32 = math.copysign(math.inf, value)
    if math.isinf(f32):
        return "INFINITY" if f32 > 0 else "(-INFINITY)"
    text = "%.9g" % f32
    if not any(c in text for c in ".e"):
        text += ".0"
    text += "f"
    return f"({text})" if text.startswith("-") else text


def int_literal(value: int) -> str:
    if value == INT32_MIN:
        return "(-2147483647 - 1)"
    return f"({value})" if value < 0 else str(value)


def literal(value) -> str:
    if type(value) is bool:
        return "true" if value else "false"
    if type(value) is int:
        return int_literal(value)
    return float_literal(float(value))


class _Emitter:
    """Emits SSA lines for nodes of one variant, each distinct node once. ``defs`` maps a node
    key to (type, expression) for values defined on first use (arguments, reused forward values)."""

    def __init__(self, shared: Shared, prefix: str, indent: str = "    "):
        self.shared, self.captures, self.prefix, self.indent = shared, shared.captures, prefix, indent
        self.lines: list[str] = []
        self.names: dict[int, str] = {}
        self.defs: dict[int, tuple] = {}

    def key(self, node: tuple) -> int:
        return self.shared.number(node)

    def type(self, node: tuple) -> str:
        return self.shared.type(node)

    def define(self, ctype: str, expression: str) -> str:
        name = f"{self.prefix}{len(self.lines)}"
        self.lines.append(f"{self.indent}const {ctype} {name} = {expression};")
        return name

    def value(self, node: tuple) -> str:
        """The C++ name (or literal) of node's value, defining it on first use."""
        key = self.key(node)
        if key not in self.names:
            if key in self.defs:
                self.names[key] = self.define(*self.defs[key])
            else:
                inline = self._inline(node)
                if inline is not None:
                    return inline
                self.names[key] = self.define(*self._definition(node))
        return self.names[key]

    def _inline(self, node: tuple) -> str | None:
        """What a leaf is written as in place, or None (it gets a definition)."""
        if node[0] == "arg":
            return node[1]  # b, h, q_idx, kv_idx: the hook's own parameters
        if node[0] == "const":
            return literal(const_value(node[1]))
        return None

    def _definition(self, node: tuple) -> tuple[str, str]:
        kind = self.type(node)
        return CTYPE[kind], self._expression(node, kind)

    def _expression(self, node: tuple, kind: str) -> str:
        op = node[0]
        if op == "load":
            dtype = self.captures[node[1]][0]
            indices = "".join(", " + self.value(i) for i in node[2:])
            return f"{NS}load_{dtype}(caps[{node[1]}]{indices})"
        if op == "float" and (positions := _float_positions(node[1])) is not None:
            return positions
        args = [self.value(c) for c in children(node)]
        operand = self.type(node[1])
        if op == "div":
            divisor = node[2]
            if divisor[0] == "const":  # a constant divisor: multiply by its reciprocal (within an ulp)
                c = const_value(divisor[1])
                reciprocal = 0.0 if math.isinf(c) else math.copysign(math.inf, c) if c == 0 else 1.0 / c
                return f"{args[0]} * {float_literal(reciprocal)}"
            return f"{args[0]} / {args[1]}"
        if op in BOOL_INFIX:  # comparisons (of ints or floats) and logic
            return f"{args[0]} {BOOL_INFIX[op]} {args[1]}"
        if op == "where":
            return f"{args[0]} ? {args[1]} : {args[2]}"
        if op == "not":
            return f"!{args[0]}"
        if op == "float":
            return f"float({args[0]})"
        if operand == "int":
            return f"{NS}{INT_FUNCTIONS[op]}({', '.join(args)})"
        if op in FLOAT_OPERATORS:
            return f"{args[0]} {FLOAT_OPERATORS[op]} {args[1]}"
        if op == "neg":
            return f"-{args[0]}"
        if op in ("min", "max"):
            return f"{NS}f{'minimum' if op == 'min' else 'maximum'}({args[0]}, {args[1]})"
        function = FLOAT_FUNCTIONS[op]
        return f"{function}({args[0]})" if function == "fabsf" else f"{NS}{function}({args[0]})"


# Positions are below 2^22 (the varlen calls check max_seqlen_q / k, FLOAT_POSITIONS_LIMIT), so
# float(q_idx), float(kv_idx) and their difference plus a constant below 2^22 are exact in fp32.
FLOAT_POSITIONS_LIMIT = 1 << 22


def _float_positions(node: tuple) -> str | None:
    """float(node) as fp32 arithmetic on float(q_idx) and float(kv_idx), exact and without an int
    to float conversion per element (the kernels' tile loops are issue-bound: float(q_idx) is one
    per row, float(kv_idx) one per column, shared by the rows), where node is q_idx, kv_idx or
    their difference plus a small constant; else None."""
    affine = linear_positions(node, FLOAT_POSITIONS_LIMIT - 1)
    if affine is None:
        return None
    q, kv, c = affine
    if q not in (-1, 0, 1) or kv not in (-1, 0, 1) or (q, kv) == (0, 0):
        return None
    (first, a), (second, b) = sorted(((q, "float(q_idx)"), (kv, "float(kv_idx)")), reverse=True)
    text = a if first > 0 else f"-{a}"
    if second:
        text += f" {'+' if second > 0 else '-'} {b}"
    return f"({text} + {float_literal(float(c))})" if c else f"({text})"


@functools.lru_cache(maxsize=256)
def _has_float_positions(tree: tuple, captures: tuple) -> bool:
    return any(node[0] == "float" and _float_positions(node[1]) is not None for node in Shared(tree, captures).nodes)


def float_positions(v: Variant) -> bool:
    """Whether v's rendering computes positions in fp32 (_float_positions): its calls must keep
    max_seqlen_q / max_seqlen_k below FLOAT_POSITIONS_LIMIT."""
    return _has_float_positions(v.tree, v.captures)


class _IntervalEmitter(_Emitter):
    """Emits classify's abstract values: variant.cuh's iv_* calls over the same nodes. ranges:
    classify_warp's, whose int and bool reads over an index range take the range's elements
    (iv_read, by the whole warp)."""

    def __init__(self, shared: Shared, prefix: str, ranges: bool = False):
        super().__init__(shared, prefix)
        self.ranges = ranges

    def _inline(self, node: tuple) -> None:
        return None  # every value, leaves too, is an interval of its own

    def _definition(self, node: tuple) -> tuple[str, str]:
        kind = self.type(node)
        return IV_CTYPE[kind], self._abstract(node, kind)

    def _abstract(self, node: tuple, kind: str) -> str:
        op = node[0]
        if kind == "float":
            return NS + "IFloat{}"
        if op == "const":
            c = const_value(node[1])
            return f"{NS}iv_bool({literal(c)})" if kind == "bool" else f"{NS}iv_exact({int_literal(c)})"
        if op == "load":
            indices = [self.value(i) for i in node[2:]]
            load = f"{NS}load_{self.captures[node[1]][0]}"
            if self.ranges:
                lanes = f"[&](int i0, int i1, int i2, int i3) {{ return {load}(caps[{node[1]}], i0, i1, i2, i3); }}"
                read = f"{NS}iv_read({lanes}{''.join(f', {i}' for i in indices)})"
                return read if kind == "int" else f"{NS}iv_bool_of({read})"
            exact = " && ".join(f"{NS}iv_is_exact({i})" for i in indices) or "true"
            read = f"{load}(caps[{node[1]}]{''.join(f', int({i}.lo)' for i in indices)})"
            if kind == "int":
                return f"({exact}) ? {NS}iv_exact({read}) : {NS}iv_full()"
            return f"({exact}) ? {NS}iv_bool({read}) : {NS}iv_unknown()"
        operand = self.type(node[1])
        if op in COMPARE and operand == "float":  # floats are not tracked (their operands are not emitted)
            return NS + "iv_unknown()"
        args = [self.value(c) for c in children(node)]
        if op in ("eq", "ne") and operand == "bool":
            op = "beq" if op == "eq" else "bne"
        elif op == "where" and kind == "bool":
            op = "bwhere"
        return f"{NS}iv_{op}({', '.join(args)})"


def _body(emitter: _Emitter) -> str:
    return "\n".join(emitter.lines) + ("\n" if emitter.lines else "")


def _forward_chain(tree: tuple, root_name: str):
    """(node, expression) of nodes recoverable from the forward's value by undoing products with
    constants from the root down (root = c * tanh(...) gives tanh(...) = root / c). Sums are not
    undone: root - c loses the small part of root to cancellation."""
    chain, node, name = [], tree, root_name
    while True:
        op = node[0]
        if op == "neg":
            node, expression = node[1], f"-{name}"
        elif op == "mul" and [c[0] for c in node[1:]].count("const") == 1:
            i = 1 if node[1][0] == "const" else 2
            c = float(const_value(node[i][1]))
            if c == 0 or not math.isfinite(c):
                return chain
            node, expression = node[3 - i], f"{name} * {float_literal(1.0 / c)}"
        elif op == "div" and node[2][0] == "const" and node[1][0] != "const":
            c = float(const_value(node[2][1]))
            if c == 0 or not math.isfinite(c):
                return chain
            node, expression = node[1], f"{name} * {float_literal(c)}"
        else:
            return chain
        chain.append((node, expression))
        name = f"({expression})"


SCORE_ARGS = "int b, int h, int q_idx, int kv_idx"


def _additive_bias(v: Variant):
    """(sign, g) where the score_mod is score + g or score - g with g free of the score (a bias:
    relative position, ALiBi, a table), else None."""
    tree, score = v.tree, ("arg", "score")
    if tree[0] not in ("add", "sub") or score not in tree[1:]:
        return None
    term, sign = (tree[2], 1 if tree[0] == "add" else -1) if tree[1] == score else (tree[1], 1)
    if tree[0] == "sub" and tree[2] == score:
        return None  # g - score
    return None if score in Shared(term, v.captures).nodes else (sign, term)


_KV = ("arg", "kv_idx")
_ONE, _ZERO = ("const", 1.0), ("const", 0.0)


def _kv_slope(node: tuple, captures: tuple) -> tuple | None:
    """A float node A free of kv_idx with node = A * kv_idx + (a part free of kv_idx), read off
    the tree (A = _ZERO when node is free of kv_idx); None when node is not affine in kv_idx. kv_idx
    enters only through float(i * q_idx + j * kv_idx + c) (_float_positions' exact form)."""
    if _KV not in Shared(node, captures).nodes:
        return _ZERO
    op = node[0]
    if op == "float":
        affine = linear_positions(node[1], FLOAT_POSITIONS_LIMIT - 1)
        return None if affine is None else ("const", float(affine[1]))
    if op == "neg":
        inner = _kv_slope(node[1], captures)
        return None if inner is None else _negate(inner)
    if op in ("add", "sub"):
        a, b = _kv_slope(node[1], captures), _kv_slope(node[2], captures)
        if a is None or b is None:
            return None
        if b == _ZERO:
            return a
        b = b if op == "add" else _negate(b)
        return b if a == _ZERO else ("add", a, b)
    if op == "mul":
        x, y = node[1], node[2]
        if _KV in Shared(x, captures).nodes and _KV in Shared(y, captures).nodes:
            return None  # kv_idx * kv_idx
        varying, factor = (x, y) if _KV in Shared(x, captures).nodes else (y, x)
        inner = _kv_slope(varying, captures)
        if inner is None:
            return None
        return _times(inner, factor)
    if op == "div" and _KV not in Shared(node[2], captures).nodes:
        inner = _kv_slope(node[1], captures)
        return None if inner is None else inner if inner == _ZERO else ("div", inner, node[2])
    return None


def _negate(node: tuple) -> tuple:
    if node[0] == "const":
        return ("const", -float(const_value(node[1])))
    return node[1] if node[0] == "neg" else ("neg", node)


def _times(a: tuple, b: tuple) -> tuple:
    for x, y in ((a, b), (b, a)):
        if x == _ZERO:
            return _ZERO
        if x == _ONE:
            return y
        if x == ("const", -1.0):
            return _negate(y)
    return ("mul", a, b)


def kv_affine(v: Variant) -> tuple | None:
    """(sign, A) when score_mod v is score +- g with g = A * kv_idx + (a part free of kv_idx),
    A free of kv_idx and not 0 (ALiBi, relative position): the forward then adds
    sign * A * (kv_idx - origin) per logit and leaves the rest, the same for every key of a query
    row, out of the softmax (the epilogue adds it to lse: templates/varlen/fwd_softmax.cuh).
    Else None."""
    bias = _additive_bias(v)
    if bias is None:
        return None
    slope = _kv_slope(bias[1], v.captures)
    return None if slope is None or slope == _ZERO else (bias[0], slope)


def pair_reads(v: Variant) -> bool:
    """Whether ``v`` reads a captured tensor at an index of both q_idx and kv_idx (a relative
    position table, bias[h, q_idx - kv_idx + C]): per logit, unless the kernel lets the compiler
    see that equal q_idx - kv_idx are one read (score.cuh's PAIR_READS)."""
    shared = Shared(v.tree, v.captures)
    for node in shared.nodes:
        if node[0] == "load":
            inside = Shared(node, v.captures).nodes
            if ("arg", "q_idx") in inside and _KV in inside:
                return True
    return False


def render_score_mod(v: Variant, qualifiers: str = "__device__ __forceinline__") -> str:
    """The ScoreMod struct for score_mod ``v``: score(s, ...) = f(scale * s) / scale and
    dscore(s, sc, ...) = f'(scale * s), sharing what it can with sc (score()'s value)."""
    if not isinstance(v, Variant) or v.kind != "score_mod":
        raise TypeError("render_score_mod takes a score_mod Variant")
    score = _Emitter(Shared(v.tree, v.captures), "t")
    score.defs[score.key(("arg", "score"))] = ("float", "s * scale")
    bias = _additive_bias(v)
    if bias is not None:  # f(x) = x +- g: score() = s +- g / scale, one FMA on the raw logit
        sign, term = bias
        result = f"fmaf({score.value(term)}, {'' if sign > 0 else '-'}inv_scale, s)"
    else:
        result = f"{score.value(v.tree)} * inv_scale"
    affine = kv_affine(v)
    kv_slope = _Emitter(Shared(affine[1] if affine else _ZERO, v.captures), "a")
    kv_slope_value = (f"{kv_slope.value(affine[1])} * {'' if affine[0] > 0 else '-'}inv_scale" if affine
                      else "0.f")
    slope = derivative(v).tree
    dscore = _Emitter(Shared(slope, v.captures), "d")
    dscore.defs[dscore.key(("arg", "score"))] = ("float", "s * scale")
    dscore.defs[dscore.key(v.tree)] = ("float", "sc * scale")
    for node, expression in _forward_chain(v.tree, "sc * scale"):
        dscore.defs.setdefault(dscore.key(node), ("float", expression))
    slope_value = dscore.value(slope)
    caps = "caps(p.captures), " if v.captures else "caps(nullptr), "
    return (
        "// The user's score_mod, rendered by jitattn/variants/render.py from the tree\n"
        f"// {v.digest}: score() returns f(scale * s) / scale, dscore() f'(scale * s).\n"
        "struct ScoreMod {\n"
        "  static constexpr bool ACTIVE = true;\n"
        f"  static constexpr bool KV_AFFINE = {literal(affine is not None)};\n"
        f"  static constexpr bool PAIR_READS = {literal(pair_reads(v))};\n"
        f"  static constexpr bool UNIT_SLOPE = {literal(slope == ('const', 1.0))};\n"
        "  const jitattn_variant::Capture* caps;\n"
        "  float scale, inv_scale;\n"
        "  template <class Params>\n"
        f"  {qualifiers} explicit ScoreMod(const Params& p)\n"
        f"      : {caps}scale(p.scale), inv_scale(1.f / p.scale) {{}}\n"
        f"  {qualifiers} float score(float s, {SCORE_ARGS}) const {{\n"
        f"{_body(score)}    return {result};\n"
        "  }\n"
        f"  {qualifiers} float dscore(float s, float sc, {SCORE_ARGS}) const {{\n"
        f"{_body(dscore)}    return {slope_value};\n"
        "  }\n"
        f"  {qualifiers} float kv_slope(int b, int h, int q_idx) const {{\n"
        f"{_body(kv_slope)}    return {kv_slope_value};\n"
        "  }\n"
        "};\n")


def mask_map_needs(v: Variant) -> tuple[bool, bool]:
    """Whether mask_mod ``v`` needs a mask map (templates/varlen/mask_map.cuh): it reads a captured
    tensor, whose values interval analysis cannot see; and whether the map has a slot per KV head
    (the mask reads ``h``) or one shared by all."""
    nodes = Shared(v.tree, v.captures).nodes
    return (any(node[0] == "load" for node in nodes), any(node == ("arg", "h") for node in nodes))


def sequence_reads(shared: Shared) -> list[tuple]:
    """The capture reads classify() makes whose indices are functions of ``b`` and constants alone
    (a sequence's flag or offset: the padding mask's whole[b], first[b // 3]); a CTA can load them
    before it knows anything but its sequence (MaskMod::preload). Float reads are left out:
    interval analysis does not track floats."""
    by_sequence: dict[int, bool] = {}
    reads = []
    for node in shared.nodes:  # children first
        of_b = all(by_sequence[shared.number(child)] for child in children(node))
        if node[0] == "load":
            if of_b and shared.type(node) != "float":
                reads.append(node)
            of_b = False  # an index read from a capture would need the read itself
        elif node[0] == "arg":
            of_b = node[1] == "b"
        by_sequence[shared.number(node)] = of_b
    return reads


def _preload(shared: Shared, qualifiers: str) -> tuple[str, list[tuple]]:
    """The Preloaded struct and preload(b): each sequence read as a volatile load, which goes out
    where it is written (variant.cuh's load_*<true>), and the reads, in the struct's order."""
    reads = sequence_reads(shared)
    emitter = _Emitter(shared, "e")
    fields = []
    for n, node in enumerate(reads):
        indices = "".join(", " + emitter.value(i) for i in node[2:])
        fields.append((CTYPE[shared.type(node)], f"r{n}",
                       f"{NS}load_{shared.captures[node[1]][0]}<true>(caps[{node[1]}]{indices})"))
    struct = "  struct Preloaded {" + "".join(f" {ctype} {name};" for ctype, name, _ in fields) + " };\n"
    loads = "".join(f"{emitter.indent}const {ctype} {name} = {read};\n" for ctype, name, read in fields)
    return (struct + f"  {qualifiers} Preloaded preload(int b) const {{\n" + _body(emitter) + loads
            + "    return {" + ", ".join(name for _, name, _ in fields) + "};\n  }\n"), reads


def render_mask_mod(v: Variant, qualifiers: str = "__device__ __forceinline__") -> str:
    """The MaskMod struct for mask_mod ``v``: visible() per element, classify() per tile by the
    interval analysis of interval.py (sound: EMPTY and FULL only where certain)."""
    if not isinstance(v, Variant) or v.kind != "mask_mod":
        raise TypeError("render_mask_mod takes a mask_mod Variant")
    visible = _Emitter(Shared(v.tree, v.captures), "t")
    result = visible.value(v.tree)

    def interval_walk(ranges: bool, preloaded: dict | None = None) -> tuple[_IntervalEmitter, str]:
        tile = _IntervalEmitter(Shared(v.tree, v.captures), "v", ranges)
        for node, n in (preloaded or {}).items():  # classify(pre, ...): the sequence's reads from preload(b)
            kind = tile.type(node)
            tile.defs[tile.key(node)] = (IV_CTYPE[kind], f"{NS}iv_bool(pre.r{n})" if kind == "bool"
                                         else f"{NS}iv_exact(pre.r{n})")
        tile.defs.update({
            tile.key(("arg", "b")): (IV_CTYPE["int"], f"{NS}iv_exact(b)"),
            tile.key(("arg", "h")): (IV_CTYPE["int"], f"{NS}IInt{{(long long)kv_head * pack, "
                                                      f"(long long)kv_head * pack + pack - 1}}"),
            tile.key(("arg", "q_idx")): (IV_CTYPE["int"], f"{NS}IInt{{q_lo, q_hi}}"),
            tile.key(("arg", "kv_idx")): (IV_CTYPE["int"], f"{NS}IInt{{kv_lo, kv_hi}}"),
        })
        return tile, tile.value(v.tree)

    preload, preloaded = _preload(Shared(v.tree, v.captures), qualifiers)
    tile, verdict = interval_walk(False)
    if preloaded:
        tile_pre, verdict_pre = interval_walk(False, {node: n for n, node in enumerate(preloaded)})
        classify_pre = (f"{_body(tile_pre)}    return !{verdict_pre}.may_true ? TILE_EMPTY : "
                        f"!{verdict_pre}.may_false ? TILE_FULL : TILE_PARTIAL;\n")
    else:  # nothing to preload: the same verdict as classify's, not a second copy of its body
        classify_pre = "    return classify(b, kv_head, q_lo, q_hi, kv_lo, kv_hi);\n"
    caps = "caps(p.captures), " if v.captures else "caps(nullptr), "
    reads, by_head = mask_map_needs(v)
    # classify_warp: only a mask that reads captures has a map (mask_map.cuh) to call it
    warp_tile, warp_verdict = interval_walk(True) if reads else (tile, verdict)
    tile_args = "int b, int kv_head, int q_lo, int q_hi, int kv_lo, int kv_hi"
    return (
        "// The user's mask_mod, rendered by jitattn/variants/render.py from the tree\n"
        f"// {v.digest}: visible() per element, classify() per tile (interval analysis, sound; classify(pre, ...)\n"
        "// takes sequence b's own reads from preload(b); classify_warp() reads captures over index ranges: the map's).\n"
        "struct MaskMod {\n"
        "  static constexpr bool ACTIVE = true;\n"
        f"  static constexpr bool DATA_DEPENDENT = {literal(reads)};\n"
        f"  static constexpr bool USES_HEAD = {literal(by_head)};\n"
        "  const jitattn_variant::Capture* caps;\n"
        "  int pack;\n"
        "  template <class Params>\n"
        f"  {qualifiers} explicit MaskMod(const Params& p) : {caps}pack(p.pack) {{}}\n"
        f"  {qualifiers} bool visible({SCORE_ARGS}) const {{\n"
        f"{_body(visible)}    return {result};\n"
        "  }\n"
        f"  {qualifiers} TileClass classify({tile_args}) const {{\n"
        f"{_body(tile)}    return !{verdict}.may_true ? TILE_EMPTY : !{verdict}.may_false ? TILE_FULL : TILE_PARTIAL;\n"
        "  }\n"
        f"{preload}"
        f"  {qualifiers} TileClass classify(const Preloaded& pre, {tile_args}) const {{\n"
        f"{classify_pre}"
        "  }\n"
        f"  {qualifiers} TileClass classify_warp({tile_args}) const {{\n"
        f"{_body(warp_tile)}    return !{warp_verdict}.may_true ? TILE_EMPTY : !{warp_verdict}.may_false ? TILE_FULL : "
        "TILE_PARTIAL;\n"
        "  }\n"
        "};\n")
