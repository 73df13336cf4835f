"""Real nvcc builds through the JIT pipeline: cold build, warm load in a new process, forced
rebuild, compile errors, record mode and an unwritable cache root.

CI has nvcc and no GPU: these tests must fail there (not skip) when nvcc is missing. A module-
scoped fixture compiles DecodeSpec(head_dim=64) for sm_90 once; later tests reuse that cache.

A spec this process already loaded cannot be rebuilt in it (the loader refuses: a second library
registering the same ops would abort the process), so when another test module loaded head_dim=64
first, the fixture builds the first variant of it that is not loaded yet.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

import jitattn
from jitattn.errors import CacheNotWritable, JitCompileError, MissingSpecializationError
from jitattn.jit import cache, keys, loader, record, render
from jitattn.jit.manifest import read_manifest
from jitattn.decode.spec import DecodeSpec
from jitattn.varlen.spec import VarlenSpec
from tests.conftest import require_nvcc

pytestmark = pytest.mark.compile

REPO = Path(__file__).resolve().parent.parent
ARCH = "9.0"
ARCH_TAG = "sm90"
SPEC = DecodeSpec(head_dim=64)
SPEC_VARIANTS = [SPEC, *(DecodeSpec(head_dim=64, dtype_q=dt, dtype_kv=dt, soft_cap=cap, group_tile=g)
                         for g in (1, 2, 4, 8) for dt in ("float16", "bfloat16") for cap in (False, True))]
ENTRY_FILES = {"module.so", "binding.cpp", "kernels.cu", "manifest.json"}
# What cpp_extension.load leaves in its build directory (and load_inline's copies); none of it may reach a published entry.
BUILD_LEFTOVER = re.compile(r"(\.o|\.ninja_deps|\.ninja_log|build\.ninja|^main\.cpp|^cuda\.cu|^lock)$")
HEAVY_MODULES = ("filelock", "jinja2", "torch.utils.cpp_extension", "jitattn.jit.build", "jitattn.jit.lock")


@pytest.fixture(autouse=True)
def _nvcc_available():
    require_nvcc()


@pytest.fixture(autouse=True)
def _fresh_memos(monkeypatch):
    """Each test starts with empty in-process module / record memos (loaded .so files stay), and
    what a build sets in os.environ (CUDA_HOME) is undone."""
    monkeypatch.setenv("CUDA_HOME", os.environ.get("CUDA_HOME", ""))
    if not os.environ["CUDA_HOME"]:
        monkeypatch.delenv("CUDA_HOME")
    record.reset()
    from jitattn.kernel import fresh_memos

    with loader.forget_loaded(), fresh_memos():  # the per-call kernel memos too
        yield


def use_cache(monkeypatch, root: Path) -> None:
    monkeypatch.setenv("JITATTN_CACHE_DIR", str(root))
    monkeypatch.setenv("JITATTN_CUDA_ARCH_LIST", ARCH)
    for name in ("JITATTN_CACHE_SEED_DIRS", "JITATTN_DISABLE_JIT", "JITATTN_RECORD"):
        monkeypatch.delenv(name, raising=False)


def child_env(root: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JITATTN_")}
    env.update(PYTHONPATH=str(REPO), JITATTN_CACHE_DIR=str(root), JITATTN_CUDA_ARCH_LIST=ARCH, **extra)
    return env


def run_child(script: str, root: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=child_env(root),
                          capture_output=True, text=True, timeout=timeout, cwd=str(REPO))


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def staging_items(root: Path) -> list[str]:
    staging = root / cache.STAGING
    return sorted(p.name for p in staging.iterdir()) if staging.exists() else []


@dataclass
class Compiled:
    spec: DecodeSpec
    root: Path
    entry: Path
    key: str
    compiled: bool
    compiles: int
    module: object


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """DecodeSpec(head_dim=64) built cold for sm_90 into a fresh cache, loaded in this process."""
    require_nvcc()
    root = tmp_path_factory.mktemp("compiled") / "cache"
    # Building a spec whose op namespace this process already loaded would crash it (see
    # test_forced_rebuild_after_loading_in_the_same_process): take the first one not loaded.
    spec = next(s for s in SPEC_VARIANTS if not any(n.startswith(f"jitattn_{s.name}_") for n in loader._loaded_namespaces))
    with pytest.MonkeyPatch.context() as mp, loader.forget_loaded():
        use_cache(mp, root)
        mp.setenv("CUDA_HOME", os.environ.get("CUDA_HOME", ""))  # the build may set it: undo
        if not os.environ["CUDA_HOME"]:
            mp.delenv("CUDA_HOME")
        before = loader.COMPILE_COUNT
        module, was_compiled = loader.build_spec(spec)
        compiles = loader.COMPILE_COUNT - before
    return Compiled(spec, root, module.entry.path, module.entry.key, was_compiled, compiles, module)


def test_cold_build_publishes_a_verified_entry_and_loads_it(compiled, monkeypatch):
    use_cache(monkeypatch, compiled.root)
    spec = compiled.spec
    assert compiled.compiled and compiled.compiles == 1

    target = loader.current_target(spec)
    parts = keys.components(spec, target)
    key = keys.key_of(parts)
    assert compiled.key == key
    assert compiled.entry == compiled.root / "v1" / ARCH_TAG / f"{spec.name}-{key[:16]}"

    files = {p.name for p in compiled.entry.iterdir()}
    assert ENTRY_FILES <= files, files
    assert not [f for f in files if BUILD_LEFTOVER.search(f)], files
    assert staging_items(compiled.root) == []

    manifest = json.loads((compiled.entry / "manifest.json").read_text())
    so = compiled.entry / "module.so"
    assert manifest["library"] == {"sha256": cache.file_digest(so), "size": so.stat().st_size}
    assert manifest["key"] == key and manifest["name"] == spec.name
    assert manifest["components"] == parts
    assert manifest["components"]["archs"] == [ARCH]
    assert manifest["op_namespace"] == f"jitattn_{spec.name}_{key[:16]}" == loader.op_namespace(spec, key)
    assert cache.why_invalid(compiled.entry) is None
    assert "this is not C++" not in (compiled.entry / "kernels.cu").read_text()
    assert f"constexpr int HEAD_DIM = {spec.head_dim};" in (compiled.entry / "kernels.cu").read_text()

    import torch

    ops = getattr(torch.ops, loader.op_namespace(spec, key))
    assert callable(ops.ctas_per_sm) and not hasattr(ops, "run")  # decode launches through C, not an op
    seconds = manifest["built"]["seconds"]
    assert 0 < seconds < 600
    print(f"\ncold compile of {spec.name} for sm_90: {seconds:.2f} s (manifest built.seconds)")


def test_decode_c_entry_point_loads_and_reports_errors_as_exceptions(compiled):
    """The decode launch is a C function called through ctypes: its params layout must match
    Python's packing (DecodeKernel checks the size on load), and a failure inside it must come
    back as a RuntimeError, never as an exception crossing the C boundary."""
    import torch

    from jitattn.decode.launch import DECODE_PARAMS, DecodeKernel

    kernel = DecodeKernel(compiled.module)
    assert DECODE_PARAMS.size == 160
    # The split's tile comes from the module: 128 threads, 8 per 64-dim fp16 row, 4 rows each.
    assert compiled.spec.head_dim == 64 and not compiled.spec.tensor_cores and kernel.tile_rows == 64
    if torch.cuda.is_available():
        return  # GPU tests launch it for real; CPU pointers must not reach a GPU kernel
    q = torch.zeros(4, compiled.spec.head_dim, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="current_cuda_stream"):  # no GPU here: the stream lookup fails
        kernel.launch(q, q, q, q, None, None, (64, 64), (64, 64), 0, 4, 1, 1, 32, 1, 1.0, 0.0, 1.0, 1e4, 1.0, 0)


def test_warm_load_in_a_new_process_compiles_nothing_and_starts_no_subprocess(compiled):
    namespace = loader.op_namespace(compiled.spec, compiled.key)
    script = f"""
        import json, os, subprocess, sys, time
        import torch  # the budget is counted from after `import torch`
        import jitattn
        from jitattn.jit import loader
        from jitattn.jit.registry import spec_from_dict

        def forbidden(*args, **kwargs):
            raise AssertionError(f"the warm path started a subprocess: {{args!r}}")

        subprocess.Popen = forbidden
        os.system = forbidden
        start = time.process_time()  # this process's CPU time: other load does not stretch it
        module = loader.get_module(spec_from_dict({compiled.spec.to_dict()!r}))
        seconds = time.process_time() - start
        import torch
        print(json.dumps({{
            "seconds": seconds,
            "compiles": loader.COMPILE_COUNT,
            "entry": str(module.entry.path),
            "heavy": [m for m in {HEAVY_MODULES!r} if m in sys.modules],
            "has_ops": hasattr(getattr(torch.ops, "{namespace}"), "ctas_per_sm"),  # the library registered
        }}))
    """
    result = run_child(script, compiled.root)
    assert result.returncode == 0, result.stderr
    report = last_json(result.stdout)
    assert report["compiles"] == 0
    assert report["entry"] == str(compiled.entry)
    assert report["heavy"] == [], f"the warm path imported {report['heavy']}"
    assert report["has_ops"]
    print(f"\nwarm get_module in a new process: {report['seconds'] * 1e3:.1f} ms of CPU")
    assert report["seconds"] < 1.0


FORCED_REBUILD = """
    import json
    from jitattn.jit import cache, loader
    from jitattn.jit.registry import spec_from_dict

    spec = spec_from_dict({spec!r})
    {before}
    module, compiled = loader.build_spec(spec, force=True)
    print(json.dumps({{
        "compiled": compiled,
        "compiles": loader.COMPILE_COUNT,
        "entry": str(module.entry.path),
        "verified": cache.read_entry(module.entry.path, module.entry.key) is not None,
        "has_ops": hasattr(module.ops, "ctas_per_sm"),
    }}))
"""


def _check_forced_rebuild(result, root: Path, entry: Path) -> None:
    assert result.returncode == 0, f"rc={result.returncode}\n{result.stderr[-3000:]}"
    report = last_json(result.stdout)
    assert report["compiled"] and report["compiles"] == 1
    assert report["verified"] and report["has_ops"]
    assert report["entry"] == str(entry)
    assert cache.why_invalid(entry) is None
    assert not [f.name for f in entry.iterdir() if BUILD_LEFTOVER.search(f.name)]
    assert staging_items(root) == []


@pytest.fixture(scope="module")
def forced(compiled, tmp_path_factory):
    """build_spec(force=True) in a fresh process (as `jitattn prewarm --force` runs it), on a
    copy of the compiled cache: (child result, root, entry, manifest before)."""
    root = tmp_path_factory.mktemp("forced") / "cache"
    shutil.copytree(compiled.root, root)
    entry = root / compiled.entry.relative_to(compiled.root)
    before = json.loads((entry / cache.MANIFEST).read_text())
    result = run_child(FORCED_REBUILD.format(spec=compiled.spec.to_dict(), before=""), root)
    return result, root, entry, before


def test_forced_rebuild_compiles_again_and_leaves_a_verified_entry(forced):
    result, root, entry, _ = forced
    _check_forced_rebuild(result, root, entry)


def test_forced_rebuild_replaces_the_published_entry(forced):
    result, root, entry, before = forced
    assert result.returncode == 0, result.stderr
    after = json.loads((entry / cache.MANIFEST).read_text())
    assert after["built"]["time"] > before["built"]["time"]


def test_forced_rebuild_of_a_module_loaded_in_the_same_process_is_refused_cleanly(compiled, tmp_path):
    # Loading a second library that registers the same op namespace would abort the process;
    # the loader refuses before compiling, with an error that says what to do instead.
    root = tmp_path / "cache"
    shutil.copytree(compiled.root, root)
    entry = root / compiled.entry.relative_to(compiled.root)
    before = (entry / cache.MANIFEST).read_text()
    result = run_child(FORCED_REBUILD.format(spec=compiled.spec.to_dict(), before="loader.get_module(spec)"), root)
    assert result.returncode == 1, f"rc={result.returncode}\n{result.stderr[-3000:]}"
    assert "already loaded in this process" in result.stderr and "prewarm --force" in result.stderr
    assert (entry / cache.MANIFEST).read_text() == before and cache.why_invalid(entry) is None


@dataclass
class BrokenBuild:
    root: Path
    spec: DecodeSpec
    error: JitCompileError
    compiles: int


@pytest.fixture(scope="module")
def broken_build(tmp_path_factory):
    """A build from a copy of the templates with a line of garbage appended to the kernel."""
    require_nvcc()
    tmp = tmp_path_factory.mktemp("broken")
    broken = tmp / "templates"
    shutil.copytree(REPO / "templates", broken)
    kernels = broken / "decode" / "kernels.cu.j2"
    kernels.write_text(kernels.read_text() + "\nthis is not C++;\n")
    spec = DecodeSpec(head_dim=96)
    with pytest.MonkeyPatch.context() as mp, loader.forget_loaded():
        use_cache(mp, tmp / "cache")
        # render.render and render.spec_template_digest (the key) both call templates_dir() at call time
        mp.setattr(render, "templates_dir", lambda: broken)
        assert render.spec_template_digest(spec) != render.spec_template_digest(spec, REPO / "templates")
        before = loader.COMPILE_COUNT
        with pytest.raises(JitCompileError) as info:
            loader.get_module(spec)
        compiles = loader.COMPILE_COUNT - before
    return BrokenBuild(tmp / "cache", spec, info.value, compiles)


ERROR_AT = re.compile(r"(\S*(?:kernels|cuda)\.cu)(?:\((\d+)\)|:(\d+))")


def test_compile_error_names_the_spec_and_the_first_error_line_and_publishes_nothing(broken_build):
    err, spec, root = broken_build.error, broken_build.spec, broken_build.root
    message = str(err)
    assert err.spec_name == spec.name and spec.name in message
    match = ERROR_AT.search(err.first_error)
    assert match and "error" in err.first_error, err.first_error
    assert err.first_error in message and err.log_path in message
    log = Path(err.log_path)
    assert log.is_file() and err.first_error in log.read_text()
    # The generated source is kept beside the log; the error's line is the injected one.
    kept = log.with_suffix(".kernels.cu")
    assert kept.is_file()
    line = int(match.group(2) or match.group(3))
    assert kept.read_text().splitlines()[line - 1].strip() == "this is not C++;"

    assert broken_build.compiles == 0
    assert cache.siblings(root, keys.CACHE_SCHEMA, ARCH_TAG, spec.name) == []
    assert list(cache.entries(root)) == []
    assert staging_items(root) == []


def test_compile_error_points_at_a_file_that_still_exists(broken_build):
    match = ERROR_AT.search(broken_build.error.first_error)
    assert match
    assert Path(match.group(1)).is_file(), f"{match.group(1)} does not exist"


def test_record_mode_lists_each_requested_spec_once(compiled, tmp_path, monkeypatch):
    use_cache(monkeypatch, compiled.root)
    spec = compiled.spec
    path = tmp_path / "recorded" / "specs.toml"
    monkeypatch.setenv("JITATTN_RECORD", str(path))
    before = loader.COMPILE_COUNT

    module = loader.get_module(spec)
    assert module.entry.path == compiled.entry and loader.COMPILE_COUNT == before  # a warm load
    assert read_manifest(path) == [spec]

    loader.get_module(spec)  # memo hit
    with loader.forget_loaded():
        loader.get_module(spec)  # memo miss: asks the recorder again
    assert read_manifest(path) == [spec]
    assert path.read_text().count("[[spec]]") == 1

    # A spec that is asked for but missing (strict mode) is recorded too: it is what the
    # deployment needs to prewarm.
    other = DecodeSpec(head_dim=128, dtype_q="bfloat16", dtype_kv="bfloat16", soft_cap=True, group_tile=4)
    monkeypatch.setenv("JITATTN_DISABLE_JIT", "1")
    with pytest.raises(MissingSpecializationError, match=other.name):
        loader.get_module(other)
    assert read_manifest(path) == [spec, other]
    assert loader.COMPILE_COUNT == before


def test_unwritable_cache_root_raises_cache_not_writable(cache_root, monkeypatch):
    monkeypatch.setenv("JITATTN_CUDA_ARCH_LIST", ARCH)
    cache_root.mkdir()
    cache_root.chmod(0o500)
    try:
        try:
            (cache_root / "probe").write_bytes(b"")
        except OSError:
            pass
        if (cache_root / "probe").exists() or os.access(cache_root, os.W_OK):
            pytest.skip("running as root: a 0o500 directory is still writable")
        with pytest.raises(CacheNotWritable) as info:
            loader.get_module(SPEC)
        assert str(cache_root) in str(info.value) and "JITATTN_CACHE_DIR" in str(info.value)
        assert list(cache_root.iterdir()) == []
    finally:
        cache_root.chmod(0o700)


def test_a_write_probe_cut_off_before_its_unlink_is_staging_litter(tmp_path):
    """A process killed between the writability probe's write and its unlink (CI saw one) leaves
    its probe under staging/, where `cache prune` removes it once that process is gone; the root
    holds no stray file."""
    root = tmp_path / "cache"
    killed_at_probe = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from jitattn.jit import loader\n"
        "real_unlink = Path.unlink\n"
        "def unlink(self, *args, **kwargs):\n"
        "    if '.write-probe' in self.name:\n"
        "        os._exit(3)  # killed between the probe's write and its unlink\n"
        "    return real_unlink(self, *args, **kwargs)\n"
        "Path.unlink = unlink\n"
        "loader._ensure_writable(Path(sys.argv[1]))\n")
    done = subprocess.run([sys.executable, "-c", killed_at_probe, str(root)],
                          cwd=str(Path(__file__).resolve().parent.parent))
    assert done.returncode == 3
    assert [p.name for p in root.iterdir()] == [cache.STAGING]
    litter = list((root / cache.STAGING).iterdir())
    assert len(litter) == 1 and litter[0].name.startswith(".write-probe")
    assert cache.prune_staging(root, older_than_s=0) == litter
    assert list((root / cache.STAGING).iterdir()) == []
    loader._ensure_writable(root)  # a probe that finishes leaves nothing behind
    assert list((root / cache.STAGING).iterdir()) == []


def test_cache_root_below_a_file_raises_cache_not_writable(tmp_path, monkeypatch):
    """Works as root too: no permission bit stops mkdir under a regular file."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    root = blocker / "cache"
    use_cache(monkeypatch, root)
    before = loader.COMPILE_COUNT
    with pytest.raises(CacheNotWritable) as info:
        loader.get_module(DecodeSpec(head_dim=80))
    message = str(info.value)
    assert str(root) in message and "JITATTN_CACHE_DIR" in message
    assert isinstance(info.value, jitattn.JitattnError)
    assert loader.COMPILE_COUNT == before


def test_each_varlen_tile_shape_compiles_and_loads_its_entry_point(tmp_path, monkeypatch):
    """The varlen family's tile shapes (prefill, decode, and the Hopper wgmma prefill, also its
    persistent schedule), paged and not: real nvcc builds through the pipeline (sm_90; sm_90a for
    wgmma), each loaded with its ctas_per_sm op and its C launch entry, whose params layout matches
    Python's packing (VarlenKernel compares sizes on load); a failure inside the entry comes back as
    a RuntimeError, never as an exception crossing the C boundary."""
    import torch

    from jitattn.varlen.launch import VarlenKernel

    use_cache(monkeypatch, tmp_path / "cache")  # the module memo is empty (_fresh_memos)
    for spec in (VarlenSpec(head_dim=64, dtype="bfloat16", paged=True, decode=False),
                 VarlenSpec(head_dim=64, dtype="float16", paged=False, decode=True),
                 VarlenSpec(head_dim=128, dtype="bfloat16", paged=False, decode=False, wgmma=True),
                 *(VarlenSpec(head_dim=d, dtype="bfloat16", paged=False, decode=False, wgmma=True, tma=True,
                              split_kv=d == 256, persistent=True) for d in (64, 128, 256))):
        module, was_compiled = loader.build_spec(spec)
        assert was_compiled and cache.why_invalid(module.entry.path) is None
        assert ("sm90a" in module.entry.path.parent.name) == spec.wgmma
        ops = getattr(torch.ops, loader.op_namespace(spec, module.entry.key))
        assert callable(ops.ctas_per_sm) and not hasattr(ops, "run")  # launched through C, not an op
        kernel = VarlenKernel(module, spec)
        if torch.cuda.is_available():
            continue  # GPU tests launch it for real; CPU pointers must not reach a GPU kernel
        q = torch.zeros(4, 2, spec.head_dim, dtype=getattr(torch, spec.dtype))
        k = torch.zeros(1, 16, 2, spec.head_dim, dtype=q.dtype) if spec.paged else q
        cu = torch.tensor([0, 4], dtype=torch.int32)
        with pytest.raises(RuntimeError, match="current_cuda_stream"):  # no GPU here: the stream lookup fails
            kernel.run(q, k, k, cu, None if spec.paged else cu, None, cu[None] if spec.paged else None, q, None, 1, 1,
                       1, 0, -1, -1, 1.0, 0.0, False, False, ())


def test_event_floor_probe_builds(tmp_path):
    """tools/event_floor.cu, which tools/device_check.sh builds and runs on the GPU machine,
    compiles with this toolkit (so it cannot rot where no GPU runs it)."""
    require_nvcc()
    from jitattn.jit import toolchain

    home, _ = toolchain.resolve_cuda_home()
    binary = tmp_path / "event_floor"
    result = subprocess.run([str(home / "bin" / "nvcc"), "-O2", "-arch=sm_90", str(REPO / "tools" / "event_floor.cu"),
                             "-o", str(binary)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert binary.stat().st_size > 0


def test_each_varlen_backward_rung_compiles_and_registers_its_op(tmp_path, monkeypatch):
    """The backward family's rungs: mma.sync at both warp layouts (warps_q 1: all of dK / dV per
    warp; 2: split across a pair, head_dim > 128) and the Hopper wgmma one (and its persistent
    producer variant, the largest template path, and the 80-row tile with dQ transposed, full D128
    calls': spec.TILE80_HEAD_DIMS): real nvcc builds through the pipeline (sm_90; sm_90a for
    wgmma), each loaded with its run op."""
    import torch

    from jitattn.varlen.spec import VarlenBackwardSpec

    use_cache(monkeypatch, tmp_path / "cache")  # the module memo is empty (_fresh_memos)
    for spec in (VarlenBackwardSpec(head_dim=128, dtype="bfloat16"), VarlenBackwardSpec(head_dim=208, dtype="float16"),
                 VarlenBackwardSpec(head_dim=64, dtype="float16", wgmma=True),
                 VarlenBackwardSpec(head_dim=128, dtype="bfloat16", wgmma=True, producer=True, persistent=True),
                 VarlenBackwardSpec(head_dim=128, dtype="bfloat16", wgmma=True, producer=True, block_m=80)):
        module, was_compiled = loader.build_spec(spec)
        assert was_compiled and cache.why_invalid(module.entry.path) is None
        assert module.entry.path.parent.name == ("sm90a" if spec.wgmma else "sm90")
        ops = getattr(torch.ops, loader.op_namespace(spec, module.entry.key))
        assert "bool deterministic" in str(ops.run.default._schema)
