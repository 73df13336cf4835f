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

from jitattn.errors import CacheLockTimeout, CacheNotWritable

log = logging.getLogger("jitattn")


@contextlib.contextmanager
def key_lock(lock_dir: Path, key: str, what: str, timeout: float):
    import filelock  # only on the cold path: a slow import (notes/host-time.md, "jit/lock.py")

    path = lock_dir / f"{key[:32]}.lock"
    owner = path.with_suffix(".owner")
    _check_lock_path(lock_dir, path)
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
    except OSError as exc:  # (after Timeout, an OSError too) not openable: the wrong type, or no access
        raise _wrong_lock(path, exc) from None
    try:
        with contextlib.suppress(OSError):
            owner.write_text(f"{socket.gethostname()} pid {os.getpid()} since {time.ctime()}\n")
        yield
    finally:
        lock.release()


def _check_lock_path(lock_dir: Path, path: Path) -> None:
    """A clear CacheNotWritable when the lock directory or the lock file is of the wrong type
    (a file where the directory goes, a directory where the lock file goes)."""
    try:
        lock_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise CacheNotWritable(f"the build lock directory {lock_dir} is not a directory: remove it "
                               f"(jitattn keeps one lock file per key there)") from None
    except OSError as exc:
        raise CacheNotWritable(f"cannot create the build lock directory {lock_dir}: {exc.strerror}") from None
    if path.is_dir() or (path.exists() and not path.is_file()):
        raise _wrong_lock(path, None)


def _wrong_lock(path: Path, exc: OSError | None) -> CacheNotWritable:
    if path.is_dir() or (path.exists() and not path.is_file()):
        return CacheNotWritable(f"the build lock {path} is not a regular file (a directory or another kind of file "
                                f"is in its place): remove it; jitattn creates its lock files itself")
    return CacheNotWritable(f"cannot open the build lock {path}: {exc.strerror if exc else 'unknown error'}")


def _read_owner(owner: Path) -> str:
    try:
        return owner.read_text().strip() or "an unknown process"
    except OSError:
        return "an unknown process"
