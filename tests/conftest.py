import os
import random
import shutil

import pytest
import torch

HAS_GPU = torch.cuda.is_available()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "compile: runs nvcc (must not skip under CI=true)")


def pytest_collection_modifyitems(config, items):
    if HAS_GPU or os.environ.get("JITATTN_TEST_DEVICE") == "cpu":  # a dry run of GPU tests' logic on the CPU
        return
    skip = pytest.mark.skip(reason="no CUDA GPU on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng():
    """A property test's random draws (and torch's: seeded too), the seed printed (pytest shows it
    under a failed test) and read from JITATTN_TEST_SEED when set: a failure CI found reruns draw
    for draw."""
    seed = int(os.environ.get("JITATTN_TEST_SEED") or random.randrange(2 ** 32))
    print(f"random seed {seed} (JITATTN_TEST_SEED={seed} reruns these draws)")
    torch.manual_seed(seed)
    return random.Random(seed)


@pytest.fixture(autouse=True)
def _backward_tile80(request, monkeypatch):
    """JITATTN_TEST_BACKWARD_ROWS80 for every GPU test (backward, variants, flex, integrations):
    0: no call on the backward's 80-row tile (spec.TILE80_HEAD_DIMS empty); all: every D128 call
    but a soft-capped one on it, windows and variants too (spec.TILE80_FEATURES: all of them).
    JITATTN_TEST_BACKWARD_EARLY_PROBS=0|1: spec.EARLY_UNIT_SLOPE_PROBS off|on (a bias table's P^T under
    dP^T's GEMM; on by default)."""
    if "gpu" in request.node.keywords:
        from jitattn.varlen import spec as spec_module

        rows80 = os.environ.get("JITATTN_TEST_BACKWARD_ROWS80")
        if rows80 == "0":
            monkeypatch.setattr(spec_module, "TILE80_HEAD_DIMS", frozenset())
        elif rows80 == "all":
            monkeypatch.setattr(spec_module, "TILE80_FEATURES", frozenset(spec_module.CALL_FEATURES))
        early = os.environ.get("JITATTN_TEST_BACKWARD_EARLY_PROBS")
        if early in ("0", "1"):
            monkeypatch.setattr(spec_module, "EARLY_UNIT_SLOPE_PROBS", early == "1")
    yield


# pytest-xdist runs several workers on the one GPU: a worker's caching allocator keeps what a
# big test (a float64 reference over 16k keys) reserved, and the next worker's big test ran out
# of memory with 7 idle workers holding 9-16 GiB each. Give a large reserve back after each test.
RELEASE_RESERVED_ABOVE = 1 << 30


def pytest_runtest_teardown(item, nextitem):
    if HAS_GPU and torch.cuda.is_initialized() and torch.cuda.memory_reserved() > RELEASE_RESERVED_ABOVE:
        torch.cuda.empty_cache()


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    """A fresh, private cache root for one test (and no seed dirs, JIT enabled)."""
    root = tmp_path / "cache"
    monkeypatch.setenv("JITATTN_CACHE_DIR", str(root))
    monkeypatch.delenv("JITATTN_CACHE_SEED_DIRS", raising=False)
    monkeypatch.delenv("JITATTN_DISABLE_JIT", raising=False)
    monkeypatch.delenv("JITATTN_RECORD", raising=False)
    return root


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_host_cxx(what: str) -> str:
    """The host C++ compiler for a test that builds native code (`what` names the test): it fails
    under CI=true without one (CI must run it), else skips."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        if in_ci():
            pytest.fail(f"no host C++ compiler: {what} must run in CI")
        pytest.skip("no host C++ compiler")
    return cxx


def require_nvcc() -> None:
    """Compile tests need nvcc: they fail under CI=true without it (CI must compile), else skip."""
    from jitattn.jit import toolchain

    home, why = toolchain.resolve_cuda_home()
    if home is None or not (home / "bin" / "nvcc").exists():
        message = f"nvcc not found ({why}); compile tests need a CUDA toolkit"
        if in_ci():
            pytest.fail(message)
        pytest.skip(message)


def missing_names(message: str, names) -> list[str]:
    """The names that do NOT appear in an error message (as a whole word where the name is one)."""
    import re

    missing = []
    for name in names:
        word = re.fullmatch(r"\w+", name)
        pattern = rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])" if word else re.escape(name)
        if not re.search(pattern, message):
            missing.append(name)
    return missing
