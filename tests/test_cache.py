"""CPU tests: cache entries (publish, verify, corruption, litter) and strict-mode lookup (no compiles).

Entries here are fakes: a few bytes as module.so, a manifest written by `cache.write_manifest`,
published by `cache.publish`, exactly as a real build publishes them.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from jitattn.errors import MissingSpecializationError
from jitattn.jit import cache, keys, loader, render
from jitattn.decode.spec import DecodeSpec
from tests.corruptions import CORRUPTIONS, _flip_byte, _manifest_of_another_key

NAME = "decode_f16_kvf16_d128_posnone_cap0_g1"
SCHEMA = keys.CACHE_SCHEMA


def make_key(seed: str) -> str:
    return hashlib.sha256(seed.encode()).hexdigest()


def stage(root: Path, key: str, payload: bytes = b"\x7fELF fake module", name: str = NAME,
          components: dict | None = None) -> Path:
    """A finished staging dir: library, a source file, and the manifest written last."""
    staging = cache.new_staging_dir(root)
    (staging / cache.LIBRARY).write_bytes(payload)
    (staging / "kernels.cu").write_text("// generated source\n")
    cache.write_manifest(staging, {"key": key, "name": name, "op_namespace": f"jitattn_{name}",
                                   "components": components or {}})
    return staging


def publish_entry(root: Path, key: str, payload: bytes = b"\x7fELF fake module", name: str = NAME,
                  arch_tag: str = "sm90", components: dict | None = None) -> Path:
    staging = stage(root, key, payload, name, components)
    return cache.publish(staging, cache.entry_path(root, SCHEMA, arch_tag, name, key))


def staging_items(root: Path) -> list[Path]:
    base = root / cache.STAGING
    return sorted(base.iterdir()) if base.is_dir() else []


# ----------------------------------------------------------------------------- publish / read


def test_published_entry_reads_back_with_its_key(tmp_path):
    key = make_key("a")
    payload = b"\x7fELF" + bytes(range(256)) * 4
    staging = stage(tmp_path, key, payload)
    path = cache.publish(staging, cache.entry_path(tmp_path, SCHEMA, "sm90", NAME, key))
    assert path == tmp_path / SCHEMA / "sm90" / f"{NAME}-{key[:16]}"
    assert not staging.exists()  # moved, not copied
    entry = cache.read_entry(path, key)
    assert entry is not None
    assert entry.key == key and entry.path == path
    assert entry.library == path / cache.LIBRARY and entry.library.read_bytes() == payload
    assert entry.manifest["library"] == {"sha256": hashlib.sha256(payload).hexdigest(), "size": len(payload)}
    assert entry.manifest["name"] == NAME
    assert (path / "kernels.cu").is_file()  # the generated sources travel with the entry
    assert cache.why_invalid(path) is None
    assert cache.read_entry(path) == entry  # without a key: same verified entry


def test_write_manifest_leaves_no_temporary_file(tmp_path):
    staging = stage(tmp_path, make_key("a"))
    assert sorted(p.name for p in staging.iterdir()) == ["kernels.cu", cache.MANIFEST, cache.LIBRARY]
    assert json.loads((staging / cache.MANIFEST).read_text())["key"] == make_key("a")


def test_reading_with_another_key_is_a_miss(tmp_path):
    path = publish_entry(tmp_path, make_key("a"))
    assert cache.read_entry(path, make_key("b")) is None
    assert cache.read_entry(path, make_key("a")) is not None


def test_an_absent_entry_is_a_miss(tmp_path):
    path = cache.entry_path(tmp_path, SCHEMA, "sm90", NAME, make_key("a"))
    assert cache.read_entry(path) is None
    assert cache.read_entry(path, make_key("a")) is None
    assert "no manifest" in cache.why_invalid(path)




@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_a_corrupt_entry_reads_as_a_miss_with_a_reason(tmp_path, case):
    corrupt, reason = CORRUPTIONS[case]
    key, other_key = make_key("a"), make_key("b")
    payload = b"\x7fELF same bytes in both entries" * 8  # only the corruption can make it fail
    path = publish_entry(tmp_path, key, payload)
    other = publish_entry(tmp_path, other_key, payload)
    assert cache.read_entry(path, key) is not None
    corrupt(path, other)
    assert cache.read_entry(path, key) is None
    why = cache.why_invalid(path)
    assert why is not None and reason in why
    assert cache.read_entry(other, other_key) is not None  # the other entry is untouched


def test_a_manifest_of_another_key_does_not_verify_even_without_a_key(tmp_path):
    payload = b"\x7fELF same bytes in both entries"
    path = publish_entry(tmp_path, make_key("a"), payload)
    other = publish_entry(tmp_path, make_key("b"), payload)
    _manifest_of_another_key(path, other)
    assert cache.why_invalid(path) is not None
    assert cache.read_entry(path) is None


# ----------------------------------------------------------------------------- verified stamps


@pytest.fixture
def hashes(monkeypatch):
    """How many times read_entry hashed a library."""
    calls = []
    real = cache.file_digest
    monkeypatch.setattr(cache, "file_digest", lambda path: calls.append(path) or real(path))
    return calls


def test_a_full_hash_stamps_the_library_and_the_next_read_trusts_the_stamp(tmp_path, hashes):
    path = publish_entry(tmp_path, make_key("s"))
    hashes.clear()  # write_manifest's own hash
    stamps = tmp_path / cache.STAMPS
    first = cache.read_entry(path, stamps=stamps)
    assert first is not None and len(hashes) == 1
    assert len(list(stamps.iterdir())) == 1
    assert cache.read_entry(path, stamps=stamps) == first and len(hashes) == 1  # no second hash
    assert cache.read_entry(path) == first and len(hashes) == 2  # without stamps: always a hash


@pytest.mark.parametrize("change", ["same-size-bytes-mtime-restored", "replaced-same-bytes", "truncated"])
def test_a_changed_library_is_hashed_again_and_a_corrupt_one_never_loads(tmp_path, hashes, change):
    import os

    path = publish_entry(tmp_path, make_key("c"), payload=b"\x7fELF" + bytes(range(200)))
    stamps = tmp_path / cache.STAMPS
    assert cache.read_entry(path, stamps=stamps) is not None
    so = path / cache.LIBRARY
    before = so.stat()
    data = so.read_bytes()
    if change == "same-size-bytes-mtime-restored":  # in place, then the old mtime put back
        so.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
        os.utime(so, ns=(before.st_atime_ns, before.st_mtime_ns))
    elif change == "replaced-same-bytes":  # a new file (inode) with the same bytes: still valid
        tmp = so.with_name("new.so")
        tmp.write_bytes(data)
        os.replace(tmp, so)
    else:
        so.write_bytes(data[:10])
    hashed = len(hashes)
    entry = cache.read_entry(path, stamps=stamps)
    if change == "replaced-same-bytes":
        assert entry is not None and len(hashes) == hashed + 1  # hashed again, then stamped anew
        assert cache.read_entry(path, stamps=stamps) is not None and len(hashes) == hashed + 1
    else:
        assert entry is None
        assert change == "truncated" or len(hashes) == hashed + 1  # the stamp did not vouch for it


def test_a_stamp_for_another_hash_or_path_vouches_for_nothing(tmp_path, hashes):
    path = publish_entry(tmp_path, make_key("f"))
    stamps = tmp_path / cache.STAMPS
    assert cache.read_entry(path, stamps=stamps) is not None
    (stamp,) = stamps.iterdir()
    record = json.loads(stamp.read_text())
    for forged in ({**record, "sha256": "0" * 64}, {**record, "path": "/elsewhere/module.so"}, "not json"):
        stamp.write_text(forged if isinstance(forged, str) else json.dumps(forged))
        hashed = len(hashes)
        assert cache.read_entry(path, stamps=stamps) is not None and len(hashes) == hashed + 1


def test_a_read_only_stamp_dir_only_costs_a_hash(tmp_path, hashes):
    path = publish_entry(tmp_path, make_key("r"))
    hashes.clear()
    stamps = tmp_path / "not-a-dir"
    stamps.write_text("")  # stamps cannot be written below a file
    for _ in range(2):
        assert cache.read_entry(path, stamps=stamps) is not None
    assert len(hashes) == 2


def test_stamps_are_not_entries(tmp_path):
    path = publish_entry(tmp_path, make_key("e"))
    cache.read_entry(path, stamps=tmp_path / cache.STAMPS)
    assert list(cache.entries(tmp_path)) == [path]


# ----------------------------------------------------------------------------- publish races


def test_publish_keeps_the_first_valid_entry_and_drops_the_loser(tmp_path):
    key = make_key("a")
    first = publish_entry(tmp_path, key, b"\x7fELF first build")
    loser = stage(tmp_path, key, b"\x7fELF second build, other bytes")
    assert cache.publish(loser, cache.entry_path(tmp_path, SCHEMA, "sm90", NAME, key)) == first
    assert not loser.exists()
    entry = cache.read_entry(first, key)
    assert entry is not None and entry.library.read_bytes() == b"\x7fELF first build"
    assert staging_items(tmp_path) == []  # no litter either


@pytest.mark.parametrize("case", ["truncated module.so", "missing manifest", "malformed manifest JSON"])
def test_publish_replaces_a_corrupt_entry_and_removes_the_old_one(tmp_path, case):
    corrupt, _ = CORRUPTIONS[case]
    key = make_key("a")
    path = publish_entry(tmp_path, key, b"\x7fELF old build")
    corrupt(path, None)
    fresh = stage(tmp_path, key, b"\x7fELF new build")
    assert cache.publish(fresh, path) == path
    entry = cache.read_entry(path, key)
    assert entry is not None and entry.library.read_bytes() == b"\x7fELF new build"
    assert staging_items(tmp_path) == []  # the old entry is gone, not left as litter
    assert cache.read_entry(path, key) is not None


def test_publish_replaces_an_entry_holding_another_keys_manifest(tmp_path):
    payload = b"\x7fELF same bytes in both entries"
    key = make_key("a")
    path = publish_entry(tmp_path, key, payload)
    other = publish_entry(tmp_path, make_key("b"), payload)
    _manifest_of_another_key(path, other)
    fresh = stage(tmp_path, key, b"\x7fELF rebuilt")
    cache.publish(fresh, path)
    entry = cache.read_entry(path, key)
    assert entry is not None and entry.library.read_bytes() == b"\x7fELF rebuilt"


# ----------------------------------------------------------------------------- killed builds, listing


def staging_of_a_dead_build(root: Path) -> Path:
    """A staging dir made by a build process that has since exited (no manifest, no publish)."""
    made = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; from jitattn.jit import cache; "
                           "print(cache.new_staging_dir(Path(sys.argv[1])))", str(root)],
                          capture_output=True, text=True, check=True, cwd=str(Path(__file__).resolve().parent.parent))
    return Path(made.stdout.strip())


def test_killed_build_leaves_no_entry_and_prune_removes_it(tmp_path):
    key = make_key("a")
    staging = staging_of_a_dead_build(tmp_path)
    (staging / cache.LIBRARY).write_bytes(b"\x7fELF half written")
    (staging / "kernels.cu").write_text("// never finished\n")
    assert staging.parent == tmp_path / cache.STAGING
    assert list(cache.entries(tmp_path)) == []
    assert cache.siblings(tmp_path, SCHEMA, "sm90", NAME) == []
    assert cache.read_entry(cache.entry_path(tmp_path, SCHEMA, "sm90", NAME, key), key) is None
    assert cache.read_entry(staging) is None and "no manifest" in cache.why_invalid(staging)
    assert cache.prune_staging(tmp_path, 3600) == []  # too fresh for the default bound
    assert staging.exists()
    assert cache.prune_staging(tmp_path, 0) == [staging]
    assert not staging.exists()


def test_staging_dirs_are_private_per_build(tmp_path):
    a, b = cache.new_staging_dir(tmp_path), cache.new_staging_dir(tmp_path)
    assert a != b and a.is_dir() and b.is_dir()
    assert a.parent == b.parent == tmp_path / cache.STAGING


def test_prune_staging_on_a_root_without_litter(tmp_path):
    assert cache.prune_staging(tmp_path / "nothing-here", 0) == []
    publish_entry(tmp_path, make_key("a"))
    assert cache.prune_staging(tmp_path, 0) == []
    assert len(list(cache.entries(tmp_path))) == 1


def test_entries_lists_entry_dirs_and_nothing_else(tmp_path):
    a1 = publish_entry(tmp_path, make_key("a1"))
    a2 = publish_entry(tmp_path, make_key("a2"), payload=b"other")
    b = publish_entry(tmp_path, make_key("b"), name="decode_bf16_kvbf16_d64_posnone_cap0_g2")
    c = publish_entry(tmp_path, make_key("c"), arch_tag="sm80+sm90")
    cache.new_staging_dir(tmp_path)  # litter
    (tmp_path / cache.LOCKS).mkdir()
    (tmp_path / cache.LOCKS / "abc.lock").write_text("")
    (tmp_path / "toolchains.json").write_text("{}")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "x.log").write_text("error: ...")
    listed = list(cache.entries(tmp_path))
    assert sorted(listed) == sorted([a1, a2, b, c])
    assert sorted(cache.entries(tmp_path, SCHEMA)) == sorted([a1, a2, b, c])
    assert list(cache.entries(tmp_path, "v0")) == []
    assert list(cache.entries(tmp_path / "absent")) == []


def test_siblings_are_the_entries_of_one_name_and_arch(tmp_path):
    a1 = publish_entry(tmp_path, make_key("a1"))
    a2 = publish_entry(tmp_path, make_key("a2"), payload=b"other")
    publish_entry(tmp_path, make_key("b"), name=NAME.replace("_g1", "_g2"))
    publish_entry(tmp_path, make_key("c"), arch_tag="sm80")
    assert cache.siblings(tmp_path, SCHEMA, "sm90", NAME) == sorted([a1, a2])
    assert cache.siblings(tmp_path, SCHEMA, "sm90a", NAME) == []
    assert cache.siblings(tmp_path, "v0", "sm90", NAME) == []
    # A name that is a prefix of another is not its sibling.
    assert cache.siblings(tmp_path, SCHEMA, "sm90", NAME[:-1]) == []


# ----------------------------------------------------------------------------- strict mode (loader)

SPEC = DecodeSpec(head_dim=128)


@pytest.fixture
def strict(cache_root, monkeypatch):
    """JITATTN_DISABLE_JIT=1, archs 9.0, an empty module memo, and no real .so loading."""
    monkeypatch.setenv("JITATTN_DISABLE_JIT", "1")
    monkeypatch.setenv("JITATTN_CUDA_ARCH_LIST", "9.0")
    loads = []

    def fake_load(spec, entry):
        loads.append((spec, entry))
        return ("sentinel module", entry.path)

    monkeypatch.setattr(loader, "load_entry", fake_load)
    with loader.forget_loaded(namespaces=True):  # nothing real loads: load_entry is the stand-in
        yield cache_root, loads


def fake_components(of_spec, nvcc="13.0.88", host_cxx="gcc 12.2.0", **override):
    parts = keys.components(of_spec, keys.BuildTarget(of_spec.archs_for(("9.0",)), nvcc, host_cxx))
    parts.update(override)
    return parts


def publish_fake(root: Path, spec, parts: dict, payload: bytes = b"\x7fELF fake") -> Path:
    key = keys.key_of(parts)
    return publish_entry(root, key, payload, name=spec.name, arch_tag="sm90", components=parts)


def test_strict_miss_on_an_empty_cache_names_the_spec(strict):
    root, loads = strict
    before = loader.COMPILE_COUNT
    with pytest.raises(MissingSpecializationError) as info:
        loader.get_module(SPEC)
    msg = str(info.value)
    assert SPEC.name in msg
    assert "JITATTN_DISABLE_JIT=1" in msg
    assert "no entry of this name exists" in msg
    assert "prewarm" in msg
    assert str(root / SCHEMA / "sm90") in msg  # where it looked
    assert loads == [] and loader.COMPILE_COUNT == before
    assert list(cache.entries(root)) == []
    assert not (root / cache.LOCKS).exists() and not (root / cache.STAGING).exists()
    assert SPEC not in loader._modules


def test_strict_miss_names_the_nearest_entry_and_the_differing_component(strict):
    root, loads = strict
    other_digest = "0" * 64
    path = publish_fake(root, SPEC, fake_components(SPEC, templates=other_digest))
    with pytest.raises(MissingSpecializationError) as info:
        loader.get_module(SPEC)
    msg = str(info.value)
    assert SPEC.name in msg
    assert str(path) in msg
    assert "differs in: templates" in msg
    assert other_digest in msg  # the cached value
    assert render.spec_template_digest(SPEC) in msg  # the wanted value
    assert "no entry of this name exists" not in msg
    assert loads == []


def test_strict_miss_reports_a_corrupt_nearest_entry(strict):
    root, loads = strict
    path = publish_fake(root, SPEC, fake_components(SPEC))
    _flip_byte(path, None)
    with pytest.raises(MissingSpecializationError) as info:
        loader.get_module(SPEC)
    msg = str(info.value)
    assert str(path) in msg and "does not verify" in msg and "sha256" in msg
    assert loads == []


def test_strict_mode_accepts_an_entry_built_by_another_toolchain(strict):
    root, loads = strict
    path = publish_fake(root, SPEC, fake_components(SPEC, nvcc="12.4.131", host_cxx="clang 17.0.6"))
    module = loader.get_module(SPEC)
    assert module == ("sentinel module", path)
    assert len(loads) == 1
    spec, entry = loads[0]
    assert spec == SPEC and entry.path == path and entry.key == keys.key_of(entry.components)
    # The second call is the in-process memo: no new lookup, no new load.
    assert loader.get_module(SPEC) is module
    assert len(loads) == 1
    assert not (root / cache.LOCKS).exists()  # the warm path takes no lock


def test_forget_loaded_looks_each_spec_up_again_inside_the_block_and_remembers_after(strict):
    root, loads = strict
    path = publish_fake(root, SPEC, fake_components(SPEC))
    module = loader.get_module(SPEC)
    with loader.forget_loaded():
        assert SPEC not in loader._modules
        again = loader.get_module(SPEC)  # looked up and loaded again
        assert again == module and again is not module and len(loads) == 2
    assert loader.get_module(SPEC) is module and len(loads) == 2  # the memo from before the block
    assert module == ("sentinel module", path)


def test_strict_mode_does_not_accept_an_entry_for_another_spec_field(strict):
    root, loads = strict
    other = DecodeSpec(head_dim=128, soft_cap=True)
    # Same directory name as SPEC, but built for another spec: the manifest tells.
    parts = fake_components(SPEC, spec=other.to_dict())
    path = publish_fake(root, SPEC, parts)
    with pytest.raises(MissingSpecializationError) as info:
        loader.get_module(SPEC)
    assert str(path) in str(info.value) and "differs in: spec" in str(info.value)
    assert loads == []


def test_strict_mode_finds_an_entry_in_a_seed_dir(strict, tmp_path, monkeypatch):
    root, loads = strict
    seed = tmp_path / "seed"
    path = publish_fake(seed, SPEC, fake_components(SPEC, nvcc="12.8.93"))
    monkeypatch.setenv("JITATTN_CACHE_SEED_DIRS", str(seed))
    loader.get_module(SPEC)
    assert [entry.path for _, entry in loads] == [path]
    assert list(cache.entries(root)) == []  # nothing was copied into the writable root
