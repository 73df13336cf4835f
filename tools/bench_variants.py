"""Attention variants through jitattn beside FlexAttention (issue 46's acceptance table).

For each variant of the acceptance set (jitattn/variants/gallery.py), full and causal where both
make sense: jitattn's forward and backward (varlen_attn with score_mod / mask_mod) and torch's
flex_attention compiled with torch.compile (default backend; masks through create_block_mask),
in one run, TFLOP/s (causal counted half, backward 2.5x the forward's FLOPs, timed as
forward + backward minus forward). Also: causal and sliding window as masks beside the built-in
window (the same kernel without a mask_mod), and the soft cap's cost (softcap= against no cap) at
D64 / D128 / D256 with its accuracy against float64.

CUDA events, warm-up, cold L2 (rotating input sets), median over interleaved rounds
(tools/bench_util.py).

With --rows80 each row also times jitattn's backward on the 80-row tile (forced by override_spec
onto every D128 producer call, as spec.TILE80_FEATURES listing all call features would): the
columns "bwd80" and its ratio to Flex.

--no-early-probs builds the backward with spec.EARLY_UNIT_SLOPE_PROBS off (a bias table's P^T computed
with dS^T after both GEMMs instead of under dP^T's; only the bias table's rows change), for a run
beside the default.

    python3 tools/bench_variants.py [--batch 8 --seqlen 4096 --heads 32 --head-dim 128] [--quick] [--rows80]
                                    [--no-early-probs]

(`jitattn prewarm cache/variants.toml cache/softcap.toml --arch 9.0` first builds what it runs
with every core instead of one JIT build at a time.)
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jitattn  # noqa: E402
from bench_util import interleaved_us, sets_needed, time_us  # noqa: E402
from jitattn.variants import gallery  # noqa: E402


def variant_set(batch, seqlen, heads, device):
    """name -> (score_mod, mask_mod, flex score_mod, flex mask_mod, causal rows?); the flex functions are
    the same ones (FlexAttention's q_idx equals ours when L_q == L_k)."""
    from jitattn.reference import alibi_slopes

    slopes = alibi_slopes(heads).to(device, torch.float32)
    bias = torch.randn(heads, 2 * seqlen - 1, device=device)
    doc_lengths = [512, 1024, 256, 2304]  # documents packed into each sequence
    doc_id = torch.repeat_interleave(torch.arange(len(doc_lengths)), torch.tensor(doc_lengths))[:seqlen]
    doc_id = torch.nn.functional.pad(doc_id, (0, seqlen - doc_id.numel()), value=len(doc_lengths))
    doc_id = doc_id.to(torch.int32).repeat(batch, 1).to(device)
    prefix = torch.full((batch,), seqlen // 4, dtype=torch.int32, device=device)
    return {
        "relative bias": (gallery.relative_position, None, True),
        "ALiBi": (gallery.alibi(slopes), None, True),
        "bias table": (gallery.bias_table(bias, seqlen - 1), None, True),
        "soft cap 50": (gallery.soft_cap(50.0), None, True),
        "causal mask": (None, gallery.causal, False),
        "sliding window 1024 mask": (None, gallery.sliding_window(1024), False),
        "document mask": (None, gallery.document(doc_id), True),
        "prefix-LM mask": (None, gallery.prefix_lm(prefix), False),
    }


def shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's shape (also tools/variant_kernels.py's)."""
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shape_arguments(parser)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one round, fewer reps")
    parser.add_argument("--only", nargs="*", default=None, help="variant names to run (substring match)")
    parser.add_argument("--no-flex", action="store_true")
    parser.add_argument("--parts", nargs="*", default=["variants", "builtin", "softcap"])
    parser.add_argument("--no-early-probs", action="store_true",
                        help="the backward with spec.EARLY_UNIT_SLOPE_PROBS off (score_mods whose slope is 1)")
    parser.add_argument("--rows80", action="store_true",
                        help="also time the backward on the 80-row tile (D128: every call but a soft-capped one)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds = 1
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    if args.no_early_probs:  # before any call plans: a template parameter, part of the kernels' keys
        from jitattn.varlen import spec

        spec.EARLY_UNIT_SLOPE_PROBS = False
        print("the backward with spec.EARLY_UNIT_SLOPE_PROBS off", flush=True)
    if "variants" in args.parts or "builtin" in args.parts:
        bench_variants(args, device)
    if "softcap" in args.parts:
        bench_softcap(args, device)
    return 0


def _inputs(b, l, h, d, device, dtype=torch.bfloat16, grad=False):
    sets = []
    for _ in range(sets_needed(3 * b * l * h * d * 2)):
        q, k, v = (torch.randn(b, l, h, d, device=device, dtype=dtype) for _ in range(3))
        if grad:
            for t in (q, k, v):
                t.requires_grad_(True)
        sets.append((q, k, v))
    return sets


def _fwd_bwd_timers(forward, sets, reps, within=contextlib.nullcontext):
    """(forward timer, forward + backward timer) over rotating sets; forward(q, k, v) -> out; each
    call inside a `within()` block (an override of the plan)."""
    grads = [torch.randn_like(s[0]) for s in sets]

    def fwd(i):
        with torch.no_grad(), within():
            forward(*sets[i])

    def fwd_bwd(i):
        q, k, v = sets[i]
        with within():
            out = forward(q, k, v)
            torch.autograd.grad(out, (q, k, v), grads[i])

    return (lambda: time_us([lambda i=i: fwd(i) for i in range(len(sets))], reps=reps),
            lambda: time_us([lambda i=i: fwd_bwd(i) for i in range(len(sets))], reps=reps))


def bench_variants(args, device):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    b, l, h, d = args.batch, args.seqlen, args.heads, args.head_dim
    reps = 10 if args.quick else 20
    sets = _inputs(b, l, h, d, device, grad=True)
    cu = torch.arange(0, (b + 1) * l, l, dtype=torch.int32, device=device)
    flex = torch.compile(flex_attention)
    flops_full = 4.0 * b * l * l * h * d

    def ours(score_mod, mask_mod, window):
        def run(q, k, v):
            out = jitattn.varlen_attn(q.view(b * l, h, d), k.view(b * l, h, d), v.view(b * l, h, d), cu, cu, l, l,
                                      window_size=window, score_mod=score_mod, mask_mod=mask_mod)
            return out.view(b, l, h, d)
        return run

    def theirs(score_mod, mask_mod, causal):
        def both(bb, hh, qq, kk):
            return (qq >= kk) & mask_mod(bb, hh, qq, kk) if mask_mod else qq >= kk
        mod = both if causal else mask_mod
        block_mask = create_block_mask(mod, b, None, l, l, device=device) if mod is not None else None

        def run(q, k, v):
            out = flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod=score_mod,
                       block_mask=block_mask)
            return out.transpose(1, 2)
        return run

    rows = []
    if "builtin" in args.parts:
        rows += [("no variant (built-in)", None, None, False, (-1, -1)), ("no variant, causal (built-in)", None, None,
                                                                         True, (-1, 0)),
                 ("built-in window (1024, 0)", None, None, None, (1024, 0))]
    if "variants" in args.parts:
        for name, (score_mod, mask_mod, with_causal) in variant_set(b, l, h, device).items():
            if args.only and not any(o in name for o in args.only):
                continue
            rows.append((name, score_mod, mask_mod, False, (-1, -1)))
            if with_causal:
                rows.append((name + ", causal", score_mod, mask_mod, True, (-1, 0)))
            if "causal mask" in name or "sliding" in name:  # also through the mask hook, not lowered
                rows.append((name + " (hook: JITATTN_LOWER_WINDOWS=0)", score_mod, mask_mod, False, (-1, -1)))
    print(f"\n### Variants: jitattn vs FlexAttention (torch.compile), bf16, {b} x {l}, {h} heads, D{d}; TFLOP/s\n")
    rows80 = args.rows80 and d == 128
    extra = " bwd80 | ratio80 | bwd80 ms |" if rows80 else ""
    print(f"| variant | jitattn fwd | Flex fwd | ratio | jitattn bwd | Flex bwd | ratio | fwd ms | bwd ms |{extra}")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * (3 if rows80 else 0), flush=True)
    for name, score_mod, mask_mod, causal, window in rows:
        # Each row's Flex compiles afresh: past dynamo's recompile limit (8) flex_attention falls back to
        # its unfused eager path, which materializes the scores (out of memory at this size).
        torch._dynamo.reset()
        flex = torch.compile(flex_attention)
        # A mask that is a window runs as the built-in window (jitattn/variants/window.py); the
        # "(hook)" rows keep the mask hook, for the hook's own cost.
        os.environ["JITATTN_LOWER_WINDOWS"] = "0" if "(hook" in name else "1"
        # FLOPs: causal (or causal-like masks) counted half; the sliding windows by their visible fraction
        density = _density(name, causal, window, l)
        flops = flops_full * density
        timers = {}
        mine = ours(score_mod, mask_mod, window)
        timers["ours_f"], timers["ours_fb"] = _fwd_bwd_timers(mine, sets, reps)
        if rows80:  # the same calls with the backward on the 80-row tile (its bwd: o80_fb less ours_f)
            timers["o80_fb"] = _fwd_bwd_timers(mine, sets, reps, _tile80)[1]
        flex_causal = causal or window == (-1, 0) or window[0] >= 0
        if not args.no_flex:
            try:
                peer = theirs(score_mod, mask_mod if mask_mod else (gallery.sliding_window(window[0])
                                                                    if window[0] >= 0 else None), flex_causal
                              if window[0] < 0 else False)
                timers["flex_f"], timers["flex_fb"] = _fwd_bwd_timers(peer, sets, reps)
                _check(mine, peer, sets[0], name)
            except Exception as exc:  # a peer that cannot run this case: say so, keep going
                print(f"  (Flex failed on {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]})")
        try:
            times = {k: statistics.median(v) for k, v in interleaved_us(timers, args.rounds).items()}
        except Exception as exc:
            print(f"| {name} | failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]} |", flush=True)
            continue
        of, ob = times["ours_f"], times["ours_fb"] - times["ours_f"]
        ff, fb = times.get("flex_f"), (times["flex_fb"] - times["flex_f"]) if "flex_f" in times else None
        tf = lambda t, k=1.0: f"{k * flops / t / 1e6:.0f}" if t else "-"  # noqa: E731
        ratio = lambda a, c: f"{c / a:.2f}x" if a and c else "-"  # noqa: E731
        o80 = times["o80_fb"] - times["ours_f"] if rows80 else None
        extra = f" {tf(o80, 2.5)} | {ratio(o80, fb)} | {o80 / 1e3:.2f} |" if rows80 else ""
        print(f"| {name} | {tf(of)} | {tf(ff)} | {ratio(of, ff)} | {tf(ob, 2.5)} | {tf(fb, 2.5)} | {ratio(ob, fb)} "
              f"| {of / 1e3:.2f} | {ob / 1e3:.2f} |{extra}", flush=True)


def _tile80():
    """The backward's 80-row tile on every D128 producer call but a soft-capped one (the plan's
    choice where spec.TILE80_FEATURES lists every call feature)."""
    from jitattn.varlen.plan import override_spec

    return override_spec("varlen_backward", when={"producer": True, "head_dim": 128, "soft_cap": False},
                         block_m=80, persistent=False)


def _density(name, causal, window, l):
    if "sliding" in name or window[0] >= 0:
        w = 1024
        return (w * (w + 1) / 2 + (l - w) * (w + 1)) / (l * l)
    if causal or "causal mask" in name or "prefix" in name:
        return 0.5
    return 1.0


def _check(mine, peer, inputs, name):
    with torch.no_grad():
        a, p = mine(*inputs).float(), peer(*inputs).float()
    diff = (a - p).abs().max().item()
    if not diff < 0.05 or math.isnan(diff):
        print(f"  WARNING: {name}: jitattn and Flex differ by {diff:.3g} (max abs)", flush=True)


def bench_softcap(args, device):
    """softcap= against no cap, forward, D64 / D128 / D256, with the forward's MUFU levers forced by
    override (poly_exp2 on part of the columns, the exact tanh, poly_tanh: the tanh on the FMA
    pipe within |x| <= 1), and the capped output's error against float64 (the hardware tanh,
    the default, and the exact tanh; every column's on the line below)."""
    from jitattn.reference import varlen_attn_reference
    from jitattn.varlen.plan import override_spec

    b, l, h = args.batch, args.seqlen, args.heads
    reps = 10 if args.quick else 20
    # The GEMM orders of the producer kernels (VarlenSpec pingpong / overlap: no gain uncapped,
    # notes/forward-h200.md) may hide a capped softmax's second MUFU operation per logit under the
    # other warpgroup's (or the previous tile's) GEMMs; they run a CTA per row block, without split_kv.
    orders = {"persistent": False, "split_kv": False}
    all_variants = {  # name -> (softcap, forced fields of the forward spec)
        "no cap": (None, {}), "cap": (50.0, {}),
        "cap, poly1": (50.0, {"poly_exp2": 1}), "cap, poly2": (50.0, {"poly_exp2": 2}),
        "cap, exact tanh": (50.0, {"exact_soft_cap": True}), "cap, poly tanh": (50.0, {"poly_tanh": True}),
        "cap, pingpong": (50.0, {**orders, "pingpong": True}), "cap, overlap": (50.0, {**orders, "overlap": True}),
    }
    print(f"\n### Soft cap 50: forward ms (and x the default uncapped), bf16, {b} x {l}, {h} heads "
          "(n/a: a head dim without that kernel)\n")
    print("| D | " + " | ".join(all_variants) + " | max err approx | max err exact |")
    print("|---:|" + "---:|" * (len(all_variants) + 2), flush=True)
    cu = torch.arange(0, (b + 1) * l, l, dtype=torch.int32, device=device)
    for d in (64, 128, 256):
        variants = {name: v for name, v in all_variants.items() if _spec_exists(v[1], d, h, device)}
        sets = _inputs(b, l, h, d, device)

        def timer(cap, forced):
            calls = [lambda s=s: jitattn.varlen_attn(s[0].view(-1, h, d), s[1].view(-1, h, d), s[2].view(-1, h, d),
                                                     cu, cu, l, l, softcap=cap) for s in sets]

            def run():
                with override_spec("varlen", **forced) if forced else contextlib.nullcontext():
                    return time_us(calls, reps=reps)
            return run

        times = {k: statistics.median(v) for k, v in
                 interleaved_us({name: timer(*v) for name, v in variants.items()}, args.rounds).items()}
        # accuracy on a short batch against float64
        q, k, v = (torch.randn(2 * 512, h, d, device=device, dtype=torch.bfloat16) * 2 for _ in range(3))
        cu2 = torch.tensor([0, 512, 1024], dtype=torch.int32, device=device)
        refs = {cap: varlen_attn_reference(q, k, v, cu2, cu2, 512, 512, softcap=cap)[0] for cap in (None, 50.0)}
        errors = {}
        for name, (cap, forced) in variants.items():
            with override_spec("varlen", **forced) if forced else contextlib.nullcontext():
                got = jitattn.varlen_attn(q, k, v, cu2, cu2, 512, 512, softcap=cap).double()
            errors[name] = (got - refs[cap]).abs().max().item()
        base = times["no cap"]
        cells = " | ".join(f"{times[n] / 1e3:.3f} ({times[n] / base:.2f}x)" if n in times else "n/a"
                           for n in all_variants)
        print(f"| {d} | {cells} | {errors['cap']:.2e} | {errors['cap, exact tanh']:.2e} |", flush=True)
        print("  max abs error against float64 (bf16 output), per column: "
              + ", ".join(f"{name} {e:.2e}" for name, e in errors.items()), flush=True)


def _spec_exists(forced: dict, head_dim: int, heads: int, device) -> bool:
    """Whether a capped bf16 prefill call at head_dim can run with `forced` (an override the spec
    rejects, e.g. pingpong on D64's 12-warp tile, raises before anything is built or launched)."""
    from jitattn.varlen.plan import override_spec

    if not forced:
        return True
    q = torch.zeros(256, heads, head_dim, device=device, dtype=torch.bfloat16)
    cu = torch.tensor([0, 256], dtype=torch.int32, device=device)
    try:
        with override_spec("varlen", **forced):
            jitattn.varlen_attn(q, q, q, cu, cu, 256, 256, softcap=50.0)
    except ValueError as exc:
        if "forces" not in str(exc):  # not the override's refusal: a real error
            raise
        return False
    return True


if __name__ == "__main__":
    raise SystemExit(main())
