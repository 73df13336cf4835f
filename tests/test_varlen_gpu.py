"""jitattn.varlen_attn / varlen_attn_out on a GPU against the float64 reference (skipped without a GPU).

Every output is compared with jitattn.reference.varlen_attn_reference run in float64 on the same
inputs; outputs come from NaN-poisoned allocator blocks (an unwritten row reads NaN, never a
stale zero) and key/value rows that must not be read (seqused_k slot tails, unused pages, rows
after cu_seq_k[-1]) hold NaN. Head dims 64/128/256 only, fp16 and bf16: what cache/gpu-tests.toml
holds for the strict (no-compile) GPU run. Contract: shared/spec/varlen.md.
"""
import importlib
import inspect
import itertools
import random

import pytest
import torch

import jitattn
from jitattn.varlen.spec import PERSISTENT_FORWARD_HEAD_DIMS
from tests.gpu_utils import rel_error
from tests.varlen_utils import DEVICE, TOL, Batch, check, close, cu, make_batch, reference, row_range, run

pytestmark = pytest.mark.gpu

F16, BF16 = torch.float16, torch.bfloat16
HEAD_DIMS = [64, 128, 256]
DTYPES = [F16, BF16]
# full, causal, causal sliding, diagonal only, general (left, right), left=0 with right>0,
# left-only (right unbounded), right-only (left unbounded)
WINDOWS = [(-1, -1), (-1, 0), (128, 0), (0, 0), (37, 11), (0, 64), (200, -1), (-1, 5)]
HEADS = [(8, 8), (8, 2), (16, 2)]  # GQA ratios 1, 4, 8


def skewed_lengths(rng: random.Random):
    """(len_q, len_k) for ~10 sequences: 0/1/short/long queries; keys equal to the queries, a
    prefix longer, fewer than the queries, or unrelated; one sequence with queries but no keys
    and one with keys but no queries."""
    len_q = [0, 1, 2, 17, 64, 129, 700, 1500]
    rng.shuffle(len_q)
    len_k = []
    for lq in len_q:
        kind = rng.randrange(4)
        len_k.append([lq, lq + rng.randint(1, 300), lq // 2, rng.randint(0, 2000)][kind])
    len_q += [5, 0]
    len_k += [0, 9]
    order = list(range(len(len_q)))
    rng.shuffle(order)
    return [len_q[i] for i in order], [len_k[i] for i in order]


# ---------------------------------------------------------------- random skewed batches x windows
SKEWED = list(itertools.product(HEAD_DIMS, DTYPES, WINDOWS, [False, True]))


@pytest.mark.parametrize("case", range(len(SKEWED)), ids=[f"d{d}-{str(t)[6:]}-w{w[0]}_{w[1]}-{'paged' if p else 'packed'}"
                                                         for d, t, w, p in SKEWED])
def test_skewed_batch_matches_reference(case):
    head_dim, dtype, window, paged = SKEWED[case]
    rng = random.Random(case)
    h_q, h_kv = HEADS[rng.randrange(3)]
    want_lse = rng.random() < 0.6
    num_splits = rng.choice([None, 1, 2])
    len_q, len_k = skewed_lengths(rng)
    b = make_batch(len_q, len_k, h_q, h_kv, head_dim, dtype, seed=case, paged=paged,
                   page_size=rng.choice([1, 16, 256]), slack=rng.randint(0, 40), use_seqused=rng.random() < 0.3,
                   cu_seq_k_paged=rng.choice(["none", "used"]))
    out, lse = run(b, window=window, num_splits=num_splits, want_lse=want_lse)
    check(b, out, lse, reference(b, window), f"window={window} splits={num_splits}")


@pytest.mark.parametrize("wgmma", ["0", "1"])
@pytest.mark.parametrize("case", range(0, len(SKEWED), 7))
def test_both_prefill_rungs_match_reference(case, wgmma, monkeypatch):
    """On sm_90 prefill runs the wgmma kernels (JITATTN_WGMMA=1, the default); the mma.sync ones
    serve other GPUs and JITATTN_WGMMA=0. Both, on every 7th skewed case."""
    monkeypatch.setenv("JITATTN_WGMMA", wgmma)
    test_skewed_batch_matches_reference(case)


# ---------------------------------------------------------------- the two prefill schedules
# Calls take the persistent kernel at D64 / D128 (VarlenSpec.for_call: a CTA per SM walks
# the row blocks); the other schedule (a CTA per row block) must give the same bits.
PERSISTENT = [(d, t, w, p) for d, t, w, p in SKEWED if d in PERSISTENT_FORWARD_HEAD_DIMS]


def _scheduled(head_dim: int, persistent: bool):
    """Within the block the wgmma prefill calls with the TMA producer at `head_dim` run
    VarlenSpec(..., persistent=persistent) (the public override of the call rule)."""
    from jitattn.varlen.plan import override_spec

    return override_spec("varlen", when={"wgmma": True, "tma": True, "decode": False, "head_dim": head_dim},
                         persistent=persistent)


@pytest.mark.parametrize("case", range(len(PERSISTENT)),
                         ids=[f"d{d}-{str(t)[6:]}-w{w[0]}_{w[1]}-{'paged' if p else 'packed'}" for d, t, w, p in PERSISTENT])
def test_persistent_prefill_matches_reference_and_the_other_schedule_bitwise(case):
    """The persistent kernel (a CTA per SM walking the row blocks, VarlenSpec.persistent) on the
    skewed batches of every window, GQA, splits, lse, paged and packed: the float64 reference,
    the same bits as the kernel a CTA per row block (each row block's arithmetic is a CTA's),
    and the same bits again on a second run."""
    head_dim, dtype, window, paged = PERSISTENT[case]
    rng = random.Random(900 + case)
    h_q, h_kv = HEADS[rng.randrange(3)]
    num_splits = rng.choice([None, 1, 2])
    len_q, len_k = skewed_lengths(rng)
    b = make_batch(len_q, len_k, h_q, h_kv, head_dim, dtype, seed=900 + case, paged=paged,
                   page_size=rng.choice([1, 16, 256]), slack=rng.randint(0, 40), use_seqused=rng.random() < 0.3)
    with _scheduled(head_dim, persistent=False):
        per_block = run(b, window=window, num_splits=num_splits, want_lse=True)
    with _scheduled(head_dim, persistent=True):
        out, lse = run(b, window=window, num_splits=num_splits, want_lse=True)
    check(b, out, lse, reference(b, window), f"persistent window={window} splits={num_splits}")
    assert torch.equal(out, per_block[0]) and torch.equal(lse, per_block[1]), "the two schedules differ"
    again = run(b, window=window, num_splits=num_splits, want_lse=True)
    assert torch.equal(again[0], out) and torch.equal(again[1], lse), "persistent kernel not run-to-run identical"


# ---------------------------------------------------------------- logit soft cap
SOFT_CAP = list(itertools.product(HEAD_DIMS, DTYPES, ["prefill", "decode", "paged-prefill", "paged-decode"]))


@pytest.mark.parametrize("wgmma", ["0", "1"])
@pytest.mark.parametrize("case", range(len(SOFT_CAP)), ids=[f"d{d}-{str(t)[6:]}-{k}" for d, t, k in SOFT_CAP])
def test_soft_cap_matches_reference(case, wgmma, monkeypatch):
    """Logits cap * tanh(scale * s / cap) (Gemma-2's soft cap) on every tile shape and rung,
    with GQA, windows, splits and lse; q is scaled so the logits reach several times the cap
    (the uncapped result is far away: the cap is computed, not dropped)."""
    monkeypatch.setenv("JITATTN_WGMMA", wgmma)
    head_dim, dtype, kind = SOFT_CAP[case]
    rng = random.Random(300 + case)
    decode, paged = "decode" in kind, "paged" in kind
    len_k = [rng.randint(1, 700) for _ in range(6)] + [1500]
    len_q = [1] * len(len_k) if decode else [min(n, rng.randint(1, 400)) for n in len_k]
    b = make_batch(len_q, len_k, 16, 2, head_dim, dtype, seed=300 + case, paged=paged, page_size=16,
                   use_seqused=case % 2 == 0, q_gain=4.0)
    window = [(-1, 0), (-1, -1), (100, 0), (37, 11)][case % 4]
    cap = [2.0, 8.0][case % 2]
    num_splits = [None, 1, 3][case % 3]
    out, lse = run(b, window=window, num_splits=num_splits, want_lse=True, softcap=cap)
    check(b, out, lse, reference(b, window, softcap=cap), f"softcap={cap} window={window}")
    uncapped, _ = reference(b, window)
    rows = slice(0, sum(b.len_q))
    assert rel_error(out[rows], uncapped[rows]) > 5 * TOL[dtype][0], "soft cap: the result is the uncapped one"


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("cap", [8.0, 1.5])
def test_poly_tanh_soft_cap_matches_reference(head_dim, cap):
    """VarlenSpec.poly_tanh (the soft cap's tanh on the FMA pipe within |x| <= 1, the hardware's
    beyond) on the call's own kernel: cap 8 keeps these logits (~N(0, 1)) within the cubic's
    reach, cap 1.5 sends many tiles past it (the tile's other path). Against float64, and not the
    default tanh's bits (the override ran)."""
    from jitattn.varlen.plan import override_spec

    rng = random.Random(700 + head_dim)
    len_k = [rng.randint(1, 700) for _ in range(5)] + [1200]
    len_q = [min(n, rng.randint(1, 400)) for n in len_k]
    b = make_batch(len_q, len_k, 16, 4, head_dim, torch.bfloat16, seed=700 + head_dim)
    default = run(b, window=(-1, 0), want_lse=True, softcap=cap)
    with override_spec("varlen", poly_tanh=True):
        out, lse = run(b, window=(-1, 0), want_lse=True, softcap=cap)
    check(b, out, lse, reference(b, (-1, 0), softcap=cap), f"poly_tanh softcap={cap}")
    assert not torch.equal(lse, default[1]), "poly_tanh: the lse is the default tanh's"


# ---------------------------------------------------------------- zero-length sequences
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("paged", [False, True])
def test_zero_length_query_and_key_sequences(window, paged):
    len_q = [0, 5, 0, 3, 7, 1, 0, 4]
    len_k = [4, 0, 0, 9, 7, 0, 1, 2]
    dtype = BF16 if paged else F16
    b = make_batch(len_q, len_k, 4, 2, 64, dtype, seed=11, paged=paged, page_size=4)
    out, lse = run(b, window=window, want_lse=True)
    check(b, out, lse, reference(b, window), f"zero lengths window={window}")


@pytest.mark.parametrize("paged", [False, True])
def test_batch_without_keys_outputs_zeros_and_minus_inf(paged):
    b = make_batch([3, 1, 8], [0, 0, 0], 4, 4, 128, F16, seed=12, paged=paged, page_size=16, slack=20,
                   use_seqused=True)
    out, lse = run(b, window=(-1, 0), want_lse=True)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()
    check(b, out, lse, reference(b, (-1, 0)), "no keys at all")


@pytest.mark.parametrize("paged", [False, True])
def test_batch_without_queries(paged):
    b = make_batch([0, 0], [5, 17], 8, 2, 128, BF16, seed=13, paged=paged)
    out, lse = run(b, want_lse=True)
    assert out.shape == (0, 8, 128) and lse.shape == (8, 0)


# ---------------------------------------------------------------- decode batches (max_q = 1)
DECODE = list(itertools.product(HEAD_DIMS, DTYPES, [False, True]))


@pytest.mark.parametrize("case", range(len(DECODE)), ids=[f"d{d}-{str(t)[6:]}-{'paged' if p else 'packed'}"
                                                         for d, t, p in DECODE])
def test_decode_batch_matches_reference(case):
    head_dim, dtype, paged = DECODE[case]
    rng = random.Random(100 + case)
    h_q, h_kv = [(8, 8), (32, 8), (32, 4)][case % 3]
    n = 24
    len_k = [rng.choice([1, 7, rng.randint(2, 600), rng.randint(600, 8192)]) for _ in range(n)]
    len_k[rng.randrange(n)] = 0
    len_k[rng.randrange(n)] = 12000
    len_q = [1] * n
    len_q[rng.randrange(n)] = 0
    window = [(-1, -1), (-1, 0), (255, 0), (0, 0)][case % 4]
    num_splits = [None, 1, 2][case % 3]
    b = make_batch(len_q, len_k, h_q, h_kv, head_dim, dtype, seed=100 + case, paged=paged,
                   page_size=[16, 1, 256][case % 3], slack=rng.randint(0, 100), use_seqused=case % 2 == 0)
    assert b.max_q == 1
    out, lse = run(b, window=window, num_splits=num_splits, want_lse=case % 2 == 1)
    check(b, out, lse, reference(b, window), f"decode window={window} splits={num_splits}")


# Decode tiles other than the default (each warp takes 16 keys of a tile: block_n / 16 warps),
# as tools/bench_varlen.py --decode-tiles times them; cache/gpu-tests.toml holds them. The
# fifth field: K/V by TMA (sm_90 only; off by default, spec.DECODE_TMA) or cp.async.
DECODE_TILES = [(1, 1, 32, 3, False), (1, 1, 32, 6, False), (1, 1, 48, 4, False), (1, 1, 64, 3, False),
                (1, 1, 128, 3, False), (1, 1, 32, 3, True), (1, 1, 32, 6, True), (1, 1, 64, 3, True)]


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("tile", DECODE_TILES, ids=[f"n{t[2]}s{t[3]}{'tma' if t[4] else ''}" for t in DECODE_TILES])
def test_decode_tile_shapes_match_reference(tile, paged):
    from jitattn.varlen.plan import override_spec

    tile_fields = dict(zip(("warps_m", "m_tiles", "block_n", "stages", "tma"), tile))
    rng = random.Random(7 + tile[2])
    len_k = [rng.choice([1, 33, rng.randint(2, 600), rng.randint(600, 5000)]) for _ in range(12)] + [0, 9000]
    b = make_batch([1] * len(len_k), len_k, 32, 8, 128, BF16, seed=7 + tile[2], paged=paged, page_size=16,
                   slack=5, use_seqused=paged)
    for window, num_splits in [((-1, -1), None), ((-1, 0), 2), ((255, 0), 3)]:
        with override_spec("varlen", when={"decode": True}, **tile_fields):
            out, lse = run(b, window=window, num_splits=num_splits, want_lse=True)
        check(b, out, lse, reference(b, window), f"decode tile {tile} window={window} splits={num_splits}")


# ---------------------------------------------------------------- GQA
@pytest.mark.parametrize("ratio", [1, 4, 8])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (64, 0)])
@pytest.mark.parametrize("paged", [False, True])
def test_gqa_ratios(ratio, window, paged):
    h_kv = 2
    rng = random.Random(ratio * 7 + window[0])
    len_q = [rng.randint(1, 400) for _ in range(5)]
    len_k = [lq + rng.randint(0, 200) for lq in len_q]
    b = make_batch(len_q, len_k, h_kv * ratio, h_kv, 128, BF16, seed=ratio, enable_gqa=True, paged=paged)
    out, lse = run(b, window=window, want_lse=True)
    check(b, out, lse, reference(b, window), f"gqa {ratio} window={window}")


def test_equal_heads_without_enable_gqa():
    b = make_batch([100, 3], [120, 50], 8, 8, 64, F16, seed=21, enable_gqa=False)
    out, lse = run(b, window=(-1, 0), want_lse=True)
    check(b, out, lse, reference(b, (-1, 0)), "enable_gqa=False")


# ---------------------------------------------------------------- paged KV
PAGED = list(itertools.product([1, 16, 256], HEAD_DIMS))


@pytest.mark.parametrize("page_size,head_dim", PAGED)
def test_paged_kv_matches_reference(page_size, head_dim):
    """Chunked prefill and decode rows over a paged cache: pages a random permutation of the
    pool, seqused_k below the slot the table holds, padding -1 or foreign page ids."""
    case = PAGED.index((page_size, head_dim))
    rng = random.Random(200 + case)
    dtype = DTYPES[case % 2]
    len_q = [1, 1, 37, 256, 1, 0, 90]
    len_k = [rng.randint(1, 3000) for _ in len_q]
    len_k[2] = max(len_k[2], 37)
    slack = [rng.randint(1, 2 * page_size + 5) for _ in len_q]  # seqused_k below every slot
    for window, num_splits, want_lse in [((-1, 0), None, True), ((-1, -1), 1, False), ((100, 0), 2, True)]:
        b = make_batch(len_q, len_k, 16, 4, head_dim, dtype, seed=200 + case, paged=True, page_size=page_size,
                       slack=slack, pad_table=["random", -1][case % 2], cu_seq_k_paged=["none", "used"][case % 2])
        out, lse = run(b, window=window, num_splits=num_splits, want_lse=want_lse)
        check(b, out, lse, reference(b, window), f"paged window={window} splits={num_splits}")


@pytest.mark.parametrize("page_size", [2, 4, 8, 32, 64, 128])
def test_paged_kv_other_page_sizes(page_size):
    len_q = [1, 64, 1, 5]
    len_k = [1000, 700, 3, page_size * 3]
    b = make_batch(len_q, len_k, 8, 2, 128, BF16, seed=page_size, paged=True, page_size=page_size, slack=page_size)
    out, lse = run(b, window=(-1, 0), want_lse=True)
    check(b, out, lse, reference(b, (-1, 0)), f"page_size={page_size}")


def test_paged_identity_and_permuted_tables_agree():
    """The same keys under two page placements give the same result."""
    len_q, len_k = [1, 30, 1], [500, 400, 33]
    a = make_batch(len_q, len_k, 8, 8, 128, F16, seed=5, paged=True, page_size=16)
    b = make_batch(len_q, len_k, 8, 8, 128, F16, seed=5, paged=False)
    # rebuild a's pool from b's packed keys at a's (permuted) pages
    starts = b.cu_seq_k.tolist()
    for i, lk in enumerate(len_k):
        c = torch.arange(lk, device=DEVICE)
        phys = a.block_table[i].long()[c // 16]
        a.key[phys, c % 16] = b.key[starts[i]: starts[i] + lk]
        a.value[phys, c % 16] = b.value[starts[i]: starts[i] + lk]
    a.query.copy_(b.query)
    out_a, _ = run(a, window=(-1, 0), num_splits=1)
    out_b, _ = run(b, window=(-1, 0), num_splits=1)
    check(a, out_a, None, reference(a, (-1, 0)), "paged")
    close(out_a, out_b.double(), *TOL[F16], "paged vs packed")


# ---------------------------------------------------------------- unpaged seqused_k
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("kind", ["prefill-causal", "decode-full", "chunked-window"])
def test_unpaged_seqused_k_below_the_slot(head_dim, kind):
    rng = random.Random(head_dim)
    if kind == "decode-full":
        len_q, window = [1] * 12, (-1, -1)
        len_k = [rng.randint(0, 5000) for _ in len_q]
    elif kind == "prefill-causal":
        len_q, window = [rng.randint(1, 500) for _ in range(6)], (-1, 0)
        len_k = list(len_q)
    else:
        len_q, window = [rng.randint(1, 200) for _ in range(6)], (50, 3)
        len_k = [lq + rng.randint(0, 900) for lq in len_q]
    slack = [rng.randint(1, 300) for _ in len_q]
    b = make_batch(len_q, len_k, 8, 2, head_dim, BF16 if head_dim == 128 else F16, seed=head_dim,
                   use_seqused=True, slack=slack)
    out, lse = run(b, window=window, want_lse=True)
    check(b, out, lse, reference(b, window), f"seqused_k {kind}")


# ---------------------------------------------------------------- num_splits
@pytest.mark.parametrize("num_splits", [1, 2, 3, None])
@pytest.mark.parametrize("shape", ["decode-long", "chunked-prefill", "decode-paged"])
def test_num_splits(num_splits, shape):
    if shape == "decode-long":
        b = make_batch([1, 1, 1, 1], [20000, 1, 9000, 513], 32, 8, 128, BF16, seed=31)
    elif shape == "chunked-prefill":
        b = make_batch([64, 3], [8192, 3000], 16, 2, 128, F16, seed=32)
    else:
        b = make_batch([1] * 8, [16384, 2, 700, 4000, 0, 1, 9999, 300], 32, 4, 128, F16, seed=33, paged=True,
                       page_size=16, slack=7)
    window = (-1, 0)
    out, lse = run(b, window=window, num_splits=num_splits, want_lse=True)
    check(b, out, lse, reference(b, window), f"{shape} num_splits={num_splits}")


# ---------------------------------------------------------------- lse
def test_lse_is_natural_log_float32_of_shape_heads_by_tokens():
    # Sequence 0: 3 queries, 1 key, causal (bottom-right): rows 0 and 1 see no key, row 2 sees
    # key 0 only, so its lse is exactly that one logit (natural log: base 2 would be 1/ln 2 larger).
    b = make_batch([3, 0, 40], [1, 4, 40], 4, 4, 64, F16, seed=41)
    out, lse = run(b, window=(-1, 0), want_lse=True)
    assert lse.shape == (4, 43) and lse.dtype == torch.float32
    assert torch.isneginf(lse[:, :2]).all() and (out[:2] == 0).all()
    logit = (b.query[2].double() * b.key[0].double()).sum(-1) / 8.0
    close(lse[:, 2], logit, 1e-4, 2e-3, "single-key lse")
    close(out[2], b.value[0].double().expand(4, 64), *TOL[F16], "single-key out")
    check(b, out, lse, reference(b, (-1, 0)), "lse")


def test_aux_request_lse_false_returns_only_out():
    b = make_batch([5, 9], [7, 9], 4, 4, 64, BF16, seed=42)
    plain = jitattn.varlen_attn(*b.args(), return_aux=jitattn.AuxRequest(lse=False))
    assert isinstance(plain, torch.Tensor)
    both = jitattn.varlen_attn(*b.args(), return_aux=jitattn.AuxRequest(lse=True))
    assert isinstance(both, tuple) and len(both) == 2
    check(b, plain, None, reference(b), "lse=False")
    check(b, both[0], both[1], reference(b), "lse=True")


# ---------------------------------------------------------------- batch invariance (num_splits=1)
def _seq(len_q, len_k, h_q, h_kv, d, dtype, seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return tuple(torch.randn(n, h, d, device=DEVICE, generator=g).to(dtype)
                 for n, h in ((len_q, h_q), (len_k, h_kv), (len_k, h_kv)))


def _assemble(seqs, paged, page_size, max_q_extra, seed, enable_gqa):
    """One batch from per-sequence (q, k, v); paged: pages from a random permutation of the pool."""
    len_q = [s[0].shape[0] for s in seqs]
    len_k = [s[1].shape[0] for s in seqs]
    query = torch.cat([s[0] for s in seqs])
    if not paged:
        key, value = torch.cat([s[1] for s in seqs]), torch.cat([s[2] for s in seqs])
        return Batch(query, key, value, cu(len_q), cu(len_k), max(len_q) + max_q_extra, max(len_k), len_q, len_k,
                     enable_gqa=enable_gqa)
    pages = [-(-lk // page_size) for lk in len_k]
    total = sum(pages) + 2
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed)).tolist()
    table = torch.full((len(seqs), max(pages)), -1, dtype=torch.int32)
    h_kv, d = seqs[0][1].shape[1:]
    key = torch.full((total, page_size, h_kv, d), float("nan"), device=DEVICE, dtype=query.dtype)
    value = key.clone()
    at = 0
    for i, (p, (_, k, v)) in enumerate(zip(pages, seqs)):
        table[i, :p] = torch.tensor(perm[at: at + p], dtype=torch.int32)
        at += p
        c = torch.arange(k.shape[0], device=DEVICE)
        phys = table[i].to(DEVICE).long()[c // page_size]
        key[phys, c % page_size], value[phys, c % page_size] = k, v
    return Batch(query, key, value, cu(len_q), None, max(len_q) + max_q_extra, max(len_k), len_q, len_k,
                 seqused_k=torch.tensor(len_k, dtype=torch.int32, device=DEVICE), block_table=table.to(DEVICE),
                 enable_gqa=enable_gqa)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scenario", ["prefill-causal", "prefill-window", "decode-paged", "decode-packed"])
def test_batch_invariance_with_one_split(dtype, scenario):
    """The same sequence inside two different batches (other sequences, max_q, position, page
    placement all different) gives bitwise-equal output rows and lse with num_splits=1."""
    decode = scenario.startswith("decode")
    paged = scenario == "decode-paged"
    window = {"prefill-causal": (-1, 0), "prefill-window": (300, 7)}.get(scenario, (-1, -1))
    h_q, h_kv, d = 16, 4, 128
    target = _seq(1 if decode else 700, 5000 if decode else 900, h_q, h_kv, d, dtype, seed=1)
    if decode:
        others_a = [_seq(1, n, h_q, h_kv, d, dtype, seed=10 + i) for i, n in enumerate([100, 3])]
        others_b = [_seq(1, n, h_q, h_kv, d, dtype, seed=20 + i) for i, n in enumerate([60000, 1, 16384, 8])]
    else:
        others_a = [_seq(q, k, h_q, h_kv, d, dtype, seed=10 + i) for i, (q, k) in enumerate([(300, 900), (1, 50)])]
        others_b = [_seq(q, k, h_q, h_kv, d, dtype, seed=20 + i)
                    for i, (q, k) in enumerate([(2000, 2000), (0, 5), (2, 16000), (64, 64)])]
    batch_a = _assemble(others_a[:1] + [target] + others_a[1:], paged, 16, 0, seed=1, enable_gqa=True)
    batch_b = _assemble(others_b + [target], paged, 16, 0 if decode else 3, seed=2, enable_gqa=True)
    out_a, lse_a = run(batch_a, window=window, num_splits=1, want_lse=True)
    out_b, lse_b = run(batch_b, window=window, num_splits=1, want_lse=True)
    rows_a, rows_b = row_range(batch_a, 1), row_range(batch_b, len(others_b))
    check(batch_a, out_a, lse_a, reference(batch_a, window), "batch a")
    assert torch.equal(out_a[rows_a], out_b[rows_b]), "num_splits=1: the sequence's rows differ between batches"
    assert torch.equal(lse_a[:, rows_a], lse_b[:, rows_b]), "num_splits=1: the sequence's lse differs between batches"


# ---------------------------------------------------------------- varlen_attn_out
@pytest.mark.parametrize("want_lse", [False, True])
@pytest.mark.parametrize("paged", [False, True])
def test_varlen_attn_out_writes_only_into_out(want_lse, paged):
    b = make_batch([3, 100, 1, 0, 57], [3, 180, 900, 4, 57], 8, 2, 128, F16, seed=51, paged=paged)
    t_q, h_q, d = b.query.shape
    backing = torch.full((t_q + 7, h_q, d), 7.0, device=DEVICE, dtype=F16)  # sentinel rows around out
    out = backing[3: 3 + t_q]
    out.fill_(float("nan"))
    ptr = out.data_ptr()
    aux = jitattn.AuxRequest(lse=True) if want_lse else None
    result = jitattn.varlen_attn_out(out, *b.args(), return_aux=aux, window_size=(-1, 0), num_splits=1, **b.kwargs())
    if want_lse:
        assert isinstance(result, tuple) and len(result) == 2
        got, lse = result
    else:
        got, lse = result, None
    assert got is out, "varlen_attn_out must return the out tensor it was given"
    assert out.data_ptr() == ptr
    assert (backing[:3] == 7.0).all() and (backing[3 + t_q:] == 7.0).all(), "wrote outside out"
    check(b, out, lse, reference(b, (-1, 0)), "varlen_attn_out")
    fresh, fresh_lse = run(b, window=(-1, 0), num_splits=1, want_lse=want_lse)
    assert torch.equal(out, fresh), "varlen_attn_out and varlen_attn differ"
    if want_lse:
        assert torch.equal(lse, fresh_lse)


def test_varlen_attn_out_overwrites_stale_values():
    b = make_batch([4, 0, 9], [0, 5, 9], 4, 4, 64, BF16, seed=52)
    out = torch.full_like(b.query, 3.0)
    jitattn.varlen_attn_out(out, *b.args(), window_size=(-1, 0))
    check(b, out, None, reference(b, (-1, 0)), "stale out")  # rows with no key must be 0, not 3


# ---------------------------------------------------------------- strided inputs
@pytest.mark.parametrize("layout", ["packed-qkv", "row-strided-query", "head-slice-query"])
def test_non_contiguous_inputs(layout):
    len_q = [10, 200, 1, 33]
    len_k = list(len_q)
    h_q, h_kv, d = 8, 2, 128
    t = sum(len_q)
    g = torch.Generator(device=DEVICE).manual_seed(61)
    b = make_batch(len_q, len_k, h_q, h_kv, d, F16, seed=61, tail_rows=0)
    if layout == "packed-qkv":
        qkv = torch.randn(t, h_q + 2 * h_kv, d, device=DEVICE, generator=g).to(F16)
        query, b.key, b.value = qkv.split([h_q, h_kv, h_kv], dim=1)
    elif layout == "row-strided-query":
        query = torch.randn(2 * t, h_q, d, device=DEVICE, generator=g).to(F16)[::2]
    else:
        query = torch.randn(t, h_q + 4, d, device=DEVICE, generator=g).to(F16)[:, 2:2 + h_q]
    assert not query.is_contiguous()
    out, lse = run(b, window=(-1, 0), want_lse=True, query=query)
    check(b, out, lse, reference(b, (-1, 0), query=query), layout, query=query)


# ---------------------------------------------------------------- long sequences
@pytest.mark.parametrize("head_dim,dtype,window", [(128, BF16, (-1, 0)), (64, F16, (1024, 0)), (256, BF16, (-1, -1))])
def test_long_sequence(head_dim, dtype, window):
    len_q = [16384, 3] if window != (-1, -1) else [4096, 1]
    len_k = [16384, 16384] if window != (-1, -1) else [12000, 30000]
    b = make_batch(len_q, len_k, 4, 1, head_dim, dtype, seed=head_dim)
    out, lse = run(b, window=window, want_lse=True)
    check(b, out, lse, reference(b, window), f"long window={window}")


# ---------------------------------------------------------------- scale, stability, determinism
def test_explicit_scale():
    b = make_batch([50, 7], [60, 7], 8, 8, 128, F16, seed=71)
    out, lse = run(b, window=(-1, 0), scale=0.05, want_lse=True)
    check(b, out, lse, reference(b, (-1, 0), scale=0.05), "scale=0.05")


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_logits_are_stable(dtype):
    b = make_batch([300, 1], [300, 4000], 4, 4, 64, dtype, seed=72, q_gain=30.0)
    out, lse = run(b, window=(-1, 0), want_lse=True)
    check(b, out, lse, reference(b, (-1, 0)), "large logits")


@pytest.mark.parametrize("num_splits", [None, 1])
def test_repeated_calls_are_bitwise_identical(num_splits):
    b = make_batch([1] * 4 + [500], [30000, 100, 7, 9000, 2000], 32, 8, 128, BF16, seed=73)
    first = run(b, window=(-1, 0), num_splits=num_splits, want_lse=True)
    for _ in range(2):
        again = run(b, window=(-1, 0), num_splits=num_splits, want_lse=True)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


# ---------------------------------------------------------------- a decode loop (forward.py _next_length)
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("window", [(-1, -1), (255, 0)])
def test_a_decode_loop_with_a_cache_one_key_longer_each_step_matches_reference(paged, window):
    """Each step's keys in new tensors, one longer (a model's KV cache): the step's first call is
    re-planned from the last step's launch (its family), the second is warm. Lengths cross the
    short-call rule (SHORT_KEYS) and the split count's steps; every call against float64."""
    for step, length in enumerate([60, 61, 127, 128, 129, 130, 700, 701, 5000, 5001, 12000, 12001]):
        b = make_batch([1, 1, 1], [length, length // 3 + 1, 7], 16, 4, 128, BF16, seed=400 + step, paged=paged,
                       page_size=16)
        ref = reference(b, window)
        for layer in range(2):
            out, lse = run(b, window=window, want_lse=True)
            check(b, out, lse, ref, f"decode loop step {step} ({length} keys) layer {layer}")


# ---------------------------------------------------------------- torch's own varlen_attn
def torch_varlen():
    """(function, kwargs builder) for torch.nn.attention.varlen.varlen_attn, or skip."""
    try:
        mod = importlib.import_module("torch.nn.attention.varlen")
    except ImportError:
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.varlen")
    fn = getattr(mod, "varlen_attn", None)
    if fn is None:
        pytest.skip("torch.nn.attention.varlen has no varlen_attn")
    params = inspect.signature(fn).parameters

    def causal_kwargs(causal):
        if "window_size" in params:
            return {"window_size": (-1, 0) if causal else (-1, -1)}
        if "is_causal" in params:
            return {"is_causal": causal}
        if causal:
            pytest.skip("torch's varlen_attn takes neither window_size nor is_causal")
        return {}

    return fn, causal_kwargs


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_matches_torch_varlen_attn(head_dim, dtype, causal):
    fn, kw = torch_varlen()
    lengths = [1, 77, 1024, 3, 513, 2048]
    b = make_batch(lengths, lengths, 8, 8, head_dim, dtype, seed=head_dim + causal, tail_rows=0)
    window = (-1, 0) if causal else (-1, -1)
    theirs = fn(*b.args(), **kw(causal))
    ours, _ = run(b, window=window)
    ref = reference(b, window)
    check(b, ours, None, ref, "jitattn")
    rel, abs_ = TOL[dtype]
    close(theirs, ref[0], rel, abs_, "torch varlen_attn vs reference (sanity)")
    close(ours, theirs.double(), rel, abs_, "jitattn vs torch varlen_attn")


def _batch_with_a_bad_page(bad_id):
    b = make_batch([1, 3], [40, 70], 8, 2, 128, torch.bfloat16, seed=11, enable_gqa=True, paged=True, page_size=16)
    table = b.block_table.clone()
    table[1, 2] = bad_id  # logical page 2 of sequence 1 holds keys 32..47 of its 70
    return b, table


@pytest.mark.parametrize("bad_id", [-5, 10**6])
def test_debug_mode_catches_an_out_of_range_page_id_on_the_device(monkeypatch, bad_id):
    """JITATTN_DEBUG=1: the kernel reports the bad page id (the host-side value check is switched
    off here, so only the device-side check can catch it) and the call raises naming block_table."""
    import jitattn.varlen.forward as forward_module

    b, table = _batch_with_a_bad_page(bad_id)
    monkeypatch.setenv("JITATTN_DEBUG", "1")
    monkeypatch.setattr(forward_module, "check_varlen_values", lambda *a, **k: None)
    with pytest.raises(ValueError, match=r"block_table\[1, 2\].*caught on the device"):
        jitattn.varlen_attn(b.query, b.key, b.value, b.cu_seq_q, None, b.max_q, b.max_k, enable_gqa=True,
                            seqused_k=b.seqused_k, block_table=table)


def test_debug_mode_host_check_names_the_bad_page_before_launch(monkeypatch):
    b, table = _batch_with_a_bad_page(-5)
    monkeypatch.setenv("JITATTN_DEBUG", "1")
    with pytest.raises(ValueError, match=r"block_table\[1, 2\] = -5"):
        jitattn.varlen_attn(b.query, b.key, b.value, b.cu_seq_q, None, b.max_q, b.max_k, enable_gqa=True,
                            seqused_k=b.seqused_k, block_table=table)


def test_out_of_range_page_id_is_never_read_without_debug():
    """Without the debug switch a bad page id is skipped (its keys take no part), never read out
    of bounds: the other sequence is exact and nothing is NaN."""
    b, table = _batch_with_a_bad_page(10**6)
    out = jitattn.varlen_attn(b.query, b.key, b.value, b.cu_seq_q, None, b.max_q, b.max_k, enable_gqa=True,
                              seqused_k=b.seqused_k, block_table=table)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    ref, _ = reference(b)
    rows = row_range(b, 0)
    close(out[rows], ref[rows], *TOL[torch.bfloat16], "sequence without the bad page")
