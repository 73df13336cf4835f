"""A loaded kernel module as a family's API uses it (its wave size per device, its C entry point),
and the per-call memos that keep the warm path to a dictionary lookup."""
from __future__ import annotations

import contextlib
import ctypes
from typing import Iterator

import torch

_MEMOS: list[dict] = []


def call_memo() -> dict:
    """A new memo of work a call does once per shape or device (its loaded kernel, its device's
    arch), registered so that `fresh_memos` can empty it."""
    memo: dict = {}
    _MEMOS.append(memo)
    return memo


def evict_oldest(memo: dict) -> None:
    """Drop a bounded memo's oldest entry. Safe when another thread evicts at the same time (the
    key already gone, or the dict changed between taking its first key and dropping it)."""
    try:
        memo.pop(next(iter(memo)), None)
    except (RuntimeError, StopIteration):
        pass


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


class CEntryKernel(LoadedKernel):
    """A module launched through its C entry point `jitattn_<family>_launch(const Params*)`, called
    through ctypes with the family's packed parameters: a launch whose GPU work is microseconds
    cannot afford a boxed torch op call of twenty arguments (notes/host-time.md). The entry point
    still launches on torch's current stream of the params' device (AOTI shim), so streams and
    CUDA graph capture behave as for a torch op. `params_size`: the bytes Python packs, compared
    with the module's sizeof(Params) on load."""

    def __init__(self, module, family: str, params_size: int):
        super().__init__(module)
        # PyDLL: keeps the GIL for the few microseconds of a launch (no release/reacquire).
        self.library = ctypes.PyDLL(str(module.entry.library))
        self._launch = getattr(self.library, f"jitattn_{family}_launch")
        self._launch.argtypes = [ctypes.c_char_p]
        self._launch.restype = ctypes.c_int
        self._error = getattr(self.library, f"jitattn_{family}_error")
        self._error.restype = ctypes.c_char_p
        size = getattr(self.library, f"jitattn_{family}_params_size")()
        if size != params_size:
            raise RuntimeError(f"{module.entry.path}: its params are {size} bytes but jitattn packs {params_size}: "
                               "the module was built from other templates; rebuild it")

    def call(self, params: bytes) -> None:
        """Launch with packed params; a failure in the entry point comes back as a RuntimeError."""
        if self._launch(params):
            raise RuntimeError(self._error().decode(errors="replace"))
