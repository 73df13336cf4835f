"""CPU tests: cache archives (`jitattn cache pack` / `unpack`, `jitattn.jit.artifact`).

Entries are fakes built as a real build publishes them: a few bytes as module.so, the generated
sources, a manifest with real key components (`keys.components` for sm90, nvcc 13.0.88) written
by `cache.write_manifest`, published by `cache.publish`. Hostile archives are written by hand
with `tarfile.TarInfo`; after each one the target root must hold exactly the accepted entries
(no partial entry, no staging litter) and nothing outside it may have changed.
"""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
import time
import uuid
from pathlib import Path

import pytest

from jitattn import cli
from jitattn.jit import artifact, cache, keys, loader, manifest
from jitattn.decode.spec import DecodeSpec

TARGET = keys.BuildTarget(("9.0",), "13.0.88", "gcc 12.2.0")
SPEC_A = DecodeSpec(head_dim=128)
SPEC_B = DecodeSpec(head_dim=64, dtype_q="bfloat16", dtype_kv="bfloat16", group_tile=4)
SPEC_C = DecodeSpec(head_dim=256, soft_cap=True, group_tile=2)
ABI = "torch-stable-%d.%d" % keys.TORCH_ABI_TARGET


def make_entry(root: Path, of_spec, payload: bytes | None = None, arch_tag: str = "sm90",
               schema_dir: str = keys.CACHE_SCHEMA, **override) -> Path:
    """Publish a fake entry for `of_spec` with realistic components (override some to make it odd)."""
    spec = of_spec
    parts = keys.components(spec, TARGET)
    parts.update(override)
    key = keys.key_of(parts)
    staging = cache.new_staging_dir(root)
    (staging / cache.LIBRARY).write_bytes(payload if payload is not None else b"\x7fELF " + spec.name.encode() * 8)
    (staging / "binding.cpp").write_text(f"// binding of {spec.name}\n")
    (staging / "kernels.cu").write_text(f"// kernels of {spec.name}\n")
    cache.write_manifest(staging, {
        "key": key, "name": spec.name, "op_namespace": f"jitattn_{spec.name}", "components": parts,
        "built": {"seconds": 1.5, "host": "ci-builder", "time": 1700000000.0},
    })
    return cache.publish(staging, cache.entry_path(root, schema_dir, arch_tag, spec.name, key))


def rel(entry: Path) -> str:
    return "/".join(entry.parts[-3:])


def files_of(entry: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(entry.iterdir())}


def record_of(entry: Path, **override) -> dict:
    """An index record for an entry, computed independently of the code under test."""
    m = json.loads((entry / cache.MANIFEST).read_text())
    files = {name: {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
             for name, data in files_of(entry).items()}
    record = {"path": rel(entry), "key": m["key"], "name": m["name"], "archs": m["components"]["archs"],
              "abi": m["components"]["abi"], "schema": m["components"]["schema"], "files": files}
    record.update(override)
    return record


def snapshot(base: Path, exclude: Path | None = None) -> dict[str, bytes | None]:
    """Every path under `base` (files with their bytes), except those under `exclude`."""
    out = {}
    for p in sorted(base.rglob("*")):
        if exclude is not None and (p == exclude or exclude in p.parents):
            continue
        out[p.relative_to(base).as_posix()] = p.read_bytes() if p.is_file() and not p.is_symlink() else None
    return out


def tree(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")} if root.exists() else set()


def entry_tree(root: Path, entries: list[str]) -> set[str]:
    """What a root holding exactly these entries (and nothing else) looks like."""
    out = set()
    for r in entries:
        schema, arch, _ = r.split("/")
        out |= {schema, f"{schema}/{arch}", r}
        out |= {f"{r}/{name}" for name in ("binding.cpp", "kernels.cu", cache.MANIFEST, cache.LIBRARY)}
    return out


def reg(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    return info, data


def special(name: str, kind: bytes, linkname: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    if kind in (tarfile.CHRTYPE, tarfile.BLKTYPE):
        info.devmajor, info.devminor = 1, 3
    return info, None


def write_tar(path: Path, members) -> Path:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def index_member(records: list[dict]) -> tuple[tarfile.TarInfo, bytes]:
    index = {"format": artifact.FORMAT, "version": artifact.FORMAT_VERSION, "created": 0.0,
             "schema": keys.CACHE_SCHEMA, "entries": records}
    return reg(artifact.INDEX, json.dumps(index).encode())


def entry_members(entry: Path, as_rel: str | None = None) -> list:
    prefix = as_rel or rel(entry)
    return [reg(f"{prefix}/{name}", data) for name, data in files_of(entry).items()]


def rejection(report, item: str) -> str:
    reasons = [r.reason for r in report.rejected if r.item == item]
    assert reasons, f"{item} not rejected; rejected: {report.rejected}"
    return reasons[0]


@pytest.fixture
def source(tmp_path):
    """A build machine's cache root with three entries."""
    root = tmp_path / "build-cache"
    return root, [make_entry(root, s) for s in (SPEC_A, SPEC_B, SPEC_C)]


# ----------------------------------------------------------------------------- pack


def test_pack_writes_the_index_first_then_every_file_with_relative_names(source, tmp_path):
    root, entries = source
    out = tmp_path / "out" / "cache.tar"
    report = artifact.pack(root, out)
    assert report.ok and [p.path for p in report.packed] == sorted(rel(e) for e in entries)
    with tarfile.open(out) as tar:
        members = tar.getmembers()
        assert members[0].name == artifact.INDEX
        index = json.loads(tar.extractfile(members[0]).read())
        for m in members:
            assert m.isreg() or m.isdir()
            assert not m.name.startswith("/") and ".." not in m.name.split("/")
        names = [m.name for m in members]
        assert len(names) == len(set(names))
        files = {m.name: tar.extractfile(m).read() for m in members[1:] if m.isreg()}
    assert index["format"] == artifact.FORMAT and index["version"] == artifact.FORMAT_VERSION
    assert index["schema"] == keys.CACHE_SCHEMA and abs(index["created"] - time.time()) < 60
    assert index["entries"] == [record_of(e) for e in sorted(entries, key=rel)]
    # Every file of every entry, byte for byte, and nothing else.
    assert files == {f"{rel(e)}/{n}": d for e in entries for n, d in files_of(e).items()}
    assert not list(out.parent.glob(".*tmp"))  # the temporary file was renamed into place


def test_pack_is_deterministic_and_gzips_by_suffix(source, tmp_path):
    root, _ = source
    plain1, plain2 = tmp_path / "a.tar", tmp_path / "b.tar"
    gz1, gz2 = tmp_path / "a.tar.gz", tmp_path / "b.tgz"
    for out in (plain1, plain2, gz1, gz2):
        artifact.pack([root], out, created=1700000000.0)
    assert plain1.read_bytes() == plain2.read_bytes()
    assert gz1.read_bytes() == gz2.read_bytes()
    assert gz1.read_bytes()[:2] == b"\x1f\x8b" and plain1.read_bytes()[:2] != b"\x1f\x8b"
    assert gzip.decompress(gz1.read_bytes()) == plain1.read_bytes()


def test_pack_ignores_staging_litter_locks_and_logs(source, tmp_path):
    root, entries = source
    litter = cache.new_staging_dir(root)
    (litter / cache.LIBRARY).write_bytes(b"half a build")
    (root / cache.LOCKS).mkdir()
    (root / cache.LOCKS / "x.lock").write_text("")
    (root / "toolchains.json").write_text("{}")
    (root / cache.STAMPS).mkdir()
    (root / cache.STAMPS / "0123.json").write_text("{}")  # a verified stamp: this machine's, never packed
    report = artifact.pack(root, tmp_path / "c.tar")
    assert [p.path for p in report.packed] == sorted(rel(e) for e in entries)
    with tarfile.open(tmp_path / "c.tar") as tar:
        assert all(n == artifact.INDEX or n.startswith(keys.CACHE_SCHEMA) for n in tar.getnames())


def test_pack_refuses_an_entry_that_does_not_verify(source, tmp_path):
    root, entries = source
    corrupt = entries[1]
    data = bytearray((corrupt / cache.LIBRARY).read_bytes())
    data[3] ^= 1
    (corrupt / cache.LIBRARY).write_bytes(bytes(data))
    report = artifact.pack(root, tmp_path / "c.tar")
    assert report.refused == [(rel(corrupt), "module.so sha256 does not match the manifest")]
    assert not report.ok
    assert sorted(p.path for p in report.packed) == sorted(rel(e) for e in entries if e != corrupt)
    with tarfile.open(tmp_path / "c.tar") as tar:
        assert not [n for n in tar.getnames() if n.startswith(rel(corrupt))]


def test_pack_skips_an_entry_of_another_binding_abi(tmp_path):
    root = tmp_path / "root"
    good = make_entry(root, SPEC_A)
    stale = make_entry(root, SPEC_B, abi="torch-stable-2.9")
    report = artifact.pack(root, tmp_path / "c.tar")
    assert [p.path for p in report.packed] == [rel(good)]
    assert [path for path, _ in report.skipped] == [rel(stale)]
    assert "torch-stable-2.9" in report.skipped[0][1]
    assert report.ok  # a stale entry is not an error of the archive


def test_pack_with_specs_packs_only_their_entries_and_reports_missing_ones(source, tmp_path):
    root, entries = source
    toml = tmp_path / "m.toml"
    toml.write_text(
        '[[spec]]\nfamily = "decode"\nhead_dim = 128\n\n'
        '[[spec]]\nfamily = "decode"\nhead_dim = 256\nsoft_cap = true\ngroup_size = 2\n\n'
        '[[spec]]\nfamily = "decode"\nhead_dim = 96\n'
    )
    specs = manifest.read_manifest(toml)
    assert len(specs) == 3
    report = artifact.pack(root, tmp_path / "sel.tar", specs=specs)
    assert sorted(p.name for p in report.packed) == sorted([SPEC_A.name, SPEC_C.name])
    assert report.missing == [DecodeSpec(head_dim=96)]
    assert not report.ok
    with tarfile.open(tmp_path / "sel.tar") as tar:
        index = json.loads(tar.extractfile(artifact.INDEX).read())
        assert {e["name"] for e in index["entries"]} == {SPEC_A.name, SPEC_C.name}
        assert not [n for n in tar.getnames() if SPEC_B.name in n]


def test_pack_with_specs_compares_the_whole_spec_not_the_name(tmp_path):
    root = tmp_path / "root"
    # An entry under SPEC_A's name whose manifest was built for another spec.
    make_entry(root, SPEC_A, spec=SPEC_B.to_dict())
    report = artifact.pack(root, tmp_path / "x.tar", specs=[SPEC_A])
    assert report.packed == [] and report.missing == [SPEC_A]


def test_pack_with_specs_skips_an_entry_built_from_older_templates(tmp_path):
    root = tmp_path / "root"
    # Same spec, but the templates changed since it was built: this tree would never load it.
    old = make_entry(root, SPEC_A, templates="0" * 64)
    report = artifact.pack(root, tmp_path / "x.tar", specs=[SPEC_A])
    assert report.packed == [] and report.missing == [SPEC_A]
    assert [r for r, _ in report.skipped] == [rel(old)] and "templates" in report.skipped[0][1]
    current = make_entry(root, SPEC_A)
    report = artifact.pack(root, tmp_path / "y.tar", specs=[SPEC_A])
    assert [p.path for p in report.packed] == [rel(current)] and report.missing == []
    # Without specs, nothing tells an old entry from a current one: both are packed.
    assert len(artifact.pack(root, tmp_path / "z.tar").packed) == 2


# ----------------------------------------------------------------------------- round trip


def test_unpack_into_a_new_seed_dir_gives_verified_entries(source, tmp_path):
    root, entries = source
    out = tmp_path / "cache.tar.gz"
    artifact.pack(root, out)
    seed = tmp_path / "opt" / "seed"  # does not exist yet
    report = artifact.unpack(out, seed)
    assert report.ok and report.rejected == []
    assert sorted(a.path for a in report.accepted) == sorted(rel(e) for e in entries)
    assert {a.status for a in report.accepted} == {"added"}
    assert artifact.verify_tree(seed) == []
    for e in entries:
        m = json.loads((e / cache.MANIFEST).read_text())
        copy = cache.read_entry(seed / rel(e), m["key"])
        assert copy is not None and copy.manifest == m
        assert files_of(seed / rel(e)) == files_of(e)
    assert tree(seed) == entry_tree(seed, [rel(e) for e in entries])  # no staging litter


def test_unpacked_seed_dir_serves_strict_mode_without_compiling(source, tmp_path, monkeypatch):
    root, entries = source
    artifact.pack(root, tmp_path / "cache.tar")
    seed = tmp_path / "seed"
    artifact.unpack(tmp_path / "cache.tar", seed)
    monkeypatch.setenv("JITATTN_CACHE_DIR", str(tmp_path / "empty-user-cache"))
    monkeypatch.setenv("JITATTN_CACHE_SEED_DIRS", str(seed))
    monkeypatch.setenv("JITATTN_DISABLE_JIT", "1")
    monkeypatch.setenv("JITATTN_CUDA_ARCH_LIST", "9.0")
    monkeypatch.delenv("JITATTN_RECORD", raising=False)
    loads = []
    monkeypatch.setattr(loader, "load_entry", lambda spec, entry: loads.append(entry.path) or entry.path)
    before = loader.COMPILE_COUNT
    with loader.forget_loaded():
        assert loader.get_module(SPEC_B) == seed / rel(entries[1])
    assert loads == [seed / rel(entries[1])] and loader.COMPILE_COUNT == before


def test_unpack_twice_keeps_the_existing_entries(source, tmp_path):
    root, entries = source
    artifact.pack(root, tmp_path / "c.tar")
    seed = tmp_path / "seed"
    artifact.unpack(tmp_path / "c.tar", seed)
    before = snapshot(seed)
    report = artifact.unpack(tmp_path / "c.tar", seed)
    assert report.ok and {a.status for a in report.accepted} == {"present"}
    assert snapshot(seed) == before


def test_unpack_replaces_a_corrupt_entry_in_the_target(source, tmp_path):
    root, entries = source
    artifact.pack(root, tmp_path / "c.tar")
    target = tmp_path / "target"
    artifact.unpack(tmp_path / "c.tar", target)
    broken = target / rel(entries[0])
    (broken / cache.LIBRARY).write_bytes(b"truncated")
    assert cache.read_entry(broken) is None
    report = artifact.unpack(tmp_path / "c.tar", target)
    assert report.ok
    assert {a.path: a.status for a in report.accepted}[rel(entries[0])] == "added"
    assert cache.read_entry(broken) is not None and files_of(broken) == files_of(entries[0])


def test_unpack_with_an_arch_filter(source, tmp_path):
    root, entries = source
    artifact.pack(root, tmp_path / "c.tar")
    other = artifact.unpack(tmp_path / "c.tar", tmp_path / "a100", archs=["8.0"])
    assert other.accepted == [] and len(other.rejected) == 3
    assert all("built for archs ['9.0']" in r.reason for r in other.rejected)
    assert tree(tmp_path / "a100") == set()
    hopper = artifact.unpack(tmp_path / "c.tar", tmp_path / "h100", archs=["8.0", "9.0a"])
    assert hopper.ok and len(hopper.accepted) == 3


def test_unpack_of_a_file_that_is_not_a_tar_is_rejected(tmp_path):
    bogus = tmp_path / "bogus.tar.gz"
    bogus.write_bytes(b"\x1f\x8b this is not gzip at all" * 10)
    report = artifact.unpack(bogus, tmp_path / "t")
    assert [r.item for r in report.rejected] == [artifact.ARCHIVE]
    assert "tar" in report.rejected[0].reason
    assert not (tmp_path / "t").exists()


def test_unpack_of_a_missing_archive_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        artifact.unpack(tmp_path / "nope.tar", tmp_path / "t")


# ----------------------------------------------------------------------------- hostile archives

EVIL_ABS = f"/tmp/jitattn-evil-{uuid.uuid4().hex}"


class Case:
    """A hostile archive: one 'victim' entry (maybe altered) next to an untouched 'bystander'."""

    def __init__(self, victim: Path, bystander: Path, tmp_path: Path):
        self.victim, self.bystander, self.tmp_path = victim, bystander, tmp_path
        self.v = rel(victim)
        self.records = [record_of(bystander), record_of(victim)]
        self.members = entry_members(bystander) + entry_members(victim)
        self.with_index = True

    def replace(self, name: str, new) -> None:
        self.members = [new if m[0].name == name else m for m in self.members]


def _traversal_top(c):
    c.members.append(reg("../evil", b"pwned"))
    return "../evil", "path traversal", False


def _traversal_in_entry(c):
    c.members.append(reg(f"{c.v}/../../../../evil", b"pwned"))
    return f"{c.v}/../../../../evil", "path traversal", True


def _absolute(c):
    c.members.append(reg(EVIL_ABS, b"pwned"))
    return EVIL_ABS, "absolute path", False


def _symlink(c):
    c.replace(f"{c.v}/module.so", special(f"{c.v}/module.so", tarfile.SYMTYPE, "/etc/passwd"))
    return f"{c.v}/module.so", "symlink", True


def _symlink_dir(c):
    # A directory symlink at the entry's own path, then files "inside" it.
    c.members.insert(0, special(c.v, tarfile.SYMTYPE, str(c.tmp_path / "elsewhere")))
    return c.v, "symlink", True


def _hardlink(c):
    c.replace(f"{c.v}/module.so", special(f"{c.v}/module.so", tarfile.LNKTYPE, f"{rel(c.bystander)}/module.so"))
    return f"{c.v}/module.so", "hardlink", True


def _char_device(c):
    c.members.append(special(f"{c.v}/null", tarfile.CHRTYPE))
    return f"{c.v}/null", "character device", True


def _block_device(c):
    c.members.append(special(f"{c.v}/sda", tarfile.BLKTYPE))
    return f"{c.v}/sda", "block device", True


def _fifo(c):
    c.members.append(special(f"{c.v}/pipe", tarfile.FIFOTYPE))
    return f"{c.v}/pipe", "fifo", True


def _duplicate(c):
    c.members.append(reg(f"{c.v}/module.so", b"\x7fELF a second, different module"))
    return f"{c.v}/module.so", "duplicate member name", True


def _not_in_index(c):
    c.members.append(reg(f"{c.v}/extra.sh", b"#!/bin/sh\nrm -rf /\n"))
    return f"{c.v}/extra.sh", "not listed in index.json", True


def _stray_top_level(c):
    c.members.append(reg("README", b"hello"))
    return "README", "not listed in index.json", False


def _missing_index(c):
    c.with_index = False
    return artifact.ARCHIVE, "no index.json", True


def _duplicate_index(c):
    c.members.append(index_member(c.records))
    return artifact.INDEX, "duplicate member name", True


def _hash_mismatch(c):
    so = c.records[1]["files"]["module.so"]
    so["sha256"] = hashlib.sha256(b"what the packer hashed").hexdigest()
    return c.v, "sha256 mismatch for module.so", True


def _size_mismatch(c):
    c.records[1]["files"]["kernels.cu"]["size"] += 1
    return f"{c.v}/kernels.cu", "size mismatch", True


def _listed_but_absent(c):
    c.members = [m for m in c.members if m[0].name != f"{c.v}/binding.cpp"]
    return c.v, "binding.cpp listed in index.json but not in the archive", True


def _index_path_traversal(c):
    evil = f"../../outside/{c.v.split('/', 1)[1]}"
    c.records[1]["path"] = evil
    c.members = [reg(m[0].name.replace(c.v, evil), m[1]) if m[0].name.startswith(c.v) else m for m in c.members]
    return evil, "unsafe entry path in index.json", True


def _wrong_schema(c):
    return c.v, "cache schema 'v0'", True  # the victim is built as a v0 entry (see VICTIM)


def _wrong_abi(c):
    return c.v, "binding ABI 'torch-stable-2.9'", True


def _index_lies_about_schema(c):
    c.records[1]["schema"] = keys.CACHE_SCHEMA  # the manifest inside still says v0
    return c.v, "cache schema 'v0'", True


def _tampered_manifest(c):
    m = json.loads((c.victim / cache.MANIFEST).read_text())
    m["components"]["cuda_flags"].append("-DEVIL")  # the key no longer hashes the components
    data = json.dumps(m).encode()
    c.replace(f"{c.v}/manifest.json", reg(f"{c.v}/manifest.json", data))
    c.records[1]["files"]["manifest.json"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    return c.v, "manifest key is not the hash of its components", True


CASES = {
    "traversal ../evil": _traversal_top,
    "traversal inside an entry": _traversal_in_entry,
    "absolute /tmp path": _absolute,
    "symlink member": _symlink,
    "symlink at the entry directory": _symlink_dir,
    "hardlink member": _hardlink,
    "character device": _char_device,
    "block device": _block_device,
    "fifo": _fifo,
    "duplicate member name": _duplicate,
    "member not in index": _not_in_index,
    "stray top-level member": _stray_top_level,
    "missing index.json": _missing_index,
    "duplicate index.json": _duplicate_index,
    "sha256 mismatch": _hash_mismatch,
    "size mismatch": _size_mismatch,
    "listed file absent": _listed_but_absent,
    "index path traversal": _index_path_traversal,
    "wrong schema": _wrong_schema,
    "wrong abi": _wrong_abi,
    "index lies about schema": _index_lies_about_schema,
    "tampered manifest": _tampered_manifest,
}
# How the victim entry is built for cases that need an odd one.
VICTIM = {
    "wrong schema": dict(schema="v0", schema_dir="v0"),
    "wrong abi": dict(abi="torch-stable-2.9"),
    "index lies about schema": dict(schema="v0"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_archive_is_rejected_with_its_reason_and_writes_nothing_outside(tmp_path, case):
    build = tmp_path / "build"
    bystander = make_entry(build, SPEC_A)
    victim = make_entry(build, SPEC_B, **VICTIM.get(case, {}))
    c = Case(victim, bystander, tmp_path)
    item, reason, victim_rejected = CASES[case](c)
    members = ([index_member(c.records)] if c.with_index else []) + c.members
    archive = write_tar(tmp_path / "hostile.tar", members)
    target = tmp_path / "target"
    assert not Path(EVIL_ABS).exists()
    before = snapshot(tmp_path)

    report = artifact.unpack(archive, target)

    assert reason in rejection(report, item)
    assert not report.ok
    accepted = [a.path for a in report.accepted]
    if case in ("missing index.json", "duplicate index.json"):
        assert accepted == []
    else:
        assert rel(bystander) in accepted  # one bad entry does not spoil the others
    if victim_rejected:
        assert c.v not in accepted
        assert not (target / c.v).exists() and not (target / rel(victim)).exists()
    # The target holds exactly the accepted entries: no partial entry, no staging litter.
    assert tree(target) == entry_tree(target, accepted)
    assert artifact.verify_tree(target) == []
    # Nothing outside the target was created or changed.
    assert snapshot(tmp_path, exclude=target) == before
    assert not Path(EVIL_ABS).exists()
    assert not (tmp_path / "evil").exists() and not (tmp_path.parent / "evil").exists()


def test_oversized_member_is_rejected_under_a_configured_limit(tmp_path):
    build = tmp_path / "build"
    small = make_entry(build, SPEC_A, payload=b"\x7fELF small")
    big = make_entry(build, SPEC_B, payload=b"\x7fELF" + bytes(64 * 1024))
    artifact.pack(build, tmp_path / "c.tar")
    target = tmp_path / "target"
    report = artifact.unpack(tmp_path / "c.tar", target, max_member_bytes=16 * 1024)
    assert "oversized" in rejection(report, f"{rel(big)}/module.so")
    assert "oversized" in rejection(report, rel(big))
    assert [a.path for a in report.accepted] == [rel(small)]
    assert tree(target) == entry_tree(target, [rel(small)])
    # The default limit takes it.
    assert artifact.unpack(tmp_path / "c.tar", tmp_path / "t2").ok


def test_rejection_of_a_staged_entry_leaves_existing_staging_work_alone(tmp_path):
    build = tmp_path / "build"
    victim = make_entry(build, SPEC_B)
    records = [record_of(victim)]
    records[0]["files"]["module.so"]["sha256"] = "0" * 64
    archive = write_tar(tmp_path / "h.tar", [index_member(records)] + entry_members(victim))
    target = tmp_path / "target"
    someone_elses_build = cache.new_staging_dir(target)  # a concurrent build in the same root
    (someone_elses_build / "kernels.cu").write_text("// building\n")
    report = artifact.unpack(archive, target)
    assert "sha256 mismatch" in rejection(report, rel(victim))
    assert tree(target) == {cache.STAGING, f"{cache.STAGING}/{someone_elses_build.name}",
                            f"{cache.STAGING}/{someone_elses_build.name}/kernels.cu"}


# ----------------------------------------------------------------------------- command line


def run_cli(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def cli_root(source, monkeypatch):
    root, entries = source
    monkeypatch.setenv("JITATTN_CACHE_DIR", str(root))
    monkeypatch.delenv("JITATTN_CACHE_SEED_DIRS", raising=False)
    return root, entries


def test_cli_pack_then_unpack_into_a_seed_dir_then_verify(cli_root, tmp_path, capsys, monkeypatch):
    root, entries = cli_root
    out = tmp_path / "jitattn-cache.tar.gz"
    code, text, _ = run_cli(capsys, "cache", "pack", out)
    assert code == 0 and out.is_file()
    assert "packed 3 entries" in text and all(rel(e) in text for e in entries)
    seed = tmp_path / "opt" / "jitattn-seed"
    code, text, _ = run_cli(capsys, "cache", "unpack", out, "--into", seed)
    assert code == 0
    assert "3 accepted, 0 rejected" in text and text.count("accepted ") == 3
    monkeypatch.setenv("JITATTN_CACHE_DIR", str(seed))
    code, text, _ = run_cli(capsys, "cache", "verify")
    assert code == 0 and "verified 3 entries: 3 ok, 0 invalid" in text


def test_cli_unpack_defaults_to_the_writable_root(cli_root, tmp_path, capsys, monkeypatch):
    root, entries = cli_root
    run_cli(capsys, "cache", "pack", tmp_path / "c.tar")
    fresh = tmp_path / "fresh-root"
    monkeypatch.setenv("JITATTN_CACHE_DIR", str(fresh))
    code, text, _ = run_cli(capsys, "cache", "unpack", tmp_path / "c.tar")
    assert code == 0 and str(fresh) in text
    assert artifact.verify_tree(fresh) == [] and len(list(cache.entries(fresh))) == 3


def test_cli_pack_with_a_manifest_exits_1_when_a_spec_is_not_cached(cli_root, tmp_path, capsys):
    toml = tmp_path / "m.toml"
    toml.write_text('[[spec]]\nfamily = "decode"\nhead_dim = [128, 96]\n')
    code, text, _ = run_cli(capsys, "cache", "pack", tmp_path / "c.tar", "--manifest", toml)
    assert code == 1
    assert f"MISSING  {DecodeSpec(head_dim=96).name}" in text
    assert f"packed   {keys.CACHE_SCHEMA}/sm90/{SPEC_A.name}-" in text
    assert "packed 1 entries" in text and "1 missing" in text


def test_cli_pack_with_a_fully_cached_manifest_exits_0(cli_root, tmp_path, capsys):
    toml = tmp_path / "m.toml"
    toml.write_text('[[spec]]\nfamily = "decode"\nhead_dim = 64\ndtype_q = "bfloat16"\ngroup_size = 3\n')
    code, text, _ = run_cli(capsys, "cache", "pack", tmp_path / "c.tar", "--manifest", toml)
    assert code == 0 and "packed 1 entries" in text and SPEC_B.name in text


def test_cli_pack_exits_1_on_a_corrupt_entry_and_on_an_empty_root(cli_root, tmp_path, capsys, monkeypatch):
    root, entries = cli_root
    (entries[0] / cache.LIBRARY).write_bytes(b"garbage")
    code, text, _ = run_cli(capsys, "cache", "pack", tmp_path / "c.tar")
    assert code == 1 and f"REFUSED  {rel(entries[0])}: module.so size" in text
    monkeypatch.setenv("JITATTN_CACHE_DIR", str(tmp_path / "empty"))
    code, text, err = run_cli(capsys, "cache", "pack", tmp_path / "e.tar")
    assert code == 1 and "packed 0 entries" in text and "nothing to pack" in err


def test_cli_unpack_exits_1_and_names_each_rejection(cli_root, tmp_path, capsys):
    root, entries = cli_root
    victim = entries[0]
    members = [index_member([record_of(victim)])] + entry_members(victim)
    members.append(special(f"{rel(victim)}/link", tarfile.SYMTYPE, "/etc/shadow"))
    archive = write_tar(tmp_path / "hostile.tar", members)
    code, text, _ = run_cli(capsys, "cache", "unpack", archive, "--into", tmp_path / "seed")
    assert code == 1
    assert f"REJECTED {rel(victim)}/link: symlink" in text
    assert f"REJECTED {rel(victim)}: member {rel(victim)}/link rejected" in text
    assert "0 accepted, 1 rejected" not in text and "0 accepted, 2 rejected" in text
    assert tree(tmp_path / "seed") == set()


def test_cli_unpack_arch_filter_and_missing_archive(cli_root, tmp_path, capsys):
    run_cli(capsys, "cache", "pack", tmp_path / "c.tar")
    code, text, _ = run_cli(capsys, "cache", "unpack", tmp_path / "c.tar", "--into", tmp_path / "s", "--arch", "8.0")
    assert code == 1 and "built for archs ['9.0']" in text
    code, _, err = run_cli(capsys, "cache", "unpack", tmp_path / "absent.tar", "--into", tmp_path / "s")
    assert code == 2 and "no archive" in err
