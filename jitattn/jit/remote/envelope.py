"""A cache entry as one Redis value, and back.

A value is a header line and a plain tar archive of the entry, as `jitattn cache pack` writes
it (index.json with every file's sha256, then the entry's files):

    b"JITATTN-REMOTE-ENTRY 1\\n" + json header + b"\\n" + archive
    header: {"key", "path": "<schema>/<arch tag>/<name>-<key16>", "name",
             "archive": {"size", "sha256"}, "signature": {"alg", "key_id", "mac"} or null}

Plain tar, not gzip: vetting an untrusted value then costs time linear in its size, which
`JITATTN_REMOTE_CACHE_MAX_MB` bounds (a compressed value could expand without bound).

Reading one back treats it as untrusted all the way: the header must name the key asked for,
the archive must have the size and sha256 the header says (a truncated or altered value reads
as refused, never as an entry), and the archive is unpacked by `artifact.unpack` — the same
vetting as an untrusted archive — into a private directory under the local root's staging dir.
There the entry is checked (manifest, .so sha256, key = hash of its components, and the
caller's trust check: the signature), and only then published into the local root with one
rename (`cache.publish`: the first valid entry wins).
"""
from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

from jitattn.jit import bounded_json, cache, keys

MAGIC = b"JITATTN-REMOTE-ENTRY 1\n"
MAX_HEADER = 16 * 1024
HEAD_BYTES = len(MAGIC) + MAX_HEADER  # enough to tell two values apart (the header names the archive's sha256)


class Refused(Exception):
    """A value that is not a valid, trusted entry of the key asked for; str() says why."""


def pack(entry: cache.CacheEntry, rel: str, signature: dict | None) -> bytes:
    from jitattn.jit import artifact

    with tempfile.TemporaryDirectory(prefix="jitattn-push-") as tmp:
        out = Path(tmp) / "entry.tar"
        report = artifact.pack([entry.path], out, created=0.0, secret=None)  # the header carries the signature
        if not report.ok or [p.path for p in report.packed] != [rel]:
            why = report.refused or report.skipped or [p.path for p in report.packed]
            raise ValueError(f"{entry.path} cannot be packed: {why}")
        archive = out.read_bytes()
    header = {"key": entry.key, "path": rel, "name": entry.manifest.get("name"),
              "archive": {"size": len(archive), "sha256": hashlib.sha256(archive).hexdigest()},
              "signature": signature}
    return MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + archive


def header_of(value: bytes) -> dict:
    """The header of a value; Refused if it has none (a foreign or cut-off value)."""
    if not value.startswith(MAGIC):
        raise Refused(f"foreign value: not a jitattn entry (it begins {value[:24]!r})")
    end = value.find(b"\n", len(MAGIC), HEAD_BYTES)
    if end < 0:
        raise Refused("truncated or malformed value: no complete header line")
    try:
        header = bounded_json.loads(value[len(MAGIC):end], max_bytes=MAX_HEADER, what="header")
    except bounded_json.JSONBoundError as exc:
        raise Refused(f"malformed header ({exc})") from None
    except ValueError:
        raise Refused("malformed header (not JSON)") from None
    if not isinstance(header, dict) or not isinstance(header.get("archive"), dict):
        raise Refused("malformed header (no archive record)")
    return header


def unwrap(value: bytes, key: str, rel: str) -> tuple[dict, bytes]:
    """(header, archive) of a value stored under `key`, or Refused."""
    header = header_of(value)
    if header.get("key") != key:
        raise Refused(f"foreign value: it holds the entry of another key ({str(header.get('key'))[:16]})")
    if header.get("path") != rel:
        raise Refused(f"foreign value: it holds {header.get('path')!r}, not {rel}")
    archive = value[value.index(b"\n", len(MAGIC)) + 1:]
    size, digest = header["archive"].get("size"), header["archive"].get("sha256")
    if type(size) is not int or not isinstance(digest, str):
        raise Refused("malformed header (archive size/sha256)")
    if len(archive) < size:
        raise Refused(f"truncated value: {len(archive)} of {size} archive bytes")
    if len(archive) > size:
        raise Refused(f"corrupt value: {len(archive)} archive bytes, its header says {size}")
    if hashlib.sha256(archive).hexdigest() != digest:
        raise Refused("corrupt value: the archive's sha256 does not match its header")
    return header, archive


def materialize(archive: bytes, key: str, rel: str, root: Path, accept) -> cache.CacheEntry:
    """Vet, check and publish the entry an archive holds into the cache root `root`.

    `accept(staged_dir, entry)` returns None to trust the staged entry or a reason to refuse
    it. Raises Refused (nothing is published) or OSError (the root cannot be written)."""
    from jitattn.jit import artifact

    private = cache.new_staging_dir(root)
    try:
        tar = private / "entry.tar"
        tar.write_bytes(archive)
        report = artifact.unpack(tar, private / "vetted", max_member_bytes=len(archive), max_total_bytes=len(archive),
                                 max_members=64, plain_only=True, secret=None)
        if report.rejected:
            raise Refused("archive rejected: " + "; ".join(f"{r.item}: {r.reason}" for r in report.rejected[:3]))
        if [a.path for a in report.accepted] != [rel]:
            raise Refused(f"the archive holds {[a.path for a in report.accepted]}, not {rel}")
        staged = private / "vetted" / rel
        entry = cache.read_entry(staged, key)
        if entry is None:
            raise Refused(f"the entry does not verify: {cache.why_invalid(staged) or 'manifest of another key'}")
        if keys.key_of(entry.components) != key:
            raise Refused("the manifest's key is not the hash of its components")
        why = accept(staged, entry)
        if why:
            raise Refused(why)
        final = root / rel
        published = cache.publish(staged, final)  # an existing valid entry wins
        entry = cache.read_entry(published, key)
        if entry is None:
            raise OSError(f"published entry {published} does not verify: {cache.why_invalid(published)}")
        return entry
    finally:
        cache.discard_staging(private)
