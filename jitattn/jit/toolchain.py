"""What we build with: CUDA home, nvcc release, host compiler, target archs.

Probing a compiler runs a subprocess, so `fingerprint()` is memoized per process and on disk
(keyed by the compilers' resolved paths, sizes and mtimes): a warm cache never runs one.
"""
from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import NamedTuple

from jitattn.errors import ToolchainError
from jitattn.jit import cache, env


class Toolchain(NamedTuple):  # not a frozen dataclass, slower to create (notes/host-time.md, "jit/toolchain.py")
    cuda_home: Path
    nvcc: Path
    host_cxx: Path
    nvcc_release: str  # "13.0.88": the part of the key
    host_cxx_version: str  # "gcc 12.2.0"


def resolve_cuda_home() -> tuple[Path | None, str]:
    """CUDA home and where it came from. Never raises; None when no toolkit is found."""
    setting = env.cuda_home_setting()
    if setting:
        return Path(setting), "CUDA_HOME/CUDA_PATH"
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = _follow_wrapper(Path(nvcc))
        return real.parent.parent, f"nvcc on PATH ({nvcc} -> {real})"
    default = Path("/usr/local/cuda")
    if (default / "bin" / "nvcc").exists():
        return default, "default /usr/local/cuda"
    return None, "not found (set CUDA_HOME or put nvcc on PATH)"


def _follow_wrapper(path: Path) -> Path:
    """Resolve symlinks, then one level of `exec /real/nvcc "$@"` shell wrapper."""
    real = path.resolve()
    try:
        head = real.read_bytes()[:4096]
    except OSError:
        return real
    if head.startswith(b"#!"):
        match = re.search(rb"exec\s+\"?(/[^\s\"]+/nvcc)\"?", head)
        if match and Path(match.group(1).decode()).exists():
            return Path(match.group(1).decode()).resolve()
    return real


def host_cxx_path() -> Path | None:
    name = env.host_compiler_setting() or "c++"
    found = shutil.which(name)
    return Path(found).resolve() if found else None


def fingerprint(memo_dir: Path | None = None) -> Toolchain:
    """The toolchain a build would use. Raises ToolchainError when there is none."""
    cuda_home, why = resolve_cuda_home()
    if cuda_home is None or not (cuda_home / "bin" / "nvcc").exists():
        raise ToolchainError(f"no CUDA toolkit: {why}")
    cxx = host_cxx_path()
    if cxx is None:
        raise ToolchainError("no host C++ compiler: set CXX or put c++ on PATH")
    return _fingerprint(cuda_home.resolve(), cxx, memo_dir)


@functools.lru_cache(maxsize=None)
def _fingerprint(cuda_home: Path, cxx: Path, memo_dir: Path | None) -> Toolchain:
    nvcc = cuda_home / "bin" / "nvcc"
    stamp = f"{_stat_stamp(nvcc)}|{_stat_stamp(cxx)}"
    memo_file = memo_dir / "toolchains.json" if memo_dir else None
    memo = _read_json(memo_file) if memo_file else {}
    versions = memo.get(stamp)
    if not versions:
        versions = {"nvcc": _probe_nvcc(nvcc), "cxx": _probe_cxx(cxx)}
        if memo_file:
            memo[stamp] = versions
            _write_memo(memo_file, memo_dir, memo)
    return Toolchain(cuda_home, nvcc, cxx, versions["nvcc"], versions["cxx"])


def _stat_stamp(path: Path) -> str:
    st = path.stat()
    return f"{path}:{st.st_size}:{st.st_mtime_ns}"


def _probe_nvcc(nvcc: Path) -> str:
    out = _run([str(nvcc), "--version"])
    match = re.search(r"V(\d+\.\d+\.\d+)", out) or re.search(r"release (\d+\.\d+)", out)
    if not match:
        raise ToolchainError(f"cannot read the nvcc version from `{nvcc} --version`: {out[:200]!r}")
    return match.group(1)


def _probe_cxx(cxx: Path) -> str:
    out = _run([str(cxx), "--version"])
    first = out.splitlines()[0] if out else ""
    kind = "clang" if "clang" in first.lower() else "gcc"
    version = _run([str(cxx), "-dumpfullversion", "-dumpversion"]).strip()
    if not version:
        match = re.search(r"(\d+\.\d+(\.\d+)?)", first)
        version = match.group(1) if match else first
    return f"{kind} {version}"


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ToolchainError(f"cannot run {cmd[0]}: {exc}") from exc


def _read_json(path: Path) -> dict:
    from jitattn.jit import bounded_json

    try:
        data = bounded_json.read(path, max_bytes=1 << 20)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_memo(path: Path, root: Path, data: dict) -> None:
    try:
        cache.write_text_atomic(path, root, json.dumps(data, indent=1, sort_keys=True))
    except OSError:
        pass  # a memo only: a read-only cache root just probes again next process


# ----------------------------------------------------------------------------- target archs

_ARCH_RE = re.compile(r"^(\d+)\.(\d+)(a?)(\+PTX)?$")


def parse_arch_list(raw: str) -> tuple[str, ...]:
    """'9.0;8.0 8.9' -> ('8.0', '8.9', '9.0'): sorted, unique. '+PTX' suffixes are dropped."""
    archs = set()
    for item in re.split(r"[;,\s]+", raw.strip()):
        if not item:
            continue
        match = _ARCH_RE.match(item)
        if not match:
            raise ValueError(
                f"bad CUDA arch {item!r} in {raw!r}: expected entries like '9.0', '8.0' or '9.0a'"
            )
        archs.add(f"{int(match.group(1))}.{int(match.group(2))}{match.group(3)}")
    if not archs:
        raise ValueError(f"empty CUDA arch list {raw!r}")
    return tuple(sorted(archs, key=lambda a: (float(a.rstrip("a")), a)))


@functools.lru_cache(maxsize=None)
def visible_gpu_archs() -> tuple[str, ...]:
    """The archs of this process's visible GPUs, sorted ('9.0',); () without one. What
    `target_archs` builds for when no arch list is set; asked once per process (patch this
    function to stand in for a GPU)."""
    import torch

    if not torch.cuda.is_available():
        return ()
    caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    return tuple(sorted(f"{major}.{minor}" for major, minor in caps))


def target_archs() -> tuple[tuple[str, ...], str]:
    """(archs, where they came from). Raises ToolchainError when nothing names any."""
    setting = env.arch_list_setting()
    if setting:
        raw, name = setting
        try:
            return parse_arch_list(raw), name
        except ValueError as exc:
            raise ToolchainError(f"{name}: {exc}") from None
    archs = visible_gpu_archs()
    if archs:
        return archs, "visible GPUs"
    raise ToolchainError(
        "no target CUDA arch: no GPU is visible and neither JITATTN_CUDA_ARCH_LIST nor "
        "TORCH_CUDA_ARCH_LIST is set (e.g. JITATTN_CUDA_ARCH_LIST=9.0 for an H100/H200)"
    )


def gencode_flags(archs: tuple[str, ...]) -> list[str]:
    flags = []
    for arch in archs:
        digits = arch.replace(".", "")
        flags.append(f"-gencode=arch=compute_{digits},code=sm_{digits}")
    return flags


def arch_tag(archs: tuple[str, ...]) -> str:
    """Directory name for an arch list: ('8.0', '9.0') -> 'sm80+sm90'."""
    return "+".join("sm" + a.replace(".", "") for a in archs)
