"""Operator verbs without foot-guns, knobs that refuse what they cannot mean, and a prewarm that
talks (issue 45 items 4 and 5). CPU only: entries are fakes, builds are stubs."""
from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from jitattn import cli
from jitattn.decode.spec import DecodeSpec
from jitattn.errors import CacheNotWritable, JitCompileError
from jitattn.jit import build, cache, env, keys, manifest, prewarm
from jitattn.jit.lock import key_lock

REPO = Path(__file__).resolve().parent.parent


def run_cli(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def root(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv("JITATTN_CACHE_DIR", str(path))
    monkeypatch.delenv("JITATTN_CACHE_SEED_DIRS", raising=False)
    return path


def fake_entry(root: Path, name: str, seed: str | None = None) -> Path:
    key = hashlib.sha256((seed or name + os.urandom(8).hex()).encode()).hexdigest()
    staging = cache.new_staging_dir(root)
    (staging / cache.LIBRARY).write_bytes(os.urandom(64))
    cache.write_manifest(staging, {"key": key, "spec": {"name": name}})
    return cache.publish(staging, cache.entry_path(root, keys.CACHE_SCHEMA, "sm90", name, key))


# ------------------------------------------------------------------ cache clear


def test_cache_clear_refuses_a_root_with_a_users_file_and_deletes_nothing(root, capsys):
    entry = fake_entry(root, "decode_f16_kvf16_d64_posnone_cap0_g1")
    notes = root / "notes.txt"
    notes.write_text("my notes, not a cache entry\n")
    code, out, err = run_cli(capsys, "cache", "clear")
    assert code == 2 and "notes.txt" in err and "--force" in err and "nothing removed" in err
    assert notes.read_text() == "my notes, not a cache entry\n" and entry.is_dir()


def test_cache_clear_refuses_foreign_things_inside_a_schema_dir(root, capsys):
    fake_entry(root, "decode_f16_kvf16_d64_posnone_cap0_g1")
    stray = root / keys.CACHE_SCHEMA / "sm90" / "holiday-photos"
    stray.mkdir()
    code, _, err = run_cli(capsys, "cache", "clear")
    assert code == 2 and "holiday-photos" in err and stray.is_dir()


def test_cache_clear_with_force_removes_everything_under_the_root(root, capsys):
    fake_entry(root, "decode_f16_kvf16_d64_posnone_cap0_g1")
    (root / "notes.txt").write_text("x")
    code, out, _ = run_cli(capsys, "cache", "clear", "--force")
    assert code == 0 and not root.exists() and f"removed {root}" in out


def test_cache_clear_removes_entries_staging_locks_logs_stamps_and_memo(root, capsys):
    fake_entry(root, "decode_f16_kvf16_d64_posnone_cap0_g1")
    for sub in (cache.STAGING, cache.LOCKS, cache.LOGS, cache.STAMPS):
        (root / sub).mkdir(exist_ok=True)
        (root / sub / "x").write_text("x")
    (root / "toolchains.json").write_text("{}")
    code, out, err = run_cli(capsys, "cache", "clear")
    assert code == 0, err
    assert not root.exists()


def test_cache_clear_leaves_the_parent_of_the_root_alone(root, capsys):
    sibling = root.parent / "sibling.txt"
    sibling.write_text("x")
    fake_entry(root, "decode_f16_kvf16_d64_posnone_cap0_g1")
    assert run_cli(capsys, "cache", "clear")[0] == 0
    assert sibling.read_text() == "x"


# ------------------------------------------------------------------ cache prune


def test_prune_never_removes_the_staging_of_a_live_build_in_this_process(root, capsys):
    staging = cache.new_staging_dir(root)
    (staging / "kernels.cu").write_text("// being compiled\n")
    old = time.time() - 10 * 86400
    os.utime(staging, (old, old))
    code, out, _ = run_cli(capsys, "cache", "prune", "--staging-age", "0")
    assert code == 0 and staging.is_dir() and "pruned 0 item(s)" in out
    cache.discard_staging(staging)
    assert not staging.exists()


HOLD_STAGING = r"""
import fcntl, os, sys, time
path = sys.argv[1]
os.makedirs(path)
fd = os.open(path, os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_SH)
print("held", flush=True)
time.sleep(60)
"""


def test_prune_never_removes_a_staging_dir_another_host_s_builder_holds(root):
    # A builder on another host sharing the root: its name's pid means nothing here, its flock does.
    staging = root / cache.STAGING / "otherhost-1-0123abcd"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_STAGING, str(staging)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert cache.prune_staging(root, 0) == [] and staging.is_dir()
    finally:
        holder.kill()
        holder.wait()
    assert cache.prune_staging(root, 0) == [staging] and not staging.exists()


def test_prune_removes_the_staging_of_a_dead_build(root):
    made = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; from jitattn.jit import cache; "
                           "print(cache.new_staging_dir(Path(sys.argv[1])))", str(root)],
                          capture_output=True, text=True, check=True, cwd=str(REPO))
    staging = Path(made.stdout.strip())
    assert staging.is_dir()
    assert cache.prune_staging(root, 0) == [staging]


@pytest.mark.parametrize("argv", [["--staging-age", "nan"], ["--staging-age", "-1"], ["--older-than-days", "inf"],
                                  ["--max-size-mb", "-5"]])
def test_prune_refuses_numbers_that_mean_nothing(root, capsys, argv):
    code, _, err = run_cli(capsys, "cache", "prune", *argv)
    assert code == 2 and argv[0] in err and "finite number" in err


def test_unpack_refuses_a_nan_member_bound(root, tmp_path, capsys):
    code, _, err = run_cli(capsys, "cache", "unpack", tmp_path / "x.tar", "--max-member-mb", "nan")
    assert code == 2 and "--max-member-mb" in err


# ------------------------------------------------------------------ cache show


def test_cache_show_refuses_an_ambiguous_prefix_listing_the_candidates(root, capsys):
    a = fake_entry(root, "decode_f16_kvf16_d64_posnone_cap0_g1")
    b = fake_entry(root, "decode_f16_kvf16_d128_posnone_cap0_g1")
    code, out, err = run_cli(capsys, "cache", "show", "decode")
    assert code == 2 and out == ""
    assert "prefix of 2 entries" in err and a.name in err and b.name in err


def test_cache_show_takes_a_unique_prefix_or_an_exact_name(root, capsys):
    a = fake_entry(root, "decode_f16_kvf16_d64_posnone_cap0_g1")
    fake_entry(root, "decode_f16_kvf16_d128_posnone_cap0_g1")
    code, out, _ = run_cli(capsys, "cache", "show", "decode_f16_kvf16_d64")
    assert code == 0 and out.startswith(str(a)) and json.loads(out.split("\n", 1)[1])["key"].startswith(a.name[-16:])
    code, out, _ = run_cli(capsys, "cache", "show", a.name)
    assert code == 0 and out.startswith(str(a))
    assert run_cli(capsys, "cache", "show", "varlen")[0] == 1


# ------------------------------------------------------------------ locks and compile logs


def test_a_directory_where_the_lock_file_goes_is_a_clear_error(tmp_path):
    key = "c" * 64
    (tmp_path / "locks" / f"{key[:32]}.lock").mkdir(parents=True)
    with pytest.raises(CacheNotWritable, match="is not a regular file .*remove it"):
        with key_lock(tmp_path / "locks", key, "a spec", timeout=1):
            pass


def test_a_file_where_the_lock_directory_goes_is_a_clear_error(tmp_path):
    (tmp_path / "locks").write_text("not a directory")
    with pytest.raises(CacheNotWritable, match="lock directory .* is not a directory"):
        with key_lock(tmp_path / "locks", "d" * 64, "a spec", timeout=1):
            pass


def test_a_full_disk_while_keeping_the_compile_log_still_reports_the_compile_error(tmp_path, monkeypatch):
    staging = tmp_path / "staging"
    staging.mkdir()
    failure = RuntimeError("Error building extension\nkernels.cu(54): error: static assertion failed with \"x\"\n")

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", no_space)
    error = build._compile_error(failure, staging, "decode_f16_kvf16_d64_posnone_cap0_g1", tmp_path / "logs")
    assert isinstance(error, JitCompileError)
    assert "static assertion failed" in error.first_error
    assert "No space left on device" in str(error) and "not kept" in str(error)


def test_the_compile_log_is_kept_under_the_log_dir_with_the_sources(tmp_path):
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "kernels.cu").write_text("// source\n")
    failure = RuntimeError(f"{staging / 'cuda.cu'}(3): error: boom\n")
    error = build._compile_error(failure, staging, "decode_f16_kvf16_d64_posnone_cap0_g1", tmp_path / "logs")
    log = Path(error.log_path)
    assert log.parent == tmp_path / "logs" and "boom" in log.read_text()
    assert log.with_suffix(".kernels.cu").read_text() == "// source\n"


# ------------------------------------------------------------------ knobs


@pytest.mark.parametrize("knob", ["JITATTN_LOCK_TIMEOUT", "JITATTN_REMOTE_CACHE_TIMEOUT", "JITATTN_REMOTE_CACHE_MAX_MB",
                                  "JITATTN_REMOTE_CACHE_LOCK_TTL", "JITATTN_BUILD_JOBS"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-5", "0", "ten"])
def test_numeric_knobs_refuse_values_they_cannot_mean_naming_the_knob(monkeypatch, knob, value):
    monkeypatch.setenv(knob, value)
    reader = {"JITATTN_LOCK_TIMEOUT": env.lock_timeout, "JITATTN_REMOTE_CACHE_TIMEOUT": env.remote_cache_timeout,
              "JITATTN_REMOTE_CACHE_MAX_MB": env.remote_cache_max_bytes,
              "JITATTN_REMOTE_CACHE_LOCK_TTL": env.remote_cache_lock_ttl, "JITATTN_BUILD_JOBS": env.build_jobs}[knob]
    with pytest.raises(ValueError, match=knob):
        reader()


def test_a_bad_remote_ttl_is_refused_when_the_fleet_is_first_read(monkeypatch):
    monkeypatch.setenv("JITATTN_REMOTE_CACHE", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("JITATTN_REMOTE_CACHE_TTL", "nan")
    with pytest.raises(ValueError, match="JITATTN_REMOTE_CACHE_TTL"):
        env.remote_cache_url()
    monkeypatch.setenv("JITATTN_REMOTE_CACHE_TTL", "0")
    assert env.remote_cache_url() == "redis://127.0.0.1:1/0" and env.remote_cache_ttl() == 0


def test_a_whitespace_secret_is_refused_naming_the_knob(monkeypatch):
    monkeypatch.setenv("JITATTN_REMOTE_CACHE_KEY", " " * 16)
    with pytest.raises(ValueError, match="JITATTN_REMOTE_CACHE_KEY is only whitespace"):
        env.remote_cache_secret()
    monkeypatch.setenv("JITATTN_REMOTE_CACHE", "redis://127.0.0.1:1/0")
    with pytest.raises(ValueError, match="JITATTN_REMOTE_CACHE_KEY"):
        env.remote_cache_url()
    monkeypatch.setenv("JITATTN_REMOTE_CACHE_KEY", "")
    assert env.remote_cache_secret() is None


def test_a_relative_cache_dir_is_made_absolute_once_with_a_log_line(monkeypatch, tmp_path, caplog):
    monkeypatch.chdir(tmp_path)
    raw = f"rel-cache-{os.urandom(4).hex()}"
    monkeypatch.setenv("JITATTN_CACHE_DIR", raw)
    with caplog.at_level("WARNING", logger="jitattn"):
        first = env.cache_dir()
    assert first == tmp_path / raw and first.is_absolute()
    assert any("is relative" in r.getMessage() and raw in r.getMessage() for r in caplog.records)
    monkeypatch.chdir(tmp_path.parent)  # a later chdir does not move the cache
    assert env.cache_dir() == first


def test_a_blank_cache_dir_is_refused(monkeypatch):
    monkeypatch.setenv("JITATTN_CACHE_DIR", "   ")
    with pytest.raises(ValueError, match="JITATTN_CACHE_DIR is blank"):
        env.cache_dir()


def test_doctor_flags_seed_dirs_that_are_missing(root, tmp_path, capsys, monkeypatch):
    present, missing = tmp_path / "seed", tmp_path / "no-such-seed"
    present.mkdir()
    monkeypatch.setenv("JITATTN_CACHE_SEED_DIRS", os.pathsep.join([str(present), str(missing)]))
    monkeypatch.setenv("JITATTN_CUDA_ARCH_LIST", "9.0")
    code, out, _ = run_cli(capsys, "doctor")
    assert code == 0
    assert f"{missing} (JITATTN_CACHE_SEED_DIRS): MISSING: does not exist" in out
    assert f"{present} (JITATTN_CACHE_SEED_DIRS): 0 entries" in out


# ------------------------------------------------------------------ prewarm that talks


def test_an_unknown_manifest_table_is_named_not_nothing_to_prewarm(tmp_path, capsys):
    path = tmp_path / "typo.toml"
    path.write_text('[[specs]]\nfamily = "decode"\nhead_dim = 128\n')
    code, _, err = run_cli(capsys, "prewarm", path, "--dry-run")
    assert code == 2 and "['specs']" in err and "[[spec]]" in err and "nothing to prewarm" not in err


def test_an_unknown_manifest_field_is_named_with_the_known_ones_group_size_among_them(tmp_path):
    path = tmp_path / "typo.toml"
    path.write_text('[[spec]]\nfamily = "decode"\nhead_dim = 128\ngroup_szie = 4\n')
    with pytest.raises(ValueError, match=r"unknown decode spec fields \['group_szie'\]") as info:
        manifest.read_manifest(path)
    assert "'group_size'" in str(info.value) and "'group_tile'" in str(info.value)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_console_progress_says_when_builds_start_how_long_they_run_and_the_eta():
    out, clock = io.StringIO(), Clock()
    a, b, c = DecodeSpec(64), DecodeSpec(128), DecodeSpec(256)
    progress = prewarm.ConsoleProgress(3, jobs=1, out=out, every=10.0, clock=clock)
    progress.started(a)
    clock.now = 25.0
    progress.tick()
    progress.finished(prewarm.Outcome(a, "built", 25.0))
    progress.started(b)
    clock.now = 29.0
    progress.tick()  # b has run 4 s: no line yet
    progress.finished(prewarm.Outcome(b, "built", 15.0))
    progress.finished(prewarm.Outcome(c, "cached", 0.0))
    lines = out.getvalue().splitlines()
    assert lines[0].startswith(f"building {a.name}")
    assert lines[1] == f"  still building {a.name}: 25 s"
    assert "1/3" in lines[2] and "ETA 50 s" in lines[2]  # 2 left at 25 s each, one at a time
    assert lines[3].startswith(f"building {b.name}")
    assert "2/3" in lines[4] and "ETA 20 s" in lines[4]  # mean of 25 and 15, one left
    assert "3/3" in lines[5] and "ETA" not in lines[5]
    assert len(lines) == 6


def test_a_prewarm_prints_a_line_as_each_build_starts_and_while_it_runs(root, capsys, monkeypatch):
    started = threading.Event()

    def slow_build(spec, force):
        started.set()
        time.sleep(0.35)
        return prewarm.Outcome(spec, "built", 0.35)

    monkeypatch.setattr(prewarm, "build_one", slow_build)
    monkeypatch.setattr(prewarm, "ConsoleProgress", lambda total, jobs: RealProgress(total, jobs, every=0.1))
    monkeypatch.setattr("jitattn.jit.loader.is_cached", lambda spec: False)
    code, out, err = run_cli(capsys, "prewarm", "--head-dim", "64", "--arch", "9.0", "-j", "1")
    assert code == 0, err
    spec = DecodeSpec(64)
    assert f"building {spec.name}" in out and f"still building {spec.name}" in out
    assert out.index("building") < out.index("still building") < out.index("1/1")


RealProgress = prewarm.ConsoleProgress


def test_doctor_names_a_bad_fleet_knob_and_still_prints_the_rest(root, capsys, monkeypatch):
    monkeypatch.setenv("JITATTN_REMOTE_CACHE", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("JITATTN_REMOTE_CACHE_TTL", "inf")
    monkeypatch.setenv("JITATTN_CUDA_ARCH_LIST", "9.0")
    code, out, _ = run_cli(capsys, "doctor")
    assert code == 0 and "remote cache UNUSABLE: JITATTN_REMOTE_CACHE_TTL must be a finite number" in out
    assert "environment knobs:" in out


def test_a_missing_seed_dir_is_logged_once(monkeypatch, tmp_path, caplog):
    missing = tmp_path / f"seed-{os.urandom(4).hex()}"
    monkeypatch.setenv("JITATTN_CACHE_SEED_DIRS", str(missing))
    with caplog.at_level("WARNING", logger="jitattn"):
        assert env.seed_dirs() == [missing] and env.seed_dirs() == [missing]
    assert [r.getMessage() for r in caplog.records].count(
        f"JITATTN_CACHE_SEED_DIRS names {missing}, which is not a directory: nothing is read from it") == 1


def test_prune_keeps_the_scratch_files_of_a_live_process_and_removes_a_dead_one_s(root):
    scratch = root / cache.STAGING
    scratch.mkdir(parents=True)
    mine = [scratch / f".write-probe.{os.getpid()}", scratch / f".toolchains.json.{os.getpid()}.tmp"]
    dead_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout.strip()
    dead = scratch / f".toolchains.json.{dead_pid}.tmp"
    for path in mine + [dead]:
        path.write_text("")
    assert cache.prune_staging(root, 0) == [dead]
    assert all(path.exists() for path in mine)
