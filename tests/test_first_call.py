"""What a first call in a new process pays for (CPU): no custom-op registration, no torch._dynamo,
and the ops still there for torch.compile (registered at trace time) and for callers that ask."""
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from jitattn import lazy_ops

REPO = Path(__file__).resolve().parent.parent

IMPORTS = """
import json, sys, torch
import jitattn.decode.api, jitattn.varlen.api
ns = torch.ops.jitattn
print(json.dumps({"dynamo": "torch._dynamo" in sys.modules, "decode_op": hasattr(ns, "single_decode_with_kv_cache"),
                  "varlen_op": hasattr(ns, "varlen_attn"), "varlen_ops_module": "jitattn.varlen.ops" in sys.modules}))
jitattn.decode.api.ops_registered(); jitattn.varlen.api.ops_registered()
print(json.dumps({"decode_op": hasattr(ns, "single_decode_with_kv_cache"), "varlen_op": hasattr(ns, "varlen_attn"),
                  "varlen_out_op": hasattr(ns, "varlen_attn_out"), "backward_op": hasattr(ns, "varlen_attn_backward")}))
"""


def test_importing_the_apis_registers_no_op_and_imports_no_dynamo():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", IMPORTS], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    before, after = (json.loads(line) for line in out.stdout.strip().splitlines()[-2:])
    assert before == {"dynamo": False, "decode_op": False, "varlen_op": False, "varlen_ops_module": False}
    assert after == {"decode_op": True, "varlen_op": True, "varlen_out_op": True, "backward_op": True}


def test_the_trace_time_marker_is_what_torch_sets():
    """jitattn.lazy_ops marks functions as torch.compiler.assume_constant_result does, without
    importing torch._dynamo: if torch renames the marker, this fails (and the compile tests)."""
    def fn():
        return True

    marked = torch.compiler.assume_constant_result(lambda: True)
    assert getattr(marked, lazy_ops.MARKER) is True
    assert getattr(lazy_ops.trace_time_constant(fn), lazy_ops.MARKER) is True


def test_a_compiled_decode_call_registers_its_op_at_trace_time():
    """fullgraph: the compiled call reaches the op (whose CPU run then refuses CPU tensors)."""
    code = """
import sys, torch, jitattn
q = torch.randn(4, 64, dtype=torch.float16); k = torch.randn(10, 4, 64, dtype=torch.float16)
f = torch.compile(lambda q, k: jitattn.single_decode_with_kv_cache(q, k, k) + 1, fullgraph=True)
try:
    f(q, k)
except Exception as exc:
    print(type(exc).__name__, exc)
print(hasattr(torch.ops.jitattn, "single_decode_with_kv_cache"))
"""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert "q must be a CUDA tensor" in lines[-2] and lines[-1] == "True", out.stdout + out.stderr
