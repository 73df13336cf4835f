"""Input checks shared by the public APIs: each failure names the argument, what was expected
and what was given, and raises before anything is compiled or launched."""
from __future__ import annotations

import math
import numbers

import torch

SUPPORTED_HEAD_DIMS = tuple(range(32, 257, 16))
Q_DTYPES = (torch.float16, torch.bfloat16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16",
               torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2"}


def tensor(name: str, value, ndim: int, shape_doc: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {shape_doc}, got {type(value).__name__}")
    if value.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims {shape_doc}, got shape {tuple(value.shape)}")
    return value


def cuda_device(named: dict[str, torch.Tensor]) -> torch.device:
    """All tensors on one CUDA device; returns it."""
    first_name, first = next(iter(named.items()))
    for name, t in named.items():
        if t.device.type != "cuda":
            raise ValueError(f"{name} must be a CUDA tensor, got a tensor on {t.device}")
    for name, t in named.items():
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}: "
                             "all inputs must be on the same device")
    return first.device


def choice(name: str, value, options: tuple[str, ...]) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {options}, got {type(value).__name__} {value!r}")
    if value not in options:
        raise ValueError(f"{name} must be one of {options}, got {value!r}")
    return value


def boolean(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def integer(name: str, value, minimum: int) -> int:
    if isinstance(value, torch.SymInt):  # a traced size (torch.compile, dynamic shapes): kept symbolic
        torch._check(value >= minimum, lambda: f"{name} must be >= {minimum}, got {value}")
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def positive_float(name: str, value, default: float) -> float:
    """None -> default; otherwise a finite real number > 0."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float or None, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return value


def head_dim(name: str, value: int) -> int:
    if value not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"{name} (head_dim) must be a multiple of 16 in [32, 256], got {value}")
    return value


def reads_in_place(t: torch.Tensor) -> bool:
    """Whether kernels can read `t` as it is with 16-byte vectors: unit last stride, 16-byte
    aligned base and strides."""
    if t.data_ptr() % 16 == 0 and t.is_contiguous():  # the common case, checked cheaply
        return True
    per_vec = 16 // t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s % per_vec == 0 for s in t.stride()[:-1])


def vector_ready(t: torch.Tensor) -> torch.Tensor:
    """`t` itself if kernels can read it with 16-byte vectors (reads_in_place), else a contiguous
    copy: never a silent misread."""
    if reads_in_place(t):
        return t
    # clone, not contiguous(): a contiguous tensor at a misaligned address must be copied too.
    return t.clone(memory_format=torch.contiguous_format)


def vectors_ready(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """vector_ready for the three inputs of an attention call, with one combined test of the
    common case (all aligned and contiguous): a per-call host cost."""
    if not (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15 and q.is_contiguous() and k.is_contiguous() \
            and v.is_contiguous():
        return q, k, v
    return vector_ready(q), vector_ready(k), vector_ready(v)
