"""Every JITATTN_* environment knob, read in this one place.

Knobs are read when asked for (not at import), so tests and long-lived processes see changes;
each reader is cheap (an os.environ lookup). A value a knob cannot mean (nan, inf, a negative
time, a blank secret) is a ValueError naming the knob at its first read, never a hang or a
failure after a full compile.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

# name -> (default, one-line meaning); `jitattn doctor` and the README print this table.
KNOBS: dict[str, tuple[str, str]] = {
    "JITATTN_CACHE_DIR": ("platformdirs user cache dir", "writable cache root (a relative path is made absolute "
                                                         "against the working directory of its first read, logged)"),
    "JITATTN_CACHE_SEED_DIRS": ("", "read-only cache roots searched first (os.pathsep-separated)"),
    "JITATTN_CUDA_ARCH_LIST": ("TORCH_CUDA_ARCH_LIST, else visible GPUs", "target archs, e.g. '9.0;8.0'"),
    "JITATTN_DISABLE_JIT": ("0", "1 = strict: a cache miss raises MissingSpecializationError"),
    "JITATTN_LOCK_TIMEOUT": ("600", "seconds to wait for another process's build of the same key"),
    "JITATTN_BUILD_JOBS": ("cpu count", "ninja jobs for one build"),
    "JITATTN_VERBOSE": ("0", "1 = info logs, 2 = debug logs and compiler command lines"),
    "JITATTN_DEBUG": ("0", "1 = extra value checks on inputs and a sync + error check after launches"),
    "JITATTN_RECORD": ("", "append every specialization this process asks for to this manifest"),
    "JITATTN_WGMMA": ("1", "0 = varlen prefill on sm_90 uses the mma.sync kernels instead of wgmma"),
    "JITATTN_SPEC_OVERRIDES": ("", "varlen variants forced on top of the call rule, for benchmarks and tests: "
                                   "'family:field=value,...[@field=value,...]' entries separated by ';'"),
    # The fleet tier (jitattn/jit/remote): read only on a local miss, never on the warm path.
    "JITATTN_REMOTE_CACHE": ("", "redis://[:password@]host:port/db or rediss://...: fleet cache searched "
                                 "after the local layers, before a build"),
    "JITATTN_REMOTE_CACHE_KEY": ("", "fleet secret: remote entries are signed and checked with it (HMAC-SHA256)"),
    "JITATTN_REMOTE_CACHE_KEY_FILE": ("", "file holding the fleet secret (instead of JITATTN_REMOTE_CACHE_KEY)"),
    "JITATTN_REMOTE_CACHE_INSECURE": ("0", "1 = load remote entries that are unsigned or signed with another key "
                                           "(sha256 and key still checked)"),
    "JITATTN_REMOTE_CACHE_TTL": ("2592000", "seconds a published entry lives in Redis (0 = no expiry)"),
    "JITATTN_REMOTE_CACHE_MAX_MB": ("64", "largest entry value published or pulled, MiB"),
    "JITATTN_REMOTE_CACHE_CONNECT_TIMEOUT": ("1", "seconds to connect to Redis"),
    "JITATTN_REMOTE_CACHE_TIMEOUT": ("5", "seconds one Redis command may take"),
    "JITATTN_REMOTE_CACHE_LOCK_TTL": ("30", "seconds a fleet build lock outlives a builder that stopped renewing it"),
}
# Knobs whose values `jitattn doctor` must not print (a secret, or a URL that may carry a password).
SECRET_KNOBS = ("JITATTN_REMOTE_CACHE_KEY",)


# Knobs read on every API call (debug, wgmma) look in CPython's dict behind os.environ, which
# every os.environ write (and so monkeypatch.setenv) keeps current: os.environ.get raises and
# catches a KeyError inside Mapping.get for an unset variable. Why: notes/host-time.md, "jit/env.py".
_ENVIRON_DATA = getattr(os.environ, "_data", None)
_ENCODED: dict[str, object] = {}  # knob name -> its key in _ENVIRON_DATA
_FALSE = ("", "0", "false", "no", "off")


def _get(name: str) -> str | None:
    if _ENVIRON_DATA is None:  # another Python: the public, slower path
        return os.environ.get(name)
    key = _ENCODED.get(name)
    if key is None:
        key = _ENCODED[name] = os.environ.encodekey(name)
    raw = _ENVIRON_DATA.get(key)
    return None if raw is None else os.environ.decodevalue(raw)


def _flag(name: str) -> bool:
    value = _get(name)
    return value is not None and value.strip().lower() not in _FALSE


# Relative JITATTN_CACHE_DIR values -> the absolute path of their first read (a later chdir
# must not move the cache).
_absolute_cache_dirs: dict[str, Path] = {}


def cache_dir() -> Path:
    explicit = os.environ.get("JITATTN_CACHE_DIR")
    if explicit:
        return _explicit_cache_dir(explicit)
    path = _platform_cache_dir()
    return path if path is not None else _fallback_cache_dir()


def _explicit_cache_dir(raw: str) -> Path:
    if not raw.strip():
        raise ValueError(f"JITATTN_CACHE_DIR is blank ({raw!r}): set a directory, or unset it for the default")
    if "\0" in raw:
        raise ValueError("JITATTN_CACHE_DIR holds a NUL byte")
    path = Path(raw).expanduser()
    if path.is_absolute():
        return path
    absolute = _absolute_cache_dirs.get(raw)
    if absolute is None:
        import logging

        absolute = _absolute_cache_dirs[raw] = Path(os.path.abspath(path))
        logging.getLogger("jitattn").warning(
            "JITATTN_CACHE_DIR=%r is relative: using %s (against the working directory now); set an "
            "absolute path to choose where the cache lives", raw, absolute)
    return absolute


def cache_dir_source() -> str:
    if os.environ.get("JITATTN_CACHE_DIR"):
        return "JITATTN_CACHE_DIR"
    return "platformdirs" if _platform_cache_dir() is not None else "temp dir fallback (no usable home)"


def _platform_cache_dir() -> Path | None:
    """platformdirs' user cache dir, or None when it has no usable home to derive it from.

    Why this check exists: with HOME unset (or relative) and no passwd entry for the uid (a
    container run as an arbitrary uid), platformdirs 4.x raises a bare RuntimeError from deep
    inside jitattn's first call, and older platformdirs return the *relative* path
    '~/.cache/jitattn', so the cache silently landed in './~/.cache/jitattn' of whatever the
    current directory was. With HOME unset and a passwd home that does not exist (`nobody`:
    /nonexistent) the derived path cannot be created by a user and would be created from
    nothing by root. Those cases fall back to a per-user temp dir instead."""
    import platformdirs  # only here: a slow import (notes/host-time.md, "jit/env.py")

    try:
        path = platformdirs.user_cache_dir("jitattn")
    except RuntimeError:  # platformdirs >= 4: "could not determine the home directory"
        return None
    if not os.path.isabs(path):  # older platformdirs: '~/.cache/jitattn' left unexpanded
        return None
    if os.name == "posix" and not _is_abs_env("HOME") and not _is_abs_env("XDG_CACHE_HOME"):
        # Derived from the passwd entry: <home>/.cache/jitattn. Use it only if that home exists.
        if not os.path.isdir(os.path.dirname(os.path.dirname(path))):
            return None
    return Path(path)


def _is_abs_env(name: str) -> bool:
    return os.path.isabs(os.environ.get(name, ""))


_fallback_warned: set[str] = set()


def _fallback_cache_dir() -> Path:
    """<tempdir>/jitattn-<uid>, created private (0700). A directory there that another user owns
    or can write to is refused: its module.so files would be loaded into this process."""
    import logging
    import stat
    import tempfile

    uid = os.geteuid() if hasattr(os, "geteuid") else None
    path = Path(tempfile.gettempdir()) / (f"jitattn-{uid}" if uid is not None else "jitattn")
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError:
        # Not creatable: return it anyway. Lookups miss (seed dirs still serve), and a build
        # raises CacheNotWritable naming this path and JITATTN_CACHE_DIR.
        return path
    if uid is not None:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o022:
            from jitattn.errors import CacheNotWritable

            raise CacheNotWritable(
                f"no home directory to put the jitattn cache in (HOME is not set), and the fallback "
                f"{path} is not a private directory of uid {uid} (owner uid {st.st_uid}, mode "
                f"{stat.filemode(st.st_mode)}); set JITATTN_CACHE_DIR to a writable directory"
            )
    if str(path) not in _fallback_warned:
        _fallback_warned.add(str(path))
        logging.getLogger("jitattn").warning(
            "no usable home directory for the jitattn cache (HOME=%r); using %s. Set "
            "JITATTN_CACHE_DIR to choose a persistent cache directory.", os.environ.get("HOME"), path)
    return path


_missing_seeds_warned: set[str] = set()


def forget_warnings() -> None:
    """Warn again, once each, about a fallback cache dir or a missing seed dir, as a fresh process
    would (tests of those warnings)."""
    _fallback_warned.clear()
    _missing_seeds_warned.clear()


def seed_dirs() -> list[Path]:
    """The read-only seed roots, in order. One that is not a directory is kept (it may appear
    later) but logged once per process: a typo must not leave a fleet building silently."""
    raw = os.environ.get("JITATTN_CACHE_SEED_DIRS", "")
    paths = [Path(p).expanduser() for p in raw.split(os.pathsep) if p.strip()]
    for path in paths:
        if str(path) not in _missing_seeds_warned and not path.is_dir():
            import logging

            _missing_seeds_warned.add(str(path))
            logging.getLogger("jitattn").warning(
                "JITATTN_CACHE_SEED_DIRS names %s, which is not a directory: nothing is read from it", path)
    return paths


def arch_list_setting() -> tuple[str, str] | None:
    """(raw value, variable name) of the first arch-list variable that is set, else None."""
    for name in ("JITATTN_CUDA_ARCH_LIST", "TORCH_CUDA_ARCH_LIST"):
        value = os.environ.get(name, "").strip()
        if value:
            return value, name
    return None


def jit_disabled() -> bool:
    return _flag("JITATTN_DISABLE_JIT")


def lock_timeout() -> float:
    return _positive_float("JITATTN_LOCK_TIMEOUT", 600.0)


def build_jobs() -> int:
    raw = os.environ.get("JITATTN_BUILD_JOBS")
    if raw:
        return max(1, int(_positive_float("JITATTN_BUILD_JOBS", 1)))
    return max(1, os.cpu_count() or 1)


def verbosity() -> int:
    raw = os.environ.get("JITATTN_VERBOSE", "0").strip()
    return int(raw) if raw.isdigit() else 1


def debug() -> bool:
    return _flag("JITATTN_DEBUG")


def wgmma_enabled() -> bool:
    value = _get("JITATTN_WGMMA")
    return value is None or value.strip().lower() not in _FALSE[1:]  # set but empty: the default


def lower_mask_windows() -> bool:
    """JITATTN_LOWER_WINDOWS (default on): a mask_mod that is a window runs as the built-in window
    (jitattn/variants/window.py); 0 keeps the mask hook."""
    value = _get("JITATTN_LOWER_WINDOWS")
    return value is None or value.strip().lower() not in _FALSE[1:]


def record_path() -> Path | None:
    raw = os.environ.get("JITATTN_RECORD", "").strip()
    return Path(raw).expanduser() if raw else None


def remote_cache_url() -> str | None:
    """The fleet tier's URL, or None. With a URL set, every fleet knob is checked here, at the
    first read of the tier's configuration (a bad TTL must not surface after a full compile)."""
    raw = os.environ.get("JITATTN_REMOTE_CACHE", "").strip()
    if raw:
        check_fleet_knobs()
    return raw or None


def check_fleet_knobs() -> None:
    """A ValueError naming the first fleet knob whose value cannot be used."""
    remote_cache_ttl()
    remote_cache_max_bytes()
    remote_cache_connect_timeout()
    remote_cache_timeout()
    remote_cache_lock_ttl()
    remote_cache_secret()


def remote_cache_secret() -> str | None:
    """The fleet secret, or None when unset (or set empty). A secret of only whitespace is an
    error: it signs like a real one but is a placeholder (or a broken template) nobody meant."""
    raw = os.environ.get("JITATTN_REMOTE_CACHE_KEY")
    if raw and not raw.strip():
        raise ValueError(f"JITATTN_REMOTE_CACHE_KEY is only whitespace ({len(raw)} characters): set a real "
                         f"secret, or unset it to publish unsigned")
    return raw or None


def remote_cache_key_file() -> Path | None:
    raw = os.environ.get("JITATTN_REMOTE_CACHE_KEY_FILE", "").strip()
    return Path(raw).expanduser() if raw else None


def remote_cache_insecure() -> bool:
    return _flag("JITATTN_REMOTE_CACHE_INSECURE")


def remote_cache_ttl() -> int:
    """Seconds; 0 means published entries never expire."""
    raw = os.environ.get("JITATTN_REMOTE_CACHE_TTL", "").strip()
    if raw in ("0", "0.0"):
        return 0
    return max(1, int(_positive_float("JITATTN_REMOTE_CACHE_TTL", 2592000)))


def remote_cache_max_bytes() -> int:
    return int(_positive_float("JITATTN_REMOTE_CACHE_MAX_MB", 64) * 2**20)


def remote_cache_connect_timeout() -> float:
    return _positive_float("JITATTN_REMOTE_CACHE_CONNECT_TIMEOUT", 1.0)


def remote_cache_timeout() -> float:
    return _positive_float("JITATTN_REMOTE_CACHE_TIMEOUT", 5.0)


def remote_cache_lock_ttl() -> float:
    return _positive_float("JITATTN_REMOTE_CACHE_LOCK_TTL", 30.0)


def shown(name: str) -> str | None:
    """A knob's value as `jitattn doctor` prints it: secrets and URL passwords masked."""
    value = os.environ.get(name)
    if value is None or name not in SECRET_KNOBS and name != "JITATTN_REMOTE_CACHE":
        return value
    if name in SECRET_KNOBS:
        return f"(set, {len(value.encode())} bytes, not shown)"
    return redact_url(value)


def redact_url(url: str) -> str:
    """redis://:secret@host:6379/0 -> redis://:***@host:6379/0 (for logs and messages)."""
    import re

    return re.sub(r"^([a-z][a-z0-9+.-]*://)([^@/]*)@", lambda m: m.group(1) + (
        m.group(2).split(":", 1)[0] + ":***" if ":" in m.group(2) else "***") + "@", url.strip())


def cuda_home_setting() -> str | None:
    for name in ("CUDA_HOME", "CUDA_PATH"):
        value = os.environ.get(name)
        if value:
            return value
    return None


def host_compiler_setting() -> str | None:
    return os.environ.get("CXX") or None


def _positive_float(name: str, default: float) -> float:
    """A knob's value as a finite number > 0 (unset or empty: `default`), else a ValueError
    naming the knob: nan would wait forever, inf never time out, 0 or less mean nothing."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {raw!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {raw!r}")
    return value


# ---- JITATTN_SPEC_OVERRIDES: variants forced on top of the call rule (jitattn/varlen/overrides.py)
_SPEC_OVERRIDES: dict[str | None, tuple] = {None: ()}  # the knob's text -> its parse


def spec_overrides() -> tuple:
    """JITATTN_SPEC_OVERRIDES parsed: ((family, when, fields), ...), `when` and `fields` tuples of
    (field, text) pairs. Syntax: entries `family:field=value,...[@field=value,...]` separated by
    ';' (the `@` part: only calls whose chosen spec has those values). Read on every call, parsed
    once per distinct value; the spec family types and validates the values."""
    raw = _get("JITATTN_SPEC_OVERRIDES")
    parsed = _SPEC_OVERRIDES.get(raw)
    if parsed is None:
        parsed = _SPEC_OVERRIDES[raw] = _parse_spec_overrides(raw)
    return parsed


def _parse_spec_overrides(raw: str) -> tuple:
    def pairs(text: str, entry: str) -> tuple:
        out = []
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, sep, value = item.partition("=")
            if not sep or not name.strip() or not value.strip():
                raise ValueError(f"JITATTN_SPEC_OVERRIDES: {item!r} in {entry!r} is not field=value")
            out.append((name.strip(), value.strip()))
        return tuple(out)

    entries = []
    for entry in filter(None, (part.strip() for part in raw.split(";"))):
        family, sep, rest = entry.partition(":")
        fields, _, when = rest.partition("@")
        if not sep or not family.strip() or not fields.strip():
            raise ValueError(f"JITATTN_SPEC_OVERRIDES: {entry!r} is not family:field=value,...[@field=value,...] "
                             "(e.g. 'varlen_backward:persistent=0')")
        entries.append((family.strip(), pairs(when, entry), pairs(fields, entry)))
    return tuple(entries)
