"""Varlen benchmark: jitattn.varlen_attn vs torch's own varlen_attn and SDPA on the same shapes in
the same run.

(a) prefill: bf16, batch 8 x 4096 tokens, D*H = 2048 (D64 x 32 heads, D128 x 16, D256 x 8),
    causal and non-causal; TFLOP/s count only unmasked work (4*T^2*D*H per sequence, half that
    causal). Peers: torch.nn.attention.varlen.varlen_attn and SDPA on (8, H, 4096, D).
(a') paged prefill: the D128 prefill rows with K/V in a page pool (page 16 and 256, pages a random
    permutation), beside the same keys contiguous and the peers (`--parts paged-prefill`).
(b) paged decode: 64 sequences x 4096 keys, 32 query / 8 KV heads, D128 bf16, page size 16, pages
    a random permutation of the pool, max_q=1, seqused_k=4096; us and TB/s (K+V pages read + q +
    out). Peer: SDPA (enable_gqa, or KV heads repeated outside the timing) on the dense
    (64,32,1,D) x (64,8,4096,D); torch's varlen_attn too where it takes block_table. With
    --decode-tiles, other decode tiles too, and each also on the same keys packed (no pages).
(c) skewed batch: causal bf16 D128 16 heads, lengths 128..16384 doubling (8 sequences);
    TFLOP/s vs torch's varlen_attn.
(d) host time per call of a tiny call (wall time over 10,000 calls), beside torch's.
(e) backward: bf16, 8 x 4096 tokens, D64 x 32 heads, D128 x 32, D256 x 16, causal and full;
    backward = (forward + backward) - forward, each timed as below; TFLOP/s with backward FLOPs
    = 2.5x forward FLOPs (causal half). Peers: torch's varlen_attn and SDPA (on (8, H, 4096, D)).
    Also jitattn in deterministic mode (torch.use_deterministic_algorithms(True), with torch's
    NaN fill of new tensors off so only the kernels' cost shows) and, with --bwd-tiles, other
    tile shapes of the backward kernel (for tuning; they must be in the cache). Then the skewed
    batch of (c) (causal D128 16 heads, lengths 128..16384) forward + backward vs torch's.
CUDA-event timing of device time (host time hidden), warm-up, cold L2 (each timed call reads a
different input set, the sets together >= 256 MB), median of the timed calls; the prefill,
paged-prefill and backward rows time their implementations in interleaved rounds (3 with --quick,
else 5) and report the median over rounds (the clocks drift within a job).
Run: python tools/bench_varlen.py [--quick] [--parts prefill paged-prefill decode skewed host backward]
     [--decode-tiles 1,1,32,6 1,1,64,3 1,1,32,3,1 ...]
     [--bwd-tiles 128,64,1 64,64,2 ...] [--bwd-variants other mma det peers skewed]
     [--bwd-producer auto|on|off] [--softcap CAP]
With --softcap, the prefill rows (and the backward's `softcap` variant) also time jitattn with
that logit soft cap (Gemma-2's is 50), beside the uncapped call.
"""
from __future__ import annotations

import argparse
import inspect
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # the repo, when jitattn is not installed
import jitattn  # noqa: E402
from bench_util import host_us_per_call, page_pools, sets_needed, time_us  # noqa: E402

BF16 = torch.bfloat16


# ---------------------------------------------------------------- peers
def torch_varlen():
    """(torch's varlen_attn or None, its parameter names)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, set()
    return varlen_attn, set(inspect.signature(varlen_attn).parameters)


def torch_window_kwargs(params: set, causal: bool) -> dict | None:
    """How torch's varlen_attn asks for causal/full attention (window_size on newer torch,
    is_causal on 2.10); None if it can't."""
    if "window_size" in params:
        return {"window_size": (-1, 0) if causal else (-1, -1)}
    if "is_causal" in params:
        return {"is_causal": causal}
    return None if causal else {}


def sdpa_has_enable_gqa() -> bool:
    q = torch.zeros(1, 4, 1, 64, device="cuda", dtype=BF16)
    kv = torch.zeros(1, 2, 8, 64, device="cuda", dtype=BF16)
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
        return True
    except TypeError:
        return False


def timed(fns, args, what):
    """Median us of fns (a list over input sets), or None with a note if a peer cannot run it."""
    if not fns:
        return None
    try:
        return time_us(fns, warmup=args.warmup, reps=args.reps)
    except Exception as exc:  # a peer that rejects the shape: report, keep going
        print(f"  ({what} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]})", flush=True)
        return None


def interleaved_median(timers, args):
    """Median us of each of `timers` (no-argument functions that time once: us, or None when the
    implementation cannot run) over args.rounds interleaved rounds (each timed once a round, in
    turn; None if any round was), and the first timer's per-round us. The H200's clocks drift
    within a job (the same kernel measured 639 then 564 TFLOP/s minutes apart, and SDPA's D128
    causal backward 442-517 between processes): timed one after another, two implementations
    differ by the drift; interleaved, each round meets every one at about the same clock."""
    rounds = [[timer() for timer in timers] for _ in range(args.rounds)]
    medians = [None if any(r[i] is None for r in rounds) else statistics.median(r[i] for r in rounds)
               for i in range(len(timers))]
    return medians, [r[0] for r in rounds]


def rounds_median(calls, args):
    """interleaved_median of timed(fns) for each (fns, what) of `calls`."""
    return interleaved_median([lambda f=f, what=what: timed(f, args, what) for f, what in calls], args)


def spread(flops, times):
    """'min-max' TFLOP/s of per-round times (None entries left out)."""
    tf = sorted(flops / t / 1e6 for t in times if t is not None and t > 0)
    return f"{tf[0]:.1f}-{tf[-1]:.1f}" if tf else "-"


def fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def ratio(ours, peer):
    return "-" if ours is None or peer is None else f"{peer / ours:.2f}x"


def sanity(ours, peer_fn, what):
    """Print a warning when jitattn and a peer disagree on the first input set."""
    try:
        peer = peer_fn()
    except Exception:
        return  # timed() reports the peer's failure
    diff = (ours.float() - peer.float()).abs().max().item()
    if not diff < 0.1:
        print(f"  WARNING: {what}: jitattn and the peer differ by {diff:.3g} (max abs)", flush=True)


def cu(lengths):
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    return torch.tensor(starts, dtype=torch.int32, device="cuda")


# ---------------------------------------------------------------- (a) prefill
def bench_prefill(args):
    batch, seq = 8, 4096
    fn, params = torch_varlen()
    print(f"\n### prefill: bf16, 8 x 4096 tokens, D*H = 2048; medians of {args.rounds} interleaved rounds\n")
    print("| D | heads | causal | jitattn us | jitattn TFLOP/s | torch varlen TFLOP/s | SDPA TFLOP/s "
          "| speedup vs torch varlen | speedup vs SDPA | jitattn min-max over rounds |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for head_dim in (64, 128, 256):
        heads = 2048 // head_dim
        tokens = batch * seq
        per_set = 4 * tokens * heads * head_dim * 2  # q, k, v, out
        cu_seq = cu([seq] * batch)
        sets = []
        for _ in range(sets_needed(per_set)):
            q, k, v = (torch.randn(tokens, heads, head_dim, device="cuda", dtype=BF16) for _ in range(3))
            sdpa = [t.view(batch, seq, heads, head_dim).transpose(1, 2).contiguous() for t in (q, k, v)]
            sets.append((q, k, v, sdpa))
        for causal in (False, True):
            window = (-1, 0) if causal else (-1, -1)
            flops = batch * 4 * seq * seq * head_dim * heads * (0.5 if causal else 1.0)
            ours = [lambda s=s: jitattn.varlen_attn(s[0], s[1], s[2], cu_seq, cu_seq, seq, seq, window_size=window)
                    for s in sets]
            kw = torch_window_kwargs(params, causal)
            theirs = ([lambda s=s: fn(s[0], s[1], s[2], cu_seq, cu_seq, seq, seq, **kw) for s in sets]
                      if fn is not None and kw is not None else [])
            sdpa = [lambda s=s: F.scaled_dot_product_attention(*s[3], is_causal=causal) for s in sets]
            sanity(ours[0](), lambda: sdpa[0]().transpose(1, 2).reshape(tokens, heads, head_dim),
                   f"prefill d{head_dim} causal={causal} vs SDPA")
            (t_ours, t_torch, t_sdpa), per_round = rounds_median(
                [(ours, "jitattn"), (theirs, "torch varlen_attn"), (sdpa, "SDPA")], args)
            tf = [None if t is None else flops / t / 1e6 for t in (t_ours, t_torch, t_sdpa)]
            print(f"| {head_dim} | {heads} | {causal} | {fmt(t_ours)} | {fmt(tf[0])} | {fmt(tf[1])} | {fmt(tf[2])} "
                  f"| {ratio(t_ours, t_torch)} | {ratio(t_ours, t_sdpa)} | {spread(flops, per_round)} |", flush=True)
            if args.softcap:
                capped = [lambda s=s: jitattn.varlen_attn(s[0], s[1], s[2], cu_seq, cu_seq, seq, seq,
                                                          window_size=window, softcap=args.softcap) for s in sets]
                t_cap = timed(capped, args, "jitattn softcap")
                print(f"|  | softcap {args.softcap:g} | {causal} | {fmt(t_cap)} "
                      f"| {fmt(None if t_cap is None else flops / t_cap / 1e6)} | | | {ratio(t_cap, t_torch)} "
                      f"| {ratio(t_cap, t_sdpa)} (cost {ratio(t_ours, t_cap)}) |", flush=True)
        del sets
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- (a') paged prefill
def bench_paged_prefill(args):
    """The prefill rows at D128 with K/V in a page pool (pages a random permutation), page 16
    and 256, beside the same keys contiguous (also with seqused_k, which every paged call
    passes) and the peers on the contiguous keys. The clocks drift over a run (power, heat: one
    H200 job measured contiguous 639 TFLOP/s first and 564 timed last), so the rows are timed in
    interleaved rounds (every call once per round) and each column is the median over rounds;
    the last column is contiguous's spread over the rounds."""
    batch, seq, head_dim, heads = 8, 4096, 128, 16
    tokens = batch * seq
    fn, params = torch_varlen()
    cu_seq = cu([seq] * batch)
    used = torch.full((batch,), seq, dtype=torch.int32, device="cuda")
    sets = []
    for _ in range(sets_needed(6 * tokens * heads * head_dim * 2)):  # q, k, v, out, and a pool of k, v
        q, k, v = (torch.randn(tokens, heads, head_dim, device="cuda", dtype=BF16) for _ in range(3))
        sdpa = [t.view(batch, seq, heads, head_dim).transpose(1, 2).contiguous() for t in (q, k, v)]
        sets.append((q, k, v, sdpa, page_pools(k, v, batch, seq)))
    print(f"\n### paged prefill: bf16 D{head_dim}, {heads} heads, {batch} x {seq} tokens, pages a random "
          "permutation of the pool; TFLOP/s as the prefill rows\n")
    print("| causal | contiguous TFLOP/s | page 16 TFLOP/s (vs contiguous) | page 256 TFLOP/s (vs contiguous) "
          "| torch varlen TFLOP/s | SDPA TFLOP/s | contiguous + seqused_k | contiguous min-max over rounds |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for causal in (False, True):
        window = (-1, 0) if causal else (-1, -1)
        flops = batch * 4 * seq * seq * head_dim * heads * (0.5 if causal else 1.0)
        contiguous = [lambda s=s: jitattn.varlen_attn(s[0], s[1], s[2], cu_seq, cu_seq, seq, seq, window_size=window)
                      for s in sets]

        def paged(page):
            return [lambda s=s: jitattn.varlen_attn(s[0], s[4][page][0], s[4][page][1], cu_seq, None, seq, seq,
                                                    window_size=window, seqused_k=used, block_table=s[4][page][2])
                    for s in sets]

        for page in (16, 256):
            sanity(paged(page)[0](), contiguous[0], f"paged prefill page {page} causal={causal} vs contiguous")
        kw = torch_window_kwargs(params, causal)
        theirs = ([lambda s=s: fn(s[0], s[1], s[2], cu_seq, cu_seq, seq, seq, **kw) for s in sets]
                  if fn is not None and kw is not None else [])
        sdpa = [lambda s=s: F.scaled_dot_product_attention(*s[3], is_causal=causal) for s in sets]
        used_k = [lambda s=s: jitattn.varlen_attn(s[0], s[1], s[2], cu_seq, cu_seq, seq, seq, window_size=window,
                                                  seqused_k=used) for s in sets]
        calls = [(contiguous, "jitattn"), (paged(16), "jitattn page 16"), (paged(256), "jitattn page 256"),
                 (theirs, "torch varlen_attn"), (sdpa, "SDPA"), (used_k, "jitattn seqused_k")]
        times, per_round = rounds_median(calls, args)
        tf = [None if t is None else flops / t / 1e6 for t in times]
        vs = lambda t: "-" if t is None or times[0] is None else f"{times[0] / t:.2f}x"
        print(f"| {causal} | {fmt(tf[0])} | {fmt(tf[1])} ({vs(times[1])}) | {fmt(tf[2])} ({vs(times[2])}) "
              f"| {fmt(tf[3])} | {fmt(tf[4])} | {fmt(tf[5])} | {spread(flops, per_round)} |", flush=True)
    del sets
    torch.cuda.empty_cache()


# ---------------------------------------------------------------- (b) paged decode
def bench_decode(args):
    batch, kv_len, h_q, h_kv, head_dim, page = 64, 4096, 32, 8, 128, 16
    fn, params = torch_varlen()
    gqa = sdpa_has_enable_gqa()
    kv_bytes = 2 * batch * kv_len * h_kv * head_dim * 2
    io_bytes = kv_bytes + 2 * batch * h_q * head_dim * 2  # K+V pages, q, out
    cu_q = cu([1] * batch)
    seqused = torch.full((batch,), kv_len, dtype=torch.int32, device="cuda")
    sets = []
    for _ in range(sets_needed(kv_bytes)):
        q = torch.randn(batch, h_q, head_dim, device="cuda", dtype=BF16)
        k_dense = torch.randn(batch, kv_len, h_kv, head_dim, device="cuda", dtype=BF16)
        v_dense = torch.randn(batch, kv_len, h_kv, head_dim, device="cuda", dtype=BF16)
        k_pool, v_pool, table = page_pools(k_dense.view(-1, h_kv, head_dim), v_dense.view(-1, h_kv, head_dim),
                                           batch, kv_len, (page,))[page]
        ks, vs = (t.permute(0, 2, 1, 3).contiguous() for t in (k_dense, v_dense))  # (B, H_kv, L, D)
        # --decode-tiles also times the same keys packed (no block_table): what the paging costs
        packed = (k_dense.view(-1, h_kv, head_dim), v_dense.view(-1, h_kv, head_dim)) if args.decode_tiles else None
        del k_dense, v_dense
        if not gqa:  # repeat the KV heads here, outside the timing
            ks, vs = ks.repeat_interleave(h_q // h_kv, dim=1), vs.repeat_interleave(h_q // h_kv, dim=1)
        sets.append((q, k_pool, v_pool, table, q.view(batch, h_q, 1, head_dim), ks, vs, packed))
    cu_k = cu([kv_len] * batch)

    def ours(s, splits):
        return jitattn.varlen_attn(s[0], s[1], s[2], cu_q, None, 1, kv_len, enable_gqa=True, seqused_k=seqused,
                                   block_table=s[3], num_splits=splits)

    def ours_packed(s, splits, used=None):
        return jitattn.varlen_attn(s[0], s[7][0], s[7][1], cu_q, cu_k, 1, kv_len, enable_gqa=True,
                                   num_splits=splits, seqused_k=used)

    sdpa_kw = {"enable_gqa": True} if gqa else {}
    sdpa = [lambda s=s: F.scaled_dot_product_attention(s[4], s[5], s[6], **sdpa_kw) for s in sets]
    sanity(ours(sets[0], None), lambda: sdpa[0]().view(batch, h_q, head_dim), "paged decode vs SDPA")
    rows = [("jitattn (num_splits=None)", timed([lambda s=s: ours(s, None) for s in sets], args, "jitattn"))]
    rows.append(("jitattn (num_splits=1)", timed([lambda s=s: ours(s, 1) for s in sets], args, "jitattn splits=1")))
    if fn is not None and "block_table" in params:
        theirs = [lambda s=s: fn(s[0], s[1], s[2], cu_q, None, 1, kv_len, enable_gqa=True, seqused_k=seqused,
                                 block_table=s[3]) for s in sets]
        rows.append(("torch varlen_attn (paged)", timed(theirs, args, "torch varlen_attn")))
    else:
        rows.append(("torch varlen_attn (paged)", None))
    rows.append((f"SDPA dense ({'enable_gqa' if gqa else 'KV repeated'})", timed(sdpa, args, "SDPA")))
    for tile in args.decode_tiles or []:  # tuning: other decode tiles, automatic and explicit splits
        shape = tuple(int(x) for x in tile.split(","))
        with _with_decode_tile(shape, head_dim):
            sanity(ours(sets[0], None), lambda: sdpa[0]().view(batch, h_q, head_dim), f"decode tile {tile} vs SDPA")
            for splits in (None, 2, 4):
                rows.append((f"jitattn tile {tile} (num_splits={splits})",
                             timed([lambda s=s: ours(s, splits) for s in sets], args, f"jitattn {tile}")))
            sanity(ours_packed(sets[0], None), lambda: sdpa[0]().view(batch, h_q, head_dim),
                   f"decode tile {tile} packed vs SDPA")
            rows.append((f"jitattn tile {tile}, packed KV (num_splits=None)",
                         timed([lambda s=s: ours_packed(s, None) for s in sets], args, f"jitattn {tile} packed")))
            # packed with seqused_k (which every paged call passes): what of the paging cost is that
            rows.append((f"jitattn tile {tile}, packed KV + seqused_k (num_splits=None)",
                         timed([lambda s=s: ours_packed(s, None, seqused) for s in sets], args,
                               f"jitattn {tile} packed seqused_k")))
    print(f"\n### paged decode: bf16 D{head_dim}, {batch} x {kv_len} keys, {h_q}/{h_kv} heads, page {page}, "
          f"max_q=1\n")
    print("| implementation | us | TB/s | jitattn speedup |")
    print("|---|---:|---:|---:|")
    base = rows[0][1]
    for name, t in rows:
        tbs = None if t is None else io_bytes / t / 1e6
        print(f"| {name} | {fmt(t)} | {fmt(tbs, '.2f')} | {ratio(base, t)} |", flush=True)
    del sets
    torch.cuda.empty_cache()


def _with_decode_tile(tile, head_dim):
    """A context in which decode-shaped calls (bf16, packed and paged) run the decode tile `tile`
    = (warps_m, m_tiles, block_n, stages[, tma]) instead of VarlenSpec.default_tile (a fifth
    field: K/V by TMA (1) or cp.async (0), else the calls' default): the public override."""
    from jitattn.varlen.plan import override_spec

    fields = dict(zip(("warps_m", "m_tiles", "block_n", "stages"), tile[:4]))
    if len(tile) > 4:
        fields["tma"] = bool(tile[4])
    return override_spec("varlen", when={"decode": True, "head_dim": head_dim, "dtype": "bfloat16"}, **fields)


def bench_skewed(args):
    lengths = [128 << i for i in range(8)]  # 128 .. 16384
    heads, head_dim = 16, 128
    tokens = sum(lengths)
    flops = sum(2 * n * n * head_dim * heads for n in lengths)  # causal: half of 4*T^2*D*H
    fn, params = torch_varlen()
    kw = torch_window_kwargs(params, True)
    order = [3, 7, 0, 5, 1, 6, 2, 4]  # mixed order, as a scheduler would pack them
    lengths = [lengths[i] for i in order]
    cu_seq, longest = cu(lengths), max(lengths)
    sets = []
    for _ in range(sets_needed(4 * tokens * heads * head_dim * 2)):
        sets.append(tuple(torch.randn(tokens, heads, head_dim, device="cuda", dtype=BF16) for _ in range(3)))
    ours = [lambda s=s: jitattn.varlen_attn(*s, cu_seq, cu_seq, longest, longest, window_size=(-1, 0)) for s in sets]
    theirs = ([lambda s=s: fn(*s, cu_seq, cu_seq, longest, longest, **kw) for s in sets]
              if fn is not None and kw is not None else [])
    if theirs:
        sanity(ours[0](), theirs[0], "skewed vs torch varlen_attn")
    t_ours, t_torch = timed(ours, args, "jitattn"), timed(theirs, args, "torch varlen_attn")
    print(f"\n### skewed batch: causal bf16 D{head_dim}, {heads} heads, lengths {sorted(lengths)}\n")
    print("| implementation | us | TFLOP/s | jitattn speedup |")
    print("|---|---:|---:|---:|")
    for name, t in (("jitattn", t_ours), ("torch varlen_attn", t_torch)):
        print(f"| {name} | {fmt(t)} | {fmt(None if t is None else flops / t / 1e6)} | {ratio(t_ours, t)} |", flush=True)
    del sets
    torch.cuda.empty_cache()


def bench_host(args):
    """Host time per call of a tiny call (2 sequences, 16 keys, decode-shaped and prefill-shaped):
    wall time over 10,000 calls / count, beside torch's varlen_attn on the same call."""
    fn, params = torch_varlen()
    kw = torch_window_kwargs(params, True)
    print("\n### host time per call: 2 sequences x 16 keys, bf16 D128, 10,000 calls\n")
    print("| call | jitattn us | torch varlen_attn us |")
    print("|---|---:|---:|")
    for name, lq in (("decode-shaped (max_q=1, 32/8 heads)", 1), ("prefill-shaped (16 queries, causal)", 16)):
        heads_q, heads_kv = (32, 8) if lq == 1 else (8, 8)
        cu_q, cu_k = cu([lq, lq]), cu([16, 16])
        q = torch.randn(2 * lq, heads_q, 128, device="cuda", dtype=BF16)
        k = torch.randn(32, heads_kv, 128, device="cuda", dtype=BF16)
        v = torch.randn_like(k)
        ours = host_us_per_call(lambda: jitattn.varlen_attn(q, k, v, cu_q, cu_k, lq, 16, window_size=(-1, 0),
                                                             enable_gqa=heads_q != heads_kv))
        theirs = None
        if fn is not None and kw is not None and heads_q == heads_kv:
            theirs = host_us_per_call(lambda: fn(q, k, v, cu_q, cu_k, lq, 16, **kw))
        print(f"| {name} | {ours:.1f} | {fmt(theirs)} |", flush=True)


# ---------------------------------------------------------------- (e) backward
WGMMA_BWD_DIMS = frozenset({64, 128, 256})  # VarlenBackwardSpec.wgmma_fits


def _with_tile(tile):
    """A context in which jitattn's backward runs the tile `tile` = (block_n, block_m, warps_q)
    of the mma.sync rung, "mma" its default mma.sync tile, "other" the wgmma rung with the
    producer warpgroup where the default runs it without, and the other way round, or for None
    its default (on sm_90: the wgmma rung at head_dim 64/128/256). Public overrides of the rule."""
    import contextlib

    from jitattn.varlen.plan import override_spec

    stack = contextlib.ExitStack()
    if tile == "other":
        for head_dim, producer in _producer_by_head_dim().items():
            stack.enter_context(override_spec("varlen_backward", when={"head_dim": head_dim, "wgmma": True},
                                              producer=not producer))
    elif tile == "mma":
        stack.enter_context(override_spec("varlen_backward", wgmma=False))
    elif tile is not None:
        stack.enter_context(override_spec("varlen_backward", wgmma=False,
                                          **dict(zip(("block_n", "block_m", "warps_q"), tile))))
    return stack


def _producer_by_head_dim() -> dict[int, bool]:
    """Whether a bf16 backward call on sm_90 runs the producer warpgroup, per wgmma head_dim (the
    rule with the active overrides)."""
    from jitattn.varlen.spec import VarlenBackwardSpec

    return {d: VarlenBackwardSpec.for_call(d, "bfloat16", False, False, True).producer for d in sorted(WGMMA_BWD_DIMS)}


def _deterministic(on: bool):
    import contextlib

    @contextlib.contextmanager
    def ctx():
        if not on:
            yield
            return
        import torch.utils.deterministic as det

        saved, saved_fill = torch.are_deterministic_algorithms_enabled(), det.fill_uninitialized_memory
        torch.use_deterministic_algorithms(True)
        det.fill_uninitialized_memory = False
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(saved)
            det.fill_uninitialized_memory = saved_fill

    return ctx()


def _train_calls(forward, sets):
    """(forward only, forward + backward) calls per input set; each set is (leaves, grad_out, ...)."""
    def fwd(s):
        return forward(s)

    def fwd_bwd(s):
        for t in s[0]:
            t.grad = None
        forward(s).backward(s[1])

    return [lambda s=s: fwd(s) for s in sets], [lambda s=s: fwd_bwd(s) for s in sets]


def _backward_us(forward, sets, args, what):
    """Median backward time: (forward + backward) - forward, or None."""
    only, both = _train_calls(forward, sets)
    t_fwd = timed(only, args, what + " forward")
    t_both = timed(both, args, what + " forward+backward")
    return None if t_fwd is None or t_both is None else t_both - t_fwd


def _backward_rounds(entries, args):
    """interleaved_median of the backward us of each entry (what, forward, sets, context factory
    or None)."""
    import contextlib

    def timer(what, forward, sets, ctx):
        def run():
            with (ctx or contextlib.nullcontext)():
                return _backward_us(forward, sets, args, what)
        return run

    return interleaved_median([timer(*e) for e in entries], args)


def bench_backward(args):
    """--bwd-producer on / off: every wgmma backward with (without) the producer, by the public override."""
    import contextlib

    from jitattn.varlen.plan import override_spec

    with (override_spec("varlen_backward", when={"wgmma": True}, producer=args.bwd_producer == "on")
          if args.bwd_producer != "auto" else contextlib.nullcontext()):
        _bench_backward(args)


def _bench_backward(args):
    batch, seq = 8, 4096
    fn, params = torch_varlen()
    from jitattn.varlen import backward_launch as launch
    from jitattn.varlen.spec import VarlenBackwardSpec

    wgmma = launch.wgmma_allowed(torch.device("cuda"))
    producer_dims = [d for d, producer in _producer_by_head_dim().items() if producer]
    persistent_dims = [d for d in producer_dims if VarlenBackwardSpec.for_call(d, "bfloat16", False, False, True).persistent]
    variants = set(args.bwd_variants)
    tiles = [None] + [v for v in ("other", "mma") if v in variants]
    tiles += [tuple(int(x) for x in t.split(",")) for t in (args.bwd_tiles or [])]
    print("\n### backward: bf16, 8 x 4096 tokens; backward = (forward + backward) - forward; "
          f"backward FLOPs = 2.5x forward; default rung {'wgmma at D64/D128/D256' if wgmma else 'mma.sync'} "
          f"(producer warpgroup at {producer_dims or 'no head_dim'}, "
          f"persistent at {persistent_dims or 'no head_dim'})\n")
    print(f"medians of {args.rounds} interleaved rounds (every row's calls timed once per round, in turn)\n")
    print("| D | heads | causal | jitattn us | jitattn TFLOP/s | deterministic TFLOP/s | torch varlen TFLOP/s "
          "| SDPA TFLOP/s | vs torch varlen | vs SDPA | deterministic cost | jitattn min-max over rounds |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for head_dim, heads in ((64, 32), (128, 32), (256, 16)):
        if head_dim not in args.bwd_dims:
            continue
        tokens = batch * seq
        per_set = 5 * tokens * heads * head_dim * 2  # q, k, v, out, dO (and as many gradients)
        cu_seq = cu([seq] * batch)
        sets = []
        for _ in range(sets_needed(per_set)):
            q, k, v = (torch.randn(tokens, heads, head_dim, device="cuda", dtype=BF16).requires_grad_() for _ in range(3))
            do = torch.randn(tokens, heads, head_dim, device="cuda", dtype=BF16)
            sdpa = [t.detach().view(batch, seq, heads, head_dim).transpose(1, 2).contiguous().requires_grad_()
                    for t in (q, k, v)]
            sets.append(((q, k, v), do, sdpa, do.view(batch, seq, heads, head_dim).transpose(1, 2).contiguous()))
        rungs = tiles if wgmma and head_dim in WGMMA_BWD_DIMS else [t for t in tiles if t not in ("mma", "other")]
        for causal in (False, True):
            window = (-1, 0) if causal else (-1, -1)
            flops = 2.5 * batch * 4 * seq * seq * head_dim * heads * (0.5 if causal else 1.0)
            ours = lambda s: jitattn.varlen_attn(*s[0], cu_seq, cu_seq, seq, seq, window_size=window)
            sdpa_sets = [(s[2], s[3]) for s in sets]
            # (result key, what, forward, sets, context): timed in interleaved rounds.
            entries = [(tile, f"jitattn tile={tile}", ours, sets, lambda tile=tile: _with_tile(tile)) for tile in rungs]
            if "det" in variants:
                entries.append(("det", "jitattn deterministic", ours, sets, lambda: _deterministic(True)))
            kw = torch_window_kwargs(params, causal)
            if fn is not None and kw is not None and "peers" in variants:
                entries.append(("torch", "torch varlen_attn", lambda s: fn(*s[0], cu_seq, cu_seq, seq, seq, **kw), sets,
                                None))
            if "peers" in variants:
                entries.append(("sdpa", "SDPA", lambda s: F.scaled_dot_product_attention(*s[0], is_causal=causal),
                                sdpa_sets, None))
            if "softcap" in variants:
                capped = lambda s: jitattn.varlen_attn(*s[0], cu_seq, cu_seq, seq, seq, window_size=window,
                                                       softcap=args.softcap or 50.0)
                entries.append(("softcap", "jitattn softcap", capped, sets, None))
            medians, per_round = _backward_rounds([e[1:] for e in entries], args)
            results = {e[0]: t for e, t in zip(entries, medians)}
            t_det, t_torch, t_sdpa = results.get("det"), results.get("torch"), results.get("sdpa")
            t_ours = results[None]
            _sanity_grads(ours, sets[0], lambda: F.scaled_dot_product_attention(*sdpa_sets[0][0], is_causal=causal),
                          sdpa_sets[0], (batch, seq, heads, head_dim), f"backward d{head_dim} causal={causal} vs SDPA")
            tf = lambda t: None if t is None or t <= 0 else flops / t / 1e6
            cost = "-" if t_ours is None or t_det is None else f"{t_det / t_ours:.2f}x"
            print(f"| {head_dim} | {heads} | {causal} | {fmt(t_ours)} | {fmt(tf(t_ours))} | {fmt(tf(t_det))} "
                  f"| {fmt(tf(t_torch))} | {fmt(tf(t_sdpa))} | {ratio(t_ours, t_torch)} | {ratio(t_ours, t_sdpa)} "
                  f"| {cost} | {spread(flops, per_round)} |", flush=True)
            for tile in rungs[1:] + (["softcap"] if "softcap" in results else []):
                t = results[tile]
                other = "wgmma with producer" if head_dim not in producer_dims else "wgmma without producer"
                name = ({"mma": "mma.sync rung", "other": other, "softcap": f"softcap {args.softcap or 50.0:g}"}.get(tile)
                        or f"mma.sync n{tile[0]}m{tile[1]}q{tile[2]}")
                print(f"|  | {name} | {causal} | {fmt(t)} | {fmt(tf(t))} | | | "
                      f"| {ratio(t, t_torch)} | {ratio(t, t_sdpa)} | | |", flush=True)
        del sets
        torch.cuda.empty_cache()
    if "skewed" in variants:
        bench_backward_skewed(args)


def _sanity_grads(ours, s, sdpa_forward, sdpa_set, shape, what):
    """Warn when jitattn's and SDPA's gradients of the first input set disagree."""
    try:
        for t in list(s[0]) + list(sdpa_set[0]):
            t.grad = None
        ours(s).backward(s[1])
        sdpa_forward().backward(sdpa_set[1])
        batch, seq, heads, head_dim = shape
        for name, a, b in zip("qkv", s[0], sdpa_set[0]):
            peer = b.grad.transpose(1, 2).reshape(batch * seq, heads, head_dim)
            diff = (a.grad.float() - peer.float()).abs().max().item()
            scale = peer.float().abs().max().item()
            if not diff <= 0.05 * scale:
                print(f"  WARNING: {what}: d{name} differs by {diff:.3g} (max abs; largest {scale:.3g})", flush=True)
    except Exception as exc:  # report, keep going
        print(f"  ({what} sanity check failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]})", flush=True)


def bench_backward_skewed(args):
    lengths = [128 << i for i in range(8)]  # 128 .. 16384
    heads, head_dim = 16, 128
    tokens = sum(lengths)
    flops = 2.5 * sum(2 * n * n * head_dim * heads for n in lengths)  # causal
    fn, params = torch_varlen()
    kw = torch_window_kwargs(params, True)
    order = [3, 7, 0, 5, 1, 6, 2, 4]
    lengths = [lengths[i] for i in order]
    cu_seq, longest = cu(lengths), max(lengths)
    sets = []
    for _ in range(sets_needed(5 * tokens * heads * head_dim * 2)):
        leaves = tuple(torch.randn(tokens, heads, head_dim, device="cuda", dtype=BF16).requires_grad_() for _ in range(3))
        sets.append((leaves, torch.randn(tokens, heads, head_dim, device="cuda", dtype=BF16)))
    ours = lambda s: jitattn.varlen_attn(*s[0], cu_seq, cu_seq, longest, longest, window_size=(-1, 0))
    entries = [("jitattn", ours, sets, None), ("jitattn deterministic", ours, sets, lambda: _deterministic(True))]
    if fn is not None and kw is not None:
        entries.append(("torch varlen_attn", lambda s: fn(*s[0], cu_seq, cu_seq, longest, longest, **kw), sets, None))
    (t_ours, t_det, *rest), _ = _backward_rounds(entries, args)
    t_torch = rest[0] if rest else None
    print(f"\n### backward, skewed batch: causal bf16 D{head_dim}, {heads} heads, lengths {sorted(lengths)}\n")
    print("| implementation | backward us | TFLOP/s | jitattn speedup |")
    print("|---|---:|---:|---:|")
    for name, t in (("jitattn", t_ours), ("jitattn deterministic", t_det), ("torch varlen_attn", t_torch)):
        print(f"| {name} | {fmt(t)} | {fmt(None if t is None or t <= 0 else flops / t / 1e6)} | {ratio(t_ours, t)} |",
              flush=True)
    del sets
    torch.cuda.empty_cache()


PARTS = {"prefill": bench_prefill, "paged-prefill": bench_paged_prefill, "decode": bench_decode, "skewed": bench_skewed, "host": bench_host,
         "backward": bench_backward}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer timed calls (10 instead of 30)")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS))
    parser.add_argument("--decode-tiles", nargs="*", metavar="WM,MT,N,S[,TMA]",
                        help="paged decode: also time these (warps_m, m_tiles, block_n, stages[, tma 0/1]) decode "
                             "tiles (compiled on first use) at num_splits None, 2 and 4")
    parser.add_argument("--bwd-tiles", nargs="*", metavar="N,M,Q",
                        help="backward: also time these (block_n, block_m, warps_q) tiles (prebuilt)")
    parser.add_argument("--bwd-variants", nargs="*", default=["other", "mma", "det", "peers", "skewed"],
                        choices=["other", "mma", "det", "peers", "skewed", "softcap"],
                        help="backward rows beside the default: the other wgmma variant (with / without the "
                             "producer warpgroup), the mma.sync rung, deterministic mode, torch's varlen_attn and "
                             "SDPA, the skewed batch, the logit soft cap (--softcap, default 50)")
    parser.add_argument("--softcap", type=float, default=None,
                        help="prefill (and the backward's softcap variant): also time jitattn with this logit soft cap")
    parser.add_argument("--bwd-dims", nargs="*", type=int, default=[64, 128, 256],
                        help="backward: the head dims to run (64, 128, 256)")
    parser.add_argument("--bwd-producer", choices=["auto", "on", "off"], default="auto",
                        help="backward: the wgmma rung with the producer warpgroup (on), without (off), or "
                             "jitattn's default (auto)")
    args = parser.parse_args()
    args.warmup, args.reps = (3, 10) if args.quick else (5, 30)
    args.rounds = 3 if args.quick else 5  # paged-prefill: interleaved rounds (clock drift)
    fn, params = torch_varlen()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"torch varlen_attn: {'-' if fn is None else '(' + ', '.join(sorted(params)) + ')'}  "
          f"median of {args.reps} calls after {args.warmup} warm-up, cold L2")
    for part in args.parts:
        PARTS[part](args)


if __name__ == "__main__":
    main()
