"""templates/varlen/mask.cuh's tile runs on the CPU (host build: tests/native/tile_runs.cpp).

The search the forward's and the backward's schedulers trim a mask hook's empty tiles and find its
full run with, against brute force over random tiles and box coarseness (a box of tiles passes
only when every tile does and it is short enough, as interval analysis may be too coarse for a
long box): the result is always the exact run tile by tile, and long runs take logarithmically
many calls. And a mask map's slot (TileRun): the span of non-empty tiles and the longest run of
full ones, against brute force."""
import math
import random
import subprocess
from pathlib import Path

import pytest

from tests.conftest import require_host_cxx

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    cxx = require_host_cxx("the tile-run test")
    binary = tmp_path_factory.mktemp("tile_runs") / "tile_runs"
    subprocess.run([cxx, "-O1", "-std=c++17", f"-I{REPO / 'templates' / 'varlen'}",
                    str(REPO / "tests" / "native" / "tile_runs.cpp"), "-o", str(binary)], check=True)
    return binary


def _run(harness, cases):
    words = []
    for case in cases:
        if case[0] == "T":
            words += ["T", case[1], len(case[2]), *case[2]]
        else:
            n, a, b, limit, tiles = case
            words += ["P", n, a, b, limit, *tiles]
    out = subprocess.run([str(harness)], input=" ".join(map(str, words)), capture_output=True, text=True,
                         check=True).stdout.split("\n")
    return [tuple(map(int, line.split())) for line in out if line]


def test_runs_match_brute_force(harness):
    rng = random.Random(0)
    cases = []
    for _ in range(3000):
        n = rng.randint(0, 70)
        a = rng.randint(0, n)
        b = rng.randint(a, n)
        density = rng.random()
        tiles = [int(rng.random() < density) for _ in range(n)]
        limit = rng.choice([1, 2, 3, 8, 1000])
        cases.append((n, a, b, limit, tiles))
    for (n, a, b, limit, tiles), (end, begin, _, _) in zip(cases, _run(harness, cases)):
        want_end = a
        while want_end < b and tiles[want_end]:
            want_end += 1
        want_begin = b
        while want_begin > a and tiles[want_begin - 1]:
            want_begin -= 1
        assert (end, begin) == (want_end, want_begin), (n, a, b, limit, tiles)


def test_long_runs_take_logarithmic_calls(harness):
    """A causal mask's row block: 60 empty tiles then some visible ones; a window's full run."""
    cases = [(64, 0, 64, 1000, [1] * 60 + [0] * 4), (64, 0, 64, 1000, [0] * 4 + [1] * 60),
             (2, 0, 2, 1000, [1, 0])]
    results = _run(harness, cases)
    for (_, _, _, _, _), (_, _, prefix_calls, suffix_calls) in zip(cases[:2], results[:2]):
        assert max(prefix_calls, suffix_calls) <= 2 * math.ceil(math.log2(64)) + 2
    assert results[2][2] <= 2  # a short range: one call per tile


def test_a_mask_maps_slot_is_the_span_and_the_longest_full_run(harness):
    rng = random.Random(1)
    cases = []
    for _ in range(3000):
        n = rng.randint(0, 40)
        weights = rng.choice([(1, 1, 1), (5, 1, 1), (1, 1, 5), (1, 0, 1)])
        classes = rng.choices([0, 1, 2], weights=weights, k=n)
        cases.append(("T", rng.randint(0, 9), classes))
    for (_, first, classes), got in zip(cases, _run(harness, cases)):
        visible = [first + i for i, c in enumerate(classes) if c != 0]
        span = (visible[0], visible[-1] + 1) if visible else (first, first)
        best = (0, 0)
        i = 0
        while i < len(classes):  # the first of the longest runs of full tiles
            if classes[i] == 2:
                j = i
                while j < len(classes) and classes[j] == 2:
                    j += 1
                if j - i > best[1] - best[0]:
                    best = (first + i, first + j)
                i = j
            else:
                i += 1
        assert got == (*span, *best), (first, classes)
