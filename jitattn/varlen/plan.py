"""How a varlen_attn call is planned: which tile shape (decode or prefill, wgmma or not) and how
many KV splits."""
from __future__ import annotations

import math

import torch

from jitattn.jit import env
from jitattn.varlen.spec import VarlenSpec

DECODE_ROWS = 16  # decode tile shape: one 16-row MMA tile; used when max_q * group fits in it
MAX_SPLITS = 128  # keep in sync with the template's max_splits
MIN_SPLIT_TILES = 2  # shortest KV split, in key tiles: shorter ones cost more to merge than they gain

_hopper: dict[int | None, bool] = {}  # device index -> sm_90 (the wgmma kernels run there)


def is_hopper(device: torch.device) -> bool:
    hopper = _hopper.get(device.index)
    if hopper is None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        hopper = _hopper[device.index] = torch.cuda.get_device_capability(index) == (9, 0)
    return hopper


def tile_kind(num_splits: int | None, max_q: int, group: int, head_dim: int,
              device: torch.device) -> tuple[bool, bool]:
    """(decode, wgmma): the decode tile shape when every KV head's query rows (max_q x its GQA
    group) fit one 16-row MMA tile; the Hopper rung for prefill on sm_90 unless JITATTN_WGMMA=0.
    num_splits=1 always takes the prefill shape, so nothing about the rest of the batch (its
    max_q) changes how a sequence is computed: bitwise batch invariance."""
    decode = num_splits != 1 and max_q * group <= DECODE_ROWS
    wgmma = VarlenSpec.wgmma_fits(head_dim, decode) and is_hopper(device) and env.wgmma_enabled()
    return decode, wgmma


def auto_splits(ctas: int, max_k: int, tile: int, capacity: int) -> int:
    """num_splits=None: the splits the grid has room for. Split the keys only when the grid is
    short of half a wave of CTAs (decode-shaped batches); then the most splits that fit in half a
    wave, and no more than MIN_SPLIT_TILES-tile chunks of the longest sequence (max_k) can use.
    Half a wave, as for single decode: on the H200 it beat a full wave (fewer partials to merge;
    two CTAs per SM keep enough loads in flight). Prefill grids are far above half a wave, so
    they never split.

    This is only the grid's room: each row block then takes as many of these splits as its own
    key tiles fill, at least MIN_SPLIT_TILES tiles each (the kernel counts them from the
    sequence's own length and window, `block_extent`). A block's own bound never exceeds the
    max_k bound here (its keys are at most max_k), so max_k's slack (a paged call's slot size,
    say) never changes how a sequence is reduced."""
    if ctas == 0:
        return 1
    return max(1, min(capacity // 2 // ctas, math.ceil(max_k / (tile * MIN_SPLIT_TILES)), MAX_SPLITS))
