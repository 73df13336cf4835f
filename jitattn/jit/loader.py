"""get_module(spec): the one way a kernel module is obtained.

Warm path (what every call after the first takes): a dict lookup. First use in a process:
find a verified entry in a local cache tier (read-only seed dirs first, then the writable root)
and load its .so — no lock, no subprocess, no ninja, no compiler probe (toolchain versions come
from an on-disk memo), and no hash of a .so a full hash already verified unchanged (cache.read_entry's
stamps). Only on a miss: `build_and_load` — ask the remote tiers, then (unless strict mode is
on) lock the key, look again, build in staging, publish, load. The tiers are `jit.tiers`.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from jitattn.errors import CacheNotWritable, MissingSpecializationError, ToolchainError
from jitattn.jit import cache, env, keys, tiers, toolchain
from jitattn.jit.spec import KernelSpec

log = logging.getLogger("jitattn")

_modules: dict[KernelSpec, "LoadedModule"] = {}
_loaded_namespaces: dict[str, str] = {}  # op namespace -> key, for this process
_process_lock = threading.RLock()
COMPILE_COUNT = 0  # compiles done by this process (tests and tools read it)
PULL_COUNT = 0  # entries this process pulled from a remote tier


class LoadedModule:
    """A loaded specialization: its spec, cache entry and op namespace (torch.ops.<namespace>)."""

    __slots__ = ("spec", "entry", "ops")

    def __init__(self, spec: KernelSpec, entry: cache.CacheEntry, ops):
        self.spec = spec
        self.entry = entry
        self.ops = ops

    def __getattr__(self, op_name: str):
        return getattr(self.ops, op_name)


def op_namespace(spec: KernelSpec, key: str) -> str:
    """torch.ops namespace of one build: two builds of a spec (new templates, archs or
    compiler) never register the same namespace in one process."""
    return f"jitattn_{spec.name}_{key[:16]}"


def get_module(spec: KernelSpec) -> LoadedModule:
    module = _modules.get(spec)
    if module is None:
        with _process_lock:
            module = _modules.get(spec) or _first_use(spec)
            _modules[spec] = module
    return module


@contextlib.contextmanager
def forget_loaded(namespaces: bool = False) -> Iterator[None]:
    """Within the block this process has loaded no module: `get_module` looks each spec up again
    (recorder, tiers, `load_entry`), for tests and tools that rebuild or stand in for the loader.
    `namespaces` also forgets which op namespaces were registered: only where no real library
    loads inside the block (torch aborts on a second registration). After it, what was loaded is
    remembered again."""
    with _process_lock:
        saved = dict(_modules), dict(_loaded_namespaces)
        _modules.clear()
        if namespaces:
            _loaded_namespaces.clear()
    try:
        yield
    finally:
        with _process_lock:
            _modules.clear()
            _modules.update(saved[0])
            if namespaces:
                _loaded_namespaces.clear()
                _loaded_namespaces.update(saved[1])


def layers() -> list[Path]:
    """Cache roots searched in order: read-only seed dirs, then the writable root."""
    return tiers.roots(tiers.from_env())


def current_target(spec: KernelSpec, root: Path | None = None) -> keys.BuildTarget:
    archs = spec.archs_for(toolchain.target_archs()[0])
    tc = toolchain.fingerprint(memo_dir=root or env.cache_dir())
    return keys.BuildTarget(archs, tc.nvcc_release, tc.host_cxx_version)


def wanted(spec: KernelSpec) -> tiers.Wanted:
    """What a call of `spec` looks for in the tiers: the exact build this process would make, or
    (strict mode, which never probes a compiler; or no usable toolchain) any toolchain's build."""
    archs = spec.archs_for(toolchain.target_archs()[0])
    loose = tiers.Wanted(spec, archs, toolchain.arch_tag(archs))
    if env.jit_disabled():
        return loose
    try:
        tc = toolchain.fingerprint(memo_dir=env.cache_dir())
    except ToolchainError:
        return loose  # build_and_load says why when it must build
    target = keys.BuildTarget(archs, tc.nvcc_release, tc.host_cxx_version)
    parts = keys.components(spec, target)
    return tiers.Wanted(spec, archs, loose.arch_tag, target, parts, keys.key_of(parts))


def find_local(want: tiers.Wanted) -> cache.CacheEntry | None:
    """The entry the local tiers (seeds, writable root) hold for `want`, or None."""
    return tiers.find_local(want, tiers.from_env())


def is_cached(spec: KernelSpec) -> bool:
    """Whether a call would load `spec` without compiling or pulling (no lock, no build)."""
    return find_local(wanted(spec)) is not None


def _first_use(spec: KernelSpec) -> LoadedModule:
    from jitattn.jit.record import record_spec

    record_spec(spec)
    want = wanted(spec)
    entry = tiers.find_local(want, tiers.from_env())
    return load_entry(spec, entry) if entry is not None else build_and_load(spec)


def build_and_load(spec: KernelSpec, force: bool = False) -> LoadedModule:
    """The cold path: pull from a remote tier, else lock the key, look again, build, publish to
    every tier, load. `force` rebuilds over a valid entry (replacing it), asks no remote tier and
    waits for no other builder. Raises MissingSpecializationError (strict mode) or ToolchainError when
    nothing can be found and this process cannot build."""
    global PULL_COUNT
    from jitattn.jit.lock import key_lock

    chain, want, notes = tiers.from_env(), wanted(spec), []
    if force:
        notes.append("not asked (forced rebuild)" if any(t.remote for t in chain) else tiers.NO_REMOTE)
    else:
        entry, _ = tiers.find_remote(want, chain, notes)
        if entry is not None:
            PULL_COUNT += 1
            return load_entry(spec, entry)
    if want.key is None:
        raise _cannot_build(spec, want, chain, notes)
    home = tiers.writable(chain)
    _check_buildable_here(spec, want, home.root)
    with key_lock(home.root / cache.LOCKS, want.key, spec.name, env.lock_timeout()):
        entry = None if force else home.find(want)  # another process may have built it meanwhile
        if entry is not None:
            return load_entry(spec, entry)
        # One build per fleet: a tier may hand over what another node built while this one waited.
        with tiers.build_turns(chain, want, force) as (handed, by):
            if handed is not None:
                PULL_COUNT += 1 if by.remote else 0
                return load_entry(spec, handed)
            entry = _build(spec, want, home, force)
            for tier in chain:
                if tier is not home:
                    tier.publish(entry, want)  # before the build turns end, so waiters find it
    # cpp_extension.load already loaded the library from staging; register it under its entry.
    return _register(spec, entry)


def _cannot_build(spec, want: tiers.Wanted, chain, notes: list[str]) -> Exception:
    """Why nothing could be loaded and this process may not build: strict mode's miss (what
    was searched, the nearest entry), or the toolchain that cannot be used."""
    if env.jit_disabled():
        _, nearest = tiers.compatible(tiers.roots(chain), want)
        error = MissingSpecializationError(_missing_message(spec, want.archs, want.arch_tag, nearest))
    else:
        try:
            toolchain.fingerprint(memo_dir=env.cache_dir())
            why = "the toolchain changed while it was being probed"
        except ToolchainError as exc:
            why = str(exc)
        error = ToolchainError(f"{spec.name} is not cached and cannot be built: {why}")
    return type(error)(f"{error}\n  remote: {'; '.join(notes)}")


def _check_buildable_here(spec, want: tiers.Wanted, root: Path) -> None:
    _ensure_writable(root)
    if op_namespace(spec, want.key) in _loaded_namespaces:
        # Loading a second library that registers the same ops would abort the process.
        raise RuntimeError(
            f"{spec.name} (key {want.key[:16]}) is already loaded in this process and cannot be rebuilt "
            "here; rebuild it from a fresh process, e.g. `jitattn prewarm --force`"
        )


def _build(spec, want: tiers.Wanted, home: tiers.DirTier, force: bool) -> cache.CacheEntry:
    """Compile `spec` in a staging dir and publish it into the writable tier (under the key's
    lock); the verified entry."""
    global COMPILE_COUNT
    final = home.entry_path(want)
    reason = "forced" if force else f"corrupt entry ({cache.why_invalid(final)})" if final.exists() else "miss"
    staging = cache.new_staging_dir(home.root)
    try:
        seconds = _compile(spec, want, staging, home.root, reason, final)
        entry = home.commit(staging, want, replace=force)
    finally:
        cache.discard_staging(staging)  # a failed build's; releases the hold `cache prune` respects
    COMPILE_COUNT += 1
    log.info("compiled %s in %.1f s -> %s", spec.name, seconds, final)
    if entry is None:
        raise cache_error(final)
    return entry


def _compile(spec, want: tiers.Wanted, staging: Path, root: Path, reason: str, final: Path) -> float:
    """Render and compile `spec` into `staging`, manifest last; the compile's seconds."""
    import socket

    from jitattn.jit.build import compile_library
    from jitattn.jit.render import render

    namespace = op_namespace(spec, want.key)
    sources = {name: text for name, text in render(spec, namespace).items() if text.strip()}  # empty: no unit
    for name, text in sources.items():
        (staging / name).write_text(text)
    log.info("compiling %s (%s) for %s into %s", spec.name, reason, ",".join(want.target.archs), final)
    tc = toolchain.fingerprint(memo_dir=root)
    seconds = compile_library(
        staging, sources, spec_name=spec.name, ext_name=f"jitattn_{want.key[:16]}",
        archs=want.target.archs, toolchain=tc, jobs=env.build_jobs(), log_dir=root / "logs",
        verbose=env.verbosity() >= 2,
    )
    cache.write_manifest(staging, {
        "key": want.key,
        "name": spec.name,
        "op_namespace": namespace,
        "components": want.components,
        "built": {"seconds": round(seconds, 3), "host": socket.gethostname(), "time": time.time()},
    })
    return seconds


def _missing_message(spec, archs, arch_tag, nearest) -> str:
    wanted = keys.components(spec, keys.BuildTarget(archs, "*", "*"))
    lines = [
        f"{spec.name} is not in the cache and JITATTN_DISABLE_JIT=1 forbids compiling it.",
        f"  wanted: templates {wanted['templates'][:16]}, archs {list(archs)}, schema {keys.CACHE_SCHEMA}, "
        f"content key (toolchain-independent) {keys.key_of(wanted)[:16]}",
        f"  searched: {', '.join(str(p / keys.CACHE_SCHEMA / arch_tag) for p in layers())}",
    ]
    if nearest is None:
        lines.append("  no entry of this name exists for these archs; prewarm it: "
                     f"`jitattn prewarm --spec '{spec.to_dict()}' --arch {';'.join(archs)}`")
    else:
        path, diff = nearest
        entry = cache.read_entry(path)
        detail = []
        for name in diff:
            theirs = entry.components.get(name) if entry else None
            detail.append(f"{name}: cached {theirs!r} vs wanted {wanted.get(name)!r}" if entry else name)
        lines.append(f"  nearest cached entry: {path}")
        lines.append("  differs in: " + "; ".join(detail))
    return "\n".join(lines)


def cache_error(path: Path) -> RuntimeError:
    return RuntimeError(f"published cache entry {path} does not verify: {cache.why_invalid(path)}")


def _ensure_writable(root: Path) -> None:
    try:
        # The probe sits under staging/, so one left by a process killed between its write and
        # its unlink is litter that `cache prune` removes, never a stray file in the root.
        staging = root / cache.STAGING
        staging.mkdir(parents=True, exist_ok=True)
        probe = staging / f".write-probe.{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        # A root that exists as a file made this say "(File exists)": name the real problem.
        why = "it is not a directory" if root.exists() and not root.is_dir() else exc.strerror
        raise CacheNotWritable(
            f"a kernel must be compiled but the cache root {root} is not writable ({why}); "
            "set JITATTN_CACHE_DIR to a writable directory, or prewarm the cache"
        ) from None


def load_entry(spec: KernelSpec, entry: cache.CacheEntry) -> LoadedModule:
    """Load a verified cache entry's library into this process and register its ops: the one
    place a cached .so enters the process (tests stand in for it to load nothing)."""
    import torch

    namespace = entry.manifest["op_namespace"]
    if namespace not in _loaded_namespaces:
        torch.ops.load_library(str(entry.library))
    return _register(spec, entry)


def _register(spec: KernelSpec, entry: cache.CacheEntry) -> LoadedModule:
    import torch

    namespace = entry.manifest["op_namespace"]
    known = _loaded_namespaces.setdefault(namespace, entry.key)
    if known != entry.key:
        raise RuntimeError(
            f"op namespace {namespace} is already loaded from another build ({known[:16]}) in this "
            f"process; cannot also load {entry.path}"
        )
    return LoadedModule(spec, entry, getattr(torch.ops, namespace))


def build_spec(spec: KernelSpec, force: bool = False) -> tuple[LoadedModule, bool]:
    """Prewarm: make sure `spec` is cached for the current target; (module, compiled?)."""
    before = COMPILE_COUNT
    with _process_lock:
        module = build_and_load(spec, force=True) if force else _first_use(spec)
        _modules[spec] = module
    return module, COMPILE_COUNT > before
