"""Tracing a user's score_mod / mask_mod into a Variant: call it once with symbolic proxies.

A proxy (``Sym``) records every operation done to it as a tree node (tree.py). Python operators
reach it through its dunder methods; torch functions (``torch.where``, ``torch.exp``, indexing a
captured tensor, ``tensor * proxy``) through ``__torch_function__``: torch calls it for any
function whose arguments hold an object that defines it, including ``Tensor.__getitem__`` with
proxies inside the index tuple (``bias[h, q_idx - kv_idx + 5]``). ``__index__`` could not do
that job: it must return a real int, so the index would be fixed at trace time.

Tensors the function reaches become capture slots (by identity, in order of first use); Python
numbers become constants. Anything outside the whitelist raises VariantError naming it, and
Python control flow on a proxy (``if``, ``and``, ``min()``) is refused, never guessed.
"""
from __future__ import annotations

import functools
import numbers
import threading
import types
import weakref

import torch

from jitattn.variants.tree import (ARGS, CAPTURE_DTYPES, INT32_MAX, INT32_MIN, MAX_CAPTURE_NDIM, MAX_CAPTURES,
                                   Shared, Variant, VariantError)

SUPPORTED = ("+, -, *, / (true division), // and % (ints), ** by an int 0..8, comparisons, & | ~ on bools, "
             "unary -, abs(), torch.where, torch.exp, torch.exp2, torch.log, torch.tanh, torch.sigmoid, "
             "torch.sqrt, torch.abs, torch.minimum, torch.maximum, torch.clamp, torch.logical_and/or/not, "
             "Tensor.float(), and reading a captured tensor at int indices (bias[h, q_idx - kv_idx])")
MAX_POWER = 8


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


class _Tracer:
    """The state of one trace: the kind (for messages) and the capture table."""

    def __init__(self, kind: str):
        self.kind = kind
        self.slots: dict[int, int] = {}
        self.tensors: list[torch.Tensor] = []
        self.table: list[tuple] = []
        self.shared = Shared(None, self.table)  # the types of the nodes made so far

    def refuse(self, what: str) -> VariantError:
        return VariantError(f"{self.kind} uses {what}, which jitattn variants do not support; supported: {SUPPORTED}")

    def capture(self, tensor: torch.Tensor) -> int:
        slot = self.slots.get(id(tensor))
        if slot is not None:
            return slot
        dtype = _dtype_name(tensor)
        if dtype not in CAPTURE_DTYPES:
            raise VariantError(f"{self.kind} captures a {dtype} tensor; captured tensors must be one of "
                               f"{', '.join(CAPTURE_DTYPES)} (convert it before defining the function)")
        if tensor.dim() > MAX_CAPTURE_NDIM:
            raise VariantError(f"{self.kind} captures a {tensor.dim()}-d tensor; at most {MAX_CAPTURE_NDIM} dims")
        if len(self.tensors) == MAX_CAPTURES:
            raise VariantError(f"{self.kind} captures more than {MAX_CAPTURES} tensors")
        self.slots[id(tensor)] = len(self.tensors)
        self.tensors.append(tensor)
        self.table.append((dtype, tensor.dim()))
        return self.slots[id(tensor)]

    def captures(self) -> tuple:
        return tuple(self.table)

    def sym(self, node: tuple) -> "Sym":
        return Sym(self, node, self.shared.type(node))

    def lift(self, value) -> "Sym":
        """A proxy for an operand: a proxy, a Python number, or a 0-d captured tensor."""
        if isinstance(value, Sym):
            return value
        if isinstance(value, (bool, numbers.Number)) and not isinstance(value, torch.Tensor):
            return self.sym(("const", _constant(self, value)))
        if not isinstance(value, torch.Tensor) and getattr(value, "shape", None) == () and hasattr(value, "item"):
            return self.lift(value.item())  # a numpy scalar
        if isinstance(value, torch.Tensor):
            if value.dim() != 0:
                raise VariantError(f"{self.kind} uses a captured tensor of shape {tuple(value.shape)} as a value; "
                                   "index it (bias[h, q_idx]) to read one element: only 0-d tensors act as scalars")
            return self.sym(("load", self.capture(value)))
        if isinstance(value, _Indexed):
            raise VariantError(f"{self.kind} uses a partly indexed captured tensor as a value: it has "
                               f"{value.ndim} dims, index all of them")
        raise self.refuse(f"a value of type {type(value).__name__}")


def _constant(tracer: _Tracer, value):
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral):
        value = int(value)
        if not INT32_MIN <= value <= INT32_MAX:
            raise VariantError(f"{tracer.kind} uses the integer {value}, outside the int32 range")
        return value
    if isinstance(value, numbers.Real):
        value = float(value)
        if value != value:
            raise VariantError(f"{tracer.kind} uses a NaN constant")
        if value in (float("inf"), float("-inf")):
            return "inf" if value > 0 else "-inf"
        return value
    raise tracer.refuse(f"the constant {value!r:.40} of type {type(value).__name__}")


def _as_float(x: "Sym") -> "Sym":
    if x.type == "float":
        return x
    if x.node[0] == "const" and x.type == "int":
        return x.tracer.sym(("const", float(x.node[1])))
    return x.tracer.sym(("float", x.node))


def _numeric(tracer: _Tracer, what: str, *operands: "Sym") -> tuple:
    """The operands promoted as torch does (int with float gives float); bools are refused."""
    if any(x.type == "bool" for x in operands):
        raise VariantError(f"{tracer.kind} uses {what} on a bool (a comparison's result); "
                           "use torch.where(cond, x, y) to turn a condition into a number")
    if any(x.type == "float" for x in operands):
        return tuple(_as_float(x) for x in operands)
    return operands


def _binary(op: str, what: str, a, b) -> "Sym":
    tracer = _tracer_of(a, b)
    a, b = _numeric(tracer, what, tracer.lift(a), tracer.lift(b))
    if op == "div":
        a, b = _as_float(a), _as_float(b)
    elif op in ("floordiv", "mod") and a.type != "int":
        raise VariantError(f"{tracer.kind} uses {what} on floats; // and % apply to integer indices only")
    return tracer.sym((op, a.node, b.node))


def _compare(op: str, a, b) -> "Sym":
    tracer = _tracer_of(a, b)
    a, b = tracer.lift(a), tracer.lift(b)
    if a.type == "bool" and b.type == "bool" and op in ("eq", "ne"):
        return tracer.sym((op, a.node, b.node))
    a, b = _numeric(tracer, f"the comparison {op}", a, b)
    return tracer.sym((op, a.node, b.node))


def _logical(op: str, *operands) -> "Sym":
    tracer = _tracer_of(*operands)
    syms = [tracer.lift(x) for x in operands]
    if any(x.type != "bool" for x in syms):
        raise VariantError(f"{tracer.kind} uses logical {op} (&, |, ~) on a non-bool; "
                           "bitwise operations on ints are not supported")
    return tracer.sym((op, *(x.node for x in syms)))


def _unary(op: str, x) -> "Sym":
    tracer = _tracer_of(x)
    (x,) = _numeric(tracer, op, tracer.lift(x))
    if op not in ("neg", "abs"):
        x = _as_float(x)
    return tracer.sym((op, x.node))


def _where(condition, input, other) -> "Sym":  # torch.where's own parameter names
    tracer = _tracer_of(condition, input, other)
    cond, a, b = tracer.lift(condition), tracer.lift(input), tracer.lift(other)
    if cond.type != "bool":
        raise VariantError(f"{tracer.kind} uses torch.where with a non-bool condition")
    if a.type != b.type:
        a, b = _numeric(tracer, "torch.where", a, b)
    return tracer.sym(("where", cond.node, a.node, b.node))


def _min_max(op: str, a, b) -> "Sym":
    tracer = _tracer_of(a, b)
    a, b = _numeric(tracer, f"torch.{'minimum' if op == 'min' else 'maximum'}", tracer.lift(a), tracer.lift(b))
    return tracer.sym((op, a.node, b.node))


def _clamp(x, min=None, max=None) -> "Sym":
    if min is not None:
        x = _min_max("max", x, min)
    if max is not None:
        x = _min_max("min", x, max)
    return _tracer_of(x).lift(x)


def _power(x, exponent) -> "Sym":
    tracer = _tracer_of(x)
    x = tracer.lift(x)
    if isinstance(exponent, float) and exponent.is_integer():
        exponent = int(exponent)
    if isinstance(exponent, bool) or not isinstance(exponent, int) or not 0 <= exponent <= MAX_POWER:
        raise VariantError(f"{tracer.kind} uses ** with the exponent {exponent!r:.40}; only a Python int in "
                           f"[0, {MAX_POWER}] is supported (it becomes multiplications)")
    (x,) = _numeric(tracer, "**", x)
    if exponent == 0:
        return tracer.lift(1.0 if x.type == "float" else 1)
    result = x
    for _ in range(exponent - 1):
        result = tracer.sym(("mul", result.node, x.node))
    return result


def _getitem(tensor, index) -> "Sym | _Indexed":
    tracer = _tracer_of(tensor, index)
    if isinstance(tensor, torch.Tensor):
        tensor = _Indexed(tracer, tracer.capture(tensor), tensor.dim(), ())
    if not isinstance(tensor, _Indexed):
        raise tracer.refuse(f"indexing a {type(tensor).__name__}")
    return tensor[index]


def _to_float(x, *args, **kwargs) -> "Sym":
    tracer = _tracer_of(x)
    dtype = kwargs.get("dtype", args[0] if args else torch.float32)
    if dtype is not torch.float32 or len(args) > 1 or set(kwargs) - {"dtype"}:
        raise tracer.refuse("Tensor.to with anything but torch.float32")
    x = tracer.lift(x)
    return x if x.type == "float" else tracer.sym(("float", x.node))


def _new_scalar(value):
    def make(x, size=(), dtype=None, **_):
        tracer = _tracer_of(x)
        if tuple(size) != ():
            raise tracer.refuse("new_ones/new_zeros with a non-empty size")
        if dtype is torch.bool:
            return tracer.lift(bool(value))
        return tracer.lift(float(value) if dtype in (None, torch.float32) else int(value))
    return make


_T = torch.Tensor
# torch functions -> handlers; each handler takes the function's arguments (tensors included).
_TORCH_FUNCTIONS = {}
for _functions, _handler in [
    ((torch.add, _T.add, _T.__add__), lambda a, b: _binary("add", "+", a, b)),
    ((_T.__radd__,), lambda a, b: _binary("add", "+", b, a)),
    ((torch.sub, torch.subtract, _T.sub, _T.__sub__), lambda a, b: _binary("sub", "-", a, b)),
    ((_T.__rsub__, torch.rsub), lambda a, b: _binary("sub", "-", b, a)),
    ((torch.mul, torch.multiply, _T.mul, _T.__mul__), lambda a, b: _binary("mul", "*", a, b)),
    ((_T.__rmul__,), lambda a, b: _binary("mul", "*", b, a)),
    ((torch.div, torch.divide, torch.true_divide, _T.div, _T.__truediv__), lambda a, b: _binary("div", "/", a, b)),
    ((_T.__rtruediv__,), lambda a, b: _binary("div", "/", b, a)),
    ((torch.floor_divide, _T.__floordiv__), lambda a, b: _binary("floordiv", "//", a, b)),
    ((_T.__rfloordiv__,), lambda a, b: _binary("floordiv", "//", b, a)),
    ((torch.remainder, _T.__mod__), lambda a, b: _binary("mod", "%", a, b)),
    ((_T.__rmod__,), lambda a, b: _binary("mod", "%", b, a)),
    ((torch.pow, _T.__pow__), _power),
    ((torch.neg, torch.negative, _T.__neg__, _T.neg), lambda x: _unary("neg", x)),
    ((torch.abs, _T.__abs__, _T.abs), lambda x: _unary("abs", x)),
    ((torch.exp, _T.exp), lambda x: _unary("exp", x)),
    ((torch.exp2, torch.special.exp2, _T.exp2), lambda x: _unary("exp2", x)),
    ((torch.log, _T.log), lambda x: _unary("log", x)),
    ((torch.tanh, _T.tanh), lambda x: _unary("tanh", x)),
    ((torch.sigmoid, torch.special.expit, _T.sigmoid), lambda x: _unary("sigmoid", x)),
    ((torch.sqrt, _T.sqrt), lambda x: _unary("sqrt", x)),
    ((torch.where,), _where),
    ((torch.minimum, torch.fmin), lambda a, b: _min_max("min", a, b)),
    ((torch.maximum, torch.fmax), lambda a, b: _min_max("max", a, b)),
    ((torch.clamp, torch.clip, _T.clamp), _clamp),
    ((torch.lt, torch.less, _T.__lt__), lambda a, b: _compare("lt", a, b)),
    ((torch.le, torch.less_equal, _T.__le__), lambda a, b: _compare("le", a, b)),
    ((torch.gt, torch.greater, _T.__gt__), lambda a, b: _compare("gt", a, b)),
    ((torch.ge, torch.greater_equal, _T.__ge__), lambda a, b: _compare("ge", a, b)),
    ((torch.eq, _T.__eq__), lambda a, b: _compare("eq", a, b)),
    ((torch.ne, torch.not_equal, _T.__ne__), lambda a, b: _compare("ne", a, b)),
    ((torch.logical_and, _T.__and__, _T.__rand__), lambda a, b: _logical("and", a, b)),
    ((torch.logical_or, _T.__or__, _T.__ror__), lambda a, b: _logical("or", a, b)),
    ((torch.logical_not, _T.__invert__), lambda x: _logical("not", x)),
    ((_T.__getitem__,), _getitem),
    ((_T.float, _T.to), _to_float),
]:
    for _function in _functions:
        _TORCH_FUNCTIONS[_function] = _handler


def _function_name(func) -> str:
    """How a user wrote ``func``: torch.sin, Tensor.cos, torch.nn.functional.relu."""
    name = getattr(func, "__name__", None) or repr(func)
    qualname = getattr(func, "__qualname__", "") or ""
    if getattr(func, "__objclass__", None) is not None or qualname.startswith(("Tensor.", "TensorBase.")):
        return f"Tensor.{name}"
    module = getattr(func, "__module__", None) or "torch"
    if module.startswith("torch._C") or module in ("torch.functional", "torch._tensor"):
        module = "torch"
    return f"{module}.{name}"


def _tracer_of(*values) -> _Tracer:
    for value in values:
        if isinstance(value, (Sym, _Indexed)):
            return value.tracer
        if isinstance(value, (tuple, list)):
            for item in value:
                if isinstance(item, (Sym, _Indexed)):
                    return item.tracer
    raise AssertionError("no proxy among the operands")


class _Indexed:
    """A captured tensor with its leading dims indexed so far (bias[h] before bias[h][q_idx])."""

    def __init__(self, tracer: _Tracer, slot: int, ndim: int, indices: tuple):
        self.tracer, self.slot, self.ndim, self.indices = tracer, slot, ndim, indices

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        nodes = []
        for i in index:
            if isinstance(i, (slice, type(None), type(Ellipsis), list)) or \
                    (isinstance(i, torch.Tensor) and i.dim() != 0):
                raise self.tracer.refuse(f"indexing a captured tensor with {type(i).__name__}; index each dim "
                                         "by an int expression")
            if isinstance(i, (int, numbers.Integral)) and not isinstance(i, bool) and int(i) < 0:
                raise VariantError(f"{self.tracer.kind} indexes a captured tensor at {int(i)}: negative constant "
                                   "indices are not supported (out-of-range reads give 0, they do not wrap)")
            sym = self.tracer.lift(i)
            if sym.type != "int":
                raise VariantError(f"{self.tracer.kind} indexes a captured tensor by a {sym.type}; "
                                   "indices must be ints (b, h, q_idx, kv_idx and int arithmetic)")
            nodes.append(sym.node)
        indices = self.indices + tuple(nodes)
        if len(indices) > self.ndim:
            raise VariantError(f"{self.tracer.kind} indexes a {self.ndim}-d captured tensor with "
                               f"{len(indices)} indices")
        if len(indices) < self.ndim:
            return _Indexed(self.tracer, self.slot, self.ndim, indices)
        return self.tracer.sym(("load", self.slot, *indices))

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise VariantError(f"{self.tracer.kind} uses .{name} of a partly indexed captured tensor "
                           f"({len(self.indices)} of {self.ndim} dims): index all dims first")

    def __bool__(self):
        raise VariantError(f"{self.tracer.kind} uses a partly indexed captured tensor in Python control flow")


class Sym:
    """A symbolic scalar: the node it stands for, its type, and the trace it belongs to."""

    def __init__(self, tracer: _Tracer, node: tuple, type_: str):
        self.tracer, self.node, self.type = tracer, node, type_

    @classmethod
    def __torch_function__(cls, func, types_, args=(), kwargs=None):
        handler = _TORCH_FUNCTIONS.get(func)
        tracer = _tracer_of(*args, *(kwargs or {}).values())
        if handler is None:
            raise tracer.refuse(_function_name(func))
        try:
            return handler(*args, **(kwargs or {}))
        except TypeError as error:
            raise tracer.refuse(f"{_function_name(func)} with these arguments ({error})") from None

    def __repr__(self):
        return f"Sym({self.type}: {self.node})"

    __hash__ = object.__hash__

    def __bool__(self):
        raise VariantError(f"{self.tracer.kind} uses a traced value in Python control flow (if, and, or, not, "
                           "min(), max(), chained comparisons): the value is not known while tracing; use "
                           "torch.where(cond, a, b), &, |, ~, torch.minimum / torch.maximum instead")

    def __index__(self):
        raise VariantError(f"{self.tracer.kind} uses a traced value as a Python index (a list, a tuple or "
                           "range()); only captured torch tensors can be indexed by b, h, q_idx, kv_idx")

    def __int__(self):
        raise VariantError(f"{self.tracer.kind} converts a traced value with int(); the value is not known "
                           "while tracing")

    __float__ = __int__

    __array_ufunc__ = None  # numpy scalars defer to our reflected operators

    def __getattr__(self, name):
        if name.startswith("__"):  # protocol probes (numpy, copy, ...) get the usual answer
            raise AttributeError(name)
        raise self.tracer.refuse(f"Tensor.{name}")

    def __add__(self, o): return _binary("add", "+", self, o)
    def __radd__(self, o): return _binary("add", "+", o, self)
    def __sub__(self, o): return _binary("sub", "-", self, o)
    def __rsub__(self, o): return _binary("sub", "-", o, self)
    def __mul__(self, o): return _binary("mul", "*", self, o)
    def __rmul__(self, o): return _binary("mul", "*", o, self)
    def __truediv__(self, o): return _binary("div", "/", self, o)
    def __rtruediv__(self, o): return _binary("div", "/", o, self)
    def __floordiv__(self, o): return _binary("floordiv", "//", self, o)
    def __rfloordiv__(self, o): return _binary("floordiv", "//", o, self)
    def __mod__(self, o): return _binary("mod", "%", self, o)
    def __rmod__(self, o): return _binary("mod", "%", o, self)
    def __pow__(self, o): return _power(self, o)
    def __rpow__(self, o): raise self.tracer.refuse("a number raised to a traced power (use torch.exp2 / torch.exp)")
    def __neg__(self): return _unary("neg", self)
    def __pos__(self): return self
    def __abs__(self): return _unary("abs", self)
    def __lt__(self, o): return _compare("lt", self, o)
    def __le__(self, o): return _compare("le", self, o)
    def __gt__(self, o): return _compare("gt", self, o)
    def __ge__(self, o): return _compare("ge", self, o)
    def __eq__(self, o): return _compare("eq", self, o)
    def __ne__(self, o): return _compare("ne", self, o)
    def __and__(self, o): return _logical("and", self, o)
    def __rand__(self, o): return _logical("and", o, self)
    def __or__(self, o): return _logical("or", self, o)
    def __ror__(self, o): return _logical("or", o, self)
    def __invert__(self): return _logical("not", self)
    def __xor__(self, o): raise self.tracer.refuse("^ (xor)")
    __rxor__ = __xor__

    def exp(self): return _unary("exp", self)
    def exp2(self): return _unary("exp2", self)
    def log(self): return _unary("log", self)
    def tanh(self): return _unary("tanh", self)
    def sigmoid(self): return _unary("sigmoid", self)
    def sqrt(self): return _unary("sqrt", self)
    def abs(self): return _unary("abs", self)
    def neg(self): return _unary("neg", self)
    def float(self): return _to_float(self)
    def to(self, *args, **kwargs): return _to_float(self, *args, **kwargs)
    def clamp(self, min=None, max=None): return _clamp(self, min, max)
    def logical_not(self): return _logical("not", self)
    def logical_and(self, o): return _logical("and", self, o)
    def logical_or(self, o): return _logical("or", self, o)
    def minimum(self, o): return _min_max("min", self, o)
    def maximum(self, o): return _min_max("max", self, o)
    new_ones = _new_scalar(1)
    new_zeros = _new_scalar(0)


def _trace(kind: str, fn) -> Variant:
    if not callable(fn):
        raise TypeError(f"{kind} must be a callable, got {type(fn).__name__}")
    tracer = _Tracer(kind)
    args = [tracer.sym(("arg", name)) for name in ARGS[kind]]
    try:
        result = fn(*args)
    except RecursionError:
        raise VariantError(f"{kind} recursed too deeply while tracing") from None
    if isinstance(result, _Indexed) or result is None:
        raise VariantError(f"{kind} returned {'None' if result is None else 'a partly indexed captured tensor'}")
    try:
        result = tracer.lift(result)
    except VariantError:
        raise VariantError(f"{kind} returned a {type(result).__name__}, not a traced value or a number") from None
    if kind == "score_mod":
        if result.type == "bool":
            raise VariantError("score_mod returned a bool (a mask?): pass it as mask_mod, or use torch.where")
        result = _as_float(result)
    elif result.type != "bool":
        raise VariantError(f"mask_mod returned a {result.type}; it must return a bool (a comparison, & | ~ of them)")
    return Variant(kind, result.node, tracer.captures(), tuple(tracer.tensors))


# ---------------------------------------------------------------- the trace cache
#
# What is cached: per code object (held weakly; a lambda written inline in a loop is a new
# function each time but one code object) and kind, the last few Variants traced from it (their
# tensors held weakly: the cache keeps no tensor alive), each with a fingerprint of what the
# function can see: the objects in its closure cells, the globals its code (and nested code)
# names, its defaults, and, recursively, the same for functions and containers among those
# (functools.partial too); for other objects among them (an nn.Module, a config object), the
# identities of their attributes and of the values of dict attributes (nn.Module keeps its
# buffers in one). A lookup recomputes the fingerprint and compares it by identity: a new tensor
# object, a reassigned global or a replaced buffer retraces; a tensor changed in place does not
# (its values are read at call time); a Python object mutated in place deeper than that is not
# seen. A trace that captured a tensor the function made itself (bias.float(), not a view of
# what it sees) is not cached: that copy would not follow the original. Callables that are not
# functions (bound methods, objects with __call__) are traced on every call.

_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_CACHE_LOCK = threading.Lock()
_FINGERPRINT_DEPTH = 4
_ENTRIES_PER_CODE = 8
_FINGERPRINT_ITEMS = 64
_OPAQUE = (types.ModuleType, type, types.BuiltinFunctionType, numbers.Number, str, bytes, bool, type(None),
           torch.Tensor, torch.dtype, torch.device)


def _code_names(code: types.CodeType) -> list[str]:
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names += _code_names(const)
    return names


def _referenced(fn) -> list:
    """What a function can see: closure contents, named globals, defaults."""
    if isinstance(fn, functools.partial):
        return [fn.func, *fn.args, *fn.keywords.values()]
    seen = []
    for cell in fn.__closure__ or ():
        try:
            seen.append(cell.cell_contents)
        except ValueError:
            seen.append(_EMPTY_CELL)
    for name in _code_names(fn.__code__):
        if name in fn.__globals__:
            seen.append(fn.__globals__[name])
    seen += list(fn.__defaults__ or ()) + list((fn.__kwdefaults__ or {}).values())
    return seen


_EMPTY_CELL = object()


def _fingerprint(fn) -> tuple:
    """(what fn sees, by identity; the ids of the tensors among it)."""
    parts, visited, tensors = [], {id(fn)}, set()

    def note(value):
        parts.append(_ref(value))
        if isinstance(value, torch.Tensor):
            tensors.add(id(value))

    def add(obj, depth):
        if depth > _FINGERPRINT_DEPTH or len(parts) > 4 * _FINGERPRINT_ITEMS:
            return
        note(obj)
        if id(obj) in visited:
            return
        visited.add(id(obj))
        if isinstance(obj, (types.FunctionType, functools.partial)):
            for item in _referenced(obj):
                add(item, depth + 1)
        elif isinstance(obj, (list, tuple, dict)):
            items = obj.values() if isinstance(obj, dict) else obj
            for value in list(items)[:_FINGERPRINT_ITEMS]:
                add(value, depth + 1)
        elif not isinstance(obj, _OPAQUE):
            attributes = getattr(obj, "__dict__", None)
            if isinstance(attributes, dict):
                for value in list(attributes.values())[:_FINGERPRINT_ITEMS]:
                    note(value)
                    if isinstance(value, dict):
                        for item in list(value.values())[:_FINGERPRINT_ITEMS]:
                            note(item)

    for item in _referenced(fn):
        add(item, 1)
    return tuple(parts), tensors


def _reachable(tensor: torch.Tensor, seen: set) -> bool:
    """Whether a captured tensor is one the function sees (or a view of one): a tensor the function
    made while tracing (bias.float()) is a copy, stale on a later call, so such traces are not cached."""
    return id(tensor) in seen or (tensor._base is not None and id(tensor._base) in seen)


class _Container:
    """A list, tuple, dict or set in a fingerprint, by id: holding it would keep the tensors in it
    alive (these take no weak reference). Its items are in the fingerprint on their own."""

    __slots__ = ("ident",)

    def __init__(self, obj):
        self.ident = (type(obj), id(obj))


def _ref(obj):
    """A weak reference where the object allows one (so the cache keeps nothing alive), an id for
    containers, else the object (numbers, strings: they hold no tensor)."""
    if isinstance(obj, (list, tuple, dict, set)):
        return _Container(obj)
    try:
        return weakref.ref(obj)
    except TypeError:
        return obj


def _same(a: tuple, b: tuple) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, _Container) and isinstance(y, _Container):
            if x.ident != y.ident:
                return False
            continue
        if isinstance(x, weakref.ref) and isinstance(y, weakref.ref):
            x, y = x(), y()
            if x is None or y is None:
                return False
        if x is not y:
            return False
    return True


class _Entry:
    """One cached trace: the fingerprint, the variant's key part, and its tensors held weakly
    (with the last Variant handed out, also weakly), so the cache keeps no tensor alive."""

    def __init__(self, fingerprint: tuple, variant: Variant):
        self.fingerprint = fingerprint
        self.key_part = _unbound(variant)
        self.tensors = tuple(weakref.ref(t) for t in variant.tensors)
        self.last = weakref.ref(variant)

    def variant(self) -> Variant | None:
        """The cached Variant, or None when one of its tensors is gone."""
        last = self.last()
        if last is not None:
            return last
        tensors = tuple(ref() for ref in self.tensors)
        if any(t is None for t in tensors):
            return None
        variant = self.key_part.bind(tensors)
        self.last = weakref.ref(variant)
        return variant


def _unbound(variant: Variant) -> Variant:
    unbound = object.__new__(Variant)
    for name in ("kind", "tree", "captures"):
        object.__setattr__(unbound, name, getattr(variant, name))
    object.__setattr__(unbound, "tensors", ())
    return unbound


def _cached_trace(kind: str, fn) -> Variant:
    if not isinstance(fn, (types.FunctionType, functools.partial)):
        return _trace(kind, fn)
    key = fn.__code__ if isinstance(fn, types.FunctionType) else fn
    fingerprint, tensors = _fingerprint(fn)
    with _CACHE_LOCK:
        entries = _CACHE.setdefault(key, {}).setdefault(kind, [])
        for i, entry in enumerate(entries):
            if _same(entry.fingerprint, fingerprint):
                variant = entry.variant()
                if variant is not None:
                    entries.insert(0, entries.pop(i))
                    return variant
    variant = _trace(kind, fn)
    if all(_reachable(t, tensors) for t in variant.tensors):
        with _CACHE_LOCK:
            entries = _CACHE.setdefault(key, {}).setdefault(kind, [])
            entries.insert(0, _Entry(fingerprint, variant))
            del entries[_ENTRIES_PER_CODE:]
    return variant


def trace_score_mod(fn) -> Variant:
    """The Variant of ``fn(score, b, h, q_idx, kv_idx) -> score`` (FlexAttention's score_mod), from
    the trace cache when nothing ``fn`` sees has changed (see above)."""
    return _cached_trace("score_mod", fn)


def trace_mask_mod(fn) -> Variant:
    """The Variant of ``fn(b, h, q_idx, kv_idx) -> bool`` (FlexAttention's mask_mod), cached likewise."""
    return _cached_trace("mask_mod", fn)
