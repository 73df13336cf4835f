"""Vetting an untrusted archive: member names and types, index records, and what this jitattn can load.

Each function returns None for a sound item, else the reason it is rejected (a sentence that
names the problem). Nothing here reads member data or writes anything.
"""
from __future__ import annotations

import re
import tarfile

from jitattn.jit import cache, keys
from jitattn.jit.artifact.format import INDEX, SAFE_COMPONENT, current_abi


def index_record_problem(record: dict) -> str | None:
    rel = record.get("path")
    if not isinstance(rel, str) or not rel:
        return f"{INDEX} entry without a path"
    problem = name_problem(rel)
    if problem:
        return f"unsafe entry path in {INDEX}: {problem}"
    parts = rel.split("/")
    if len(parts) != 3 or not all(SAFE_COMPONENT.match(p) for p in parts):
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
        if name_problem(fname) or not all(SAFE_COMPONENT.match(p) for p in fname.split("/")):
            return f"unsafe file name in {INDEX}: {fname!r}"
        if (not isinstance(meta, dict) or not isinstance(meta.get("sha256"), str)
                or not isinstance(meta.get("size"), int) or meta["size"] < 0):
            return f"{INDEX} has no sha256/size for {fname}"
    for required in (cache.MANIFEST, cache.LIBRARY):
        if required not in listed:
            return f"{INDEX} entry does not list {required}"
    return None


def name_problem(name: str) -> str | None:
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


def member_kind(m: tarfile.TarInfo) -> str:
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


def member_problem(m: tarfile.TarInfo, name_counts, listed_files, listed_dirs, limit) -> str | None:
    problem = name_problem(m.name)
    if problem:
        return problem
    if not (m.isreg() or m.isdir()):
        return f"{member_kind(m)} members are not allowed (regular files and directories only)"
    if name_counts[m.name] > 1:
        return f"duplicate member name: appears {name_counts[m.name]} times"
    if m.isdir():
        return None if m.name in listed_dirs else f"directory not listed in {INDEX}"
    if m.name not in listed_files:
        return f"not listed in {INDEX}"
    if m.size > limit:
        return f"oversized: {m.size} bytes > limit {limit}"
    return None


def owning_entry(name: str, entries: dict) -> str | None:
    parts = name.split("/")
    rel = "/".join(parts[:3])
    return rel if len(parts) >= 3 and rel in entries else None


def compatibility_problem(record: dict, archs) -> str | None:
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
