"""Compile rendered sources into `module.so` inside a staging directory (torch's cpp_extension).

Each rendered source is its own translation unit, so ninja compiles them side by side (a kernel
family may split a kernel off into a unit of its own: the varlen mask map); a unit that renders
empty is not built. Only the binding sees torch headers (the stable ABI, so one .so serves every
torch from the target version on); no torch/extension.h, no pybind11. A failure raises
JitCompileError with the first compiler `error:` line and the path of the full log, which is kept
under <root>/logs.
"""
from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

from jitattn.errors import JitCompileError
from jitattn.jit import cache, keys
from jitattn.jit.toolchain import Toolchain

_ERROR_LINE = re.compile(r"^.*(?:\(\d+\)|:\d+(?::\d+)?):\s*(?:fatal )?error\b.*$", re.M)
_ANY_ERROR = re.compile(r"^.*\berror\b.*$", re.M | re.I)
# cpp_extension's objects and build files: the entry keeps the rendered sources and the library.
_LEFTOVERS = (".o", ".ninja_deps", ".ninja_log", "lock", "build.ninja")


def compile_library(
    staging: Path,
    sources: dict[str, str],
    *,
    spec_name: str,
    ext_name: str,
    archs: tuple[str, ...],
    toolchain: Toolchain,
    jobs: int,
    log_dir: Path,
    verbose: bool = False,
) -> float:
    """Build staging/module.so from `sources` (file name -> text, already written into staging:
    'binding.cpp', 'kernels.cu', ...), a unit per source; returns seconds.

    cpp_extension also loads the library (registering its ops) before we publish it, so a
    library that fails to load is never published.
    """
    cpp_extension = _import_cpp_extension()

    cpp_extension.CUDA_HOME = str(toolchain.cuda_home)  # torch guesses wrong behind wrapper scripts
    units = [str(staging / name) for name in sources]  # the loader writes no empty unit
    start = time.perf_counter()
    saved_jobs = os.environ.get("MAX_JOBS")
    os.environ["MAX_JOBS"] = str(jobs)
    try:
        cpp_extension.load(
            name=ext_name,
            sources=units,
            build_directory=str(staging),
            extra_cflags=list(keys.CXX_FLAGS),
            extra_cuda_cflags=keys.cuda_flags(archs),
            is_python_module=False,
            verbose=verbose,
        )
    except Exception as exc:  # load raises RuntimeError/CalledProcessError/OSError
        raise _compile_error(exc, staging, spec_name, log_dir) from None
    finally:
        if saved_jobs is None:
            os.environ.pop("MAX_JOBS", None)
        else:
            os.environ["MAX_JOBS"] = saved_jobs
    seconds = time.perf_counter() - start
    os.replace(staging / f"{ext_name}.so", staging / cache.LIBRARY)
    for item in staging.iterdir():
        if item.name.endswith(_LEFTOVERS):
            item.unlink()
    return seconds


def _import_cpp_extension():
    # Importing it logs a warning about CUDA_HOME on GPU-less machines; we set its CUDA_HOME
    # attribute ourselves (compile_library), so silence that one import-time warning.
    import logging

    quiet = logging.getLogger("torch.utils.cpp_extension")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
    finally:
        quiet.setLevel(level)
    return cpp_extension


def _compile_error(exc: Exception, staging: Path, spec_name: str, log_dir: Path) -> JitCompileError:
    """The JitCompileError for a failed build. Its first error line points at the kept copies of
    the sources (the staging dir is about to be removed); keeping them and the log is best effort,
    so a full disk or a read-only root never hides the compiler's error behind an OSError."""
    text = str(exc)
    output = getattr(exc, "output", None)
    if isinstance(output, bytes):
        text += "\n" + output.decode(errors="replace")
    try:
        log_path = cache.log_path(log_dir, spec_name, f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
        kept = _point_at_kept_sources(text, staging, log_path)
        _keep_log(kept, staging, log_path)
    except (OSError, ValueError) as keep_exc:
        reason = keep_exc.strerror if isinstance(keep_exc, OSError) and keep_exc.strerror else keep_exc
        return JitCompileError(spec_name, _first_error(text), f"(not kept: writing it under {log_dir} failed: "
                                                              f"{reason}; the compiler's output follows)\n{text[-4000:]}")
    return JitCompileError(spec_name, _first_error(kept), str(log_path))


def _first_error(text: str) -> str:
    match = _ERROR_LINE.search(text) or _ANY_ERROR.search(text)
    return match.group(0).strip() if match else text.strip().splitlines()[0] if text.strip() else "unknown error"


def _point_at_kept_sources(text: str, staging: Path, log_path: Path) -> str:
    """The compiler output with its paths into staging/ turned into those of the kept copies."""
    for source in _rendered_sources(staging):
        text = text.replace(str(source), str(log_path.with_suffix(f".{source.name}")))
    return text


def _rendered_sources(staging: Path) -> list[Path]:
    return sorted(path for path in staging.iterdir() if path.suffix in (".cu", ".cpp") and path.is_file())


def _keep_log(text: str, staging: Path, log_path: Path) -> None:
    """Write the compiler output to <root>/logs/<spec>-<time>-<pid>.log with the generated
    sources beside it."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    for source in _rendered_sources(staging):
        shutil.copy(source, log_path.with_suffix(f".{source.name}"))
    log_path.write_text(text)
