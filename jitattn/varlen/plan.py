"""How a varlen_attn call is planned beyond its spec (VarlenSpec.for_call): the facts the rule
reads from the device, how many KV splits, and the public override of the rule's choice."""
from __future__ import annotations

import math

import torch

from jitattn.kernel import call_memo
from jitattn.varlen.overrides import override_spec  # noqa: F401  (the public override: jitattn/varlen/overrides.py)

DECODE_ROWS = 16  # decode tile shape: one 16-row MMA tile; a call's `few_rows` fact (VarlenSpec.for_call)
# A call's `short` fact (VarlenSpec.for_call): every KV head's query rows and every sequence's keys
# fit one tile of the lockstep wgmma kernel (128 x 64 at D64: an encoder's sentences).
SHORT_ROWS, SHORT_KEYS = 128, 128
MAX_SPLITS = 128  # keep in sync with the template's max_splits
MIN_SPLIT_TILES = 2  # shortest KV split, in key tiles: shorter ones cost more to merge than they gain

_hopper = call_memo()  # device index -> whether it is sm_90 (the wgmma kernels run there)


def is_hopper(device: torch.device) -> bool:
    """Whether `device` is an sm_90 GPU (asked once per device)."""
    hopper = _hopper.get(device.index)
    if hopper is None:
        if device.type != "cuda":
            return False
        index = device.index if device.index is not None else torch.cuda.current_device()
        hopper = _hopper[device.index] = torch.cuda.get_device_capability(index) == (9, 0)
    return hopper


def auto_splits(ctas: int, max_k: int, tile: int, capacity: int) -> int:
    """num_splits=None: the splits the grid has room for. Split the keys only when the grid is
    short of half a wave of CTAs (decode-shaped batches); then the most splits that fit in half a
    wave, and no more than MIN_SPLIT_TILES-tile chunks of the longest sequence (max_k) can use.
    Half a wave, as for single decode (fewer partials to merge; two CTAs per SM keep enough
    loads in flight: notes/decode-h200.md, "full_wave_min_tiles"). Prefill grids are far above
    half a wave, so they never split.

    This is only the grid's room: each row block then takes as many of these splits as its own
    key tiles fill, at least MIN_SPLIT_TILES tiles each (the kernel counts them from the
    sequence's own length and window, `block_extent`). A block's own bound never exceeds the
    max_k bound here (its keys are at most max_k), so max_k's slack (a paged call's slot size,
    say) never changes how a sequence is reduced."""
    if ctas == 0:
        return 1
    return max(1, min(capacity // 2 // ctas, math.ceil(max_k / (tile * MIN_SPLIT_TILES)), MAX_SPLITS))
