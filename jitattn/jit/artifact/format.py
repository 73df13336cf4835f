"""The cache archive format: its constants, reports, and the manifest checks packer and unpacker share."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from jitattn.jit import bounded_json, keys

INDEX = "index.json"
FORMAT = "jitattn-cache-archive"
FORMAT_VERSION = 1
DEFAULT_MAX_MEMBER_BYTES = 512 * 2**20  # per file
DEFAULT_MAX_TOTAL_BYTES = 4 * 2**30  # all members together (a cache of every tuned spec is far smaller)
DEFAULT_MAX_MEMBERS = 100_000
MAX_INDEX_BYTES = 64 * 2**20
ARCHIVE = "<archive>"  # the `item` of a rejection that concerns the whole archive

# One path component of an entry as the packer writes it: no separators, no "..", no oddities.
SAFE_COMPONENT = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._+-]*$")


def current_abi() -> str:
    return "torch-stable-%d.%d" % keys.TORCH_ABI_TARGET


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


def stale(manifest: dict, rel: str) -> str | None:
    """Why this jitattn could not use an entry (another cache schema or binding ABI)."""
    parts = manifest.get("components") or {}
    schema, abi = parts.get("schema"), parts.get("abi")
    if schema != keys.CACHE_SCHEMA or rel.split("/")[0] != keys.CACHE_SCHEMA:
        return f"cache schema {schema!r} is not this jitattn's {keys.CACHE_SCHEMA!r}"
    if abi != current_abi():
        return f"binding ABI {abi!r} is not this jitattn's {current_abi()!r}"
    return None


def inconsistent(manifest: dict, rel: str) -> str | None:
    """Why a verified entry's manifest does not hold together (key, name, directory)."""
    parts = manifest.get("components")
    if not isinstance(parts, dict) or keys.key_of(parts) != manifest.get("key"):
        return "manifest key is not the hash of its components"
    if rel.split("/")[-1] != f"{manifest.get('name')}-{manifest['key'][:16]}":
        return "entry directory does not match the manifest's name and key"
    return None


def read_json(path: Path):
    try:
        return bounded_json.read(path, max_bytes=MAX_INDEX_BYTES)
    except (OSError, ValueError):
        return None


def configured_secret() -> bytes | None:
    """The key archives are signed and checked with: the fleet secret, when one is configured
    (JITATTN_REMOTE_CACHE_KEY or JITATTN_REMOTE_CACHE_KEY_FILE), else None (unsigned archives,
    as trusted as their producer)."""
    from jitattn.jit import signing

    found = signing.fleet_secret()
    return found[0] if found else None
