"""Where compiled specializations live on disk: layout, manifests, verification, publishing.

Knows nothing about kernels. An entry is `<root>/<schema>/<arch tag>/<name>-<key16>/` holding
`module.so`, the generated sources and `manifest.json`. The manifest is written last and is
the commit marker; an entry is only ever *read* through `read_entry`, which treats anything
that does not verify (missing/malformed manifest, other key, .so size or sha256 mismatch) as a
miss. Entries appear by one atomic rename of a finished staging directory.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path

from jitattn.jit import bounded_json

MANIFEST = "manifest.json"
LIBRARY = "module.so"
STAGING = "staging"
LOCKS = "locks"
LOGS = "logs"  # <root>/logs/: compile logs of failed builds (build._keep_log)
MAX_MANIFEST_BYTES = 1 << 20  # a manifest is a few KiB; one read from an untrusted entry is bounded
STAMPS = "verified"  # <writable root>/verified/: which module.so files a full hash verified (see read_entry)
# What a path component the cache makes from a name may be: spec names and schemas [a-z0-9_],
# arch tags 'sm80+sm90a', keys hex.
SAFE_NAME = re.compile(r"[a-z0-9_]+")
_ARCH_TAG = re.compile(r"[a-z0-9_+]+")
_KEY = re.compile(r"[0-9a-f]{16,}")


def check_name(what: str, name: str, pattern: re.Pattern = SAFE_NAME) -> str:
    """`name` if it is a safe path component (`pattern`), else a ValueError naming `what`."""
    if not isinstance(name, str) or not pattern.fullmatch(name):
        raise ValueError(f"{what} {name!r:.80} is not a safe cache path component ({pattern.pattern})")
    return name


def check_within(root: Path, path: Path) -> Path:
    """`path` if it lies strictly under `root` once '.' and '..' are resolved (string-wise: no
    file system calls), else a ValueError: every path the cache writes goes through here."""
    base = os.path.abspath(root)
    full = os.path.abspath(path)
    if full == base or os.path.commonpath([base, full]) != base:
        raise ValueError(f"refusing to write {path}: it is not under the cache root {root}")
    return path


class CacheEntry:
    """A verified entry: its directory and parsed manifest."""

    __slots__ = ("path", "manifest")

    def __init__(self, path: Path, manifest: dict):
        self.path = path
        self.manifest = manifest

    def __repr__(self) -> str:
        return f"CacheEntry({self.path})"

    def __eq__(self, other) -> bool:
        return isinstance(other, CacheEntry) and (self.path, self.manifest) == (other.path, other.manifest)

    __hash__ = None  # a manifest dict is not hashable

    @property
    def library(self) -> Path:
        return self.path / LIBRARY

    @property
    def key(self) -> str:
        return self.manifest["key"]

    @property
    def components(self) -> dict:
        return self.manifest.get("components", {})


def entry_path(root: Path, schema: str, arch_tag: str, name: str, key: str) -> Path:
    """<root>/<schema>/<arch tag>/<name>-<key16>; each part checked to be a plain name."""
    check_name("cache schema", schema)
    check_name("arch tag", arch_tag, _ARCH_TAG)
    check_name("spec name", name)
    check_name("cache key", key, _KEY)
    return check_within(root, root / schema / arch_tag / f"{name}-{key[:16]}")


def log_path(log_dir: Path, spec_name: str, stamp: str) -> Path:
    """<log dir>/<spec name>-<stamp>.log (log dir: <root>/logs): a failed build's compiler output."""
    check_name("spec name", spec_name)
    check_name("log stamp", stamp, re.compile(r"[0-9a-zA-Z_-]+"))
    return check_within(log_dir, log_dir / f"{spec_name}-{stamp}.log")


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_entry(path: Path, key: str | None = None, stamps: Path | None = None) -> CacheEntry | None:
    """The verified entry at `path`, or None (absent, partial, corrupt, or another key).

    The .so must match the manifest's size and sha256. With `stamps` (a directory in the
    writable root), a full hash that matched is remembered there as the file's identity (size,
    mtime_ns, ctime_ns, inode, device) and its hash, and a later read of the same unchanged file
    trusts that stamp instead of hashing again: a first call then reads a few hundred bytes, not
    the whole library. Any rewrite or replacement of the file changes its ctime or inode (ctime
    cannot be set from user space), so it is hashed again; `cache verify` always hashes."""
    try:
        manifest = bounded_json.read(path / MANIFEST, max_bytes=MAX_MANIFEST_BYTES)
        lib = manifest["library"]
        if key is not None and manifest["key"] != key:
            return None
        if not path.name.endswith(f"-{manifest['key'][:16]}"):  # a manifest copied from another entry
            return None
        so = path / LIBRARY
        st = so.stat()
        if st.st_size != lib["size"]:
            return None
        if stamps is None or not _stamped(stamps, so, st, lib["sha256"]):
            if file_digest(so) != lib["sha256"]:
                return None
            if stamps is not None:
                _stamp(stamps, so, st, lib["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return CacheEntry(path, manifest)


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _stamp_file(stamps: Path, so: Path) -> Path:
    return stamps / (hashlib.sha256(os.path.abspath(so).encode()).hexdigest()[:32] + ".json")


def _stamped(stamps: Path, so: Path, st: os.stat_result, sha256: str) -> bool:
    """Whether a full hash verified this very file (same identity) as having `sha256`."""
    try:
        stamp = bounded_json.read(_stamp_file(stamps, so), max_bytes=MAX_MANIFEST_BYTES)
    except (OSError, ValueError):
        return False
    return (isinstance(stamp, dict) and stamp.get("path") == os.path.abspath(so) and stamp.get("sha256") == sha256
            and stamp.get("identity") == _identity(st))


def _stamp(stamps: Path, so: Path, before: os.stat_result, sha256: str) -> None:
    """Record that `so`, hashed to `sha256` while its identity was `before`, verified; only if it
    did not change while it was hashed. Best effort: a read-only root just hashes next time."""
    try:
        if _identity(so.stat()) != _identity(before):
            return
        stamps.mkdir(parents=True, exist_ok=True)
        write_text_atomic(_stamp_file(stamps, so), stamps.parent,
                          json.dumps({"path": os.path.abspath(so), "sha256": sha256, "identity": _identity(before)}))
    except OSError:
        pass


def why_invalid(path: Path) -> str | None:
    """A human reason an entry directory does not verify (None if it does)."""
    mf = path / MANIFEST
    if not mf.exists():
        return "no manifest.json (unfinished or killed build)"
    try:
        manifest = bounded_json.read(mf, max_bytes=MAX_MANIFEST_BYTES)
        lib = manifest["library"]
        expected_dir = f"-{manifest['key'][:16]}"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"malformed manifest.json ({exc.__class__.__name__})"
    if not path.name.endswith(expected_dir):
        return "manifest belongs to another key"
    so = path / LIBRARY
    if not so.exists():
        return "module.so missing"
    if so.stat().st_size != lib.get("size"):
        return f"module.so size {so.stat().st_size} != manifest {lib.get('size')}"
    if file_digest(so) != lib.get("sha256"):
        return "module.so sha256 does not match the manifest"
    return None


def entries(root: Path, schema: str | None = None):
    """Every entry directory under a root (verified or not), as paths."""
    base = root / schema if schema else root
    if not base.is_dir():
        return
    schemas = [base] if schema else [p for p in base.iterdir() if p.is_dir() and p.name not in (STAGING, LOCKS, STAMPS)]
    for schema_dir in schemas:
        for arch_dir in sorted(p for p in schema_dir.iterdir() if p.is_dir()):
            for entry in sorted(p for p in arch_dir.iterdir() if p.is_dir()):
                yield entry


def siblings(root: Path, schema: str, arch_tag: str, name: str) -> list[Path]:
    """Entry directories of the same spec name (any key) under one root and arch."""
    arch_dir = root / schema / arch_tag
    try:
        return sorted(p for p in arch_dir.iterdir() if p.name.rsplit("-", 1)[0] == name)
    except OSError:
        return []


def write_text_atomic(path: Path, root: Path, text: str) -> None:
    """Replace `path` (a file under cache root `root`) by `text` in one rename, from a temporary
    file under <root>/staging/: a process killed mid-write leaves litter `cache prune` removes,
    never a stray file beside the entries. Raises OSError."""
    check_within(root, path)
    scratch = root / STAGING
    scratch.mkdir(parents=True, exist_ok=True)
    tmp = scratch / f".{path.name}.{os.getpid()}.tmp"
    tmp.write_text(text)
    os.replace(tmp, path)


# Open staging directories of this process, each held with a shared flock while its build runs:
# `prune_staging` skips a staging dir whose lock it cannot take (see _staging_alive).
_held_staging: dict[str, int] = {}


def _host_tag() -> str:
    import socket

    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())[:64] or "host"


def new_staging_dir(root: Path) -> Path:
    """A private directory to build in: <root>/staging/<host>-<pid>-<random>, held (a shared
    flock on the directory) until `publish` or `discard_staging`, so that `cache prune` can tell
    a live build from litter."""
    import fcntl, uuid  # cold path only: keep them off the warm import

    for gone in [path for path in _held_staging if not os.path.isdir(path)]:  # removed without discard_staging
        _release_staging(Path(gone))
    staging = check_within(root, root / STAGING / f"{_host_tag()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    staging.mkdir(parents=True)
    try:
        fd = os.open(staging, os.O_RDONLY)
    except OSError:
        return staging
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:  # a file system without flock: the host and pid in the name still tell
        pass
    _held_staging[str(staging)] = fd
    return staging


def _release_staging(staging: Path) -> None:
    fd = _held_staging.pop(str(staging), None)
    if fd is not None:
        os.close(fd)


def discard_staging(staging: Path) -> None:
    """Remove a staging dir that will not be published (a failed build) and release its hold."""
    _release_staging(staging)
    shutil.rmtree(staging, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (0, negative or absurd pids: no)."""
    if not 0 < pid < 2**31:  # os.kill(0 or -n) would signal a process group
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, as another user
        return True
    return True


def _staging_alive(item: Path) -> bool:
    """Whether a build may still be using `item`: its name's pid is alive on this host, or
    another process holds the directory's flock (a builder on another host sharing the root)."""
    import fcntl

    parts = item.name.rsplit("-", 2)
    if len(parts) == 3 and parts[1].isdigit() and parts[0] == _host_tag() and _pid_alive(int(parts[1])):
        return True
    tmp = re.fullmatch(r"\..*\.(\d+)(?:\.tmp)?", item.name)  # write_text_atomic's scratch, the write probe
    if tmp:
        return _pid_alive(int(tmp.group(1)))
    if not item.is_dir() or item.is_symlink():
        return False
    try:
        fd = os.open(item, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # no flock here: the name was all there was to go by
        return False
    finally:
        os.close(fd)
    return False


def write_manifest(staging: Path, manifest: dict) -> None:
    """Hash the library and write manifest.json (fsynced) as the last file of the entry."""
    so = staging / LIBRARY
    manifest = {**manifest, "library": {"sha256": file_digest(so), "size": so.stat().st_size}}
    tmp = staging / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, staging / MANIFEST)


def publish(staging: Path, final: Path, replace: bool = False) -> Path:
    """Move a finished staging dir to `final` with one rename. First valid entry wins, unless
    `replace` (a forced rebuild): then the old entry is moved aside first."""
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists():
        if read_entry(final) is not None and not replace:
            discard_staging(staging)
            return final
        # A corrupt, partial or replaced entry: move it out of the way, then delete it. Processes
        # that already loaded its .so keep their mapping; new readers see the new entry.
        import uuid

        aside = final.parent.parent.parent / STAGING / f"replaced-{uuid.uuid4().hex[:8]}"
        os.rename(final, aside)
        shutil.rmtree(aside, ignore_errors=True)
    os.rename(staging, final)
    _release_staging(staging)
    _fsync_dir(final.parent)
    return final


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def prune_staging(root: Path, older_than_s: float = 3600.0) -> list[Path]:
    """Remove staging litter (killed builds, replaced broken entries) older than a bound; never
    the staging dir of a live build (_staging_alive), however old."""
    removed = []
    staging = root / STAGING
    if not staging.is_dir():
        return removed
    now = time.time()
    for item in staging.iterdir():
        try:
            if now - item.lstat().st_mtime < older_than_s or _staging_alive(item):
                continue
            shutil.rmtree(item) if item.is_dir() and not item.is_symlink() else item.unlink()
            removed.append(item)
        except OSError:
            continue
    return removed


# What jitattn writes at the top of a cache root besides schema dirs (`clear` removes only these).
_OWN_DIRS = (STAGING, LOCKS, LOGS, STAMPS)
_OWN_FILES = ("toolchains.json",)
_SCHEMA_DIR = re.compile(r"v\d+")


def foreign_items(root: Path) -> list[Path]:
    """What under a cache root jitattn did not write: anything at the top but its own dirs, memo
    files and schema dirs, and anything in a schema dir but arch dirs of entry dirs."""
    foreign = []
    for item in sorted(root.iterdir()):
        if item.is_symlink():
            foreign.append(item)
        elif item.is_dir() and item.name in _OWN_DIRS:
            continue
        elif item.is_file() and item.name in _OWN_FILES:
            continue
        elif item.is_dir() and _SCHEMA_DIR.fullmatch(item.name):
            for arch_dir in sorted(item.iterdir()):
                if arch_dir.is_symlink() or not arch_dir.is_dir() or not _ARCH_TAG.fullmatch(arch_dir.name):
                    foreign.append(arch_dir)
                    continue
                foreign += [e for e in sorted(arch_dir.iterdir()) if e.is_symlink() or not e.is_dir()
                            or not re.fullmatch(r"[a-z0-9_]+-[0-9a-f]{16}", e.name)]
        else:
            foreign.append(item)
    return foreign


def clear(root: Path, force: bool = False) -> list[Path]:
    """Remove what jitattn wrote under `root` (schema dirs of entries, staging, locks, logs,
    stamps, memo files) and return it; with `force`, everything under `root`. Refuses (ValueError,
    nothing removed) a root holding anything else: a cache dir pointed at the wrong place must
    not cost a user their files. The root itself stays."""
    if not root.is_dir():
        return []
    foreign = foreign_items(root)
    if foreign and not force:
        shown = ", ".join(str(p) for p in foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ValueError(f"{root} holds files jitattn did not write ({shown}); nothing removed. Point "
                         f"JITATTN_CACHE_DIR at the cache, or pass --force to delete everything under {root}")
    removed = []
    for item in sorted(root.iterdir()):
        if item.is_dir() and not item.is_symlink():
            shutil.rmtree(item)
        else:
            item.unlink()
        removed.append(item)
    try:
        root.rmdir()  # the root too, now empty: jitattn made it
    except OSError:
        pass
    return removed
