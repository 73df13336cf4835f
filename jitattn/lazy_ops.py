"""Custom ops registered on first use: the marker that lets torch.compile trace a call to them.

Registering torch.library ops costs an eager first call milliseconds it never uses them for, so
the APIs register theirs on first use, from a function the compiler runs at trace time rather
than tracing it (`torch.compiler.assume_constant_result`), so the op exists before the call to
it is traced. That decorator imports torch._dynamo (~1 s); `trace_time_constant` sets the same
marker without the import (tests/test_layout.py checks it is what torch sets).
"""
from __future__ import annotations

import sys

# What torch.compiler.assume_constant_result sets on a function (torch/_dynamo/decorators.py).
MARKER = "_dynamo_marked_constant"


def trace_time_constant(fn):
    """torch.compiler.assume_constant_result(fn), without importing torch._dynamo first."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        return dynamo.assume_constant_result(fn)
    setattr(fn, MARKER, True)
    return fn
