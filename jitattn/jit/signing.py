"""Fleet signatures: HMAC-SHA256, with the fleet's secret, over what a remote entry holds.

The signed message names the entry's key and every file in it by name, size and sha256:
manifest.json among them, and the manifest holds the .so's sha256, so the signature covers the
code a process will load. A signature is made from an entry on disk (`sign_entry`) and checked
against the files of an entry staged from an untrusted value (`check_entry`): the bytes that are
checked are the bytes that get published.
"""
from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path

from jitattn.errors import RemoteCacheError
from jitattn.jit import cache, env

ALGORITHM = "hmac-sha256"
_DOMAIN = b"jitattn-remote-entry-v1\n"
MIN_SECRET_BYTES = 16


def fleet_secret() -> tuple[bytes, str] | None:
    """(secret, where it came from), or None when neither knob is set."""
    raw = env.remote_cache_secret()
    if raw is not None:
        secret, source = raw.encode(), "JITATTN_REMOTE_CACHE_KEY"
    else:
        path = env.remote_cache_key_file()
        if path is None:
            return None
        try:
            secret = path.read_bytes().strip()
        except OSError as exc:
            raise RemoteCacheError(f"JITATTN_REMOTE_CACHE_KEY_FILE: cannot read {path}: {exc.strerror}") from None
        source = f"JITATTN_REMOTE_CACHE_KEY_FILE ({path})"
    if len(secret) < MIN_SECRET_BYTES:
        raise RemoteCacheError(f"the fleet secret from {source} has {len(secret)} bytes; use at least "
                               f"{MIN_SECRET_BYTES} (e.g. `openssl rand -hex 32`)")
    return secret, source


def key_id(secret: bytes) -> str:
    """A short public name of a secret, so a refusal can say "signed with another key"."""
    return hashlib.sha256(b"jitattn-key-id\0" + secret).hexdigest()[:12]


def entry_files(path: Path) -> dict[str, dict]:
    """{name: {"sha256", "size"}} of the regular files of an entry directory."""
    files = {}
    for item in sorted(path.rglob("*")):
        if item.is_symlink() or not (item.is_file() or item.is_dir()):
            raise ValueError(f"{item} is not a regular file")
        if item.is_file():
            files[item.relative_to(path).as_posix()] = {"sha256": cache.file_digest(item),
                                                         "size": item.stat().st_size}
    return files


def _message(key: str, files: dict) -> bytes:
    return _DOMAIN + json.dumps({"key": key, "files": files}, sort_keys=True, separators=(",", ":")).encode()


def sign_entry(secret: bytes, key: str, path: Path) -> dict:
    """The signature record a published value carries."""
    mac = hmac.new(secret, _message(key, entry_files(path)), hashlib.sha256).hexdigest()
    return {"alg": ALGORITHM, "key_id": key_id(secret), "mac": mac}


def check_entry(secret: bytes | None, key: str, path: Path, signature) -> str | None:
    """None if `signature` is a valid signature of the entry at `path` under `secret`; else
    why not ("unsigned", "signed with another key ...", "signature does not match ...")."""
    if not isinstance(signature, dict) or not signature.get("mac"):
        return "unsigned"
    if secret is None:
        return f"signed (key id {signature.get('key_id')}), but this process has no fleet secret to check it"
    if signature.get("alg") != ALGORITHM:
        return f"signed with an unknown algorithm {signature.get('alg')!r}"
    ours = key_id(secret)
    if signature.get("key_id") != ours:
        return f"signed with another key (key id {signature.get('key_id')}; this fleet's is {ours})"
    expected = hmac.new(secret, _message(key, entry_files(path)), hashlib.sha256).hexdigest()
    if not isinstance(signature["mac"], str) or not hmac.compare_digest(expected, signature["mac"]):
        return "signature does not match the entry's contents (altered after signing, or forged)"
    return None
