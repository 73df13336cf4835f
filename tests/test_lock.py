"""CPU tests: the per-key build lock across processes (holder in a child process)."""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jitattn.errors import CacheLockTimeout
from jitattn.jit.lock import key_lock

REPO = Path(__file__).resolve().parent.parent
KEY_A = "a" * 64
KEY_B = "b" * 64

# The child imports jitattn.jit.lock without running jitattn/__init__ (which imports torch and
# costs seconds): a bare package object pointing at the source directory stands in for it.
HOLDER = r"""
import sys, time, types
from pathlib import Path
pkg = types.ModuleType("jitattn"); pkg.__path__ = [sys.argv[1]]; sys.modules["jitattn"] = pkg
from jitattn.jit.lock import key_lock
with key_lock(Path(sys.argv[2]), sys.argv[3], "holder spec", timeout=5):
    print("locked", flush=True)
    time.sleep(120)
"""


class Holder:
    """A child process that holds key_lock(lock_dir, key) until killed."""

    def __init__(self, lock_dir: Path, key: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(REPO / "jitattn"), str(lock_dir), key],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        line = self.proc.stdout.readline()
        if line.strip() != "locked":
            self.proc.kill()
            raise RuntimeError(f"holder did not take the lock: {line!r} {self.proc.stderr.read()}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self.proc.stdout.close()
        self.proc.stderr.close()


@pytest.fixture
def holder(tmp_path):
    started = []

    def start(key: str = KEY_A) -> Holder:
        h = Holder(tmp_path / "locks", key)
        started.append(h)
        return h

    yield start
    for h in started:
        h.kill()


def test_waiting_past_the_timeout_names_the_lock_and_its_holder(tmp_path, holder, caplog):
    h = holder()
    lock_dir = tmp_path / "locks"
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger="jitattn"), pytest.raises(CacheLockTimeout) as info:
        with key_lock(lock_dir, KEY_A, "decode_f16_kvf16_d128_posnone_cap0_g1", timeout=0.5):
            pytest.fail("acquired a lock another process holds")
    waited = time.monotonic() - t0
    # A wait is logged (what the tests below check the absence of).
    assert [r for r in caplog.records if "waiting up to 0.5 s" in r.getMessage()]
    # It waited its timeout (load can only lengthen the wait; the holder keeps it 120 s).
    assert 0.4 <= waited < 60
    msg = str(info.value)
    assert str(lock_dir / f"{KEY_A[:32]}.lock") in msg
    assert f"{socket.gethostname()} pid {h.proc.pid}" in msg
    assert "decode_f16_kvf16_d128_posnone_cap0_g1" in msg
    assert "JITATTN_LOCK_TIMEOUT" in msg


def test_a_killed_holder_releases_the_lock(tmp_path, holder, caplog):
    h = holder()
    lock_dir = tmp_path / "locks"
    with pytest.raises(CacheLockTimeout):
        with key_lock(lock_dir, KEY_A, "x", timeout=0.2):
            pass
    h.kill()  # returns once the holder is reaped: the kernel has released its lock
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="jitattn"):
        with key_lock(lock_dir, KEY_A, "x", timeout=10):
            # The owner file now names this process, not the dead one.
            owner = (lock_dir / f"{KEY_A[:32]}.owner").read_text()
            assert f"pid {os.getpid()}" in owner
    # Taken at the first, non-blocking try (a time bound here failed on a loaded machine).
    assert not [r for r in caplog.records if "waiting up to" in r.getMessage()]


def test_different_keys_do_not_block_each_other(tmp_path, holder, caplog):
    holder(KEY_A)
    with caplog.at_level(logging.INFO, logger="jitattn"):
        with key_lock(tmp_path / "locks", KEY_B, "other spec", timeout=0.5):
            pass
    assert not [r for r in caplog.records if "waiting up to" in r.getMessage()]  # no wait at all
    # ... and KEY_A really is held meanwhile.
    with pytest.raises(CacheLockTimeout):
        with key_lock(tmp_path / "locks", KEY_A, "x", timeout=0.2):
            pass


def test_the_lock_file_survives_release(tmp_path):
    lock_dir = tmp_path / "locks"
    path = lock_dir / f"{KEY_A[:32]}.lock"
    with key_lock(lock_dir, KEY_A, "x", timeout=1):
        assert path.exists()
        owner = path.with_suffix(".owner")
        assert owner.read_text().startswith(f"{socket.gethostname()} pid {os.getpid()} ")
    assert path.exists()
    # And it can be taken again (by this process) right away.
    with key_lock(lock_dir, KEY_A, "x", timeout=1):
        assert path.exists()
    assert path.exists()


def test_the_lock_is_released_when_the_body_raises(tmp_path, holder):
    lock_dir = tmp_path / "locks"
    with pytest.raises(ZeroDivisionError):
        with key_lock(lock_dir, KEY_A, "x", timeout=1):
            1 / 0
    # A child can take it now: the failed build did not keep the lock.
    h = holder(KEY_A)
    assert h.proc.poll() is None
