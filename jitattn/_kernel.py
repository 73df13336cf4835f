"""A loaded kernel module as the API functions use it: its launch op and its wave size."""
from __future__ import annotations

import torch


class LoadedKernel:
    """A module's `run` op (an OpOverload: no overload resolution per call) and, per device, how
    many of its CTAs fill one wave (SMs x CTAs resident per SM, from the kernel's occupancy)."""

    def __init__(self, module):
        self.run = module.ops.run.default
        self._ctas_per_sm = module.ops.ctas_per_sm.default
        self._capacity: dict[int, int] = {}

    def capacity(self, device: torch.device) -> int:
        index = device.index if device.index is not None else torch.cuda.current_device()
        cap = self._capacity.get(index)
        if cap is None:
            sms = torch.cuda.get_device_properties(index).multi_processor_count
            cap = self._capacity[index] = sms * int(self._ctas_per_sm(index))
        return cap
