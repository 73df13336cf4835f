"""jitattn as a provider of torch's flash attention (torch.nn.attention's registry, torch >= 2.11).

    import torch, jitattn                       # registers "jitattn"; activates nothing
    torch.nn.attention.activate_flash_attention_impl("jitattn")   # or jitattn.activate()
    ...                                         # SDPA's flash path and torch's varlen_attn run jitattn
    torch.nn.attention.restore_flash_attention_impl()             # or jitattn.restore()

(the registration and activate / restore: jitattn/integrations/torch_registry.py; this module is
what activation installs.)

Activation overrides, for one dispatch key (CUDA), aten's `_flash_attention_forward`,
`_flash_attention_forward_no_dropout_inplace`, `_flash_attention_backward`,
`_scaled_dot_product_flash_attention` and `_scaled_dot_product_flash_attention_backward` with
kernels that keep aten's semantics (arguments, output shapes/strides/dtypes as aten's meta
kernels give them, lse natural log, the philox seed/offset tensors) and compute through
jitattn's public entry points (`jitattn.varlen_attn_out`, `torch.ops.jitattn.varlen_attn_backward`):
dense (B, S, H, D) calls become varlen calls with one sequence per batch row.

A call jitattn does not compute (see `forward_fallback_reason` / `backward_fallback_reason`:
dropout, a debug mask, ALiBi, other dtypes or head dims, a GPU older than sm_80, ...) runs the
kernel aten had for that key before activation (`torch.library.get_kernel`), logged once per
reason at debug level: never an error of ours, never a different result. Nothing here syncs with
the host, so calls capture into CUDA graphs; under torch.compile the aten ops stay in the graph
(their meta kernels shape them) and these kernels run when it executes.

`Kernels` / `use_kernels` is the seam between the argument mapping and jitattn's kernels (tests
put a float64 CPU stand-in there); `CALLS` counts what ran.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import math
import threading
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from jitattn.checks import Q_DTYPES as DTYPES, SUPPORTED_HEAD_DIMS as HEAD_DIMS
from jitattn.errors import JitattnError
from jitattn.kernel import call_memo, evict_oldest

log = logging.getLogger("jitattn.torch_flash")

OVERRIDDEN_OPS = (
    "_flash_attention_forward",
    "_flash_attention_forward_no_dropout_inplace",
    "_flash_attention_backward",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_backward",
)
MIN_CAPABILITY = (8, 0)
MAX_ROWS = 2**31 - 1  # jitattn indexes tokens with 32-bit ints

# What ran, by kind: "forward", "backward" (jitattn's kernels) and "fallback" (aten's).
CALLS: collections.Counter = collections.Counter()


# ----------------------------------------------------------------------------- the kernel seam
class Kernels(NamedTuple):
    """The kernels the provider calls, in jitattn's varlen terms (shared/spec/varlen.md).

    forward(out, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window, enable_gqa,
            seqused_k, block_table, num_splits) -> lse (H_q, T_q) float32; writes out (T_q, H_q, D)
    backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, scale,
             window) -> (dq, dk, dv) packed like query, key, value
    device_error(device) -> None if the kernels run on `device`, else why not
    """

    forward: Callable
    backward: Callable
    device_error: Callable


def _jitattn_forward(out, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window, enable_gqa,
                     seqused_k, block_table, num_splits):
    from jitattn.varlen import AuxRequest, varlen_attn_out  # the family's public names (= jitattn.varlen_attn_out)

    _, lse = varlen_attn_out(out, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                             return_aux=AuxRequest(lse=True), scale=scale, window_size=tuple(window),
                             enable_gqa=enable_gqa, seqused_k=seqused_k, block_table=block_table,
                             num_splits=num_splits)
    return lse


def _jitattn_backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, scale, window):
    import jitattn.varlen.ops  # noqa: F401  (registers torch.ops.jitattn.*)

    return torch.ops.jitattn.varlen_attn_backward(grad_out, None, query, key, value, out, lse, cu_seq_q,
                                                  cu_seq_k, None, scale, list(window), max_q, max_k, None)


@functools.lru_cache(maxsize=None)
def _cuda_device_error(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"device {device} is not CUDA"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return f"compute capability {capability} is below sm_80"
    return None


JITATTN_KERNELS = Kernels(_jitattn_forward, _jitattn_backward, _cuda_device_error)
_kernels = JITATTN_KERNELS


@contextlib.contextmanager
def use_kernels(kernels: Kernels):
    """Run the provider's calls on `kernels` instead of jitattn's (a test's stand-in), restoring after."""
    global _kernels
    if not isinstance(kernels, Kernels):
        raise TypeError(f"kernels must be a torch_flash.Kernels, got {type(kernels).__name__}")
    previous, _kernels = _kernels, kernels
    try:
        yield kernels
    finally:
        _kernels = previous


# ----------------------------------------------------------------------------- what jitattn computes
def _tensor_error(query: Tensor, tensors: dict, dense: bool, paged: bool = False) -> str | None:
    """Checks shared by forward and backward; `tensors` names the floating tensors of the call
    (with `paged`, key and value are a page pool (pages, page_size, H_kv, D))."""
    if query.dim() != (4 if dense else 3):
        return f"query has {query.dim()} dims; expected {4 if dense else 3} for a {'dense' if dense else 'varlen'} call"
    for name, t in tensors.items():
        if t.dtype not in DTYPES:
            return f"{name} dtype {t.dtype} is not float16/bfloat16"
        if t.dtype != query.dtype:
            return f"{name} dtype {t.dtype} differs from query's {query.dtype}"
        if t.device != query.device:
            return f"{name} is on {t.device}, query on {query.device}"
        if t.dim() != query.dim() + (paged and name in ("key", "value")):
            return f"{name} has {t.dim()} dims, query {query.dim()}"
        if t.shape[-1] != query.shape[-1]:
            return f"{name} head_dim {t.shape[-1]} differs from query's {query.shape[-1]}"
    if query.shape[-1] not in HEAD_DIMS:
        return f"head_dim {query.shape[-1]} is not a multiple of 16 in [32, 256]"
    heads_q, heads_kv = query.shape[-2], tensors.get("key", query).shape[-2]
    if heads_kv < 1 or heads_q % heads_kv:
        return f"{heads_q} query heads are not a multiple of {heads_kv} key/value heads"
    rows = query.shape[0] * (query.shape[1] if dense else 1)
    if rows == 0 or rows > MAX_ROWS:
        return f"{rows} query rows (jitattn takes 1 to 2**31 - 1)"
    return _kernels.device_error(query.device)


def _int32_error(**tensors) -> str | None:
    for name, t in tensors.items():
        if t is not None and t.dtype != torch.int32:
            return f"{name} is {t.dtype}, not int32"
    return None


def _window_error(left, right) -> str | None:
    if (left is not None and left < -1) or (right is not None and right < -1):
        return f"window ({left}, {right}) has a value below -1"
    return None


def _scale_error(scale) -> str | None:
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        return f"scale {scale} is not a finite number > 0"
    return None


@functools.lru_cache(maxsize=None)
def varlen_lse_is_packed() -> bool:
    """Whether this torch's varlen flash forward returns lse as (H, T_q), as jitattn does (asked
    of aten's meta kernel once). Older FlashAttention ports padded it to (B, H, max_q); varlen
    calls then run torch's kernel rather than return another layout."""
    q = torch.empty(8, 2, 64, dtype=torch.float16, device="meta")
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    try:
        lse = torch.ops.aten._flash_attention_forward(q, q, q, cu, cu, 4, 4, 0.0, False, False)[1]
    except Exception:  # no meta kernel: do not guess
        return False
    return tuple(lse.shape) == (2, 8)


def forward_fallback_reason(query, key, value, cum_seq_q, cum_seq_k, dropout_p, return_debug_mask, *,
                            scale=None, window_size_left=None, window_size_right=None, seqused_k=None,
                            alibi_slopes=None, block_table=None, out=None) -> str | None:
    """Why aten's own kernel must run this _flash_attention_forward call, or None if jitattn computes it."""
    if dropout_p != 0.0:
        return "dropout_p > 0"
    if return_debug_mask:
        return "return_debug_mask"
    if alibi_slopes is not None:
        return "alibi_slopes"
    dense = cum_seq_q is None
    if dense and (cum_seq_k is not None or seqused_k is not None or block_table is not None):
        return "a dense call with cum_seq_k, seqused_k or block_table"
    paged = block_table is not None
    tensors = {"key": key, "value": value} if out is None else {"key": key, "value": value, "out": out}
    why = _tensor_error(query, tensors, dense, paged)
    if why is None and paged:
        page_size = key.shape[1]
        if page_size < 1 or page_size & (page_size - 1):
            why = f"block_table with a page size of {page_size} (not a power of two)"
        elif seqused_k is None:
            why = "block_table without seqused_k"
    if why is None and not dense and cum_seq_k is None and not paged:
        why = "cum_seq_k is None without block_table"
    if why is None and not dense and not varlen_lse_is_packed():
        why = "this torch lays out varlen lse as (B, H, max_q)"
    if why is None and out is not None and out.shape != query.shape:
        why = f"out shape {tuple(out.shape)} differs from query's {tuple(query.shape)}"
    return (why or _int32_error(cum_seq_q=cum_seq_q, cum_seq_k=cum_seq_k, seqused_k=seqused_k,
                                block_table=block_table)
            or _window_error(window_size_left, window_size_right) or _scale_error(scale))


def backward_fallback_reason(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, dropout_p, *,
                             scale=None, window_size_left=None, window_size_right=None) -> str | None:
    """Why aten's own kernel must run this _flash_attention_backward call, or None if jitattn computes it."""
    if dropout_p != 0.0:
        return "dropout_p > 0"
    dense = cum_seq_q is None or cum_seq_q.numel() == 0
    why = _tensor_error(query, {"key": key, "value": value, "out": out, "grad_out": grad_out}, dense)
    if why is not None:
        return why
    if logsumexp.dtype != torch.float32:
        return f"logsumexp dtype {logsumexp.dtype} is not float32"
    heads = query.shape[-2]
    expected = (query.shape[0], heads, query.shape[1]) if dense else (heads, query.shape[0])
    if tuple(logsumexp.shape) != expected:
        return f"logsumexp shape {tuple(logsumexp.shape)} is not {expected}"
    if not dense and (cum_seq_k is None or cum_seq_k.numel() != cum_seq_q.numel()):
        return "cum_seq_k missing or of another length than cum_seq_q"
    return (_int32_error(cum_seq_q=None if dense else cum_seq_q, cum_seq_k=None if dense else cum_seq_k)
            or _window_error(window_size_left, window_size_right) or _scale_error(scale))


# ----------------------------------------------------------------------------- argument mapping
_CU_SEQ_CACHE: dict = {}
_CU_SEQ_CACHE_SIZE = 64


def _kept(key: tuple, device: torch.device, make: Callable):
    """make(), made once per key. Not kept when made inside CUDA graph capture (the captured fill
    runs only on replay, so the tensor holds nothing yet for an eager call)."""
    made = _CU_SEQ_CACHE.get(key)
    if made is None:
        made = make()
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            if len(_CU_SEQ_CACHE) >= _CU_SEQ_CACHE_SIZE:
                _CU_SEQ_CACHE.pop(next(iter(_CU_SEQ_CACHE)))
            _CU_SEQ_CACHE[key] = made
    return made


def dense_cu_seq(batch: int, seqlen: int, device: torch.device) -> Tensor:
    """int32 [0, S, 2S, ..., B*S]: the sequence starts of B dense rows of S tokens, made once per
    (B, S, device) (`_kept`)."""
    return _kept((batch, seqlen, device), device, lambda: torch.arange(
        0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=device) if seqlen
        else torch.zeros(batch + 1, dtype=torch.int32, device=device))


def slotted_keys(key: Tensor, value: Tensor) -> tuple | None:
    """Dense (B, L, H, D) key and value that are no packed rows but whose batch rows are evenly
    spaced (the transpose of a (B, H, L, D) KV cache: SDPA's decode calls) as one (T, H, D) view
    each over the same storage, batch row b a slot of `slot` tokens from b * slot of which the
    first L take part: (key view, value view, cu_seq_k, seqused_k), nothing copied. None where
    the strides do not allow it."""
    batch, length, heads, dim = key.shape
    stride_b, stride_l, stride_h, stride_d = key.stride()
    if (batch < 2 or length == 0 or stride_d != 1 or value.shape != key.shape or value.stride() != key.stride()
            or stride_l <= 0 or stride_b % stride_l or stride_b // stride_l < length):
        return None
    slot = stride_b // stride_l
    rows = (batch - 1) * slot + length  # the view ends where the last batch row's keys do
    views = tuple(t.as_strided((rows, heads, dim), (stride_l, stride_h, 1)) for t in (key, value))
    cu_k, used = _kept(("slots", batch, slot, length, key.device), key.device, lambda: (
        torch.arange(0, (batch + 1) * slot, slot, dtype=torch.int32, device=key.device).clamp_(max=rows),
        torch.full((batch,), length, dtype=torch.int32, device=key.device)))
    return views + (cu_k, used)


def aten_window(is_causal: bool, left, right) -> tuple[int, int]:
    """aten's (is_causal, window_size_left, window_size_right) as jitattn's (left, right): None is
    unbounded (-1) and is_causal bounds the right side at 0; both align to the bottom-right, as
    FlashAttention's (and jitattn's) windows do."""
    left = -1 if left is None else int(left)
    right = 0 if is_causal else (-1 if right is None else int(right))
    return left, right


def _packed(t: Tensor) -> Tensor:
    """(B, S, H, D) as (B*S, H, D): a view where the strides allow, else a copy."""
    packed = _packed_view(t)
    return packed if packed is not None else t.reshape(t.shape[0] * t.shape[1], t.shape[2], t.shape[3])


def _packed_view(t: Tensor) -> Tensor | None:
    """(B, S, H, D) as a (B*S, H, D) view, or None where the batch rows are not evenly spaced tokens
    (decided from the strides: a failed `view` raises, and building its message cost more than the
    rest of a decode call's argument mapping)."""
    batch, seqlen, heads, dim = t.shape
    stride_b, stride_s, stride_h, stride_d = t.stride()
    if seqlen == 1:
        token = stride_b
    elif batch == 1 or stride_b == seqlen * stride_s:
        token = stride_s
    else:
        return None
    return t.as_strided((batch * seqlen, heads, dim), (token, stride_h, stride_d))


def _like(result: Tensor, like: Tensor) -> Tensor:
    """`result` with the strides of torch.empty_like(like) (what aten's meta kernels promise)."""
    if result.stride() == like.stride():
        return result
    target = torch.empty_like(like)  # `like`'s strides when it is dense, else contiguous ones
    return result if target.stride() == result.stride() else target.copy_(result)


def _aux(query: Tensor, compute: bool = True):
    """(rng_state, philox_offset, debug_mask) with the shapes and dtypes aten's flash kernels return
    without dropout. Their values are never read without dropout (the backward takes them only to
    replay a dropout mask), so they are not filled: each fill was a kernel launch a call."""
    if not compute:
        return None, None, None
    return (torch.empty((2,), dtype=torch.uint64, device=query.device),
            torch.empty((), dtype=torch.uint64, device=query.device),
            torch.empty(0, dtype=query.dtype, device=query.device))


def flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                            return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                            seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None, out=None,
                            compute_auxiliary=True):
    """aten::_flash_attention_forward on jitattn (a call forward_fallback_reason accepts): dense
    (B, S, H, D) or varlen (T, H, D); returns (out, lse, rng_state, philox_offset, debug_mask), lse
    (B, H, S_q) dense, (H, T_q) varlen, float32 natural log. `out`: where to write (as aten's
    no_dropout_inplace variant)."""
    window = aten_window(is_causal, window_size_left, window_size_right)
    enable_gqa = query.shape[-2] != key.shape[-2]
    if out is None:
        out = torch.empty_like(query)
    if cum_seq_q is not None:
        lse = _kernels.forward(out, query, key, value, cum_seq_q, cum_seq_k, int(max_q), int(max_k), scale, window,
                               enable_gqa, seqused_k, block_table, num_splits)
        return (out, lse) + _aux(query, compute_auxiliary)
    batch, seqlen_q, heads, _ = query.shape
    seqlen_k = key.shape[1]
    cu_q = dense_cu_seq(batch, seqlen_q, query.device)
    # Keys that are no packed rows (a (B, H, L, D) cache) are read in place from their slots when
    # their strides allow (`slotted_keys`), else copied.
    key_rows = _packed_view(key)
    slotted = None if key_rows is not None else slotted_keys(key, value)
    if slotted is not None:
        key_rows, value_rows, cu_k, used = slotted
    else:
        if key_rows is None:  # no view (just asked): a copy
            key_rows = key.reshape(batch * seqlen_k, key.shape[2], key.shape[3])
        value_rows, used = _packed(value), None
        cu_k = cu_q if seqlen_k == seqlen_q else dense_cu_seq(batch, seqlen_k, query.device)
    out_packed = _packed_view(out)
    target = out_packed if out_packed is not None else torch.empty(
        batch * seqlen_q, heads, query.shape[-1], dtype=query.dtype, device=query.device)
    lse = _kernels.forward(target, _packed(query), key_rows, value_rows, cu_q, cu_k, seqlen_q, seqlen_k,
                           scale, window, enable_gqa, used, None, num_splits)
    if out_packed is None:
        out.copy_(target.view(batch, seqlen_q, heads, -1))
    # (H, B*S) -> (B, H, S): a view at batch 1, a copy otherwise
    lse = (lse.unsqueeze(0) if batch == 1 else lse.reshape(heads, batch, seqlen_q).transpose(0, 1)).contiguous()
    return (out, lse) + _aux(query, compute_auxiliary)


def flash_attention_forward_no_dropout_inplace(out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k,
                                               dropout_p, is_causal, return_debug_mask, **kwargs):
    """aten::_flash_attention_forward_no_dropout_inplace: writes `out`, returns the lse."""
    return flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                                   return_debug_mask, out=out, compute_auxiliary=False, **kwargs)[1]


def flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                             dropout_p, is_causal, rng_state, unused, *, scale=None, window_size_left=None,
                             window_size_right=None):
    """aten::_flash_attention_backward on jitattn: (dq, dk, dv) shaped and strided like query, key, value."""
    window = aten_window(is_causal, window_size_left, window_size_right)
    if cum_seq_q is not None and cum_seq_q.numel():
        dq, dk, dv = _kernels.backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                                       int(max_q), int(max_k), scale, window)
        return _like(dq, query), _like(dk, key), _like(dv, value)
    batch, seqlen_q, heads, _ = query.shape
    seqlen_k = key.shape[1]
    cu_q = dense_cu_seq(batch, seqlen_q, query.device)
    cu_k = cu_q if seqlen_k == seqlen_q else dense_cu_seq(batch, seqlen_k, query.device)
    lse = logsumexp.transpose(0, 1).reshape(heads, batch * seqlen_q)
    dq, dk, dv = _kernels.backward(_packed(grad_out), _packed(query), _packed(key), _packed(value), _packed(out),
                                   lse, cu_q, cu_k, seqlen_q, seqlen_k, scale, window)
    return (_like(dq.reshape(query.shape), query), _like(dk.reshape(key.shape), key),
            _like(dv.reshape(value.shape), value))


def sdpa_flash_forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    """aten::_scaled_dot_product_flash_attention on jitattn: (B, H, S, D) in; (out like query, lse
    (B, H, S_q), None, None, S_q, S_k, rng_state, philox_offset, debug_mask)."""
    out = torch.empty_like(query)
    _, lse, rng_state, philox_offset, debug_mask = flash_attention_forward(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), None, None, query.shape[2],
        key.shape[2], dropout_p, is_causal, return_debug_mask, scale=scale, out=out.transpose(1, 2))
    return out, lse, None, None, query.shape[2], key.shape[2], rng_state, philox_offset, debug_mask


def sdpa_flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                        is_causal, philox_seed, philox_offset, *, scale=None):
    """aten::_scaled_dot_product_flash_attention_backward on jitattn: (B, H, S, D) in and out."""
    dq, dk, dv = flash_attention_backward(
        grad_out.transpose(1, 2), query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
        out.transpose(1, 2), logsumexp, None, None, max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset,
        scale=scale)
    return _like(dq.transpose(1, 2), query), _like(dk.transpose(1, 2), key), _like(dv.transpose(1, 2), value)


# ----------------------------------------------------------------------------- the decision per op
def _sdpa_forward_reason(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
                         scale=None):
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return "SDPA inputs are not 4D"
    return forward_fallback_reason(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), None, None,
                                   dropout_p, return_debug_mask, scale=scale)


def _sdpa_backward_reason(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                          dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
    if any(t.dim() != 4 for t in (grad_out, query, key, value, out)):
        return "SDPA inputs are not 4D"
    return backward_fallback_reason(grad_out.transpose(1, 2), query.transpose(1, 2), key.transpose(1, 2),
                                    value.transpose(1, 2), out.transpose(1, 2), logsumexp, None, None, dropout_p,
                                    scale=scale)


def _forward_reason(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask,
                    *, num_splits=None, **kwargs):
    return forward_fallback_reason(query, key, value, cum_seq_q, cum_seq_k, dropout_p, return_debug_mask, **kwargs)


def _inplace_reason(out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                    return_debug_mask, *, num_splits=None, **kwargs):
    return forward_fallback_reason(query, key, value, cum_seq_q, cum_seq_k, dropout_p, return_debug_mask, out=out,
                                   **kwargs)


def _backward_reason(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                     is_causal, rng_state, unused, **kwargs):
    return backward_fallback_reason(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, dropout_p,
                                    **kwargs)


# op -> (jitattn's implementation, the fallback decision, what CALLS counts it as)
_IMPLS = {
    "_flash_attention_forward": (flash_attention_forward, _forward_reason, "forward"),
    "_flash_attention_forward_no_dropout_inplace": (flash_attention_forward_no_dropout_inplace, _inplace_reason,
                                                    "forward"),
    "_flash_attention_backward": (flash_attention_backward, _backward_reason, "backward"),
    "_scaled_dot_product_flash_attention": (sdpa_flash_forward, _sdpa_forward_reason, "forward"),
    "_scaled_dot_product_flash_attention_backward": (sdpa_flash_backward, _sdpa_backward_reason, "backward"),
}
_LOGGED_REASONS: set = set()
# (op, kernel seam, each argument's shape / dtype / device or value) -> its fallback reason: the
# decisions read nothing else, and a model's layers repeat one call (the SDPA forward's reason
# costs more than this key: it transposes and checks every tensor).
_DECISIONS: dict = call_memo()
_DECISIONS_SIZE = 256


def _facts(a):
    return (a.shape, a.dtype, a.device) if isinstance(a, Tensor) else a


def _decision(op_name: str, reason_for: Callable, args: tuple, kwargs: dict) -> str | None:
    try:
        key = (op_name, _kernels, *map(_facts, args), *((n, _facts(a)) for n, a in kwargs.items()))
        return _DECISIONS[key]
    except KeyError:
        reason = _DECISIONS[key] = reason_for(*args, **kwargs)
        if len(_DECISIONS) > _DECISIONS_SIZE:
            evict_oldest(_DECISIONS)
        return reason
    except TypeError:  # an unhashable argument: decide without the memo
        return reason_for(*args, **kwargs)
# Set while torch's own kernel runs a call jitattn passed on: the flash ops it calls in turn (SDPA's
# flash op calls _flash_attention_forward) go straight to torch's kernels, counted and logged once.
_in_torchs_kernel = threading.local()


def _log_fallback(op_name: str, reason: str) -> None:
    if (op_name, reason) not in _LOGGED_REASONS:
        _LOGGED_REASONS.add((op_name, reason))
        log.debug("aten::%s runs torch's own kernel: %s (logged once)", op_name, reason)


def dispatching_kernel(op_name: str, original) -> Callable:
    """The kernel registered for `op_name`: jitattn's implementation, or `original` (aten's kernel
    for the key, captured before the override) for the calls jitattn does not compute."""
    implementation, reason_for, kind = _IMPLS[op_name]

    def kernel(keyset, *args, **kwargs):
        if getattr(_in_torchs_kernel, "active", False) and original is not None:
            return original.call_boxed(keyset, *args, **kwargs)
        reason = _decision(op_name, reason_for, args, kwargs)
        if reason is None:
            try:
                result = implementation(*args, **kwargs)
            except (ValueError, TypeError, JitattnError) as exc:
                # jitattn refused the call before launching anything (its checks, a strict-mode
                # miss, a failed build): torch's kernel still computes it.
                reason = f"jitattn refused it: {type(exc).__name__}: {exc}"
            else:
                CALLS[kind] += 1
                return result
        CALLS["fallback"] += 1
        _log_fallback(op_name, reason)
        if original is None:
            raise RuntimeError(f"jitattn's flash-attention provider cannot run aten::{op_name} ({reason}) and "
                               "this torch has no kernel of its own for the call")
        _in_torchs_kernel.active = True
        try:
            return original.call_boxed(keyset, *args, **kwargs)
        finally:
            _in_torchs_kernel.active = False

    kernel.__name__ = f"jitattn_{op_name}"
    return kernel


# ----------------------------------------------------------------------------- activation
@dataclasses.dataclass
class ProviderHandle:
    """What torch's registry keeps while jitattn is active; remove() gives aten its kernels back."""

    library: object | None

    def remove(self) -> None:
        library, self.library = self.library, None
        if library is not None and hasattr(library, "_destroy"):
            library._destroy()


def _original_kernel(op_name: str, dispatch_key: str):
    try:
        return torch.library.get_kernel(f"aten::{op_name}", dispatch_key)
    except RuntimeError:  # no kernel for this key
        return None


def install(dispatch_key: str = "CUDA") -> ProviderHandle:
    """Override torch's flash ops for `dispatch_key` with jitattn's kernels; the registry's
    register_fn (use `activate()`, or torch's `activate_flash_attention_impl("jitattn")`, which
    first undo any other provider). Ops this torch lacks are skipped."""
    if not hasattr(torch.library, "get_kernel"):
        raise RuntimeError(f"jitattn's flash-attention provider needs torch.library.get_kernel (torch >= 2.11), "
                           f"this is torch {torch.__version__}")
    library = torch.library.Library("aten", "IMPL", dispatch_key)
    for op_name in OVERRIDDEN_OPS:
        if not hasattr(torch.ops.aten, op_name):
            continue
        original = _original_kernel(op_name, dispatch_key)
        library.impl(op_name, dispatching_kernel(op_name, original), dispatch_key, with_keyset=True)
    return ProviderHandle(library)
