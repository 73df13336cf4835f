"""Corrupt entries of a real build are never loaded: normal mode rebuilds them (a real compile,
logged as "corrupt entry (<why>)") and the rebuilt entry verifies; strict mode raises a
MissingSpecializationError naming the entry and why it does not verify. And a failed compile
leaves no staging litter and releases its lock: a second attempt fails the same way at once.

test_cache.py covers the same corruptions on fake entries (read_entry/why_invalid/publish);
these run the loader on entries nvcc built.
"""
from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest

from jitattn.errors import JitCompileError, MissingSpecializationError
from jitattn.jit import cache, keys, loader, render
from jitattn.decode.spec import DecodeSpec
from tests.conftest import require_nvcc
from tests.procs import ARCH, ARCH_TAG, REPO, child_env, last_json, run_child, tree
from tests.corruptions import CORRUPTIONS

pytestmark = pytest.mark.compile

SPEC = DecodeSpec(head_dim=64, soft_cap=True, group_tile=4)
OTHER = DecodeSpec(head_dim=64, soft_cap=True, group_tile=8)

BUILD_BOTH = """
    import json, sys
    from jitattn.jit import loader
    from jitattn.jit.registry import spec_from_dict
    entries = [str(loader.build_spec(spec_from_dict(s))[0].entry.path) for s in json.loads(sys.argv[1])]
    print(json.dumps({"entries": entries, "compiles": loader.COMPILE_COUNT}))
"""

# get_module in a fresh process, recording every library it loads and whether that library's
# entry verified at that moment (a fresh build's library is loaded from its staging dir).
GET_RECORDING_LOADS = """
    import json, sys
    from pathlib import Path
    import torch
    from jitattn.jit import cache, loader
    from jitattn.jit.registry import spec_from_dict
    loads = []
    real_load_library = torch.ops.load_library
    def load_library(path):
        p = Path(path)
        staged = cache.STAGING in p.parts
        loads.append({"path": str(p), "staging": staged, "why_invalid": None if staged else cache.why_invalid(p.parent)})
        return real_load_library(path)
    torch.ops.load_library = load_library
    module = loader.get_module(spec_from_dict(json.loads(sys.argv[1])))
    print(json.dumps({"entry": str(module.entry.path), "compiles": loader.COMPILE_COUNT, "loads": loads,
                      "has_ops": hasattr(module.ops, "ctas_per_sm")}))
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(root, SPEC's entry, OTHER's entry): both built by nvcc in a child process."""
    require_nvcc()
    root = tmp_path_factory.mktemp("built") / "cache"
    result = run_child(BUILD_BOTH, child_env(root), args=[json.dumps([SPEC.to_dict(), OTHER.to_dict()])])
    assert result.returncode == 0, result.stderr[-3000:]
    report = last_json(result.stdout)
    assert report["compiles"] == 2
    entry, other = map(Path, report["entries"])
    assert cache.why_invalid(entry) is None and cache.why_invalid(other) is None
    return root, entry, other




@pytest.fixture
def corrupted(built, tmp_path, request):
    """A copy of the built cache with SPEC's entry corrupted one way: (root, entry, other, why)."""
    src_root, src_entry, src_other = built
    root = tmp_path / "cache"
    shutil.copytree(src_root, root)
    entry = root / src_entry.relative_to(src_root)
    other = root / src_other.relative_to(src_root)
    corrupt, why = CORRUPTIONS[request.param]
    corrupt(entry, other)
    assert cache.read_entry(entry) is None and why in cache.why_invalid(entry)
    return root, entry, other, cache.why_invalid(entry)


@pytest.mark.parametrize("corrupted", list(CORRUPTIONS), indirect=True)
def test_a_corrupt_entry_is_rebuilt_not_loaded_and_the_rebuild_verifies(corrupted):
    root, entry, other, why = corrupted
    old_manifest = (entry / cache.MANIFEST).read_text() if (entry / cache.MANIFEST).exists() else None
    other_manifest = (other / cache.MANIFEST).read_text()
    t0 = time.time()
    result = run_child(GET_RECORDING_LOADS, child_env(root, JITATTN_VERBOSE="1"), args=[json.dumps(SPEC.to_dict())])
    assert result.returncode == 0, result.stderr[-3000:]
    report = last_json(result.stdout)

    # A real compile, logged with the reason.
    assert report["compiles"] == 1
    assert f"compiling {SPEC.name} (corrupt entry ({why}))" in result.stderr, result.stderr[-2000:]
    assert re.search(rf"compiled {SPEC.name} in [\d.]+ s", result.stderr)
    # Nothing that did not verify was loaded: the only library loaded is the fresh build's.
    assert report["loads"] and all(load["staging"] or load["why_invalid"] is None for load in report["loads"])
    assert not [load for load in report["loads"] if Path(load["path"]).parent == entry]
    # The rebuilt entry is in place, verifies, and is new.
    assert report["entry"] == str(entry) and report["has_ops"]
    assert cache.why_invalid(entry) is None
    manifest = json.loads((entry / cache.MANIFEST).read_text())
    assert manifest["built"]["time"] >= t0 and manifest["name"] == SPEC.name
    assert (entry / cache.MANIFEST).read_text() != old_manifest
    # The corrupt entry was moved aside and deleted (no litter); the other entry is untouched.
    assert not (root / cache.STAGING).exists() or list((root / cache.STAGING).iterdir()) == []
    assert (other / cache.MANIFEST).read_text() == other_manifest and cache.why_invalid(other) is None
    assert [p for p in cache.entries(root)] == sorted([entry, other])


@pytest.fixture
def strict_mode(monkeypatch):
    """Strict mode in this process, with fresh memos and a torch.ops.load_library that fails the
    test if anything is loaded."""
    monkeypatch.setenv("JITATTN_DISABLE_JIT", "1")
    monkeypatch.setenv("JITATTN_CUDA_ARCH_LIST", ARCH)
    monkeypatch.delenv("JITATTN_CACHE_SEED_DIRS", raising=False)
    monkeypatch.delenv("JITATTN_RECORD", raising=False)
    import torch

    def no_load(path):
        pytest.fail(f"strict mode loaded {path}")

    monkeypatch.setattr(torch.ops, "load_library", no_load)
    with loader.forget_loaded():
        yield


@pytest.mark.parametrize("corrupted", list(CORRUPTIONS), indirect=True)
def test_strict_mode_names_a_corrupt_entry_and_why_it_does_not_verify(corrupted, strict_mode, monkeypatch):
    root, entry, other, why = corrupted
    monkeypatch.setenv("JITATTN_CACHE_DIR", str(root))
    before = tree(root)
    compiles = loader.COMPILE_COUNT
    with pytest.raises(MissingSpecializationError) as info:
        loader.get_module(SPEC)
    message = str(info.value)
    assert SPEC.name in message and "JITATTN_DISABLE_JIT=1" in message
    assert f"nearest cached entry: {entry}" in message
    assert f"entry does not verify: {why}" in message
    assert loader.COMPILE_COUNT == compiles and SPEC not in loader._modules
    assert tree(root) == before  # strict mode repairs nothing and writes nothing


# ----------------------------------------------------------------------------- 8. compile failure

RETRY_BROKEN = """
    import json, sys, time
    from pathlib import Path
    from jitattn.errors import JitCompileError
    from jitattn.jit import loader, render
    from jitattn.jit.registry import spec_from_dict
    broken = Path(sys.argv[2])
    render.templates_dir = lambda: broken
    t0 = time.perf_counter()
    try:
        loader.get_module(spec_from_dict(json.loads(sys.argv[1])))
        report = {"error": None}
    except Exception as exc:
        report = {"error": type(exc).__name__, "first_error": getattr(exc, "first_error", str(exc))}
    report["seconds"] = time.perf_counter() - t0
    print(json.dumps(report))
"""


def _error_text(first_error: str) -> str:
    """The compiler's message without the file path (the kept copy's name has a timestamp)."""
    return re.sub(r"^.*?(?:\(\d+\)|:\d+(?::\d+)?):\s*", "", first_error)


def test_a_failed_build_leaves_no_litter_and_releases_its_lock(cache_root, tmp_path, monkeypatch):
    require_nvcc()
    monkeypatch.setenv("JITATTN_CUDA_ARCH_LIST", ARCH)
    broken = tmp_path / "templates"
    shutil.copytree(REPO / "templates", broken)
    kernels = broken / "decode" / "kernels.cu.j2"
    kernels.write_text(kernels.read_text() + "\nthis is not C++ either;\n")
    monkeypatch.setattr(render, "templates_dir", lambda: broken)
    spec = DecodeSpec(head_dim=112)

    t0 = time.monotonic()
    with pytest.raises(JitCompileError) as info, loader.forget_loaded():
        loader.get_module(spec)
    first = time.monotonic() - t0
    assert "error" in info.value.first_error
    # No entry, no staging litter; exactly one lock file, and nobody holds it.
    assert list(cache.entries(cache_root)) == []
    assert not (cache_root / cache.STAGING).exists() or list((cache_root / cache.STAGING).iterdir()) == []
    assert cache.siblings(cache_root, keys.CACHE_SCHEMA, ARCH_TAG, spec.name) == []
    assert len(list((cache_root / cache.LOCKS).glob("*.lock"))) == 1

    # A second attempt from another process fails the same way, compiling again at once rather
    # than waiting on a lock left behind (its lock timeout is 30 s; a compile takes a few).
    result = run_child(RETRY_BROKEN, child_env(cache_root, JITATTN_VERBOSE="1", JITATTN_LOCK_TIMEOUT="30"),
                       args=[json.dumps(spec.to_dict()), str(broken)])
    assert result.returncode == 0, result.stderr[-3000:]
    report = last_json(result.stdout)
    print(f"\nfailed build: {first:.1f} s in this process, {report['seconds']:.1f} s in a second process")
    assert report["error"] == "JitCompileError", report
    assert _error_text(report["first_error"]) == _error_text(info.value.first_error)
    # It compiled at once: no wait was logged, and the error is the compiler's, not the lock
    # timeout's (a wall-time bound here failed when the machine was loaded).
    assert "waiting up to" not in result.stderr and f"compiling {spec.name} (miss)" in result.stderr
    assert list(cache.entries(cache_root)) == []
    assert not (cache_root / cache.STAGING).exists() or list((cache_root / cache.STAGING).iterdir()) == []
    # Both failures kept their logs.
    assert len(list((cache_root / "logs").glob(f"{spec.name}-*.log"))) == 2
