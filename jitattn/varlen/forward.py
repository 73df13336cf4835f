"""One varlen_attn forward: a checked call (VarlenCall) -> its spec (VarlenSpec.for_call) -> module
-> launch, shared by the eager call and the ops."""
from __future__ import annotations

from typing import NamedTuple

import torch

from jitattn import checks as check
from jitattn.jit import env
from jitattn.jit.loader import get_module
from jitattn.kernel import call_memo, evict_oldest
from jitattn.variants.tree import Variant
from jitattn.variants.window import lower_window
from jitattn.varlen import overrides
from jitattn.varlen.checks import VarlenCall, check_positions, check_varlen_values
from jitattn.varlen.launch import VarlenKernel
from jitattn.varlen.plan import (DECODE_ROWS, MAX_SPLITS, MIN_SPLIT_TILES, SHORT_KEYS, SHORT_ROWS, auto_splits,
                                 is_hopper)
from jitattn.varlen.spec import VarlenSpec, mask_map_flag

LOG2E = 1.4426950408889634

# (the call facts VarlenSpec.for_call reads, the override state) -> (loaded kernel, BLOCK_M,
# BLOCK_N): the warm path is this one lookup
_kernels: dict[tuple, tuple[VarlenKernel, int, int]] = call_memo()


def captures_of(score_mod, mask_mod) -> tuple:
    """The captured tensors the kernels take after their fixed arguments: the score_mod's slots,
    then the mask_mod's (hooks.cuh)."""
    if score_mod is None and mask_mod is None:
        return ()
    return (score_mod.tensors if score_mod else ()) + (mask_mod.tensors if mask_mod else ())


class KeyRule(NamedTuple):
    """What `plan` derived a Launch's key-length facts from (the split count, the short-call rule,
    the mask map's flag), so a call that differs from a planned one in max_k alone is re-planned
    without its checks (`for_max_k`: a model's decode steps, one key longer each)."""

    tile_n: int
    ctas: int  # CTAs of one split: row blocks x sequences x KV heads
    capacity: int  # CTAs of the kernel in one wave on the call's device
    auto_splits: bool  # num_splits was None
    short_rows: bool  # max_q * group <= SHORT_ROWS: the short-call rule's other half
    short: bool  # the short-call rule's verdict the kernel was chosen with
    map_layout: tuple
    map_units: int  # work units per KV head: sequences x row blocks
    heads_kv: int


class Launch(NamedTuple):
    """Everything a call's launch needs but its tensors: what `plan` derives from a checked
    call's shapes, dtypes, strides, scalars and variants' trees (and the device, the overrides
    and the knobs read per call), so a warm call with the same ones reuses it (`warm_key`)."""

    kernel: VarlenKernel
    group: int
    m_blocks: int
    splits: int
    min_tiles: int
    window_left: int
    window_right: int
    scale_log2: float
    softcap: float
    return_lse: bool
    build_mask_map: bool  # the mask_mod's map is built on the device this call (mask_map.cuh)
    mask_captures: bool  # the mask_mod's tensors go to the kernel (not lowered to a window)
    out_like_query: bool  # out = torch.empty_like(query): the query's layout is not the binding's
    ready: bool  # inputs as given: aligned, contiguous metadata (a warm call may skip the checks)
    key_rule: KeyRule


def plan(call: VarlenCall) -> Launch:
    """The kernel and launch arguments of a checked call (its module loaded or built once)."""
    args = call  # the checked sizes (VarlenArgs' fields) are the call's own
    query, key, max_q = call.query, call.key, call.max_q
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
    short_rows = max_q * group <= SHORT_ROWS
    short = short_rows and call.max_k <= SHORT_KEYS
    facts = (args.head_dim, query.dtype, args.paged, args.softcap > 0, max_q * group <= DECODE_ROWS,
             args.num_splits == 1, hopper, hopper and env.wgmma_enabled(), short, overrides.state(), variants)
    entry = _kernels.get(facts)
    if entry is None:
        spec = VarlenSpec.for_call(facts[0], check.DTYPE_NAMES[query.dtype], *facts[2:9], score_mod=variants[0],
                                   mask_mod=variants[1])
        entry = _kernels[facts] = (VarlenKernel(get_module(spec), spec), spec.block_m, spec.block_n)
    kernel, block_m, tile_n = entry
    map_layout = (kernel.mask_map, kernel.mask_map_per_head)  # read from the spec once, by the kernel
    m_blocks = -(-max_q * group // block_m)
    rule = KeyRule(tile_n, m_blocks * args.num_seqs * args.num_heads_kv, kernel.capacity(args.device),
                   args.num_splits is None, short_rows, short, map_layout, args.num_seqs * m_blocks, args.num_heads_kv)
    splits, min_tiles = _splits(rule, args.num_splits, call.max_k)
    # The output takes the query's layout, as torch's does (`torch.empty_like(query)`, also in
    # the fake kernel). A query with those strides gets them from the binding's allocation.
    out_like_query = query.stride() != (query.shape[1] * args.head_dim, args.head_dim, 1)
    ready = (all(check.reads_in_place(t) for t in (query, key, call.value))
             and all(t is None or t.is_contiguous() for t in (call.cu_seq_q, call.cu_seq_k, call.seqused_k))
             and (call.block_table is None or call.block_table.stride(-1) == 1)
             and (call.out is None or check.reads_in_place(call.out)))
    return Launch(kernel, group, m_blocks, splits, min_tiles, window_left, window_right, args.scale * LOG2E,
                  args.softcap, args.return_lse, _builds_map(rule, call.max_k), mask_mod is not None, out_like_query,
                  ready, rule)


def _splits(rule: KeyRule, num_splits: int | None, max_k: int) -> tuple[int, int]:
    """(splits, split_min_tiles). Explicit: every row block takes that many. Automatic: the grid has
    room for `splits`, and each block takes as many of them as its own keys fill (counted on the device)."""
    if rule.auto_splits:
        return min(auto_splits(rule.ctas, max_k, rule.tile_n, rule.capacity), MAX_SPLITS), MIN_SPLIT_TILES
    return min(num_splits, MAX_SPLITS), 0


def _builds_map(rule: KeyRule, max_k: int) -> bool:
    return any(mask_map_flag(rule.map_layout, max_k, rule.tile_n, rule.map_units, rule.heads_kv))


def for_max_k(launch: Launch, max_k: int) -> Launch | None:
    """`launch` re-planned for a call that differs from its own in max_k alone (and in the key
    tensors' length, which the caller vouches for: `_next_length`, jitattn/integrations/transformers.py),
    or None where another kernel would run (the short-call rule changes its verdict): then the full path."""
    rule = launch.key_rule
    if (rule.short_rows and max_k <= SHORT_KEYS) != rule.short:
        return None
    splits, min_tiles = _splits(rule, launch.splits, max_k)
    build_mask_map = _builds_map(rule, max_k)
    if (splits, min_tiles, build_mask_map) == (launch.splits, launch.min_tiles, launch.build_mask_map):
        return launch  # a decode step's usual case: one key more, the same plan (no _replace per step)
    return launch._replace(splits=splits, min_tiles=min_tiles, build_mask_map=build_mask_map)


def _run(launch: Launch, query, key, value, cu_seq_q, cu_seq_k, seqused_k, block_table, out, bad_page,
         score_mod, mask_mod):
    """The kernel on ready inputs (`out`: None, or one the kernel can write). (out, lse or None)."""
    return launch.kernel.run(query, key, value, cu_seq_q, cu_seq_k, seqused_k, block_table, out, bad_page,
                             launch.group, launch.m_blocks, launch.splits, launch.min_tiles, launch.window_left,
                             launch.window_right, launch.scale_log2, launch.softcap, launch.return_lse,
                             launch.build_mask_map,
                             captures_of(score_mod, mask_mod if launch.mask_captures else None))


def keep_launch(launch: Launch, query, key, value, cu_seq_q, cu_seq_k, seqused_k, mask_mod, out_shape):
    """`launch` on these ready tensors packed once (launch.py's KeptLaunch), for a caller that
    runs it again on tensors of the same layout, or None where a kept launch does not apply (an
    lse asked for, an output laid out like a query the binding's layout does not fit)."""
    if launch.return_lse or launch.out_like_query:
        return None
    return launch.kernel.keep(query, key, value, cu_seq_q, cu_seq_k, seqused_k, launch.group, launch.m_blocks,
                              launch.splits, launch.min_tiles, launch.window_left, launch.window_right,
                              launch.scale_log2, launch.softcap, launch.build_mask_map,
                              captures_of(None, mask_mod if launch.mask_captures else None), out_shape)


def forward(call: VarlenCall, remember_as: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plan and launch a checked call. Returns (out, lse); lse is (0, T_q) unless the call asked for it.
    remember_as: the call's `warm_key`, under which its plan is kept for warm calls (when its
    inputs needed no fixing)."""
    query, key = call.query, call.key
    debug = env.debug() and not torch.cuda.is_current_stream_capturing()
    if debug:  # reads the metadata back: a sync, so only when asked for
        check_varlen_values(query, key, call.cu_seq_q, call.cu_seq_k, call.max_q, call.max_k,
                            seqused_k=call.seqused_k, block_table=call.block_table)
    launch = plan(call)
    if remember_as is not None and launch.ready:
        _remember(remember_as, launch)
        _remember_family(remember_as, call.key, call.value, launch)
    out = call.out
    if out is None and launch.out_like_query:
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
    bad_page = torch.zeros(3, dtype=torch.int32, device=call.device) if debug and call.paged else None
    result, lse = _run(launch, query, key, value, *metadata, block_table, target, bad_page, call.score_mod,
                       call.mask_mod)
    if out is not None and target is None:
        out.copy_(result)
        result = out
    if lse is None:  # not asked for: the ops' schema still returns one
        lse = query.new_empty((0, query.shape[0]), dtype=torch.float32)
    if debug:
        torch.cuda.synchronize(call.device)
        if bad_page is not None and int(bad_page[0]):
            seq, page = int(bad_page[1]), int(bad_page[2])
            raise ValueError(f"block_table[{seq}, {page}] is not a page of the pool (caught on the device): "
                             f"page ids must be in [0, {key.shape[0]})")
    return result, lse


# ------------------------------------------------------------------ warm calls
# A model calls varlen_attn with the same shapes layer after layer: its checks and `plan` depend
# on the tensors' metadata and the scalars alone, so an eager call (no grad) whose key
# was seen before launches at once. The key holds every input the checks and `plan` read
# (notes/host-time.md, "warm calls").
_warm: dict[tuple, Launch] = call_memo()
WARM_ENTRIES = 256


def _meta(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15, t.requires_grad)


def _variant_meta(v):
    if v is None:
        return None
    if not isinstance(v, Variant):
        return False  # a function: traced per call, no key
    return v.key_text, v.kind, tuple(_meta(t) for t in v.tensors)


def warm_key(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size, enable_gqa, seqused_k,
             block_table, num_splits, out, return_aux, softcap, score_mod, mask_mod) -> tuple | None:
    """The memo key of an eager call without grad, or None where it has none (a variant given as
    a function, arguments of types the checks would convert or refuse, debug mode)."""
    if (type(max_q) is not int or type(max_k) is not int or not isinstance(window_size, (tuple, list))
            or not all(isinstance(t, torch.Tensor) for t in (query, key, value, cu_seq_q))
            or not (out is None or isinstance(out, torch.Tensor))
            or env.debug()):
        return None
    variants = (_variant_meta(score_mod), _variant_meta(mask_mod))
    if False in variants:
        return None
    try:
        # Scalars with their types: True == 1 and hash alike, but the checks refuse a bool. (An
        # unhashable scalar makes an unhashable key: warm_forward and forward skip it.)
        return (_meta(query), _meta(key), _meta(value), _meta(cu_seq_q), _meta(cu_seq_k), _meta(seqused_k),
                _meta(block_table), _meta(out), max_q, max_k, _typed(scale), tuple(map(_typed, window_size)),
                _typed(enable_gqa), _typed(num_splits),
                None if return_aux is None else (type(return_aux), _typed(return_aux.lse)), _typed(softcap),
                variants, knobs(), torch.is_grad_enabled())
    except AttributeError:  # not tensors: the checks will say
        return None


def knobs() -> tuple:
    """What a call's plan reads besides its arguments: the env knobs and the spec overrides (part
    of every warm key, so a changed knob plans anew)."""
    return env.lower_mask_windows(), env.wgmma_enabled(), overrides.state()


def _typed(x):
    return type(x), x


def _remember(key: tuple, launch: Launch) -> None:
    try:
        if len(_warm) >= WARM_ENTRIES:
            evict_oldest(_warm)
        _warm[key] = launch
    except TypeError:  # an unhashable key (warm_key): not remembered
        pass


def remembered(key: tuple) -> Launch | None:
    """The plan remembered under a `warm_key`, or None."""
    try:
        return _warm.get(key)
    except TypeError:  # an unhashable scalar: the checks will take the call
        return None


def warm_forward(key: tuple, query, key_, value, cu_seq_q, cu_seq_k, seqused_k, block_table, out, score_mod,
                 mask_mod):
    """(out, lse) of a call whose `warm_key` was remembered, or of its family's (`_next_length`),
    or None (then forward(varlen_call(...), remember_as=key))."""
    launch = remembered(key)
    if launch is None:
        launch = _next_length(key, key_, value, score_mod, mask_mod)
        if launch is None:
            return None
    return run_remembered(launch, query, key_, value, cu_seq_q, cu_seq_k, seqused_k, block_table, out, score_mod,
                          mask_mod)


def run_remembered(launch: Launch, query, key, value, cu_seq_q, cu_seq_k, seqused_k, block_table, out, score_mod,
                   mask_mod):
    """(out, lse or None) of a call with the metadata of the one `launch` was remembered for (the
    caller vouches for that: jitattn/integrations/transformers.py keys its own calls)."""
    if out is None and launch.out_like_query:
        out = torch.empty_like(query)
    return _run(launch, query, key, value, cu_seq_q, cu_seq_k, seqused_k, block_table, out, None, score_mod,
                mask_mod)


# ------------------------------------------------------------------ the next key length
# A decode loop calls with a cache one key longer each step, in a new tensor: a new warm_key at
# every step's first layer. Its family (the warm_key less the key / value rows, their strides and
# max_k) keeps the last launch planned for it, which `for_max_k` re-plans for the new length
# without the checks or `plan` (those checks that read the dropped fields are repeated: rows, key
# and value alike, max_k, a variant's float positions; `ready` is the one fact the strides decide,
# so it is part of the family).
_families: dict[tuple, Launch] = call_memo()
_MAX_ROWS = 2**31 - 1  # the checks' bound on key rows (tokens, or pages of a pool)


def _family(key: tuple, key_, value) -> tuple:
    kv = tuple((t.shape[1:], t.dtype, t.device, t.requires_grad, check.reads_in_place(t)) for t in (key_, value))
    return key[:1] + kv + key[3:9] + key[10:]


def _remember_family(key: tuple, key_, value, launch: Launch) -> None:
    try:
        family = _family(key, key_, value)
        if len(_families) >= WARM_ENTRIES:
            evict_oldest(_families)
        _families[family] = launch
    except TypeError:  # an unhashable key (warm_key)
        pass


def _next_length(key: tuple, key_, value, score_mod, mask_mod) -> Launch | None:
    """The launch of a call whose family was planned at another max_k, re-planned for this one and
    remembered under its own warm_key (the step's other layers); None: the full path (which also
    raises what the checks refuse)."""
    max_q, max_k = key[8], key[9]
    if max_k < 0 or key_.shape[0] > _MAX_ROWS or value.shape[0] != key_.shape[0]:
        return None
    try:
        known = _families.get(_family(key, key_, value))
    except TypeError:
        return None
    if known is None:
        return None
    if score_mod is not None or mask_mod is not None:
        try:
            check_positions(score_mod, mask_mod, max_q, max_k)
        except ValueError:
            return None
    launch = for_max_k(known, max_k)
    if launch is not None:
        _remember(key, launch)
    return launch
