"""jitattn.varlen_attn / varlen_attn_out: a drop-in for torch.nn.attention.varlen.

See shared/spec/varlen.md. Reads top-down: the public functions; `forward` (validate -> plan ->
module -> launch), which the eager call and the registered custom op (jitattn.ops) share; the
plan (which tile shape, how many KV splits).

Eager calls skip the torch.library dispatcher (its Python custom-op path costs more than the
whole launch); under torch.compile the public functions call the registered ops instead, which
the compiler treats as opaque and shapes through their fake kernels, and calls that autograd
must record (an input requires grad) go through the op too, as it carries the backward formula.
"""
from __future__ import annotations

import math

import torch

from jitattn import _checks as check
from jitattn._kernel import OpKernel
from jitattn.jit import env
from jitattn.jit.loader import get_module
from jitattn.jit.spec import VarlenSpec
from jitattn.varlen_backward import OUT_NOT_DIFFERENTIABLE, check_differentiable, needs_grad
from jitattn.varlen_checks import AuxRequest, check_varlen_args, check_varlen_values

__all__ = ["AuxRequest", "varlen_attn", "varlen_attn_out"]

LOG2E = 1.4426950408889634
DECODE_ROWS = 16  # decode tile shape: one 16-row MMA tile; used when max_q * group fits in it
MAX_SPLITS = 128  # keep in sync with the template's max_splits
MIN_SPLIT_TILES = 2  # shortest KV split, in key tiles: shorter ones cost more to merge than they gain

# (head_dim, dtype, paged, decode, wgmma) -> (loaded kernel, BLOCK_M, BLOCK_N): the per-call fast path
_kernels: dict[tuple, tuple[OpKernel, int, int]] = {}
_hopper: dict[int | None, bool] = {}  # device index -> sm_90 (the wgmma kernels run there)


def _is_hopper(device: torch.device) -> bool:
    hopper = _hopper.get(device.index)
    if hopper is None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        hopper = _hopper[device.index] = torch.cuda.get_device_capability(index) == (9, 0)
    return hopper


def varlen_attn(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    *,
    return_aux: AuxRequest | None = None,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    num_splits: int | None = None,
):
    """Attention over packed variable-length sequences.

    query (T_q, H_q, D); key/value (T_k, H_kv, D), or with block_table a page pool
    (total_pages, page_size, H_kv, D); cu_seq_q/cu_seq_k int32 (N+1,) sequence starts. Returns
    out (T_q, H_q, D) in query's dtype, or (out, lse) with return_aux=AuxRequest(lse=True), lse
    (H_q, T_q) float32 natural log. Windows are (left, right), bottom-right aligned; -1 is
    unbounded. num_splits=1 makes a sequence's result independent of the rest of the batch.
    Differentiable (query, key, value) unless paged (jitattn/varlen_backward.py).
    """
    want_lse = return_aux is not None and getattr(return_aux, "lse", False) is True
    grad = needs_grad(query, key, value)
    if grad or torch.compiler.is_compiling():
        # The op carries the autograd formula, which needs the lse: asked for whenever grad is.
        if grad:
            check_differentiable(block_table)
        out, lse = torch.ops.jitattn.varlen_attn(
            query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, list(window_size), enable_gqa,
            seqused_k, block_table, num_splits, want_lse or grad)
    else:
        out, lse = forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                           window_size=window_size, enable_gqa=enable_gqa, seqused_k=seqused_k,
                           block_table=block_table, num_splits=num_splits, return_aux=return_aux)
    return (out, lse) if want_lse else out


def varlen_attn_out(
    out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    *,
    return_aux: AuxRequest | None = None,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    num_splits: int | None = None,
):
    """varlen_attn writing into `out` (T_q, H_q, D), query's dtype and device; returns `out`, or
    (out, lse) with return_aux=AuxRequest(lse=True). Rows of `out` outside every sequence are
    left as they were. Not differentiable (as torch's): raises RuntimeError if grad is needed."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor of query's shape (T_q, H_q, D), got {type(out).__name__}")
    if needs_grad(out, query, key, value):
        raise RuntimeError(OUT_NOT_DIFFERENTIABLE)
    want_lse = return_aux is not None and getattr(return_aux, "lse", False) is True
    if torch.compiler.is_compiling():
        lse = torch.ops.jitattn.varlen_attn_out(
            out, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, list(window_size), enable_gqa,
            seqused_k, block_table, num_splits, want_lse)
    else:
        out, lse = forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                           window_size=window_size, enable_gqa=enable_gqa, seqused_k=seqused_k,
                           block_table=block_table, num_splits=num_splits, return_aux=return_aux, out=out)
    return (out, lse) if want_lse else out


def forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale, window_size, enable_gqa,
            seqused_k, block_table, num_splits, return_aux, out=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate, plan, launch. Returns (out, lse); lse is (0, T_q) unless return_aux asks for it."""
    args = check_varlen_args(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                             window_size=window_size, enable_gqa=enable_gqa, seqused_k=seqused_k,
                             block_table=block_table, num_splits=num_splits, out=out, return_aux=return_aux)
    debug = env.debug() and not torch.cuda.is_current_stream_capturing()
    if debug:  # reads the metadata back: a sync, so only when asked for
        check_varlen_values(query, key, cu_seq_q, cu_seq_k, max_q, max_k, seqused_k=seqused_k,
                            block_table=block_table)

    group = args.num_heads_q // args.num_heads_kv
    # num_splits=1 always takes the prefill shape, so nothing about the rest of the batch (its
    # max_q) changes how a sequence is computed: bitwise batch invariance.
    decode = args.num_splits != 1 and max_q * group <= DECODE_ROWS
    wgmma = VarlenSpec.wgmma_fits(args.head_dim, decode) and _is_hopper(args.device) and env.wgmma_enabled()
    kernel_key = (args.head_dim, query.dtype, args.paged, decode, wgmma)
    entry = _kernels.get(kernel_key)
    if entry is None:
        spec = VarlenSpec(args.head_dim, check.DTYPE_NAMES[query.dtype], args.paged, decode, wgmma=wgmma)
        entry = _kernels[kernel_key] = (OpKernel(get_module(spec)), spec.block_m, spec.block_n)
    kernel, block_m, tile_n = entry
    m_blocks = -(-max_q * group // block_m)
    splits = args.num_splits
    if splits is None:
        ctas = m_blocks * args.num_seqs * args.num_heads_kv
        splits = auto_splits(ctas, max_k, tile_n, kernel.capacity(args.device))
    splits = min(splits, MAX_SPLITS)

    query, key, value = check.vectors_ready(query, key, value)
    metadata = [t if t is None or t.is_contiguous() else t.contiguous()
                for t in (cu_seq_q, cu_seq_k, seqused_k)]
    if block_table is not None and block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    # The kernel writes 16-byte rows: an `out` it cannot (odd strides or alignment) gets the
    # result copied in.
    target = out
    if out is not None and check.vector_ready(out) is not out:
        target = None
    bad_page = torch.zeros(3, dtype=torch.int32, device=args.device) if debug and args.paged else None
    result, lse = kernel.run(query, key, value, metadata[0], metadata[1], metadata[2], block_table, target,
                             bad_page, group, m_blocks, splits, args.window_left, args.window_right,
                             args.scale * LOG2E, args.return_lse)
    if out is not None and target is None:
        out.copy_(result)
        result = out
    if debug:
        torch.cuda.synchronize(args.device)
        if bad_page is not None and int(bad_page[0]):
            seq, page = int(bad_page[1]), int(bad_page[2])
            raise ValueError(f"block_table[{seq}, {page}] is not a page of the pool (caught on the device): "
                             f"page ids must be in [0, {key.shape[0]})")
    return result, lse


def auto_splits(ctas: int, max_k: int, tile: int, capacity: int) -> int:
    """num_splits=None: split the keys only when the grid is short of half a wave of CTAs
    (decode-shaped batches); then the most splits that fit in half a wave, none shorter than
    MIN_SPLIT_TILES tiles of the longest sequence. Half a wave, as for single decode: on the H200
    it beat a full wave (fewer partials to merge; two CTAs per SM keep enough loads in flight).
    Prefill grids are far above half a wave, so they never split."""
    if ctas == 0:
        return 1
    return max(1, min(capacity // 2 // ctas, math.ceil(max_k / (tile * MIN_SPLIT_TILES)), MAX_SPLITS))


import jitattn.ops  # noqa: E402,F401  (registers the custom ops; imports this module back)
