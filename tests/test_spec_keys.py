"""CPU tests: spec naming, content keys, template rendering and the toolchain probes (no compiles)."""
from __future__ import annotations

import re

import dataclasses
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest

from jitattn.errors import ToolchainError
from jitattn.jit import keys, render, toolchain
from jitattn.decode.spec import DecodeSpec
from jitattn.jit.registry import spec_from_dict
from jitattn.varlen.spec import VarlenSpec
from jitattn.varlen import spec as varlen_spec

TARGET = keys.BuildTarget(("9.0",), "13.0.88", "gcc 12.2.0")
DECODE_ENTRY_POINTS = tuple(sorted(DecodeSpec.sources.values()))


# ----------------------------------------------------------------------------- spec naming


JINJA_LEFTOVER = re.compile(r"\{\{\s*\w|\{%-?\s*[a-z]|\{#")


def test_decode_name_is_a_readable_slug_of_every_field():
    spec = DecodeSpec(head_dim=128, dtype_q="bfloat16", dtype_kv="float8_e4m3fn",
                      pos_encoding="ROPE_LLAMA", soft_cap=True, group_tile=4)
    assert spec.name == "decode_bf16_kve4m3_d128_posropellama_cap1_g4"
    default = DecodeSpec(head_dim=64)
    assert default.name == "decode_f16_kvf16_d64_posnone_cap0_g1"
    # No '-' in names: cache directories are '<name>-<key16>' and siblings split on the last '-'.
    assert "-" not in spec.name and "-" not in default.name


def test_names_differ_for_specs_that_differ_in_any_field():
    base = DecodeSpec(head_dim=128)
    variants = [
        dataclasses.replace(base, head_dim=64),
        dataclasses.replace(base, dtype_q="bfloat16"),
        dataclasses.replace(base, dtype_kv="float8_e5m2"),
        dataclasses.replace(base, pos_encoding="ALIBI"),
        dataclasses.replace(base, soft_cap=True),
        dataclasses.replace(base, group_tile=8),
    ]
    names = {v.name for v in variants} | {base.name}
    assert len(names) == len(variants) + 1


@pytest.mark.parametrize("group_size, tile", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (6, 8), (7, 8), (8, 8), (16, 8)])
def test_group_tile_is_the_group_rounded_up_to_a_power_of_two_at_most_8(group_size, tile):
    assert DecodeSpec.group_tile_for(group_size) == tile


def test_spec_from_dict_inverts_to_dict():
    spec = DecodeSpec(head_dim=96, dtype_q="bfloat16", dtype_kv="float8_e4m3fn",
                      pos_encoding="ALIBI", soft_cap=True, group_tile=2)
    data = spec.to_dict()
    assert data["family"] == "decode"
    back = spec_from_dict(data)
    assert back == spec and type(back) is DecodeSpec
    assert data == spec.to_dict()  # not mutated by spec_from_dict


def test_spec_from_dict_accepts_group_size_and_defaults_dtype_kv_to_dtype_q():
    spec = spec_from_dict({"family": "decode", "head_dim": 128, "dtype_q": "bfloat16", "group_size": 3})
    assert spec == DecodeSpec(head_dim=128, dtype_q="bfloat16", dtype_kv="bfloat16", group_tile=4)
    # a group of 6 is what a call with use_tensor_cores=False runs: tensor cores (DecodeSpec.for_call)
    spec = spec_from_dict({"family": "decode", "head_dim": 128, "dtype_q": "bfloat16", "group_size": 6})
    assert spec == DecodeSpec(head_dim=128, dtype_q="bfloat16", dtype_kv="bfloat16", group_tile=8, tensor_cores=True)
    explicit = spec_from_dict({"family": "decode", "head_dim": 64, "dtype_q": "float16", "dtype_kv": "float8_e5m2"})
    assert explicit.dtype_kv == "float8_e5m2"


@pytest.mark.parametrize("family", ["prefill", None])
def test_spec_from_dict_rejects_an_unknown_family(family):
    data = {"head_dim": 128} if family is None else {"family": family, "head_dim": 128}
    with pytest.raises(ValueError, match="unknown kernel family") as info:
        spec_from_dict(data)
    assert "decode" in str(info.value)  # lists the known ones
    if family:
        assert family in str(info.value)


def test_spec_from_dict_rejects_unknown_fields_by_name():
    with pytest.raises(ValueError, match="unknown decode spec fields") as info:
        spec_from_dict({"family": "decode", "head_dim": 128, "kv_layout": "NHD", "blocksize": 4})
    assert "blocksize" in str(info.value) and "kv_layout" in str(info.value)
    assert "head_dim" in str(info.value)  # names the known fields too


def test_decode_builds_plain_sm_for_an_a_suffixed_arch():
    spec = DecodeSpec(head_dim=128)
    assert spec.archs_for(("9.0a",)) == ("9.0",)
    assert spec.archs_for(("9.0a", "8.0", "9.0")) == ("8.0", "9.0")
    assert spec.archs_for(("10.0", "9.0")) == ("9.0", "10.0")  # numeric order, not string order


# ----------------------------------------------------------------------------- keys


def test_key_is_deterministic():
    spec = DecodeSpec(head_dim=128, pos_encoding="ALIBI")
    first = keys.key_of(keys.components(spec, TARGET))
    again = keys.key_of(keys.components(DecodeSpec(head_dim=128, pos_encoding="ALIBI"),
                                        keys.BuildTarget(("9.0",), "13.0.88", "gcc 12.2.0")))
    assert first == again
    assert len(first) == 64 and int(first, 16) >= 0


def test_key_does_not_depend_on_the_process():
    spec = DecodeSpec(head_dim=64, dtype_q="bfloat16", dtype_kv="bfloat16", soft_cap=True, group_tile=4)
    here = keys.key_of(keys.components(spec, TARGET))
    code = (
        "from jitattn.jit import keys; from jitattn.decode.spec import DecodeSpec;"
        "s = DecodeSpec(head_dim=64, dtype_q='bfloat16', dtype_kv='bfloat16', soft_cap=True, group_tile=4);"
        "print(keys.key_of(keys.components(s, keys.BuildTarget(('9.0',), '13.0.88', 'gcc 12.2.0'))))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=Path(__file__).resolve().parent.parent, timeout=60, check=True).stdout
    assert out.strip().splitlines()[-1] == here


@pytest.mark.parametrize("field, value", [
    ("head_dim", 64),
    ("dtype_q", "bfloat16"),
    ("dtype_kv", "float8_e4m3fn"),
    ("pos_encoding", "ROPE_LLAMA"),
    ("soft_cap", True),
    ("group_tile", 2),
])
def test_changing_any_spec_field_changes_the_key(field, value):
    base = DecodeSpec(head_dim=128)
    other = dataclasses.replace(base, **{field: value})
    assert keys.key_of(keys.components(base, TARGET)) != keys.key_of(keys.components(other, TARGET))


@pytest.mark.parametrize("change", [
    {"archs": ("8.0",)},
    {"archs": ("8.0", "9.0")},
    {"archs": ("9.0a",)},
    {"nvcc": "13.0.89"},
    {"host_cxx": "gcc 12.3.0"},
    {"host_cxx": "clang 12.2.0"},
])
def test_changing_the_build_target_changes_the_key(change):
    spec = DecodeSpec(head_dim=128)
    other = TARGET._replace(**change)
    ours, theirs = keys.components(spec, TARGET), keys.components(spec, other)
    assert keys.key_of(ours) != keys.key_of(theirs)
    assert keys.differing(ours, theirs)  # and `explain` can say which component


def test_differing_names_exactly_the_changed_components():
    spec = DecodeSpec(head_dim=128)
    ours = keys.components(spec, TARGET)
    assert keys.differing(ours, dict(ours)) == []
    theirs = keys.components(spec, TARGET._replace(nvcc="12.8.93"))
    assert keys.differing(ours, theirs) == ["nvcc"]
    theirs = keys.components(dataclasses.replace(spec, head_dim=64), TARGET._replace(archs=("8.0",)))
    assert keys.differing(ours, theirs) == ["archs", "cuda_flags", "params", "spec"]


def test_components_list_everything_the_key_docstring_names():
    parts = keys.components(DecodeSpec(head_dim=128), keys.BuildTarget(("8.0", "9.0"), "13.0.88", "gcc 12.2.0"))
    # Docstring: template sources, spec fields, the template parameters' digest, normalized compile
    # flags, sorted target archs, stable-ABI target, cache schema, nvcc release, host compiler version.
    assert set(parts) == {"templates", "spec", "params", "cxx_flags", "cuda_flags", "archs", "abi", "schema",
                          "nvcc", "host_cxx"}
    assert parts["params"] == keys.params_digest(DecodeSpec(head_dim=128))
    assert parts["schema"] == keys.CACHE_SCHEMA
    assert parts["abi"] == "torch-stable-%d.%d" % keys.TORCH_ABI_TARGET
    assert parts["archs"] == ["8.0", "9.0"]
    assert parts["spec"] == DecodeSpec(head_dim=128).to_dict()
    assert parts["nvcc"] == "13.0.88" and parts["host_cxx"] == "gcc 12.2.0"
    assert keys.TORCH_TARGET_VERSION_FLAG in parts["cxx_flags"]
    assert "-gencode=arch=compute_80,code=sm_80" in parts["cuda_flags"]
    assert "-gencode=arch=compute_90,code=sm_90" in parts["cuda_flags"]
    assert parts["templates"] == render.template_digest(render.templates_dir(), DECODE_ENTRY_POINTS)
    # No path or mtime leaks into the key: nothing in it names this checkout.
    assert str(render.templates_dir()) not in repr(parts)


def test_key_uses_sorted_archs():
    # The key docstring (and DESIGN.md) promise "the sorted target archs".
    spec = DecodeSpec(head_dim=128)
    a = keys.components(spec, keys.BuildTarget(("8.0", "9.0"), "13.0.88", "gcc 12.2.0"))
    b = keys.components(spec, keys.BuildTarget(("9.0", "8.0"), "13.0.88", "gcc 12.2.0"))
    assert keys.key_of(a) == keys.key_of(b)


def _copy_templates(dst: Path) -> Path:
    shutil.copytree(render.templates_dir(), dst)
    return dst


def test_template_files_follow_includes_and_imports():
    files = render.template_files(render.templates_dir(), DECODE_ENTRY_POINTS)
    for rel in ("decode/binding.cpp.j2", "decode/kernels.cu.j2", "decode/params.h", "common/binding.h",
                "common/softmax.cuh", "common/cp_async.cuh", "common/dtypes.cuh", "common/ctypes.j2"):
        assert rel in files
    assert list(files) == sorted(files)


@pytest.mark.parametrize("rel", ["common/softmax.cuh", "common/ctypes.j2", "decode/params.h", "decode/kernels.cu.j2"])
def test_one_changed_template_byte_changes_the_digest(tmp_path, rel):
    original = render.template_digest(render.templates_dir(), DECODE_ENTRY_POINTS)
    copy = _copy_templates(tmp_path / "templates")
    path = copy / rel
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    assert render.template_digest(copy, DECODE_ENTRY_POINTS) != original


def test_an_unreached_template_file_does_not_change_the_digest(tmp_path):
    copy = _copy_templates(tmp_path / "templates")
    (copy / "common" / "unused.cuh").write_text("// not included by any decode template\n")
    assert render.template_digest(copy, DECODE_ENTRY_POINTS) == render.template_digest(
        render.templates_dir(), DECODE_ENTRY_POINTS)


def test_moving_the_templates_tree_does_not_change_the_digest(tmp_path):
    original = render.template_digest(render.templates_dir(), DECODE_ENTRY_POINTS)
    copy = _copy_templates(tmp_path / "a" / "templates")
    assert render.template_digest(copy, DECODE_ENTRY_POINTS) == original
    moved = tmp_path / "elsewhere" / "deeper" / "tpl"
    moved.parent.mkdir(parents=True)
    shutil.move(str(copy), str(moved))
    # Touching mtimes changes nothing either.
    for p in moved.rglob("*"):
        os.utime(p, (1, 1))
    assert render.template_digest(moved, DECODE_ENTRY_POINTS) == original


def test_renaming_an_included_file_changes_the_digest(tmp_path):
    copy = _copy_templates(tmp_path / "templates")
    kernels = copy / "decode" / "kernels.cu.j2"
    kernels.write_text(kernels.read_text().replace('"common/softmax.cuh"', '"common/softmax2.cuh"'))
    (copy / "common" / "softmax.cuh").rename(copy / "common" / "softmax2.cuh")
    plain = _copy_templates(tmp_path / "plain")
    kernels_plain = plain / "decode" / "kernels.cu.j2"
    kernels_plain.write_text(kernels.read_text().replace('"common/softmax2.cuh"', '"common/softmax.cuh"'))
    assert render.template_digest(copy, DECODE_ENTRY_POINTS) != render.template_digest(plain, DECODE_ENTRY_POINTS)


# ----------------------------------------------------------------------------- rendering

DTYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16"}


@pytest.mark.parametrize("head_dim", range(32, 257, 16))
def test_every_decode_variant_renders_completely(head_dim):
    for mode in ("ROPE_LLAMA", "ALIBI"):  # positional encodings, fp8 and the tensor-core path too
        for extra in ({}, {"dtype_kv": "float8_e4m3fn"} if head_dim % 32 == 0 else None,
                      {"tensor_cores": True, "group_tile": 16} if head_dim % 32 == 0 else None):
            if extra is not None:
                text = render.render(DecodeSpec(head_dim=head_dim, pos_encoding=mode, **extra), "ns")["kernels.cu"]
                assert not JINJA_LEFTOVER.search(text)
                assert f"constexpr bool {'ROPE' if mode == 'ROPE_LLAMA' else 'ALIBI'} = true;" in text
    for dtype, ctype in DTYPES.items():
        for soft_cap in (False, True):
            for group_tile in (1, 2, 4, 8):
                spec = DecodeSpec(head_dim=head_dim, dtype_q=dtype, dtype_kv=dtype, soft_cap=soft_cap,
                                  group_tile=group_tile)
                ns = f"jitattn_{spec.name}"
                out = render.render(spec, ns)
                assert set(out) == {"binding.cpp", "kernels.cu"}
                for name, text in out.items():
                    # Jinja leftovers; asm operand lists such as "{%0, %1}" are C, not Jinja.
                    assert not JINJA_LEFTOVER.search(text), (spec.name, name, JINJA_LEFTOVER.search(text))
                    assert spec.name in text  # the header comment names the specialization
                kernels, binding = out["kernels.cu"], out["binding.cpp"]
                assert f"constexpr int HEAD_DIM = {head_dim};" in kernels
                assert f"constexpr int GROUP_TILE = {group_tile};" in kernels
                assert f"constexpr bool SOFT_CAP = {'true' if soft_cap else 'false'};" in kernels
                assert f"using DTypeQ = {ctype};" in kernels and f"using DTypeKV = {ctype};" in kernels
                assert f"STABLE_TORCH_LIBRARY({ns}, m)" in binding  # ctas_per_sm
                assert 'extern "C"' in binding and "int jitattn_decode_launch(const DecodeParams* p)" in binding


def test_render_is_deterministic():
    spec = DecodeSpec(head_dim=128, dtype_q="bfloat16", dtype_kv="bfloat16", group_tile=4)
    assert render.render(spec, "ns") == render.render(spec, "ns")


def test_an_undefined_template_variable_is_an_error(tmp_path):
    root = tmp_path / "templates"
    (root / "decode").mkdir(parents=True)
    (root / "decode" / "binding.cpp.j2").write_text("int x = {{ head_dim }};\n")
    (root / "decode" / "kernels.cu.j2").write_text("constexpr int N = {{ no_such_parameter }};\n")
    with pytest.raises(jinja2.UndefinedError, match="no_such_parameter"):
        render.render(DecodeSpec(head_dim=128), "ns", root=root)


def test_an_undefined_variable_inside_an_expression_is_an_error(tmp_path):
    root = tmp_path / "templates"
    (root / "decode").mkdir(parents=True)
    (root / "decode" / "binding.cpp.j2").write_text("{% if missing_flag %}a{% endif %}\n")
    (root / "decode" / "kernels.cu.j2").write_text("ok\n")
    with pytest.raises(jinja2.UndefinedError):
        render.render(DecodeSpec(head_dim=128), "ns", root=root)


# ----------------------------------------------------------------------------- archs


@pytest.mark.parametrize("raw, expected", [
    ("9.0;8.0", ("8.0", "9.0")),
    ("9.0", ("9.0",)),
    ("9.0a", ("9.0a",)),
    ("8.0 8.9,9.0", ("8.0", "8.9", "9.0")),
    ("9.0+PTX;8.0", ("8.0", "9.0")),
    ("9.0;9.0;8.0", ("8.0", "9.0")),
    ("10.0;9.0", ("9.0", "10.0")),
    ("9.0a;9.0", ("9.0", "9.0a")),
    (" 9.0 ; ", ("9.0",)),
])
def test_parse_arch_list(raw, expected):
    assert toolchain.parse_arch_list(raw) == expected


@pytest.mark.parametrize("raw, bad", [("9.0;sm_90", "sm_90"), ("90", "90"), ("9.0;8.x", "8.x"), ("9", "9")])
def test_parse_arch_list_names_the_bad_entry(raw, bad):
    with pytest.raises(ValueError) as info:
        toolchain.parse_arch_list(raw)
    assert repr(bad) in str(info.value)


@pytest.mark.parametrize("raw", ["", " ; "])
def test_parse_arch_list_rejects_an_empty_list(raw):
    with pytest.raises(ValueError, match="empty"):
        toolchain.parse_arch_list(raw)


def test_arch_tag_and_gencode_flags():
    assert toolchain.arch_tag(("9.0",)) == "sm90"
    assert toolchain.arch_tag(("8.0", "9.0")) == "sm80+sm90"
    assert toolchain.arch_tag(("9.0a",)) == "sm90a"
    assert toolchain.gencode_flags(("8.0", "9.0a")) == [
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_90a,code=sm_90a",
    ]
    assert toolchain.gencode_flags(()) == []


@pytest.fixture
def no_arch_env(monkeypatch):
    monkeypatch.delenv("JITATTN_CUDA_ARCH_LIST", raising=False)
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    visible = toolchain.visible_gpu_archs  # lru_cached: start and end with an empty cache
    visible.cache_clear()
    yield monkeypatch
    visible.cache_clear()


def test_target_archs_prefers_jitattn_arch_list(no_arch_env):
    no_arch_env.setenv("JITATTN_CUDA_ARCH_LIST", "9.0;8.0")
    no_arch_env.setenv("TORCH_CUDA_ARCH_LIST", "7.5")
    assert toolchain.target_archs() == (("8.0", "9.0"), "JITATTN_CUDA_ARCH_LIST")


def test_target_archs_falls_back_to_torch_arch_list(no_arch_env):
    no_arch_env.setenv("TORCH_CUDA_ARCH_LIST", "8.9 9.0+PTX")
    assert toolchain.target_archs() == (("8.9", "9.0"), "TORCH_CUDA_ARCH_LIST")


def test_target_archs_uses_visible_gpus_when_nothing_is_set(no_arch_env):
    no_arch_env.setattr(toolchain, "visible_gpu_archs", lambda: ("9.0",))
    assert toolchain.target_archs() == (("9.0",), "visible GPUs")


def test_target_archs_without_gpu_or_setting_says_how_to_set_one(no_arch_env):
    no_arch_env.setattr(toolchain, "visible_gpu_archs", lambda: ())
    with pytest.raises(ToolchainError) as info:
        toolchain.target_archs()
    msg = str(info.value)
    assert "JITATTN_CUDA_ARCH_LIST" in msg and "TORCH_CUDA_ARCH_LIST" in msg and "no GPU" in msg


def test_target_archs_on_this_machine_without_a_gpu(no_arch_env):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert toolchain.visible_gpu_archs() == ()
    with pytest.raises(ToolchainError, match="JITATTN_CUDA_ARCH_LIST"):
        toolchain.target_archs()


def test_a_bad_arch_setting_names_the_variable(no_arch_env):
    no_arch_env.setenv("TORCH_CUDA_ARCH_LIST", "9.0;hopper")
    with pytest.raises(ToolchainError) as info:
        toolchain.target_archs()
    assert "TORCH_CUDA_ARCH_LIST" in str(info.value) and "'hopper'" in str(info.value)


# ----------------------------------------------------------------------------- toolchain


def _script(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def test_follow_wrapper_resolves_a_shell_exec_wrapper(tmp_path):
    real = _script(tmp_path / "cuda-13.0" / "bin" / "nvcc", "#!/bin/sh\necho real nvcc\n")
    wrapper = _script(tmp_path / "wrap" / "nvcc", f'#!/bin/sh\nexec {real} "$@"\n')
    assert toolchain._follow_wrapper(wrapper) == real.resolve()
    quoted = _script(tmp_path / "wrap2" / "nvcc", f'#!/bin/bash\n# a wrapper\nexec "{real}" "$@"\n')
    assert toolchain._follow_wrapper(quoted) == real.resolve()
    # A symlink to the wrapper resolves through both.
    link_dir = tmp_path / "links"
    link_dir.mkdir()
    (link_dir / "nvcc").symlink_to(wrapper)
    assert toolchain._follow_wrapper(link_dir / "nvcc") == real.resolve()


def test_follow_wrapper_keeps_a_wrapper_whose_target_is_missing(tmp_path):
    wrapper = _script(tmp_path / "wrap" / "nvcc", f'#!/bin/sh\nexec {tmp_path}/nowhere/bin/nvcc "$@"\n')
    assert toolchain._follow_wrapper(wrapper) == wrapper.resolve()
    binary = tmp_path / "bin" / "nvcc"
    binary.parent.mkdir()
    binary.write_bytes(b"\x7fELF" + b"\0" * 64)
    assert toolchain._follow_wrapper(binary) == binary.resolve()


def test_cuda_home_is_found_through_a_wrapped_nvcc_on_path(tmp_path, monkeypatch):
    real = _script(tmp_path / "toolkit" / "bin" / "nvcc", "#!/bin/sh\necho real\n")
    _script(tmp_path / "wrap" / "nvcc", f'#!/bin/sh\nexec {real} "$@"\n')
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "wrap"))
    home, why = toolchain.resolve_cuda_home()
    assert home == (tmp_path / "toolkit").resolve()
    assert "nvcc on PATH" in why
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "explicit"))
    assert toolchain.resolve_cuda_home() == (tmp_path / "explicit", "CUDA_HOME/CUDA_PATH")


@pytest.fixture
def fake_toolchain(tmp_path, monkeypatch):
    """A fake CUDA home and host compiler (shell scripts) selected through CUDA_HOME and CXX."""
    cuda = tmp_path / "cuda"
    nvcc = _script(cuda / "bin" / "nvcc", "#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
                                          "echo 'Cuda compilation tools, release 13.0, V13.0.88'\n")
    cxx = _script(tmp_path / "bin" / "g++", '#!/bin/sh\ncase "$1" in\n'
                                             "  --version) echo 'g++ (GCC) 12.2.0' ;;\n"
                                             "  -dumpfullversion) echo '12.2.0' ;;\nesac\n")
    monkeypatch.setenv("CUDA_HOME", str(cuda))
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("CXX", str(cxx))
    toolchain._fingerprint.cache_clear()
    yield nvcc, cxx
    toolchain._fingerprint.cache_clear()


def test_fingerprint_reads_nvcc_and_host_compiler_versions(fake_toolchain, tmp_path):
    nvcc, cxx = fake_toolchain
    tc = toolchain.fingerprint(memo_dir=None)
    assert tc.nvcc_release == "13.0.88"
    assert tc.host_cxx_version == "gcc 12.2.0"
    assert tc.nvcc == nvcc.resolve() and tc.host_cxx == cxx.resolve()


def test_fingerprint_memo_avoids_every_subprocess_in_a_fresh_process(fake_toolchain, tmp_path, monkeypatch):
    memo = tmp_path / "memo"
    first = toolchain.fingerprint(memo_dir=memo)
    assert (memo / "toolchains.json").is_file()
    toolchain._fingerprint.cache_clear()  # as if a new process started

    def no_subprocess(*args, **kwargs):
        raise AssertionError(f"ran a subprocess on the warm path: {args}")

    monkeypatch.setattr(subprocess, "run", no_subprocess)
    monkeypatch.setattr(subprocess, "Popen", no_subprocess)
    second = toolchain.fingerprint(memo_dir=memo)
    assert (second.nvcc_release, second.host_cxx_version) == (first.nvcc_release, first.host_cxx_version)
    assert (second.nvcc_release, second.host_cxx_version) == ("13.0.88", "gcc 12.2.0")


def test_fingerprint_memo_is_invalidated_when_the_compiler_changes(fake_toolchain, tmp_path):
    nvcc, _ = fake_toolchain
    memo = tmp_path / "memo"
    assert toolchain.fingerprint(memo_dir=memo).nvcc_release == "13.0.88"
    _script(nvcc, "#!/bin/sh\necho 'Cuda compilation tools, release 13.1, V13.1.115'  # upgraded\n")
    toolchain._fingerprint.cache_clear()
    assert toolchain.fingerprint(memo_dir=memo).nvcc_release == "13.1.115"


def test_fingerprint_without_a_toolkit_raises_toolchain_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    with pytest.raises(ToolchainError, match="no CUDA toolkit"):
        toolchain.fingerprint(memo_dir=None)


@pytest.mark.parametrize("head_dim", range(32, 257, 16))
def test_every_varlen_variant_renders_completely(head_dim):
    for dtype, ctype in DTYPES.items():
        for paged in (False, True):
            for decode in (False, True):
                spec = VarlenSpec(head_dim=head_dim, dtype=dtype, paged=paged, decode=decode)
                out = render.render(spec, "ns")
                for name, text in out.items():
                    assert not JINJA_LEFTOVER.search(text), (spec.name, name, JINJA_LEFTOVER.search(text))
                    assert spec.name in text or (name == "mask_map.cu" and not text.strip())  # no mask_mod: no unit
                kernels = out["kernels.cu"]
                assert f"constexpr int HEAD_DIM = {head_dim};" in kernels and f"using T = {ctype};" in kernels
                assert f"constexpr bool PAGED = {'true' if paged else 'false'};" in kernels
                assert f"constexpr bool DECODE = {'true' if decode else 'false'};" in kernels


def test_varlen_names_and_keys_differ_in_every_field():
    base = VarlenSpec(head_dim=128)
    assert base.name == "varlen_f16_d128_prefill_m4x2n64s2"
    variants = [base, VarlenSpec(head_dim=64), VarlenSpec(head_dim=128, dtype="bfloat16"),
                VarlenSpec(head_dim=128, paged=True), VarlenSpec(head_dim=128, decode=True),
                VarlenSpec(head_dim=128, warps_m=8, m_tiles=1), VarlenSpec(head_dim=128, block_n=32),
                VarlenSpec(head_dim=128, stages=3), VarlenSpec(head_dim=128, wgmma=True)]
    target = keys.BuildTarget(("9.0",), "13.0.88", "gcc 12.2.0")
    assert len({v.name for v in variants}) == len({keys.key_of(keys.components(v, target)) for v in variants}) == 9
    assert VarlenSpec(head_dim=128, warps_m=4) == base  # 0 and the default tile are the same spec
    assert spec_from_dict(VarlenSpec(head_dim=96, dtype="bfloat16", paged=True).to_dict()) == \
        VarlenSpec(head_dim=96, dtype="bfloat16", paged=True)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_wgmma_varlen_spec_renders_and_targets_sm90a(head_dim):
    spec = VarlenSpec(head_dim=head_dim, dtype="bfloat16", paged=True, wgmma=True)
    assert spec.name.startswith(f"varlen_bf16_d{head_dim}_paged_prefill_wgmma_m8x1n")
    assert (spec.warps_m, spec.m_tiles) == (8, 1) and spec_from_dict(spec.to_dict()) == spec
    kernels = render.render(spec, "ns")["kernels.cu"]
    assert not JINJA_LEFTOVER.search(kernels) and "constexpr bool WGMMA = true;" in kernels
    assert f"wgmma.mma_async.sync.aligned.m64n{head_dim}k16.f32.bf16.bf16" in kernels
    # wgmma needs the arch-specific target; other archs cannot run it.
    assert spec.archs_for(("9.0",)) == spec.archs_for(("8.0", "9.0a")) == ("9.0a",)
    with pytest.raises(ValueError, match="only sm_90"):
        spec.archs_for(("8.0", "10.0"))
    assert VarlenSpec(head_dim=head_dim).archs_for(("9.0a",)) == ("9.0",)  # mma.sync: plain sm_90


@pytest.mark.parametrize("head_dim", [128, 256])
def test_wgmma_schedules_are_spec_fields_that_round_trip(head_dim):
    base = VarlenSpec(head_dim=head_dim, dtype="bfloat16", wgmma=True)
    assert (base.pingpong, base.overlap) == (False, False)  # the old kernel
    variants = [dataclasses.replace(base, pingpong=pp, overlap=ov) for pp in (False, True) for ov in (False, True)]
    target = keys.BuildTarget(("9.0",), "13.0.88", "gcc 12.2.0")
    assert len({v.name for v in variants}) == len({keys.key_of(keys.components(v, target)) for v in variants}) == 4
    for v in variants:
        assert spec_from_dict(v.to_dict()) == v and isinstance(v.to_dict()["pingpong"], bool)
        kernels = render.render(v, "ns")["kernels.cu"]
        assert not JINJA_LEFTOVER.search(kernels)
        assert f"constexpr bool PINGPONG = {'true' if v.pingpong else 'false'};" in kernels
        assert f"constexpr bool OVERLAP = {'true' if v.overlap else 'false'};" in kernels
    assert variants[3].name.endswith("_pingpong_overlap")


def _a_new_kernel_of_its_own(base, flagged, field: str, suffix: str) -> str:
    """A spec field turned on names, keys and round-trips its own kernel; its rendered source."""
    target = keys.BuildTarget(("9.0",), "13.0.88", "gcc 12.2.0")
    assert flagged.name == base.name + suffix
    assert keys.key_of(keys.components(flagged, target)) != keys.key_of(keys.components(base, target))
    assert spec_from_dict(flagged.to_dict()) == flagged and flagged.to_dict()[field] is True
    kernels = render.render(flagged, "ns")["kernels.cu"]
    assert not JINJA_LEFTOVER.search(kernels)
    return kernels


@pytest.mark.parametrize("head_dim, paged, tma", [(128, False, True), (128, True, True), (256, False, False), (64, False, True)])
def test_split_kv_is_a_spec_field_that_round_trips(head_dim, paged, tma):
    base = VarlenSpec(head_dim=head_dim, dtype="bfloat16", paged=paged, wgmma=True, tma=tma)
    assert base.split_kv is False  # the old kernel
    split = dataclasses.replace(base, split_kv=True)
    kernels = _a_new_kernel_of_its_own(base, split, "split_kv", "_splitkv")
    assert "constexpr bool SPLIT_KV = true;" in kernels and "full_v[STAGES], empty_v[STAGES]" in kernels
    assert ("tma_kv_tile<2>" in kernels) == tma  # V onto its own barrier
    plain = render.render(base, "ns")["kernels.cu"]
    assert "constexpr bool SPLIT_KV = false;" in plain and "full_v[STAGES]" not in plain


@pytest.mark.parametrize("head_dim, paged", [(128, False), (128, True), (64, False), (256, False), (256, True)])
def test_persistent_is_a_spec_field_that_round_trips(head_dim, paged):
    base = VarlenSpec(head_dim=head_dim, dtype="bfloat16", paged=paged, wgmma=True, tma=True,
                      split_kv=head_dim == 256)
    assert base.persistent is False  # a CTA per row block
    persistent = dataclasses.replace(base, persistent=True)
    kernels = _a_new_kernel_of_its_own(base, persistent, "persistent", "_persistent")
    assert "constexpr bool PERSISTENT = true;" in kernels and "__shared__ Work item_work[ITEM_SLOTS];" in kernels
    assert "std::min<int64_t>(ctas, resident)" in kernels  # the grid: what fits on the GPU at once
    # O leaves by TMA stores whose stage is released under the next item's first S = Q K^T
    assert "tma_store_5d(&map_o" in kernels and "if (tile == w.tile_begin) release_staging();" in kernels
    plain = render.render(base, "ns")["kernels.cu"]
    assert "constexpr bool PERSISTENT = false;" in plain and "Work item_work" not in plain
    assert "map_o" not in plain and "release_staging" not in plain
    assert "const int grid = static_cast<int>(ctas);" in plain


@pytest.mark.parametrize("fields", [
    dict(head_dim=128, wgmma=True),                            # Q and K / V by cp.async only
    dict(head_dim=128, wgmma=True, tma=True, pingpong=True),   # the deferred GEMM orders
    dict(head_dim=128, wgmma=True, tma=True, overlap=True),
    dict(head_dim=128, wgmma=True, tma=True, block_n=48),      # O's 128 rows fit neither a K nor a V stage
    dict(head_dim=128),                                        # mma.sync
    dict(head_dim=128, decode=True, tma=True),                 # the decode tile
])
def test_persistent_takes_the_tma_producer_kernels_only(fields):
    with pytest.raises(ValueError, match="persistent=True"):
        VarlenSpec(dtype="bfloat16", **fields, persistent=True)


def hopper_prefill(head_dim: int, paged: bool = False, **chosen) -> VarlenSpec:
    """The spec a prefill call on sm_90 runs (VarlenSpec.for_call)."""
    return VarlenSpec.for_call(head_dim, "bfloat16", paged, False, False, False, True, True, **chosen)


def test_calls_take_split_kv_at_d256_by_tma_with_its_two_stage_tile():
    assert hopper_prefill(256).split_kv and hopper_prefill(256, paged=True).split_kv
    assert not any(hopper_prefill(d).split_kv for d in (64, 128, 192))
    assert not hopper_prefill(256, wgmma=False).split_kv and not hopper_prefill(256, tma=False).split_kv
    split = VarlenSpec(256, "bfloat16", wgmma=True, tma=True, split_kv=True)
    plain = VarlenSpec(256, "bfloat16", wgmma=True, tma=True)
    assert (split.block_n, split.stages) == (80, 2) and (plain.block_n, plain.stages) == (48, 3)
    # prewarm lists what a call runs: split_kv where for_call takes it, unless the manifest names it
    variants = VarlenSpec.prewarm_variants({"head_dim": 256, "paged": False, "decode": False}, ("9.0",))
    assert [v.get("split_kv", False) for v in variants] == [True]
    named = VarlenSpec.prewarm_variants({"head_dim": 256, "paged": False, "decode": False, "split_kv": False}, ("9.0",))
    assert [v["split_kv"] for v in named] == [False]


@pytest.mark.parametrize("fields", [dict(head_dim=64, wgmma=True), dict(head_dim=128), dict(head_dim=128, decode=True)])
def test_split_kv_needs_the_producer_warpgroup(fields):
    with pytest.raises(ValueError, match="producer warpgroup"):
        VarlenSpec(**fields, split_kv=True)


def test_split_kv_does_not_combine_with_the_deferred_gemm_schedules():
    for schedule in (dict(pingpong=True), dict(overlap=True)):
        with pytest.raises(ValueError, match="does not combine"):
            VarlenSpec(head_dim=128, wgmma=True, split_kv=True, **schedule)


@pytest.mark.parametrize("head_dim, paged", [(128, True), (256, False), (64, False)])
def test_tma_is_a_spec_field_that_round_trips(head_dim, paged):
    base = VarlenSpec(head_dim=head_dim, dtype="bfloat16", paged=paged, wgmma=True)
    assert base.tma is False  # the old kernel
    tma = dataclasses.replace(base, tma=True)
    if head_dim == 64:  # TMA brings the producer warpgroup, and its own default tile
        fresh = VarlenSpec(head_dim=64, dtype="bfloat16", wgmma=True, tma=True)
        assert not base.has_producer and tma.has_producer and (fresh.block_n, fresh.stages) == (128, 4)
        assert "constexpr bool PRODUCER = true;" in render.render(tma, "ns")["kernels.cu"]
        assert "constexpr bool PRODUCER = false;" in render.render(base, "ns")["kernels.cu"]
    kernels = _a_new_kernel_of_its_own(base, tma, "tma", "_tma")
    assert "constexpr bool TMA = true;" in kernels and "cp.async.bulk.tensor.5d" in kernels
    assert "CUtensorMap" not in render.render(base, "ns")["kernels.cu"]
    # Calls take it where it measured better: paged producer shapes, packed keys at D64 / D128 and D256
    # (with split_kv), and the paged D128 decode tile on sm_90 if DECODE_TMA (off, no gain measured).
    assert hopper_prefill(head_dim, paged).tma is (paged or head_dim in (64, 128, 256))
    assert not hopper_prefill(192).tma  # not measured there
    assert hopper_prefill(64, paged=True).tma  # paged D64: the packed kernel's tile (same bits)
    decode = lambda d, paged, hopper: VarlenSpec.for_call(d, "bfloat16", paged, False, True, False, hopper, True)
    assert decode(head_dim, True, True).tma is (head_dim == 128 and varlen_spec.DECODE_TMA)
    assert not decode(128, True, False).tma and not decode(128, False, True).tma


def test_decode_tile_tma_renders_the_lockstep_copies_for_sm90a_only():
    base = VarlenSpec(128, "bfloat16", True, True)
    tma = dataclasses.replace(base, tma=True)
    assert tma.name == base.name + "_tma" and spec_from_dict(tma.to_dict()) == tma
    kernels = render.render(tma, "ns")["kernels.cu"]
    assert not JINJA_LEFTOVER.search(kernels)
    assert "constexpr bool LOCKSTEP_TMA = TMA && !PRODUCER;" in kernels and "cp.async.bulk.tensor.5d" in kernels
    assert "wgmma.mma_async.sync" not in kernels  # only the mbarriers of wgmma.cuh
    assert "CUtensorMap" not in render.render(base, "ns")["kernels.cu"]
    assert tma.archs_for(("8.0", "9.0")) == ("9.0a",) and base.archs_for(("8.0", "9.0")) == ("8.0", "9.0")
    with pytest.raises(ValueError, match="or TMA"):
        tma.archs_for(("8.0",))
    for block_n in (48, 128):  # thread 0 would not hold every 8th row's page id
        with pytest.raises(ValueError, match="must divide 8"):
            VarlenSpec(128, "bfloat16", True, True, 1, 1, block_n, 3, tma=True)
    assert VarlenSpec(128, "bfloat16", True, True, 1, 1, 64, 3, tma=True).tma


@pytest.mark.parametrize("fields", [dict(head_dim=64), dict(head_dim=128)])
def test_tma_needs_the_producer_warpgroup(fields):
    with pytest.raises(ValueError, match="producer warpgroup"):  # the mma.sync rung has none
        VarlenSpec(**fields, tma=True)


@pytest.mark.parametrize("fields", [dict(head_dim=64, wgmma=True), dict(head_dim=128)])
def test_wgmma_schedules_need_the_producer_warpgroup(fields):
    assert VarlenSpec(**fields, pingpong=False).pingpong is False
    with pytest.raises(ValueError, match="producer warpgroup"):
        VarlenSpec(**fields, pingpong=True)


@pytest.mark.parametrize("head_dim, decode", [(96, False), (128, True)])
def test_wgmma_varlen_spec_rejects_shapes_it_does_not_cover(head_dim, decode):
    with pytest.raises(ValueError, match="wgmma varlen kernels are prefill-only"):
        VarlenSpec(head_dim=head_dim, decode=decode, wgmma=True)


@pytest.mark.parametrize("group, pos, kv, head_dim, use_tc, want_tc", [
    (1, "NONE", "float16", 128, False, False),
    (3, "NONE", "float16", 128, False, False),
    (4, "NONE", "float16", 128, False, True),   # large groups: tensor cores by default
    (8, "ALIBI", "bfloat16", 64, False, True),
    (1, "ROPE_LLAMA", "float16", 128, False, True),  # RoPE: tensor cores at any group size
    (4, "ROPE_LLAMA", "bfloat16", 64, False, True),
    (1, "ROPE_LLAMA", "float8_e5m2", 128, False, False),  # ...but not for fp8 MHA
    (4, "ROPE_LLAMA", "float8_e5m2", 128, False, True),  # fp8 GQA: tensor cores, like fp16
    (2, "ROPE_LLAMA", "float16", 48, True, False),
    (1, "NONE", "float16", 128, True, True),
    (1, "NONE", "float8_e4m3fn", 128, True, True),  # fp8 K/V: tensor cores when asked for
    (1, "NONE", "float8_e4m3fn", 128, False, False),
    (8, "NONE", "float8_e4m3fn", 64, False, True),
    (8, "NONE", "float16", 48, False, False),  # head_dim not a multiple of 32
])
def test_for_call_picks_tensor_cores_by_the_documented_rule(group, pos, kv, head_dim, use_tc, want_tc):
    spec = DecodeSpec.for_call(head_dim, "float16" if kv.startswith("float8") else kv, kv, pos, False, group, use_tc)
    assert spec.tensor_cores is want_tc
    want_tile = DecodeSpec.tensor_core_group_tile(group) if want_tc else DecodeSpec.group_tile_for(group, kv)
    assert spec.group_tile == want_tile
