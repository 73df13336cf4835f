"""The varlen kernel family: jitattn.varlen_attn / varlen_attn_out / AuxRequest (torch's API).

api (the public functions), forward (validate -> plan -> module -> launch), spec (VarlenSpec),
plan (tile shape, KV splits), checks (argument validation), ops (the torch.library custom ops)
and backward (the autograd formula). The API is imported on first use, so finding the family's
spec (jitattn.jit.registry) does not import torch.
"""

_PUBLIC = {"varlen_attn": "jitattn.varlen.api", "varlen_attn_out": "jitattn.varlen.api",
           "AuxRequest": "jitattn.varlen.checks"}


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'jitattn.varlen' has no attribute {name!r}")
