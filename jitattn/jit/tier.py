"""The cache-tier interface: what a call wants (`Wanted`), a build turn (`Turn`) and a tier
(`Tier`: find / publish / build_turn). Its own module so that tiers (jitattn/jit/tiers.py: the
directory tiers and the factory) and the fleet tier (jitattn/jit/remote) both build on it without
importing each other."""
from __future__ import annotations

from dataclasses import dataclass, replace

from jitattn.jit import cache, keys


@dataclass(frozen=True)
class Wanted:
    """What one call looks for: the spec, the archs it runs on, and the exact build this process
    would make (`target`, `components`, `key`), or None when it cannot build (strict mode, no
    toolchain) and any toolchain's build of the same components will do."""

    spec: object
    archs: tuple
    arch_tag: str
    target: keys.BuildTarget | None = None
    components: dict | None = None
    key: str | None = None

    @property
    def rel(self) -> str:
        """The entry's path under a cache root (needs the exact key)."""
        return f"{keys.CACHE_SCHEMA}/{self.arch_tag}/{self.spec.name}-{self.key[:16]}"

    def any_toolchain(self) -> "Wanted":
        """The same spec and archs, built by whatever toolchain."""
        return replace(self, target=None, components=None, key=None)


class Turn:
    """A build turn that waits for nobody: nothing handed over."""

    found = None

    def __enter__(self) -> "Turn":
        return self

    def __exit__(self, *exc_info) -> None:
        return None


class Tier:
    """One place entries live. `remote` tiers cost a network round trip: the loader asks them
    only after every local tier missed, and counts what they hand over as pulls."""

    remote = False
    writable = False
    other_toolchains = False  # whether a build by another toolchain is served even when this one can build

    def find(self, wanted: Wanted, notes: list[str] | None = None) -> cache.CacheEntry | None:
        raise NotImplementedError

    def publish(self, entry: cache.CacheEntry, wanted: Wanted) -> str | None:
        return None

    def build_turn(self, wanted: Wanted, force: bool):
        return Turn()
