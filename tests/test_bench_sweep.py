"""The sweep benchmark's non-GPU parts (tools/bench_sweep.py: plan, records, JSON schema) and the
plots drawn from its JSON (tools/plot_benchmarks.py)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

import bench_sweep  # noqa: E402
from bench_sweep import Case, make_record, plan, throughput, validate_records  # noqa: E402


def random_records(rng, seqlens=(1024, 4096, 16384)):
    records = []
    for case in plan(quick=True):
        if case.area != "decode" and case.seqlen not in seqlens:
            continue
        for impl in ("jitattn", "sdpa") if case.area == "decode" else bench_sweep.VARLEN_IMPLS:
            records.append(make_record(case, impl, rng.uniform(0.1, 800), "NVIDIA H100 80GB HBM3", "2.14.1",
                                       "2026-12-06"))
    return records


def test_plan_keeps_the_total_tokens_fixed_and_covers_every_head_dim_and_mask():
    cases = plan(quick=False)
    varlen = [c for c in cases if c.area != "decode"]
    assert {c.area for c in cases} == {"forward", "backward", "decode"}
    assert all(c.batch * c.seqlen == bench_sweep.TOTAL_TOKENS for c in varlen)
    for area in ("forward", "backward"):
        points = {(c.head_dim, c.causal, c.seqlen) for c in varlen if c.area == area}
        assert points == {(d, m, n) for d in (64, 128, 256) for m in (False, True) for n in bench_sweep.SEQLENS}
    assert [c.seqlen for c in cases if c.area == "decode"] == list(bench_sweep.KV_LENS)
    quick = plan(quick=True)
    assert len(quick) < len(cases)
    assert {c.seqlen for c in quick if c.area == "forward"} == set(bench_sweep.QUICK_SEQLENS)


def test_plan_names_an_unknown_area():
    with pytest.raises(ValueError, match="areas: unknown area 'prefill'"):
        plan(["forward", "prefill"])


def test_throughput_counts_unmasked_flops_and_decode_bytes(rng):
    us = rng.uniform(50, 5000)
    full = Case("forward", 128, False, 4096, 8, 16, 16)
    causal = Case("forward", 128, True, 4096, 8, 16, 16)
    backward = Case("backward", 128, False, 4096, 8, 16, 16)
    assert throughput(full, us) == pytest.approx(8 * 4 * 4096 ** 2 * 128 * 16 / us / 1e6)
    assert throughput(causal, us) == pytest.approx(throughput(full, us) / 2)
    assert throughput(backward, us) == pytest.approx(2.5 * throughput(full, us))
    decode = Case("decode", 128, False, 32768, 1, 32, 8)
    # 32/8 heads at 32k: the README's "134.2 MB" of K/V, plus q and out.
    assert bench_sweep.decode_bytes(decode) == 2 * 32768 * 8 * 128 * 2 + 2 * 32 * 128 * 2
    assert throughput(decode, us) == pytest.approx(bench_sweep.decode_bytes(decode) / us / 1e6)
    with pytest.raises(ValueError, match="us: a time must be positive"):
        throughput(full, 0.0)


def test_records_follow_the_schema_and_survive_json(rng):
    records = random_records(rng)
    assert all(set(r) == set(bench_sweep.RECORD_KEYS) for r in records)
    assert {r["unit"] for r in records if r["area"] == "decode"} == {"TB/s"}
    assert {r["unit"] for r in records if r["area"] != "decode"} == {"TFLOP/s"}
    assert validate_records(json.loads(json.dumps(records))) == records


@pytest.mark.parametrize("change,message", [
    (lambda r: r.pop("gpu"), "expected the keys"),
    (lambda r: r.update(extra=1), "expected the keys"),
    (lambda r: r.update(unit="TB/s"), "with unit 'TB/s'"),
    (lambda r: r.update(head_dim=True), r"\.head_dim: expected"),
    (lambda r: r.update(value=-1.0), "must be positive"),
    (lambda r: r.update(causal="yes"), r"\.causal: expected"),
    (lambda r: r.update(date="yesterday"), "Invalid isoformat|yesterday"),
])
def test_a_bad_record_is_named(change, message, rng):
    records = random_records(rng)
    change(records[rng.choice([i for i, r in enumerate(records) if r["area"] == "forward"])])
    with pytest.raises(ValueError, match=message):
        validate_records(records)


def test_text_table_has_a_column_per_impl_and_a_row_per_point(rng):
    records = random_records(rng)
    table = bench_sweep.text_table(records).splitlines()
    points = {(r["area"], r["head_dim"], r["causal"], r["seqlen"]) for r in records}
    assert len(table) == 2 + len(points)
    for impl in bench_sweep.VARLEN_IMPLS:
        assert f" {impl} " in table[0]
    jitattn_value = next(r["value"] for r in records if r["impl"] == "jitattn" and r["area"] == "decode")
    assert any(f"{jitattn_value:.2f}" in line for line in table if line.startswith("| decode"))


def test_dry_run_prints_the_plan_without_a_gpu():
    result = subprocess.run([sys.executable, str(REPO / "tools" / "bench_sweep.py"), "--dry-run", "--quick",
                             "--areas", "forward", "decode"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    expected = [c.describe() for c in plan(["forward", "decode"], quick=True)]
    assert [line.split(":")[0] for line in lines[:-1]] == expected
    assert lines[-1].startswith(f"{len(expected)} cases")


def test_plots_are_drawn_for_each_area_from_the_json(tmp_path, rng):
    pytest.importorskip("matplotlib")
    import plot_benchmarks

    records = random_records(rng)
    results = tmp_path / "sweep.json"
    results.write_text(json.dumps(records))
    assert plot_benchmarks.main([str(results), "--out", str(tmp_path / "img")]) == 0
    for area in ("forward", "backward", "decode"):
        png = tmp_path / "img" / f"{area}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # A panel with one length (the transcribed README numbers) is drawn too, and an area without
    # records draws nothing.
    one = [r for r in records if r["area"] == "forward" and r["seqlen"] == 4096]
    results.write_text(json.dumps(one))
    assert plot_benchmarks.main([str(results), "--out", str(tmp_path / "one")]) == 0
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == ["forward.png"]


def test_plot_panels_put_jitattn_first_and_sort_lengths(rng):
    import plot_benchmarks

    records = random_records(rng)
    rng.shuffle(records)
    grid = plot_benchmarks.panels(records, "backward")
    assert set(grid) == {(d, m) for d in (64, 128, 256) for m in (False, True)}
    for impls in grid.values():
        assert plot_benchmarks.ordered_impls(impls)[0] == "jitattn"
        for points in impls.values():
            assert [n for n, _ in points] == sorted(bench_sweep.QUICK_SEQLENS)


def test_the_committed_plots_match_the_committed_numbers():
    data = REPO / "docs" / "data" / "h100-sweep-2026-12-06.json"
    records = bench_sweep.load_records(data)
    assert data.name in (REPO / "docs" / "benchmarks.md").read_text()  # the page names its plots' source
    for area in {r["area"] for r in records}:
        assert (REPO / "docs" / "img" / f"{area}.png").is_file(), area
    assert {r["impl"] for r in records} >= {"jitattn", "sdpa"}


def test_collect_times_every_impl_in_turn_and_drops_one_that_fails(rng):
    from bench_util import interleaved_us

    cases = plan(["forward", "decode"], quick=True)[:2] + plan(["decode"], quick=True)[:1]
    calls, times = [], {}

    def timers_for(case):
        def timer(impl, fail_on=None):
            def run():
                calls.append((case, impl))
                if fail_on is not None and sum(c == (case, impl) for c in calls) == fail_on:
                    raise RuntimeError("out of memory")
                us = rng.uniform(100, 1000)
                times.setdefault((case, impl), []).append(us)
                return us
            return run
        return {"jitattn": timer("jitattn"), "sdpa": timer("sdpa"), "flaky": timer("flaky", fail_on=2)}

    records = bench_sweep.collect(cases, timers_for, 3, "GPU", "2.14.1", "2026-12-06", interleaved_us)
    assert validate_records(records) == records
    assert {r["impl"] for r in records} == {"jitattn", "sdpa"}  # "flaky" failed in round 2 of each case
    assert len(records) == 2 * len(cases)
    first = [impl for case, impl in calls if case == cases[0]]
    assert first == ["jitattn", "sdpa", "flaky"] * 2 + ["jitattn", "sdpa"]  # in turn; no retry after a failure
    for record, case in zip(records[::2], cases):
        median = sorted(times[(case, "jitattn")])[1]
        assert record["value"] == pytest.approx(throughput(case, median), abs=0.01)
