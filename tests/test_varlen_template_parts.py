"""CPU tests of how the varlen kernels are composed from named template parts (issue 44 item 2):
the parts forward and backward share, the two hook points, the soft cap as the score hook's
first user, and the decisions the templates read from the spec (no compiles)."""
from __future__ import annotations

import re
from pathlib import Path

import jinja2
import pytest

from jitattn.jit import render
from jitattn.varlen.spec import VarlenBackwardSpec, VarlenSpec
from tests.conftest import require_host_cxx

SHARED_PARTS = {"varlen/tile_scheduler.cuh", "varlen/pipeline.cuh", "varlen/mask.cuh", "varlen/score.cuh", "varlen/hooks.cuh",
                "varlen/packed_rows.cuh"}
MAX_TEMPLATE_LINES = 600


def _files(spec_cls) -> set[str]:
    return set(render.template_files(render.templates_dir(), tuple(sorted(spec_cls.sources.values()))))


def _render_with(spec, **extra) -> str:
    """kernels.cu of `spec`, with extra template parameters (what a user hook would pass)."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(render.templates_dir())),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True, trim_blocks=True,
                             lstrip_blocks=True)
    context = {**spec.params(), "spec_name": spec.name, "op_namespace": "ns", **extra}
    return env.get_template(spec.sources["kernels.cu"]).render(**context, unit="kernels.cu")


def test_forward_and_backward_include_the_same_scheduler_pipeline_mask_score_and_row_map_parts():
    forward, backward = _files(VarlenSpec), _files(VarlenBackwardSpec)
    assert SHARED_PARTS <= forward
    assert SHARED_PARTS <= backward


def test_no_template_file_is_over_the_line_budget():
    root = render.templates_dir()
    sizes = {str(p.relative_to(root)): len(p.read_text().splitlines())
             for p in root.rglob("*") if p.is_file() and p.suffix in {".j2", ".cuh", ".h"}}
    over = {name: n for name, n in sizes.items() if n > MAX_TEMPLATE_LINES}
    assert not over


@pytest.mark.parametrize("spec", [VarlenSpec(128, "bfloat16", wgmma=True, soft_cap=True),
                                  VarlenSpec(64, "bfloat16", soft_cap=True),
                                  VarlenBackwardSpec(128, "bfloat16", wgmma=True, producer=True, soft_cap=True),
                                  VarlenBackwardSpec(64, "bfloat16", soft_cap=True)],
                         ids=lambda s: s.name)
def test_the_soft_cap_is_the_score_hooks_first_user(spec):
    source = render.render(spec, "ns")["kernels.cu"]
    assert "using ScoreMod = SoftCapScore;" in source
    # The tanh functions are called by SoftCapScore (score.cuh) and each other (soft_cap.cuh)
    # alone: no kernel applies the cap itself.
    tanhs = ("tanh_from_exp2(", "tanh_approx(", "tanh_poly(", "tanh_split(")
    root = render.templates_dir()
    for path in root.rglob("*"):
        if path.is_file() and path.relative_to(root).as_posix() not in ("common/soft_cap.cuh", "varlen/score.cuh"):
            text = path.read_text()
            assert not [t for t in tanhs if t in text], path
    assert all(t in source for t in tanhs)


@pytest.mark.parametrize("spec", [VarlenSpec(128, "bfloat16", wgmma=True), VarlenBackwardSpec(128, "bfloat16")],
                         ids=lambda s: s.name)
def test_without_cap_or_user_function_the_hooks_are_the_inactive_defaults(spec):
    source = render.render(spec, "ns")["kernels.cu"]
    assert "using ScoreMod = IdentityScore;" in source
    assert "using MaskMod = NoMaskMod;" in source


@pytest.mark.parametrize("spec", [VarlenSpec(128, "bfloat16", wgmma=True, soft_cap=True),
                                  VarlenBackwardSpec(256, "bfloat16", wgmma=True, producer=True, dq_kernel=True)],
                         ids=lambda s: s.name)
def test_a_user_score_and_mask_source_replace_the_defaults(spec):
    user_score = "struct UserScore : IdentityScore {}; using ScoreMod = UserScore;  // user-score-marker"
    user_mask = "struct UserMask : NoMaskMod {}; using MaskMod = UserMask;  // user-mask-marker"
    source = _render_with(spec, score_mod_source=user_score, mask_mod_source=user_mask)
    assert user_score in source and user_mask in source
    assert "using ScoreMod = SoftCapScore;" not in source and "using MaskMod = NoMaskMod;" not in source
    # The hooks are declared before any kernel uses them.
    assert source.index("user-score-marker") < source.index("__global__")


@pytest.mark.parametrize("has_producer", [False, True])
def test_the_forward_template_takes_the_producer_decision_from_the_spec(has_producer):
    spec = VarlenSpec(128, "bfloat16", wgmma=True)
    source = _render_with(spec, has_producer=has_producer)
    assert f"constexpr bool PRODUCER = {'true' if has_producer else 'false'};" in source
    assert spec.params()["has_producer"] == spec.has_producer


def test_the_forward_template_re_derives_no_spec_decision():
    text = (render.templates_dir() / "varlen" / "kernels.cu.j2").read_text()
    assert not re.search(r"{%\s*set\s+(producer|tma|has_producer|uses_tma)\b", text)


@pytest.mark.parametrize("tanh", ["exact", "approx", "poly"])
@pytest.mark.parametrize("scale,cap", [(0.125, 30.0), (0.0884, 50.0), (1.0, 2.0)])
def test_the_score_hooks_honour_their_contract_for_the_kernels(tmp_path, scale, cap, tanh, rng):
    """score.cuh's contract, on the real source compiled for the host: the logit is
    L = scale_log2 / log2(e) * score(s) (soft cap: cap * tanh(scale * s / cap); none: scale * s),
    and dscore is dL/ds / scale (what the backward multiplies dS by). Every tanh convention (the
    host build's tanh.approx is std::tanh: this checks the bindings' factor, not the device's
    accuracy; poly_tanh's cubic is the device's own code, within its fitted 8.2e-5 of tanh). With
    poly_tanh, a tile through score_all gives each logit score()'s value exactly, whichever of the
    tile's logits lie beyond the cubic's reach (the first 96 logits lie within it)."""
    import math
    import subprocess

    exact, poly = tanh == "exact", tanh == "poly"
    cxx = require_host_cxx("the score-hook host build")
    root = render.templates_dir()
    binary = tmp_path / "score_hook"
    harness = Path(__file__).resolve().parent / "native" / "score_hook.cpp"
    subprocess.run([cxx, "-O1", "-std=c++17", f"-I{root}", f"-DJITATTN_EXACT_SOFT_CAP={int(exact)}",
                    f"-DJITATTN_POLY_TANH={int(poly)}", str(harness), "-o", str(binary)], check=True)
    within = [rng.uniform(-cap / scale, cap / scale) for _ in range(96)]
    logits = within + [rng.uniform(-4 * cap / scale, 4 * cap / scale) for _ in range(200)] + [0.0]
    out = subprocess.run([str(binary), str(scale), str(cap)], input=" ".join(map(repr, logits)),
                         capture_output=True, text=True, check=True).stdout.split("\n")
    rows = [list(map(float, line.split())) for line in out if line]
    assert len(rows) == len(logits)
    for s, capped, dcapped, plain, dplain, tiled in rows:
        # soft cap: scale_log2 = cap * log2(e), so L = cap * score
        want = math.tanh(scale * s / cap)
        assert cap * capped == pytest.approx(cap * want, abs=(9e-5 * abs(want) + 1e-6 if poly else 1e-5) * cap)
        assert tiled == capped
        slope = (math.tanh(scale * (s + 1e-3) / cap) - math.tanh(scale * (s - 1e-3) / cap)) * cap / 2e-3
        assert dcapped == pytest.approx(slope / scale, abs=1e-4)
        # no hook: scale_log2 = scale * log2(e), so L = scale * score
        assert plain == s and dplain == 1.0
