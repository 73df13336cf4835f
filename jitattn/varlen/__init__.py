"""The varlen kernel family: jitattn.varlen_attn / varlen_attn_out / AuxRequest (torch's API).

api (the public functions), checks (argument validation into a VarlenCall), spec (VarlenSpec,
VarlenBackwardSpec and `for_call`, the one rule from a call to its kernel), overrides (the public
override of that rule for benchmarks and tests), plan (device facts, KV splits), forward (spec ->
module -> launch), ops (the torch.library custom ops), backward and backward_launch (the
autograd formula and its kernels). The API is imported on first use, so finding the family's
spec (jitattn.jit.registry) does not import torch.
"""

_PUBLIC = {"varlen_attn": "jitattn.varlen.api", "varlen_attn_out": "jitattn.varlen.api",
           "AuxRequest": "jitattn.varlen.checks"}


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'jitattn.varlen' has no attribute {name!r}")
