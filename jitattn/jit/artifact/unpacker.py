"""Unpacking: an untrusted archive -> verified entries published into a cache root, one by one."""
from __future__ import annotations

import hashlib
import os
import tarfile
import zlib
from pathlib import Path, PurePosixPath
from typing import Iterable

from jitattn.jit import bounded_json, cache, signing
from jitattn.jit.artifact.format import (ARCHIVE, DEFAULT_MAX_MEMBER_BYTES, DEFAULT_MAX_MEMBERS,
                                         DEFAULT_MAX_TOTAL_BYTES, FORMAT, FORMAT_VERSION, INDEX, MAX_INDEX_BYTES,
                                         AcceptedEntry, Rejection, UnpackReport, configured_secret, inconsistent,
                                         stale)
from jitattn.jit.artifact.vetting import (compatibility_problem, index_record_problem, member_kind,
                                          member_problem, owning_entry)


def unpack(archive, target_root, *, archs: Iterable[str] | None = None,
           max_member_bytes: int = DEFAULT_MAX_MEMBER_BYTES, max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
           max_members: int = DEFAULT_MAX_MEMBERS, plain_only: bool = False,
           secret: bytes | None | object = configured_secret) -> UnpackReport:
    """Extract the verified entries of `archive` into the cache root `target_root` (created if
    absent). Nothing is written outside `target_root`; a rejected entry leaves nothing behind.

    `archs`: if given, only entries carrying code for at least one of these archs are accepted
    ('9.0' and '9.0a' count as the same GPU generation). The archive is a plain tar, or gzip
    (never bz2/xz; with `plain_only`, plain tar only); it may list at most `max_members` members
    of at most `max_total_bytes` together (and a gzip archive at most MAX_INFLATION times its
    own size), which is checked while the headers are read, before anything is written. `secret` (default: the fleet secret, when JITATTN_REMOTE_CACHE_KEY or
    _KEY_FILE is set; None: no check) must have signed every entry (`signing.sign_entry`, as
    `pack` does with a key): an unsigned or forged entry is rejected. Raises FileNotFoundError
    if the archive does not exist; everything else wrong with it is a rejection in the report.
    """
    archive, target = Path(archive), Path(target_root)
    report = UnpackReport(archive, target)
    if not archive.is_file():
        raise FileNotFoundError(f"no archive at {archive}")
    if secret is configured_secret:
        secret = configured_secret()
    mode, problem = _open_mode(archive, plain_only)
    if problem:
        report.rejected.append(Rejection(ARCHIVE, problem))
        return report
    try:
        tar = tarfile.open(archive, mode=mode)
    except (tarfile.TarError, OSError, EOFError) as exc:
        report.rejected.append(Rejection(ARCHIVE, f"not a readable tar archive ({exc})"))
        return report
    if mode == "r:gz":  # real entries compress a few times over; a bomb, by orders of magnitude
        max_total_bytes = min(max_total_bytes, MAX_INFLATION * archive.stat().st_size)
    with tar:
        try:
            members = _bounded_members(tar, max_members, max_total_bytes)
        except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
            report.rejected.append(Rejection(ARCHIVE, f"corrupt tar archive ({exc})"))
            return report
        except _OverBound as exc:
            report.rejected.append(Rejection(ARCHIVE, str(exc)))
            return report
        index = _read_index(tar, members, report)
        if index is None:
            return report
        _unpack_entries(tar, members, index, target, report, archs, max_member_bytes, secret)
    return report


MAX_INFLATION = 100  # a gzip archive may list at most this many times its own size


class _OverBound(Exception):
    pass


def _open_mode(archive: Path, plain_only: bool) -> tuple[str, str | None]:
    """The tarfile mode for an archive's first bytes, or why it is refused (bz2, xz, ...)."""
    with open(archive, "rb") as f:
        magic = f.read(6)
    if magic.startswith(b"\x1f\x8b"):
        if plain_only:
            return "", "a gzip-compressed archive where only plain tar is read"
        return "r:gz", None
    for prefix, what in ((b"BZh", "bzip2"), (b"\xfd7zXZ", "xz"), (b"\x28\xb5\x2f\xfd", "zstd")):
        if magic.startswith(prefix):
            return "", f"a {what}-compressed archive: only plain tar{'' if plain_only else ' or gzip'} is read"
    return "r:", None


def _bounded_members(tar: tarfile.TarFile, max_members: int, max_total_bytes: int) -> list[tarfile.TarInfo]:
    """The members, read header by header; _OverBound as soon as there are more than
    `max_members` or their sizes add up to more than `max_total_bytes` (so a compressed archive
    is never inflated past the bound just to be listed)."""
    members, total = [], 0
    while True:
        member = tar.next()
        if member is None:
            return members
        members.append(member)
        total += max(member.size, 0)
        if len(members) > max_members:
            raise _OverBound(f"more than {max_members} members: over the bound on an archive's member count")
        if total > max_total_bytes:
            raise _OverBound(f"members of more than {max_total_bytes} bytes together: over the bound on an "
                             f"archive's unpacked size (cache unpack --max-total-mb; a gzip archive may also "
                             f"inflate at most {MAX_INFLATION}x)")


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
        report.rejected.append(Rejection(INDEX, f"{INDEX} is a {member_kind(member)}, not a regular file"))
        return None
    if member.size > MAX_INDEX_BYTES:
        report.rejected.append(Rejection(INDEX, f"oversized: {member.size} bytes > {MAX_INDEX_BYTES}"))
        return None
    try:
        index = bounded_json.loads(tar.extractfile(member).read(MAX_INDEX_BYTES + 1), max_bytes=MAX_INDEX_BYTES,
                                   what=INDEX)
    except bounded_json.JSONBoundError as exc:
        report.rejected.append(Rejection(INDEX, str(exc)))
        return None
    except (ValueError, tarfile.TarError, OSError, EOFError, zlib.error) as exc:
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
                    max_member_bytes: int, secret: bytes | None) -> None:
    # 1. Which index entries are well formed, and which member names they list.
    entries: dict[str, dict] = {}  # entry path -> index record
    listed_files: dict[str, tuple[str, str]] = {}  # member name -> (entry path, file name)
    listed_dirs: set[str] = set()
    counts: dict[str, int] = {}
    for record in index_entries:
        counts[str(record.get("path"))] = counts.get(str(record.get("path")), 0) + 1
    for record in index_entries:
        rel = str(record.get("path"))
        problem = index_record_problem(record)
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
        reason = member_problem(m, name_counts, listed_files, listed_dirs, max_member_bytes)
        owner = owning_entry(m.name, entries)
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
            reason = bad_entry.get(rel) or compatibility_problem(record, archs)
            if reason is None:
                absent = [n for n in record["files"] if f"{rel}/{n}" not in files]
                if absent:
                    reason = f"{', '.join(sorted(absent))} listed in {INDEX} but not in the archive"
            if reason is None:
                try:
                    accepted, reason = _install(tar, files, rel, record, target, secret)
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


def _install(tar, files: dict, rel: str, record: dict, target: Path, secret: bytes | None):
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
        if secret is not None:
            why = signing.check_entry(secret, record["key"], stage, record.get("signature"))
            if why:
                return None, f"{why} (a signing key is configured: JITATTN_REMOTE_CACHE_KEY or _KEY_FILE)"
        entry = cache.read_entry(stage, record["key"])
        if entry is None:
            return None, f"does not verify as a cache entry: {cache.why_invalid(stage) or 'manifest key differs'}"
        problem = stale(entry.manifest, rel) or inconsistent(entry.manifest, rel)
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
        cache.discard_staging(private)


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


def verify_tree(root) -> list[tuple[Path, str]]:
    """(entry path, reason) for every entry under `root` that does not verify; [] if all do."""
    return [(p, r) for p in cache.entries(Path(root)) if (r := cache.why_invalid(p))]
