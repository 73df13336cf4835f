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
import shutil
import time
from pathlib import Path

from jitattn.jit import bounded_json

MANIFEST = "manifest.json"
LIBRARY = "module.so"
STAGING = "staging"
LOCKS = "locks"
MAX_MANIFEST_BYTES = 1 << 20  # a manifest is a few KiB; one read from an untrusted entry is bounded
STAMPS = "verified"  # <writable root>/verified/: which module.so files a full hash verified (see read_entry)


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
    return root / schema / arch_tag / f"{name}-{key[:16]}"


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
    scratch = root / STAGING
    scratch.mkdir(parents=True, exist_ok=True)
    tmp = scratch / f".{path.name}.{os.getpid()}.tmp"
    tmp.write_text(text)
    os.replace(tmp, path)


def new_staging_dir(root: Path) -> Path:
    """A private directory to build in: <root>/staging/<host>-<pid>-<random>."""
    import socket, uuid  # cold path only: keep them off the warm import

    staging = root / STAGING / f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir(parents=True)
    return staging


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
            shutil.rmtree(staging, ignore_errors=True)
            return final
        # A corrupt, partial or replaced entry: move it out of the way, then delete it. Processes
        # that already loaded its .so keep their mapping; new readers see the new entry.
        import uuid

        aside = final.parent.parent.parent / STAGING / f"replaced-{uuid.uuid4().hex[:8]}"
        os.rename(final, aside)
        shutil.rmtree(aside, ignore_errors=True)
    os.rename(staging, final)
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
    """Remove staging litter (killed builds, replaced broken entries) older than a bound."""
    removed = []
    staging = root / STAGING
    if not staging.is_dir():
        return removed
    now = time.time()
    for item in staging.iterdir():
        try:
            if now - item.stat().st_mtime >= older_than_s:
                shutil.rmtree(item) if item.is_dir() else item.unlink()
                removed.append(item)
        except OSError:
            continue
    return removed
