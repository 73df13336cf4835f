"""Cache archives bounded and signed (issue 45 item 3): what an archive producer can and cannot
make `jitattn cache unpack` do. Each test backs a sentence of docs/threat-model.md.

- an archive's members are bounded in count and in total size, checked while the headers are
  read, so a small compressed archive cannot inflate past the bound or write anything;
- index.json (and every manifest) is parsed under a depth and size bound;
- only plain tar and gzip are read (never bz2/xz);
- with a fleet secret configured, `pack` signs each entry as the fleet does and `unpack` refuses
  an unsigned, foreign-signed or forged entry; without one, old archives stay readable.
"""
from __future__ import annotations

import bz2
import gzip
import io
import json
import shutil
import tarfile
import time
from pathlib import Path

import pytest

from jitattn import cli
from jitattn.jit import artifact, bounded_json, cache, signing
from tests.fleet import OTHER_SECRET, SECRET
from tests.test_artifacts import (SPEC_A, entry_members, index_member, make_entry, record_of, reg, rejection,  # noqa: F401
                                  rel, source, tree, write_tar)

OLD_ARCHIVE = Path(__file__).resolve().parent / "data" / "cache-865b607.tar.gz"


@pytest.fixture(autouse=True)
def no_secret(monkeypatch):
    for knob in ("JITATTN_REMOTE_CACHE_KEY", "JITATTN_REMOTE_CACHE_KEY_FILE"):
        monkeypatch.delenv(knob, raising=False)


# ----------------------------------------------------------------------------- bounded JSON


@pytest.mark.parametrize("doc", [b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 5000 + b"1" + b"}" * 5000])
def test_bounded_json_refuses_deep_nesting_with_a_value_error_not_a_recursion_error(doc):
    with pytest.raises(bounded_json.JSONBoundError, match="nests deeper than 32 levels"):
        bounded_json.loads(doc, max_bytes=1 << 20)


def test_bounded_json_refuses_an_oversized_document_and_reads_brackets_inside_strings_as_text():
    with pytest.raises(bounded_json.JSONBoundError, match="over the bound of 10"):
        bounded_json.loads(b'"' + b"x" * 20 + b'"', max_bytes=10)
    text = json.dumps({"s": "[" * 1000 + '\\"{' * 100, "n": [[1]]}).encode()
    assert bounded_json.loads(text, max_bytes=1 << 20, max_depth=3)["n"] == [[1]]


# ----------------------------------------------------------------------------- bounded archives


def test_an_index_nested_100000_deep_is_a_clear_rejection(tmp_path, capsys):
    deep = reg(artifact.INDEX, b"[" * 100_000 + b"]" * 100_000)
    archive = write_tar(tmp_path / "deep.tar", [deep])
    report = artifact.unpack(archive, tmp_path / "target")
    assert "nests deeper than" in rejection(report, artifact.INDEX)
    assert cli.main(["cache", "unpack", str(archive), "--into", str(tmp_path / "target")]) == 1
    assert "REJECTED index.json: index.json nests deeper than" in capsys.readouterr().out
    assert tree(tmp_path / "target") == set()


def test_a_manifest_nested_deep_reads_as_a_corrupt_entry(source):
    _, entries = source
    (entries[0] / cache.MANIFEST).write_bytes(b"[" * 100_000 + b"]" * 100_000)
    assert cache.read_entry(entries[0]) is None
    assert "malformed manifest.json (JSONBoundError)" in cache.why_invalid(entries[0])


def test_members_over_the_total_size_bound_are_rejected_before_anything_is_written(source, tmp_path):
    root, entries = source
    archive = tmp_path / "cache.tar"
    artifact.pack(root, archive)
    total = sum(f.stat().st_size for e in entries for f in e.iterdir())
    report = artifact.unpack(archive, tmp_path / "target", max_total_bytes=total - 1)
    assert "over the bound on an archive's unpacked size" in rejection(report, artifact.ARCHIVE)
    assert tree(tmp_path / "target") == set()
    assert artifact.unpack(archive, tmp_path / "target", max_total_bytes=total + 4096).ok


def test_more_members_than_the_bound_are_rejected(source, tmp_path):
    root, _ = source
    archive = tmp_path / "cache.tar"
    artifact.pack(root, archive)
    report = artifact.unpack(archive, tmp_path / "target", max_members=5)
    assert "more than 5 members" in rejection(report, artifact.ARCHIVE)
    assert tree(tmp_path / "target") == set()


def test_a_small_gzip_bomb_is_rejected_without_inflating_it(tmp_path):
    """A few hundred KiB of gzip that would inflate to 256 MiB: the headers say so before the data is read."""
    path = tmp_path / "bomb.tar.gz"
    with gzip.open(path, "wb", compresslevel=9) as gz:
        with tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
            info, data = reg(artifact.INDEX, b'{"format": "jitattn-cache-archive", "version": 1, "entries": []}')
            tar.addfile(info, io.BytesIO(data))
            for i in range(4):
                info = tarfile.TarInfo(f"v1/sm90/x-{i:016x}/module.so")
                info.size = 64 * 2**20
                tar.addfile(info, _Zeros(info.size))
    assert path.stat().st_size < 2**20
    t0 = time.monotonic()
    report = artifact.unpack(path, tmp_path / "target", max_total_bytes=100 * 2**20)
    assert time.monotonic() - t0 < 5
    assert "over the bound on an archive's unpacked size" in rejection(report, artifact.ARCHIVE)
    assert tree(tmp_path / "target") == set()


class _Zeros(io.RawIOBase):
    def __init__(self, n):
        self.left = n

    def read(self, n=-1):
        n = self.left if n < 0 else min(n, self.left)
        self.left -= n
        return b"\0" * n


def test_a_gzip_archive_that_would_inflate_a_hundredfold_is_rejected_under_the_default_bound(tmp_path):
    path = tmp_path / "bomb.tar.gz"
    with gzip.open(path, "wb", compresslevel=9) as gz:
        with tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
            info = tarfile.TarInfo("v1/sm90/x-0000000000000000/module.so")
            info.size = 32 * 2**20
            tar.addfile(info, _Zeros(info.size))
    report = artifact.unpack(path, tmp_path / "target")
    assert "inflate at most 100x" in rejection(report, artifact.ARCHIVE)
    assert tree(tmp_path / "target") == set()


@pytest.mark.parametrize("compress", ["bzip2", "xz"])
def test_only_plain_tar_and_gzip_are_read(source, tmp_path, compress):
    root, _ = source
    plain = tmp_path / "cache.tar"
    artifact.pack(root, plain)
    import lzma

    packed = tmp_path / f"cache.tar.{compress}"
    packed.write_bytes((bz2.compress if compress == "bzip2" else lzma.compress)(plain.read_bytes()))
    report = artifact.unpack(packed, tmp_path / "target")
    assert f"a {compress}-compressed archive: only plain tar or gzip is read" in rejection(report, artifact.ARCHIVE)
    assert tree(tmp_path / "target") == set()


# ----------------------------------------------------------------------------- signed archives


def test_with_a_key_pack_signs_each_entry_and_unpack_accepts_it(source, tmp_path, monkeypatch):
    root, entries = source
    monkeypatch.setenv("JITATTN_REMOTE_CACHE_KEY", SECRET)
    archive = tmp_path / "cache.tar.gz"
    artifact.pack(root, archive)
    with tarfile.open(archive) as tar:
        index = json.loads(tar.extractfile(artifact.INDEX).read())
    assert all(r["signature"]["key_id"] == signing.key_id(SECRET.encode()) for r in index["entries"])
    report = artifact.unpack(archive, tmp_path / "target")
    assert report.ok and len(report.accepted) == len(entries)


def test_with_a_key_unpack_refuses_unsigned_and_foreign_signed_entries(source, tmp_path, monkeypatch):
    root, entries = source
    unsigned, foreign = tmp_path / "unsigned.tar", tmp_path / "foreign.tar"
    artifact.pack(root, unsigned)
    monkeypatch.setenv("JITATTN_REMOTE_CACHE_KEY", OTHER_SECRET)
    artifact.pack(root, foreign)
    monkeypatch.setenv("JITATTN_REMOTE_CACHE_KEY", SECRET)
    for archive, why in ((unsigned, "unsigned"), (foreign, "signed with another key")):
        report = artifact.unpack(archive, tmp_path / "target")
        assert not report.accepted
        assert all(why in rejection(report, rel(e)) for e in entries)
    assert not list(cache.entries(tmp_path / "target"))


def test_with_a_key_a_forged_library_with_a_consistent_manifest_and_index_is_refused(source, tmp_path, monkeypatch):
    """A producer without the key swaps module.so and rewrites its manifest and the index so that
    every hash agrees, keeping the old signature: only the signature can tell."""
    root, entries = source
    monkeypatch.setenv("JITATTN_REMOTE_CACHE_KEY", SECRET)
    genuine = tmp_path / "genuine.tar"
    artifact.pack(entries[0], genuine)
    with tarfile.open(genuine) as tar:
        signature = json.loads(tar.extractfile(artifact.INDEX).read())["entries"][0]["signature"]
    evil = tmp_path / "evil" / rel(entries[0])
    shutil.copytree(entries[0], evil)
    (evil / cache.LIBRARY).write_bytes(b"\x7fELF forged code")
    manifest = json.loads((evil / cache.MANIFEST).read_text())
    manifest.pop("library")
    (evil / cache.MANIFEST).unlink()
    cache.write_manifest(evil, manifest)
    forged = write_tar(tmp_path / "forged.tar", [index_member([record_of(evil, signature=signature)]),
                                                 *entry_members(evil)])
    report = artifact.unpack(forged, tmp_path / "target")
    assert "signature does not match the entry's contents" in rejection(report, rel(evil))
    assert not list(cache.entries(tmp_path / "target"))
    monkeypatch.delenv("JITATTN_REMOTE_CACHE_KEY")  # without a key an archive is as trusted as its producer
    assert artifact.unpack(forged, tmp_path / "target").ok


def test_without_a_key_the_old_unsigned_archive_format_stays_readable(tmp_path):
    report = artifact.unpack(OLD_ARCHIVE, tmp_path / "seed", archs=["9.0"])
    assert report.ok and len(report.accepted) == 2
