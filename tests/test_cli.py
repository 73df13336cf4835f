"""The `jitattn` command line: prewarm, cache list/verify/prune/clear, doctor/show-config, explain.

Most commands run in-process through `jitattn.cli.main` (capsys); the one real build runs as
`python -m jitattn` in a child process (exit codes as a shell sees them), once per module, and
later tests use copies of that cache.
"""
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from jitattn import cli
from jitattn.jit import cache, env, keys, loader, manifest, record, toolchain
from jitattn.jit.prewarm import Outcome
from jitattn.decode.spec import DecodeSpec
from tests.conftest import require_nvcc

REPO = Path(__file__).resolve().parent.parent
SPEC = DecodeSpec(head_dim=64)
# Variables the CLI (or a build it runs) sets in its own process environment.
CLI_SETS = ("JITATTN_CUDA_ARCH_LIST", "TORCH_CUDA_ARCH_LIST", "JITATTN_BUILD_JOBS", "CUDA_HOME", "MAX_JOBS")


@pytest.fixture(autouse=True)
def isolated(monkeypatch):
    """Whatever a command writes into os.environ is undone; no arch list unless a test sets one;
    empty in-process module/record memos."""
    for name in CLI_SETS:
        monkeypatch.setenv(name, os.environ.get(name, ""))  # records the original for undo
        if name.endswith("ARCH_LIST") or name in ("JITATTN_BUILD_JOBS", "MAX_JOBS") or not os.environ[name]:
            monkeypatch.delenv(name)
    for name in ("JITATTN_CACHE_SEED_DIRS", "JITATTN_DISABLE_JIT", "JITATTN_RECORD"):
        monkeypatch.delenv(name, raising=False)
    record.reset()
    with loader.forget_loaded():
        yield


def run_cli(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def cli_process(*argv, root: Path, timeout=300) -> subprocess.CompletedProcess:
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("JITATTN_")}
    child_env.update(PYTHONPATH=str(REPO), JITATTN_CACHE_DIR=str(root))
    return subprocess.run([sys.executable, "-m", "jitattn", *map(str, argv)], env=child_env,
                          capture_output=True, text=True, timeout=timeout, cwd=str(REPO))


@dataclass
class Prewarmed:
    root: Path
    result: subprocess.CompletedProcess
    seconds: float


@pytest.fixture(scope="module")
def prewarmed(tmp_path_factory):
    """`python -m jitattn prewarm --head-dim 64 --arch 9.0` into a fresh cache, once."""
    require_nvcc()
    root = tmp_path_factory.mktemp("prewarmed") / "cache"
    start = time.perf_counter()
    result = cli_process("prewarm", "--head-dim", "64", "--arch", "9.0", root=root)
    return Prewarmed(root, result, time.perf_counter() - start)


@pytest.fixture
def warm_cache(prewarmed, tmp_path, monkeypatch):
    """A private copy of the prewarmed cache, as JITATTN_CACHE_DIR."""
    assert prewarmed.result.returncode == 0, prewarmed.result.stderr
    root = tmp_path / "cache"
    shutil.copytree(prewarmed.root, root)
    monkeypatch.setenv("JITATTN_CACHE_DIR", str(root))
    return root


def only_entry(root: Path) -> Path:
    found = list(cache.entries(root))
    assert len(found) == 1, found
    return found[0]


# ------------------------------------------------------------------ prewarm


@pytest.mark.compile
def test_prewarm_builds_one_spec_into_a_fresh_cache(prewarmed):
    result = prewarmed.result
    assert result.returncode == 0, result.stderr
    assert f"prewarm: 1 specializations for 9.0 (JITATTN_CUDA_ARCH_LIST) into {prewarmed.root}" in result.stdout
    assert "built 1, already cached 0, failed 0" in result.stdout
    assert re.search(rf"{SPEC.name}\s+built\s+\d", result.stdout)
    entry = only_entry(prewarmed.root)
    assert entry.parent == prewarmed.root / "v1" / "sm90"
    assert entry.name.startswith(SPEC.name + "-")
    assert cache.why_invalid(entry) is None
    print(f"\ncold `python -m jitattn prewarm --head-dim 64`: {prewarmed.seconds:.1f} s wall")


@pytest.mark.compile
def test_prewarm_again_reports_already_cached_quickly(warm_cache, capsys, monkeypatch):
    """No compiler, no worker process, little work. The work is this process's CPU time, which
    other load on the machine does not stretch (a wall-time bound here could fail under load)."""
    import subprocess as subprocess_module

    def forbidden(*args, **kwargs):
        raise AssertionError(f"a cached prewarm started a process: {args!r}")

    monkeypatch.setattr(subprocess_module, "Popen", forbidden)
    monkeypatch.setattr("concurrent.futures.ProcessPoolExecutor", forbidden)
    before = loader.COMPILE_COUNT
    start, cpu = time.perf_counter(), time.process_time()
    code, out, err = run_cli(capsys, "prewarm", "--head-dim", "64", "--arch", "9.0")
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    assert code == 0, err
    assert "built 0, already cached 1, failed 0" in out
    assert re.search(rf"{SPEC.name}\s+cached\s", out)
    assert loader.COMPILE_COUNT == before
    assert cpu_seconds < 5, f"a cached prewarm took {cpu_seconds:.1f} s of CPU ({seconds:.1f} s wall)"


def test_prewarm_with_nothing_to_do_exits_2_with_a_message(tmp_path, capsys):
    code, out, err = run_cli(capsys, "prewarm")
    assert code == 2
    assert "nothing to prewarm" in err and "--head-dim" in err


def test_prewarm_with_nothing_to_do_exits_2_from_the_command_line(tmp_path):
    result = cli_process("prewarm", root=tmp_path / "cache")
    assert result.returncode == 2
    assert "jitattn: error: nothing to prewarm" in result.stderr
    assert not (tmp_path / "cache").exists()


def test_decode_flags_without_head_dim_are_an_error(capsys):
    code, _, err = run_cli(capsys, "prewarm", "--dtype", "bfloat16")
    assert code == 2 and "--head-dim" in err


def test_bad_arch_is_an_error_naming_it(capsys):
    code, _, err = run_cli(capsys, "prewarm", "--head-dim", "64", "--arch", "sm_90")
    assert code == 2 and "sm_90" in err


MANIFEST = """
[[spec]]
family = "decode"
head_dim = [64, 128]
dtype_q = ["float16", "bfloat16"]
group_size = [1, 3, 8]

[[spec]]               # a duplicate of one of the above: listed once
family = "decode"
head_dim = 64
"""


def expected_cross_product():
    return [
        DecodeSpec.for_call(d, dt, dt, "NONE", False, g)
        for d in (64, 128) for dt in ("float16", "bfloat16") for g in (1, 3, 8)
    ]


def test_manifest_list_fields_expand_to_the_cross_product(tmp_path):
    path = tmp_path / "deploy.toml"
    path.write_text(MANIFEST)
    specs = manifest.read_manifest(path)
    assert specs == expected_cross_product()
    assert len(specs) == 12
    assert {s.group_tile for s in specs} == {1, 4, 8}  # group 3 rounds up to a tile of 4
    # group 8 runs on tensor cores by default (DecodeSpec.for_call), groups 1 and 3 do not
    assert {s.group_tile for s in specs if s.tensor_cores} == {8}


def test_prewarm_builds_every_spec_of_a_manifest_and_of_the_flags(tmp_path, capsys, monkeypatch):
    path = tmp_path / "deploy.toml"
    path.write_text(MANIFEST)
    asked = []

    def fake_prewarm(specs, jobs, force=False, on_done=None, on_start=None):
        asked.extend(specs)
        outcomes = [Outcome(s, "cached", 0.0) for s in specs]
        for o in outcomes:
            on_done(o)
        return outcomes

    monkeypatch.setattr("jitattn.jit.prewarm.prewarm", fake_prewarm)
    code, out, err = run_cli(capsys, "prewarm", path, "--head-dim", "256", "--soft-cap", "both",
                             "--group-size", "1", "16", "--arch", "9.0")
    assert code == 0, err
    # --group-size 16 is what a call runs: the tensor-core kernel with 16 heads per CTA
    flags = [DecodeSpec(head_dim=256, soft_cap=cap, group_tile=tile, tensor_cores=tile == 16)
             for tile in (1, 16) for cap in (False, True)]
    assert asked == expected_cross_product() + flags
    assert f"prewarm: {len(asked)} specializations for 9.0" in out
    assert f"built 0, already cached {len(asked)}, failed 0" in out


@pytest.mark.parametrize("text,named", [
    ('[[spec]]\nfamily = "decode"\nhead_dims = [64, 128]\n', "head_dims"),
    ('[[spec]]\nfamily = "decode"\nhead_dim = 64\nwindow = true\n', "window"),
    ('[[spec]]\nfamily = "prefill"\nhead_dim = 64\n', "prefill"),
    ('[[spec]\nfamily = "decode"\n', "not valid TOML"),
], ids=["typo-in-field", "unknown-field", "unknown-family", "bad-toml"])
def test_bad_manifest_exits_2_naming_the_problem(tmp_path, capsys, text, named):
    path = tmp_path / "deploy.toml"
    path.write_text(text)
    code, out, err = run_cli(capsys, "prewarm", path, "--arch", "9.0")
    assert code == 2
    assert named in err and str(path) in err
    assert "built" not in out


def test_missing_manifest_exits_2(tmp_path, capsys):
    code, _, err = run_cli(capsys, "prewarm", tmp_path / "nope.toml")
    assert code == 2 and "nope.toml" in err


@pytest.mark.compile
def test_prewarm_of_a_spec_that_fails_to_compile_exits_1(cache_root, capsys, tmp_path, monkeypatch):
    require_nvcc()
    # Specs the kernels cannot build are refused before nvcc now (tests/test_spec_fields.py): a
    # static_assert injected into a copy of the templates makes a valid spec fail to compile.
    from jitattn.jit import render

    broken = tmp_path / "templates"
    shutil.copytree(REPO / "templates", broken)
    kernels = broken / "decode" / "kernels.cu.j2"
    kernels.write_text(kernels.read_text() + '\nstatic_assert(HEAD_DIM == 0, "injected: this build must fail");\n')
    monkeypatch.setattr(render, "templates_dir", lambda: broken)
    code, out, err = run_cli(capsys, "prewarm", "--spec", '{"family": "decode", "head_dim": 64}', "--arch", "9.0")
    assert code == 1, err
    assert "built 0, already cached 0, failed 1" in out
    assert re.search(r"decode_f16_kvf16_d64\S*\s+failed", out)
    assert "JitCompileError" in out and "full compiler log" in out
    log = re.search(r"full compiler log: (\S+)", out).group(1)
    assert Path(log).is_file() and "injected: this build must fail" in Path(log).read_text()
    assert list(cache.entries(cache_root)) == []
    assert not any((cache_root / cache.STAGING).iterdir())


# ------------------------------------------------------------------ cache commands


@pytest.mark.compile
def test_cache_list_shows_each_entry_and_its_state(warm_cache, capsys):
    entry = only_entry(warm_cache)
    code, out, _ = run_cli(capsys, "cache", "list")
    assert code == 0
    assert f"{warm_cache} (writable)" in out
    assert re.search(rf"{re.escape(str(entry.relative_to(warm_cache)))}\s+\d+ KiB\s+ok", out)


@pytest.mark.compile
def test_cache_list_shows_seed_dirs_as_read_only(warm_cache, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("JITATTN_CACHE_SEED_DIRS", str(warm_cache))
    monkeypatch.setenv("JITATTN_CACHE_DIR", str(tmp_path / "empty"))
    code, out, _ = run_cli(capsys, "cache", "list")
    assert code == 0
    assert f"{warm_cache} (read-only seed)" in out and f"{tmp_path / 'empty'} (writable)" in out
    assert out.index("read-only seed") < out.index("(writable)")


@pytest.mark.compile
def test_cache_verify_passes_then_flags_a_corrupted_library(warm_cache, capsys):
    entry = only_entry(warm_cache)
    code, out, _ = run_cli(capsys, "cache", "verify")
    assert code == 0
    assert "verified 1 entries: 1 ok, 0 invalid" in out and "INVALID" not in out

    so = entry / "module.so"
    data = bytearray(so.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes
    so.write_bytes(bytes(data))
    code, out, _ = run_cli(capsys, "cache", "verify")
    assert code == 1
    assert f"INVALID {entry}: module.so sha256 does not match the manifest" in out
    assert "verified 1 entries: 0 ok, 1 invalid" in out
    code, out, _ = run_cli(capsys, "cache", "list")
    assert code == 0 and re.search(r"KiB\s+INVALID", out)


def test_cache_verify_flags_an_entry_without_manifest(cache_root, capsys):
    entry = cache_root / "v1" / "sm90" / f"{SPEC.name}-0123456789abcdef"
    entry.mkdir(parents=True)
    (entry / "module.so").write_bytes(b"\x7fELF")
    code, out, _ = run_cli(capsys, "cache", "verify")
    assert code == 1
    assert f"INVALID {entry}: no manifest.json" in out


def test_cache_verify_of_an_empty_cache_is_ok(cache_root, capsys):
    code, out, _ = run_cli(capsys, "cache", "verify")
    assert code == 0 and "verified 0 entries" in out


def _litter(root: Path, name: str, age_s: float) -> Path:
    path = root / cache.STAGING / name
    path.mkdir(parents=True)
    (path / "cuda.cuda.o").write_bytes(b"half a build")
    stamp = time.time() - age_s
    os.utime(path, (stamp, stamp))
    return path


@pytest.mark.compile
def test_cache_prune_removes_old_staging_litter_and_keeps_entries(warm_cache, capsys):
    entry = only_entry(warm_cache)
    old = _litter(warm_cache, "host-123-deadbeef", age_s=2 * 3600)
    broken = _litter(warm_cache, "broken-cafef00d", age_s=3 * 3600)
    fresh = _litter(warm_cache, "host-456-feedface", age_s=10)  # maybe a build in progress

    code, out, _ = run_cli(capsys, "cache", "prune")
    assert code == 0
    assert not old.exists() and not broken.exists() and fresh.exists()
    assert f"removed {old}" in out and "pruned 2 item(s)" in out
    assert cache.why_invalid(entry) is None

    code, out, _ = run_cli(capsys, "cache", "prune", "--staging-age", "0")
    assert code == 0 and not fresh.exists() and "pruned 1 item(s)" in out
    assert cache.why_invalid(entry) is None


@pytest.mark.compile
def test_cache_clear_removes_the_cache_root(warm_cache, capsys):
    code, out, _ = run_cli(capsys, "cache", "clear")
    assert code == 0
    assert f"removed {warm_cache}" in out
    assert not warm_cache.exists()
    code, out, _ = run_cli(capsys, "cache", "clear")  # nothing left: still fine
    assert code == 0


def test_cache_clear_leaves_seed_dirs_alone(cache_root, tmp_path, capsys, monkeypatch):
    seed = tmp_path / "seed"
    (seed / "v1").mkdir(parents=True)
    monkeypatch.setenv("JITATTN_CACHE_SEED_DIRS", str(seed))
    cache_root.mkdir()
    code, _, _ = run_cli(capsys, "cache", "clear")
    assert code == 0 and not cache_root.exists() and (seed / "v1").is_dir()


# ------------------------------------------------------------------ doctor / show-config / explain


@pytest.mark.compile
@pytest.mark.parametrize("command", ["doctor", "show-config"])
def test_doctor_prints_toolchain_archs_cache_and_knobs(command, warm_cache, capsys, monkeypatch):
    monkeypatch.setenv("JITATTN_CUDA_ARCH_LIST", "9.0")
    code, out, err = run_cli(capsys, command)
    assert code == 0, err
    home, _ = toolchain.resolve_cuda_home()
    tc = toolchain.fingerprint()
    assert re.search(rf"^CUDA home\s+{re.escape(str(home))} \(", out, re.M), out
    assert re.search(rf"^nvcc\s+{re.escape(tc.nvcc_release)} ", out, re.M), out
    assert re.search(r"^nvcc\s+\d+\.\d+", out, re.M)
    assert re.search(r"^archs\s+9\.0 \(from JITATTN_CUDA_ARCH_LIST\)", out, re.M), out
    assert re.search(rf"^cache root\s+{re.escape(str(warm_cache))} \(JITATTN_CACHE_DIR\): 1 entries", out, re.M), out
    for knob in env.KNOBS:
        assert re.search(rf"^\s+{knob}\s", out, re.M), f"{knob} missing from {command}"
    assert re.search(r"^\s+JITATTN_CUDA_ARCH_LIST\s+9\.0\s", out, re.M)
    assert re.search(r"^\s+JITATTN_DISABLE_JIT\s+\(unset: 0\)", out, re.M)


def test_doctor_without_any_arch_says_how_to_set_one(cache_root, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a visible GPU supplies the archs")
    code, out, _ = run_cli(capsys, "doctor")
    assert code == 0
    assert re.search(r"^archs\s+no target CUDA arch.*JITATTN_CUDA_ARCH_LIST", out, re.M), out


@pytest.mark.compile  # needs the toolchain's versions for the key
def test_explain_prints_the_key_and_every_component(cache_root, capsys, monkeypatch):
    require_nvcc()
    code, out, err = run_cli(capsys, "explain", "--head-dim", "128", "--arch", "9.0")
    assert code == 0, err
    spec = DecodeSpec(head_dim=128)
    monkeypatch.setenv("JITATTN_CUDA_ARCH_LIST", "9.0")
    parts = keys.components(spec, loader.current_target(spec))
    key = keys.key_of(parts)
    assert out.startswith(spec.name + "\n")
    assert f"  key {key}\n" in out
    for name, value in parts.items():
        assert re.search(rf"^  {name}\s+{re.escape(json.dumps(value))}$", out, re.M), f"component {name}"
    assert set(parts) >= {"schema", "abi", "archs", "cxx_flags", "cuda_flags", "spec", "templates", "nvcc", "host_cxx"}
    entry = cache.entry_path(cache_root, keys.CACHE_SCHEMA, "sm90", spec.name, key)
    assert f"  entry      {entry} (absent)" in out


@pytest.mark.compile
def test_explain_reports_a_cached_entry_as_present(warm_cache, capsys):
    code, out, _ = run_cli(capsys, "explain", "--head-dim", "64", "--arch", "9.0")
    assert code == 0
    assert f"  entry      {only_entry(warm_cache)} (present)" in out


def test_explain_with_nothing_exits_2(capsys):
    code, _, err = run_cli(capsys, "explain")
    assert code == 2 and "explain needs --spec or --head-dim" in err


# ------------------------------------------------------------------ spec flags for every family
from jitattn.jit import registry  # noqa: E402
from jitattn.varlen.spec import VarlenSpec  # noqa: E402
from jitattn.varlen import spec as varlen_spec  # noqa: E402


def dry_run(capsys, *argv):
    code, out, err = run_cli(capsys, *argv, "--dry-run")
    assert code == 0, err
    return [json.loads(line) for line in out.splitlines() if line.startswith("    {")], out


@pytest.fixture
def no_builds(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a dry run must build nothing")

    monkeypatch.setattr("jitattn.jit.prewarm.prewarm", refuse)


def test_prewarm_varlen_dry_run_lists_what_calls_on_the_arch_run(capsys, no_builds):
    """The issue's first acceptance command: every spec a varlen call of those head dims and dtype
    may run on sm_90 (both paging modes and tile shapes; prefill on the wgmma rung there)."""
    got, out = dry_run(capsys, "prewarm", "--family", "varlen", "--head-dim", "64,128", "--dtype", "bfloat16",
                       "--arch", "9.0")
    # TMA: every prefill at D64 and D128, and, if DECODE_TMA, the paged D128 decode tile; the
    # prefill kernels persistent (VarlenSpec.for_call).
    want = [VarlenSpec(d, "bfloat16", paged, decode, wgmma=not decode,
                       tma=not decode or (varlen_spec.DECODE_TMA and paged and d == 128), persistent=not decode)
            for d in (64, 128) for paged in (False, True) for decode in (False, True)]
    assert [s.tma for s in want] == [True, False, True, False, True, False, True, False]
    # and the packed D64 prefill of short sequences: the lockstep wgmma tile, no TMA (for_call's `short`)
    want.insert(1, VarlenSpec(64, "bfloat16", False, False, wgmma=True))
    assert [registry.spec_from_dict(d) for d in got] == want
    assert "prewarm --dry-run: 9 specializations for 9.0" in out
    assert "varlen_bf16_d64_prefill_wgmma_m12x1n128s4_tma_persistent  [9.0a]" in out
    assert "varlen_bf16_d64_decode_m1x1n64s3  [9.0]" in out


def test_prewarm_paged_decode_on_hopper_and_another_gpu_lists_both_copies(capsys, no_builds, monkeypatch):
    """With DECODE_TMA the paged D128 decode tile copies by TMA on sm_90 only: an A100 target keeps cp.async."""
    monkeypatch.setattr(varlen_spec, "DECODE_TMA", True)
    got, out = dry_run(capsys, "prewarm", "--family", "varlen", "--head-dim", "128", "--dtype", "bfloat16",
                       "--paged", "on", "--decode", "on", "--arch", "8.0;9.0")
    assert [registry.spec_from_dict(d) for d in got] == [VarlenSpec(128, "bfloat16", True, True, tma=True),
                                                         VarlenSpec(128, "bfloat16", True, True)]
    assert "varlen_bf16_d128_paged_decode_m1x1n32s3_tma  [9.0a]" in out and "[8.0,9.0]" in out


def test_prewarm_decode_dry_run_with_fp8_and_rope(capsys, no_builds):
    """The issue's second acceptance command: the kernel a call with fp8 K/V and RoPE runs."""
    got, out = dry_run(capsys, "prewarm", "--head-dim", "128", "--kv-dtype", "float8_e4m3fn", "--pos-encoding",
                       "ROPE_LLAMA", "--arch", "9.0")
    want = DecodeSpec.for_call(128, "float16", "float8_e4m3fn", "ROPE_LLAMA", False, 1)
    assert [registry.spec_from_dict(d) for d in got] == [want]
    assert f"  {want.name}  [9.0]" in out


def test_lists_take_commas_and_spaces_alike(capsys, no_builds):
    commas, _ = dry_run(capsys, "prewarm", "--head-dim", "64,128", "--dtype", "float16,bfloat16", "--group-size",
                        "1,", "8", "--arch", "9.0")
    spaces, _ = dry_run(capsys, "prewarm", "--head-dim", "64", "128", "--dtype", "float16", "bfloat16",
                        "--group-size", "1", "8", "--arch", "9.0")
    assert commas == spaces and len(commas) == 8
    want = [DecodeSpec.for_call(d, dt, dt, "NONE", False, g) for d in (64, 128) for dt in ("float16", "bfloat16")
            for g in (1, 8)]
    assert [registry.spec_from_dict(d) for d in commas] == want


def test_decode_flags_cover_pos_encoding_fp8_soft_cap_and_tensor_cores(capsys, no_builds):
    got, _ = dry_run(capsys, "prewarm", "--head-dim", "128", "--dtype", "bfloat16", "--kv-dtype",
                     "float8_e5m2,bfloat16", "--pos-encoding", "alibi", "--soft-cap", "on", "--tensor-cores", "on",
                     "--group-size", "4")
    want = [DecodeSpec.for_call(128, "bfloat16", kv, "ALIBI", True, 4, use_tensor_cores=True)
            for kv in ("float8_e5m2", "bfloat16")]
    assert [registry.spec_from_dict(d) for d in got] == want


def test_varlen_switches_pick_paging_tile_and_rung(capsys, no_builds):
    got, _ = dry_run(capsys, "prewarm", "--family", "varlen", "--head-dim", "256", "--paged", "on", "--decode", "off",
                     "--wgmma", "both", "--arch", "9.0")
    assert [registry.spec_from_dict(d) for d in got] == [VarlenSpec(256, "float16", True, False, wgmma=w, tma=w, split_kv=w)
                                                         for w in (False, True)]
    got, out = dry_run(capsys, "prewarm", "--family", "varlen", "--head-dim", "128", "--decode", "off", "--paged",
                       "off", "--arch", "8.0;9.0")  # an A100 too: the mma.sync prefill rung for it
    assert [registry.spec_from_dict(d) for d in got] == [VarlenSpec(128, "float16", False, False, wgmma=True, tma=True,
                                                                    persistent=True),
                                                         VarlenSpec(128, "float16", False, False)]
    assert "[9.0a]" in out and "[8.0,9.0]" in out


def test_several_families_in_one_command(capsys, no_builds):
    got, _ = dry_run(capsys, "prewarm", "--family", "decode,varlen", "--head-dim", "64", "--dtype", "bfloat16",
                     "--group-size", "4", "--decode", "on", "--paged", "off", "--arch", "9.0")
    assert [registry.spec_from_dict(d) for d in got] == [
        DecodeSpec.for_call(64, "bfloat16", "bfloat16", "NONE", False, 4), VarlenSpec(64, "bfloat16", False, True)]


def test_the_backward_family_takes_the_same_flags(capsys, no_builds):
    """varlen_backward, registered by its own spec module: the rungs a backward call on the archs
    runs (wgmma with its producer warpgroup on sm_90 at head_dim 64/128/256: at 128 persistent, and
    a CTA per key tile for deterministic mode; at 256 with dQ in its own kernel; mma.sync
    elsewhere), varlen-only flags ignored."""
    from jitattn.varlen.spec import TILE80_HEAD_DIMS, VarlenBackwardSpec

    got, _ = dry_run(capsys, "prewarm", "--family", "varlen_backward", "--head-dim", "64,128,256", "--dtype",
                     "bfloat16", "--arch", "9.0")
    rows80 = [VarlenBackwardSpec(128, "bfloat16", wgmma=True, producer=True, block_m=80)] if 128 in TILE80_HEAD_DIMS else []
    assert [registry.spec_from_dict(d) for d in got] == [
        VarlenBackwardSpec(64, "bfloat16", wgmma=True, producer=True),
        VarlenBackwardSpec(128, "bfloat16", wgmma=True, producer=True, persistent=True), *rows80,
        VarlenBackwardSpec(128, "bfloat16", wgmma=True, producer=True),
        VarlenBackwardSpec(256, "bfloat16", wgmma=True, producer=True, dq_kernel=True)]
    got, _ = dry_run(capsys, "prewarm", "--family", "varlen,varlen_backward", "--head-dim", "128", "--paged", "off",
                     "--decode", "off", "--arch", "8.0;9.0")
    assert [registry.spec_from_dict(d) for d in got] == [
        VarlenSpec(128, "float16", False, False, wgmma=True, tma=True, persistent=True),
        VarlenSpec(128, "float16", False, False),
        VarlenBackwardSpec(128, "float16", wgmma=True, producer=True, persistent=True),
        *[dataclasses.replace(spec, dtype="float16") for spec in rows80],
        VarlenBackwardSpec(128, "float16", wgmma=True, producer=True), VarlenBackwardSpec(128, "float16")]


def test_a_registered_family_gets_the_flags_without_the_cli_naming_it(capsys, no_builds):
    """--family takes whatever the registry holds (a backward family, say): flags map by field name."""
    from dataclasses import dataclass
    from typing import ClassVar

    from jitattn.jit.spec import KernelSpec

    @dataclass(frozen=True)
    class OtherSpec(KernelSpec):
        family: ClassVar[str] = "other"
        # Every family declares what its int and str fields accept (KernelSpec.validate_fields).
        choices: ClassVar[dict] = {"dtype": ("float16", "bfloat16")}
        ranges: ClassVar[dict] = {"head_dim": (32, 256)}
        head_dim: int
        dtype: str = "float16"
        deterministic: bool = False

        @property
        def name(self):
            return f"other_{self.dtype}_d{self.head_dim}"

    with registry.registered(OtherSpec):
        got, _ = dry_run(capsys, "prewarm", "--family", "other", "--head-dim", "64,128", "--dtype", "bfloat16")
        code, _, err = run_cli(capsys, "prewarm", "--family", "other", "--head-dim", "64", "--paged", "on",
                               "--dry-run")
    assert got == [{"family": "other", "head_dim": d, "dtype": "bfloat16", "deterministic": False} for d in (64, 128)]
    assert code == 2 and "--paged applies to none of the families ['other']" in err and "deterministic" in err
    assert "other" not in registry.families()  # registered only within the block


@pytest.mark.parametrize("argv,named", [
    (["--head-dim", "128", "--paged", "on"], "--paged applies to none of the families ['decode']"),
    (["--family", "varlen", "--head-dim", "128", "--group-size", "4"], "--group-size applies to none"),
    (["--head-dim", "128", "--kv-dtype", "float8_e4m3"], "--kv-dtype: ['float8_e4m3'] not among"),
    (["--head-dim", "128", "--pos-encoding", "rope"], "--pos-encoding: ['ROPE'] not among"),
    (["--head-dim", "12x"], "--head-dim takes integers"),
    (["--head-dim", ","], "--head-dim needs at least one value"),
    (["--family", "prefill", "--head-dim", "64"], "unknown kernel family 'prefill'"),
    (["--family", "varlen"], "need --head-dim"),
], ids=["paged-for-decode", "group-for-varlen", "bad-kv-dtype", "bad-pos-encoding", "bad-int", "empty-list",
        "unknown-family", "no-head-dim"])
def test_bad_spec_flags_exit_2_naming_the_flag(capsys, no_builds, argv, named):
    code, out, err = run_cli(capsys, "prewarm", *argv, "--dry-run")
    assert code == 2 and named in err, err
    assert "specializations for" not in out


def test_explain_takes_the_same_flags(capsys, no_builds):
    got, out = dry_run(capsys, "explain", "--family", "varlen", "--head-dim", "64,128", "--dtype", "bfloat16",
                       "--arch", "9.0")
    prewarm, _ = dry_run(capsys, "prewarm", "--family", "varlen", "--head-dim", "64,128", "--dtype", "bfloat16",
                         "--arch", "9.0")
    assert got == prewarm and out.startswith("explain --dry-run: 9 specializations")


@pytest.mark.compile
def test_explain_of_a_varlen_flag_spec_prints_its_key(cache_root, capsys, monkeypatch):
    require_nvcc()
    code, out, err = run_cli(capsys, "explain", "--family", "varlen", "--head-dim", "64", "--paged", "off",
                             "--decode", "on", "--arch", "9.0")
    assert code == 0, err
    spec = VarlenSpec(64, "float16", False, True)
    monkeypatch.setenv("JITATTN_CUDA_ARCH_LIST", "9.0")
    assert out.startswith(spec.name + "\n") and f"  key {keys.key_of(keys.components(spec, loader.current_target(spec)))}" in out


@pytest.mark.compile
def test_prewarm_builds_the_fp8_rope_kernel_it_says(tmp_path):
    """One real build from the flags, in a child process: what the dry run lists is what lands."""
    require_nvcc()
    root = tmp_path / "cache"
    argv = ("prewarm", "--head-dim", "128", "--kv-dtype", "float8_e4m3fn", "--pos-encoding", "ROPE_LLAMA",
            "--arch", "9.0")
    listed = cli_process(*argv, "--dry-run", root=root)
    assert listed.returncode == 0, listed.stderr
    built = cli_process(*argv, root=root, timeout=600)
    assert built.returncode == 0, built.stderr
    spec = DecodeSpec.for_call(128, "float16", "float8_e4m3fn", "ROPE_LLAMA", False, 1)
    assert f"  {spec.name}  [9.0]" in listed.stdout and "built 1, already cached 0, failed 0" in built.stdout
    assert only_entry(root).name.startswith(spec.name + "-")
