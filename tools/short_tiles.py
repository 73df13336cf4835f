"""The forward's tile for short sequences: a padded encoder batch's attention call under forced
tiles, beside SDPA, in one run (issue 47's BERT-like encoder).

The call is the transformers integration's (jitattn/integrations/transformers.py, attention_forward)
on 256 right-padded sentences of 8 to 68 tokens (tools/bench_transformers.py's encoder batch),
bidirectional, bf16, 12 heads of 32 or 6 of 64, both padding paths ("on_device" and "host_read").
SDPA gets what transformers' sdpa integration hands it: the (B, 1, L, L) bool mask. Each tile is a
VarlenSpec override (jitattn/varlen/overrides.py) checked against float64 on the valid query rows
before it is timed; tiles are timed in interleaved rounds (CUDA events, warm-up, rotating input
sets, median; tools/bench_util.py).

    PYTHONPATH=. python3 tools/short_tiles.py [--head-dims 32 64] [--rounds 3] [--tiles NAME ...]
    PYTHONPATH=. python3 tools/short_tiles.py --mask-hooks [--head-dims 32 64]

`--mask-hooks` instead times the default tile on the on_device path's arguments under mask hooks
of increasing cost: none, an index-only mask (tiles classify FULL without a read), one capture
read per classification (`whole[b]`) and the padding mask_mod itself: what the hook's capture
reads cost one-tile sequences (notes/transformers-host.md, eighth session).

The candidate kernels are collected first (JITATTN_RECORD, strict mode: no call compiles) and
built in parallel with every core, then timed.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

from bench_util import interleaved_us, median_spread, sets_needed, time_us  # noqa: E402

import jitattn.integrations.transformers as jt  # noqa: E402
from jitattn.errors import MissingSpecializationError  # noqa: E402
from jitattn.varlen.overrides import override_spec  # noqa: E402

SENTENCES, MAX_LEN = 256, 68
HIDDEN = 384

# name -> VarlenSpec fields forced on the call's choice, per head dim ({} = the call's own spec).
TILES = {
    32: {
        "default": {},
        "mma m4x1n64": {"warps_m": 4, "m_tiles": 1, "block_n": 64, "stages": 2},
        "mma m4x1n80": {"warps_m": 4, "m_tiles": 1, "block_n": 80, "stages": 2},
        "mma m4x2n80": {"warps_m": 4, "m_tiles": 2, "block_n": 80, "stages": 2},
        "mma m8x1n80": {"warps_m": 8, "m_tiles": 1, "block_n": 80, "stages": 2},
        "mma m2x2n80": {"warps_m": 2, "m_tiles": 2, "block_n": 80, "stages": 2},
        "mma m2x1n80": {"warps_m": 2, "m_tiles": 1, "block_n": 80, "stages": 2},
        # the default tile with the launch bounds asking for more resident CTAs (fewer registers:
        # one-tile CTAs are latency, which more CTAs per SM hide)
        "default, 3 CTAs/SM": {"min_blocks": 3},
        "default, 4 CTAs/SM": {"min_blocks": 4},
    },
    64: {
        "default": {},
        "wgmma m8 tma persistent": {"warps_m": 8, "block_n": 128, "stages": 2, "tma": True, "persistent": True},
        "wgmma m8 tma": {"warps_m": 8, "block_n": 128, "stages": 2, "tma": True, "persistent": False},
        "wgmma m4 tma": {"warps_m": 4, "block_n": 128, "stages": 2, "tma": True, "persistent": False},
        "wgmma m4 tma persistent": {"warps_m": 4, "block_n": 128, "stages": 2, "tma": True, "persistent": True},
        "wgmma m4 n64": {"warps_m": 4, "block_n": 64, "stages": 3, "tma": False, "persistent": False},
        "wgmma m8 n64": {"warps_m": 8, "block_n": 64, "stages": 3, "tma": False, "persistent": False},
        "wgmma m4 n80": {"warps_m": 4, "block_n": 80, "stages": 3, "tma": False, "persistent": False},
        "wgmma m8 n80": {"warps_m": 8, "block_n": 80, "stages": 3, "tma": False, "persistent": False},
        "mma m4x1n80": {"wgmma": False, "tma": False, "persistent": False, "warps_m": 4, "m_tiles": 1,
                        "block_n": 80, "stages": 2},
        "mma m4x2n80": {"wgmma": False, "tma": False, "persistent": False, "warps_m": 4, "m_tiles": 2,
                        "block_n": 80, "stages": 2},
    },
}


class _Module(torch.nn.Module):
    is_causal = False


def batch(head_dim: int, g: torch.Generator, device):
    """(q, k, v (B, H, L, D) bf16, the (B, L) long padding mask) like tools/bench_transformers.py's."""
    heads = HIDDEN // head_dim
    lengths = torch.randint(8, MAX_LEN + 1, (SENTENCES,), generator=g)
    lengths[0] = MAX_LEN
    mask = (torch.arange(MAX_LEN)[None] < lengths[:, None]).long().to(device)
    q, k, v = (torch.randn(SENTENCES, heads, MAX_LEN, head_dim, generator=g).to(device, torch.bfloat16)
               for _ in range(3))
    return q, k, v, mask


def reference(q, k, v, mask):
    """float64 softmax attention of every query row over its sentence's valid keys."""
    scale = q.shape[-1] ** -0.5
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double()) * scale
    s = s.masked_fill(~mask.bool()[:, None, None, :], float("-inf"))
    return torch.einsum("bhqk,bhkd->bhqd", s.softmax(-1), v.double()).transpose(1, 2)  # (B, L, H, D)


def implementations(module):
    """{padding: run} for jitattn (run inside `padded(padding)`: the plan a forward pass's first layer
    derives is then reused, as by a model's other layers), and sdpa's run."""
    def ours(q, k, v, mask):
        return jt.attention_forward(module, q, k, v, mask, is_causal=False)[0]

    def sdpa(q, k, v, mask):
        full = mask.bool()[:, None, None, :].expand(-1, 1, mask.shape[1], -1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=full)
        return out.transpose(1, 2)

    return {"on_device": ours, "host_read": ours}, sdpa


def padded(padding: str):
    return jt.use_backend(jt.JITATTN_BACKEND._replace(padding=padding))


def first_layer(run, padding: str):
    """run as a forward pass's first layer: the plan derived anew each call (use_backend forgets
    what forward passes derived on entry)."""
    def call(*args):
        with padded(padding):
            return run(*args)
    return call


def collect_and_build(head_dims, tiles, sets, impls) -> None:
    """Every candidate's kernels, recorded without compiling (strict mode), then built in parallel."""
    from jitattn.jit import record
    from jitattn.jit.manifest import read_manifest
    from jitattn.jit.prewarm import prewarm

    path = Path(tempfile.mkdtemp()) / "record.toml"
    saved = {k: os.environ.get(k) for k in ("JITATTN_RECORD", "JITATTN_DISABLE_JIT")}
    os.environ.update(JITATTN_RECORD=str(path), JITATTN_DISABLE_JIT="1")
    record.reset()
    try:
        for d in head_dims:
            for name in tiles[d]:
                for impl, run in impls.items():
                    with padded(impl), override_spec("varlen", when={"head_dim": d}, **TILES[d][name]):
                        try:
                            run(*sets[d][0])
                        except MissingSpecializationError:
                            pass
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        record.reset()
    specs = read_manifest(path) if path.exists() else []
    if specs:
        outcomes = prewarm(specs, os.cpu_count() or 2)
        failed = [o for o in outcomes if o.status == "failed"]
        print(f"built {len(specs)} candidate kernels ({len(failed)} failed)", flush=True)
        for o in failed:
            print("  failed:", o.spec.name, o.detail[-300:])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[32, 64], choices=sorted(TILES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tiles", nargs="*", default=None, help="tile names to run (substring match)")
    parser.add_argument("--mask-hooks", action="store_true", help="the mask hook's cost by kind (see above)")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    g = torch.Generator().manual_seed(0)
    if args.mask_hooks:
        return mask_hooks(args.head_dims, args.rounds, g, device)
    module = _Module()
    impls, sdpa = implementations(module)
    tiles = {d: [n for n in TILES[d] if not args.tiles or n == "default" or any(t in n for t in args.tiles)]
             for d in args.head_dims}
    sets = {}
    for d in args.head_dims:
        first = batch(d, g, device)
        per_set = sum(t.numel() * t.element_size() for t in first[:3])
        sets[d] = [first] + [(*batch(d, g, device)[:3], first[3]) for _ in range(sets_needed(per_set) - 1)]
    collect_and_build(args.head_dims, tiles, sets, impls)

    for d in args.head_dims:
        q, k, v, mask = sets[d][0]
        want = reference(q, k, v, mask)
        valid = mask.bool()
        print(f"\n### short sequences: {SENTENCES} sentences of 8..{MAX_LEN} tokens, {HIDDEN // d} heads of {d}, "
              f"bf16, bidirectional; us per call (median of {args.rounds} interleaved rounds, min-max)")
        timers, errors = {}, {}
        for name in tiles[d]:
            runs = dict(impls)
            if name == "default":  # what the plan costs: the first layer of a forward pass
                runs["on_device, first layer"] = first_layer(impls["on_device"], "on_device")
            for impl, run in runs.items():
                padding = impl.partition(",")[0]
                with padded(padding), override_spec("varlen", when={"head_dim": d}, **TILES[d][name]):
                    out = run(q, k, v, mask)
                    torch.cuda.synchronize()
                err = (out.double() - want)[valid].abs().max().item()
                ok = err < 2e-2 and not torch.isnan(out[valid]).any()
                errors[(name, impl)] = (err, ok)

                def timer(name=name, run=run, padding=padding):
                    with padded(padding), override_spec("varlen", when={"head_dim": d}, **TILES[d][name]):
                        return time_us([lambda s=s: run(*s) for s in sets[d]], reps=20)
                if ok:
                    timers[(name, impl)] = timer
        timers[("sdpa", "")] = lambda: time_us([lambda s=s: sdpa(*s) for s in sets[d]], reps=20)
        times = interleaved_us(timers, args.rounds)
        base = median_spread(times[("sdpa", "")])[0]
        print(f"sdpa (cuDNN/efficient, 4D mask): {base:.1f} us")
        print("| tile | padding | us | min-max | vs sdpa | max abs err |")
        print("|---|---|---:|---|---:|---:|")
        for (name, impl), (err, ok) in errors.items():
            if not ok:
                print(f"| {name} | {impl} | FAILED | | | {err:.2e} |")
                continue
            med, lo, hi = median_spread(times[(name, impl)])
            print(f"| {name} | {impl} | {med:.1f} | {lo:.1f}-{hi:.1f} | {base / med:.2f}x | {err:.1e} |")
    return 0


def mask_hooks(head_dims, rounds: int, g: torch.Generator, device) -> int:
    """The default tile on the padded call's varlen arguments (`_padded`, on_device) under mask
    hooks of increasing cost, each checked against float64 on the valid query rows."""
    import jitattn
    from jitattn.variants import trace_mask_mod

    common = {"scale": None, "window_size": (-1, -1), "enable_gqa": False, "softcap": None}
    for d in head_dims:
        sets = [batch(d, g, device) for _ in range(4)]
        runs = {"none": [], "index-only": [], "whole[b]": [], "padding mask_mod": []}
        with torch.no_grad():
            for q, k, v, mask in sets:
                mapped = jt._padded(q, k, v, mask, common)
                whole = mapped.mask_mod.tensors[0]  # (N,) bool: every key the sequence reads is a token
                hooks = {"none": None, "index-only": trace_mask_mod(lambda b, h, q_idx, kv_idx: q_idx + kv_idx < 1 << 20),
                         "whole[b]": trace_mask_mod(lambda b, h, q_idx, kv_idx: whole[b]),
                         "padding mask_mod": mapped.mask_mod}
                args = mapped[:7]
                for name, hook in hooks.items():
                    extra = {} if hook is None else {"mask_mod": hook}
                    runs[name].append(lambda a=args, m=mapped, e=extra: jitattn.varlen_attn(*a, seqused_k=m.used, **e))
            q, k, v, mask = sets[0]
            want, valid = reference(q, k, v, mask), mask.bool()
            for name, fns in runs.items():
                out = fns[0]().view(q.shape[0], q.shape[2], q.shape[1], d)
                err = (out.double() - want)[valid].abs().max().item()
                if not err < 2e-2:
                    print(f"d{d} {name}: FAILED against float64 (max abs err {err:.2e})")
                    return 1
            times = interleaved_us({n: (lambda f=f: time_us(f, reps=50)) for n, f in runs.items()}, rounds)
        print(f"\n### mask hooks on the padded encoder call, {HIDDEN // d} heads of {d}: us per call "
              f"(median of {rounds} interleaved rounds, min-max)")
        print("| mask_mod | us | min-max |")
        print("|---|---:|---|")
        for name, t in times.items():
            med, lo, hi = median_spread(t)
            print(f"| {name} | {med:.1f} | {lo:.1f}-{hi:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
