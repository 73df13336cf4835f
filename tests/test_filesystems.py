"""Read-only and hostile filesystems: a read-only warm cache loads, a read-only cold cache says
what to do, a cache root with spaces and non-ASCII characters works, and HOME unset still gives
a usable cache directory (or a clear error).

Read-only roots need a process that obeys permission bits; when the tests run as root (chmod does
not stop root) the child runs as root without the capabilities that bypass them, or as `nobody`
(see tests/procs.unprivileged_prefix), and the tests skip with the reason if neither works.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from jitattn.errors import CacheNotWritable
from jitattn.jit import cache, env, keys
from jitattn.decode.spec import DecodeSpec
from tests.conftest import require_nvcc
from tests.procs import ARCH_TAG, REPO, child_env, last_json, make_read_only, make_writable, run_child, tree, \
    unprivileged_prefix

SPEC = DecodeSpec(head_dim=64, dtype_q="bfloat16", dtype_kv="bfloat16")
OTHER = DecodeSpec(head_dim=128, dtype_q="bfloat16", dtype_kv="bfloat16")

# get_module(spec) in a child; reports what happened, including a failure's type and message.
GET = """
    import json, sys
    from jitattn.jit import cache, loader
    from jitattn.jit.registry import spec_from_dict
    report = {}
    try:
        module = loader.get_module(spec_from_dict(json.loads(sys.argv[1])))
        report.update(entry=str(module.entry.path), has_ops=hasattr(module.ops, "ctas_per_sm"),
                      verified=cache.why_invalid(module.entry.path) is None)
    except Exception as exc:
        report.update(error=type(exc).__name__, message=str(exc))
    report["compiles"] = loader.COMPILE_COUNT
    print(json.dumps(report))
"""


def get_module_in_child(spec, env: dict, prefix=None, timeout=180) -> tuple[dict, str]:
    result = run_child(GET, env, prefix=list(prefix or []), args=[json.dumps(spec.to_dict())], timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return last_json(result.stdout), result.stderr


def drop_privileges(tmp_path: Path) -> tuple[str, ...]:
    prefix, how = unprivileged_prefix(str(tmp_path.parent))
    if prefix is None:
        pytest.skip(how)
    print(f"\nread-only checks run as: {how}")
    return prefix


@pytest.fixture(scope="module")
def warm(tmp_path_factory) -> Path:
    """A cache root holding SPEC, built by a child process."""
    require_nvcc()
    root = tmp_path_factory.mktemp("warm") / "cache"
    report, err = get_module_in_child(SPEC, child_env(root))
    assert "error" not in report, report
    assert report["compiles"] == 1 and report["verified"], (report, err[-2000:])
    return root


@pytest.fixture
def read_only_copy(warm, tmp_path):
    """A copy of the warm root, made read-only (files and directories); restored afterwards."""
    root = tmp_path / "ro-cache"
    shutil.copytree(warm, root)
    make_read_only(root)
    yield root
    make_writable(root)


# ----------------------------------------------------------------------------- read-only roots


@pytest.mark.compile
@pytest.mark.parametrize("strict", [False, True], ids=["jit", "strict"])
def test_read_only_warm_cache_loads_without_writing_anything(read_only_copy, tmp_path, strict):
    prefix = drop_privileges(tmp_path)
    root = read_only_copy
    before = tree(root)
    extra = {"JITATTN_DISABLE_JIT": "1"} if strict else {}
    report, err = get_module_in_child(SPEC, child_env(root, JITATTN_VERBOSE="1", **extra), prefix)
    assert "error" not in report, (report, err[-3000:])
    assert report["compiles"] == 0 and "compiling" not in err
    assert report["verified"] and report["has_ops"]
    assert Path(report["entry"]).parent.parent.parent == root
    assert tree(root) == before  # no lock, memo, staging dir, log or probe file was written


@pytest.mark.compile
def test_read_only_cache_with_a_cold_spec_raises_cache_not_writable(read_only_copy, tmp_path):
    prefix = drop_privileges(tmp_path)
    root = read_only_copy
    before = tree(root)
    report, err = get_module_in_child(OTHER, child_env(root, JITATTN_VERBOSE="1"), prefix)
    assert report.get("error") == "CacheNotWritable", (report, err[-3000:])
    assert str(root) in report["message"] and "JITATTN_CACHE_DIR" in report["message"]
    assert "not writable" in report["message"] and "Permission denied" in report["message"]
    assert report["compiles"] == 0 and "compiling" not in err
    assert tree(root) == before


@pytest.mark.compile
@pytest.mark.parametrize("case", ["empty read-only root", "missing root under a read-only parent"])
def test_read_only_empty_cache_raises_cache_not_writable_naming_the_root(tmp_path, case):
    require_nvcc()
    prefix = drop_privileges(tmp_path)
    parent = tmp_path / "ro-parent"
    parent.mkdir()
    root = parent / "cache"
    if case == "empty read-only root":
        root.mkdir()
    make_read_only(parent)
    try:
        report, err = get_module_in_child(SPEC, child_env(root, JITATTN_VERBOSE="1"), prefix)
        assert report.get("error") == "CacheNotWritable", (report, err[-3000:])
        assert str(root) in report["message"] and "JITATTN_CACHE_DIR" in report["message"]
        assert report["compiles"] == 0 and "compiling" not in err
        assert sorted(p.name for p in parent.iterdir()) == (["cache"] if root.exists() else [])
        assert not root.exists() or list(root.iterdir()) == []
    finally:
        make_writable(parent)


@pytest.mark.compile
def test_cache_root_that_is_a_regular_file_raises_cache_not_writable(tmp_path, monkeypatch):
    """Works as root too: no permission bit is involved."""
    require_nvcc()
    root = tmp_path / "cache-file"
    root.write_text("not a directory")
    report, err = get_module_in_child(SPEC, child_env(root))
    assert report.get("error") == "CacheNotWritable", (report, err[-3000:])
    assert str(root) in report["message"] and "JITATTN_CACHE_DIR" in report["message"]
    assert "not a directory" in report["message"]
    assert root.read_text() == "not a directory" and report["compiles"] == 0


# ----------------------------------------------------------------------------- odd paths


@pytest.mark.compile
def test_cache_root_with_spaces_and_non_ascii_characters_builds_and_loads_warm(tmp_path):
    require_nvcc()
    root = tmp_path / "cache dir ü 例" / "jit tä"
    report, err = get_module_in_child(SPEC, child_env(root, JITATTN_VERBOSE="1"))
    assert "error" not in report, (report, err[-3000:])
    assert report["compiles"] == 1 and report["verified"] and report["has_ops"]
    entry = Path(report["entry"])
    assert entry.parent == root / keys.CACHE_SCHEMA / ARCH_TAG and cache.why_invalid(entry) is None
    assert f"compiling {SPEC.name} (miss)" in err and str(root) in err

    report, err = get_module_in_child(SPEC, child_env(root))  # a new process: warm load
    assert "error" not in report, (report, err[-3000:])
    assert report["compiles"] == 0 and report["entry"] == str(entry)

    # The CLI prints such paths (whatever the locale's encoding) and verifies the entry.
    cli = "from jitattn.cli import main; raise SystemExit(main(sys.argv[1:]))"
    listing = run_child("import sys; " + cli, child_env(root, LC_ALL="C"), args=["cache", "list"])
    assert listing.returncode == 0, listing.stderr
    assert f"{root} (writable)" in listing.stdout and f"{entry.relative_to(root)}" in listing.stdout
    assert listing.stdout.rstrip().endswith("ok")
    verify = run_child("import sys; " + cli, child_env(root), args=["cache", "verify"])
    assert verify.returncode == 0 and "1 ok, 0 invalid" in verify.stdout, verify.stdout + verify.stderr


# ----------------------------------------------------------------------------- HOME unset


@pytest.fixture
def no_home(monkeypatch, tmp_path):
    """HOME, XDG_CACHE_HOME and JITATTN_CACHE_DIR unset; temp dir redirected under tmp_path;
    the once-per-process fallback warning re-armed. Returns a setter for the passwd home."""
    for name in ("HOME", "XDG_CACHE_HOME", "JITATTN_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    env.forget_warnings()
    import pwd

    def passwd_home(home: str | None):
        """None: this uid has no passwd entry (a container run with an arbitrary uid)."""
        real = pwd.getpwuid

        def getpwuid(uid):
            if home is None:
                raise KeyError(f"getpwuid(): uid not found: {uid}")
            entry = real(uid)
            return pwd.struct_passwd((entry.pw_name, entry.pw_passwd, entry.pw_uid, entry.pw_gid,
                                      entry.pw_gecos, home, entry.pw_shell))

        monkeypatch.setattr(pwd, "getpwuid", getpwuid)

    return tmp, passwd_home


def fallback(tmp: Path) -> Path:
    return tmp / f"jitattn-{os.geteuid()}"


def test_home_unset_uses_the_passwd_home_when_it_exists(no_home, tmp_path):
    _, passwd_home = no_home
    home = tmp_path / "home" / "user"
    home.mkdir(parents=True)
    passwd_home(str(home))
    assert env.cache_dir() == home / ".cache" / "jitattn"
    assert env.cache_dir_source() == "platformdirs"
    assert not (home / ".cache").exists()  # asking for the path creates nothing


@pytest.mark.parametrize("home_var", [None, "", "relative/home"], ids=["unset", "empty", "relative"])
def test_home_unusable_and_no_passwd_entry_falls_back_to_a_private_temp_dir(no_home, monkeypatch, caplog, home_var):
    tmp, passwd_home = no_home
    if home_var is not None:
        monkeypatch.setenv("HOME", home_var)
    passwd_home(None)
    with caplog.at_level(logging.WARNING, logger="jitattn"):
        root = env.cache_dir()
        assert env.cache_dir() == root  # stable, and warned about once
    assert root == fallback(tmp)
    assert root.is_dir() and stat.S_IMODE(root.stat().st_mode) == 0o700 and root.stat().st_uid == os.geteuid()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(root) in warnings[0] and "JITATTN_CACHE_DIR" in warnings[0]
    assert "temp dir fallback" in env.cache_dir_source()


def test_home_unset_and_a_passwd_home_that_does_not_exist_falls_back(no_home, tmp_path):
    tmp, passwd_home = no_home
    passwd_home(str(tmp_path / "nonexistent"))  # like `nobody`: /nonexistent
    assert env.cache_dir() == fallback(tmp)
    assert not (tmp_path / "nonexistent").exists()


def test_xdg_cache_home_still_wins_without_home(no_home, monkeypatch, tmp_path):
    _, passwd_home = no_home
    passwd_home(None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert env.cache_dir() == tmp_path / "xdg" / "jitattn"


@pytest.mark.parametrize("hostile", ["world-writable", "owned by another user", "a symlink"])
def test_a_fallback_dir_another_user_could_have_planted_is_refused(no_home, tmp_path, hostile):
    tmp, passwd_home = no_home
    passwd_home(None)
    planted = fallback(tmp)
    if hostile == "world-writable":
        planted.mkdir()
        planted.chmod(0o777)
    elif hostile == "owned by another user":
        if os.geteuid() != 0:
            pytest.skip("only root can make a directory owned by another user")
        planted.mkdir(mode=0o700)
        os.chown(planted, 65534, 65534)
    else:
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        planted.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CacheNotWritable) as info:
        env.cache_dir()
    message = str(info.value)
    assert str(planted) in message and "JITATTN_CACHE_DIR" in message and "HOME" in message


def test_an_uncreatable_fallback_is_returned_for_a_build_to_report(no_home, monkeypatch, tmp_path):
    """No writable temp dir either: lookups (seed dirs) still work; a build then raises
    CacheNotWritable naming the path (see the read-only tests)."""
    _, passwd_home = no_home
    passwd_home(None)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no" / "such" / "tmp"))
    assert env.cache_dir() == tmp_path / "no" / "such" / "tmp" / f"jitattn-{os.geteuid()}"


@pytest.mark.compile
def test_a_process_without_home_or_passwd_entry_builds_into_the_fallback_and_loads_warm(tmp_path):
    """End to end: a child with HOME, XDG_CACHE_HOME and JITATTN_CACHE_DIR unset whose uid has
    no passwd entry (simulated: pwd.getpwuid raises KeyError, as in a container run with an
    arbitrary uid) and TMPDIR under tmp_path. Before the fix it died in platformdirs with
    `RuntimeError: could not determine the home directory`."""
    require_nvcc()
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    script = """
        import pwd
        def no_entry(uid):
            raise KeyError(f"getpwuid(): uid not found: {uid}")
        pwd.getpwuid = no_entry
    """ + GET.replace("\n    ", "\n        ")
    child = child_env(None, TMPDIR=str(tmp))
    for name in ("HOME", "XDG_CACHE_HOME"):
        child.pop(name, None)
    expected = fallback(tmp)
    for attempt in ("cold", "warm"):
        result = run_child(script, child, args=[json.dumps(SPEC.to_dict())])
        assert result.returncode == 0, result.stderr[-3000:]
        report = last_json(result.stdout)
        assert "error" not in report, (report, result.stderr[-3000:])
        assert Path(report["entry"]).is_relative_to(expected), report
        assert report["compiles"] == (1 if attempt == "cold" else 0) and report["verified"]
        assert f"using {expected}" in result.stderr and "JITATTN_CACHE_DIR" in result.stderr
    assert stat.S_IMODE(expected.stat().st_mode) == 0o700
    assert not (REPO / "~").exists()
