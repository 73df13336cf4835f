"""Property: arbitrary JSON thrown at `spec_from_dict` and at `jitattn prewarm --dry-run --spec`
yields a valid spec (a safe name, params that render as plain ints, bools and known strings) or
a clear ValueError / TypeError (exit 2 with `jitattn: error:`), never another exception
(issue 45 item 1). Bounded examples, in-process CLI: a few seconds."""
from __future__ import annotations

import contextlib
import io
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jitattn import cli
from jitattn.jit import registry
from jitattn.jit.spec import SAFE_NAME, KernelSpec

FAMILIES = sorted(registry.families())
FIELDS = sorted({name for cls in registry.families().values() for name in cls.accepted_fields()})

scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.sampled_from([0, 1, 16, 32, 64, 128, 256])
           | st.floats(allow_nan=True) | st.text(max_size=20)
           | st.sampled_from(["NONE", "ROPE_LLAMA", "ALIBI", "float16", "bfloat16", "float8_e4m3fn", "false", "../x"]))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                                    max_size=3),
                           max_leaves=8)
# Values a spec field takes, and values close to them: most spec-shaped inputs then build a spec.
plausible = (st.booleans() | st.sampled_from([0, 1, 2, 4, 8, 16, 32, 48, 64, 128, 256])
             | st.sampled_from(["NONE", "ROPE_LLAMA", "ALIBI", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]))
field_values = st.one_of(plausible, plausible, plausible, json_values)
# Spec-shaped: a family (or junk), a head_dim, then known field names (or junk) with any values.
spec_like = st.fixed_dictionaries(
    {"family": st.sampled_from(FAMILIES) | json_values},
    optional={"head_dim": st.sampled_from([64, 128, 256, 100, 0, -64]) | json_values},
).flatmap(lambda base: st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), field_values, max_size=3)
          .map(lambda extra: {**extra, **base}))
valid_shaped = st.builds(lambda family, head_dim, extra: {**extra, "family": family, "head_dim": head_dim},
                         st.sampled_from(FAMILIES), st.sampled_from([64, 128, 256]),
                         st.dictionaries(st.sampled_from(FIELDS), plausible, max_size=2))
anything = valid_shaped | spec_like | json_values

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def assert_valid(spec: KernelSpec) -> None:
    assert SAFE_NAME.fullmatch(spec.name), spec.name
    known = {value for values in type(spec).choices.values() for value in values}
    params = spec.params()
    for name, value in params.items():
        assert type(value) in (int, bool, str), (name, value)
        if type(value) is str and name in type(spec).parsers:
            assert value == "" or type(spec).parsers[name](value) is not None, (name, value)
        elif type(value) is str and name.endswith("_mod_source"):
            # C++ only from jitattn's renderer, of the field's validated tree
            field = params[name[: -len("_source")]]
            assert (value == "") == (field == ""), (name, value)
        elif type(value) is str:
            assert value in known, (name, value)
    assert registry.spec_from_dict(spec.to_dict()) == spec


@SETTINGS
@given(anything)
def test_spec_from_dict_yields_a_valid_spec_or_a_clear_error(data):
    try:
        spec = registry.spec_from_dict(data)
    except (ValueError, TypeError) as exc:
        assert str(exc)
        return
    assert_valid(spec)


@SETTINGS
@given(anything)
def test_prewarm_dry_run_spec_yields_specs_or_exits_2_with_a_message(data):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["prewarm", "--dry-run", "--arch", "9.0", f"--spec={json.dumps(data)}"])
    if code == 2:
        assert err.getvalue().startswith("jitattn: error: ") and "Traceback" not in err.getvalue()
    else:
        assert code in (0, 1) and "specializations for 9.0" in out.getvalue()  # 1: a target it cannot build


@pytest.fixture(autouse=True)
def restore_arch(monkeypatch):
    """--arch sets JITATTN_CUDA_ARCH_LIST in this process: undone after each test."""
    monkeypatch.setenv("JITATTN_CUDA_ARCH_LIST", "9.0")


def test_every_spec_of_the_default_manifest_is_valid_and_round_trips():
    from pathlib import Path

    from jitattn.jit.manifest import read_manifest

    specs = read_manifest(Path(__file__).resolve().parent.parent / "cache" / "default.toml")
    assert len(specs) > 10
    for spec in specs:
        assert_valid(spec)
