"""Sweep benchmark for the plots in docs/benchmarks.md: jitattn beside its peers against sequence length.

Areas (bf16 for varlen, fp16 for decode; every peer timed in the same run, in interleaved rounds):
  forward   varlen prefill TFLOP/s; batches of `seqlen` tokens adding up to a fixed total (32k tokens),
            D*H = 2048 (D64 x 32 heads, D128 x 16, D256 x 8), causal and full.
  backward  (forward + backward) - forward, TFLOP/s with backward FLOPs = 2.5x forward; the same
            batches with bench_varlen's backward heads (D64 x 32, D128 x 32, D256 x 16).
  decode    single_decode_with_kv_cache TB/s (K and V bytes read once, plus q and out) against kv
            length; 32 query / 8 KV heads, D128, fp16.
Peers: torch.nn.attention.varlen.varlen_attn ("torch-varlen") and SDPA with the cuDNN and the flash
backend ("sdpa-cudnn", "sdpa-flash") for varlen, SDPA with its default backend ("sdpa") for decode.
A peer that this torch lacks or that rejects a shape is skipped with a note, never a failure.
Timing is tools/bench_util.py's: CUDA events, warm-up, cold L2 (inputs rotated over >= 256 MB),
median of the timed calls, then the median over interleaved rounds (the clocks drift within a job).

Run: python3 tools/bench_sweep.py [--quick] [--areas forward backward decode] [--json PATH] [--dry-run]
--quick (the GPU job's mode, BENCH=sweep in tools/device_check.sh): 3 sequence lengths, 4 kv lengths,
fewer repetitions. --dry-run prints the plan and needs no GPU. tools/plot_benchmarks.py draws the JSON.
"""
from __future__ import annotations

import argparse
import datetime
import inspect
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))
sys.path.insert(1, str(TOOLS.parent))  # the repo, when jitattn is not installed

AREAS = ("forward", "backward", "decode")
UNITS = {"forward": "TFLOP/s", "backward": "TFLOP/s", "decode": "TB/s"}
RECORD_KEYS = ("area", "head_dim", "causal", "seqlen", "impl", "value", "unit", "gpu", "torch", "date")
TOTAL_TOKENS = 32768
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_SEQLENS = (1024, 4096, 16384)
KV_LENS = (1024, 4096, 16384, 65536, 131072)
QUICK_KV_LENS = (1024, 4096, 16384, 65536)
HEAD_DIMS = (64, 128, 256)
FORWARD_HEADS = {64: 32, 128: 16, 256: 8}
BACKWARD_HEADS = {64: 32, 128: 32, 256: 16}
DECODE_HEADS = (32, 8)  # query heads, KV heads
DECODE_HEAD_DIM = 128
VARLEN_IMPLS = ("jitattn", "torch-varlen", "sdpa-cudnn", "sdpa-flash")
DECODE_IMPLS = ("jitattn", "sdpa")


@dataclass(frozen=True)
class Case:
    """One point of the sweep: every impl is timed on it in the same rounds."""
    area: str
    head_dim: int
    causal: bool
    seqlen: int  # tokens per sequence (varlen) or kv length (decode)
    batch: int
    heads: int  # query heads
    kv_heads: int

    def describe(self) -> str:
        mask = "causal" if self.causal else "full"
        if self.area == "decode":
            return f"decode D{self.head_dim} {self.heads}/{self.kv_heads} heads, kv {self.seqlen}"
        return f"{self.area} D{self.head_dim} x {self.heads} heads, {self.batch} x {self.seqlen}, {mask}"


def plan(areas=AREAS, quick: bool = False, head_dims=HEAD_DIMS) -> list:
    """The cases of a run, in the order they are timed."""
    cases = []
    seqlens = QUICK_SEQLENS if quick else SEQLENS
    for area in areas:
        if area not in AREAS:
            raise ValueError(f"areas: unknown area {area!r}; expected some of {AREAS}")
        if area == "decode":
            heads, kv_heads = DECODE_HEADS
            cases += [Case(area, DECODE_HEAD_DIM, False, n, 1, heads, kv_heads)
                      for n in (QUICK_KV_LENS if quick else KV_LENS)]
            continue
        heads_of = FORWARD_HEADS if area == "forward" else BACKWARD_HEADS
        for head_dim in head_dims:
            for causal in (False, True):
                cases += [Case(area, head_dim, causal, n, TOTAL_TOKENS // n, heads_of[head_dim], heads_of[head_dim])
                          for n in seqlens]
    return cases


def attention_flops(case: Case) -> float:
    """Forward FLOPs of a varlen case: 4 T^2 D H per sequence, half that causal (only unmasked work);
    the backward's are 2.5x."""
    flops = case.batch * 4.0 * case.seqlen ** 2 * case.head_dim * case.heads * (0.5 if case.causal else 1.0)
    return flops * (2.5 if case.area == "backward" else 1.0)


def decode_bytes(case: Case, elem_bytes: int = 2) -> int:
    """Bytes a decode call must move: K and V once, q in and out."""
    return (2 * case.seqlen * case.kv_heads + 2 * case.heads) * case.head_dim * elem_bytes


def throughput(case: Case, us: float) -> float:
    """TFLOP/s (varlen) or TB/s (decode) of one call that took `us` microseconds."""
    if not us > 0:
        raise ValueError(f"us: a time must be positive, got {us!r}")
    work = decode_bytes(case) if case.area == "decode" else attention_flops(case)
    return work / us / 1e6


def make_record(case: Case, impl: str, value: float, gpu: str, torch_version: str, date: str) -> dict:
    """One JSON record (RECORD_KEYS); value in UNITS[case.area]."""
    return {"area": case.area, "head_dim": case.head_dim, "causal": case.causal, "seqlen": case.seqlen,
            "impl": impl, "value": float(f"{value:.6g}"), "unit": UNITS[case.area], "gpu": gpu,
            "torch": torch_version, "date": date}


def validate_records(records) -> list:
    """The records if they follow the schema, else a ValueError naming the first bad one."""
    if not isinstance(records, list):
        raise ValueError(f"records: expected a JSON list, got {type(records).__name__}")
    types = {"area": str, "head_dim": int, "causal": bool, "seqlen": int, "impl": str, "value": (int, float),
             "unit": str, "gpu": str, "torch": str, "date": str}
    for i, record in enumerate(records):
        if not isinstance(record, dict) or set(record) != set(RECORD_KEYS):
            got = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise ValueError(f"records[{i}]: expected the keys {list(RECORD_KEYS)}, got {got}")
        for key, kind in types.items():
            value = record[key]
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ValueError(f"records[{i}].{key}: expected {kind}, got {value!r}")
        if record["area"] not in AREAS or record["unit"] != UNITS[record["area"]]:
            raise ValueError(f"records[{i}]: area {record['area']!r} with unit {record['unit']!r}; "
                             f"expected one of {UNITS}")
        if not record["value"] > 0 or record["seqlen"] <= 0 or record["head_dim"] <= 0:
            raise ValueError(f"records[{i}]: value, seqlen and head_dim must be positive: {record}")
        datetime.date.fromisoformat(record["date"])
    return records


def load_records(path) -> list:
    return validate_records(json.loads(Path(path).read_text()))


def text_table(records) -> str:
    """A short markdown table: one row per (area, head_dim, causal, seqlen), one column per impl."""
    impls = list(dict.fromkeys(r["impl"] for r in records))
    rows = {}
    for r in records:
        rows.setdefault((r["area"], r["head_dim"], r["causal"], r["seqlen"], r["unit"]), {})[r["impl"]] = r["value"]
    lines = ["| area | D | mask | seqlen | unit | " + " | ".join(impls) + " |",
             "|---|---:|---|---:|---|" + "---:|" * len(impls)]
    for (area, head_dim, causal, seqlen, unit), values in rows.items():
        mask = "-" if area == "decode" else ("causal" if causal else "full")
        cells = " | ".join(f"{values[i]:.2f}" if i in values else "-" for i in impls)
        lines.append(f"| {area} | {head_dim} | {mask} | {seqlen} | {unit} | {cells} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- GPU part
def first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [""])[0][:120]


def _inputs(case: Case, torch, sets_needed):
    """Input sets for a varlen case: (q, k, v, grad_out, the same as (B, H, S, D) for SDPA)."""
    tokens = case.batch * case.seqlen
    shape = (tokens, case.heads, case.head_dim)
    grad = case.area == "backward"
    per_set = (5 if grad else 4) * tokens * case.heads * case.head_dim * 2
    sets = []
    for _ in range(sets_needed(per_set)):
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16).requires_grad_(grad) for _ in range(3))
        do = torch.randn(shape, device="cuda", dtype=torch.bfloat16) if grad else None
        bhsd = [t.detach().view(case.batch, case.seqlen, case.heads, case.head_dim).transpose(1, 2).contiguous()
                .requires_grad_(grad) for t in (q, k, v)]
        do_bhsd = do.view(case.batch, case.seqlen, case.heads, case.head_dim).transpose(1, 2).contiguous() if grad else None
        sets.append(((q, k, v), do, bhsd, do_bhsd))
    return sets


def _varlen_forwards(case: Case, torch):
    """impl -> (forward of one input set, whether it takes the SDPA layout); peers this torch lacks are left out."""
    import jitattn
    F = torch.nn.functional
    cu = torch.arange(0, case.batch + 1, device="cuda", dtype=torch.int32) * case.seqlen
    window = (-1, 0) if case.causal else (-1, -1)
    n = case.seqlen
    impls = {"jitattn": (lambda s: jitattn.varlen_attn(*s[0], cu, cu, n, n, window_size=window), False)}
    try:
        from torch.nn.attention.varlen import varlen_attn as torch_varlen
    except ImportError:
        torch_varlen = None
        print("  (torch-varlen skipped: this torch has no torch.nn.attention.varlen)", flush=True)
    if torch_varlen is not None:
        # torch 2.10 asks for causal with is_causal, later releases with window_size.
        params = inspect.signature(torch_varlen).parameters
        mask = {"window_size": window} if "window_size" in params else {"is_causal": case.causal}
        impls["torch-varlen"] = (lambda s: torch_varlen(*s[0], cu, cu, n, n, **mask), False)
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        sdpa_kernel = None
    for impl, backend in (("sdpa-cudnn", "CUDNN_ATTENTION"), ("sdpa-flash", "FLASH_ATTENTION")):
        if sdpa_kernel is None or not hasattr(SDPBackend, backend):
            print(f"  ({impl} skipped: this torch has no SDPBackend.{backend})", flush=True)
            continue

        def sdpa(s, backend=getattr(SDPBackend, backend)):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(*s[2], is_causal=case.causal)
        impls[impl] = (sdpa, True)
    return impls


def _varlen_timers(case: Case, args, torch, bench_util):
    """impl -> a function that times once and returns us; impls that fail on this case are left out."""
    sets = _inputs(case, torch, bench_util.sets_needed)
    timers = {}
    for impl, (forward, bhsd) in _varlen_forwards(case, torch).items():
        def fwd(s, forward=forward):
            return forward(s)

        def fwd_bwd(s, forward=forward, bhsd=bhsd):
            for leaf in s[2] if bhsd else s[0]:
                leaf.grad = None  # no accumulation kernel: each call writes fresh gradients
            forward(s).backward(s[3] if bhsd else s[1])

        call = fwd_bwd if case.area == "backward" else fwd
        try:  # one call first: a peer that rejects the shape is skipped here
            call(sets[0])
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - any failure of a peer only skips it
            print(f"  ({impl} skipped on {case.describe()}: {type(exc).__name__}: {first_line(exc)})",
                  flush=True)
            continue
        fns = [lambda s=s, call=call: call(s) for s in sets]
        fwd_fns = [lambda s=s, fwd=fwd: fwd(s) for s in sets]

        def timer(fns=fns, fwd_fns=fwd_fns):
            us = bench_util.time_us(fns, warmup=args.warmup, reps=args.reps)
            if case.area == "backward":
                us -= bench_util.time_us(fwd_fns, warmup=args.warmup, reps=args.reps)
            return us
        timers[impl] = timer
    return timers


def _decode_timers(case: Case, args, torch, bench_util):
    import jitattn
    F = torch.nn.functional
    sets = []
    for _ in range(bench_util.sets_needed(decode_bytes(case))):
        q = torch.randn(case.heads, case.head_dim, device="cuda", dtype=torch.float16)
        k, v = (torch.randn(case.seqlen, case.kv_heads, case.head_dim, device="cuda", dtype=torch.float16)
                for _ in range(2))
        sdpa = (q.view(1, case.heads, 1, case.head_dim), k.permute(1, 0, 2).contiguous().unsqueeze(0),
                v.permute(1, 0, 2).contiguous().unsqueeze(0))
        sets.append((q, k, v, sdpa))
    calls = {"jitattn": [lambda s=s: jitattn.single_decode_with_kv_cache(s[0], s[1], s[2]) for s in sets],
             "sdpa": [lambda s=s: F.scaled_dot_product_attention(*s[3], enable_gqa=case.heads != case.kv_heads)
                      for s in sets]}
    timers = {}
    for impl, fns in calls.items():
        try:
            fns[0]()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001
            print(f"  ({impl} skipped on {case.describe()}: {type(exc).__name__}: {first_line(exc)})",
                  flush=True)
            continue
        timers[impl] = lambda fns=fns: bench_util.time_us(fns, warmup=args.warmup, reps=args.reps)
    return timers


def collect(cases, timers_for, rounds: int, gpu: str, torch_version: str, date: str, interleaved) -> list:
    """Records of every case: `timers_for(case)` gives impl -> a function that times one call (us),
    `interleaved(timers, rounds)` runs them in turn (bench_util.interleaved_us). An impl whose
    timer fails mid-run is dropped from that case with a note; the others are kept."""
    records = []
    for case in cases:
        timers, failed = {}, set()
        for impl, timer in timers_for(case).items():
            def guarded(impl=impl, timer=timer):
                if impl in failed:
                    return math.nan
                try:
                    return timer()
                except Exception as exc:  # noqa: BLE001 - a peer's failure skips it, never the sweep
                    failed.add(impl)
                    print(f"  ({impl} failed on {case.describe()}: {type(exc).__name__}: "
                          f"{first_line(exc)})", flush=True)
                    return math.nan
            timers[impl] = guarded
        got = []
        for impl, us in interleaved(timers, rounds).items():
            if impl in failed:
                continue
            median = statistics.median(us)
            if median > 0:
                got.append(make_record(case, impl, throughput(case, median), gpu, torch_version, date))
        print(f"{case.describe()}: " + ", ".join(f"{r['impl']} {r['value']:.1f}" for r in got)
              + f" {UNITS[case.area]}", flush=True)
        records += got
        del timers  # the case's input sets go before the next case allocates its own
    return records


def run(cases, args) -> list:
    import torch

    import bench_util

    def timers_for(case):
        make = _decode_timers if case.area == "decode" else _varlen_timers
        return make(case, args, torch, bench_util)

    def interleaved(timers, rounds):
        try:
            return bench_util.interleaved_us(timers, rounds)
        finally:
            torch.cuda.empty_cache()

    return collect(cases, timers_for, args.rounds, torch.cuda.get_device_name(), torch.__version__.split("+")[0],
                   datetime.date.today().isoformat(), interleaved)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer lengths and repetitions (the GPU job's mode)")
    parser.add_argument("--areas", nargs="+", default=list(AREAS), choices=AREAS)
    parser.add_argument("--head-dims", nargs="+", type=int, default=list(HEAD_DIMS))
    parser.add_argument("--json", type=Path, help="write the records to this file")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU needed)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 2 with --quick, else 3)")
    parser.add_argument("--reps", type=int, help="timed calls per measurement (default 5 with --quick, else 30)")
    parser.add_argument("--warmup", type=int, help="untimed calls before each measurement (default 2 with --quick, else 5)")
    args = parser.parse_args(argv)
    # --quick must stay well under 2 minutes on an H100: the longest point (backward, 2 x 16k, D128 x 32
    # heads) is ~0.1 s a call, timed 2 rounds x 4 impls x (fwd+bwd, fwd) x 7 calls.
    args.rounds = args.rounds or (2 if args.quick else 3)
    args.reps = args.reps or (5 if args.quick else 30)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else 5)
    cases = plan(args.areas, args.quick, tuple(args.head_dims))
    if args.dry_run:
        impls = {"decode": DECODE_IMPLS}
        for case in cases:
            print(f"{case.describe()}: {', '.join(impls.get(case.area, VARLEN_IMPLS))} ({UNITS[case.area]})")
        print(f"{len(cases)} cases; {args.rounds} interleaved rounds of {args.reps} timed calls each")
        return 0
    records = validate_records(run(cases, args))
    print("\n" + text_table(records))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(records, indent=1) + "\n")
        print(f"\n{len(records)} records -> {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
