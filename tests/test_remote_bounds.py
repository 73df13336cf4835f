"""The fleet tier bounded (issue 45 item 2): what a Redis writer, or a server that misbehaves at
the protocol level, can make a node do. Each test backs one sentence of docs/threat-model.md.

Real redis-server for values, alias sets and locks a writer can plant (tests/fleet.py's
fixture); a fake RESP server (tests/fake_resp.py) for replies no real server sends. In every
case the call ends in a local build (or strict mode's MissingSpecializationError) within its
deadline, with one log line, and never another exception.
"""
from __future__ import annotations

import bz2
import gzip
import hashlib
import io
import json
import logging
import tarfile
import time

import pytest

from jitattn import cli
from jitattn.errors import MissingSpecializationError
from jitattn.jit import build, cache, remote
from jitattn.jit.remote import envelope
from tests import fake_compiler
from tests.fake_resp import FakeRedis, bulk
from tests.fleet import server  # noqa: F401  (a fixture)
from tests.test_remote import (SPEC, archive_of, build_on, fleet, get, jlog, no_litter,  # noqa: F401
                               rewrap, signed_value, store_value, warnings_of)

STRICT = {"JITATTN_DISABLE_JIT": "1", "CUDA_HOME": "/nonexistent"}


def assert_local_build(result):
    module, compiled, pulled = result
    assert (compiled, pulled) == (1, 0)
    assert cache.why_invalid(module.entry.path) is None
    return module


def strict_miss(fleet, seconds: float) -> str:
    t0 = time.monotonic()
    with pytest.raises(MissingSpecializationError) as err:
        get(SPEC)
    assert time.monotonic() - t0 < seconds
    assert "  remote: " in str(err.value)
    return str(err.value)


# ----------------------------------------------------------------------------- values


def _with_member(archive: bytes, name: str, data: bytes) -> bytes:
    """The archive with member `name` replaced by `data`, its index record re-hashed to match
    (as a writer without the secret would do)."""
    src = tarfile.open(fileobj=io.BytesIO(archive), mode="r:")
    members = [(m, src.extractfile(m).read() if m.isreg() else None) for m in src.getmembers()]
    index = json.loads(members[0][1])
    for record in index["entries"]:
        for fname in record["files"]:
            if f"{record['path']}/{fname}" == name:
                record["files"][fname] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, content in members:
            if info.name == "index.json":
                content = json.dumps(index).encode()
            elif info.name == name:
                content = data
            if content is not None:
                info.size = len(content)
            tar.addfile(info, io.BytesIO(content) if content is not None else None)
    return out.getvalue()


@pytest.mark.parametrize("compress", ["bzip2", "gzip"])
def test_a_value_whose_archive_is_compressed_is_refused_unread(fleet, jlog, compress):
    entry = build_on(fleet, "a", SPEC)
    value = signed_value(fleet, SPEC, entry)
    packed = (bz2.compress if compress == "bzip2" else gzip.compress)(archive_of(value))
    fleet.use("b")
    name = store_value(fleet, SPEC, rewrap(value, packed))
    assert_local_build(get(SPEC))
    refusals = [w for w in warnings_of(jlog) if name in w]
    assert refusals and f"a {compress}-compressed archive" in refusals[0] and "only plain tar" in refusals[0]


def test_a_header_nested_thousands_deep_is_refused_not_raised(fleet, jlog):
    fleet.use("b")
    name = store_value(fleet, SPEC, envelope.MAGIC + b"[" * 5000 + b"]" * 5000 + b"\n" + b"\0" * 512)
    assert_local_build(get(SPEC))
    assert any(name in w and "nests deeper than" in w for w in warnings_of(jlog)), warnings_of(jlog)
    fleet.server.client().set(name, envelope.MAGIC + b"[" * 5000 + b"]" * 5000 + b"\n")  # (b's build replaced it)
    fleet.use("c", **STRICT)
    assert "no usable build (of 1 listed)" in strict_miss(fleet, 5)  # its header is not even worth a fetch


def test_an_inner_manifest_nested_thousands_deep_is_refused_not_raised(fleet, jlog):
    entry = build_on(fleet, "a", SPEC)
    value = signed_value(fleet, SPEC, entry)
    rel = "/".join(entry.parts[-3:])
    deep = b'{"key": ' * 5000 + b"1" + b"}" * 5000
    fleet.use("b")
    store_value(fleet, SPEC, rewrap(value, _with_member(archive_of(value), f"{rel}/manifest.json", deep)))
    module = assert_local_build(get(SPEC))
    assert any("does not verify" in w and "malformed manifest.json" in w for w in warnings_of(jlog)), \
        warnings_of(jlog)
    assert no_litter(fleet.root("b")) and [p.name for p in cache.entries(fleet.root("b"))] == [module.entry.path.name]


# ----------------------------------------------------------------------------- protocol faults


def _trickle(fake, conn):
    for byte in b"$100\r\n" + b"x" * 100 + b"\r\n":  # one byte every 0.2 s: each read is quick, the whole is not
        fake.send(conn, bytes([byte]))
        time.sleep(0.2)


def _huge(fake, conn):
    fake.send(conn, b"$419430400\r\n")  # STRLEN said 100; GETRANGE answers 400 MiB
    block = b"\0" * (1 << 20)
    for _ in range(400):
        fake.send(conn, block)


def _deep(fake, conn):
    fake.send(conn, b"*1\r\n" * 100_000 + b":1\r\n")


def _answers(table):
    def reply(command):
        answer = table.get(command[0])
        return answer if answer is not None else (b"+PONG\r\n" if command[0] == b"PING" else b"+OK\r\n")
    return reply


PROTOCOL_FAULTS = {
    # a server (or a proxy) that answers +OK to everything: HELLO, STRLEN, SCARD ...
    "+OK to everything": {},
    "STRLEN a string": {b"STRLEN": bulk(b"abc"), b"SCARD": bulk(b"abc")},
    "SMEMBERS an integer": {b"STRLEN": b":0\r\n", b"SCARD": b":1\r\n", b"SMEMBERS": b":7\r\n"},
    "a reply nested 100,000 deep": {b"STRLEN": _deep, b"SCARD": _deep},
    "a GET trickled a byte at a time": {b"STRLEN": b":100\r\n", b"EXISTS": b":1\r\n", b"GETRANGE": _trickle,
                                        b"SCARD": _trickle},
}


@pytest.fixture
def fake_server():
    servers = []

    def start(table):
        servers.append(FakeRedis(_answers(table)))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


@pytest.mark.parametrize("fault,strict", [(f, s) for f in sorted(PROTOCOL_FAULTS) for s in (False, True)
                                          if s or f != "SMEMBERS an integer"])  # only strict mode lists a set
def test_a_malformed_or_trickled_reply_makes_the_tier_unavailable_and_the_call_goes_on_locally(
        fleet, jlog, fake_server, fault, strict):
    fake = fake_server(PROTOCOL_FAULTS[fault])
    knobs = {"JITATTN_REMOTE_CACHE": fake.url, "JITATTN_REMOTE_CACHE_TIMEOUT": "0.5",
             "JITATTN_REMOTE_CACHE_CONNECT_TIMEOUT": "0.5"}
    fleet.use("b", **knobs, **(STRICT if strict else {}))
    if strict:
        strict_miss(fleet, 4)
    else:
        t0 = time.monotonic()
        assert_local_build(get(SPEC))
        assert time.monotonic() - t0 < 4  # one operation's deadline (1 s), not a per-read timeout
    said = [w for w in warnings_of(jlog) if fake.url in w]
    assert len(said) == 1 and "going on locally" in said[0], said


def test_a_reply_longer_than_the_byte_bound_is_cut_off_unbuffered(fleet, jlog, fake_server):
    fake = fake_server({b"STRLEN": b":100\r\n", b"EXISTS": b":1\r\n", b"GETRANGE": _huge})
    fleet.use("b", JITATTN_REMOTE_CACHE=fake.url, JITATTN_REMOTE_CACHE_MAX_MB="1")
    assert_local_build(get(SPEC))
    time.sleep(0.2)
    assert fake.sent < 32 * 2**20, fake.sent  # the client closed the connection after ~1 MiB (plus socket buffers)
    assert len([w for w in warnings_of(jlog) if fake.url in w]) == 1


def test_a_value_longer_than_strlen_said_is_refused_at_the_bound(fleet, jlog, monkeypatch):
    entry = build_on(fleet, "a", SPEC)
    value = signed_value(fleet, SPEC, entry)
    fleet.use("b", JITATTN_REMOTE_CACHE_MAX_MB=str(len(value) / 2**20 / 2))
    name = store_value(fleet, SPEC, value)
    from jitattn.jit.remote.store import RedisStore
    monkeypatch.setattr(RedisStore, "size", lambda self, n: 100)  # STRLEN lies
    assert_local_build(get(SPEC))
    assert any(name in w and "whatever STRLEN said" in w for w in warnings_of(jlog)), warnings_of(jlog)


# ----------------------------------------------------------------------------- alias sets


def _plant_aliases(fleet, spec, n: int, with_values: bool) -> set[bytes]:
    client = fleet.server.client()
    entry = cache.read_entry(next(cache.entries(fleet.root("a"))))
    alias = remote.alias_name(entry.components)
    junk = set()
    for i in range(n):
        key = f"{i:064x}"  # sorts before any real key
        junk.add(key.encode())
        client.sadd(alias, key)
        if with_values and i % 2:
            client.set(remote.entry_name(key), b"JITATTN-REMOTE-ENTRY 1\n{\"key\": \"" + key.encode() + b"\"}\n")
        elif with_values:
            client.set(remote.entry_name(key), b"junk")
    return junk


def test_planted_low_sorting_aliases_do_not_hide_the_real_build_from_strict_nodes(fleet):
    fleet.use("a")
    get(SPEC)
    _plant_aliases(fleet, SPEC, 40, with_values=True)
    fleet.use("b", **STRICT)
    assert get(SPEC)[1:] == (0, 1)


def test_cache_push_heals_the_alias_set(fleet, capsys):
    fleet.use("a")
    module, _, _ = get(SPEC)
    alias = remote.alias_name(module.entry.components)
    client = fleet.server.client()
    junk = _plant_aliases(fleet, SPEC, 20, with_values=True) | {b"not-a-key"}
    client.sadd(alias, "not-a-key")
    client.srem(alias, module.entry.key)  # the real key dropped by the writer
    assert cli.main(["cache", "push"]) == 0
    assert client.smembers(alias) == {module.entry.key.encode()}
    assert not junk & client.smembers(alias)


def test_an_alias_set_too_long_to_read_is_rebuilt_by_push(fleet, capsys):
    fleet.use("a")
    module, _, _ = get(SPEC)
    alias = remote.alias_name(module.entry.components)
    client = fleet.server.client()
    client.sadd(alias, *[f"{i:064x}" for i in range(remote._ALIAS_MEMBERS + 1)])
    fleet.use("b", **STRICT)
    assert "over the bound" in strict_miss(fleet, 10)
    fleet.use("a")
    assert cli.main(["cache", "push"]) == 0
    assert client.smembers(alias) == {module.entry.key.encode()}


# ----------------------------------------------------------------------------- locks


@pytest.mark.parametrize("planted", ["no TTL", "a TTL of ten days"])
def test_a_planted_fleet_lock_without_a_live_ttl_is_not_waited_for(fleet, jlog, planted):
    fleet.use("b")
    name = remote.lock_name(fleet.key(SPEC))
    if planted == "no TTL":
        fleet.server.client().set(name, "planted")
    else:
        fleet.server.client().set(name, "planted", px=10 * 86400 * 1000)
    t0 = time.monotonic()
    assert_local_build(get(SPEC))
    assert time.monotonic() - t0 < 3  # not JITATTN_LOCK_TIMEOUT (600 s)
    assert any(name in w and "no live jitattn builder" in w for w in warnings_of(jlog)), warnings_of(jlog)


def test_a_waiter_waits_no_longer_than_a_planted_locks_ttl(fleet, jlog):
    fleet.use("b", JITATTN_REMOTE_CACHE_LOCK_TTL="2")
    name = remote.lock_name(fleet.key(SPEC))
    fleet.server.client().set(name, "planted", px=1500)  # a lock nobody renews
    t0 = time.monotonic()
    assert_local_build(get(SPEC))
    assert 1.0 < time.monotonic() - t0 < 4


def test_the_fleet_lock_a_build_holds_always_carries_a_ttl(fleet, monkeypatch):
    fleet.use("b", JITATTN_REMOTE_CACHE_LOCK_TTL="7")
    name = remote.lock_name(fleet.key(SPEC))
    seen = []

    def compile_and_look(*args, **kwargs):
        seen.append(fleet.server.client().pttl(name))
        return fake_compiler.compile_library(*args, **kwargs)

    monkeypatch.setattr(build, "compile_library", compile_and_look)
    assert_local_build(get(SPEC))
    assert len(seen) == 1 and 0 < seen[0] <= 7000
    assert fleet.server.client().exists(name) == 0  # released after the build


# ----------------------------------------------------------------------------- doctor, explain, pull


def test_doctor_explain_and_pull_report_a_misbehaving_server_instead_of_raising(fleet, fake_server, capsys, tmp_path):
    fake = fake_server({b"INFO": _deep, b"GETRANGE": _deep, b"STRLEN": _deep, b"SCARD": _deep})
    fleet.use("b", JITATTN_REMOTE_CACHE=fake.url, JITATTN_REMOTE_CACHE_TIMEOUT="0.5")
    assert cli.main(["doctor"]) == 0
    assert "UNREACHABLE" in capsys.readouterr().out
    fleet.fresh_process()
    assert cli.main(["explain", "--head-dim", "64", "--group-size", "2"]) == 0
    assert "(unreachable: GETRANGE" in capsys.readouterr().out
    fleet.fresh_process()
    manifest = tmp_path / "m.toml"
    manifest.write_text('[[spec]]\nfamily = "decode"\nhead_dim = 64\ngroup_tile = 2\n')
    assert cli.main(["cache", "pull", "--manifest", str(manifest)]) == 1
    assert "MISSING" in capsys.readouterr().out


def test_explain_names_a_value_whose_header_nests_deep_as_foreign(fleet, capsys):
    fleet.use("a")
    fleet.server.client().set(remote.entry_name(fleet.key(SPEC)), envelope.MAGIC + b"[" * 5000 + b"]" * 5000 + b"\n")
    assert cli.main(["explain", "--head-dim", "64", "--group-size", "2"]) == 0
    assert "(a FOREIGN value (not a jitattn entry))" in capsys.readouterr().out
