"""Where a compiled specialization can come from: the cache tiers, behind one small interface.

A tier answers `find(wanted)` (a verified entry, or None), takes `publish(entry, wanted)` (an
entry this process built, offered to the tier), and gives a `build_turn(wanted, force)` (a
context manager that may hand over an entry another builder made while this one waited). The
tiers in lookup order come from one factory, `from_env()`: the read-only seed dirs, the
writable root, then the fleet when JITATTN_REMOTE_CACHE is set. The loader walks them in order
and knows no tier by kind; like Triton's CacheManager, each kind lives behind the same verbs.

Knows nothing about kernels: a spec is only asked for its name and its key components.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

from jitattn.jit import cache, env, keys
from jitattn.jit.tier import Tier, Turn, Wanted  # noqa: F401  (the interface; also re-exported here)


class DirTier(Tier):
    """A cache root on disk: a read-only seed dir, or the writable root."""

    def __init__(self, root: Path, *, writable: bool, stamps: Path):
        self.root, self.writable, self.stamps = root, writable, stamps
        self.other_toolchains = not writable  # seeds are deliberate artifacts (CI's pinned toolchain)

    def __repr__(self) -> str:
        return f"DirTier({self.root}, {'writable' if self.writable else 'seed'})"

    def find(self, wanted: Wanted, notes: list[str] | None = None) -> cache.CacheEntry | None:
        """The entry of the exact key, or with no key (wanted.key None) any verified build whose
        components match but for the toolchain."""
        if wanted.key is not None:
            path = cache.entry_path(self.root, keys.CACHE_SCHEMA, wanted.arch_tag, wanted.spec.name, wanted.key)
            return cache.read_entry(path, wanted.key, stamps=self.stamps)
        return compatible([self.root], wanted, self.stamps)[0]

    def commit(self, staging: Path, wanted: Wanted, replace: bool) -> cache.CacheEntry | None:
        """Publish a finished staging dir as the entry of `wanted` (one rename; first valid entry
        wins unless `replace`); the verified entry, or None if what landed does not verify."""
        final = self.entry_path(wanted)
        return cache.read_entry(cache.publish(staging, final, replace=replace), wanted.key, stamps=self.stamps)

    def entry_path(self, wanted: Wanted) -> Path:
        return cache.entry_path(self.root, keys.CACHE_SCHEMA, wanted.arch_tag, wanted.spec.name, wanted.key)


class _LazyRemote(Tier):
    """The fleet tier, created on first use, so a process whose entries are local never imports
    redis or connects. Config errors (no secret, bad URL) surface then, as RemoteCacheError."""

    remote = True

    def _tier(self):
        from jitattn.jit import remote

        return remote.tier()

    def find(self, wanted, notes=None):
        return self._tier().find(wanted, notes)

    def publish(self, entry, wanted):
        return self._tier().publish(entry, wanted)

    def build_turn(self, wanted, force):
        return self._tier().build_turn(wanted, force)


NO_REMOTE = "none (JITATTN_REMOTE_CACHE is not set)"


def from_env() -> list[Tier]:
    """The tiers in lookup order, as the env knobs name them."""
    root = env.cache_dir()
    stamps = root / cache.STAMPS  # full hashes of .so files are remembered in the writable root
    chain: list[Tier] = [DirTier(p, writable=False, stamps=stamps) for p in env.seed_dirs()]
    chain.append(DirTier(root, writable=True, stamps=stamps))
    if env.remote_cache_url() is not None:
        chain.append(_LazyRemote())
    return chain


def writable(chain: list[Tier]) -> DirTier:
    return next(t for t in chain if t.writable)


def roots(chain: list[Tier]) -> list[Path]:
    return [t.root for t in chain if isinstance(t, DirTier)]


def find_local(wanted: Wanted, chain: list[Tier]) -> cache.CacheEntry | None:
    """The entry the local tiers hold: the exact build first (any tier), then a build by another
    toolchain where that is served (seeds; or every tier when this process cannot build)."""
    local = [t for t in chain if not t.remote]
    if wanted.key is not None:
        for tier in local:
            entry = tier.find(wanted)
            if entry is not None:
                return entry
        local = [t for t in local if t.other_toolchains]
    loose = wanted.any_toolchain()
    for tier in local:
        entry = tier.find(loose)
        if entry is not None:
            return entry
    return None


def find_remote(wanted: Wanted, chain: list[Tier], notes: list[str]):
    """(entry, tier) from the first remote tier that has one, else (None, None); each remote
    tier appends what it found to `notes`."""
    for tier in chain:
        if tier.remote:
            entry = tier.find(wanted, notes)
            if entry is not None:
                return entry, tier
    if not any(t.remote for t in chain):
        notes.append(NO_REMOTE)
    return None, None


def compatible(roots_: list[Path], wanted: Wanted, stamps: Path | None = None):
    """(verified entry matching everything but the toolchain, nearest other entry + diff)."""
    spec = wanted.spec
    target = keys.BuildTarget(wanted.archs, "", "")
    want = keys.components(spec, target)
    nearest = None
    stamps = stamps or env.cache_dir() / cache.STAMPS
    for layer in roots_:
        for path in reversed(cache.siblings(layer, keys.CACHE_SCHEMA, wanted.arch_tag, spec.name)):
            entry = cache.read_entry(path, stamps=stamps)
            if entry is None:
                nearest = nearest or (path, [f"entry does not verify: {cache.why_invalid(path)}"])
                continue
            diff = [d for d in keys.differing(want, entry.components) if d not in keys.TOOLCHAIN_COMPONENTS]
            if not diff:
                return entry, None
            if nearest is None or len(diff) < len(nearest[1]):
                nearest = (path, diff)
    return None, nearest


@contextlib.contextmanager
def build_turns(chain: list[Tier], wanted: Wanted, force: bool):
    """Every tier's build turn, entered in order: yields the entry one of them handed over (a
    build another node finished while this one waited), else None."""
    with contextlib.ExitStack() as held:
        for tier in chain:
            turn = held.enter_context(tier.build_turn(wanted, force))
            if turn.found is not None:
                yield turn.found, tier
                return
        yield None, None
