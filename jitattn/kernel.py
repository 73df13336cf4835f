"""A loaded kernel module as a family's API uses it: its wave size per device, and its `run` op."""
from __future__ import annotations

import torch


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
