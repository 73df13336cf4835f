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
# VarlenKernel.keep's arguments after q, k, v, cu_q, cu_k, used, in order.
KEEP_ARGS = ("pack", "m_blocks", "splits", "split_min_tiles", "left", "right", "scale_log2", "softcap",
             "build_mask_map", "captures", "out_shape")


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

        def keep(self, q, k, v, cu_q, cu_k, used, *rest):
            assert len(rest) == len(KEEP_ARGS), f"VarlenKernel.keep takes {6 + len(KEEP_ARGS)} arguments"
            return StandInKept(self, q, k, v, dict(zip(KEEP_ARGS, rest)))

    class StandInKept:
        """VarlenKernel.keep's KeptLaunch: run() reads the tensors it is given in the kept layouts
        (as the kernel reads their data pointers with the kept strides) and calls `run` with the
        kept arguments."""

        def __init__(self, kernel, q, k, v, kept):
            self.kernel, self.kept = kernel, kept
            self.layouts = [(tuple(t.shape), t.stride()) for t in (q, k, v)]
            self.num_captures = len(kept["captures"])

        def for_keys(self, k, v):
            """KeptLaunch.for_keys: the same launch on keys of these layouts ((size, stride) each)."""
            other = StandInKept.__new__(StandInKept)
            other.kernel, other.kept, other.num_captures = self.kernel, self.kept, self.num_captures
            other.layouts = self.layouts[:1] + [(tuple(size), tuple(stride)) for size, stride in (k, v)]
            return other

        def run(self, q, k, v, cu_q, cu_k, used, captures=()):
            assert len(captures) == self.num_captures
            q, k, v = (t.as_strided(size, stride) for t, (size, stride) in zip((q, k, v), self.layouts))
            kept = self.kept
            out, _ = self.kernel.run(q, k, v, cu_q, cu_k, used, None, None, None, kept["pack"], kept["m_blocks"],
                                     kept["splits"], kept["split_min_tiles"], kept["left"], kept["right"],
                                     kept["scale_log2"], kept["softcap"], False, kept["build_mask_map"],
                                     tuple(captures))
            return out.view(kept["out_shape"])

    module = types.SimpleNamespace(ops=types.SimpleNamespace(
        ctas_per_sm=types.SimpleNamespace(default=lambda device: ctas_per_sm)))
    monkeypatch.setattr(forward, "get_module", lambda spec: module)
    monkeypatch.setattr(forward, "VarlenKernel", StandInKernel)
