"""get_module(spec): the one way a kernel module is obtained.

Warm path (what every call after the first takes): a dict lookup. First use in a process:
find a verified entry in a cache layer (read-only seed dirs first, then the writable root) and
load its .so — no lock, no subprocess, no ninja, no compiler probe (toolchain versions come from
an on-disk memo), and no hash of a .so a full hash already verified unchanged (cache.read_entry's
stamps, kept in the writable root). Only on a miss, and unless strict mode is on: lock(key),
look again, render, build in staging, publish with one rename, manifest last, load.
"""
from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from pathlib import Path

from jitattn.errors import CacheNotWritable, MissingSpecializationError, ToolchainError
from jitattn.jit import cache, env, keys, toolchain
from jitattn.jit.spec import KernelSpec

log = logging.getLogger("jitattn")

_modules: dict[KernelSpec, "LoadedModule"] = {}
_loaded_namespaces: dict[str, str] = {}  # op namespace -> key, for this process
_process_lock = threading.RLock()
COMPILE_COUNT = 0  # compiles done by this process (tests and tools read it)
PULL_COUNT = 0  # entries this process pulled from the fleet tier


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
            module = _modules.get(spec) or _find_or_build(spec)
            _modules[spec] = module
    return module


def layers() -> list[Path]:
    """Cache roots searched in order: read-only seed dirs, then the writable root."""
    return [*env.seed_dirs(), env.cache_dir()]


def current_target(spec: KernelSpec, root: Path | None = None) -> keys.BuildTarget:
    archs = spec.archs_for(toolchain.target_archs()[0])
    tc = toolchain.fingerprint(memo_dir=root or env.cache_dir())
    return keys.BuildTarget(archs, tc.nvcc_release, tc.host_cxx_version)


class _Lookup:
    """What the cache layers hold for a spec, and how to build it if they hold nothing:
    `build` is (target, components, key) when this process may build, `failure` why it
    cannot when it may not."""

    __slots__ = ("entry", "archs", "arch_tag", "build", "failure")

    def __init__(self, entry, archs, arch_tag, build=None, failure=None):
        self.entry, self.archs, self.arch_tag = entry, archs, arch_tag
        self.build, self.failure = build, failure


def _lookup(spec: KernelSpec, force: bool = False) -> _Lookup:
    root = env.cache_dir()
    archs = spec.archs_for(toolchain.target_archs()[0])
    arch_tag = toolchain.arch_tag(archs)
    if not env.jit_disabled():  # strict mode never builds, so it never probes a compiler
        try:
            tc = toolchain.fingerprint(memo_dir=root)
        except ToolchainError as exc:
            tc, no_toolchain = None, exc
        if tc is not None:
            target = keys.BuildTarget(archs, tc.nvcc_release, tc.host_cxx_version)
            parts = keys.components(spec, target)
            key = keys.key_of(parts)
            build = (target, parts, key)
            if force:
                return _Lookup(None, archs, arch_tag, build)
            for layer in layers():
                path = cache.entry_path(layer, keys.CACHE_SCHEMA, arch_tag, spec.name, key)
                entry = cache.read_entry(path, key, stamps=root / cache.STAMPS)
                if entry is not None:
                    return _Lookup(entry, archs, arch_tag)
            # Seed layers are deliberate artifacts (CI's pinned toolchain): trust them whatever
            # compiler this machine has, as long as the binary interface matches.
            entry, _ = _find_compatible(spec, archs, arch_tag, env.seed_dirs())
            return _Lookup(entry, archs, arch_tag, build)
    # Strict mode, or no toolchain to build with: any entry whose binary interface matches.
    entry, nearest = _find_compatible(spec, archs, arch_tag, layers())
    if env.jit_disabled():
        failure = MissingSpecializationError(_missing_message(spec, archs, arch_tag, nearest))
    else:
        failure = ToolchainError(f"{spec.name} is not cached and cannot be built: {no_toolchain}")
    return _Lookup(entry, archs, arch_tag, failure=failure)


def is_cached(spec: KernelSpec) -> bool:
    """Whether a call would load `spec` without compiling (no lock, no build)."""
    return _lookup(spec).entry is not None


def _find_or_build(spec: KernelSpec, force: bool = False) -> LoadedModule:
    from jitattn.jit.record import record_spec

    record_spec(spec)
    found = _lookup(spec, force)
    if found.entry is not None:
        return _load(spec, found.entry)
    fleet = _fleet()  # after the local layers, before a build; None when no remote is set
    note = "none (JITATTN_REMOTE_CACHE is not set)" if fleet is None else "not asked (forced rebuild)"
    if fleet is not None and not force:
        entry, note = fleet.pull(spec, found.archs, found.arch_tag, found.build)
        if entry is not None:
            return _pulled(spec, entry)
    if found.build is None:
        raise type(found.failure)(f"{found.failure}\n  remote: {note}")
    target, parts, key = found.build
    return _build(spec, target, parts, key, env.cache_dir(), found.arch_tag, reason="forced" if force else "miss",
                  fleet=fleet)


def _fleet():
    if env.remote_cache_url() is None:  # keep the remote package (and redis) off every local path
        return None
    from jitattn.jit import remote

    return remote.tier()


def _pulled(spec: KernelSpec, entry: cache.CacheEntry) -> LoadedModule:
    global PULL_COUNT
    PULL_COUNT += 1
    return _load(spec, entry)


def _fleet_turn(fleet, spec: KernelSpec, key: str, root: Path, arch_tag: str, forced: bool):
    """The fleet's build lock for `key` (taken inside the node's file lock), or a stand-in."""
    if fleet is None:
        from contextlib import nullcontext

        return nullcontext(None)
    from jitattn.jit import remote

    rel = remote.entry_rel(arch_tag, spec.name, key)
    return remote.NoTurn(fleet, rel) if forced else fleet.build_turn(spec.name, key, rel, root)


def _find_compatible(spec, archs, arch_tag, roots):
    """(verified entry matching everything but the toolchain, nearest other entry + diff)."""
    wanted = keys.components(spec, keys.BuildTarget(archs, "", ""))
    nearest = None
    stamps = env.cache_dir() / cache.STAMPS
    for layer in roots:
        for path in reversed(cache.siblings(layer, keys.CACHE_SCHEMA, arch_tag, spec.name)):
            entry = cache.read_entry(path, stamps=stamps)
            if entry is None:
                nearest = nearest or (path, [f"entry does not verify: {cache.why_invalid(path)}"])
                continue
            diff = [d for d in keys.differing(wanted, entry.components) if d not in keys.TOOLCHAIN_COMPONENTS]
            if not diff:
                return entry, None
            if nearest is None or len(diff) < len(nearest[1]):
                nearest = (path, diff)
    return None, nearest


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


def _build(spec, target, parts, key, root, arch_tag, reason, fleet=None) -> LoadedModule:
    import contextlib
    import socket

    from jitattn.jit.build import compile_library
    from jitattn.jit.lock import key_lock
    from jitattn.jit.render import render

    global COMPILE_COUNT
    final = cache.entry_path(root, keys.CACHE_SCHEMA, arch_tag, spec.name, key)
    _ensure_writable(root)
    namespace = op_namespace(spec, key)
    if namespace in _loaded_namespaces:
        # Loading a second library that registers the same ops would abort the process.
        raise RuntimeError(
            f"{spec.name} (key {key[:16]}) is already loaded in this process and cannot be rebuilt "
            "here; rebuild it from a fresh process, e.g. `jitattn prewarm --force`"
        )
    with key_lock(root / cache.LOCKS, key, spec.name, env.lock_timeout()), contextlib.ExitStack() as held:
        if reason != "forced":
            entry = cache.read_entry(final, key, stamps=root / cache.STAMPS)  # another process may have built it
            if entry is not None:
                return _load(spec, entry)
        # One build per fleet: wait for this key's fleet lock, or for another node's result.
        turn = held.enter_context(_fleet_turn(fleet, spec, key, root, arch_tag, reason == "forced"))
        if turn is not None and turn.pulled is not None:
            return _pulled(spec, turn.pulled)
        if reason != "forced" and final.exists():
            reason = f"corrupt entry ({cache.why_invalid(final)})"
        staging = cache.new_staging_dir(root)
        try:
            sources = render(spec, namespace)
            for name, text in sources.items():
                (staging / name).write_text(text)
            log.info("compiling %s (%s) for %s into %s", spec.name, reason, ",".join(target.archs), final)
            tc = toolchain.fingerprint(memo_dir=root)
            seconds = compile_library(
                staging, sources, spec_name=spec.name, ext_name=f"jitattn_{key[:16]}",
                archs=target.archs, toolchain=tc, jobs=env.build_jobs(), log_dir=root / "logs",
                verbose=env.verbosity() >= 2,
            )
            cache.write_manifest(staging, {
                "key": key,
                "name": spec.name,
                "op_namespace": namespace,
                "components": parts,
                "built": {"seconds": round(seconds, 3), "host": socket.gethostname(), "time": time.time()},
            })
            entry = cache.read_entry(cache.publish(staging, final, replace=reason == "forced"), key,
                                     stamps=root / cache.STAMPS)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
        COMPILE_COUNT += 1
        log.info("compiled %s in %.1f s -> %s", spec.name, seconds, final)
        if turn is not None and entry is not None:
            turn.share(entry)  # before the fleet lock is released, so its waiters find it
    if entry is None:
        raise cache_error(final)
    # load_inline already loaded the library from staging; register it under its entry.
    return _register(spec, entry)


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


def _load(spec: KernelSpec, entry: cache.CacheEntry) -> LoadedModule:
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
        module = _find_or_build(spec, force=force)
        _modules[spec] = module
    return module, COMPILE_COUNT > before
