"""What issue 46's backward column measures: forward + backward minus forward, taken apart.

tools/bench_variants.py times a backward as (forward + backward) - (forward without grad), each
with CUDA events after a ~100 us spin that lets the host enqueue the call first. This times, for
jitattn and torch.compile'd FlexAttention at the benchmark's shape, full and causal:

- fwd no grad, fwd grad (the same forward with inputs that require grad: what the forward of a
  training step costs), fwd+bwd, bwd alone (autograd.grad on a kept graph), in ms;
- jitattn's host enqueue of each (us: the call's wall time while the GPU sleeps 10 ms ahead of
  it, so the host never waits); where it exceeds the spin, the GPU idles inside the events.

With `--profile` it also prints, for jitattn, torch.profiler's view of a few calls of each step:
every kernel's device time per call (is the forward with grad the same kernel, as fast, as the
one without?) and the host operations by self time per call (where the backward's enqueue goes).

Full calls' backward runs FlashAttention-3's 80-row tile (dQ transposed; spec.TILE80_HEAD_DIMS).
With `--rows80` a third line runs jitattn with that tile forced by override_spec onto the calls
that take the persistent 64-row kernel, causal ones included (not what the plan picks: timing only).

With `--spin-x N` the spin is N times longer (bench_util.time_us's spin_x): the host's enqueue
is then hidden, but a power-capped GPU also cools between reps, so both peers speed up somewhat.

    PYTHONPATH=. python3 tools/bwd_method.py [--rounds 3] [--spin-x 1] [--profile] [--rows80] [--batch 8 ...]
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import jitattn  # noqa: E402
from bench_util import host_enqueue_us, sets_needed, time_us  # noqa: E402
from bench_variants import shape_arguments  # noqa: E402
from jitattn.varlen.plan import override_spec  # noqa: E402


def profile_steps(steps: dict, calls: int = 5, top: int = 12) -> None:
    """Per call of each step under torch.profiler: device time by kernel, host self time by op."""
    from torch.profiler import ProfilerActivity, profile

    for name, step in steps.items():
        step(0)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(calls):
                step(i % 2)
            torch.cuda.synchronize()
        events = prof.key_averages()
        kernels = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                         key=lambda e: -e.self_device_time_total)
        hosts = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CPU),
                       key=lambda e: -e.self_cpu_time_total)
        print(f"{'':15s} profile of {name!r} (us per call):")
        for e in kernels[:6]:
            print(f"{'':17s} device {e.self_device_time_total / calls:9.1f}  x{e.count / calls:g}  {e.key[:90]}")
        for e in hosts[:top]:
            print(f"{'':17s} host   {e.self_cpu_time_total / calls:9.1f}  x{e.count / calls:g}  {e.key[:90]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shape_arguments(parser)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--spin-x", type=int, default=1)
    parser.add_argument("--no-flex", action="store_true")
    parser.add_argument("--profile", action="store_true", help="jitattn's steps under torch.profiler")
    parser.add_argument("--rows80", action="store_true",
                        help="also jitattn with the 80-row tile forced onto causal calls too (full calls take it by default)")
    args = parser.parse_args()
    import torch._functorch.config
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._functorch.config.donated_buffer = False  # "bwd alone" runs the compiled backward on a kept graph
    b, l, h, d = args.batch, args.seqlen, args.heads, args.head_dim
    sets = [tuple(torch.randn(b, l, h, d, device="cuda", dtype=torch.bfloat16).requires_grad_(True) for _ in range(3))
            for _ in range(sets_needed(3 * b * l * h * d * 2))]
    grads = [torch.randn_like(s[0]) for s in sets]
    cu = torch.arange(0, (b + 1) * l, l, dtype=torch.int32, device="cuda")
    flex = torch.compile(flex_attention)

    def ours(causal):
        def run(q, k, v):
            return jitattn.varlen_attn(q.view(b * l, h, d), k.view(b * l, h, d), v.view(b * l, h, d), cu, cu, l, l,
                                       window_size=(-1, 0) if causal else (-1, -1)).view(b, l, h, d)
        return run

    def theirs(causal):
        mask = create_block_mask(lambda bb, hh, qq, kk: qq >= kk, b, None, l, l, device="cuda") if causal else None

        def run(q, k, v):
            return flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask).transpose(1, 2)
        return run

    def timers(fn, context=contextlib.nullcontext):
        """Each step of `fn`, run inside `context()` (where the backward plans its kernels)."""
        def fwd_no_grad(i):
            with context(), torch.no_grad():
                fn(*sets[i])

        def fwd_grad(i):
            with context():
                return fn(*sets[i])

        def fwd_bwd(i):
            with context():
                torch.autograd.grad(fn(*sets[i]), sets[i], grads[i])

        def bwd_alone(i):
            with context():
                torch.autograd.grad(kept[i], sets[i], grads[i], retain_graph=True)

        kept = [fn(*s) for s in sets]
        steps = {"fwd no grad": fwd_no_grad, "fwd grad": fwd_grad, "fwd+bwd": fwd_bwd, "bwd alone": bwd_alone}
        return {name: (lambda f=f: time_us([lambda i=i: f(i) for i in range(len(sets))], reps=10,
                                           spin_x=args.spin_x) / 1e3)
                for name, f in steps.items()}, steps

    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; bf16 {b} x {l}, {h} heads, D{d}; ms, median "
          f"of {args.rounds} interleaved rounds; spin x{args.spin_x}")
    for causal in (False, True):
        medians = {}
        implementations = [("jitattn", ours(causal), contextlib.nullcontext)]
        if args.rows80:  # the backward on the 80-row tile (persistent 64-row calls forced onto it)
            implementations.append(("jitattn80", ours(causal), lambda: override_spec(
                "varlen_backward", when={"persistent": True, "soft_cap": False}, block_m=80, persistent=False)))
        if not args.no_flex:
            implementations.append(("flex", theirs(causal), contextlib.nullcontext))
        for name, fn, context in implementations:
            t, steps = timers(fn, context)
            got = {k: [] for k in t}
            for _ in range(args.rounds):
                for k, f in t.items():
                    got[k].append(f())
            med = medians[name] = {k: statistics.median(v) for k, v in got.items()}
            line = "  ".join(f"{k} {v:6.3f}" for k, v in med.items())
            print(f"{'causal' if causal else 'full':6s} {name:9s} {line}  | fwd+bwd - fwd no grad "
                  f"{med['fwd+bwd'] - med['fwd no grad']:6.3f}")
            if name == "jitattn":
                host = {k: host_enqueue_us(lambda f=f: f(0)) for k, f in steps.items() if k != "fwd+bwd"}
                print(f"{'':15s} host enqueue (us): " + "  ".join(f"{k} {v:.0f}" for k, v in host.items()))
                if args.profile:
                    profile_steps({k: f for k, f in steps.items() if k != "fwd+bwd"})
        for ours_name in ("jitattn", "jitattn80") if "flex" in medians else ():
            if ours_name not in medians:
                continue
            mine, peer = medians[ours_name], medians["flex"]
            print(f"{'':15s} flex / {ours_name}: bench column (fwd+bwd - fwd no grad) "
                  f"{(peer['fwd+bwd'] - peer['fwd no grad']) / (mine['fwd+bwd'] - mine['fwd no grad']):.3f}x, "
                  f"bwd alone {peer['bwd alone'] / mine['bwd alone']:.3f}x, "
                  f"fwd {peer['fwd no grad'] / mine['fwd no grad']:.3f}x")


if __name__ == "__main__":
    main()
