"""The fleet tier against a real redis-server, in this process: two or more cache roots stand for
nodes (switching roots and resetting the loader's memo stands for a new process on another
node), builds are fake compiles (tests/fake_compiler.py), Redis is real.

- publishing: a build is published signed, first writer wins, with the TTL and size knobs;
  `prewarm` publishes and pulls; `cache push` / `cache pull`.
- trust: unsigned, foreign-signed, tampered and inconsistent values are refused and named, and
  the call builds locally; JITATTN_REMOTE_CACHE_INSECURE=1 opts out (integrity still checked).
- faults: the server down, slow (SIGSTOPped), restarted or flushed mid-pull, a truncated,
  corrupted or foreign value, a full server: each ends in a local build (or strict mode's
  error) within the timeouts, logged once, never a corrupt load.
- strict mode pulls with no compiler; doctor, explain and the strict error name the remote.
The multi-process behaviour (one compile per fleet, kills, lock expiry) is in test_remote_fleet.py.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import shutil
import sys
import tarfile
import time
from pathlib import Path

import pytest

from jitattn import cli
from jitattn.errors import MissingSpecializationError, RemoteCacheError
from jitattn.jit import artifact, build, cache, env, keys, loader, remote, signing, toolchain
from jitattn.jit.remote import envelope
from jitattn.jit.remote.store import RedisStore
from jitattn.decode.spec import DecodeSpec
from tests import fake_compiler
from tests.fleet import OTHER_SECRET, SECRET, server  # noqa: F401  (server: a fixture)
from tests.procs import ARCH, ARCH_TAG

SPEC = DecodeSpec(head_dim=64, group_tile=2)
OTHER = DecodeSpec(head_dim=128, soft_cap=True)


class Fleet:
    """This test process as a node of a fleet: `use(name)` makes it a fresh process on node `name`."""

    def __init__(self, tmp_path: Path, monkeypatch, server):
        self.tmp, self.mp, self.server = tmp_path, monkeypatch, server
        self.log = tmp_path / "compiles.log"
        self.cuda = fake_compiler.make_cuda_home(tmp_path / "cuda")
        self.memos = contextlib.ExitStack()  # closed on exit: this process's memos come back

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, *exc) -> None:
        self.memos.close()

    def root(self, name: str) -> Path:
        return self.tmp / f"node-{name}"

    def use(self, name: str, **knobs: str) -> Path:
        mp = self.mp
        for knob in env.KNOBS:
            mp.delenv(knob, raising=False)
        mp.setenv("JITATTN_CACHE_DIR", str(self.root(name)))
        mp.setenv("JITATTN_CUDA_ARCH_LIST", ARCH)
        mp.setenv("JITATTN_REMOTE_CACHE", self.server.url)
        mp.setenv("JITATTN_REMOTE_CACHE_KEY", SECRET)
        mp.setenv("CUDA_HOME", str(self.cuda))
        mp.delenv("CUDA_PATH", raising=False)
        for knob, value in knobs.items():
            if value is None:
                mp.delenv(knob, raising=False)
            else:
                mp.setenv(knob, value)
        self.fresh_process()
        return self.root(name)

    def fresh_process(self) -> None:
        self.memos.enter_context(loader.forget_loaded(namespaces=True))
        remote.forget_tiers()
        toolchain._fingerprint.cache_clear()

    def key(self, spec) -> str:
        return keys.key_of(keys.components(spec, loader.current_target(spec)))

    def value(self, spec) -> bytes | None:
        return self.server.client().get(remote.entry_name(self.key(spec)))

    def compiles(self) -> list[str]:
        return fake_compiler.compiles(self.log)


@pytest.fixture
def fleet(tmp_path, monkeypatch, server):
    fake_compiler.require_cc()
    monkeypatch.setenv("FAKE_COMPILE_LOG", str(tmp_path / "compiles.log"))
    monkeypatch.setenv("FAKE_COMPILE_SECONDS", "0")
    monkeypatch.setattr(build, "compile_library", fake_compiler.compile_library)
    with Fleet(tmp_path, monkeypatch, server) as f:
        yield f
    toolchain._fingerprint.cache_clear()


@pytest.fixture
def jlog(caplog):
    caplog.set_level(logging.INFO, logger="jitattn")
    return caplog


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "jitattn" and r.levelno >= logging.WARNING]


def counts():
    return loader.COMPILE_COUNT, loader.PULL_COUNT


def get(spec):
    """get_module, and how many compiles and pulls it took."""
    c0, p0 = counts()
    module = loader.get_module(spec)
    c1, p1 = counts()
    return module, c1 - c0, p1 - p0


def assert_right_library(module, spec, fleet):
    key = fleet.key(spec)
    assert module.entry.key == key
    assert cache.why_invalid(module.entry.path) is None
    assert fake_compiler.fake_id(module.entry.library) == f"jitattn_{key[:16]}"


def no_litter(root: Path) -> bool:
    staging = root / cache.STAGING
    return not staging.exists() or not any(staging.iterdir())


def build_on(fleet, name: str, spec, **knobs) -> Path:
    """Node `name` builds `spec` (with the remote unset unless knobs say otherwise); its entry."""
    fleet.use(name, **{"JITATTN_REMOTE_CACHE": None, **knobs})
    module, compiled, _ = get(spec)
    assert compiled == 1
    return module.entry.path


def store_value(fleet, spec, value) -> str:
    name = remote.entry_name(fleet.key(spec))
    fleet.server.client().set(name, value)
    return name


def signed_value(fleet, spec, entry_dir: Path, secret: str | None = SECRET) -> bytes:
    entry = cache.read_entry(entry_dir)
    sig = signing.sign_entry(secret.encode(), entry.key, entry_dir) if secret else None
    return envelope.pack(entry, "/".join(entry_dir.parts[-3:]), sig)


def rewrap(value: bytes, archive: bytes, **header_changes) -> bytes:
    """A value with another archive (and a header that matches it, as an attacker would write)."""
    header = envelope.header_of(value)
    header["archive"] = {"size": len(archive), "sha256": hashlib.sha256(archive).hexdigest()}
    header.update(header_changes)
    return envelope.MAGIC + json.dumps(header).encode() + b"\n" + archive


def archive_of(value: bytes) -> bytes:
    return value[value.index(b"\n", len(envelope.MAGIC)) + 1:]


# ----------------------------------------------------------------------------- publish and pull


def test_a_build_is_published_signed_and_another_node_pulls_it_instead_of_compiling(fleet, jlog):
    a = fleet.use("a")
    module, compiled, pulled = get(SPEC)
    assert (compiled, pulled) == (1, 0)
    value = fleet.value(SPEC)
    header = envelope.header_of(value)
    assert header["key"] == fleet.key(SPEC) and header["signature"]["key_id"] == signing.key_id(SECRET.encode())
    ttl = fleet.server.client().ttl(remote.entry_name(fleet.key(SPEC)))
    assert 2592000 - 60 < ttl <= 2592000  # the default TTL knob: 30 days

    b = fleet.use("b")
    module_b, compiled, pulled = get(SPEC)
    assert (compiled, pulled) == (0, 1)
    assert_right_library(module_b, SPEC, fleet)
    assert module_b.entry.path.parent.parent.parent == b  # materialized into b's own root
    files = lambda p: {f.name: f.read_bytes() for f in p.iterdir()}  # noqa: E731
    assert files(module_b.entry.path) == files(module.entry.path)
    assert no_litter(b) and len(fleet.compiles()) == 1
    assert any(f"pulled {keys.CACHE_SCHEMA}/{ARCH_TAG}/{SPEC.name}" in r.getMessage() for r in jlog.records)
    assert a != b


def test_a_process_whose_entries_are_local_never_contacts_the_server(fleet):
    fleet.use("a")
    get(SPEC)
    fleet.use("b")
    get(SPEC)  # pulled into b
    watcher = fleet.server.client()
    before = watcher.info("stats")["total_connections_received"]
    for node in ("a", "b"):
        fleet.use(node)  # a fresh process on each node
        module, compiled, pulled = get(SPEC)
        assert (compiled, pulled) == (0, 0)
        assert_right_library(module, SPEC, fleet)
    assert watcher.info("stats")["total_connections_received"] == before


def test_first_writer_wins_and_the_ttl_knob_is_applied(fleet):
    first = build_on(fleet, "a", SPEC)
    second = build_on(fleet, "b", SPEC)  # the same key, other bytes (its own build)
    assert (first / cache.MANIFEST).read_bytes() != (second / cache.MANIFEST).read_bytes()
    fleet.use("a", JITATTN_REMOTE_CACHE_TTL="0")
    tier = remote.tier()
    rel = "/".join(first.parts[-3:])
    assert tier.share(cache.read_entry(first), rel) == "published"
    assert tier.share(cache.read_entry(second), rel) == "present"
    assert tier.share(cache.read_entry(first), rel) == "present"
    assert fleet.value(SPEC) == signed_value(fleet, SPEC, first)
    assert fleet.server.client().ttl(remote.entry_name(fleet.key(SPEC))) == -1  # TTL 0: no expiry

    fleet.server.client().flushall()
    fleet.use("a", JITATTN_REMOTE_CACHE_TTL="120")
    assert remote.tier().share(cache.read_entry(second), rel) == "published"
    assert 110 < fleet.server.client().ttl(remote.entry_name(fleet.key(SPEC))) <= 120
    alias = fleet.server.client().smembers(remote.alias_name(cache.read_entry(second).components))
    assert alias == {fleet.key(SPEC).encode()}


def test_an_entry_over_the_size_bound_is_neither_published_nor_pulled(fleet, jlog):
    entry = build_on(fleet, "a", SPEC)
    value = signed_value(fleet, SPEC, entry)
    fleet.use("a", JITATTN_REMOTE_CACHE_MAX_MB=str(len(value) / 2**20 / 2))
    status = remote.tier().share(cache.read_entry(entry), "/".join(entry.parts[-3:]))
    assert status.startswith("not published") and "JITATTN_REMOTE_CACHE_MAX_MB" in status
    assert fleet.value(SPEC) is None

    store_value(fleet, SPEC, value)
    fleet.use("b", JITATTN_REMOTE_CACHE_MAX_MB=str(len(value) / 2**20 / 2))
    module, compiled, pulled = get(SPEC)
    assert (compiled, pulled) == (1, 0)
    assert any("oversized value" in w for w in warnings_of(jlog))


def test_prewarm_publishes_its_builds_and_pulls_what_the_fleet_has(fleet, capsys):
    fleet.use("a")
    assert cli.main(["prewarm", "--head-dim", "64", "--group-size", "2", "-j", "1"]) == 0
    out = capsys.readouterr().out
    assert "built 1, already cached 0, failed 0" in out
    assert envelope.header_of(fleet.value(SPEC))["signature"]
    fleet.use("b")
    assert cli.main(["prewarm", "--head-dim", "64", "--group-size", "2", "-j", "1"]) == 0
    out = capsys.readouterr().out
    assert "built 0, already cached 0, pulled from the fleet 1, failed 0" in out and " pulled " in out
    assert len(fleet.compiles()) == 1


def test_cache_push_and_pull_move_a_manifests_entries(fleet, tmp_path, capsys):
    for spec in (SPEC, OTHER):
        build_on(fleet, "a", spec)
    manifest = tmp_path / "m.toml"
    manifest.write_text('[[spec]]\nfamily = "decode"\nhead_dim = 64\ngroup_tile = 2\n\n'
                        '[[spec]]\nfamily = "decode"\nhead_dim = 128\nsoft_cap = true\n')
    fleet.use("a")
    assert cli.main(["cache", "push", "--manifest", str(manifest)]) == 0
    out = capsys.readouterr().out
    assert out.count("published ") == 2 and "pushed 2 entries" in out
    assert cli.main(["cache", "push"]) == 0
    out = capsys.readouterr().out
    assert "pushed 0 entries" in out and "2 already there" in out, out

    b = fleet.use("b", CUDA_HOME="/nonexistent")  # a serving node: no compiler at all
    assert cli.main(["cache", "pull", "--manifest", str(manifest)]) == 0
    out = capsys.readouterr().out
    assert "pulled 2 of 2 specs" in out, out
    assert sorted(p.name.rsplit("-", 1)[0] for p in cache.entries(b)) == sorted([SPEC.name, OTHER.name])
    assert all(cache.why_invalid(p) is None for p in cache.entries(b))
    assert cli.main(["cache", "pull", "--manifest", str(manifest)]) == 0
    assert "2 already local" in capsys.readouterr().out

    missing = tmp_path / "missing.toml"
    missing.write_text('[[spec]]\nfamily = "decode"\nhead_dim = 96\n')
    assert cli.main(["cache", "pull", "--manifest", str(missing)]) == 1
    assert "MISSING  decode_f16_kvf16_d96" in capsys.readouterr().out
    assert cli.main(["cache", "push", "--manifest", str(missing)]) == 1
    assert "MISSING" in capsys.readouterr().out


def test_push_and_pull_without_a_remote_say_how_to_set_one(fleet, tmp_path, capsys):
    fleet.use("a", JITATTN_REMOTE_CACHE=None)
    assert cli.main(["cache", "push"]) == 2
    assert "JITATTN_REMOTE_CACHE=redis://" in capsys.readouterr().err


# ----------------------------------------------------------------------------- trust


def test_unsigned_and_foreign_signed_entries_are_refused_named_and_built_locally(fleet, jlog):
    entry = build_on(fleet, "a", SPEC)
    for i, (secret, phrase) in enumerate(((None, "unsigned"), (OTHER_SECRET, "signed with another key"))):
        node = fleet.use(f"b{i}")
        name = store_value(fleet, SPEC, signed_value(fleet, SPEC, entry, secret))
        module, compiled, pulled = get(SPEC)
        assert (compiled, pulled) == (1, 0)
        assert_right_library(module, SPEC, fleet)
        refusals = [w for w in warnings_of(jlog) if phrase in w and name in w]
        assert refusals, warnings_of(jlog)
        assert "JITATTN_REMOTE_CACHE_INSECURE=1" in refusals[0]
        if secret:
            assert f"key id {signing.key_id(OTHER_SECRET.encode())}" in refusals[0]
        assert no_litter(node)


def test_a_refused_value_is_replaced_by_the_next_build_so_the_fleet_heals(fleet, jlog):
    entry = build_on(fleet, "a", SPEC)
    name = store_value(fleet, SPEC, signed_value(fleet, SPEC, entry, secret=None))  # unsigned
    fleet.use("b")
    get(SPEC)  # refuses it, builds, publishes over it
    assert any(f": replaced {keys.CACHE_SCHEMA}/{ARCH_TAG}/{SPEC.name}" in r.getMessage() for r in jlog.records)
    assert envelope.header_of(fleet.server.client().get(name))["signature"]["key_id"] == signing.key_id(SECRET.encode())
    fleet.use("c")
    module, compiled, pulled = get(SPEC)
    assert (compiled, pulled) == (0, 1)


def test_a_tampered_library_with_a_consistent_manifest_fails_the_signature(fleet, jlog, tmp_path):
    """An attacker without the secret rewrites module.so, its manifest hash and the archive index
    so that everything is self-consistent: only the signature can tell."""
    entry_dir = build_on(fleet, "a", SPEC)
    value = signed_value(fleet, SPEC, entry_dir)
    evil = tmp_path / "evil" / Path(*entry_dir.parts[-3:])
    shutil.copytree(entry_dir, evil)
    (evil / cache.LIBRARY).write_bytes((evil / cache.LIBRARY).read_bytes() + b"\0evil")
    manifest = json.loads((evil / cache.MANIFEST).read_text())
    manifest.pop("library")
    (evil / cache.MANIFEST).unlink()
    cache.write_manifest(evil, manifest)  # a valid manifest for the altered .so
    assert cache.read_entry(evil) is not None
    forged = envelope.pack(cache.read_entry(evil), "/".join(evil.parts[-3:]), envelope.header_of(value)["signature"])
    store_value(fleet, SPEC, forged)
    fleet.use("b")
    module, compiled, pulled = get(SPEC)
    assert (compiled, pulled) == (1, 0)
    assert not (module.entry.library.read_bytes()).endswith(b"\0evil")
    assert any("signature does not match the entry's contents" in w for w in warnings_of(jlog))

    fleet.use("c", JITATTN_REMOTE_CACHE_INSECURE="1")  # the opt-out loads it, and says so
    store_value(fleet, SPEC, forged)  # (b's build had replaced it with a good one)
    module, compiled, pulled = get(SPEC)
    assert (compiled, pulled) == (0, 1) and module.entry.library.read_bytes().endswith(b"\0evil")
    assert any("accepted because JITATTN_REMOTE_CACHE_INSECURE=1" in w for w in warnings_of(jlog))


def test_a_signed_entry_whose_key_is_not_the_hash_of_its_components_is_refused(fleet, jlog):
    """Even signed (a buggy or compromised node), an entry must be what its key says."""
    entry_dir = build_on(fleet, "a", SPEC)
    rel = "/".join(entry_dir.parts[-3:])
    files = {p.name: p.read_bytes() for p in entry_dir.iterdir()}
    manifest = json.loads(files[cache.MANIFEST])
    manifest["components"]["templates"] = "0" * 64  # other templates, same key claimed
    files[cache.MANIFEST] = json.dumps(manifest).encode()
    record = {"path": rel, "key": manifest["key"], "name": manifest["name"], "archs": manifest["components"]["archs"],
              "abi": manifest["components"]["abi"], "schema": keys.CACHE_SCHEMA,
              "files": {n: {"sha256": hashlib.sha256(d).hexdigest(), "size": len(d)} for n, d in files.items()}}
    index = {"format": artifact.FORMAT, "version": artifact.FORMAT_VERSION, "created": 0.0,
             "schema": keys.CACHE_SCHEMA, "entries": [record]}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in [(artifact.INDEX, json.dumps(index).encode())] + [(f"{rel}/{n}", d) for n, d in files.items()]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    staged = fleet.tmp / "forged" / rel
    staged.mkdir(parents=True)
    for n, d in files.items():
        (staged / n).write_bytes(d)
    sig = signing.sign_entry(SECRET.encode(), manifest["key"], staged)
    store_value(fleet, SPEC, rewrap(signed_value(fleet, SPEC, entry_dir), buf.getvalue(), signature=sig))
    fleet.use("b")
    module, compiled, pulled = get(SPEC)
    assert (compiled, pulled) == (1, 0)
    assert any("key is not the hash of its components" in w for w in warnings_of(jlog)), warnings_of(jlog)
    assert_right_library(module, SPEC, fleet)


def test_without_a_secret_the_remote_is_refused_unless_insecure_is_chosen(fleet):
    fleet.use("a", JITATTN_REMOTE_CACHE_KEY=None)
    with pytest.raises(RemoteCacheError, match="JITATTN_REMOTE_CACHE_KEY or JITATTN_REMOTE_CACHE_KEY_FILE"):
        loader.get_module(SPEC)
    fleet.use("a", JITATTN_REMOTE_CACHE_KEY=None, JITATTN_REMOTE_CACHE_INSECURE="1")
    _, compiled, _ = get(SPEC)
    assert compiled == 1 and envelope.header_of(fleet.value(SPEC))["signature"] is None
    fleet.use("b", JITATTN_REMOTE_CACHE_KEY=None, JITATTN_REMOTE_CACHE_INSECURE="1")
    assert get(SPEC)[1:] == (0, 1)


def test_the_secret_can_come_from_a_key_file_and_must_not_be_short(fleet, tmp_path):
    key_file = tmp_path / "fleet.key"
    key_file.write_text(SECRET + "\n")
    fleet.use("a", JITATTN_REMOTE_CACHE_KEY=None, JITATTN_REMOTE_CACHE_KEY_FILE=str(key_file))
    get(SPEC)
    assert envelope.header_of(fleet.value(SPEC))["signature"]["key_id"] == signing.key_id(SECRET.encode())
    fleet.use("b")  # the same secret through JITATTN_REMOTE_CACHE_KEY: verifies
    assert get(SPEC)[1:] == (0, 1)
    fleet.use("c", JITATTN_REMOTE_CACHE_KEY="short")
    with pytest.raises(RemoteCacheError, match="at least 16"):
        loader.get_module(SPEC)
    fleet.use("c", JITATTN_REMOTE_CACHE_KEY=None, JITATTN_REMOTE_CACHE_KEY_FILE=str(tmp_path / "absent"))
    with pytest.raises(RemoteCacheError, match="cannot read"):
        loader.get_module(SPEC)


def test_a_missing_redis_client_names_the_extra(fleet, monkeypatch):
    fleet.use("a")
    monkeypatch.setitem(sys.modules, "redis", None)  # `import redis` now raises ImportError
    with pytest.raises(RemoteCacheError, match=r"pip install 'jitattn\[redis\]'"):
        loader.get_module(SPEC)


def test_a_bad_url_is_a_clear_error(fleet):
    fleet.use("a", JITATTN_REMOTE_CACHE="http://127.0.0.1:1/0")
    with pytest.raises(RemoteCacheError, match=r"redis://\[:password@\]host:port/db"):
        loader.get_module(SPEC)


# ----------------------------------------------------------------------------- faults


def _timed_get(spec):
    t0 = time.monotonic()
    result = get(spec)
    return result, time.monotonic() - t0


def test_server_down_builds_locally_logs_once_and_stops_asking(fleet, jlog):
    fleet.use("a")
    fleet.server.kill()
    (module, compiled, pulled), seconds = _timed_get(SPEC)
    assert (compiled, pulled) == (1, 0) and seconds < 5
    assert_right_library(module, SPEC, fleet)
    (_, compiled, _), seconds = _timed_get(OTHER)  # the tier is skipped for RETRY_AFTER_S: no new wait
    assert compiled == 1 and seconds < 1
    faults = warnings_of(jlog)
    assert len(faults) == 1 and "going on locally" in faults[0] and "ConnectionError" in faults[0], faults


def test_a_slow_server_costs_at_most_the_command_timeout(fleet, jlog):
    build_on(fleet, "a", SPEC)
    fleet.use("b", JITATTN_REMOTE_CACHE_TIMEOUT="0.5")
    fleet.server.pause()  # accepts connections, answers nothing
    try:
        (module, compiled, pulled), seconds = _timed_get(SPEC)
    finally:
        fleet.server.resume()
    assert (compiled, pulled) == (1, 0)
    assert seconds < 3, seconds  # one command timeout (0.5 s), not retried, then a local build
    assert "TimeoutError" in warnings_of(jlog)[0]


@pytest.mark.parametrize("event", ["restart", "flush"])
def test_restart_or_flush_between_finding_and_reading_the_value_builds_locally(fleet, jlog, monkeypatch, event):
    fleet.use("a")
    get(SPEC)
    fleet.use("b")
    real_get = RedisStore.get

    def get_after_event(self, name):  # the server really restarts (or is flushed) mid-pull
        if name.startswith(remote.entry_name("")) and not hasattr(get_after_event, "done"):
            get_after_event.done = True
            fleet.server.restart() if event == "restart" else fleet.server.client().flushall()
        return real_get(self, name)

    monkeypatch.setattr(RedisStore, "get", get_after_event)
    (module, compiled, pulled), seconds = _timed_get(SPEC)
    assert getattr(get_after_event, "done", False)
    assert (compiled, pulled) == (1, 0) and seconds < 10
    assert_right_library(module, SPEC, fleet)
    assert fleet.value(SPEC) is not None  # the local build was published to the new/flushed server
    assert not warnings_of(jlog)  # the value had gone: a miss, not a fault


def _truncated(value, fleet, spec):
    return value[: len(value) - 1000], "truncated value"


def _flipped(value, fleet, spec):
    data = bytearray(value)
    data[-500] ^= 0x20
    return bytes(data), "corrupt value: the archive's sha256 does not match its header"


def _garbage(value, fleet, spec):
    return b"hello, not an entry", "foreign value: not a jitattn entry"


def _other_key(value, fleet, spec):
    return value, "foreign value: it holds the entry of another key"


def _bad_archive(value, fleet, spec):
    return rewrap(value, b"\0" * 4096), "archive rejected"


VALUE_FAULTS = {"truncated": _truncated, "flipped byte": _flipped, "garbage": _garbage,
                "another key's entry": _other_key, "not a tar": _bad_archive}


@pytest.mark.parametrize("fault", sorted(VALUE_FAULTS))
def test_a_bad_value_under_our_key_is_refused_and_the_call_builds_locally(fleet, jlog, fault):
    source = OTHER if fault == "another key's entry" else SPEC
    entry = build_on(fleet, "a", source)
    value, phrase = VALUE_FAULTS[fault](signed_value(fleet, source, entry), fleet, SPEC)
    fleet.use("b")
    name = store_value(fleet, SPEC, value)
    root = fleet.root("b")
    module, compiled, pulled = get(SPEC)
    assert (compiled, pulled) == (1, 0)
    assert_right_library(module, SPEC, fleet)
    refusals = [w for w in warnings_of(jlog) if name in w]
    assert refusals and phrase in refusals[0], warnings_of(jlog)
    assert no_litter(root) and [p.name for p in cache.entries(root)] == [module.entry.path.name]


def test_a_value_of_another_redis_type_is_refused(fleet, jlog):
    fleet.use("a")
    name = remote.entry_name(fleet.key(SPEC))
    fleet.server.client().hset(name, "x", "y")
    module, compiled, pulled = get(SPEC)
    assert (compiled, pulled) == (1, 0)
    assert any("a Redis hash" in w for w in warnings_of(jlog))


def test_a_full_server_is_logged_once_and_the_build_goes_on(tmp_path, monkeypatch, jlog):
    from tests.redis_server import RedisServer, require_redis

    full = RedisServer(require_redis(), tmp_path / "full", maxmemory="2mb").start()
    try:
        client = full.client()
        with pytest.raises(Exception, match="maxmemory"):
            for i in range(10000):
                client.set(f"filler:{i}", b"x" * 4096)
        fake_compiler.require_cc()
        monkeypatch.setenv("FAKE_COMPILE_LOG", str(tmp_path / "compiles.log"))
        monkeypatch.setenv("FAKE_COMPILE_SECONDS", "0")
        monkeypatch.setattr(build, "compile_library", fake_compiler.compile_library)
        with Fleet(tmp_path, monkeypatch, full) as fleet:
            fleet.use("a")
            (module, compiled, pulled), seconds = _timed_get(SPEC)
            assert (compiled, pulled) == (1, 0) and seconds < 5
            assert_right_library(module, SPEC, fleet)
            faults = warnings_of(jlog)
            assert len(faults) == 1 and "OutOfMemoryError" in faults[0], faults
            assert fleet.value(SPEC) is None
    finally:
        full.stop()


def test_a_server_that_needs_a_password_refuses_a_wrong_one_as_a_fault(tmp_path, monkeypatch, jlog):
    from tests.redis_server import RedisServer, require_redis

    secured = RedisServer(require_redis(), tmp_path / "auth", password="s3cret-pass").start()
    try:
        fake_compiler.require_cc()
        monkeypatch.setenv("FAKE_COMPILE_SECONDS", "0")
        monkeypatch.setattr(build, "compile_library", fake_compiler.compile_library)
        with Fleet(tmp_path, monkeypatch, secured) as fleet:
            fleet.use("a")
            assert get(SPEC)[1:] == (1, 0)
            assert envelope.header_of(fleet.value(SPEC))["signature"]  # published with the password
            fleet.use("b", JITATTN_REMOTE_CACHE=secured.url.replace("s3cret-pass", "wrong"))
            assert get(SPEC)[1:] == (1, 0)
            faults = warnings_of(jlog)
            assert len(faults) == 1 and "s3cret-pass" not in faults[0] and "wrong" not in faults[0], faults
    finally:
        secured.stop()


def test_rediss_works_with_a_trusted_certificate_and_faults_without_one(tmp_path, monkeypatch, jlog):
    from tests.redis_server import RedisServer, require_redis

    secure = RedisServer(require_redis(), tmp_path / "tls", tls=True).start()
    try:
        fake_compiler.require_cc()
        monkeypatch.setenv("FAKE_COMPILE_SECONDS", "0")
        monkeypatch.setattr(build, "compile_library", fake_compiler.compile_library)
        with Fleet(tmp_path, monkeypatch, secure) as fleet:
            fleet.use("a")
            assert secure.url.startswith("rediss://")
            assert get(SPEC)[1:] == (1, 0)
            fleet.use("b")
            assert get(SPEC)[1:] == (0, 1)  # pulled over TLS
            fleet.use("c", JITATTN_REMOTE_CACHE=secure.url.split("?")[0])  # no CA: the certificate is not trusted
            assert get(SPEC)[1:] == (1, 0)
            faults = warnings_of(jlog)
            assert len(faults) == 1 and "CERTIFICATE_VERIFY_FAILED" in faults[0], faults
    finally:
        secure.stop()


# ----------------------------------------------------------------------------- strict mode


def test_strict_mode_without_a_compiler_pulls_what_another_node_built(fleet):
    fleet.use("a")
    get(SPEC)
    b = fleet.use("b", JITATTN_DISABLE_JIT="1", CUDA_HOME="/nonexistent")
    module, compiled, pulled = get(SPEC)
    assert (compiled, pulled) == (0, 1)
    assert module.entry.path.parent.parent.parent == b
    assert fake_compiler.fake_id(module.entry.library) == f"jitattn_{module.entry.key[:16]}"


def test_strict_mode_pulls_a_build_made_by_another_toolchain(fleet):
    fleet.use("a", CUDA_HOME=str(fake_compiler.make_cuda_home(fleet.tmp / "cuda-12", "12.8.93")))
    module_a, _, _ = get(SPEC)
    assert module_a.entry.components["nvcc"] == "12.8.93"
    fleet.use("b", JITATTN_DISABLE_JIT="1")  # this node's nvcc (13.0) would build another key
    module, compiled, pulled = get(SPEC)
    assert (compiled, pulled) == (0, 1) and module.entry.key == module_a.entry.key


@pytest.mark.parametrize("state", ["absent", "down"])
def test_strict_mode_miss_names_the_remote_and_what_it_said(fleet, state):
    fleet.use("b", JITATTN_DISABLE_JIT="1", CUDA_HOME="/nonexistent")
    if state == "down":
        fleet.server.kill()
    t0 = time.monotonic()
    with pytest.raises(MissingSpecializationError) as err:
        loader.get_module(SPEC)
    assert time.monotonic() - t0 < 5
    message = str(err.value)
    assert f"  remote: " in message
    if state == "absent":
        assert f"no build of {SPEC.name} for {ARCH_TAG} in {fleet.server.url}" in message
    else:
        assert "unreachable" in message and "ConnectionError" in message


def test_strict_mode_error_without_a_remote_says_so(fleet):
    fleet.use("b", JITATTN_DISABLE_JIT="1", JITATTN_REMOTE_CACHE=None)
    with pytest.raises(MissingSpecializationError, match="remote: none .JITATTN_REMOTE_CACHE is not set"):
        loader.get_module(SPEC)


# ----------------------------------------------------------------------------- doctor, explain


def test_doctor_shows_the_remote_tier_and_never_prints_secrets(fleet, capsys):
    fleet.use("a")
    get(SPEC)
    entry = build_on(fleet, "c", OTHER)
    fleet.use("a")
    store_value(fleet, OTHER, signed_value(fleet, OTHER, entry, secret=None))
    fleet.server.client().set(remote.entry_name("f" * 64), b"junk")
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    line = [l for l in out.splitlines() if l.startswith("remote cache")][0]
    assert f"remote cache {fleet.server.url}: reachable (redis " in line
    assert "3 entries: 1 signed with this key, 0 with another key, 1 unsigned, 1 foreign" in line, line
    assert f"key id {signing.key_id(SECRET.encode())}" in out and SECRET not in out
    for knob in env.KNOBS:
        assert f"  {knob} " in out
    assert f"(set, {len(SECRET)} bytes, not shown)" in out

    fleet.use("a", JITATTN_REMOTE_CACHE=f"redis://:hunter2-password@127.0.0.1:{fleet.server.port}/0")
    fleet.server.kill()
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "UNREACHABLE" in out and "hunter2-password" not in out and "redis://:***@127.0.0.1" in out

    fleet.use("a", JITATTN_REMOTE_CACHE=None)
    assert cli.main(["doctor"]) == 0
    assert "remote cache not configured (JITATTN_REMOTE_CACHE)" in capsys.readouterr().out


def test_explain_says_whether_the_remote_holds_the_key(fleet, capsys):
    fleet.use("a")
    assert cli.main(["explain", "--head-dim", "64", "--group-size", "2"]) == 0
    key = fleet.key(SPEC)
    assert f"  remote     {fleet.server.url} {remote.entry_name(key)} (absent)" in capsys.readouterr().out
    get(SPEC)
    assert cli.main(["explain", "--head-dim", "64", "--group-size", "2"]) == 0
    assert "(present, signed with this fleet's key)" in capsys.readouterr().out
    fleet.use("a", JITATTN_REMOTE_CACHE=None)
    assert cli.main(["explain", "--head-dim", "64", "--group-size", "2"]) == 0
    assert "  remote     not configured (JITATTN_REMOTE_CACHE)" in capsys.readouterr().out


def test_every_knob_is_in_the_readme_table():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    missing = [knob for knob in env.KNOBS if f"| `{knob}` |" not in readme]
    assert not missing, f"README.md's knob table lacks {missing}"
