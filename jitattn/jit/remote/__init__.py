"""The fleet tier: one Redis server whose entries every node's cache can pull.

A cache tier (`jit.tiers`) that the loader asks only after every local tier missed
(`FleetTier.find`), so a process whose entries are local never imports redis or connects. A
build takes the fleet's lock for its key after the node's file lock (`FleetTier.build_turn`):
nodes that ask for the same cold spec at once wait for one builder and pull its result, and the
builder publishes first-writer-wins (`publish` / `share`).

Every value read is untrusted (`envelope`): bounded, verified, authenticated with the fleet
secret (`jitattn.jit.signing`) and materialized into the local root through staging + one
rename, so the warm path stays local. Every fault of the server (down, slow, restarted,
flushed, full, a malformed reply, a foreign value) is logged once per process and the call goes
on locally: a build, or strict mode's error. Each remote operation is bounded by one deadline
and a byte bound (`store`), each wait by the lock's TTL and JITATTN_LOCK_TIMEOUT; a server that
cannot be reached is not asked again for RETRY_AFTER_S. What a Redis writer can and cannot do:
docs/threat-model.md.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path

from jitattn.errors import RemoteCacheError
from jitattn.jit import cache, env, keys, signing
from jitattn.jit.remote import envelope
from jitattn.jit.remote.store import Oversized, RedisStore, RemoteFault
from jitattn.jit.tier import Tier, Turn, Wanted

log = logging.getLogger("jitattn")

RETRY_AFTER_S = 10.0  # after a connection fault, the tier is skipped this long
_PREFIX = f"jitattn:{keys.CACHE_SCHEMA}"
_ALIAS_LIMIT = 16  # builds of one toolchain-independent spec fully fetched by strict mode
_LOCK_TTL_SLACK_MS = 2000  # a lock's PTTL may exceed the TTL knob by this much (another node's clock of the knob)
_ALIAS_MEMBERS = 4096  # an alias set longer than this is junk: the tier is unavailable for the spec


def entry_name(key: str) -> str:
    return f"{_PREFIX}:entry:{key}"


def lock_name(key: str) -> str:
    return f"{_PREFIX}:lock:{key}"


def alias_name(components: dict) -> str:
    """The set of keys (one per toolchain) of one build: strict mode, which cannot probe a
    compiler, finds an entry built by any toolchain through it, as it does locally."""
    return f"{_PREFIX}:alias:{keys.key_of(_without_toolchain(components))}"


def _without_toolchain(components: dict) -> dict:
    return {k: v for k, v in components.items() if k not in keys.TOOLCHAIN_COMPONENTS}


def entry_rel(arch_tag: str, name: str, key: str) -> str:
    return f"{keys.CACHE_SCHEMA}/{arch_tag}/{name}-{key[:16]}"


_tiers: dict[tuple, "FleetTier"] = {}
_tiers_lock = threading.Lock()


def tier() -> "FleetTier | None":
    """The fleet tier JITATTN_REMOTE_CACHE names, or None. Raises RemoteCacheError when it is
    set but unusable (no redis client, a bad URL, no secret and no explicit opt-out)."""
    url = env.remote_cache_url()
    if url is None:
        return None
    config = (url, env.remote_cache_secret(), env.remote_cache_key_file(), env.remote_cache_insecure(),
              env.remote_cache_connect_timeout(), env.remote_cache_timeout(), env.remote_cache_max_bytes())
    with _tiers_lock:
        found = _tiers.get(config)
        if found is None:
            found = _tiers[config] = FleetTier(url, insecure=config[3], connect_timeout=config[4], timeout=config[5],
                                               max_bytes=config[6])
    return found


def forget_tiers() -> None:
    """Drop the fleet tiers this process opened (their connections and what they learnt of the
    server), so the next call connects afresh, as a new process would (tests, tools that restart
    a server)."""
    with _tiers_lock:
        _tiers.clear()


class FleetTier(Tier):
    """The fleet as a cache tier (jit.tiers): `find` pulls, `publish` shares, `build_turn` waits
    for the one builder of a key fleet-wide. Every failure of the server or of what it sent
    makes the tier unavailable for that key: one log line, and the call goes on locally."""

    remote = True

    def __init__(self, url: str, *, insecure: bool, connect_timeout: float, timeout: float,
                 max_bytes: int = 64 * 2**20):
        self.url = env.redact_url(url)
        secret = signing.fleet_secret()
        self.secret, self.secret_source = secret if secret else (None, None)
        self.insecure = insecure
        if self.secret is None and not insecure:
            raise RemoteCacheError(
                f"JITATTN_REMOTE_CACHE={self.url} needs the fleet secret that signs its entries: set "
                "JITATTN_REMOTE_CACHE_KEY or JITATTN_REMOTE_CACHE_KEY_FILE (or, on a network you "
                "trust, JITATTN_REMOTE_CACHE_INSECURE=1 to share unsigned entries)")
        self.store = RedisStore(url, connect_timeout, timeout, max_bytes)
        self.timeouts = (connect_timeout, timeout)
        self._down_until = 0.0
        self._faulted = False  # the first fault of this process is a warning, later ones info
        self._said: set[tuple] = set()
        self._refused_heads: dict[str, bytes] = {}  # key -> head of a value we refused
        self._state = threading.Lock()

    def __repr__(self) -> str:
        return f"FleetTier({self.url})"

    @property
    def key_id(self) -> str | None:
        return signing.key_id(self.secret) if self.secret else None

    # ------------------------------------------------------------------ faults and refusals

    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _fault(self, fault: RemoteFault, doing: str) -> None:
        with self._state:
            first, self._faulted = not self._faulted, True
            if fault.down:
                self._down_until = time.monotonic() + RETRY_AFTER_S
        skip = f"; not asked again for {RETRY_AFTER_S:g} s" if fault.down else ""
        if first:
            log.warning("remote cache %s: %s while %s; going on locally%s (connect timeout %g s, command "
                        "timeout %g s; further remote faults of this process are logged at info level)",
                        self.url, fault, doing, skip, *self.timeouts)
        else:
            log.info("remote cache %s: %s while %s; going on locally%s", self.url, fault, doing, skip)

    def _once(self, level: int, what: tuple, message: str, *args) -> None:
        with self._state:
            if what in self._said:
                return
            self._said.add(what)
        log.log(level, message, *args)

    def _refuse(self, key: str, rel: str, reason: str, head: bytes) -> str:
        with self._state:
            self._refused_heads[key] = head
        self._once(logging.WARNING, ("refused", key, reason),
                   "remote cache %s: refused the value under %s (for %s): %s", self.url, entry_name(key), rel, reason)
        return f"refused {entry_name(key)}: {reason}"

    def _unavailable(self, key: str | None, doing: str, exc: BaseException) -> str:
        """Anything unexpected while talking to the fleet (a client error, a malformed reply or
        value): the tier is unavailable for this key, logged once, and the call goes on locally."""
        what = f"{type(exc).__name__}: {exc}"[:300]
        self._once(logging.WARNING, ("unavailable", key, type(exc).__name__),
                   "remote cache %s: fleet tier unavailable for %s (%s while %s); going on locally",
                   self.url, key[:16] if key else "this spec", what, doing)
        return f"unavailable ({what})"

    # ------------------------------------------------------------------ the tier interface

    def find(self, wanted: Wanted, notes: list[str] | None = None) -> cache.CacheEntry | None:
        entry, note = self.pull(wanted)
        if notes is not None:
            notes.append(note)
        return entry

    def publish(self, entry: cache.CacheEntry, wanted: Wanted) -> str:
        return self.share(entry, wanted.rel)

    def build_turn(self, wanted: Wanted, force: bool) -> "BuildTurn | Turn":
        """A forced rebuild takes no fleet lock; any other build waits for the key's lock."""
        if force:
            return Turn()
        return BuildTurn(self, wanted.spec.name, wanted.key, wanted.rel, env.cache_dir())

    # ------------------------------------------------------------------ pull

    def pull(self, wanted: Wanted) -> tuple[cache.CacheEntry | None, str]:
        """After a local miss: the entry the fleet holds for `wanted`, materialized into the
        writable root, and a note on what happened (for strict mode's error). With an exact key
        (this process knows its toolchain), only that key; else (strict mode, no toolchain) any
        build whose components match but for the toolchain, as strict mode accepts locally."""
        try:
            if wanted.key is not None:
                return self.fetch(wanted.key, wanted.rel, env.cache_dir())
            return self._pull_any_toolchain(wanted)
        except RemoteCacheError:
            raise
        except Exception as exc:
            return None, self._unavailable(wanted.key, f"pulling {wanted.spec.name}", exc)

    def _pull_any_toolchain(self, wanted: Wanted) -> tuple[cache.CacheEntry | None, str]:
        spec, root = wanted.spec, env.cache_dir()
        components = keys.components(spec, keys.BuildTarget(wanted.archs, "", ""))
        if not self.available():
            return None, f"skipped ({self.url} was unreachable moments ago)"
        alias = alias_name(components)
        try:
            candidates, listed = self._plausible_builds(alias, wanted)
        except RemoteFault as fault:
            self._fault(fault, f"looking up the builds of {spec.name}")
            return None, f"unreachable ({fault})"
        notes = []
        for key in candidates:
            def same_build(_, entry):
                diff = [d for d in keys.differing(components, entry.components)
                        if d not in keys.TOOLCHAIN_COMPONENTS]
                return f"listed as a build of {spec.name} but differs in {diff}" if diff else None

            entry, note = self.fetch(key, entry_rel(wanted.arch_tag, spec.name, key), root, same_build)
            if entry is not None:
                return entry, note
            notes.append(note)
        if not notes:
            what = "no build" if not listed else f"no usable build (of {listed} listed)"
            return None, f"{what} of {spec.name} for {wanted.arch_tag} in {self.url} ({alias})"
        return None, "; ".join(notes)

    def _plausible_builds(self, alias: str, wanted: Wanted) -> tuple[list[str], int]:
        """(up to _ALIAS_LIMIT keys of the alias set whose value exists and whose header names
        that key's entry of this spec, signed by this fleet's key unless insecure; how many
        members the set has). Junk members (no value, foreign headers) cost one GETRANGE each and
        never hide a real build behind them."""
        with self.store.operation(f"listing the builds in {alias}"):
            members = self.store.members(alias, _ALIAS_MEMBERS)
            found = []
            for key in members:
                if len(found) >= _ALIAS_LIMIT:
                    break
                if _is_key(key) and self._plausible(key, entry_rel(wanted.arch_tag, wanted.spec.name, key),
                                                    self.store.head(entry_name(key), envelope.HEAD_BYTES)):
                    found.append(key)
        return found, len(members)

    def _plausible(self, key: str, rel: str | None, head: bytes) -> bool:
        """Whether a value's head could be the entry of `key` (at `rel`, if given) that this
        process would accept: worth a full fetch and verification."""
        try:
            header = envelope.header_of(head)
        except envelope.Refused:
            return False
        if header.get("key") != key or (rel is not None and header.get("path") != rel):
            return False
        signature = header.get("signature")
        if self.secret is not None and not self.insecure:
            return isinstance(signature, dict) and signature.get("key_id") == self.key_id
        return True

    def fetch(self, key: str, rel: str, root: Path, check=None) -> tuple[cache.CacheEntry | None, str]:
        """Pull the value of one key into `root`: (entry, note), entry None on a miss, a
        refusal or a fault."""
        if not self.available():
            return None, f"skipped ({self.url} was unreachable moments ago)"
        name = entry_name(key)
        limit = env.remote_cache_max_bytes()
        start = time.perf_counter()
        try:
            # One deadline for the whole read: STRLEN, then the value in bounded chunks.
            with self.store.operation(f"pulling {rel}", limit):
                size = self.store.size(name)
                if size is None:
                    return None, self._refuse(key, rel, f"foreign value (a Redis {self.store.kind(name)}, "
                                                         "not a jitattn entry)", b"\0type")
                if size == 0:
                    return None, f"no entry {name} in {self.url}"
                if size > limit:
                    head = self.store.head(name, envelope.HEAD_BYTES)
                    return None, self._refuse(key, rel, f"oversized value: {size} bytes > "
                                                        f"JITATTN_REMOTE_CACHE_MAX_MB ({limit} bytes)", head)
                value = self.store.get(name)  # at most JITATTN_REMOTE_CACHE_MAX_MB received
        except RemoteFault as fault:
            if isinstance(fault, Oversized):
                return None, self._refuse(key, rel, f"oversized value: more than {limit} bytes "
                                                    "(JITATTN_REMOTE_CACHE_MAX_MB), whatever STRLEN said", b"\0big")
            self._fault(fault, f"pulling {rel}")
            return None, f"unreachable ({fault})"
        if value is None:
            return None, f"no entry {name} in {self.url} (gone since it was seen: expired or flushed)"
        head = value[:envelope.HEAD_BYTES]
        trusted = []

        def accept(staged: Path, entry) -> str | None:
            why = check(staged, entry) if check else None
            if why:
                return why
            why = signing.check_entry(self.secret, key, staged, header.get("signature"))
            if why is None:
                trusted.append("signed with this fleet's key")
                return None
            if self.insecure:
                trusted.append(f"{why}: accepted because JITATTN_REMOTE_CACHE_INSECURE=1")
                return None
            return f"{why}; set JITATTN_REMOTE_CACHE_INSECURE=1 to load it anyway"

        try:
            header, archive = envelope.unwrap(value, key, rel)
            entry = envelope.materialize(archive, key, rel, root, accept)
        except envelope.Refused as refused:
            return None, self._refuse(key, rel, str(refused), head)
        except OSError as exc:
            self._once(logging.WARNING, ("local", str(root)), "remote cache %s: cannot materialize %s into %s: %s",
                       self.url, rel, root, exc)
            return None, f"found in {self.url}, but the cache root {root} cannot be written ({exc})"
        log.info("pulled %s from %s (%d KiB, %.0f ms; %s)", rel, self.url, len(value) // 1024,
                 (time.perf_counter() - start) * 1e3, trusted[0])
        if not trusted[0].startswith("signed with this"):
            # With a secret, each unverified load is news; an unsigned fleet chose this once.
            what = ("insecure", key) if self.secret else ("insecure",)
            self._once(logging.WARNING, what, "remote cache %s: loaded %s: %s", self.url, rel, trusted[0])
        return entry, f"pulled from {self.url}"

    # ------------------------------------------------------------------ publish

    def share(self, entry: cache.CacheEntry, rel: str) -> str:
        """Publish a verified local entry, first writer wins: "published", "present" (some
        value is there already), "replaced" (the value there had been refused), or why not."""
        try:
            return self._share(entry, rel)
        except RemoteCacheError:
            raise
        except Exception as exc:
            return "not published: " + self._unavailable(entry.key, f"publishing {rel}", exc)

    def _share(self, entry: cache.CacheEntry, rel: str) -> str:
        if not self.available():
            return f"skipped ({self.url} was unreachable moments ago)"
        signature = signing.sign_entry(self.secret, entry.key, entry.path) if self.secret else None
        try:
            value = envelope.pack(entry, rel, signature)
        except (OSError, ValueError) as exc:
            return f"not published: {exc}"
        limit = env.remote_cache_max_bytes()
        if len(value) > limit:
            self._once(logging.WARNING, ("size", entry.key), "remote cache %s: %s not published: %d bytes > "
                       "JITATTN_REMOTE_CACHE_MAX_MB (%d bytes)", self.url, rel, len(value), limit)
            return f"not published: {len(value)} bytes > JITATTN_REMOTE_CACHE_MAX_MB ({limit} bytes)"
        name, ttl = entry_name(entry.key), env.remote_cache_ttl()
        try:
            if self.store.put_new(name, value, ttl):
                status = "published"
            else:
                refused = self._refused_heads.get(entry.key)
                if refused and self.store.replace_if_head(name, refused, value, ttl):
                    status = "replaced"
                else:
                    status = "present"
            self.store.add_member(alias_name(entry.components), entry.key, ttl)
        except RemoteFault as fault:
            self._fault(fault, f"publishing {rel}")
            return f"not published ({fault})"
        log.info("remote cache %s: %s %s (%d KiB%s)", self.url, status, rel, len(value) // 1024,
                 ", signed" if signature else ", unsigned")
        return status

    def heal_alias(self, entry: cache.CacheEntry) -> int:
        """Make the alias set of `entry`'s build list it, and drop members that are not keys or
        whose value is absent or could not be this fleet's entry (`_plausible`); a set longer
        than any honest fleet makes is rebuilt from this key alone. How many members went."""
        alias = alias_name(entry.components)
        try:
            with self.store.operation(f"healing {alias}"):
                try:
                    members = self.store.members(alias, _ALIAS_MEMBERS)
                except RemoteFault as fault:
                    if fault.down:
                        raise
                    members = None  # over the bound: start the set again
                if members is None:
                    self.store.delete(alias)
                    junk_count = -1
                else:
                    junk = [m for m in members if m != entry.key and not (
                        _is_key(m) and self._plausible(m, None, self.store.head(entry_name(m), envelope.HEAD_BYTES)))]
                    self.store.remove_members(alias, junk)
                    junk_count = len(junk)
                self.store.add_member(alias, entry.key, env.remote_cache_ttl())
        except RemoteFault as fault:
            self._fault(fault, f"healing {alias}")
            return 0
        except Exception as exc:
            self._unavailable(entry.key, f"healing {alias}", exc)
            return 0
        if junk_count:
            log.warning("remote cache %s: %s: %s", self.url, alias,
                        "over-long set rebuilt" if junk_count < 0 else f"removed {junk_count} junk member(s)")
        return junk_count

    def _pull_if_new(self, key: str, rel: str, root: Path):
        """An entry someone published, skipping a value this process already refused."""
        head = self.store.head(entry_name(key), envelope.HEAD_BYTES)
        if not head or self._refused_heads.get(key) == head:
            return None
        entry, _ = self.fetch(key, rel, root)
        return entry


def _is_key(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


class BuildTurn:
    """This process's turn to build one key, fleet-wide (taken under the node's file lock).

    On entry: wait until this process holds the fleet lock of the key (SET NX PX: it always
    carries a TTL), or another node has published the entry (then `found` is it, materialized
    locally), or the remote faults, or JITATTN_LOCK_TIMEOUT passes (then the build goes on here
    without the lock: a duplicate compile, never a failed call). A lock without a TTL, or with a
    longer one than a jitattn builder sets, is no live builder's: the build goes on here at once.
    While held, the lock is renewed every third of its TTL; on exit it is released. A builder that
    dies stops renewing, and its lock expires after JITATTN_REMOTE_CACHE_LOCK_TTL."""

    def __init__(self, fleet: FleetTier, spec_name: str, key: str, rel: str, root: Path):
        self.fleet, self.spec_name, self.key, self.rel, self.root = fleet, spec_name, key, rel, root
        self.found: cache.CacheEntry | None = None
        self.token = f"{socket.gethostname()} pid {os.getpid()} {uuid.uuid4().hex[:8]}"
        self._held = False
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def __enter__(self) -> "BuildTurn":
        try:
            self._wait()
        except RemoteCacheError:
            raise
        except Exception as exc:
            self.fleet._unavailable(self.key, f"waiting for the fleet build of {self.spec_name}", exc)
        return self

    def _wait(self) -> None:
        fleet, name = self.fleet, lock_name(self.key)
        ttl_ms = max(1, int(env.remote_cache_lock_ttl() * 1000))
        timeout = env.lock_timeout()
        deadline = time.monotonic() + timeout
        delay, announced = 0.05, False
        while fleet.available():
            try:
                self.found = fleet._pull_if_new(self.key, self.rel, self.root)
                if self.found is not None:
                    return
                if fleet.store.lock(name, self.token, ttl_ms):
                    self._held = True
                    self._start_renewing(name, ttl_ms)
                    # Published between the look and the lock (its builder then released)?
                    self.found = fleet._pull_if_new(self.key, self.rel, self.root)
                    return
                holder, left_ms = fleet.store.holder(name), fleet.store.ttl_ms(name)
            except RemoteFault as fault:
                fleet._fault(fault, f"waiting for the fleet build of {self.spec_name}")
                return
            if left_ms == -1 or left_ms > ttl_ms + _LOCK_TTL_SLACK_MS:
                fleet._once(logging.WARNING, ("stale lock", self.key),
                            "remote cache %s: the fleet lock %s (held by %r) has %s, so no live jitattn builder "
                            "holds it; building %s here", fleet.url, name, (holder or "")[:80],
                            "no TTL" if left_ms == -1 else f"a TTL of {left_ms} ms > JITATTN_REMOTE_CACHE_LOCK_TTL",
                            self.spec_name)
                return
            if left_ms == -2 or holder is None:
                continue  # released between the two looks: try again at once
            if not announced:
                log.info("waiting up to %g s for %s, which %s is building for the fleet (%s)",
                         timeout, self.spec_name, holder or "another node", name)
                announced = True
            if time.monotonic() + delay > deadline:
                log.warning("remote cache %s: gave up after %g s waiting for the fleet build of %s (lock %s held "
                            "by %s); building it here (JITATTN_LOCK_TIMEOUT)", fleet.url, timeout, self.spec_name,
                            name, holder)
                return
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)

    def _start_renewing(self, name: str, ttl_ms: int) -> None:
        def renew():
            while not self._stop.wait(ttl_ms / 3000):
                try:
                    if not self.fleet.store.renew(name, self.token, ttl_ms):
                        log.warning("remote cache %s: lost the fleet build lock of %s (it expired); another node "
                                    "may build it too (harmless: first writer wins)", self.fleet.url, self.spec_name)
                        return
                except RemoteFault as fault:
                    self.fleet._fault(fault, f"renewing the fleet build lock of {self.spec_name}")
                    return

        self._renewer = threading.Thread(target=renew, name=f"jitattn-lock-{self.key[:8]}", daemon=True)
        self._renewer.start()

    def __exit__(self, *exc_info) -> None:
        if not self._held:
            return
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(timeout=5)
        self._held = False
        if not self.fleet.available():  # a server that just faulted: its lock expires by its TTL
            return
        try:
            self.fleet.store.release(lock_name(self.key), self.token)
        except RemoteFault as fault:
            self.fleet._fault(fault, f"releasing the fleet build lock of {self.spec_name}")
