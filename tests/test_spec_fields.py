"""A spec field is data, never code (issue 45 item 1): every family checks every field's type,
range or enum and the kernels' shape rules on construction, whatever the source (constructor,
`spec_from_dict`, manifests, `--spec`, flags), and refuses an arch it cannot build for before any
compiler runs. The issue's reproductions are the cases here; nothing in this file compiles.
"""
from __future__ import annotations

import dataclasses

import pytest

from jitattn import cli
from jitattn.decode.spec import DecodeSpec
from jitattn.jit import cache, keys, manifest, registry
from jitattn.jit.spec import SAFE_NAME
from jitattn.varlen.spec import VarlenBackwardSpec, VarlenSpec

FAMILIES = ["decode", "varlen", "varlen_backward"]


def run_cli(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(autouse=True)
def no_arch_list(monkeypatch):
    for name in ("JITATTN_CUDA_ARCH_LIST", "TORCH_CUDA_ARCH_LIST"):
        monkeypatch.delenv(name, raising=False)


# ------------------------------------------------------------------ the declarations


@pytest.mark.parametrize("name", FAMILIES)
def test_every_int_and_str_field_of_every_family_declares_what_it_accepts(name):
    cls = registry.family(name)
    for f in dataclasses.fields(cls):
        if f.type == "int":
            low, high = cls.ranges[f.name]
            assert low <= high
        elif f.type == "str" and f.name in cls.parsers:  # structured data (a variant's tree): its parser checks it
            assert callable(cls.parsers[f.name]) and f.name not in cls.choices
        elif f.type == "str":
            assert cls.choices[f.name] and all(SAFE_NAME.fullmatch(v.lower()) for v in cls.choices[f.name])
        else:
            assert f.type == "bool", f"{name}.{f.name} is {f.type}: spec fields are int, bool or str"


# ------------------------------------------------------------------ the reproductions


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("head_dim", ["64; system(\"id\");", "64", 64.0, [64], None])
def test_a_head_dim_that_is_not_an_int_is_a_type_error_naming_the_field(family, head_dim):
    with pytest.raises(TypeError, match=rf"{family} spec field head_dim must be an integer"):
        registry.spec_from_dict({"family": family, "head_dim": head_dim})


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("value", ["false", "true", 1, 0, None, "1"])
def test_a_bool_field_takes_only_a_bool(family, value):
    with pytest.raises(TypeError, match=r"soft_cap must be true or false \(a bool\)"):
        registry.spec_from_dict({"family": family, "head_dim": 128, "soft_cap": value})


def test_tensor_cores_false_as_a_string_is_refused_not_read_as_true():
    with pytest.raises(TypeError, match="tensor_cores must be true or false"):
        registry.spec_from_dict({"family": "decode", "head_dim": 64, "tensor_cores": "false"})


@pytest.mark.parametrize("fields, named", [
    ({"pos_encoding": "ROPE"}, "pos_encoding must be NONE, ROPE_LLAMA or ALIBI"),
    ({"pos_encoding": "/../../../outside/x"}, "pos_encoding must be NONE, ROPE_LLAMA or ALIBI"),
    ({"pos_encoding": "rope_llama"}, "pos_encoding must be NONE, ROPE_LLAMA or ALIBI"),
    ({"dtype_q": "float64"}, "dtype_q must be float16 or bfloat16"),
    ({"dtype_kv": "int8"}, "dtype_kv must be float16, bfloat16, float8_e4m3fn or float8_e5m2"),
    ({"group_tile": 0}, r"group_tile must be in \[1, 16\]"),
    ({"group_tile": 12}, r"group_tile must be in \[1, 8\] without tensor cores"),
    ({"group_size": 0}, r"group_size must be in \[1, 1024\]"),
    ({"group_size": "4"}, "group_size must be an integer"),
    ({"group_size": 4, "group_tile": 4}, "group_size .* or group_tile .*, not both"),
    ({"head_dim": 80, "dtype_kv": "float8_e4m3fn"}, "multiple of 32 with fp8"),
    ({"head_dim": 80, "tensor_cores": True}, "tensor_cores=true needs head_dim a multiple of 32"),
], ids=lambda v: str(v)[:40])
def test_decode_fields_out_of_their_enum_or_range_are_refused_naming_field_and_values(fields, named):
    with pytest.raises((TypeError, ValueError), match=named):
        registry.spec_from_dict({"family": "decode", "head_dim": 128, **fields})


@pytest.mark.parametrize("family, fields, named", [
    ("varlen", {"m_tiles": "2"}, "m_tiles must be an integer"),
    ("varlen", {"stages": "3"}, "stages must be an integer"),
    ("varlen", {"stages": 1}, "stages >= 2"),
    ("varlen", {"wgmma": True, "head_dim": 64, "stages": 2}, "stages >= 3"),  # the lockstep wgmma loop
    ("varlen", {"block_n": 40}, "block_n a multiple of 16"),
    ("varlen", {"block_n": 4096}, r"block_n must be in \[0, 256\]"),
    ("varlen", {"dtype": "float8_e4m3fn"}, "dtype must be float16 or bfloat16"),
    ("varlen", {"min_blocks": 5}, r"min_blocks must be in \[0, 4\]"),
    ("varlen", {"wgmma": True, "min_blocks": 2}, "only kernels without the producer"),  # setmaxnreg's pool
    ("varlen_backward", {"warps_q": True}, "warps_q must be an integer"),
    ("varlen_backward", {"consumer_regs": -1}, r"consumer_regs must be in \[0, 255\]"),
])
def test_varlen_fields_are_typed_and_ranged(family, fields, named):
    with pytest.raises((TypeError, ValueError), match=named):
        registry.spec_from_dict({"family": family, "head_dim": 128, **fields})


def test_min_blocks_reaches_the_launch_bounds_and_the_key():
    from jitattn.jit import render

    rule, asked = (registry.spec_from_dict({"family": "varlen", "head_dim": 32, "min_blocks": m}) for m in (0, 3))
    assert rule.name != asked.name and asked.name.endswith("_b3")
    for spec, count in ((rule, 0), (asked, 3)):
        source = render.render(spec, "ns")["kernels.cu"]
        assert f"constexpr int MIN_BLOCKS = {count} > 0 ? {count} :" in source
        assert "__launch_bounds__(THREADS, MIN_BLOCKS)" in source



def test_only_a_short_calls_d32_tile_asks_for_more_ctas_per_sm():
    """The short-call rule (an encoder's sentences): head_dim 32, not paged, prefill -> min_blocks
    SHORT_D32_MIN_BLOCKS; every other call keeps the shape's rule (0), and a named field wins."""
    from jitattn.varlen.spec import SHORT_D32_MIN_BLOCKS

    def spec(head_dim=32, paged=False, few_rows=False, short=True, **chosen):
        return VarlenSpec.for_call(head_dim, "bfloat16", paged, False, few_rows, False, True, True, short, **chosen)

    assert SHORT_D32_MIN_BLOCKS > 0 and spec().min_blocks == SHORT_D32_MIN_BLOCKS
    assert spec().name.endswith(f"_b{SHORT_D32_MIN_BLOCKS}")
    assert [spec(short=False).min_blocks, spec(paged=True).min_blocks, spec(few_rows=True).min_blocks,
            spec(head_dim=64).min_blocks, spec(head_dim=48).min_blocks] == [0] * 5
    assert spec(min_blocks=0).min_blocks == 0

@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("head_dim", [100, 24, 0, -64, 16, 272, 2**70])
def test_dry_run_rejects_head_dims_no_kernel_builds_with_the_family_rule(family, head_dim, capsys):
    code, out, err = run_cli(capsys, "prewarm", "--family", family, "--head-dim", head_dim, "--dry-run")
    assert code == 2 and out == ""
    assert err.startswith("jitattn: error: ") and "head_dim must be a multiple of 16 in [32, 256]" in err
    assert f"got {head_dim}" in err and "Traceback" not in err


@pytest.mark.parametrize("family", FAMILIES)
def test_every_supported_head_dim_is_accepted(family):
    for head_dim in range(32, 257, 16):
        spec = registry.spec_from_dict({"family": family, "head_dim": head_dim})
        assert spec.head_dim == head_dim and SAFE_NAME.fullmatch(spec.name)


@pytest.mark.parametrize("argv, named", [
    (["--group-size", "0"], "group_size must be in [1, 1024], got 0"),
    (["--group-size", "-2"], "group_size must be in [1, 1024], got -2"),
    (["-j", "-3"], "-j/--jobs takes a positive number of parallel builds, got -3"),
    (["-j", "0"], "-j/--jobs takes a positive number"),
])
def test_bad_numbers_on_the_command_line_are_clear_errors(argv, named, capsys):
    code, _, err = run_cli(capsys, "prewarm", "--head-dim", "64", *argv)
    assert code == 2 and named in err and "Traceback" not in err


@pytest.mark.parametrize("raw, named", [
    ('"x"', "a spec entry is a table of fields, got 'x'"),
    ("[1, 2]", "a spec entry is a table of fields"),
    ('{"family": "decode", "head_dim": 64, "dtype_q": "float64"}', "dtype_q must be float16 or bfloat16"),
    ('{"head_dim": 64}', "unknown kernel family None"),
    ('{"family": 3, "head_dim": 64}', "unknown kernel family 3"),
    ('{"family": "decode", "head_dim": []}', "list no values"),
    ('{"family": "decode"}', "needs the fields ['head_dim']"),
    ("[" * 100_000, "nested too deeply"),
    ('{"family": "decode", "head_dim": 64, "pos_encoding": "/../../x"}', "pos_encoding must be"),
])
def test_spec_json_that_is_not_a_spec_exits_2_with_a_message(raw, named, capsys):
    code, out, err = run_cli(capsys, "prewarm", "--spec", raw, "--dry-run")
    assert code == 2 and named in err, err
    assert "Traceback" not in err


def test_a_manifest_with_code_in_a_field_builds_nothing_and_names_the_field(tmp_path, capsys):
    path = tmp_path / "evil.toml"
    path.write_text('[[spec]]\nfamily = "decode"\nhead_dim = "64; }; int x = system(\\"touch pwned\\"); //"\n')
    code, out, err = run_cli(capsys, "prewarm", path, "--dry-run")
    assert code == 2 and "spec #1" in err and "head_dim must be an integer" in err
    assert not (tmp_path / "pwned").exists()


def test_manifest_list_expansion_is_bounded(tmp_path):
    path = tmp_path / "big.toml"
    values = ", ".join(str(64) for _ in range(20))
    path.write_text(f'[[spec]]\nfamily = "varlen"\nhead_dim = [{values}]\nblock_n = [{values}]\nstages = [{values}]\n')
    with pytest.raises(ValueError, match="expand to more than"):
        manifest.read_manifest(path)


# ------------------------------------------------------------------ archs


@pytest.mark.parametrize("spec", [DecodeSpec(128), VarlenSpec(128), VarlenBackwardSpec(128)], ids=lambda s: s.family)
@pytest.mark.parametrize("arch", ["7.0", "7.5", "6.1"])
def test_an_arch_the_family_cannot_build_for_is_refused_with_its_reason(spec, arch):
    with pytest.raises(ValueError, match=rf"{spec.family} cannot build for arch {arch}: .*sm_80"):
        spec.archs_for((arch, "9.0"))
    assert spec.archs_for(("8.0", "9.0a")) == ("8.0", "9.0")


@pytest.mark.parametrize("arch", ["9", "9.0b", "../9.0", "", "9.0;rm"])
def test_a_malformed_arch_string_is_refused(arch):
    with pytest.raises(ValueError, match="bad CUDA arch"):
        DecodeSpec(128).archs_for((arch,))


def test_prewarm_for_an_old_arch_fails_before_any_compiler_runs(capsys, monkeypatch, tmp_path):
    from jitattn.jit import build

    monkeypatch.setenv("JITATTN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "compile_library", lambda *a, **k: pytest.fail("nvcc must not run"))
    code, out, err = run_cli(capsys, "prewarm", "--head-dim", "64", "--arch", "7.0")
    assert code == 1, err
    assert "decode cannot build for arch 7.0" in out and "sm_80" in out and "nvcc" not in out
    code, out, _ = run_cli(capsys, "prewarm", "--head-dim", "64", "--arch", "7.0", "--dry-run")
    assert code == 1 and "cannot build: decode cannot build for arch 7.0" in out


# ------------------------------------------------------------------ names and paths


class _Subclassed(int):
    def __str__(self):
        return "64; evil()"

    __repr__ = __format__ = lambda self, *a: "64; evil()"


def test_an_int_subclass_is_stored_as_a_plain_int():
    spec = DecodeSpec(_Subclassed(64))
    assert type(spec.head_dim) is int and spec.name == "decode_f16_kvf16_d64_posnone_cap0_g1"


@pytest.mark.parametrize("name", ["../x", "a/b", "UPPER", "x y", "", "decode_f16;"])
def test_entry_paths_refuse_names_that_are_not_plain(tmp_path, name):
    with pytest.raises(ValueError, match="not a safe cache path component"):
        cache.entry_path(tmp_path, keys.CACHE_SCHEMA, "sm90", name, "ab" * 32)


def test_cache_writes_stay_under_the_root(tmp_path):
    with pytest.raises(ValueError, match="not under the cache root"):
        cache.check_within(tmp_path / "root", tmp_path / "root" / ".." / "outside")
    with pytest.raises(ValueError, match="not under the cache root"):
        cache.write_text_atomic(tmp_path / "elsewhere.json", tmp_path / "root", "{}")
    assert not (tmp_path / "elsewhere.json").exists()
    inside = tmp_path / "root" / "v1" / "x"
    assert cache.check_within(tmp_path / "root", inside) == inside


def test_fresh_random_specs_round_trip_through_their_dict(rng):
    for _ in range(50):
        fields = {"family": "decode", "head_dim": rng.choice(range(32, 257, 32)),
                  "dtype_q": rng.choice(["float16", "bfloat16"]), "pos_encoding": rng.choice(["NONE", "ROPE_LLAMA", "ALIBI"]),
                  "soft_cap": rng.random() < 0.5, "group_size": rng.randint(1, 64)}
        spec = registry.spec_from_dict(fields)
        assert registry.spec_from_dict(spec.to_dict()) == spec
