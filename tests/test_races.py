"""Concurrent and killed builds, with real compiles in child processes.

- 16 processes ask for the same cold spec at once: exactly one compiles, all 16 succeed.
- 8 processes ask for 8 different specs at once: they build in parallel (per-key locks).
- A builder killed while another process waits for its lock: the waiter takes over.
- 20 builds killed with SIGKILL after seeded random delays, and 6 killed at each step of
  publishing: every entry directory verifies or is absent, no lock outlives its holder, `cache
  prune --staging-age 0` removes the litter, and a fresh process then gets every spec.

Children import torch before a start signal (stdin), so timings measure builds, not imports.
A kill is a SIGKILL of every process of the child's session (python, ninja and the compilers
ninja runs in process groups of their own), or of the python process alone.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jitattn.jit import cache, keys, loader
from jitattn.decode.spec import DecodeSpec
from tests.conftest import require_nvcc
from tests.procs import ARCH, ARCH_TAG, REPO, Builder, child_env, last_json, run_child

pytestmark = pytest.mark.compile

COMPILING = re.compile(r"compiling (\S+) \(([^)]*(?:\([^)]*\))?[^)]*)\)")
COMPILED = re.compile(r"compiled (\S+) in ([\d.]+) s")


@pytest.fixture(autouse=True)
def _nvcc():
    require_nvcc()


def key_of(spec: DecodeSpec, root: Path, monkeypatch) -> str:
    monkeypatch.setenv("JITATTN_CACHE_DIR", str(root))
    monkeypatch.setenv("JITATTN_CUDA_ARCH_LIST", ARCH)
    return keys.key_of(keys.components(spec, loader.current_target(spec, root)))


def entries_of(root: Path, spec: DecodeSpec) -> list[Path]:
    """Entry directories of `spec` under root, whatever their key. (Tests name entries by what
    the children built rather than by a key computed here, so they do not depend on the
    template files staying the same between this process and its children.)"""
    return cache.siblings(root, keys.CACHE_SCHEMA, ARCH_TAG, spec.name)


def staging_items(root: Path) -> list[Path]:
    base = root / cache.STAGING
    return sorted(base.iterdir()) if base.is_dir() else []


def start_builders(n: int, env: dict, script: str | None = None) -> list[Builder]:
    builders = [Builder(env, script) if script else Builder(env) for _ in range(n)]
    try:
        for b in builders:
            b.wait_ready()
    except Exception:
        for b in builders:
            b.kill()
        raise
    return builders


def assert_every_entry_verifies(root: Path) -> list[Path]:
    """The invariant of publishing: an entry directory exists only as a finished, verified entry
    (manifest included); an interrupted build never leaves a directory at an entry path."""
    found = list(cache.entries(root))
    for path in found:
        assert cache.why_invalid(path) is None, f"{path} exists but does not verify: {cache.why_invalid(path)}"
        assert not [p.name for p in path.iterdir() if p.name.endswith(".tmp")], path
    return found


def assert_locks_free(root: Path) -> float:
    """Take every build lock under root without waiting (a dead holder must not keep one: the
    kernel releases its lock with it), asserting none is held; the longest it took (to print).
    A non-blocking attempt, not a time bound: a loaded machine cannot make it fail."""
    import filelock

    longest = 0.0
    for lock_file in sorted((root / cache.LOCKS).glob("*.lock")):
        t0 = time.monotonic()
        lock = filelock.FileLock(str(lock_file))
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            raise AssertionError(f"{lock_file} is still held after its builder died") from None
        lock.release()
        longest = max(longest, time.monotonic() - t0)
    return longest


# ----------------------------------------------------------------------------- 1. races


def test_sixteen_processes_asking_for_one_cold_spec_compile_it_exactly_once(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    spec = DecodeSpec(head_dim=64)
    builders = start_builders(16, child_env(root, JITATTN_VERBOSE="1"))
    go = time.time()
    for b in builders:
        b.go(spec)
    results = [b.finish() for b in builders]
    wall = time.time() - go

    failures = [(rc, err[-2000:]) for rc, _, err in results if rc != 0]
    assert not failures, failures
    reports = [r for _, r, _ in results]
    logs = "".join(err for *_, err in results)
    compiling_lines = COMPILING.findall(logs)
    compiled_lines = COMPILED.findall(logs)
    waited = sum("waiting up to" in err for *_, err in results)
    entry = Path(reports[0]["entry"])

    print(f"\n16 processes, one cold spec: {sum(r['compiles'] for r in reports)} compile(s) by "
          f"COMPILE_COUNT, {len(compiling_lines)} 'compiling' log line(s), {waited} process(es) "
          f"logged waiting for the lock; wall {wall:.1f} s")
    assert sum(r["compiles"] for r in reports) == 1
    assert sum(r["compiled"] for r in reports) == 1
    assert compiling_lines == [(spec.name, "miss")] and [n for n, _ in compiled_lines] == [spec.name]
    assert all(r["entry"] == str(entry) and r["verified"] and r["has_ops"] for r in reports)
    # One published entry, built once, during this test, on this host.
    assert assert_every_entry_verifies(root) == [entry]
    manifest = json.loads((entry / cache.MANIFEST).read_text())
    assert manifest["built"]["host"] == socket.gethostname()
    assert go <= manifest["built"]["time"] <= go + wall
    assert staging_items(root) == []
    assert [p.name for p in (root / cache.LOCKS).glob("*.lock")] == [f"{manifest['key'][:32]}.lock"]


def test_eight_different_specs_build_in_parallel(tmp_path, monkeypatch):
    specs = [DecodeSpec(head_dim=64, dtype_q=dt, dtype_kv=dt, soft_cap=cap, group_tile=g)
             for dt in ("float16", "bfloat16") for cap in (False, True) for g in (1, 2)]
    assert len(set(specs)) == 8
    # One ninja job per build, so that a build uses one core: then 8 builds on N cores can at
    # best take 8/N times one build, and builds serialized by a shared lock would take 8x.
    env = dict(JITATTN_BUILD_JOBS="1")

    def alone(spec, root: Path) -> float:
        """One build alone, measured as the parallel ones are: start signal to module in hand."""
        (solo,) = start_builders(1, child_env(root, **env))
        solo.go(spec)
        rc, report, err = solo.finish()
        assert rc == 0, err[-3000:]
        assert report["compiled"]
        return report["end"] - report["start"]

    # The machine may be busy with other work: time one build before and one after, and compare
    # the parallel wall time with their mean.
    before = alone(specs[0], tmp_path / "solo-before")
    root = tmp_path / "cache"
    builders = start_builders(8, child_env(root, **env))
    go = time.time()
    for b, spec in zip(builders, specs):
        b.go(spec)
    results = [b.finish() for b in builders]
    failures = [(rc, err[-2000:]) for rc, _, err in results if rc != 0]
    assert not failures, failures
    reports = [r for _, r, _ in results]
    wall = max(r["end"] for r in reports) - go
    after = alone(specs[-1], tmp_path / "solo-after")
    one = (before + after) / 2
    ratio = wall / one
    # CPU seconds the 8 builds got per second of wall time: 2 on an idle 2-core machine, less
    # when other work shares it (then the ratio is inflated by that, not by jitattn).
    cores_used = sum(r["cpu"] for r in reports) / wall
    print(f"\none build alone: {before:.2f} s before, {after:.2f} s after; 8 different specs at once: "
          f"{wall:.2f} s wall = {ratio:.2f}x one build ({os.cpu_count()} cores, 1 ninja job per build, "
          f"the 8 builds got {cores_used:.2f} cores, load average {os.getloadavg()[0]:.1f}; "
          f"builds serialized by a lock would take >= 8x)")
    assert all(r["compiled"] and r["compiles"] == 1 and r["verified"] for r in reports)
    entries = assert_every_entry_verifies(root)
    assert len(entries) == 8 and len({r["entry"] for r in reports}) == 8
    assert len(list((root / cache.LOCKS).glob("*.lock"))) == 8  # one lock per key, not per family

    # The compile intervals (manifest built.time - built.seconds .. built.time) all overlap: every
    # build started before the first one finished, so none waited for another's lock.
    spans = []
    for path in entries:
        built = json.loads((path / cache.MANIFEST).read_text())["built"]
        spans.append((built["time"] - built["seconds"], built["time"]))
    assert max(s for s, _ in spans) < min(e for _, e in spans), spans
    # How many builds ran at once on average: their compile seconds (measured inside the lock,
    # in the same minutes as the wall time, so other load stretches both alike) over the wall
    # time. Builds serialized by a lock give <= 1; 8 in parallel give ~8. (A bound on `ratio`,
    # against solo builds timed minutes apart, failed when the machine's load changed between.)
    concurrency = sum(e - s for s, e in spans) / wall
    print(f"average builds at once: {concurrency:.2f}")
    assert concurrency > 4, (f"8 builds ran {concurrency:.2f} at a time on average (ratio {ratio:.2f}x one "
                             f"build, {cores_used:.2f} of {os.cpu_count()} cores, load {os.getloadavg()})")


def test_a_waiter_takes_over_when_the_lock_holder_is_killed(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    spec = DecodeSpec(head_dim=128)
    holder, waiter = start_builders(2, child_env(root, JITATTN_VERBOSE="1", JITATTN_LOCK_TIMEOUT="60"))
    holder.go(spec)
    deadline = time.monotonic() + 30
    while not any(f"pid {holder.pid} " in p.read_text() for p in (root / cache.LOCKS).glob("*.owner")):
        assert time.monotonic() < deadline, "the first builder never took the lock"
        time.sleep(0.02)
    waiter.go(spec)
    # Until the waiter says it is blocked on the holder's lock (a fixed sleep raced a loaded
    # machine: a waiter that reached the lock only after the kill never waited).
    deadline = time.monotonic() + 120
    while "waiting up to 60 s for the build lock" not in waiter.stderr():
        assert waiter.proc.poll() is None, f"the waiter exited without waiting: {waiter.stderr()[-3000:]}"
        assert time.monotonic() < deadline, "the waiter never blocked on the lock"
        time.sleep(0.02)
    assert holder.proc.poll() is None and waiter.proc.poll() is None  # the holder is still compiling
    killed_at = time.monotonic()
    holder.kill()
    rc, report, err = waiter.finish(timeout=120)
    took_over = time.monotonic() - killed_at
    holder_err = holder.stderr()
    print(f"\nwaiter finished {took_over:.1f} s after the lock holder was killed")
    assert rc == 0, err[-3000:]
    assert "waiting up to 60 s for the build lock" in err and f"pid {holder.pid}" in err
    assert not COMPILED.search(holder_err)  # the holder really died mid-build
    assert report["compiled"] and report["verified"]  # the waiter built it itself
    assert took_over < 60  # well before its lock timeout: the dead holder's lock was released
    assert assert_every_entry_verifies(root) == [Path(report["entry"])] == entries_of(root, spec)


# ----------------------------------------------------------------------------- 2. kills


def _phase(root: Path, pid: int, spec: DecodeSpec, rc: int) -> str:
    """Where a killed build was, from what it left in its staging dir."""
    if rc == 0:
        return "finished before the kill"
    mine = [p for p in staging_items(root) if f"-{pid}-" in p.name]
    if not mine:
        return "published, killed before returning" if entries_of(root, spec) else "lookup/lock (no staging yet)"
    names = {p.name for p in mine[0].iterdir()}
    if cache.MANIFEST in names or cache.MANIFEST + ".tmp" in names:
        return "publish (manifest written)"
    if cache.LIBRARY in names:
        return "manifest (library hashed)"
    if any(n.endswith(".so") for n in names):
        return "load (linked)"
    objects = {n for n in names if n.endswith(".o")}
    if len(objects) >= 2:
        return "link"
    if objects or "build.ninja" in names:
        return "compile"
    return "render"


def _check_after_kill(root: Path) -> float:
    assert_every_entry_verifies(root)
    return assert_locks_free(root)


RECOVER = """
    import json, os, sys, time
    from pathlib import Path
    import torch
    from jitattn.jit import cache, loader
    from jitattn.jit.registry import spec_from_dict
    unverified_loads = []  # libraries loaded from an entry dir that did not verify at that moment
    real_load_library = torch.ops.load_library
    def load_library(path):
        p = Path(path)
        if cache.STAGING not in p.parts and cache.why_invalid(p.parent) is not None:
            unverified_loads.append(str(p))
        return real_load_library(path)
    torch.ops.load_library = load_library
    report = []
    for root, spec in json.loads(sys.argv[1]):
        os.environ["JITATTN_CACHE_DIR"] = root
        t0 = time.perf_counter()
        module = loader.get_module(spec_from_dict(spec))
        report.append({"entry": str(module.entry.path), "seconds": time.perf_counter() - t0,
                       "verified": cache.why_invalid(module.entry.path) is None,
                       "has_ops": hasattr(module.ops, "ctas_per_sm")})
    print(json.dumps({"loads": report, "compiles": loader.COMPILE_COUNT, "unverified_loads": unverified_loads}))
"""


def _recover(pairs: list[tuple[Path, DecodeSpec]], timeout: float = 900) -> dict:
    """A fresh process gets every (root, spec) without waiting on any lock (a lock that
    outlived its holder would make it log the wait, then fail after JITATTN_LOCK_TIMEOUT).
    `timeout` only bounds a hung child: the compiles themselves take what the load allows."""
    t0 = time.monotonic()
    result = run_child(RECOVER, child_env(None, JITATTN_LOCK_TIMEOUT="30", JITATTN_VERBOSE="1"),
                       args=[json.dumps([[str(r), s.to_dict()] for r, s in pairs])], timeout=timeout)
    seconds = time.monotonic() - t0
    assert result.returncode == 0, result.stderr[-3000:]
    assert "waiting up to" not in result.stderr, result.stderr[-3000:]
    report = last_json(result.stdout)
    report["wall"] = seconds
    assert all(load["verified"] and load["has_ops"] for load in report["loads"]), report
    assert report["unverified_loads"] == []
    return report


def _prune(root: Path) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "jitattn", "cache", "prune", "--staging-age", "0"],
                            env=child_env(root), capture_output=True, text=True, timeout=120, cwd=str(REPO))
    assert result.returncode == 0, result.stderr
    return result


KILLS = 20
KILL_SEED = 20261129
MAX_DELAY = 4.0  # one build takes ~3-4 s here: delays cover lookup, render, compile, link, load


def test_builds_killed_at_random_moments_never_leave_an_unverified_entry(tmp_path):
    """20 rounds: a builder gets a spec, and after a seeded random delay it is SIGKILLed: the
    whole build (python, ninja, compilers), or in every 4th round only the python process (as
    the OOM killer would), whose compilers then run on as orphans. After each round: every entry
    dir verifies, every build lock can be taken at once. At the end: `cache prune --staging-age
    0` removes all litter and keeps the entries, and a fresh process gets both specs."""
    root = tmp_path / "cache"
    specs = [DecodeSpec(head_dim=64, soft_cap=True), DecodeSpec(head_dim=128, soft_cap=True)]
    rng = random.Random(KILL_SEED)
    delays = [round(rng.uniform(0, MAX_DELAY), 3) for _ in range(KILLS)]
    env = child_env(root, JITATTN_VERBOSE="1")
    outcomes, orphaned = [], []
    t_start = time.monotonic()
    upcoming = Builder(env)
    for i, delay in enumerate(delays):
        spec = specs[i % 2]
        python_only = i % 4 == 3
        for entry in entries_of(root, spec):  # a previous round finished it: start cold again
            shutil.rmtree(entry)
        builder = upcoming
        builder.wait_ready()
        upcoming = Builder(env) if i + 1 < KILLS else None  # imports while this one builds
        builder.go(spec)
        time.sleep(delay)
        rc = builder.proc.poll()
        if rc is None:
            if python_only:
                builder.kill_python_only()
                orphaned.append(builder)
            else:
                builder.kill()
            rc = builder.proc.returncode
        err = builder.stderr()
        phase = _phase(root, builder.pid, spec, rc)
        lock_wait = _check_after_kill(root)
        outcomes.append((i, spec.head_dim, delay, rc, phase))
        what = "python only" if python_only and rc != 0 else "whole build" if rc != 0 else "nothing"
        print(f"kill {i:2d}: head_dim {spec.head_dim:3d}, delay {delay:.3f} s, killed {what:11s} -> rc {rc}, "
              f"{phase}; locks free after {lock_wait * 1e3:.0f} ms")
        assert rc in (0, -signal.SIGKILL), err[-3000:]
        if rc == 0:
            assert len(entries_of(root, spec)) == 1
    for builder in orphaned:  # orphaned compilers write into their dead build's staging dir
        builder.wait_session_gone()
    assert_every_entry_verifies(root)
    litter = staging_items(root)
    print(f"{KILLS} rounds in {time.monotonic() - t_start:.1f} s, {sum(o[3] != 0 for o in outcomes)} killed; "
          f"phases: {sorted({o[4] for o in outcomes})}; staging litter: {len(litter)} item(s)")
    assert sum(o[3] != 0 for o in outcomes) >= KILLS // 2  # most rounds really were killed

    # Litter is only ever under staging/ (besides entries: lock files, the toolchain memo, logs,
    # the stamps of verified libraries).
    assert {p.name for p in root.iterdir()} <= {keys.CACHE_SCHEMA, cache.STAGING, cache.LOCKS, "logs",
                                               "toolchains.json", cache.STAMPS}, list(root.iterdir())
    before = {p: cache.read_entry(p).manifest for p in cache.entries(root)}
    pruned = _prune(root)
    assert staging_items(root) == [], pruned.stdout
    assert f"pruned {len(litter)} item(s)" in pruned.stdout
    assert {p: cache.read_entry(p).manifest for p in cache.entries(root)} == before  # entries kept

    report = _recover([(root, s) for s in specs])
    print(f"recovery in a fresh process: {report['compiles']} compile(s), {report['wall']:.1f} s")
    assert [[load["entry"]] for load in report["loads"]] == [list(map(str, entries_of(root, s))) for s in specs]
    assert_every_entry_verifies(root)


# Kill points inside the build, reached deterministically: the child kills its own process
# group there. Each leaves the state a SIGKILL at that instant leaves.
KILL_AT = """
import os, signal, sys, shutil
import torch.utils.cpp_extension as cpp_extension
from jitattn.jit import build, cache

def die():
    os.killpg(os.getpgrp(), signal.SIGKILL)

point = os.environ["TEST_KILL_AT"]
if point == "after_render":          # sources written to staging, nothing compiled
    build.compile_library = lambda *a, **k: die()
elif point == "after_link":          # module linked (and loaded) by load, not renamed
    real_load = cpp_extension.load
    def load(*a, **k):
        real_load(*a, **k); die()
    cpp_extension.load = load
elif point == "before_manifest":     # module.so in place, no manifest
    cache.write_manifest = lambda *a, **k: die()
elif point == "after_manifest":      # a finished staging dir, not yet renamed into place
    real_write_manifest = cache.write_manifest
    def write_manifest(*a, **k):
        real_write_manifest(*a, **k); die()
    cache.write_manifest = write_manifest
elif point == "after_publish":       # the entry is in place; died before loading it
    real_publish = cache.publish
    def publish(*a, **k):
        real_publish(*a, **k); die()
    cache.publish = publish
elif point == "replacing_corrupt":   # old corrupt entry moved aside, new one not yet renamed in
    real_rmtree = shutil.rmtree
    def rmtree(path, *a, **k):
        if os.path.basename(str(path)).startswith("replaced-"):
            die()
        return real_rmtree(path, *a, **k)
    cache.shutil.rmtree = rmtree
else:
    raise SystemExit(f"unknown kill point {point}")
"""


def _kill_at_script() -> str:
    from tests.procs import BUILDER

    head, sep, tail = BUILDER.partition('print("ready"')
    return head + KILL_AT + sep + tail


KILL_POINTS = ["after_render", "after_link", "before_manifest", "after_manifest", "after_publish",
               "replacing_corrupt"]


def test_builds_killed_at_each_step_of_publishing_leave_only_verified_entries(tmp_path, monkeypatch):
    """Each kill point in its own cache root, with its own spec (so one fresh process can then
    recover all of them: a process cannot load two builds of one spec)."""
    specs = [DecodeSpec(head_dim=64, dtype_q="bfloat16", dtype_kv="bfloat16", group_tile=g, soft_cap=cap)
             for g, cap in ((1, False), (2, False), (4, False), (8, False), (1, True), (2, True))]
    roots = [tmp_path / point for point in KILL_POINTS]
    script = _kill_at_script()
    builders = [Builder({**child_env(root), "TEST_KILL_AT": point}, script) for root, point in zip(roots, KILL_POINTS)]
    for b in builders:  # all import at once; they then run one at a time
        b.wait_ready()
    for point, root, spec, b in zip(KILL_POINTS, roots, specs, builders):
        if point == "replacing_corrupt":  # a corrupt entry (bad sha256) sits at the entry path
            key = key_of(spec, root, monkeypatch)
            entry = cache.entry_path(root, keys.CACHE_SCHEMA, ARCH_TAG, spec.name, key)
            entry.mkdir(parents=True)
            (entry / cache.LIBRARY).write_bytes(b"\x7fELF corrupt")
            (entry / cache.MANIFEST).write_text(json.dumps(
                {"key": key, "library": {"sha256": "0" * 64, "size": 12}}))
        b.go(spec)
        rc, _, err = b.finish(timeout=120)
        b.kill()  # nothing of it may run on (ninja had finished at every point; make sure)
        assert rc == -signal.SIGKILL, f"{point}: rc {rc}\n{err[-3000:]}"
        names = sorted(p.name for item in staging_items(root) for p in ([item] if item.is_file() else item.iterdir()))
        found = entries_of(root, spec)
        state = "absent" if not found else "published" if all(cache.read_entry(e) for e in found) else "INVALID"
        print(f"killed {point:18s}: entry {state}, staging litter {len(staging_items(root))} item(s) {names}")
        assert_every_entry_verifies(root)
        assert state == ("published" if point == "after_publish" else "absent"), (
            point, sorted(map(str, root.rglob("*"))), err[-3000:])
        assert_locks_free(root)
        if point != "after_publish":
            assert staging_items(root), "a killed build leaves its staging dir (until pruned)"
        _prune(root)
        assert staging_items(root) == []
    report = _recover(list(zip(roots, specs)))
    print(f"recovery of {len(roots)} roots in one fresh process: {report['compiles']} compile(s), "
          f"{report['wall']:.1f} s")
    assert report["compiles"] == len(roots) - 1  # every root but the published one built again
    for root in roots:
        assert len(assert_every_entry_verifies(root)) == 1
