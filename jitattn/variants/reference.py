"""The float64 oracle of a variant: its tree evaluated with torch on broadcastable tensors.

Kernels and the user's own function are checked against this. It follows the kernels' rules
where they differ from torch's: ints are 32-bit and wrap, // and % by zero give 0, and a captured
tensor read outside its bounds gives 0 (rendered code never faults on a bad index).
"""
from __future__ import annotations

import torch

from jitattn.variants.tree import ARGS, Shared, Variant, children, const_value

_INT_DTYPES = (torch.int32, torch.int64)


def _wrap32(x: torch.Tensor) -> torch.Tensor:
    return (x + 2 ** 31) % 2 ** 32 - 2 ** 31


def _as_arg(value, name: str, floating: bool) -> torch.Tensor:
    tensor = torch.as_tensor(value)
    if floating:
        return tensor.to(torch.float64)
    if tensor.dtype.is_floating_point or tensor.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers, got {tensor.dtype}")
    return tensor.to(torch.int64)


def _load(tensor: torch.Tensor, indices: list, device) -> torch.Tensor:
    tensor = tensor.to(device)
    if not indices:
        value = tensor
    else:
        shape = torch.broadcast_shapes(*(i.shape for i in indices))
        indices = [i.expand(shape) for i in indices]
        inside = torch.ones(shape, dtype=torch.bool, device=device)
        for i, size in zip(indices, tensor.shape):
            inside &= (i >= 0) & (i < size)
        clamped = [torch.where(inside, i, 0) for i in indices]
        if tensor.numel() == 0:
            value = torch.zeros(shape, dtype=tensor.dtype, device=device)
        else:
            value = torch.where(inside, tensor[tuple(clamped)], torch.zeros((), dtype=tensor.dtype, device=device))
    if value.dtype == torch.bool:
        return value
    if value.dtype in _INT_DTYPES:
        return _wrap32(value.to(torch.int64))
    return value.to(torch.float64)


def _floordiv(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    safe = torch.where(b == 0, 1, b)
    return _wrap32(torch.where(b == 0, 0, torch.div(a, safe, rounding_mode="floor")))


def _mod(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    safe = torch.where(b == 0, 1, b)
    return torch.where(b == 0, 0, torch.remainder(a, safe))


_FLOAT_FUNCTIONS = {"exp": torch.exp, "exp2": torch.exp2, "log": torch.log, "tanh": torch.tanh,
                    "sigmoid": torch.sigmoid, "sqrt": torch.sqrt}


def evaluate(v: Variant, args: dict, tensors=None) -> torch.Tensor:
    """The value of ``v``'s tree at ``args`` (name -> tensor), reading ``tensors`` (default
    ``v.tensors``) for the captures."""
    tensors = v.tensors if tensors is None else tuple(tensors)
    if len(tensors) != len(v.captures):
        raise ValueError(f"the variant has {len(v.captures)} captures, {len(tensors)} tensors were given")
    device = next(iter(args.values())).device
    shared, values = Shared(v.tree, v.captures), []
    for node in shared.nodes:
        op, kids = node[0], [values[shared.number(c)] for c in children(node)]
        if op == "arg":
            value = args[node[1]]
        elif op == "const":
            c = const_value(node[1])
            dtype = torch.bool if type(c) is bool else torch.int64 if type(c) is int else torch.float64
            value = torch.tensor(c, dtype=dtype, device=device)
        elif op == "load":
            value = _load(tensors[node[1]], kids, device)
        elif op in ("add", "sub", "mul", "neg", "abs"):
            fn = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "neg": torch.neg, "abs": torch.abs}[op]
            value = fn(*kids)
            value = value if value.dtype.is_floating_point else _wrap32(value)
        elif op == "div":
            value = kids[0] / kids[1]
        elif op == "floordiv":
            value = _floordiv(*kids)
        elif op == "mod":
            value = _mod(*kids)
        elif op in ("min", "max"):
            value = (torch.minimum if op == "min" else torch.maximum)(*kids)
        elif op in ("lt", "le", "gt", "ge", "eq", "ne"):
            value = getattr(torch, op)(*kids)
        elif op == "where":
            value = torch.where(*kids)
        elif op in ("and", "or"):
            value = (torch.logical_and if op == "and" else torch.logical_or)(*kids)
        elif op == "not":
            value = torch.logical_not(kids[0])
        elif op == "float":
            value = kids[0].to(torch.float64)
        else:
            value = _FLOAT_FUNCTIONS[op](kids[0])
        values.append(value)
    return values[shared.number(v.tree)]


def reference_score(v: Variant, scores, b, h, q_idx, kv_idx, tensors=None) -> torch.Tensor:
    """score_mod ``v`` at natural-units ``scores`` (float64 result, broadcast over all arguments)."""
    if v.kind != "score_mod":
        raise ValueError(f"reference_score takes a score_mod variant, got a {v.kind}")
    args = dict(zip(ARGS["score_mod"], (_as_arg(scores, "scores", True), *(
        _as_arg(x, name, False) for x, name in zip((b, h, q_idx, kv_idx), ARGS["mask_mod"])))))
    return _broadcast(evaluate(v, args, tensors), args).to(torch.float64)


def reference_mask(v: Variant, b, h, q_idx, kv_idx, tensors=None) -> torch.Tensor:
    """mask_mod ``v`` at the given indices (bool result, broadcast over all arguments)."""
    if v.kind != "mask_mod":
        raise ValueError(f"reference_mask takes a mask_mod variant, got a {v.kind}")
    args = {name: _as_arg(x, name, False) for x, name in zip((b, h, q_idx, kv_idx), ARGS["mask_mod"])}
    return _broadcast(evaluate(v, args, tensors), args)


def _broadcast(value: torch.Tensor, args: dict) -> torch.Tensor:
    shape = torch.broadcast_shapes(value.shape, *(a.shape for a in args.values()))
    return value.expand(shape)
