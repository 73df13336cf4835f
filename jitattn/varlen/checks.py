"""Validation of varlen_attn / varlen_attn_out arguments (see shared/spec/varlen.md).

check_varlen_args checks types, ranks, dtypes, shapes and scalar arguments, each error naming the
argument; the CUDA-device check comes last, so everything else is testable with CPU tensors. It
reads no tensor values (that would sync with the GPU). `varlen_call` runs the same checks and
returns the VarlenCall that planning and launch take. check_varlen_values checks the values
(monotonic cu_seq, seqused_k within its slot, page ids in range) for use under JITATTN_DEBUG=1.
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

from jitattn import checks as check

_Q_DOC = "(T_q, H_q, D)"
_KV_DOC = "(T_k, H_kv, D)"
_POOL_DOC = "(total_pages, page_size, H_kv, D) (a page pool, as block_table is given)"


class AuxRequest(NamedTuple):
    """Which auxiliary outputs varlen_attn returns: AuxRequest(lse=True) adds the logsumexp.

    An immutable NamedTuple, like torch.nn.attention.varlen.AuxRequest."""

    lse: bool = False


class VarlenArgs(NamedTuple):
    """What check_varlen_args derived from a valid call. (A NamedTuple: a frozen dataclass made
    the first call slower, notes/host-time.md.)"""

    num_seqs: int
    total_q: int
    num_heads_q: int
    num_heads_kv: int
    head_dim: int
    scale: float
    window_left: int
    window_right: int
    paged: bool
    page_size: int  # 0 when not paged
    num_splits: int | None
    return_lse: bool
    device: torch.device
    softcap: float  # 0.0: no soft cap
    score_mod: object = None  # a traced score_mod (jitattn.variants.Variant, with its captured tensors) or None
    mask_mod: object = None   # a traced mask_mod, or None


# The call's inputs as given; VarlenCall adds VarlenArgs' fields after them, in VarlenArgs' order.
_CALL_INPUTS = [("query", "torch.Tensor"), ("key", "torch.Tensor"), ("value", "torch.Tensor"),
                ("cu_seq_q", "torch.Tensor"), ("cu_seq_k", "torch.Tensor | None"), ("max_q", "int"),
                ("max_k", "int"), ("seqused_k", "torch.Tensor | None"), ("block_table", "torch.Tensor | None"),
                ("out", "torch.Tensor | None")]
_INPUTS = len(_CALL_INPUTS)


class VarlenCall(NamedTuple("VarlenCallFields", _CALL_INPUTS + list(VarlenArgs.__annotations__.items()))):
    """A checked varlen_attn call: its tensors and sizes as given, then what the checks derived
    (VarlenArgs' fields, in its order). Built once where a call enters (the API, the ops) by
    `varlen_call`, read by the forward's planning and launch, so nothing below spells the
    argument list again."""

    __slots__ = ()

    @property
    def args(self) -> VarlenArgs:
        """What the checks derived, on its own."""
        return _tuple_new(VarlenArgs, self[_INPUTS:])


# A VarlenCall is made on every call: tuple.__new__ directly, as a NamedTuple's own __new__ is a
# Python function with a call's cost (notes/host-time.md, "NamedTuple construction").
_tuple_new = tuple.__new__


def needs_grad(*tensors) -> bool:
    """Whether autograd records a call on these inputs (non-tensors count as not requiring grad)."""
    if torch.is_grad_enabled():  # a plain loop: this runs on every eager call (the fast path)
        for t in tensors:
            if getattr(t, "requires_grad", False):
                return True
    return False


def _int_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be an int32 tensor, got {t.dtype}")


def _optional_tensor(name: str, value, ndim: int, shape_doc: str) -> torch.Tensor | None:
    return None if value is None else check.tensor(name, value, ndim, shape_doc)


def _scale(value, default: float) -> float:
    """None -> default; else a finite number > 0. torch's words for 0, negatives and NaN."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"scale must be a float or None, got {type(value).__name__} {value!r}")
    if not value > 0:  # also NaN; the value as given, as torch prints it
        raise ValueError(f"scale must be greater than 0, got {value}")
    if math.isinf(value):  # torch lets inf through to NaN logits; we say so instead
        raise ValueError(f"scale must be finite, got {value}")
    return float(value)


def _softcap(value) -> float:
    """None or 0 -> 0.0, no cap (FlashAttention's convention); else a finite cap > 0."""
    if value is None or (isinstance(value, numbers.Real) and not isinstance(value, bool) and value == 0):
        return 0.0
    return check.positive_float("softcap", value, 0.0)


def _variant(name: str, value, trace):
    """A score_mod / mask_mod argument as a traced Variant (jitattn/variants): None stays None; a
    Variant (the ops rebuild one from its text) is taken as is; a callable is traced (cached per
    function: jitattn/variants/trace.py), raising the tracer's error naming what it cannot take."""
    if value is None:
        return None
    from jitattn.variants import Variant

    if isinstance(value, Variant):
        if value.kind != name:
            raise TypeError(f"{name} must be a {name} function, got a traced {value.kind}")
        return value
    if not callable(value):
        raise TypeError(f"{name} must be a function {_VARIANT_SIGNATURES[name]} or None, "
                        f"got {type(value).__name__} {value!r}")
    return trace(value)


_VARIANT_SIGNATURES = {"score_mod": "(score, b, h, q_idx, kv_idx) -> score",
                       "mask_mod": "(b, h, q_idx, kv_idx) -> bool"}


def check_positions(score_mod, mask_mod, max_q, max_k) -> None:
    """A variant whose rendering computes positions in fp32 (exact below 2^22) refuses longer sequences."""
    from jitattn.variants.render import FLOAT_POSITIONS_LIMIT, float_positions

    for variant in (score_mod, mask_mod):
        if variant is not None and float_positions(variant):
            for name, value in (("max_q", max_q), ("max_k", max_k)):
                if value >= FLOAT_POSITIONS_LIMIT:
                    raise ValueError(f"{name} = {value}: a {variant.kind} computing with q_idx / kv_idx runs them "
                                     f"in float32 on the GPU, exact for sequences below {FLOAT_POSITIONS_LIMIT} "
                                     f"tokens")


def _variants(score_mod, mask_mod, softcap: float):
    """The call's traced score_mod / mask_mod (either may be None), checked against what they do
    not compose with."""
    if score_mod is None and mask_mod is None:
        return None, None
    from jitattn.variants import trace_mask_mod, trace_score_mod

    score_mod = _variant("score_mod", score_mod, trace_score_mod)
    mask_mod = _variant("mask_mod", mask_mod, trace_mask_mod)
    if score_mod is not None and softcap:
        raise ValueError("softcap and score_mod both change the score: pass one (a score_mod writes the cap "
                         "itself: cap * torch.tanh(score / cap))")
    if torch.is_grad_enabled():
        for variant in (score_mod, mask_mod):
            for slot, t in enumerate(variant.tensors if variant is not None else ()):
                if t.requires_grad:
                    raise ValueError(f"{variant.kind} reads a tensor that requires grad (captured slot {slot}, shape "
                                     f"{tuple(t.shape)}): gradients do not flow into captured tensors; pass it "
                                     "detached (.detach()) or call under torch.no_grad()")
    return score_mod, mask_mod


def _window(value) -> tuple[int, int]:
    if not isinstance(value, (tuple, list)):
        raise TypeError(f"window_size must be a tuple of two ints (left, right), got {type(value).__name__} {value!r}")
    if len(value) != 2:
        raise ValueError(f"window_size must have two entries (left, right), got {len(value)}: {value!r}")
    return (check.integer("window_size[0] (left)", value[0], -1),
            check.integer("window_size[1] (right)", value[1], -1))


def check_varlen_args(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale, window_size, enable_gqa,
                      seqused_k, block_table, num_splits, out=None, return_aux=None, softcap=None, score_mod=None,
                      mask_mod=None) -> VarlenArgs:
    """Raise TypeError/ValueError naming the first bad argument; return the derived VarlenArgs
    (varlen_call's checks)."""
    return varlen_call(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size,
                       enable_gqa=enable_gqa, seqused_k=seqused_k, block_table=block_table, num_splits=num_splits,
                       out=out, return_aux=return_aux, softcap=softcap, score_mod=score_mod, mask_mod=mask_mod).args


def varlen_call(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    scale=None,
    window_size=(-1, -1),
    enable_gqa=False,
    seqused_k=None,
    block_table=None,
    num_splits=None,
    out=None,
    return_aux=None,
    softcap=None,
    score_mod=None,
    mask_mod=None,
) -> VarlenCall:
    """The checked call (varlen_attn's defaults): raise TypeError/ValueError naming the first
    bad argument.

    cu_seq_k may be None only with block_table (keys then come from the page pool and their
    counts from seqused_k), as torch's signature allows."""
    # -- tensors and ranks
    query = check.tensor("query", query, 3, _Q_DOC)
    block_table = _optional_tensor("block_table", block_table, 2, "(N, max_pages_per_seq)")
    paged = block_table is not None
    kv_ndim, kv_doc = (4, _POOL_DOC) if paged else (3, _KV_DOC + " (a 4-D page pool needs block_table)")
    key = check.tensor("key", key, kv_ndim, kv_doc)
    value = check.tensor("value", value, kv_ndim, kv_doc)
    cu_seq_q = check.tensor("cu_seq_q", cu_seq_q, 1, "(N+1,)")
    if cu_seq_k is None and not paged:
        raise TypeError("cu_seq_k must be a torch.Tensor of shape (N+1,) (it may be None only with block_table)")
    cu_seq_k = _optional_tensor("cu_seq_k", cu_seq_k, 1, "(N+1,)")
    seqused_k = _optional_tensor("seqused_k", seqused_k, 1, "(N,)")

    # -- dtypes
    if query.dtype not in check.Q_DTYPES:
        raise TypeError(f"query must be float16 or bfloat16, got {query.dtype}")
    for name, t in (("key", key), ("value", value)):
        if t.dtype != query.dtype:
            raise TypeError(f"{name} must have query's dtype ({query.dtype}), got {t.dtype}")
    for name, t in (("cu_seq_q", cu_seq_q), ("cu_seq_k", cu_seq_k), ("seqused_k", seqused_k),
                    ("block_table", block_table)):
        if t is not None:
            _int_dtype(name, t)

    # -- shapes: heads and head_dim
    if key.shape != value.shape:
        raise ValueError(f"key and value must have the same shape, got key {tuple(key.shape)} "
                         f"and value {tuple(value.shape)}")
    total_q, num_heads_q, head_dim = query.shape
    # Kernels index tokens and pages with 32-bit ints.
    for name, rows, what in (("query", total_q, "T_q"), ("key", key.shape[0], "total_pages" if paged else "T_k")):
        if rows >= 2**31:
            raise ValueError(f"{name} has {rows} rows ({what}); at most 2**31 - 1 are supported")
    num_heads_kv = key.shape[-2]
    for name, t in (("key", key), ("value", value)):
        if t.shape[-1] != head_dim:
            raise ValueError(f"head_dim of {name} ({t.shape[-1]}) must equal head_dim of query ({head_dim})")
    check.head_dim("query.shape[2]", head_dim)
    if num_heads_q < 1:
        raise ValueError(f"query must have at least one head (H_q), got shape {tuple(query.shape)}")
    if num_heads_kv < 1:
        raise ValueError(f"key/value must have at least one head (H_kv), got shape {tuple(key.shape)}")
    if enable_gqa is not False:
        check.boolean("enable_gqa", enable_gqa)
    # torch's words first (its tests match them), then ours.
    if not enable_gqa and num_heads_q != num_heads_kv:
        raise ValueError(f"Expect query and key/value to have the same number of heads but got Hq={num_heads_q} "
                         f"and Hkv={num_heads_kv}. Try setting enable_gqa=True for GQA. (query has "
                         f"H_q={num_heads_q} heads, key/value H_kv={num_heads_kv}: they must be equal unless "
                         "enable_gqa=True)")
    if num_heads_q % num_heads_kv:
        raise ValueError(f"Expect number of query heads to be a multiple of kv heads for GQA but got "
                         f"Hq={num_heads_q} and Hkv={num_heads_kv}. (with enable_gqa, the query heads "
                         f"H_q={num_heads_q} must be a multiple of the key/value heads H_kv={num_heads_kv})")
    page_size = 0
    if paged:
        page_size = key.shape[1]
        if page_size < 1:
            raise ValueError(f"key/value page pool must have page_size >= 1 (dim 1), got shape {tuple(key.shape)}")
        if page_size & (page_size - 1):
            raise ValueError(f"key/value page pool must have a page_size (dim 1) that is a power of two, "
                             f"got {page_size} (shape {tuple(key.shape)})")

    # -- batch metadata
    if cu_seq_q.shape[0] < 2:
        raise ValueError(f"cu_seq_q must have N+1 >= 2 entries, got shape {tuple(cu_seq_q.shape)}")
    num_seqs = cu_seq_q.shape[0] - 1
    if cu_seq_k is not None and cu_seq_k.shape != cu_seq_q.shape:
        raise ValueError(f"cu_seq_k must have the shape of cu_seq_q ({num_seqs + 1},), got {tuple(cu_seq_k.shape)}")
    if paged and seqused_k is None:
        raise ValueError("block_table requires seqused_k (the number of valid keys per sequence)")
    if seqused_k is not None and seqused_k.shape[0] != num_seqs:
        raise ValueError(f"seqused_k must have shape (N,) = ({num_seqs},), got {tuple(seqused_k.shape)}")
    if paged and block_table.shape[0] != num_seqs:
        raise ValueError(f"block_table must have shape (N, max_pages_per_seq) with N = {num_seqs}, "
                         f"got {tuple(block_table.shape)}")

    # -- scalars
    check.integer("max_q", max_q, 0)
    check.integer("max_k", max_k, 0)
    scale = _scale(scale, 1.0 / head_dim**0.5)
    left, right = _window(window_size)
    if num_splits is not None:
        num_splits = check.integer("num_splits", num_splits, 1)
    softcap = _softcap(softcap)
    score_mod, mask_mod = _variants(score_mod, mask_mod, softcap)
    if score_mod is not None or mask_mod is not None:
        check_positions(score_mod, mask_mod, max_q, max_k)

    # -- out and return_aux
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor of query's shape {tuple(query.shape)}, got {type(out).__name__}")
        if out.shape != query.shape:
            raise ValueError(f"out must have query's shape {tuple(query.shape)}, got {tuple(out.shape)}")
        if out.dtype != query.dtype:
            raise TypeError(f"out must have query's dtype ({query.dtype}), got {out.dtype}")
        if out.device != query.device:
            raise ValueError(f"out is on {out.device} but query is on {query.device}: out must be on query's device")
    return_lse = False
    if return_aux is not None:
        if not hasattr(return_aux, "lse"):
            raise TypeError(f"return_aux must be None or an AuxRequest, got {type(return_aux).__name__} {return_aux!r}")
        if not isinstance(return_aux.lse, bool):
            raise TypeError(f"return_aux.lse must be a bool, got {type(return_aux.lse).__name__} {return_aux.lse!r}")
        return_lse = return_aux.lse

    # -- last: one CUDA device for every tensor (all of the above runs on CPU tensors)
    named = {"query": query, "key": key, "value": value, "cu_seq_q": cu_seq_q, "cu_seq_k": cu_seq_k,
             "seqused_k": seqused_k, "block_table": block_table, "out": out}
    for variant in (score_mod, mask_mod):
        if variant is not None:
            for slot, t in enumerate(variant.tensors):
                named[f"{variant.kind}'s captured tensor {slot}"] = t
    device = check.cuda_device({name: t for name, t in named.items() if t is not None})
    return _tuple_new(VarlenCall, (query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, seqused_k, block_table, out,
                                   num_seqs, total_q, num_heads_q, num_heads_kv, head_dim, scale, left, right,
                                   paged, page_size, num_splits, return_lse, device, softcap, score_mod, mask_mod))


def check_varlen_values(
    query: torch.Tensor,
    key: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    *,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
) -> None:
    """Check the values of arguments that passed check_varlen_args (for JITATTN_DEBUG=1).

    Copies the metadata to the CPU (a sync when it lives on the GPU). Raises ValueError naming the
    argument for: cu_seq_q / cu_seq_k not starting at 0 or decreasing; cu_seq_q[-1] > T_q;
    cu_seq_k[-1] > T_k (unpaged); seqused_k[i] < 0 or above its slot (cu_seq_k[i+1] - cu_seq_k[i]
    unpaged, max_pages_per_seq * page_size paged); a page id of a page holding one of the first
    seqused_k[i] keys outside [0, total_pages) (entries past them are never read, so they may be
    padding such as -1); max_q / max_k below the longest query / key sequence."""
    paged = block_table is not None
    cq = [int(x) for x in cu_seq_q.detach().cpu().tolist()]
    ck = None if cu_seq_k is None else [int(x) for x in cu_seq_k.detach().cpu().tolist()]
    for name, cu, total in (("cu_seq_q", cq, query.shape[0]), ("cu_seq_k", ck, None if paged else key.shape[0])):
        if cu is None:
            continue
        if cu[0] != 0:
            raise ValueError(f"{name} must start at 0, got {name}[0] = {cu[0]}")
        for i in range(len(cu) - 1):
            if cu[i + 1] < cu[i]:
                raise ValueError(f"{name} must be non-decreasing, got {name}[{i}] = {cu[i]} > "
                                 f"{name}[{i + 1}] = {cu[i + 1]}")
        if total is not None and cu[-1] > total:
            what = "T_q (query.shape[0])" if name == "cu_seq_q" else "T_k (key.shape[0])"
            raise ValueError(f"{name}[-1] = {cu[-1]} exceeds {what} = {total}")
    len_q = [cq[i + 1] - cq[i] for i in range(len(cq) - 1)]
    if seqused_k is not None:
        used = [int(x) for x in seqused_k.detach().cpu().tolist()]
        if paged:
            page_size = key.shape[1]
            slots = [block_table.shape[1] * page_size] * len(used)
        else:
            slots = [ck[i + 1] - ck[i] for i in range(len(used))]
        for i, (n, slot) in enumerate(zip(used, slots)):
            if n < 0 or n > slot:
                raise ValueError(f"seqused_k[{i}] = {n} must be in [0, {slot}] (the keys sequence {i} has room for)")
        len_k = used
    else:
        len_k = [ck[i + 1] - ck[i] for i in range(len(ck) - 1)]
    if paged:
        total_pages = key.shape[0]
        table = block_table.detach().cpu()
        for i, n in enumerate(len_k):
            pages_used = -(-n // page_size)
            row = table[i, :pages_used]
            bad = ((row < 0) | (row >= total_pages)).nonzero()
            if bad.numel():
                p = int(bad[0, 0])
                raise ValueError(f"block_table[{i}, {p}] = {int(row[p])} is not a page of the pool: "
                                 f"page ids must be in [0, {total_pages})")
    if len_q and max(len_q) > max_q:
        raise ValueError(f"max_q = {max_q} is below the longest query sequence ({max(len_q)})")
    if len_k and max(len_k) > max_k:
        raise ValueError(f"max_k = {max_k} is below the longest key sequence ({max(len_k)})")
