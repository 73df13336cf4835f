"""Packing: verified cache entries of one or more roots -> one archive (index.json first)."""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tarfile
import time
from pathlib import Path, PurePosixPath
from typing import IO

from jitattn.jit import cache, keys, render, signing
from jitattn.jit.artifact.format import (FORMAT, FORMAT_VERSION, INDEX, SAFE_COMPONENT, PackedEntry, PackReport,
                                         configured_secret, inconsistent, read_json, stale)


def pack(roots_or_entries, out_path, specs=None, *, created: float | None = None,
         secret: bytes | None | object = configured_secret) -> PackReport:
    """Write one archive of verified cache entries to `out_path` (.tar.gz/.tgz: gzip, else plain).

    `roots_or_entries`: a path or a list of paths; each is a cache root (its current-schema
    entries are taken) or one entry directory. With `specs` (KernelSpecs), only entries whose
    manifest `components.spec` equals `spec.to_dict()` and whose `components.templates` is the
    digest of today's templates for it are packed (an entry built from older templates is
    skipped as stale: this tree would never load it), and specs with none are reported as
    missing. Entries that do not verify are refused (reported, not packed); entries
    of another cache schema or binding ABI are skipped (this jitattn could not load them).
    With the same `created` and the same entries, the archive is byte-for-byte the same.
    `secret` (default: the fleet secret, when one is configured; None: unsigned) signs each
    entry as the fleet signs its values, so `unpack` with the same key refuses forgeries.
    """
    out_path = Path(out_path)
    if isinstance(roots_or_entries, (str, os.PathLike)):
        roots_or_entries = [roots_or_entries]
    created = time.time() if created is None else float(created)
    if secret is configured_secret:
        secret = configured_secret()
    report = PackReport(out_path)
    wanted = None if specs is None else [(s, s.to_dict(), render.spec_template_digest(s)) for s in specs]
    found: set[int] = set()  # indices into `wanted` that have at least one packed entry

    candidates: dict[str, Path] = {}
    for item in roots_or_entries:
        item = Path(item)
        if (item / cache.MANIFEST).exists() or (item / cache.LIBRARY).exists():
            candidates.setdefault(PurePosixPath(*item.parts[-3:]).as_posix(), item)
        else:
            for path in cache.entries(item, keys.CACHE_SCHEMA):
                candidates.setdefault(path.relative_to(item).as_posix(), path)

    index_entries = []
    sources: list[tuple[str, Path, dict]] = []  # (relative entry path, directory, files)
    for rel, path in sorted(candidates.items()):
        manifest = read_json(path / cache.MANIFEST)
        if wanted is not None:
            same_spec = [i for i, (_, data, _) in enumerate(wanted) if _spec_of(manifest) == data]
            matches = [i for i in same_spec if _templates_of(manifest) == wanted[i][2]]
            named = any(path.name.rsplit("-", 1)[0] == spec.name for spec, _, _ in wanted)
            if not same_spec and not named:
                continue
            if same_spec and not matches:
                report.skipped.append((rel, "built from other templates than this tree's (stale)"))
                continue
        else:
            matches = []
        reason = cache.why_invalid(path)
        entry = cache.read_entry(path) if reason is None else None
        if entry is None:
            report.refused.append((rel, reason or "does not verify"))
            continue
        if wanted is not None and not matches:
            continue  # only its directory name matched, and it verifies: another spec's entry
        problem = stale(entry.manifest, rel)
        if problem:
            report.skipped.append((rel, problem))
            continue
        problem = inconsistent(entry.manifest, rel)
        if problem:
            report.refused.append((rel, problem))
            continue
        try:
            files = _entry_files(path)
        except ValueError as exc:
            report.refused.append((rel, str(exc)))
            continue
        found.update(matches)
        parts = entry.components
        record = {
            "path": rel, "key": entry.key, "name": entry.manifest.get("name"),
            "archs": parts.get("archs"), "abi": parts.get("abi"), "schema": parts.get("schema"),
            "files": files,
        }
        if secret is not None:
            record["signature"] = signing.sign_entry(secret, entry.key, path)
        index_entries.append(record)
        sources.append((rel, path, files))
        report.packed.append(PackedEntry(rel, entry.key, entry.manifest.get("name"),
                                         sum(f["size"] for f in files.values())))
    if wanted is not None:
        report.missing = [spec for i, (spec, _, _) in enumerate(wanted) if i not in found]

    index = {"format": FORMAT, "version": FORMAT_VERSION, "created": created,
             "schema": keys.CACHE_SCHEMA, "entries": index_entries}
    _write_archive(out_path, index, sources, int(created))
    return report


def _spec_of(manifest) -> object:
    try:
        return manifest["components"]["spec"]
    except (KeyError, TypeError):
        return None


def _templates_of(manifest) -> object:
    try:
        return manifest["components"]["templates"]
    except (KeyError, TypeError):
        return None


def _entry_files(path: Path) -> dict:
    """{relative name: {sha256, size}} of every file in an entry; only files and directories."""
    files = {}
    for item in sorted(path.rglob("*")):
        rel = item.relative_to(path).as_posix()
        if item.is_symlink():
            raise ValueError(f"contains a symlink ({rel}); only regular files are packed")
        if item.is_dir():
            continue
        if not item.is_file():
            raise ValueError(f"contains {rel}, which is not a regular file")
        if not all(SAFE_COMPONENT.match(c) for c in PurePosixPath(rel).parts):
            raise ValueError(f"contains a file with an unportable name ({rel!r})")
        files[rel] = {"sha256": cache.file_digest(item), "size": item.stat().st_size}
    return files


def _write_archive(out_path: Path, index: dict, sources, mtime: int) -> None:
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.{os.getpid()}.tmp")
    compress = out_path.name.endswith((".tar.gz", ".tgz"))
    try:
        with open(tmp, "wb") as raw:
            stream = gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=mtime) if compress else raw
            try:
                with tarfile.open(fileobj=stream, mode="w", format=tarfile.PAX_FORMAT) as tar:
                    data = json.dumps(index, indent=1, sort_keys=True).encode()
                    tar.addfile(_info(INDEX, tarfile.REGTYPE, len(data), mtime), io.BytesIO(data))
                    written_dirs: set[str] = set()
                    for rel, path, files in sources:
                        parents = [PurePosixPath(rel), *PurePosixPath(rel).parents][:-1]
                        for d in reversed(parents):
                            if d.as_posix() not in written_dirs:
                                written_dirs.add(d.as_posix())
                                tar.addfile(_info(d.as_posix(), tarfile.DIRTYPE, 0, mtime))
                        for name, meta in files.items():
                            for d in reversed(list(PurePosixPath(rel, name).parents)[:-1]):
                                if d.as_posix() not in written_dirs:
                                    written_dirs.add(d.as_posix())
                                    tar.addfile(_info(d.as_posix(), tarfile.DIRTYPE, 0, mtime))
                            member = f"{rel}/{name}"
                            with open(path / name, "rb") as f:
                                hashing = _HashingReader(f)
                                tar.addfile(_info(member, tarfile.REGTYPE, meta["size"], mtime), hashing)
                            if hashing.digest() != meta["sha256"]:
                                raise RuntimeError(f"{path / name} changed while it was being packed")
            finally:
                if compress:
                    stream.close()
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, out_path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _info(name: str, kind: bytes, size: int, mtime: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.size = size
    info.mode = 0o755 if kind == tarfile.DIRTYPE else 0o644
    info.mtime = mtime
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


class _HashingReader:
    def __init__(self, f: IO[bytes]):
        self._f = f
        self._h = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self._h.update(data)
        return data

    def digest(self) -> str:
        return self._h.hexdigest()
