"""The varlen backward's schedule on the CPU: templates/varlen/backward_schedule.cuh (the source
the kernels include) compiled for the host by tests/native/backward_schedule.cpp and driven over
whole grids of random batches. Checked against brute force over every (query row, key) pair:

- every key tile of every (sequence, KV head) gets exactly one CTA, in ascending block order;
- a CTA walks exactly the query tiles that see one of its keys, and masks exactly the tiles
  where some (row, key) pair is hidden;
- the deterministic dQ order: a CTA's turn (= the key tiles that add to the same query tile
  before it: the lower ones, or with a right window edge the higher ones), a CTA never waits on
  one with a higher block index, counters distinct per (KV head, sequence, tile);
- heaviest first (default mode): CTAs with the most query tiles come first;
- visible_rows (the interval of packed rows that see a key, which the kernels' boundary-tile
  mask compares against): exactly the rows the brute-force visibility gives.
"""
import math
import random
import subprocess
from pathlib import Path

import pytest
import torch

from tests.conftest import require_host_cxx
from tests.varlen_utils import window_visibility

REPO = Path(__file__).resolve().parent.parent
HARNESS = REPO / "tests" / "native" / "backward_schedule.cpp"
TILES = [(128, 64), (64, 64), (128, 128), (48, 64)]  # (BLOCK_N, BLOCK_M)


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    """(BLOCK_N, BLOCK_M) -> path of the host build of the schedule."""
    cxx = require_host_cxx("the schedule test")
    out = tmp_path_factory.mktemp("schedule")
    built = {}
    for block_n, block_m in TILES:
        binary = out / f"schedule_{block_n}_{block_m}"
        subprocess.run([cxx, "-O1", "-std=c++17", f"-DBLOCK_N_={block_n}", f"-DBLOCK_M_={block_m}",
                        f"-I{REPO / 'templates' / 'varlen'}", str(HARNESS), "-o", str(binary)], check=True)
        built[(block_n, block_m)] = binary
    return built


def run_schedule(binary, cfg, want_written=False):
    """The harness's CTAs (and with want_written, key_written of every key token)."""
    words = [cfg["num_seqs"], cfg["h_kv"], cfg["pack"], cfg["total_q"], cfg["total_k"], cfg["n_blocks"],
             cfg["left"], cfg["right"], int(cfg.get("deterministic", True)), int(cfg["used"] is not None),
             *cfg["cu_q"], *cfg["cu_k"],
             *(cfg["used"] or [])]
    text = subprocess.run([str(binary)], input=" ".join(map(str, words)), capture_output=True, text=True,
                          check=True).stdout
    blocks, written = [], []
    for line in text.splitlines():
        kind, *vals = line.split()
        vals = [int(v) for v in vals]
        if kind == "W":
            written.append(bool(vals[1]))
        elif kind == "B":
            blocks.append({"block": vals[0], "seq": vals[1], "kv": vals[2], "n": vals[3], "m_begin": vals[4],
                           "m_end": vals[5], "tiles": {}, "keys": {}})
        elif kind == "K":
            blocks[-1]["keys"][vals[0]] = (vals[1], vals[2])
        else:
            blocks[-1]["tiles"][vals[0]] = {"masked": bool(vals[1]), "turn": vals[2], "sem": vals[3]}
    return blocks if not want_written else (blocks, written)


def random_batch(rng: random.Random, block_n: int, long: bool = False):
    n = rng.randint(1, 6)
    len_q = [rng.choice([0, 1, rng.randint(1, 40), rng.randint(1, 400)]) for _ in range(n)]
    len_k = [rng.choice([0, 1, rng.randint(1, 40), rng.randint(1, 400), lq]) for lq in len_q]
    if long:
        len_q[0] = len_k[0] = rng.randint(600, 1500)
    used = None
    slots = list(len_k)
    if rng.random() < 0.3:
        used = len_k
        slots = [lk + rng.randint(0, 20) for lk in len_k]
    kind = rng.choice(["full", "causal", "sliding", "general", "right", "left", "zero"])
    left, right = {"full": (-1, -1), "causal": (-1, 0), "sliding": (rng.randint(0, 300), 0),
                   "general": (rng.randint(0, 200), rng.randint(0, 200)), "right": (-1, rng.randint(0, 50)),
                   "left": (rng.randint(0, 50), -1), "zero": (0, 0)}[kind]
    pack = rng.choice([1, 1, 2, 3, 4, 8])
    cu = lambda lens: [0] + [sum(lens[:i + 1]) for i in range(len(lens))]
    return {"num_seqs": n, "h_kv": rng.choice([1, 2]), "pack": pack, "len_q": len_q, "len_k": len_k,
            "cu_q": cu(len_q), "cu_k": cu(slots), "used": used, "total_q": sum(len_q) + rng.randint(0, 3),
            "total_k": sum(slots) + rng.randint(0, 3), "left": left, "right": right,
            "n_blocks": math.ceil(max(len_k) / block_n), "kind": kind}


def expected(cfg, block_n, block_m, seq):
    """active[m][n] and fully-visible[m][n] of one sequence by brute force."""
    lq, lk, pack = cfg["len_q"][seq], cfg["len_k"][seq], cfg["pack"]
    vis = window_visibility(lq, lk, cfg["left"], cfg["right"])
    rows = lq * pack
    m_tiles, n_tiles = -(-rows // block_m), -(-lk // block_n)
    active = [[False] * n_tiles for _ in range(m_tiles)]
    full = [[False] * n_tiles for _ in range(m_tiles)]
    for m in range(m_tiles):
        r_lo, r_hi = m * block_m // pack, (min((m + 1) * block_m, rows) - 1) // pack
        for n in range(n_tiles):
            block = vis[r_lo:r_hi + 1, n * block_n:(n + 1) * block_n]
            active[m][n] = bool(block.any())
            full[m][n] = (n + 1) * block_n <= lk and bool(block.all())
    return active, full


def check_grid(blocks, cfg, block_n, block_m):
    what = f"{cfg['kind']} window=({cfg['left']}, {cfg['right']}) pack={cfg['pack']} lq={cfg['len_q']} lk={cfg['len_k']}"
    n_blocks = cfg["n_blocks"]
    deterministic = cfg.get("deterministic", True)
    descending = deterministic and cfg["right"] >= 0
    seen, owners = {}, {}
    for b in blocks:
        key = (b["seq"], b["kv"], b["n"])
        assert key not in seen, f"{what}: key tile {key} has two CTAs"
        seen[key] = b
    for seq in range(cfg["num_seqs"]):
        n_tiles = -(-cfg["len_k"][seq] // block_n)
        active, full = expected(cfg, block_n, block_m, seq)
        launched = range(max(0, n_tiles - n_blocks), n_tiles)  # all of them unless max_k is too small
        for kv in range(cfg["h_kv"]):
            got = sorted(n for (s, h, n) in seen if s == seq and h == kv)
            assert got == list(launched), f"{what}: seq {seq} kv {kv}: CTAs for key tiles {got}"
            order = [seen[(seq, kv, n)]["block"] for n in got]
            assert order == sorted(order, reverse=descending), f"{what}: key tiles out of block order"
            sems = {}
            for n in got:
                b = seen[(seq, kv, n)]
                walked = list(range(b["m_begin"], b["m_end"]))
                want = [m for m in range(len(active)) if active[m][n]]
                assert walked == want, f"{what}: seq {seq} tile {n} walks query tiles {walked}, want {want}"
                for m in walked:
                    t = b["tiles"][m]
                    assert t["masked"] == (not full[m][n]), f"{what}: seq {seq} (m={m}, n={n}) masked={t['masked']}"
                    if not deterministic:
                        assert t["sem"] == -1
                        continue
                    before = [n2 for n2 in launched if (n2 > n if descending else n2 < n) and active[m][n2]]
                    assert t["turn"] == len(before), \
                        f"{what}: (m={m}, n={n}) waits for {t['turn']} key tiles, {len(before)} add before it"
                    for n2 in before:  # it only waits on CTAs that start before it
                        assert seen[(seq, kv, n2)]["block"] < b["block"], f"{what}: waits on a later CTA"
                    stride = cfg["total_q"] * cfg["pack"] // block_m + cfg["num_seqs"] + 1
                    assert kv * stride <= t["sem"] < (kv + 1) * stride, f"{what}: counter outside kv {kv}'s"
                    sems.setdefault(m, set()).add(t["sem"])
            assert all(len(v) == 1 for v in sems.values()), f"{what}: one query tile, several counters"
            for m, (s,) in sems.items():
                other = owners.setdefault(kv, {}).setdefault(s, (seq, m))
                assert other == (seq, m), f"{what}: kv {kv} counter {s} shared by {other} and {(seq, m)}"


@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"n{t[0]}m{t[1]}")
@pytest.mark.parametrize("seed", range(30))
def test_schedule_covers_every_visible_block_once_in_order(harness, tile, seed):
    block_n, block_m = tile
    rng = random.Random(seed * 7919 + block_n)
    cfg = random_batch(rng, block_n, long=seed % 5 == 0)
    for deterministic in (False, True):
        cfg["deterministic"] = deterministic
        check_grid(run_schedule(harness[tile], cfg), cfg, block_n, block_m)


@pytest.mark.parametrize("seed", range(6))
def test_schedule_with_too_small_max_k_leaves_out_the_lowest_tiles_and_counts_only_launched_ones(harness, seed):
    """max_k below the longest sequence (malformed, as in the forward): no CTA for the lowest key
    tiles of that sequence, and the deterministic order does not wait for them (no hang)."""
    rng = random.Random(1000 + seed)
    cfg = random_batch(rng, 64, long=True)
    cfg["n_blocks"] = max(1, cfg["n_blocks"] - 3)
    check_grid(run_schedule(harness[(64, 64)], cfg), cfg, 64, 64)


def test_schedule_runs_heaviest_first(harness):
    """Causal, skewed lengths: CTAs in block order carry non-increasing work band by band, and the
    first half of the grid holds most of the work."""
    block_n, block_m = 128, 64
    lens = [300, 4096, 1024, 77, 2048, 4096]
    cu = [0] + [sum(lens[:i + 1]) for i in range(len(lens))]
    cfg = {"num_seqs": len(lens), "h_kv": 2, "pack": 1, "len_q": lens, "len_k": lens, "cu_q": cu, "cu_k": cu,
           "used": None, "total_q": sum(lens), "total_k": sum(lens), "left": -1, "right": 0,
           "n_blocks": math.ceil(max(lens) / block_n), "kind": "causal", "deterministic": False}
    blocks = sorted(run_schedule(harness[(block_n, block_m)], cfg), key=lambda b: b["block"])
    work = [b["m_end"] - b["m_begin"] for b in blocks]
    assert work[0] == max(work), "the first CTA is not the heaviest"
    assert sum(work[:len(work) // 2]) > 0.7 * sum(work), "the heavy key tiles are not at the front"
    # Within each (sequence, KV head) the work never grows with the block index (causal).
    for seq in range(len(lens)):
        mine = [b["m_end"] - b["m_begin"] for b in blocks if b["seq"] == seq and b["kv"] == 0]
        assert mine == sorted(mine, reverse=True)


@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"n{t[0]}m{t[1]}")
def test_visible_rows_of_a_key_are_exactly_the_rows_that_see_it(harness, tile):
    """visible_rows, the mask of the boundary tiles: for every key of every CTA (KV head 0) the
    span [first, last] of packed rows is exactly the rows whose query sees the key (GQA packs
    of 1..8, every window kind, keys past the sequence: none), empty as first > last."""
    block_n, _ = tile
    checked = empty = 0
    for seed in range(40):
        rng = random.Random(7000 + seed * 13 + block_n)
        cfg = random_batch(rng, block_n, long=seed % 8 == 0)
        cfg["deterministic"] = False
        pack = cfg["pack"]
        for b in run_schedule(harness[tile], cfg):
            if b["kv"] != 0:
                continue
            seq = b["seq"]
            lq, lk = cfg["len_q"][seq], cfg["len_k"][seq]
            vis = window_visibility(lq, lk, cfg["left"], cfg["right"])
            assert sorted(b["keys"]) == list(range(b["n"] * block_n, (b["n"] + 1) * block_n))
            for key, (first, last) in b["keys"].items():
                rows = [pr for pr in range(lq * pack) if key < lk and bool(vis[pr // pack, key])]
                what = f"seed {seed} {cfg['kind']} ({cfg['left']}, {cfg['right']}) pack {pack} lq {lq} lk {lk} key {key}"
                if rows:
                    assert (first, last) == (rows[0], rows[-1]) and len(rows) == last - first + 1, what
                else:
                    assert first > last and 0 <= first <= lq * pack and -1 <= last < lq * pack, what
                    empty += 1
                checked += 1
    assert checked > 1000 and empty > 0, f"too little checked: {checked} keys, {empty} seen by no row"


def written_by_ctas(blocks, cfg, block_n):
    """Key tokens whose dK / dV rows some CTA writes (store_dk_dv: its tile's keys below k_len)."""
    out = [False] * cfg["total_k"]
    for b in blocks:
        k_start = cfg["cu_k"][b["seq"]]
        k_len = cfg["used"][b["seq"]] if cfg["used"] is not None else cfg["cu_k"][b["seq"] + 1] - k_start
        k_len = max(0, min(k_len, cfg["total_k"] - k_start))
        for token in range(k_start + b["n"] * block_n, k_start + min((b["n"] + 1) * block_n, k_len)):
            out[token] = True
    return out


@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"n{t[0]}m{t[1]}")
def test_key_written_is_exactly_what_the_ctas_write(harness, tile):
    """The preprocess zeroes the dK / dV rows of the key tokens key_written says no CTA writes (dk
    and dv come from torch.empty): it must name exactly the tokens outside every CTA's tile rows,
    over random batches with seqused_k, slack slots, tail tokens and a too-small max_k."""
    block_n, block_m = tile
    unwritten = 0
    for seed in range(40):
        rng = random.Random(5000 + seed * 31 + block_n)
        cfg = random_batch(rng, block_n, long=seed % 8 == 0)
        if seed % 5 == 4:
            cfg["n_blocks"] = max(1, cfg["n_blocks"] - 2)
        cfg["deterministic"] = False
        blocks, written = run_schedule(harness[tile], cfg, want_written=True)
        assert len(written) == cfg["total_k"]
        assert written == written_by_ctas(blocks, cfg, block_n), f"seed {seed}: {cfg}"
        unwritten += written.count(False)
    assert unwritten > 0, "no batch left a key token to zero: the check above tested nothing"
