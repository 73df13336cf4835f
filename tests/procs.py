"""Helpers for tests that run jitattn in child processes: environments, builder children that
wait for a start signal, reading their reports, snapshots of a cache tree, and a way to run a
child for which file permission bits apply even when the tests run as root.

Used by test_races.py, test_filesystems.py and test_corruption_rebuild.py.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ARCH = "9.0"
ARCH_TAG = "sm90"


def child_env(root: Path | None, **extra: str) -> dict:
    """os.environ without JITATTN_* knobs; the repo on PYTHONPATH, archs 9.0, `root` as cache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JITATTN_")}
    env.update(PYTHONPATH=str(REPO), JITATTN_CUDA_ARCH_LIST=ARCH)
    if root is not None:
        env["JITATTN_CACHE_DIR"] = str(root)
    env.update(extra)
    return env


def run_child(script: str, env: dict, *, prefix: list[str] | None = None, args: list[str] = (),
              timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([*(prefix or []), sys.executable, "-c", textwrap.dedent(script), *args],
                          env=env, capture_output=True, text=True, timeout=timeout, cwd=str(REPO))


def last_json(stdout: str) -> dict:
    lines = [line for line in stdout.strip().splitlines() if line.startswith("{")]
    assert lines, f"no JSON report in child output:\n{stdout[-2000:]}"
    return json.loads(lines[-1])


def tree(root: Path) -> dict[str, tuple]:
    """Every path under root -> (kind, size, mtime_ns): compare two to prove nothing changed."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            out[str(path.relative_to(root))] = (st.st_mode >> 12, st.st_size if not path.is_dir() else 0,
                                                st.st_mtime_ns)
    return out


def make_read_only(root: Path) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames:
            p = Path(dirpath) / name
            p.chmod(p.stat().st_mode & ~0o222)
        Path(dirpath).chmod(Path(dirpath).stat().st_mode & ~0o222)


def make_writable(root: Path) -> None:
    if not root.exists():
        return
    root.chmod(root.stat().st_mode | 0o700)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            p = Path(dirpath) / name
            p.chmod(p.stat().st_mode | 0o700)
        for name in filenames:
            p = Path(dirpath) / name
            p.chmod(p.stat().st_mode | 0o200)


# ----------------------------------------------------------------------------- dropping privileges

_PROBE = """
import sys
import torch, jitattn  # the child must be able to run this interpreter and import both
try:
    open(sys.argv[1] + "/probe", "w").close()
    print("WROTE")
except PermissionError:
    print("DENIED")
"""


@functools.lru_cache(maxsize=None)
def unprivileged_prefix(where: str) -> tuple[tuple[str, ...] | None, str]:
    """(command prefix, how) under which a child obeys permission bits and can still reach
    directories under `where` (the tests' temp dir); (None, why not).

    Not root: no prefix. Root (chmod does not stop root): first try root *without* the
    capabilities that bypass permission bits (setpriv drops CAP_DAC_OVERRIDE,
    CAP_DAC_READ_SEARCH and CAP_FOWNER from the bounding and inheritable sets), which keeps
    access to an interpreter under /root; then the user `nobody`. Each is probed: the child must
    run this interpreter, import torch and jitattn, and be refused a write into a 0555 dir
    under `where`.
    """
    candidates: list[tuple[list[str], str]] = []
    if os.geteuid() != 0:
        candidates.append(([], f"uid {os.geteuid()} (not root)"))
    else:
        setpriv = shutil.which("setpriv")
        if setpriv:
            caps = "-dac_override,-dac_read_search,-fowner"
            candidates.append(([setpriv, f"--bounding-set={caps}", f"--inh-caps={caps}"],
                               "root without CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH/CAP_FOWNER (setpriv)"))
            candidates.append(([setpriv, "--reuid=nobody", "--regid=nogroup", "--clear-groups"],
                               "user nobody (setpriv)"))
        runuser = shutil.which("runuser")
        if runuser:
            candidates.append(([runuser, "-u", "nobody", "--"], "user nobody (runuser)"))
    tried = []
    probe_dir = Path(tempfile.mkdtemp(prefix="jitattn-ro-probe-", dir=where))
    try:
        probe_dir.chmod(0o555)
        for prefix, how in candidates:
            try:
                result = subprocess.run([*prefix, sys.executable, "-c", _PROBE, str(probe_dir)],
                                        env=child_env(None), capture_output=True, text=True,
                                        timeout=120, cwd=str(REPO))
            except (OSError, subprocess.TimeoutExpired) as exc:
                tried.append(f"{how}: {exc}")
                continue
            if result.stdout.strip().endswith("DENIED"):
                return tuple(prefix), how
            tried.append(f"{how}: {(result.stdout + result.stderr).strip()[-200:]}")
    finally:
        probe_dir.chmod(0o700)
        shutil.rmtree(probe_dir, ignore_errors=True)
    return None, "no way to run a child that obeys permission bits: " + ("; ".join(tried) or "no setpriv/runuser")


# ----------------------------------------------------------------------------- builder children

# A child that imports everything a build needs, says "ready", waits for one line on stdin
# (a spec as JSON), builds it with loader.build_spec and prints a JSON report. Importing before
# the start signal makes the time after it the build's, not torch's import.
BUILDER = r"""
import json, os, sys, time
import torch, torch.utils.cpp_extension, jinja2, filelock
from jitattn.jit import cache, loader
from jitattn.jit.registry import spec_from_dict
print("ready", os.getpid(), flush=True)
spec = spec_from_dict(json.loads(sys.stdin.readline()))

def cpu():  # this process and the compilers it ran (reaped children)
    import resource
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))

start, cpu0 = time.time(), cpu()
module, compiled = loader.build_spec(spec)
end = time.time()
print(json.dumps({
    "pid": os.getpid(), "compiled": compiled, "compiles": loader.COMPILE_COUNT,
    "entry": str(module.entry.path), "start": start, "end": end, "cpu": cpu() - cpu0,
    "verified": cache.read_entry(module.entry.path, module.entry.key) is not None,
    "has_ops": hasattr(module.ops, "ctas_per_sm"),
}), flush=True)
"""


class Builder:
    """One BUILDER child in its own session. Killing "the build" must reach every process of
    it: ninja starts each compiler command in a process group of its own, so a kill of the
    child's process group would leave nvcc/cicc/ptxas running (and writing into the staging
    dir); the session (setsid) holds them all."""

    def __init__(self, env: dict, script: str = BUILDER):
        self.stderr_file = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-c", script], env=env, cwd=str(REPO),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr_file, text=True, start_new_session=True)
        self.ready = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self) -> None:
        line = self.proc.stdout.readline()  # the child prints it within seconds, or dies
        if not line.startswith("ready"):
            self.kill()
            raise RuntimeError(f"builder {self.pid} did not get ready: {line!r}\n{self.stderr()[-3000:]}")
        self.ready = True

    def go(self, spec) -> None:
        self.proc.stdin.write(json.dumps(spec.to_dict()) + "\n")
        self.proc.stdin.flush()

    def finish(self, timeout: float = 300) -> tuple[int, dict | None, str]:
        """(returncode, report or None, stderr) once the child exits."""
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        err = self.stderr()
        report = None
        if self.proc.returncode == 0:
            report = last_json(out)
        return self.proc.returncode, report, err

    def session(self) -> list[int]:
        """Live (not zombie) processes of this child's session, the child included."""
        return session_members(self.pid)

    def kill(self, timeout: float = 30) -> None:
        """SIGKILL every process of the build (python, ninja, nvcc, ...), then reap the child."""
        deadline = time.monotonic() + timeout
        while True:
            members = self.session()
            if not members:
                break
            for pid in members:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes of session {self.pid} survive SIGKILL: {members}")
            time.sleep(0.005)
        self.proc.wait(timeout=timeout)

    def kill_python_only(self) -> None:
        """SIGKILL only the python process (as the OOM killer would): the compilers it started
        run on as orphans until they finish."""
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)

    def wait_session_gone(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while self.session():
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"session {self.pid} still running after {timeout} s")
            time.sleep(0.05)

    def stderr(self) -> str:
        self.stderr_file.flush()
        self.stderr_file.seek(0)
        return self.stderr_file.read()


def session_members(sid: int) -> list[int]:
    """Pids of live (not zombie) processes whose session id is `sid` (from /proc)."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, session = fields[0], int(fields[3])  # after "pid (comm)": state ppid pgrp session
        if session == sid and state not in ("Z", "X"):
            members.append(int(entry.name))
    return members
