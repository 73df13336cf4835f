"""Cache archives: pack verified cache entries into one tar file, unpack one safely.

Knows nothing about kernels, only about cache entries (`jitattn.jit.cache`) and the parts of
their manifests that decide whether this jitattn can use them (schema, ABI, archs, key).

An archive is a plain tar (or tar.gz by suffix) whose first member is `index.json`:

    {"format": "jitattn-cache-archive", "version": 1, "created": <unix time>,
     "schema": "v1",                      # the jitattn cache schema of the packer
     "entries": [{"path": "v1/sm90/<name>-<key16>", "key": ..., "name": ..., "archs": [...],
                  "abi": ..., "schema": ..., "files": {"module.so": {"sha256": ..., "size": ...},
                                                       ...every file of the entry...}}]}

followed by the entries' directories and files in sorted order, with relative names only.

Unpacking treats the archive as untrusted: members are read one by one (never `extractall`),
every name and type is checked, every byte is hashed against the index, and each entry is
written into a private staging directory inside the target root, verified with
`cache.read_entry`, and only then published with `cache.publish` (one atomic rename; an
existing valid entry wins). A rejected entry leaves nothing behind.
"""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import shutil
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO, Iterable

from jitattn.jit import cache, keys

INDEX = "index.json"
FORMAT = "jitattn-cache-archive"
FORMAT_VERSION = 1
DEFAULT_MAX_MEMBER_BYTES = 512 * 2**20  # per file
MAX_INDEX_BYTES = 64 * 2**20
ARCHIVE = "<archive>"  # the `item` of a rejection that concerns the whole archive

# One path component of an entry as the packer writes it: no separators, no "..", no oddities.
_SAFE_COMPONENT = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._+-]*$")


def current_abi() -> str:
    return "torch-stable-%d.%d" % keys.TORCH_ABI_TARGET


# ----------------------------------------------------------------------------- reports


@dataclass(frozen=True)
class PackedEntry:
    path: str  # relative to the cache root: <schema>/<arch tag>/<name>-<key16>
    key: str
    name: str
    size: int  # bytes of all its files


@dataclass
class PackReport:
    archive: Path
    packed: list[PackedEntry] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)  # (entry path, why): does not verify
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (entry path, why): other schema/ABI
    missing: list = field(default_factory=list)  # KernelSpecs asked for that have no packable entry

    @property
    def ok(self) -> bool:
        return bool(self.packed) and not self.refused and not self.missing


@dataclass(frozen=True)
class AcceptedEntry:
    path: str  # relative to the target root
    dest: Path
    status: str  # "added" or "present" (a valid entry was already there and wins)


@dataclass(frozen=True)
class Rejection:
    item: str  # a member name, an entry path, or ARCHIVE
    reason: str


@dataclass
class UnpackReport:
    archive: Path
    target: Path
    accepted: list[AcceptedEntry] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.rejected


# ----------------------------------------------------------------------------- pack


def pack(roots_or_entries, out_path, specs=None, *, created: float | None = None) -> PackReport:
    """Write one archive of verified cache entries to `out_path` (.tar.gz/.tgz: gzip, else plain).

    `roots_or_entries`: a path or a list of paths; each is a cache root (its current-schema
    entries are taken) or one entry directory. With `specs` (KernelSpecs), only entries whose
    manifest `components.spec` equals `spec.to_dict()` are packed, and specs with none are
    reported as missing. Entries that do not verify are refused (reported, not packed); entries
    of another cache schema or binding ABI are skipped (this jitattn could not load them).
    With the same `created` and the same entries, the archive is byte-for-byte the same.
    """
    out_path = Path(out_path)
    if isinstance(roots_or_entries, (str, os.PathLike)):
        roots_or_entries = [roots_or_entries]
    created = time.time() if created is None else float(created)
    report = PackReport(out_path)
    wanted = None if specs is None else [(s, s.to_dict()) for s in specs]
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
        manifest = _read_json(path / cache.MANIFEST)
        if wanted is not None:
            matches = [i for i, (spec, data) in enumerate(wanted) if _spec_of(manifest) == data]
            named = any(path.name.rsplit("-", 1)[0] == spec.name for spec, _ in wanted)
            if not matches and not named:
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
        problem = _stale(entry.manifest, rel)
        if problem:
            report.skipped.append((rel, problem))
            continue
        problem = _inconsistent(entry.manifest, rel)
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
        index_entries.append({
            "path": rel, "key": entry.key, "name": entry.manifest.get("name"),
            "archs": parts.get("archs"), "abi": parts.get("abi"), "schema": parts.get("schema"),
            "files": files,
        })
        sources.append((rel, path, files))
        report.packed.append(PackedEntry(rel, entry.key, entry.manifest.get("name"),
                                         sum(f["size"] for f in files.values())))
    if wanted is not None:
        report.missing = [spec for i, (spec, _) in enumerate(wanted) if i not in found]

    index = {"format": FORMAT, "version": FORMAT_VERSION, "created": created,
             "schema": keys.CACHE_SCHEMA, "entries": index_entries}
    _write_archive(out_path, index, sources, int(created))
    return report


def _spec_of(manifest) -> object:
    try:
        return manifest["components"]["spec"]
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
        if not all(_SAFE_COMPONENT.match(c) for c in PurePosixPath(rel).parts):
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


# ----------------------------------------------------------------------------- unpack


def unpack(archive, target_root, *, archs: Iterable[str] | None = None,
           max_member_bytes: int = DEFAULT_MAX_MEMBER_BYTES) -> UnpackReport:
    """Extract the verified entries of `archive` into the cache root `target_root` (created if
    absent). Nothing is written outside `target_root`; a rejected entry leaves nothing behind.

    `archs`: if given, only entries carrying code for at least one of these archs are accepted
    ('9.0' and '9.0a' count as the same GPU generation). Raises FileNotFoundError if the archive
    does not exist; everything else wrong with it is a rejection in the report.
    """
    archive, target = Path(archive), Path(target_root)
    report = UnpackReport(archive, target)
    if not archive.is_file():
        raise FileNotFoundError(f"no archive at {archive}")
    try:
        tar = tarfile.open(archive, mode="r:*")
    except (tarfile.TarError, OSError, EOFError) as exc:
        report.rejected.append(Rejection(ARCHIVE, f"not a readable tar archive ({exc})"))
        return report
    with tar:
        try:
            members = tar.getmembers()
        except (tarfile.TarError, OSError, EOFError) as exc:
            report.rejected.append(Rejection(ARCHIVE, f"corrupt tar archive ({exc})"))
            return report
        index = _read_index(tar, members, report)
        if index is None:
            return report
        _unpack_entries(tar, members, index, target, report, archs, max_member_bytes)
    return report


def _read_index(tar: tarfile.TarFile, members, report: UnpackReport) -> list[dict] | None:
    found = [m for m in members if m.name == INDEX]
    if not found:
        report.rejected.append(Rejection(ARCHIVE, f"no {INDEX}: not a jitattn cache archive"))
        return None
    if len(found) > 1:
        report.rejected.append(Rejection(INDEX, f"duplicate member name: {INDEX} appears {len(found)} times"))
        return None
    member = found[0]
    if not member.isreg():
        report.rejected.append(Rejection(INDEX, f"{INDEX} is a {_kind(member)}, not a regular file"))
        return None
    if member.size > MAX_INDEX_BYTES:
        report.rejected.append(Rejection(INDEX, f"oversized: {member.size} bytes > {MAX_INDEX_BYTES}"))
        return None
    try:
        index = json.loads(tar.extractfile(member).read())
    except (ValueError, tarfile.TarError, OSError, EOFError) as exc:
        report.rejected.append(Rejection(INDEX, f"unreadable or malformed JSON ({exc.__class__.__name__})"))
        return None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        report.rejected.append(Rejection(INDEX, f"not a jitattn cache archive index (format != {FORMAT!r})"))
        return None
    if index.get("version") != FORMAT_VERSION:
        report.rejected.append(Rejection(
            INDEX, f"archive format version {index.get('version')!r}; this jitattn reads {FORMAT_VERSION}"))
        return None
    entries = index.get("entries")
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        report.rejected.append(Rejection(INDEX, "malformed: 'entries' must be a list of objects"))
        return None
    return entries


def _unpack_entries(tar, members, index_entries, target: Path, report: UnpackReport, archs,
                    max_member_bytes: int) -> None:
    # 1. Which index entries are well formed, and which member names they list.
    entries: dict[str, dict] = {}  # entry path -> index record
    listed_files: dict[str, tuple[str, str]] = {}  # member name -> (entry path, file name)
    listed_dirs: set[str] = set()
    counts: dict[str, int] = {}
    for record in index_entries:
        counts[str(record.get("path"))] = counts.get(str(record.get("path")), 0) + 1
    for record in index_entries:
        rel = str(record.get("path"))
        problem = _index_record_problem(record)
        if problem is None and counts[rel] > 1:
            problem = f"listed {counts[rel]} times in {INDEX}"
        if problem is not None:
            report.rejected.append(Rejection(rel, problem))
            continue
        entries[rel] = record
        for name in record["files"]:
            listed_files[f"{rel}/{name}"] = (rel, name)
            for d in PurePosixPath(rel, name).parents:
                if d.as_posix() != ".":
                    listed_dirs.add(d.as_posix())

    # 2. Every member: name, type, uniqueness, listing, size. A bad member rejects its entry.
    name_counts: dict[str, int] = {}
    for m in members:
        name_counts[m.name] = name_counts.get(m.name, 0) + 1
    bad_entry: dict[str, str] = {}  # entry path -> first reason
    files: dict[str, tarfile.TarInfo] = {}  # member name -> member, for good listed files
    for m in members:
        if m.name == INDEX:
            continue
        reason = _member_problem(m, name_counts, listed_files, listed_dirs, max_member_bytes)
        owner = _owner(m.name, entries)
        if reason is None:
            if m.isreg():
                rel, name = listed_files[m.name]
                size = entries[rel]["files"][name]["size"]
                if m.size != size:
                    reason = f"size mismatch: archive member has {m.size} bytes, {INDEX} says {size}"
                else:
                    files[m.name] = m
            if reason is None:
                continue
        report.rejected.append(Rejection(m.name, reason))
        if owner is not None and owner not in bad_entry:
            bad_entry[owner] = f"member {m.name} rejected: {reason}"

    # 3. Entry by entry: metadata checks, then stage, hash, verify, publish.
    staging_base = target / cache.STAGING
    created_staging_base = not staging_base.exists()
    try:
        for rel in sorted(entries):
            record = entries[rel]
            reason = bad_entry.get(rel) or _compatibility_problem(record, archs)
            if reason is None:
                absent = [n for n in record["files"] if f"{rel}/{n}" not in files]
                if absent:
                    reason = f"{', '.join(sorted(absent))} listed in {INDEX} but not in the archive"
            if reason is None:
                try:
                    accepted, reason = _install(tar, files, rel, record, target)
                except OSError as exc:
                    accepted, reason = None, f"cannot write into {target}: {exc}"
                if accepted is not None:
                    report.accepted.append(accepted)
                    continue
            report.rejected.append(Rejection(rel, reason))
    finally:
        if created_staging_base:
            try:
                staging_base.rmdir()  # only if empty: nothing but what this call created
            except OSError:
                pass


def _index_record_problem(record: dict) -> str | None:
    rel = record.get("path")
    if not isinstance(rel, str) or not rel:
        return f"{INDEX} entry without a path"
    problem = _name_problem(rel)
    if problem:
        return f"unsafe entry path in {INDEX}: {problem}"
    parts = rel.split("/")
    if len(parts) != 3 or not all(_SAFE_COMPONENT.match(p) for p in parts):
        return f"entry path in {INDEX} is not <schema>/<arch tag>/<name>-<key16>"
    key, name = record.get("key"), record.get("name")
    if not isinstance(key, str) or not re.fullmatch(r"[0-9a-f]{64}", key):
        return f"{INDEX} entry has no valid key"
    if not isinstance(name, str) or parts[2] != f"{name}-{key[:16]}":
        return f"entry directory {parts[2]!r} does not match its name and key in {INDEX}"
    listed = record.get("files")
    if not isinstance(listed, dict) or not listed:
        return f"{INDEX} entry lists no files"
    for fname, meta in listed.items():
        if _name_problem(fname) or not all(_SAFE_COMPONENT.match(p) for p in fname.split("/")):
            return f"unsafe file name in {INDEX}: {fname!r}"
        if (not isinstance(meta, dict) or not isinstance(meta.get("sha256"), str)
                or not isinstance(meta.get("size"), int) or meta["size"] < 0):
            return f"{INDEX} has no sha256/size for {fname}"
    for required in (cache.MANIFEST, cache.LIBRARY):
        if required not in listed:
            return f"{INDEX} entry does not list {required}"
    return None


def _name_problem(name: str) -> str | None:
    if "\x00" in name:
        return "NUL byte in the name"
    if name.startswith("/") or re.match(r"^[A-Za-z]:[\\/]", name) or name.startswith("\\"):
        return f"absolute path {name!r}"
    parts = name.replace("\\", "/").split("/")
    if ".." in parts:
        return f"path traversal ('..' component) in {name!r}"
    if any(p in ("", ".") for p in parts):
        return f"non-canonical path {name!r}"
    return None


def _kind(m: tarfile.TarInfo) -> str:
    if m.issym():
        return f"symlink (-> {m.linkname})"
    if m.islnk():
        return f"hardlink (-> {m.linkname})"
    if m.ischr():
        return "character device"
    if m.isblk():
        return "block device"
    if m.isfifo():
        return "fifo"
    if m.isdir():
        return "directory"
    if m.isreg():
        return "regular file"
    return f"special member (type {m.type!r})"


def _member_problem(m: tarfile.TarInfo, name_counts, listed_files, listed_dirs, limit) -> str | None:
    problem = _name_problem(m.name)
    if problem:
        return problem
    if not (m.isreg() or m.isdir()):
        return f"{_kind(m)} members are not allowed (regular files and directories only)"
    if name_counts[m.name] > 1:
        return f"duplicate member name: appears {name_counts[m.name]} times"
    if m.isdir():
        return None if m.name in listed_dirs else f"directory not listed in {INDEX}"
    if m.name not in listed_files:
        return f"not listed in {INDEX}"
    if m.size > limit:
        return f"oversized: {m.size} bytes > limit {limit}"
    return None


def _owner(name: str, entries: dict) -> str | None:
    parts = name.split("/")
    rel = "/".join(parts[:3])
    return rel if len(parts) >= 3 and rel in entries else None


def _stale(manifest: dict, rel: str) -> str | None:
    """Why this jitattn could not use an entry (another cache schema or binding ABI)."""
    parts = manifest.get("components") or {}
    schema, abi = parts.get("schema"), parts.get("abi")
    if schema != keys.CACHE_SCHEMA or rel.split("/")[0] != keys.CACHE_SCHEMA:
        return f"cache schema {schema!r} is not this jitattn's {keys.CACHE_SCHEMA!r}"
    if abi != current_abi():
        return f"binding ABI {abi!r} is not this jitattn's {current_abi()!r}"
    return None


def _inconsistent(manifest: dict, rel: str) -> str | None:
    """Why a verified entry's manifest does not hold together (key, name, directory)."""
    parts = manifest.get("components")
    if not isinstance(parts, dict) or keys.key_of(parts) != manifest.get("key"):
        return "manifest key is not the hash of its components"
    if rel.split("/")[-1] != f"{manifest.get('name')}-{manifest['key'][:16]}":
        return "entry directory does not match the manifest's name and key"
    return None


def _compatibility_problem(record: dict, archs) -> str | None:
    if record.get("schema") != keys.CACHE_SCHEMA or record["path"].split("/")[0] != keys.CACHE_SCHEMA:
        return f"cache schema {record.get('schema')!r} is not this jitattn's {keys.CACHE_SCHEMA!r}"
    if record.get("abi") != current_abi():
        return f"binding ABI {record.get('abi')!r} is not this jitattn's {current_abi()!r}"
    if archs is not None:
        have = record.get("archs")
        if not isinstance(have, list) or not all(isinstance(a, str) for a in have):
            return f"{INDEX} entry does not say which archs it was built for"
        want = {a.rstrip("a") for a in archs}
        if not {a.rstrip("a") for a in have} & want:
            return f"built for archs {have}, none of {sorted(set(archs))}"
    return None


def _install(tar, files: dict, rel: str, record: dict, target: Path):
    """Stage, hash and verify one entry, then publish it: (AcceptedEntry, None) or (None, why)."""
    target.mkdir(parents=True, exist_ok=True)
    private = cache.new_staging_dir(target)
    try:
        stage = private / rel.split("/")[-1]
        stage.mkdir()
        base = os.path.realpath(stage)
        for name, meta in sorted(record["files"].items()):
            dest = stage / name
            if os.path.commonpath([base, os.path.realpath(dest)]) != base:
                return None, f"{name} would be written outside the staging directory"
            dest.parent.mkdir(parents=True, exist_ok=True)
            digest, size = _copy_member(tar, files[f"{rel}/{name}"], dest, meta["size"])
            if size != meta["size"]:
                return None, f"size mismatch for {name}: read {size} bytes, {INDEX} says {meta['size']}"
            if digest != meta["sha256"]:
                return None, f"sha256 mismatch for {name}: content does not match {INDEX}"
        entry = cache.read_entry(stage, record["key"])
        if entry is None:
            return None, f"does not verify as a cache entry: {cache.why_invalid(stage) or 'manifest key differs'}"
        problem = _stale(entry.manifest, rel) or _inconsistent(entry.manifest, rel)
        if problem is None:
            for field_name in ("name", "schema", "abi", "archs"):
                value = entry.manifest.get("name") if field_name == "name" else entry.components.get(field_name)
                if value != record.get(field_name):
                    problem = f"manifest {field_name} {value!r} differs from {INDEX}'s {record.get(field_name)!r}"
                    break
        if problem:
            return None, problem
        final = target / rel
        existed = cache.read_entry(final) is not None
        try:
            published = cache.publish(stage, final)
        except OSError as exc:
            if cache.read_entry(final, record["key"]) is None:
                return None, f"cannot publish into {final}: {exc}"
            published = final  # lost a race with another publisher, whose valid entry wins
        if cache.read_entry(published, record["key"]) is None:
            return None, f"published entry does not verify: {cache.why_invalid(published)}"
        return AcceptedEntry(rel, published, "present" if existed or stage.exists() else "added"), None
    finally:
        shutil.rmtree(private, ignore_errors=True)


def _copy_member(tar, member: tarfile.TarInfo, dest: Path, expected: int) -> tuple[str, int]:
    """Write one regular member to a new file (never following links); (sha256, bytes)."""
    src = tar.extractfile(member)
    if src is None:
        raise OSError(f"cannot read member {member.name}")
    h = hashlib.sha256()
    size = 0
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "wb") as out:
        while True:
            block = src.read(min(1 << 20, expected + 1 - size))
            if not block:
                break
            size += len(block)
            h.update(block)
            out.write(block)
            if size > expected:
                break
    return h.hexdigest(), size


# ----------------------------------------------------------------------------- verify


def verify_tree(root) -> list[tuple[Path, str]]:
    """(entry path, reason) for every entry under `root` that does not verify; [] if all do."""
    return [(p, r) for p in cache.entries(Path(root)) if (r := cache.why_invalid(p))]


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
