"""jitattn.flex_attention / create_block_mask / BlockMask: a drop-in for torch's dense FlexAttention
(torch.nn.attention.flex_attention), so a FlexAttention user changes one import (issue 46).

A call packs its (B, H, L, E) batch as B sequences of one `jitattn.varlen_attn` call, with the
user's score_mod / mask_mod as that call's variants. Nothing here imports torch's flex module (its
import alone costs more than a first call): a torch BlockMask or AuxRequest is recognised through
the module the caller already imported. Block sparsity is the kernels' business: they classify
tiles from the traced mask_mod, so a BlockMask is only the mask_mod and the shape it was made for,
and `create_block_mask` costs nothing worth hoisting out of a training step.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import math
import sys
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from jitattn.reference import evaluate_mod
from jitattn.varlen.api import varlen_attn
from jitattn.varlen.checks import AuxRequest

__all__ = ["AuxOutput", "BlockMask", "create_block_mask", "flex_attention"]
_log = logging.getLogger("jitattn")
_TORCH_FLEX = "torch.nn.attention.flex_attention"
# Elements of the dense mask `BlockMask.to_dense` evaluates at once (a memory bound, not a speed one).
DENSE_CHUNK_ELEMENTS = 1 << 24


class AuxOutput(NamedTuple):
    """flex_attention's auxiliary outputs with return_aux, as torch's AuxOutput: lse (B, H, L)
    float32 natural log, or None when not asked for; max_scores is always None (not supported)."""

    lse: torch.Tensor | None = None
    max_scores: torch.Tensor | None = None


@dataclass(frozen=True)
class BlockMask:
    """A mask_mod and the (B, H, Q_LEN, KV_LEN) it was made for: what `create_block_mask` returns.

    torch's BlockMask also stores which blocks are empty, partial or full; jitattn's kernels derive
    that per tile from the traced mask_mod, so this one holds none, and `to_dense()` computes
    torch's dense block layout on demand. B or H of 1 broadcasts over the batch or heads, as torch's.
    mask_mod sees torch's positions: q_idx is the query's row (top-left aligned).
    """

    mask_mod: Callable
    shape: tuple[int, int, int, int]
    BLOCK_SIZE: tuple[int, int]
    device: torch.device

    @property
    def seq_lengths(self) -> tuple[int, int]:
        """(Q_LEN, KV_LEN), as torch's BlockMask."""
        return self.shape[2], self.shape[3]

    def to_dense(self) -> torch.Tensor:
        """torch's dense block layout: int32 (B, H, ceil(Q_LEN / bq), ceil(KV_LEN / bkv)) on the
        mask's device, 1 where any element of the block is visible (torch's to_dense of the same
        create_block_mask). Evaluates mask_mod over every element, a block of query rows at a time."""
        batch, heads, q_len, kv_len = self.shape
        block_q, block_kv = self.BLOCK_SIZE
        q_blocks, kv_blocks = -(-q_len // block_q), -(-kv_len // block_kv)
        dense = torch.zeros(batch, heads, q_blocks, kv_blocks, dtype=torch.int32, device=self.device)
        if q_len == 0 or kv_len == 0:
            return dense
        rows_per_chunk = block_q * max(1, DENSE_CHUNK_ELEMENTS // max(1, heads * block_q * kv_len))
        h = torch.arange(heads, device=self.device).view(-1, 1, 1)
        kv_idx = torch.arange(kv_len, device=self.device).view(1, 1, -1)
        for b in range(batch):
            b_idx = torch.tensor(b, device=self.device)
            for q0 in range(0, q_len, rows_per_chunk):
                q1 = min(q_len, q0 + rows_per_chunk)
                q_idx = torch.arange(q0, q1, device=self.device).view(1, -1, 1)
                visible = evaluate_mod(self.mask_mod, "mask_mod", (b_idx, h, q_idx, kv_idx),
                                       torch.Size([heads, q1 - q0, kv_len]))
                if visible.dtype != torch.bool:
                    raise TypeError(f"mask_mod must return a bool tensor, got {visible.dtype}")
                pad_q, pad_kv = -(q1 - q0) % block_q, -kv_len % block_kv
                visible = torch.nn.functional.pad(visible, (0, pad_kv, 0, pad_q))  # pads with False
                blocks = visible.view(heads, -1, block_q, kv_blocks, block_kv).any(4).any(2)
                dense[b, :, q0 // block_q: q0 // block_q + blocks.shape[1]] = blocks.to(torch.int32)
        return dense

    def numel(self) -> int:
        """B * H * Q_LEN * KV_LEN, as torch's BlockMask."""
        return math.prod(self.shape)

    def sparsity(self) -> float:
        """The percentage of blocks the mask leaves out, as torch's (computed through to_dense)."""
        dense = self.to_dense()
        return 100.0 * (1.0 - dense.sum().item() / max(1, dense.numel()))

    def to(self, device) -> BlockMask:
        """The same mask for another device (where to_dense evaluates it), as torch's BlockMask.to."""
        return dataclasses.replace(self, device=torch.device(device))

    def __str__(self) -> str:
        return f"BlockMask(shape={self.shape}, BLOCK_SIZE={self.BLOCK_SIZE}, mask_mod={_name(self.mask_mod)})"

    __repr__ = __str__


def create_block_mask(mask_mod: Callable, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int,
                      device=None, BLOCK_SIZE: int | tuple[int, int] = 128, _compile: bool = False,
                      **ignored_torch_kwargs) -> BlockMask:
    """torch's create_block_mask (same arguments): a BlockMask of mask_mod for (B, H, Q_LEN, KV_LEN).

    Evaluates nothing: jitattn's kernels find the empty and full tiles from the traced mask_mod
    themselves, so building one per step is free and a mask need not be hoisted for speed. B or H
    None means 1 (broadcast). device None is torch's current accelerator, else the CPU. _compile
    and torch's other keyword arguments (separate_full_blocks, ...) tune torch's block tables, which
    jitattn does not build: accepted and ignored."""
    del _compile
    if ignored_torch_kwargs:
        _log.debug("create_block_mask ignores %s (torch's block-table options)", sorted(ignored_torch_kwargs))
    _check_mod("mask_mod", mask_mod, 4, required=True)
    shape = (_size("B", 1 if B is None else B, 1), _size("H", 1 if H is None else H, 1),
             _size("Q_LEN", Q_LEN, 0), _size("KV_LEN", KV_LEN, 0))
    if isinstance(BLOCK_SIZE, int) and not isinstance(BLOCK_SIZE, bool):
        BLOCK_SIZE = (BLOCK_SIZE, BLOCK_SIZE)
    if not (isinstance(BLOCK_SIZE, tuple) and len(BLOCK_SIZE) == 2):
        raise TypeError(f"BLOCK_SIZE must be an int or a tuple (Q_BLOCK_SIZE, KV_BLOCK_SIZE), got {BLOCK_SIZE!r}")
    block_size = (_size("BLOCK_SIZE", BLOCK_SIZE[0], 1), _size("BLOCK_SIZE", BLOCK_SIZE[1], 1))
    if device is None:
        accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
        device = accelerator or "cpu"
    return BlockMask(mask_mod, shape, block_size, torch.device(device))


def flex_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod: Callable | None = None,
                   block_mask=None, scale: float | None = None, enable_gqa: bool = False,
                   return_lse: bool = False, kernel_options: dict | None = None, *, return_aux=None):
    """torch's flex_attention (same arguments and results) on jitattn's kernels.

    query (B, Hq, L, E), key / value (B, Hkv, S, E) fp16 or bf16 on a CUDA device; score_mod(score,
    b, h, q_idx, kv_idx) and block_mask (jitattn's or torch's BlockMask) as torch defines them:
    q_idx is the query's row, kv_idx the key's. Returns out (B, Hq, L, E), a (B, Hq, L, E) view of
    the packed (B * L, Hq, E) result; with return_lse (out, lse), with return_aux=AuxRequest(lse=True)
    (out, AuxOutput(lse=lse)), lse (B, Hq, L) float32 natural log like torch's. Rows a mask hides
    everywhere give out 0 and lse -inf (torch's as well). Differentiable in query, key, value.
    kernel_options tune torch's Triton kernels: accepted and ignored. Not supported (a clear error):
    max_scores, a value head dim other than E, a key batch other than B or 1.
    """
    batch, heads_q, len_q, _ = _check_4d("query", query, "(B, Hq, L, E)")
    batch_kv, _, len_k, _ = _check_4d("key", key, "(B, Hkv, S, E)")
    value_shape = _check_4d("value", value, "(B, Hkv, S, Ev)")
    _check_flex_args(query, key, value, value_shape, enable_gqa)
    _check_mod("score_mod", score_mod, 5)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    want_lse = return_lse or _wants_lse(return_aux)
    if return_lse and return_aux is not None:
        raise ValueError("give either return_lse or return_aux (return_lse is deprecated in torch), not both")
    _check_kernel_options(kernel_options)
    mask_mod = _mask_of(block_mask, (batch, heads_q, len_q, len_k), query.device)
    if batch_kv != batch:  # (1, Hkv, S, E) keys shared by the whole batch: torch broadcasts them
        key, value = key.expand(batch, -1, -1, -1), value.expand(batch, -1, -1, -1)

    cu_seq_q, cu_seq_k = _cu_seqlens(batch, len_q, len_k, query.device)
    mods = {}
    if score_mod is not None:
        mods["score_mod"] = _top_left(score_mod, len_k - len_q, score=True)
    if mask_mod is not None:
        mods["mask_mod"] = _top_left(mask_mod, len_k - len_q, score=False)
    result = varlen_attn(packed(query), packed(key), packed(value), cu_seq_q, cu_seq_k, len_q, len_k,
                         return_aux=AuxRequest(lse=True) if want_lse else None, scale=scale,
                         enable_gqa=enable_gqa, **mods)
    out, lse = result if want_lse else (result, None)
    out = out.unflatten(0, (batch, len_q)).transpose(1, 2)
    if lse is not None:
        lse = lse.unflatten(1, (batch, len_q)).transpose(0, 1)
    if return_aux is not None:
        return out, _aux_output(lse if want_lse else None)
    return (out, lse) if return_lse else out


def packed(x: torch.Tensor) -> torch.Tensor:
    """(B, H, N, E) as B sequences of N tokens packed (B * N, H, E): a view when the strides allow
    (x is the transpose(1, 2) of a (B, N, H, E) tensor, or H is 1), else a copy."""
    batch, heads, tokens, dim = x.shape
    return x.transpose(1, 2).reshape(batch * tokens, heads, dim)


def _cu_seqlens(batch: int, len_q: int, len_k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 cu_seq_q, cu_seq_k of B equal sequences: made on the device once per (B, L, S, device)
    in eager calls (no per-call allocation, so a call captures into a CUDA graph), in the graph
    under torch.compile (which would trace through the cache anyway)."""
    if torch.compiler.is_compiling():
        return _equal_starts(batch, len_q, len_k, device)
    return _cached_equal_starts(batch, len_q, len_k, device)


def _equal_starts(batch: int, len_q: int, len_k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.arange(batch + 1, dtype=torch.int32, device=device)
    return starts * len_q, starts * len_k


_cached_equal_starts = functools.lru_cache(maxsize=64)(_equal_starts)


def _top_left(fn: Callable, shift: int, score: bool) -> Callable:
    """fn seeing torch's top-left q_idx (the query's row) where varlen_attn passes the bottom-right
    one (row + S - L). A new function per call when S != L (plain arithmetic the tracer sees), so
    a changed closure of the user's function is never hidden behind a cached wrapper."""
    if shift == 0:
        return fn
    if score:
        def score_mod(score, b, h, q_idx, kv_idx):
            return fn(score, b, h, q_idx - shift, kv_idx)
        return score_mod

    def mask_mod(b, h, q_idx, kv_idx):
        return fn(b, h, q_idx - shift, kv_idx)
    return mask_mod


def _mask_of(block_mask, shape: tuple[int, int, int, int], device: torch.device) -> Callable | None:
    """The mask_mod a block_mask (None, jitattn's or torch's BlockMask) stands for, after checking
    it was made for this call's (B, Hq, L, S); None when it hides nothing."""
    if block_mask is None:
        return None
    torch_flex = sys.modules.get(_TORCH_FLEX)
    if torch_flex is not None and isinstance(block_mask, torch_flex.BlockMask):
        return _mask_of_torch(torch_flex, block_mask, shape, device)
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a BlockMask (jitattn.create_block_mask or torch's), "
                        f"got {type(block_mask).__name__}")
    _check_mask_shape(block_mask.shape, shape)
    return block_mask.mask_mod


def _mask_of_torch(torch_flex, block_mask, shape, device) -> Callable | None:
    """torch's BlockMask: its mask_mod, or, when it has none (noop_mask) but leaves blocks out
    (BlockMask.from_kv_blocks), a mask reading its dense block layout (copied to the query's
    device), which is what torch's kernels compute. Only that last kind reads the block tables,
    with one host sync per call (whether any block is left out)."""
    mask_mod = block_mask.mask_mod
    if mask_mod is getattr(torch_flex, "_sliced_mask_mod_error", None):
        raise ValueError("block_mask is a sliced torch BlockMask, whose mask_mod torch replaced by an error: "
                         "build the BlockMask for the full batch")
    if tuple(block_mask.BLOCK_SIZE) == (getattr(torch_flex, "_LARGE_SPARSE_BLOCK_SIZE", None),) * 2:
        return None if mask_mod is torch_flex.noop_mask else mask_mod  # torch's "no block mask"
    _check_mask_shape(tuple(block_mask.shape), shape)
    if mask_mod is not torch_flex.noop_mask:
        return mask_mod
    dense = block_mask.to_dense()
    if bool(dense.all()):
        return None
    visible = dense.bool().expand(shape[0], shape[1], -1, -1).contiguous().to(device)
    block_q, block_kv = block_mask.BLOCK_SIZE

    def block_sparse_mask(b, h, q_idx, kv_idx):
        return visible[b, h, q_idx // block_q, kv_idx // block_kv]
    return block_sparse_mask


def _check_mask_shape(mask_shape: tuple, shape: tuple[int, int, int, int]) -> None:
    names = ("B", "H", "Q_LEN", "KV_LEN")
    for name, have, want in zip(names[:2], mask_shape[:2], shape[:2]):
        if have not in (1, want):
            raise ValueError(f"block_mask was made for {name}={have}, but the call has {name}={want} "
                             f"(a block mask's B and H must equal the call's or be 1)")
    if tuple(mask_shape[2:]) != shape[2:]:
        raise ValueError(f"block_mask was made for (Q_LEN, KV_LEN)={tuple(mask_shape[2:])}, but query and key "
                         f"have (L, S)={shape[2:]}: make it with create_block_mask(..., {shape[2]}, {shape[3]})")


def _check_4d(name: str, t, doc: str) -> tuple[int, int, int, int]:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {doc}, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{name} must have 4 dimensions {doc}, got shape {tuple(t.shape)}")
    return tuple(t.shape)


def _check_flex_args(query, key, value, value_shape, enable_gqa) -> None:
    batch, heads_q, _, head_dim = query.shape
    batch_kv, heads_kv, len_k, key_dim = key.shape
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa must be a bool, got {type(enable_gqa).__name__}")
    for name, t in (("key", key), ("value", value)):
        if t.dtype != query.dtype:
            raise TypeError(f"{name} must have query's dtype {query.dtype}, got {t.dtype}")
        if t.device != query.device:
            raise ValueError(f"{name} must be on query's device {query.device}, got {t.device}")
    if query.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"query must be float16 or bfloat16 (jitattn's kernels), got {query.dtype}")
    if value_shape[:3] != (batch_kv, heads_kv, len_k):
        raise ValueError(f"value must match key's (B, Hkv, S) {(batch_kv, heads_kv, len_k)}, got {value_shape[:3]}")
    if key_dim != head_dim:
        raise ValueError(f"key's head dim E must equal query's ({head_dim}), got {key_dim}")
    if value_shape[3] != head_dim:
        raise ValueError(f"value's head dim Ev must equal query's E ({head_dim}) in jitattn, got {value_shape[3]}")
    if batch_kv not in (batch, 1):
        raise ValueError(f"key and value must have query's batch size {batch} (or 1, shared), got {batch_kv}")
    if heads_q != heads_kv and not enable_gqa:
        raise ValueError(f"query has Hq={heads_q} heads and key/value Hkv={heads_kv}: "
                         f"set enable_gqa=True for grouped-query attention")
    if heads_q % heads_kv:
        raise ValueError(f"query's heads Hq={heads_q} must be a multiple of key/value's Hkv={heads_kv}")


def _check_mod(name: str, fn, positional: int, required: bool = False) -> None:
    """fn is None (unless required) or a callable taking `positional` positional arguments, counted
    as torch counts them (parameters without defaults; from __code__ where there is one, which
    torch.compile can trace, unlike inspect.signature)."""
    if fn is None and not required:
        return
    if not callable(fn):
        raise TypeError(f"{name} must be a callable, got {type(fn).__name__}")
    code = getattr(fn, "__code__", None)
    if code is not None:
        if code.co_flags & inspect.CO_VARARGS:
            return
        count = code.co_argcount - len(getattr(fn, "__defaults__", None) or ()) - inspect.ismethod(fn)
    else:
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            return  # a builtin or C callable: let the call itself tell
        if any(p.kind is p.VAR_POSITIONAL for p in params):
            return
        count = sum(1 for p in params
                    if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    if count != positional:
        signature = "(score, b, h, q_idx, kv_idx)" if positional == 5 else "(b, h, q_idx, kv_idx)"
        raise TypeError(f"{name} must take {positional} arguments {signature}, got one taking {count}")


def _wants_lse(return_aux) -> bool:
    """return_aux (torch's AuxRequest, jitattn.AuxRequest or None): whether lse is asked for."""
    if return_aux is None:
        return False
    if not hasattr(return_aux, "lse"):
        raise TypeError(f"return_aux must be an AuxRequest or None, got {type(return_aux).__name__}")
    if getattr(return_aux, "max_scores", False):
        raise ValueError("return_aux=AuxRequest(max_scores=True): jitattn.flex_attention does not return the "
                         "row maxima (its kernels keep them in registers); ask for lse only")
    return bool(return_aux.lse)


def _aux_output(lse: torch.Tensor | None):
    """torch's AuxOutput when the caller has torch's flex module loaded, else jitattn's (same fields)."""
    torch_flex = sys.modules.get(_TORCH_FLEX)
    kind = getattr(torch_flex, "AuxOutput", AuxOutput) if torch_flex is not None else AuxOutput
    return kind(lse=lse, max_scores=None)


def _check_kernel_options(kernel_options) -> None:
    if kernel_options is None:
        return
    if not isinstance(kernel_options, dict):
        raise TypeError(f"kernel_options must be a dict or None, got {type(kernel_options).__name__}")
    if kernel_options:
        _log.debug("flex_attention ignores kernel_options %s (torch's Triton kernel settings)", sorted(kernel_options))


def _size(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _name(fn) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__

