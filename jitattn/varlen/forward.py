"""One varlen_attn forward: validate -> plan -> module -> launch (shared by the eager call and the ops)."""
from __future__ import annotations

import torch

from jitattn import checks as check
from jitattn.jit import env
from jitattn.jit.loader import get_module
from jitattn.kernel import OpKernel
from jitattn.varlen.checks import check_varlen_args, check_varlen_values
from jitattn.varlen.plan import MAX_SPLITS, MIN_SPLIT_TILES, auto_splits, is_hopper, tile_kind
from jitattn.varlen import spec as spec_module
from jitattn.varlen.spec import VarlenSpec

LOG2E = 1.4426950408889634

# Bound once, so tools that swap VarlenSpec for a maker (tools/fwd_schedule.py) keep it.
_takes_tma = VarlenSpec.takes_tma
_takes_split_kv = VarlenSpec.takes_split_kv
_takes_persistent = VarlenSpec.takes_persistent

# kernel_key(...) -> (loaded kernel, BLOCK_M, BLOCK_N): the per-call fast path
_kernels: dict[tuple, tuple[OpKernel, int, int]] = {}


def call_spec(head_dim: int, dtype: str, paged: bool, decode: bool, wgmma: bool, soft_cap: bool,
              decode_hopper: bool = False) -> VarlenSpec:
    """The specialization a call of that shape runs: its tile, and the copies and barriers that
    measured faster there (VarlenSpec.takes_tma, takes_split_kv, takes_persistent). The manifests
    list these."""
    tma = _takes_tma(head_dim, paged, decode, wgmma, wgmma or decode_hopper)
    return VarlenSpec(head_dim, dtype, paged, decode, wgmma=wgmma, soft_cap=soft_cap, tma=tma,
                      split_kv=_takes_split_kv(head_dim, wgmma, tma),
                      persistent=_takes_persistent(head_dim, decode, wgmma, tma))


def kernel_key(head_dim: int, dtype: torch.dtype, paged: bool, decode: bool, wgmma: bool, soft_cap: bool,
               decode_hopper: bool = False) -> tuple:
    """The key of _kernels (tools and tests that swap in a tile build it here). decode_hopper: a
    decode call on sm_90 while DECODE_TMA is on, whose tile then copies by TMA, so a process that
    drives another GPU as well keeps both kernels apart."""
    return (head_dim, dtype, paged, decode, wgmma, soft_cap, decode_hopper)


def forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale, window_size, enable_gqa,
            seqused_k, block_table, num_splits, return_aux, out=None,
            softcap=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate, plan, launch. Returns (out, lse); lse is (0, T_q) unless return_aux asks for it."""
    args = check_varlen_args(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                             window_size=window_size, enable_gqa=enable_gqa, seqused_k=seqused_k,
                             block_table=block_table, num_splits=num_splits, out=out, return_aux=return_aux,
                             softcap=softcap)
    debug = env.debug() and not torch.cuda.is_current_stream_capturing()
    if debug:  # reads the metadata back: a sync, so only when asked for
        check_varlen_values(query, key, cu_seq_q, cu_seq_k, max_q, max_k, seqused_k=seqused_k,
                            block_table=block_table)

    group = args.num_heads_q // args.num_heads_kv
    decode, wgmma = tile_kind(args.num_splits, max_q, group, args.head_dim, args.device)
    capped = args.softcap > 0
    decode_hopper = decode and spec_module.DECODE_TMA and is_hopper(args.device)  # asked only when on
    memo = kernel_key(args.head_dim, query.dtype, args.paged, decode, wgmma, capped, decode_hopper)
    entry = _kernels.get(memo)
    if entry is None:
        spec = call_spec(args.head_dim, check.DTYPE_NAMES[query.dtype], args.paged, decode, wgmma, capped,
                         decode_hopper)
        entry = _kernels[memo] = (OpKernel(get_module(spec)), spec.block_m, spec.block_n)
    kernel, block_m, tile_n = entry
    m_blocks = -(-max_q * group // block_m)
    # Explicit splits: every row block takes that many. Automatic: the grid has room for
    # `splits`, and each block takes as many of them as its own keys fill (counted on the device).
    splits, min_tiles = args.num_splits, 0
    if splits is None:
        ctas = m_blocks * args.num_seqs * args.num_heads_kv
        splits, min_tiles = auto_splits(ctas, max_k, tile_n, kernel.capacity(args.device)), MIN_SPLIT_TILES
    splits = min(splits, MAX_SPLITS)

    if out is None and query.stride() != (query.shape[1] * args.head_dim, args.head_dim, 1):
        # The output takes the query's layout, as torch's does (`torch.empty_like(query)`, also in
        # the fake kernel). A query with those strides gets them from the binding's allocation.
        out = torch.empty_like(query)
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
                             bad_page, group, m_blocks, splits, min_tiles, args.window_left, args.window_right,
                             args.scale * LOG2E, args.softcap, args.return_lse)
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
