"""Every JITATTN_* environment knob, read in this one place.

Knobs are read when asked for (not at import), so tests and long-lived processes see changes;
each reader is cheap (an os.environ lookup).
"""
from __future__ import annotations

import os
from pathlib import Path

# name -> (default, one-line meaning); `jitattn doctor` and the README print this table.
KNOBS: dict[str, tuple[str, str]] = {
    "JITATTN_CACHE_DIR": ("platformdirs user cache dir", "writable cache root"),
    "JITATTN_CACHE_SEED_DIRS": ("", "read-only cache roots searched first (os.pathsep-separated)"),
    "JITATTN_CUDA_ARCH_LIST": ("TORCH_CUDA_ARCH_LIST, else visible GPUs", "target archs, e.g. '9.0;8.0'"),
    "JITATTN_DISABLE_JIT": ("0", "1 = strict: a cache miss raises MissingSpecializationError"),
    "JITATTN_LOCK_TIMEOUT": ("600", "seconds to wait for another process's build of the same key"),
    "JITATTN_BUILD_JOBS": ("cpu count", "ninja jobs for one build"),
    "JITATTN_VERBOSE": ("0", "1 = info logs, 2 = debug logs and compiler command lines"),
    "JITATTN_DEBUG": ("0", "1 = extra value checks on inputs and a sync + error check after launches"),
    "JITATTN_RECORD": ("", "append every specialization this process asks for to this manifest"),
}


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() not in ("", "0", "false", "no", "off")


def cache_dir() -> Path:
    explicit = os.environ.get("JITATTN_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    import platformdirs  # only here: costs ~6 ms to import

    return Path(platformdirs.user_cache_dir("jitattn"))


def cache_dir_source() -> str:
    return "JITATTN_CACHE_DIR" if os.environ.get("JITATTN_CACHE_DIR") else "platformdirs"


def seed_dirs() -> list[Path]:
    raw = os.environ.get("JITATTN_CACHE_SEED_DIRS", "")
    return [Path(p).expanduser() for p in raw.split(os.pathsep) if p.strip()]


def arch_list_setting() -> tuple[str, str] | None:
    """(raw value, variable name) of the first arch-list variable that is set, else None."""
    for name in ("JITATTN_CUDA_ARCH_LIST", "TORCH_CUDA_ARCH_LIST"):
        value = os.environ.get(name, "").strip()
        if value:
            return value, name
    return None


def jit_disabled() -> bool:
    return _flag("JITATTN_DISABLE_JIT")


def lock_timeout() -> float:
    return _positive_float("JITATTN_LOCK_TIMEOUT", 600.0)


def build_jobs() -> int:
    raw = os.environ.get("JITATTN_BUILD_JOBS")
    if raw:
        return max(1, int(_positive_float("JITATTN_BUILD_JOBS", 1)))
    return max(1, os.cpu_count() or 1)


def verbosity() -> int:
    raw = os.environ.get("JITATTN_VERBOSE", "0").strip()
    return int(raw) if raw.isdigit() else 1


def debug() -> bool:
    return _flag("JITATTN_DEBUG")


def record_path() -> Path | None:
    raw = os.environ.get("JITATTN_RECORD", "").strip()
    return Path(raw).expanduser() if raw else None


def cuda_home_setting() -> str | None:
    for name in ("CUDA_HOME", "CUDA_PATH"):
        value = os.environ.get(name)
        if value:
            return value
    return None


def host_compiler_setting() -> str | None:
    return os.environ.get("CXX") or None


def _positive_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {raw!r}")
    return value
