"""A stand-in for the compiled varlen forward kernel in CPU tests of the planning around it.

jitattn/varlen/forward.py builds a `VarlenKernel` (jitattn/varlen/launch.py) per spec from the
loaded module; `stand_in_forward_kernels` replaces both the module loader and that class, so a
call reaches the test's `run(spec, *kernel_args)` with VarlenKernel.run's arguments (RUN_ARGS) and
sees a device of `ctas_per_sm` CTAs per SM (the SM count is the test's
torch.cuda.get_device_properties)."""
from __future__ import annotations

import types

from jitattn.kernel import LoadedKernel

# VarlenKernel.run's positional arguments, in order.
RUN_ARGS = ("q", "k", "v", "cu_q", "cu_k", "used", "table", "out", "bad_page", "pack", "m_blocks", "splits",
            "split_min_tiles", "left", "right", "scale_log2", "softcap", "want_lse", "build_mask_map", "captures")


def stand_in_forward_kernels(monkeypatch, run, ctas_per_sm: int = 2) -> None:
    import jitattn.varlen.forward as forward
    from jitattn.varlen.spec import mask_map_layout

    class StandInKernel(LoadedKernel):
        def __init__(self, module, spec):
            super().__init__(module)
            self.spec = spec
            self.mask_map, self.mask_map_per_head = mask_map_layout(spec)  # as VarlenKernel reads them

        def run(self, *args):
            assert len(args) == len(RUN_ARGS), f"VarlenKernel.run takes {len(RUN_ARGS)} arguments, got {len(args)}"
            return run(self.spec, *args)

    module = types.SimpleNamespace(ops=types.SimpleNamespace(
        ctas_per_sm=types.SimpleNamespace(default=lambda device: ctas_per_sm)))
    monkeypatch.setattr(forward, "get_module", lambda spec: module)
    monkeypatch.setattr(forward, "VarlenKernel", StandInKernel)
