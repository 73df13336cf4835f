"""The wgmma prefill forward's GEMM schedules (VarlenSpec pingpong / overlap) side by side.

As a benchmark: bf16 8 x 4096 tokens, D*H = 2048, causal and full, each schedule of the kernels
with a producer warpgroup (D128, D256, and D64 since its TMA kernel has one) beside SDPA in the
same run, after a float64-reference check of each schedule on a ragged causal / windowed / GQA /
paged batch. The schedules and SDPA are timed in interleaved rounds (the clocks drift over a job
by as much as the differences being judged), each cell the median with the rounds' min-max.
  python tools/fwd_schedule.py [--quick] [--head-dims 64 128 256] [--rounds 3]
Variants (--schedules) are "none", "pingpong", "overlap", "pingpong,overlap", "default", each
optionally for one head_dim, with the flags split_kv, tma and persistent, and with tile fields:
"d128:block_n=96,stages=4,pingpong", "d256:block_n=80,stages=2,tma,split_kv". Every variant but
"default" turns off what it does not name (so "none" at D256 is the call's 80 x 2 tile without
split_kv, and "d128:tma" the D128 kernel a CTA per row block); --packed-only skips the paged
checks for tiles the paged TMA producer cannot take.
As a pytest plugin: FWD_SCHEDULE=<variant> python -m
pytest -p fwd_schedule ... (tools/ on sys.path) runs every call on that schedule instead of the
spec's default, so the GPU tests cover a schedule before it becomes one; variants for several
head dims go separated by ";" (FWD_SCHEDULE="d64:tma,persistent;d128:tma,persistent").
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

def parse(variant: str) -> tuple[int | None, dict]:
    """"pingpong,overlap" / "none" / "default", optionally "d128:" first and tile fields
    ("d128:block_n=96,stages=4,pingpong"): (head_dim it is for or None, VarlenSpec overrides)."""
    head_dim, _, fields = variant.rpartition(":")
    overrides = ({"pingpong": False, "overlap": False, "split_kv": False, "persistent": False}
                 if fields != "default" else {})
    for item in fields.split(","):
        if item in ("pingpong", "overlap", "split_kv", "tma", "persistent"):
            overrides[item] = True
        elif "=" in item:
            name, value = item.split("=")
            overrides[name] = int(value)
    return (int(head_dim[1:]) if head_dim else None), overrides


_schedule = contextlib.ExitStack()  # the overrides use_schedule entered last


def use_schedule(variant: str) -> None:
    """Every later varlen call runs the wgmma kernels with producer as `variant` says (parse);
    several variants, each for its own head_dim, go separated by ";" ("d64:tma,persistent;d128:...").
    Each is a public override (jitattn.varlen.plan.override_spec) of the call's spec that keeps
    the call's tile unless the variant names tile fields."""
    from jitattn.varlen.plan import override_spec
    from jitattn.varlen.spec import VarlenSpec

    global _schedule
    _schedule.close()
    _schedule = contextlib.ExitStack()
    by_head_dim = dict(parse(v) for v in variant.split(";"))
    for head_dim in (64, 128, 192, 256):
        fields = by_head_dim.get(head_dim, by_head_dim.get(None))
        call = VarlenSpec.for_call(head_dim, "bfloat16", False, False, False, False, True, True)  # packed prefill, sm_90
        if not fields or not call.has_producer:
            continue
        tile = {name: getattr(call, name) for name in ("warps_m", "m_tiles", "block_n", "stages")}
        _schedule.enter_context(override_spec("varlen", when={"head_dim": head_dim, "wgmma": True, "decode": False},
                                              **{**tile, **fields}))


def pytest_configure(config):
    name = os.environ.get("FWD_SCHEDULE")
    if name:
        use_schedule(name)


def check_schedule(head_dim: int, paged: bool = True) -> float:
    """Worst relative error against the float64 reference over a few batches that reach every
    path the schedule changes: first/last tiles, masked edges, empty sequences, paging, GQA."""
    import torch

    from tests.varlen_utils import check, make_batch, reference, run

    worst = 0.0
    cases = [([1, 77, 300, 1024, 0, 513], [1, 77, 300, 1024, 5, 700], 8, 8, False, (-1, 0), None),
             ([256, 1000, 64], [256, 1500, 64], 8, 2, True, (128, 0), None),
             ([900, 33], [900, 2000], 16, 2, True, (-1, -1), 2),
             ([640, 1], [640, 4096], 8, 8, False, (37, 11), 1)]
    for i, (len_q, len_k, h_q, h_kv, paged_case, window, splits) in enumerate(cases):
        if paged_case and not paged:
            continue
        b = make_batch(len_q, len_k, h_q, h_kv, head_dim, torch.bfloat16, seed=i, paged=paged_case, page_size=16)
        out, lse = run(b, window=window, num_splits=splits, want_lse=True)
        ref = reference(b, window)
        check(b, out, lse, ref, f"d{head_dim} case {i}")  # raises on a wrong row
        err = ((out.double() - ref[0]).nan_to_num().norm() / ref[0].nan_to_num().norm().clamp_min(1e-30)).item()
        worst = max(worst, err)
    return worst


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--schedules", nargs="+", default=["none", "pingpong", "overlap", "pingpong,overlap"])
    parser.add_argument("--packed-only", action="store_true",
                        help="check packed keys only: for tiles the paged TMA producer cannot take (block_n > 128)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (bench_util.interleaved_us)")
    parser.add_argument("--shapes", nargs="+", default=["8x4096"],
                        help="sequences x tokens each (same tokens: 32x1024 weighs a CTA's start and end more)")
    args = parser.parse_args()
    reps = 10 if args.quick else 30
    for name in args.schedules:
        use_schedule(name)
        for d in args.head_dims:
            if parse(name)[0] not in (None, d):
                continue
            try:
                print(f"check {name} d{d}: ok, worst rel err {check_schedule(d, not args.packed_only):.2e}", flush=True)
            except AssertionError as exc:
                print(f"check {name} d{d}: FAILED {str(exc)[:300]}", flush=True)
    for shape in args.shapes:
        batch, seq = (int(x) for x in shape.split("x"))
        bench_shape(args, reps, batch, seq)
    use_schedule("default")


def bench_shape(args, reps: int, batch: int, seq: int):
    import torch
    import torch.nn.functional as F

    import jitattn
    from bench_util import interleaved_us, median_spread, sets_needed, time_us

    bf16 = torch.bfloat16
    cu_seq = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device="cuda")
    print(f"\n{batch} x {seq} tokens, TFLOP/s, the median over {args.rounds} interleaved rounds (min-max over rounds "
          "in brackets)")
    print("\n| D | causal | " + " | ".join(f"{n} TFLOP/s" for n in args.schedules) + " | SDPA TFLOP/s | best / SDPA |")
    print("|---:|---|" + "---:|" * (len(args.schedules) + 2))
    for head_dim in args.head_dims:
        heads, tokens = 2048 // head_dim, batch * seq
        sets = []
        for _ in range(sets_needed(4 * tokens * heads * head_dim * 2)):
            q, k, v = (torch.randn(tokens, heads, head_dim, device="cuda", dtype=bf16) for _ in range(3))
            sets.append((q, k, v, [t.view(batch, seq, heads, head_dim).transpose(1, 2).contiguous() for t in (q, k, v)]))
        for causal in (False, True):
            window = (-1, 0) if causal else (-1, -1)
            flops = batch * 4 * seq * seq * head_dim * heads * (0.5 if causal else 1.0)
            fns = [lambda s=s: jitattn.varlen_attn(s[0], s[1], s[2], cu_seq, cu_seq, seq, seq, window_size=window)
                   for s in sets]

            def timer(name):
                def run():
                    use_schedule(name)
                    return time_us(fns, warmup=5, reps=reps)
                return run
            timers = {name: timer(name) for name in args.schedules if parse(name)[0] in (None, head_dim)}
            sdpa = [lambda s=s: F.scaled_dot_product_attention(*s[3], is_causal=causal) for s in sets]
            timers["SDPA"] = lambda: time_us(sdpa, warmup=5, reps=reps)
            tf = {name: [flops / t / 1e6 for t in median_spread(times)]  # (median, fastest, slowest)
                  for name, times in interleaved_us(timers, args.rounds).items()}
            cell = lambda name: "-" if name not in tf else f"{tf[name][0]:.1f} ({tf[name][2]:.0f}-{tf[name][1]:.0f})"
            best = max(tf[n][0] for n in args.schedules if n in tf)
            print(f"| {head_dim} | {causal} | " + " | ".join(cell(n) for n in args.schedules) +
                  f" | {cell('SDPA')} | {best / tf['SDPA'][0]:.2f}x |", flush=True)
        del sets
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
