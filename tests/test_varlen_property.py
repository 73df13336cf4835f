"""Seeded-random property test of jitattn.varlen_attn against the float64 reference (GPU).

Each seed draws one whole configuration: dtype, head_dim (64/128/256: what the GPU test cache
holds), GQA ratio, window kind, packed or paged KV (page size 1..256, permuted pages, seqused_k
below the slot), num_splits, lse, scale, and a batch of lengths from 0 up to a few thousand,
with a handful of long ones (a 128k-key decode, an 8k prefill). The test id names the seed and
the configuration's headline; a failure message prints the whole configuration, so
`pytest tests/test_varlen_property.py -k 'seed137-'` reruns one case.
"""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from tests.varlen_utils import check, make_batch, reference, run, work

NUM_CONFIGS = 320
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
WORK_CAP = 1 << 31  # sum over sequences of Lq * Lk * H_q: keeps the float64 reference quick
LONG_EVERY = 32  # seeds with seed % LONG_EVERY == 7 or 23 get a long sequence (20 of 320)


def _length(rng: random.Random) -> int:
    r = rng.random()
    if r < 0.12:
        return 0
    if r < 0.22:
        return 1
    if r < 0.60:
        return rng.randint(2, 128)
    if r < 0.95:
        return rng.randint(129, 2048)
    return rng.randint(2049, 4096)


def _window(rng: random.Random) -> tuple[int, int]:
    kind = rng.choice(["full", "causal", "sliding", "general", "left-zero", "left-only", "right-only"])
    if kind == "full":
        return (-1, -1)
    if kind == "causal":
        return (-1, 0)
    if kind == "sliding":
        return (rng.choice([0, 1, rng.randint(2, 64), rng.randint(65, 2048)]), 0)
    if kind == "general":
        return (rng.randint(0, 1500), rng.randint(1, 300))
    if kind == "left-zero":
        return (0, rng.choice([0, rng.randint(1, 500)]))
    if kind == "left-only":
        return (rng.randint(0, 1000), -1)
    return (-1, rng.randint(0, 200))


def config(seed: int) -> dict:
    rng = random.Random(0x5EED0000 + seed)
    ratio = rng.choice([1, 1, 2, 3, 4, 5, 8, 16])
    h_kv = 1 if ratio == 16 else rng.choice([1, 2, 4])
    shape = rng.choices(["prefill", "decode", "chunked", "cross"], weights=[3, 3, 2, 2])[0]
    long = seed % LONG_EVERY in (7, 23)
    if shape == "decode":
        n = rng.randint(1, 32)
        len_q = [0 if rng.random() < 0.05 else 1 for _ in range(n)]
        len_k = [_length(rng) for _ in range(n)]
        if long:
            len_k[rng.randrange(n)] = rng.randint(32768, 131072)
    else:
        n = rng.randint(1, 10)
        if shape == "prefill":
            len_q = [_length(rng) for _ in range(n)]
            len_k = [lq + (rng.randint(1, 1000) if rng.random() < 0.4 else 0) for lq in len_q]
        elif shape == "chunked":
            len_q = [0 if rng.random() < 0.1 else rng.randint(1, 256) for _ in range(n)]
            len_k = [lq + rng.randint(0, 4000) for lq in len_q]
        else:
            len_q = [_length(rng) for _ in range(n)]
            len_k = [_length(rng) for _ in range(n)]
        if long:
            i = rng.randrange(n)
            len_q[i] = rng.randint(6000, 8192)
            len_k[i] = len_q[i] + rng.choice([0, rng.randint(1, 2000)])
    h_q = h_kv * ratio
    while work(len_q, len_k) * h_q > WORK_CAP:  # shrink the longest sequence until the reference is cheap
        i = max(range(n), key=lambda j: len_q[j] * len_k[j])
        len_q[i], len_k[i] = len_q[i] // 2, len_k[i] // 2
    paged = rng.random() < 0.5
    page_size = 1 << rng.randint(0, 8)
    use_seqused = paged or rng.random() < 0.3
    slack = [rng.choice([0, rng.randint(1, 64), rng.randint(65, 600)]) if use_seqused else 0 for _ in range(n)]
    return {
        "seed": seed,
        "dtype": rng.choice(list(DTYPES)),
        "head_dim": rng.choice([64, 128, 256]),
        "h_q": h_q,
        "h_kv": h_kv,
        "enable_gqa": ratio > 1 or rng.random() < 0.3,
        "shape": shape + ("-long" if long else ""),
        "len_q": len_q,
        "len_k": len_k,
        "window": _window(rng),
        "paged": paged,
        "page_size": page_size if paged else 0,
        "use_seqused": use_seqused,
        "slack": slack,
        "cu_seq_k_paged": rng.choice(["none", "used"]),
        "pad_table": rng.choice([-1, "random"]),
        "num_splits": rng.choice([None, 1, 2, 3]),
        "lse": rng.random() < 0.5,
        "scale": None if rng.random() < 0.7 else round(rng.uniform(0.02, 0.3), 4),
        "max_extra": 0 if rng.random() < 0.8 else rng.randint(1, 100),
        "q_gain": 1.0 if rng.random() < 0.9 else 4.0,
    }


CONFIGS = [config(seed) for seed in range(NUM_CONFIGS)]


def _id(c: dict) -> str:
    kv = f"paged{c['page_size']}" if c["paged"] else ("seqused" if c["use_seqused"] else "packed")
    return (f"seed{c['seed']}-{c['dtype'][:4]}-d{c['head_dim']}-{c['h_q']}x{c['h_kv']}-{c['shape']}"
            f"-w{c['window'][0]}_{c['window'][1]}-{kv}-s{c['num_splits']}{'-lse' if c['lse'] else ''}")


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", CONFIGS, ids=[_id(c) for c in CONFIGS])
def test_varlen_random_config_matches_reference(cfg):
    c = cfg
    b = make_batch(c["len_q"], c["len_k"], c["h_q"], c["h_kv"], c["head_dim"], DTYPES[c["dtype"]], seed=c["seed"],
                   enable_gqa=c["enable_gqa"], paged=c["paged"], page_size=max(1, c["page_size"]), slack=c["slack"],
                   use_seqused=c["use_seqused"], cu_seq_k_paged=c["cu_seq_k_paged"], pad_table=c["pad_table"],
                   max_q=max(c["len_q"], default=0) + c["max_extra"], max_k=max(c["len_k"], default=0) + c["max_extra"],
                   q_gain=c["q_gain"])
    out, lse = run(b, window=c["window"], scale=c["scale"], num_splits=c["num_splits"], want_lse=c["lse"])
    check(b, out, lse, reference(b, c["window"], c["scale"]), f"config {c}")


def test_configs_cover_the_space():
    """The table (no GPU needed): enough configs, and every value of every axis drawn."""
    assert len(CONFIGS) >= 300 and len({_id(c) for c in CONFIGS}) == len(CONFIGS)
    seen = {key: Counter(str(c[key]) for c in CONFIGS) for key in
            ("dtype", "head_dim", "paged", "num_splits", "lse", "use_seqused", "enable_gqa")}
    assert set(seen["dtype"]) == set(DTYPES) and set(seen["head_dim"]) == {"64", "128", "256"}
    assert set(seen["num_splits"]) == {"None", "1", "2", "3"} and set(seen["paged"]) == {"True", "False"}
    assert {c["page_size"] for c in CONFIGS if c["paged"]} == {1 << i for i in range(9)}
    assert {c["h_q"] // c["h_kv"] for c in CONFIGS} >= {1, 2, 3, 4, 5, 8, 16}
    windows = {("full" if w == (-1, -1) else "causal" if w == (-1, 0) else "sliding" if w[1] == 0 else
                "left-only" if w[1] == -1 else "right-only" if w[0] == -1 else "general")
               for w in (c["window"] for c in CONFIGS)}
    assert windows == {"full", "causal", "sliding", "general", "left-only", "right-only"}
    assert any(c["window"][0] == 0 and c["window"][1] > 0 for c in CONFIGS)
    lengths = [x for c in CONFIGS for x in c["len_q"] + c["len_k"]]
    assert 0 in lengths and 1 in lengths and max(lengths) >= 100_000
    assert sum("long" in c["shape"] for c in CONFIGS) >= 10
    assert any(c["max_extra"] for c in CONFIGS)
    assert all(work(c["len_q"], c["len_k"]) * c["h_q"] <= WORK_CAP for c in CONFIGS)
