"""One varlen_attn forward: a checked call (VarlenCall) -> its spec (VarlenSpec.for_call) -> module
-> launch, shared by the eager call and the ops."""
from __future__ import annotations

import torch

from jitattn import checks as check
from jitattn.jit import env
from jitattn.jit.loader import get_module
from jitattn.kernel import OpKernel, call_memo
from jitattn.variants.window import lower_window
from jitattn.varlen import overrides
from jitattn.varlen.checks import VarlenCall, check_varlen_values
from jitattn.varlen.plan import (DECODE_ROWS, MAX_SPLITS, MIN_SPLIT_TILES, SHORT_KEYS, SHORT_ROWS, auto_splits,
                                 is_hopper)
from jitattn.varlen.spec import VarlenSpec, mask_map_flag, mask_map_layout

LOG2E = 1.4426950408889634

# (the call facts VarlenSpec.for_call reads, the override state) -> (loaded kernel, BLOCK_M,
# BLOCK_N): the warm path is this one lookup
_kernels: dict[tuple, tuple[OpKernel, int, int]] = call_memo()


def captures_of(score_mod, mask_mod) -> tuple:
    """The captured tensors the kernels take after their fixed arguments: the score_mod's slots,
    then the mask_mod's (hooks.cuh)."""
    if score_mod is None and mask_mod is None:
        return ()
    return (score_mod.tensors if score_mod else ()) + (mask_mod.tensors if mask_mod else ())


def forward(call: VarlenCall) -> tuple[torch.Tensor, torch.Tensor]:
    """Plan and launch a checked call. Returns (out, lse); lse is (0, T_q) unless the call asked for it."""
    args = call  # the checked sizes (VarlenArgs' fields) are the call's own
    query, key, max_q = call.query, call.key, call.max_q
    debug = env.debug() and not torch.cuda.is_current_stream_capturing()
    if debug:  # reads the metadata back: a sync, so only when asked for
        check_varlen_values(query, key, call.cu_seq_q, call.cu_seq_k, max_q, call.max_k, seqused_k=call.seqused_k,
                            block_table=call.block_table)

    group = args.num_heads_q // args.num_heads_kv
    hopper = is_hopper(args.device)
    # for_call's arguments in its order (head_dim, dtype, paged, soft cap, few rows, one split,
    # sm_90, JITATTN_WGMMA there, short), then the override state
    # (and the variants' canonical texts)
    score_mod = call.score_mod
    # A mask_mod that is a window runs as the built-in window (jitattn/variants/window.py).
    mask_mod, window_left, window_right = lower_window(call.mask_mod, args.window_left, args.window_right,
                                                       env.lower_mask_windows())
    variants = (score_mod.key_text if score_mod else "", mask_mod.key_text if mask_mod else "")
    facts = (args.head_dim, query.dtype, args.paged, args.softcap > 0, max_q * group <= DECODE_ROWS,
             args.num_splits == 1, hopper, hopper and env.wgmma_enabled(),
             max_q * group <= SHORT_ROWS and call.max_k <= SHORT_KEYS, overrides.state(), variants)
    entry = _kernels.get(facts)
    if entry is None:
        spec = VarlenSpec.for_call(facts[0], check.DTYPE_NAMES[query.dtype], *facts[2:9], score_mod=variants[0],
                                   mask_mod=variants[1])
        entry = _kernels[facts] = (OpKernel(get_module(spec)), spec.block_m, spec.block_n, mask_map_layout(spec))
    kernel, block_m, tile_n, map_layout = entry
    m_blocks = -(-max_q * group // block_m)
    # Explicit splits: every row block takes that many. Automatic: the grid has room for
    # `splits`, and each block takes as many of them as its own keys fill (counted on the device).
    splits, min_tiles = args.num_splits, 0
    if splits is None:
        ctas = m_blocks * args.num_seqs * args.num_heads_kv
        splits, min_tiles = auto_splits(ctas, call.max_k, tile_n, kernel.capacity(args.device)), MIN_SPLIT_TILES
    splits = min(splits, MAX_SPLITS)

    out = call.out
    if out is None and query.stride() != (query.shape[1] * args.head_dim, args.head_dim, 1):
        # The output takes the query's layout, as torch's does (`torch.empty_like(query)`, also in
        # the fake kernel). A query with those strides gets them from the binding's allocation.
        out = torch.empty_like(query)
    query, key, value = check.vectors_ready(query, key, call.value)
    metadata = [t if t is None or t.is_contiguous() else t.contiguous()
                for t in (call.cu_seq_q, call.cu_seq_k, call.seqused_k)]
    block_table = call.block_table
    if block_table is not None and block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    # The kernel writes 16-byte rows: an `out` it cannot (odd strides or alignment) gets the
    # result copied in.
    target = out
    if out is not None and check.vector_ready(out) is not out:
        target = None
    bad_page = torch.zeros(3, dtype=torch.int32, device=args.device) if debug and args.paged else None
    result, lse = kernel.run(query, key, value, metadata[0], metadata[1], metadata[2], block_table, target,
                             bad_page, group, m_blocks, splits, min_tiles, window_left, window_right,
                             args.scale * LOG2E, args.softcap, args.return_lse,
                             *mask_map_flag(map_layout, call.max_k, tile_n, args.num_seqs * m_blocks, args.num_heads_kv),
                             *captures_of(score_mod, mask_mod))
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
