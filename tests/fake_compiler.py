"""A stand-in for nvcc in fleet-tier tests: a fake CUDA home whose `nvcc --version` names a
release (so keys are computed as usual), and a `compile_library` that builds a tiny real shared
library with the host C compiler instead of the kernels.

The library holds one string, `jitattn_fake_id`, set to the build's extension name
(`jitattn_<key16>`): a process that loaded an entry can check, through ctypes, that the library
it got is the one built for the key it asked for. Every fake compile appends one line to
$FAKE_COMPILE_LOG (O_APPEND), so a test counts the compiles of a whole fleet of processes.

Knobs (environment): FAKE_COMPILE_SECONDS (default 1.0: how long a compile takes, so that
concurrent askers really overlap), FAKE_COMPILE_FAIL=1 (the compile fails).
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from jitattn.errors import JitCompileError
from tests.conftest import in_ci

NVCC_RELEASE = "13.0.88"


def require_cc() -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        if in_ci():
            pytest.fail("no host C compiler (cc): the fake compiler needs one")
        pytest.skip("no host C compiler (cc)")
    return cc


def make_cuda_home(where: Path, release: str = NVCC_RELEASE) -> Path:
    """A directory that passes for a CUDA toolkit: bin/nvcc prints `release`."""
    nvcc = where / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True, exist_ok=True)
    major_minor = ".".join(release.split(".")[:2])
    nvcc.write_text("#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
                    f"echo 'Cuda compilation tools, release {major_minor}, V{release}'\n")
    nvcc.chmod(0o755)
    return where


def compile_library(staging: Path, sources: dict, *, spec_name: str, ext_name: str, archs, toolchain,
                    jobs: int, log_dir: Path, verbose: bool = False) -> float:
    start = time.perf_counter()
    record = os.environ.get("FAKE_COMPILE_LOG")
    if record:
        fd = os.open(record, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(fd, f"{os.getpid()} {spec_name} {ext_name}\n".encode())
        os.close(fd)
    time.sleep(float(os.environ.get("FAKE_COMPILE_SECONDS", "1.0")))
    if os.environ.get("FAKE_COMPILE_FAIL") == "1":
        raise JitCompileError(spec_name, "kernels.cu(1): error: fake compile failure", str(log_dir / "fake.log"))
    source = staging / "fake.c"
    source.write_text(f'const char jitattn_fake_id[] = "{ext_name}";\n')
    subprocess.run([shutil.which("cc") or "gcc", "-shared", "-fPIC", "-o", str(staging / "module.so"), str(source)],
                   check=True, capture_output=True)
    source.unlink()
    ctypes.CDLL(str(staging / "module.so"))  # as cpp_extension.load loads what it built
    return time.perf_counter() - start


def install() -> None:
    """Make this process's builds fake ones (the loader imports compile_library at build time)."""
    from jitattn.jit import build

    build.compile_library = compile_library


def fake_id(library: Path) -> str:
    """The id baked into a fake module.so (dlopen returns the already loaded handle)."""
    lib = ctypes.CDLL(str(library))
    return (ctypes.c_char * 64).in_dll(lib, "jitattn_fake_id").value.decode()


def compiles(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []
