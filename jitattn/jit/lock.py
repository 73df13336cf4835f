"""One inter-process lock per cache key, held only around build + publish.

Uses filelock (an OS advisory lock: released by the kernel when the holder dies, so a killed
build never leaves a lock that blocks forever). A sidecar `.owner` file names the holder so a
waiting process can say whom it waits for. Lock files are never deleted.
"""
from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from pathlib import Path

from jitattn.errors import CacheLockTimeout

log = logging.getLogger("jitattn")


@contextlib.contextmanager
def key_lock(lock_dir: Path, key: str, what: str, timeout: float):
    import filelock  # only on the cold path: ~40 ms to import

    lock_dir.mkdir(parents=True, exist_ok=True)
    path = lock_dir / f"{key[:32]}.lock"
    owner = path.with_suffix(".owner")
    lock = filelock.FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        log.info("waiting up to %g s for the build lock of %s (%s), held by %s",
                 timeout, what, path, _read_owner(owner))
        try:
            lock.acquire(timeout=timeout)
        except filelock.Timeout:
            raise CacheLockTimeout(
                f"gave up after {timeout:g} s waiting for the build lock of {what} ({path}), "
                f"held by {_read_owner(owner)}; raise JITATTN_LOCK_TIMEOUT or stop that process"
            ) from None
    try:
        with contextlib.suppress(OSError):
            owner.write_text(f"{socket.gethostname()} pid {os.getpid()} since {time.ctime()}\n")
        yield
    finally:
        lock.release()


def _read_owner(owner: Path) -> str:
    try:
        return owner.read_text().strip() or "an unknown process"
    except OSError:
        return "an unknown process"
