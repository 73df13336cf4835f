"""Helpers for fleet-tier tests: a real redis-server fixture, nodes (a cache root each) with a fake
toolchain and compiler, and the child process that asks for one spec the way a serving process
does (loader.get_module) and reports what it got.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import fake_compiler
from tests.procs import ARCH, Builder, child_env
from tests.redis_server import RedisServer, require_redis

SECRET = "fleet-secret-for-tests-0123456789abcdef"
OTHER_SECRET = "another-fleet-secret-9876543210fedcba"


@pytest.fixture
def server(tmp_path):
    """A real redis-server on a free localhost port, stopped at the end of the test."""
    srv = RedisServer(require_redis(), tmp_path / "redis").start()
    yield srv
    srv.stop()


def node_env(root: Path | None, url: str | None, cuda_home: Path | str | None, **extra: str) -> dict:
    """The environment of a process on one node: its cache root, the fleet tier and secret,
    archs 9.0, and a toolchain: a fake CUDA home (then builds are fake compiles), "real" (this
    machine's nvcc), or None (no toolkit at all). Libraries are fake ones (FAKE_LIBS=1: the
    asker checks their id) unless the toolchain is real."""
    env = child_env(root, JITATTN_VERBOSE="1", JITATTN_CUDA_ARCH_LIST=ARCH)
    if cuda_home != "real":
        env.pop("CUDA_PATH", None)
        env["CUDA_HOME"] = str(cuda_home) if cuda_home is not None else "/nonexistent-cuda"
        env["FAKE_LIBS"] = "1"
    if cuda_home not in (None, "real"):
        env["FAKE_COMPILE"] = "1"
    if url is not None:
        env.update(JITATTN_REMOTE_CACHE=url, JITATTN_REMOTE_CACHE_KEY=SECRET)
    env.update(extra)
    return env


# A process that imports everything, says "ready", reads one spec (JSON) from stdin, asks the
# loader for it and prints a JSON report: what it loaded and whether that is the right library.
ASKER = r"""
import json, os, sys, time
import torch
from jitattn.jit import cache, keys, loader
from jitattn.jit.registry import spec_from_dict
fake = os.environ.get("FAKE_LIBS") == "1"
if os.environ.get("FAKE_COMPILE") == "1":
    from tests import fake_compiler
    fake_compiler.install()
print("ready", os.getpid(), flush=True)
spec = spec_from_dict(json.loads(sys.stdin.readline()))
redis_before = "redis" in sys.modules
start = time.time()
module, error = None, None
try:
    module = loader.get_module(spec)
except Exception as exc:
    error = f"{type(exc).__name__}: {exc}"
end = time.time()
report = {"pid": os.getpid(), "compiles": loader.COMPILE_COUNT, "pulls": loader.PULL_COUNT, "start": start,
          "end": end, "error": error, "redis_imported": "redis" in sys.modules, "redis_before": redis_before}
if module is not None:
    entry = module.entry
    report.update(entry=str(entry.path), key=entry.key,
                  verified=cache.read_entry(entry.path, entry.key) is not None,
                  key_is_hash_of_components=keys.key_of(entry.components) == entry.key)
    if fake:
        from tests.fake_compiler import fake_id
        report["fake_id"] = fake_id(entry.library)
    else:
        report["has_ops"] = hasattr(module.ops, "ctas_per_sm")
print(json.dumps(report), flush=True)
"""


def start_askers(envs: list[dict], script: str = ASKER) -> list[Builder]:
    askers = [Builder(env, script) for env in envs]
    try:
        for a in askers:
            a.wait_ready()
    except Exception:
        for a in askers:
            a.kill()
        raise
    return askers


def ask_all(askers: list[Builder], spec, timeout: float = 300) -> list[tuple[int, dict | None, str]]:
    for a in askers:
        a.go(spec)
    return [a.finish(timeout=timeout) for a in askers]


def expected_key(spec, cuda_home: Path, memo_root: Path, monkeypatch) -> str:
    """The key every node with this fake toolchain computes for `spec` (archs 9.0)."""
    from jitattn.jit import keys, loader, toolchain

    monkeypatch.setenv("CUDA_HOME", str(cuda_home))
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("JITATTN_CUDA_ARCH_LIST", ARCH)
    toolchain._fingerprint.cache_clear()
    return keys.key_of(keys.components(spec, loader.current_target(spec, root=memo_root)))


def read_json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]

