"""What a call costs the host to enqueue, with the GPU idle and with it busy: the varlen backward's parts.

tools/bwd_method.py measured the eager backward's host enqueue at 800-1000 us on the H100 host,
with the GPU sleeping ahead of it (the forward's is 60-170 us, a warm decode layer call's 21 us
with the GPU idle). This times, per call, the wall time of:

- baselines: one small kernel launch (`add_`), a 4-byte cudaMemsetAsync (ctypes, as the persistent
  kernels' work counter is zeroed), torch.zeros(1), a 545 MB torch.empty (the backward's workspace),
  one cuTensorMapEncodeTiled of the backward's 5-D key map (ctypes; the binding encodes six);
- jitattn: the forward without grad, backward_launch.backward (Python planning + the binding),
  and the binding's `run` op alone with the same arguments, at bf16 8 x 4096 x 32 heads x D128
  and at 1 x 256 (does the cost follow the problem's size?).

Each: "idle" = the GPU synchronized before each call; "busy" = the GPU sleeping ~10 ms ahead of
it (the host never waits); median of --reps calls.

    PYTHONPATH=. python3 tools/host_enqueue.py [--reps 15]
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import glob
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import jitattn  # noqa: E402
from jitattn import checks as check  # noqa: E402
from jitattn.jit.loader import get_module  # noqa: E402
from jitattn.varlen import backward_launch  # noqa: E402
from jitattn.varlen.spec import VarlenBackwardSpec, mask_map_flag, mask_map_layout  # noqa: E402
from bench_util import host_enqueue_us  # noqa: E402


def cudart():
    """The CUDA runtime torch loaded (for a bare cudaMemsetAsync), or None."""
    roots = [os.path.dirname(torch.__file__)] + [os.path.join(p, "nvidia") for p in sys.path if p.endswith("-packages")]
    for root in roots:
        for path in sorted(glob.glob(os.path.join(root, "**", "libcudart.so*"), recursive=True)):
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    name = ctypes.util.find_library("cudart")
    return ctypes.CDLL(name) if name else None


def tensor_map_encode(buffer: torch.Tensor):
    """One cuTensorMapEncodeTiled of the backward's 5-D K map shape (64 x T_k x D/64 x 16 x H_kv,
    128-byte swizzle) through the driver, or None where libcuda is not found: the backward's
    binding encodes six maps a call, the forward three or four."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    encode = cuda.cuTensorMapEncodeTiled
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    encode.argtypes = [ctypes.c_void_p, ctypes.c_int, u32, ctypes.c_void_p, ctypes.POINTER(u64), ctypes.POINTER(u64),
                       ctypes.POINTER(u32), ctypes.POINTER(u32), ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    tokens, heads = buffer.shape[0], buffer.shape[1]
    dims = (u64 * 5)(64, tokens, 2, 16, heads)
    strides = (u64 * 4)(heads * 128 * 2, 128, 8 * heads * 128 * 2, 128 * 2)
    box = (u32 * 5)(64, 8, 2, 16, 1)
    unit = (u32 * 5)(1, 1, 1, 1, 1)
    descriptor = ctypes.create_string_buffer(128 + 64)
    at = (ctypes.addressof(descriptor) + 63) // 64 * 64  # CUtensorMap is 64-byte aligned

    def run(descriptor=descriptor):  # held here: the driver writes 128 bytes at `at`, inside it
        # CU_TENSOR_MAP_DATA_TYPE_UINT16 = 1, SWIZZLE_128B = 3, L2_PROMOTION_L2_256B = 3
        status = encode(at, 1, 5, buffer.data_ptr(), dims, strides, box, unit, 0, 3, 3, 0)
        if status != 0:
            raise RuntimeError(f"cuTensorMapEncodeTiled returned {status}")
    return run


def backward_parts(batch: int, seqlen: int, heads: int = 32, head_dim: int = 128) -> dict:
    """{name: fn} of one shape: the forward, backward_launch.backward, and its binding's run op alone."""
    q, k, v = (torch.randn(batch * seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu = torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device="cuda")
    out, lse = jitattn.varlen_attn(q, k, v, cu, cu, seqlen, seqlen, return_aux=jitattn.AuxRequest(lse=True))
    grad = torch.randn_like(out)
    scale = head_dim ** -0.5

    def backward():
        return backward_launch.backward(grad, None, q, k, v, out, lse, cu, cu, None, scale=scale, max_q=seqlen,
                                        max_k=seqlen)

    backward()  # planned and built
    hopper = torch.cuda.get_device_capability() == (9, 0)
    spec = VarlenBackwardSpec.for_call(head_dim, check.DTYPE_NAMES[q.dtype], False, False, hopper,
                                       hopper and backward_launch.wgmma_allowed(q.device), frozenset())  # a full call
    run = get_module(spec).ops.run.default
    layout = mask_map_layout(spec)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    blocks = backward_launch.num_key_blocks(seqlen, spec.block_n)
    extra = (backward_launch.num_key_blocks(seqlen, 128),) if spec.dq_kernel else ()

    def binding():
        run(grad, None, q, k, v, out, lse, cu, cu, None, dq, dk, dv, blocks, -1, -1, scale,
            scale * backward_launch.LOG2E, 0.0, False, *extra,
            *mask_map_flag(layout, seqlen, spec.block_m, batch * blocks, heads))

    return {"varlen_attn, no grad": lambda: jitattn.varlen_attn(q, k, v, cu, cu, seqlen, seqlen),
            "backward_launch.backward": backward, "  its binding's run op alone": binding}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    small = torch.zeros(16, device="cuda")
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    rt = cudart()
    parts = {"add_ (one small launch)": lambda: small.add_(1),
             "torch.zeros(1)": lambda: torch.zeros(1, dtype=torch.int32, device="cuda"),
             "torch.empty 545 MB": lambda: torch.empty(32768 * 32 * 130, dtype=torch.float32, device="cuda")}
    if rt is not None:
        rt.cudaMemsetAsync.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p]
        parts["cudaMemsetAsync 4 bytes"] = lambda: rt.cudaMemsetAsync(
            counter.data_ptr(), 0, 4, torch.cuda.current_stream().cuda_stream)
    keys = torch.empty(32768, 32, 128, device="cuda", dtype=torch.bfloat16)
    encode = tensor_map_encode(keys)
    if encode is not None:
        parts["cuTensorMapEncodeTiled (5-D, ctypes)"] = encode
    for batch, seqlen in ((8, 4096), (1, 256)):
        parts.update({f"{name} ({batch} x {seqlen})": fn for name, fn in backward_parts(batch, seqlen).items()})
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; host us per call, median of {args.reps}")
    print(f"{'call':58s} {'GPU idle':>9s} {'GPU busy':>9s}")
    for name, fn in parts.items():
        idle, busy = host_enqueue_us(fn, args.reps, busy=False), host_enqueue_us(fn, args.reps)
        print(f"{name:58s} {idle:9.1f} {busy:9.1f}")


if __name__ == "__main__":
    main()
