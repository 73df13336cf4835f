"""The L2's fp32 reduction rate by access pattern (tools/dq_reduce_bench.cu), which bounds the D256
backward's dQ adds (notes/backward-d256.md). Builds the .cu with nvcc into /tmp on first use.

    python3 tools/dq_reduce_bench.py [--modes 0 1 2 3 4 5 6] [--ctas 132]
"""
import argparse
import ctypes
import os
import subprocess

import torch

NAMES = ["red.v4, fragments (16 rows x 32 B an instruction)", "red.v4, 8 rows x 64 B", "red.v4, 4 rows x 128 B",
         "scalar red.f32, fragments", "bulk reduce-add, 16 KB from shared memory", "plain st.v4 (no reduction)",
         "scalar red.f32, 32 consecutive floats"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--modes", type=int, nargs="*", default=list(range(7)))
    parser.add_argument("--ctas", type=int, default=132)
    args = parser.parse_args()
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dq_reduce_bench.cu")
    lib_path = "/tmp/dq_reduce_bench.so"
    if not os.path.exists(lib_path) or os.path.getmtime(lib_path) < os.path.getmtime(src):
        nvcc = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
        subprocess.run([nvcc, "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-shared", "-Xcompiler", "-fPIC", src,
                        "-o", lib_path], check=True)
    lib = ctypes.CDLL(lib_path)
    lib.run.restype = ctypes.c_float
    lib.run.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    acc = torch.zeros(128 * 4096 * 256, device="cuda", dtype=torch.float32)  # 512 MB: 128 (sequence, head) x 4096 rows
    steps = 128
    for mode in args.modes:
        ms = lib.run(acc.data_ptr(), mode, args.ctas, steps, 128, 5)
        print(f"mode {mode} {NAMES[mode]:48s} {ms:8.3f} ms {args.ctas * steps * 64 * 256 * 4 / ms / 1e9:6.2f} TB/s")


if __name__ == "__main__":
    main()
