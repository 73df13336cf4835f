"""A loaded kernel module as a family's API uses it (its wave size per device, its `run` op), and
the per-call memos that keep the warm path to a dictionary lookup."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

_MEMOS: list[dict] = []


def call_memo() -> dict:
    """A new memo of work a call does once per shape or device (its loaded kernel, its device's
    arch), registered so that `fresh_memos` can empty it."""
    memo: dict = {}
    _MEMOS.append(memo)
    return memo


@contextlib.contextmanager
def fresh_memos() -> Iterator[None]:
    """Within the block every call memo starts empty, so calls look up their kernel and device
    again (tests that stand in for the loader or the GPU); after it, the memos hold what they held."""
    saved = [dict(memo) for memo in _MEMOS]
    for memo in _MEMOS:
        memo.clear()
    try:
        yield
    finally:
        for memo, before in zip(_MEMOS, saved):
            memo.clear()
            memo.update(before)


class LoadedKernel:
    """Per device, how many of a module's CTAs fill one wave (SMs x CTAs resident per SM, from
    the kernel's occupancy: its `ctas_per_sm` op, asked once per device)."""

    def __init__(self, module):
        self._ctas_per_sm = module.ops.ctas_per_sm.default
        self._capacity: dict[int, int] = {}

    def capacity(self, device: torch.device) -> int:
        index = device.index if device.index is not None else torch.cuda.current_device()
        cap = self._capacity.get(index)
        if cap is None:
            sms = torch.cuda.get_device_properties(index).multi_processor_count
            cap = self._capacity[index] = sms * int(self._ctas_per_sm(index))
        return cap


class OpKernel(LoadedKernel):
    """A module launched through its `run` op (an OpOverload: no overload resolution per call)."""

    def __init__(self, module):
        super().__init__(module)
        self.run = module.ops.run.default
