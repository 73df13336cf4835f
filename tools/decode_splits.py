"""Is a decode-shaped varlen call's automatic KV split worth its second launch? (tuning aid)

A transformers decode step calls varlen_attn once per layer with one query row per sequence.
With few sequences the grid is short of half a wave, so the keys are split (plan.auto_splits)
and a merge kernel follows: two launches, and a partials workspace, per layer call. At batch 1
generation is host-bound (notes/transformers-host.md), so the second launch's host time is paid
in full, while the split's device gain is small when the cache is short. This prints, per batch
and cache length, the device time and the host time per call with the automatic split and with
num_splits=1, interleaved over rounds (medians):

    PYTHONPATH=. python3 tools/decode_splits.py [--rounds 5] [--batches 1 8] [--keys 128 256 ...]

Shape: transformers' Llama decode call, 16 query / 4 KV heads of 128, bf16, causal (bottom-right).
Device time: CUDA events around 32 back-to-back calls on distinct input sets (a step's layers).
Host time: wall time per call of a loop that synchronizes once (tools/bench_util.py).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import jitattn  # noqa: E402
import jitattn.varlen.forward as forward  # noqa: E402
from bench_util import host_us_per_call, time_us  # noqa: E402

HEADS_Q, HEADS_KV, HEAD_DIM, LAYERS = 16, 4, 128, 32


def layer_inputs(batch: int, keys: int) -> tuple:
    q = torch.randn(batch, HEADS_Q, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch * keys, HEADS_KV, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cu_q = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    cu_k = cu_q * keys
    return q, k, v, cu_q, cu_k


def call(inputs, keys: int, splits):
    q, k, v, cu_q, cu_k = inputs
    return lambda: jitattn.varlen_attn(q, k, v, cu_q, cu_k, 1, keys, window_size=(-1, 0), enable_gqa=True,
                                       num_splits=splits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--keys", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096, 8192])
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, torch {torch.__version__}; {HEADS_Q}/{HEADS_KV} heads of {HEAD_DIM}, bf16, one query a "
          f"sequence; us, median of {args.rounds} interleaved rounds (auto: num_splits=None; one: num_splits=1)")
    print(f"{'batch':>5} {'keys':>6} {'splits':>6} {'dev auto':>9} {'dev one':>8} {'host auto':>10} {'host one':>9}")
    for batch in args.batches:
        for keys in args.keys:
            sets = [layer_inputs(batch, keys) for _ in range(LAYERS)]
            call(sets[0], keys, None)()  # plans, and remembers the plan under the call's warm key
            q, k, v, cu_q, cu_k = sets[0]
            launch = forward.remembered(forward.warm_key(q, k, v, cu_q, cu_k, 1, keys, None, (-1, 0), True, None, None,
                                                         None, None, None, None, None, None))
            rule_splits = launch.splits if launch is not None else "?"
            got = {"dev auto": [], "dev one": [], "host auto": [], "host one": []}
            for _ in range(args.rounds):
                for name, splits in (("auto", None), ("one", 1)):
                    fns = [call(s, keys, splits) for s in sets]
                    got[f"dev {name}"].append(time_us(fns, reps=20, calls=LAYERS))
                    got[f"host {name}"].append(host_us_per_call(fns[0], calls=2000))
            med = {name: statistics.median(t) for name, t in got.items()}
            print(f"{batch:>5} {keys:>6} {rule_splits:>6} {med['dev auto']:>9.2f} {med['dev one']:>8.2f} "
                  f"{med['host auto']:>10.2f} {med['host one']:>9.2f}")


if __name__ == "__main__":
    main()
