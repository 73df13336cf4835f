"""A first varlen_attn call that needs grad pays no import of torch._dynamo, sympy or FSDP (CPU).

The custom op's first call through the torch.library dispatcher imports them (torch's
`_disable_dynamo` around every custom-op kernel): seconds a trainer that never compiles should
not pay (issue 47, notes/first-call.md). Eager calls with grad go through a plain
autograd.Function (jitattn/varlen/backward.py EagerVarlenAttn). Here a forward and backward run
on CPU tensors through stand-in launches; the path around them is the one a GPU call takes.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
HEAVY = ("torch._dynamo", "sympy", "torch.distributed.fsdp")

FIRST_CALL = """
import json, sys, time, torch, jitattn
import jitattn.checks as checks, jitattn.varlen.api as api, jitattn.varlen.backward_launch as launch
# No GPU here: the device check accepts CPU tensors and the launches are stand-ins of the right shapes;
# what is measured is the path around them (autograd wiring, dispatch), as a GPU call takes it.
checks.cuda_device = lambda named: next(iter(named.values())).device
api.forward = lambda call, remember_as=None: (call.query.detach() * 1.0,
                                               torch.zeros(call.query.shape[1], call.query.shape[0]))
launch.backward = lambda g, gl, q, k, v, *rest, **kw: (torch.ones_like(q), torch.ones_like(k), torch.ones_like(v))
q = torch.randn(16, 2, 64, dtype=torch.float16, requires_grad=True)
cu = torch.tensor([0, 16], dtype=torch.int32)
start = time.perf_counter()
out = jitattn.varlen_attn(q, q, q, cu, cu, 16, 16)
out.float().sum().backward()
print(json.dumps({"grad": float(q.grad.float().sum()), "seconds": time.perf_counter() - start,
                  "imported": [m for m in %r if m in sys.modules]}))
""" % (HEAVY,)


def test_a_first_call_with_grad_imports_no_dynamo_sympy_or_fsdp():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", FIRST_CALL], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["grad"] == 3 * 16 * 2 * 64  # dq + dk + dv of the stand-in backward all reached q
    assert result["imported"] == []
