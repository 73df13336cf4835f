"""Ways to corrupt a cache entry, shared by the cache-read tests and the rebuild tests.

Each maps a name to (corrupt(entry, other_entry), a phrase cache.why_invalid reports).
"""
import json
import shutil

from jitattn.jit import cache


def _truncate(path, other):
    so = path / cache.LIBRARY
    so.write_bytes(so.read_bytes()[:-7])


def _flip_byte(path, other):
    so = path / cache.LIBRARY
    data = bytearray(so.read_bytes())
    data[len(data) // 2] ^= 0x40
    so.write_bytes(bytes(data))


def _remove_manifest(path, other):
    (path / cache.MANIFEST).unlink()


def _remove_library(path, other):
    (path / cache.LIBRARY).unlink()


def _malformed_manifest(path, other):
    text = (path / cache.MANIFEST).read_text()
    (path / cache.MANIFEST).write_text(text[: len(text) // 2])


def _manifest_without_library(path, other):
    manifest = json.loads((path / cache.MANIFEST).read_text())
    del manifest["library"]
    (path / cache.MANIFEST).write_text(json.dumps(manifest))


def _manifest_of_another_key(path, other):
    shutil.copy(other / cache.MANIFEST, path / cache.MANIFEST)


CORRUPTIONS = {
    "truncated module.so": (_truncate, "size"),
    "one flipped byte": (_flip_byte, "sha256"),
    "missing manifest": (_remove_manifest, "no manifest.json"),
    "missing module.so": (_remove_library, "module.so missing"),
    "malformed manifest JSON": (_malformed_manifest, "malformed manifest.json"),
    "manifest without library record": (_manifest_without_library, "malformed manifest.json"),
    "manifest copied from another key's entry": (_manifest_of_another_key, "another key"),
}
