"""One compile per fleet, with real processes, separate cache roots (nodes) and a real
redis-server; builds are fake compiles (tests/fake_compiler.py) except in the nvcc test.

- 8 processes over 4 roots ask for one cold spec at once: 1 compile fleet-wide, 8 correct loads
  (and the same with a real nvcc compile of a small spec).
- a builder SIGKILLed while it holds the fleet lock: the lock expires and another node builds;
  a build longer than the lock's TTL is not duplicated (the lock is renewed); a failed build
  releases the lock at once; the server killed while a node waits: that node builds locally.
- a node with an empty root, no compiler and JITATTN_DISABLE_JIT=1 serves a spec another node
  built; after that, its processes load it locally without importing redis or connecting.
- a pull killed between vetting and publishing leaves only staging litter.
"""
from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest

from jitattn.jit import cache, keys, remote
from jitattn.decode.spec import DecodeSpec
from tests import fake_compiler
from tests.conftest import require_nvcc
from tests.fleet import ASKER, ask_all, expected_key, node_env, server, start_askers  # noqa: F401
from tests.procs import Builder

SPEC = DecodeSpec(head_dim=64, dtype_q="bfloat16", dtype_kv="bfloat16", group_tile=2)


@pytest.fixture
def cuda(tmp_path):
    fake_compiler.require_cc()
    return fake_compiler.make_cuda_home(tmp_path / "cuda")


def entries(root: Path) -> list[Path]:
    return list(cache.entries(root))


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def check_loads(results, key: str, fake: bool = True) -> list[dict]:
    reports = []
    for rc, report, err in results:
        assert rc == 0 and report is not None, err[-3000:]
        assert report["error"] is None, report["error"]
        assert report["key"] == key and report["verified"] and report["key_is_hash_of_components"], report
        if fake:
            assert report["fake_id"] == f"jitattn_{key[:16]}", report  # the library built for this key
        else:
            assert report["has_ops"], report
        reports.append(report)
    return reports


# ----------------------------------------------------------------------------- one compile per fleet


def _eight_over_four(tmp_path, server, cuda_home, spec, timeout, **extra):
    roots = [tmp_path / f"node{i}" for i in range(4)]
    log = tmp_path / "compiles.log"
    envs = [node_env(roots[i % 4], server.url, cuda_home, FAKE_COMPILE_LOG=str(log), **extra) for i in range(8)]
    askers = start_askers(envs)
    t0 = time.time()
    results = ask_all(askers, spec, timeout=timeout)
    return roots, log, results, t0


def _summary(reports, roots, t0) -> str:
    by_root = {}
    for r in reports:
        by_root.setdefault(str(Path(r["entry"]).parents[2].name), []).append(r)
    parts = [f"{name}: " + ", ".join(f"{'compiled' if r['compiles'] else 'pulled' if r['pulls'] else 'local'}"
                                     for r in rs) for name, rs in sorted(by_root.items())]
    return (f"8 processes over {len(roots)} roots: {sum(r['compiles'] for r in reports)} compile(s), "
            f"{sum(r['pulls'] for r in reports)} pull(s), {len(reports)} correct loads, last done "
            f"{max(r['end'] for r in reports) - t0:.1f} s after the start signal ({'; '.join(parts)})")


def test_eight_processes_over_four_nodes_compile_a_cold_spec_once_fleet_wide(tmp_path, server, cuda, monkeypatch):
    key = expected_key(SPEC, cuda, tmp_path / "memo", monkeypatch)
    roots, log, results, t0 = _eight_over_four(tmp_path, server, cuda, SPEC, 120, FAKE_COMPILE_SECONDS="2")
    reports = check_loads(results, key)
    print("\n" + _summary(reports, roots, t0))
    assert len(fake_compiler.compiles(log)) == 1  # one compile fleet-wide ...
    assert sum(r["compiles"] for r in reports) == 1
    assert sum(r["pulls"] for r in reports) == 3  # ... one pull into each other node ...
    for root in roots:  # ... and every node holds exactly that verified entry
        assert [p.name for p in entries(root)] == [f"{SPEC.name}-{key[:16]}"]
        assert cache.why_invalid(entries(root)[0]) is None
    assert all(r["start"] < min(x["end"] for x in reports) for r in reports)  # they really overlapped
    assert server.client().get(remote.lock_name(key)) is None  # the fleet lock was released


@pytest.mark.compile
def test_eight_processes_over_four_nodes_with_a_real_nvcc_compile_once(tmp_path, server, monkeypatch):
    require_nvcc()
    spec = DecodeSpec(head_dim=64, dtype_q="bfloat16", dtype_kv="bfloat16", group_tile=2, soft_cap=True)
    roots, _, results, t0 = _eight_over_four(tmp_path, server, "real", spec, 400)
    key = results[0][1]["key"] if results[0][1] else None
    reports = check_loads(results, key, fake=False)
    print("\n" + _summary(reports, roots, t0))
    assert sum(r["compiles"] for r in reports) == 1
    assert sum(r["pulls"] for r in reports) == 3
    for root in roots:
        assert [p.name for p in entries(root)] == [f"{spec.name}-{key[:16]}"]
    manifests = {(e / cache.MANIFEST).read_bytes() for root in roots for e in entries(root)}
    assert len(manifests) == 1  # every node holds the one build (its manifest, built time included)
    assert json.loads(manifests.pop())["built"]["seconds"] > 0


# ----------------------------------------------------------------------------- kills and lock lifetime


def test_a_killed_builders_fleet_lock_expires_and_another_node_builds(tmp_path, server, cuda, monkeypatch):
    key = expected_key(SPEC, cuda, tmp_path / "memo", monkeypatch)
    log = tmp_path / "compiles.log"
    common = dict(FAKE_COMPILE_LOG=str(log), JITATTN_REMOTE_CACHE_LOCK_TTL="2", JITATTN_LOCK_TIMEOUT="60")
    holder, waiter = start_askers([
        node_env(tmp_path / "a", server.url, cuda, FAKE_COMPILE_SECONDS="120", **common),
        node_env(tmp_path / "b", server.url, cuda, FAKE_COMPILE_SECONDS="0.2", **common)])
    holder.go(SPEC)
    token = wait_for(lambda: server.client().get(remote.lock_name(key)), 60, "the holder's fleet lock").decode()
    assert f"pid {holder.pid} " in token
    wait_for(lambda: fake_compiler.compiles(log), 30, "the holder's compile")
    waiter.go(SPEC)
    time.sleep(1.5)  # the waiter is polling the fleet lock; the holder renews it (TTL 2 s)
    assert waiter.proc.poll() is None
    killed = time.monotonic()
    holder.kill()
    lock = remote.lock_name(key)
    wait_for(lambda: server.client().get(lock) != token.encode(), 30, "the dead holder's lock to go")
    expired = time.monotonic() - killed
    rc, report, err = waiter.finish(timeout=60)
    took = time.monotonic() - killed
    print(f"\nthe dead holder's fleet lock (TTL 2 s) went {expired:.2f} s after the kill; the waiter had built "
          f"and loaded the spec {took:.1f} s after it")
    assert rc == 0 and report["error"] is None, err[-3000:]
    assert report["compiles"] == 1 and report["fake_id"] == f"jitattn_{key[:16]}"
    assert re.search(rf"waiting up to 60 s for {SPEC.name}, which \S+ pid {holder.pid} ", err), err[-3000:]
    assert expired < 2 + 0.5  # nobody renewed it: it expired after its TTL ...
    assert took < 30  # ... and the waiter took over, long before its 60 s lock timeout
    assert entries(tmp_path / "a") == []  # the killed build left no entry, only staging litter
    assert len(fake_compiler.compiles(log)) == 2


def test_a_build_longer_than_the_lock_ttl_is_not_duplicated(tmp_path, server, cuda, monkeypatch):
    key = expected_key(SPEC, cuda, tmp_path / "memo", monkeypatch)
    log = tmp_path / "compiles.log"
    common = dict(FAKE_COMPILE_LOG=str(log), JITATTN_REMOTE_CACHE_LOCK_TTL="1", FAKE_COMPILE_SECONDS="4")
    builder, waiter = start_askers([node_env(tmp_path / "a", server.url, cuda, **common),
                                    node_env(tmp_path / "b", server.url, cuda, **common)])
    builder.go(SPEC)
    wait_for(lambda: fake_compiler.compiles(log), 30, "the compile")
    waiter.go(SPEC)
    held, watcher, deadline = [], server.client(), time.monotonic() + 60
    while builder.proc.poll() is None and time.monotonic() < deadline:
        ttl = watcher.pttl(remote.lock_name(key))
        if ttl > 0:
            held.append((time.monotonic(), ttl))
        time.sleep(0.01)
    results = [builder.finish(timeout=60), waiter.finish(timeout=60)]
    reports = check_loads(results, key)
    assert len(fake_compiler.compiles(log)) == 1 and reports[1]["pulls"] == 1
    span = held[-1][0] - held[0][0]
    print(f"\nthe fleet lock (TTL 1 s) was held {span:.1f} s by a 4 s build; the waiter pulled")
    assert span > 2.5 and max(t for _, t in held) <= 1000  # held past 2 TTLs, never longer than 1: renewed


def test_a_failed_build_releases_the_fleet_lock_at_once(tmp_path, server, cuda, monkeypatch):
    log = tmp_path / "compiles.log"
    common = dict(FAKE_COMPILE_LOG=str(log), FAKE_COMPILE_FAIL="1", FAKE_COMPILE_SECONDS="1.5",
                  JITATTN_REMOTE_CACHE_LOCK_TTL="30")
    first, second = start_askers([node_env(tmp_path / "a", server.url, cuda, **common),
                                  node_env(tmp_path / "b", server.url, cuda, **common)])
    first.go(SPEC)
    wait_for(lambda: fake_compiler.compiles(log), 30, "the first compile")
    second.go(SPEC)
    (_, r1, e1), (_, r2, e2) = first.finish(timeout=60), second.finish(timeout=60)
    assert r1["error"].startswith("JitCompileError") and r2["error"].startswith("JitCompileError"), (e1, e2)
    assert r2["end"] - r1["end"] < 5  # not the 30 s TTL: the failed builder released its lock
    assert len(fake_compiler.compiles(log)) == 2


def test_the_server_killed_while_a_node_waits_for_the_fleet_lock_ends_in_a_local_build(tmp_path, server, cuda,
                                                                                    monkeypatch):
    key = expected_key(SPEC, cuda, tmp_path / "memo", monkeypatch)
    log = tmp_path / "compiles.log"
    builder, waiter = start_askers([
        node_env(tmp_path / "a", server.url, cuda, FAKE_COMPILE_LOG=str(log), FAKE_COMPILE_SECONDS="6"),
        node_env(tmp_path / "b", server.url, cuda, FAKE_COMPILE_LOG=str(log), FAKE_COMPILE_SECONDS="0.2")])
    builder.go(SPEC)
    wait_for(lambda: fake_compiler.compiles(log), 30, "the compile")
    waiter.go(SPEC)
    time.sleep(1.0)
    assert waiter.proc.poll() is None  # waiting for the fleet build
    killed = time.monotonic()
    server.kill()
    rc, report, err = waiter.finish(timeout=60)
    took = time.monotonic() - killed
    assert rc == 0 and report["error"] is None, err[-3000:]
    assert report["compiles"] == 1 and took < 10, took
    assert "going on locally" in err and "ConnectionError" in err
    built = builder.finish(timeout=60)
    check_loads([(rc, report, err), built], key)  # both loaded the right library
    assert report["end"] < built[1]["end"]  # the waiter did not wait for the fleet build to finish
    assert len(fake_compiler.compiles(log)) == 2


KILL_BEFORE_PUBLISH = r"""
import os, signal
from jitattn.jit import cache
real_publish = cache.publish
def publish(staging, final, replace=False):
    if "vetted" in str(staging) and "vetted" not in str(final):  # the pulled entry, vetted, not yet in place
        os.killpg(os.getpgrp(), signal.SIGKILL)
    return real_publish(staging, final, replace)
cache.publish = publish
"""


def test_a_pull_killed_before_publishing_leaves_only_staging_litter(tmp_path, server, cuda, monkeypatch):
    key = expected_key(SPEC, cuda, tmp_path / "memo", monkeypatch)
    (builder,) = start_askers([node_env(tmp_path / "a", server.url, cuda, FAKE_COMPILE_SECONDS="0")])
    check_loads(ask_all([builder], SPEC), key)
    b = tmp_path / "b"
    head, sep, tail = ASKER.partition('print("ready"')
    (victim,) = start_askers([node_env(b, server.url, cuda)], head + KILL_BEFORE_PUBLISH + sep + tail)
    victim.go(SPEC)
    rc, _, err = victim.finish(timeout=60)
    assert rc == -signal.SIGKILL, err[-3000:]
    assert entries(b) == [] and any((b / cache.STAGING).iterdir())
    (again,) = start_askers([node_env(b, server.url, cuda)])
    (report,) = check_loads(ask_all([again], SPEC), key)
    assert report["pulls"] == 1 and report["compiles"] == 0
    assert [p.name for p in entries(b)] == [f"{SPEC.name}-{key[:16]}"]


# ----------------------------------------------------------------------------- strict mode, warm path


def test_a_strict_node_with_an_empty_root_serves_what_another_node_built(tmp_path, server, cuda, monkeypatch):
    key = expected_key(SPEC, cuda, tmp_path / "memo", monkeypatch)
    (builder,) = start_askers([node_env(tmp_path / "a", server.url, cuda, FAKE_COMPILE_SECONDS="0")])
    check_loads(ask_all([builder], SPEC), key)
    strict = tmp_path / "serving"
    (first,) = start_askers([node_env(strict, server.url, None, JITATTN_DISABLE_JIT="1")])  # no compiler at all
    (report,) = check_loads(ask_all([first], SPEC), key)
    assert (report["compiles"], report["pulls"]) == (0, 1)
    assert report["redis_imported"] and not report["redis_before"]

    watcher = server.client()
    before = watcher.info("stats")["total_connections_received"]
    later = start_askers([node_env(strict, server.url, None, JITATTN_DISABLE_JIT="1"),
                          node_env(strict, "redis://127.0.0.1:1/0", None, JITATTN_DISABLE_JIT="1")])
    for report in check_loads(ask_all(later, SPEC), key):
        assert (report["compiles"], report["pulls"]) == (0, 0)
        assert not report["redis_imported"]  # the warm path never imports the client ...
    assert watcher.info("stats")["total_connections_received"] == before  # ... nor connects
