"""The tools that run torch's own attention tests against jitattn (docs/torch-tests.md): the pytest
plugin's modes and per-test call counts (tools/jitattn_torch_tests_plugin.py) and the report's
grouping and known causes (tools/torch_tests_report.py), on synthetic junit XML and tiny test files."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from xml.sax.saxutils import escape

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

import jitattn_torch_tests_plugin as plugin  # noqa: E402
import torch_tests_report as report  # noqa: E402


# ----------------------------------------------------------------------------- synthetic junit
def case(name, outcome="passed", message="", calls=None, classname="test_varlen_attention.TestVarlenAttentionCUDA"):
    message = escape(message, {'"': "&quot;"})
    body = ""
    if outcome == "failed":
        body = f'<failure message="{message}">E   {message}</failure>'
    elif outcome == "error":
        body = f'<error message="failed on setup with &quot;{message}&quot;">E   {message}</error>'
    elif outcome == "skipped":
        body = f'<skipped type="pytest.skip" message="{message}">{message}</skipped>'
    props = ""
    if calls is not None:
        props = "<properties>" + "".join(f'<property name="jitattn_{k}" value="{v}" />'
                                         for k, v in zip(("forward", "backward", "fallback"), calls)) + "</properties>"
    return f'<testcase classname="{classname}" name="{name}" time="0.1">{props}{body}</testcase>'


def junit(*cases):
    return ('<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">' + "".join(cases) +
            "</testsuite></testsuites>")


COLLECTION_ERROR = ('<testcase classname="" name="test_varlen_attention" time="0.0"><error message="collection failure">'
                    "ImportError while importing test module\nE   ImportError: cannot import name 'varlen_attn_out' from "
                    "'torch.nn.attention.varlen' (/x/varlen.py)</error></testcase>")
POSITIONAL = "TypeError: varlen_attn() takes 7 positional arguments but 8 were given"


def test_parse_junit_reads_outcomes_messages_and_call_counts(rng):
    forward, backward = rng.randint(1, 50), rng.randint(0, 50)
    run = report.parse_junit(junit(case("test_a_cuda", calls=(forward, backward, 0)),
                                   case("test_b_cuda", "failed", POSITIONAL, calls=(0, 0, 0)),
                                   case("test_c_cuda", "skipped", "FA3 backend not available"),
                                   case("test_d_cuda", "error", "RuntimeError: boom")))
    assert run.collection_error is None
    assert run.results["test_a_cuda"] == report.Result("passed", "", (forward, backward, 0))
    assert run.results["test_a_cuda"].reached_jitattn is True
    assert run.results["test_b_cuda"].outcome == "failed" and "7 positional" in run.results["test_b_cuda"].message
    assert run.results["test_b_cuda"].reached_jitattn is False
    assert run.results["test_c_cuda"].outcome == "skipped" and run.results["test_c_cuda"].calls is None
    assert run.results["test_d_cuda"].outcome == "error" and "boom" in run.results["test_d_cuda"].message


def test_a_collection_error_marks_every_test_of_that_mode_with_its_exception():
    runs = {"off": report.parse_junit(junit(COLLECTION_ERROR)),
            "dropin": report.parse_junit(junit(case("test_basic_functionality_bfloat16_cuda", calls=(3, 1, 0))))}
    assert "cannot import name 'varlen_attn_out'" in runs["off"].collection_error
    [row] = report.table_rows(runs, ["test_basic_functionality"])
    assert row.labels == ("not collected", "—", "pass (jitattn ran)")
    assert "varlen lacks `varlen_attn_out`: the file does not import" in row.reason
    assert "did not import" in report.summary_line(runs)


def test_parametrizations_group_under_their_test_where_outcomes_agree(tmp_path, rng):
    test_file = tmp_path / "test_varlen_attention.py"
    test_file.write_text("class T:\n    def test_varlen_vs_sdpa(self):\n        pass\n\n"
                         "    def test_varlen_vs_sdpa_extra(self):\n        pass\n")
    known = report.method_names_in(test_file)
    assert known == ["test_varlen_vs_sdpa_extra", "test_varlen_vs_sdpa"]
    n_pass, n_fail = rng.randint(2, 9), rng.randint(1, 5)
    passing = [f"test_varlen_vs_sdpa_bfloat16_scale0_window_size{i}_cuda" for i in range(n_pass)]
    failing = [f"test_varlen_vs_sdpa_float16_scale0_window_size{i}_cuda" for i in range(n_fail)]
    runs = {"off": report.parse_junit(junit(*[case(n, "failed", POSITIONAL) for n in passing + failing])),
            "provider": report.parse_junit(junit(*[case(n, "failed", POSITIONAL, calls=(0, 0, 0))
                                                   for n in passing + failing])),
            "dropin": report.parse_junit(junit(*[case(n, calls=(2, 1, 0)) for n in passing],
                                               *[case(n, "failed", "AssertionError: 0.5 not <= 0.1", calls=(2, 1, 0))
                                                 for n in failing],
                                               case("test_varlen_vs_sdpa_extra_cuda", calls=(0, 0, 0))))}
    rows = report.table_rows(runs, known)
    by_labels = {(r.family, r.labels): r for r in rows}
    ok = by_labels[("test_varlen_vs_sdpa", ("FAIL", "FAIL", "pass (jitattn ran)"))]
    bad = by_labels[("test_varlen_vs_sdpa", ("FAIL", "FAIL", "FAIL"))]
    assert sorted(ok.names) == sorted(passing) and sorted(bad.names) == sorted(failing)
    assert ok.calls["dropin"] == [2 * n_pass, n_pass, 0] and ok.calls["provider"] == [0, 0, 0]
    assert "is_causal positionally" in ok.reason
    extra = by_labels[("test_varlen_vs_sdpa_extra", ("—", "—", "pass (no jitattn call)"))]
    assert extra.names == ["test_varlen_vs_sdpa_extra_cuda"]
    text = report.markdown("test_varlen_attention", runs, known)
    assert f"| `test_varlen_vs_sdpa` | {n_pass}: `bfloat16_scale0_window_size0_cuda`" in text
    assert text.count("\n| `") == len(rows)


def test_known_causes_apply_by_mode_outcome_message_and_test_name():
    def reason(name, **results):
        return report.reasons_for(name, {mode: report.Result(*r) for mode, r in results.items()})

    assert "not applicable" in reason("test_x_fa3_cuda", provider=("skipped", "FA3 backend not available"))
    assert "cuDNN" in reason("test_cudnn_attention_varlen_cuda", dropin=("skipped", "cuDNN varlen attention is not "
                                                                         "supported on this device"))
    assert "lacks `enable_gqa`" in reason("test_v_cuda", off=("failed", "TypeError: varlen_attn() got an unexpected "
                                                                        "keyword argument 'enable_gqa'"))
    assert "intended" in reason("test_varlen_lse_is_not_differentiable_cuda", dropin=("failed", "AssertionError"))
    # the same failure of a test that is not known gets no made-up reason
    assert reason("test_something_else_cuda", dropin=("failed", "AssertionError")) == ""
    # a cause bound to dropin does not explain the same failure in provider mode
    assert reason("test_custom_op_registration_cuda", provider=("failed", "AssertionError")) == ""
    assert reason("test_x_cuda", off=("passed", "")) == ""


def test_report_reads_a_folder_of_junit_files_and_the_cli_writes_markdown(tmp_path):
    (tmp_path / "test_varlen_attention.off.xml").write_text(junit(case("test_a_cuda", "failed", POSITIONAL)))
    (tmp_path / "test_varlen_attention.provider.xml").write_text(junit(case("test_a_cuda", calls=(1, 1, 0))))
    (tmp_path / "test_transformers.provider.xml").write_text(junit(case("test_flash_cuda", calls=(0, 0, 4))))
    (tmp_path / "unrelated.xml").write_text("not xml")
    assert set(report.load_dir(tmp_path)) == {"test_varlen_attention", "test_transformers"}
    out = tmp_path / "report.md"
    assert report.main([str(tmp_path), "-o", str(out)]) == 0
    text = out.read_text()
    assert "### test_transformers.py" in text and "### test_varlen_attention.py" in text
    assert "| `test_a_cuda` | 1 | FAIL | pass (jitattn ran) | — | P: 1 fwd / 1 bwd / 0 fallback |" in text
    assert "| `test_flash_cuda` | 1 | — | pass (no jitattn call) | — | P: 0 fwd / 0 bwd / 4 fallback |" in text
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit, match="no <stem>"):
        report.report(empty)


# ----------------------------------------------------------------------------- the plugin
def test_the_mode_comes_from_its_env_knob_and_a_bad_value_names_it():
    assert plugin.mode_from_env({}) == "provider"
    assert plugin.mode_from_env({"JITATTN_TORCH_TESTS": " DropIn "}) == "dropin"
    assert plugin.mode_from_env({"JITATTN_TORCH_TESTS": "off"}) == "off"
    with pytest.raises(pytest.UsageError, match="JITATTN_TORCH_TESTS='flash'"):
        plugin.mode_from_env({"JITATTN_TORCH_TESTS": "flash"})


def test_properties_are_the_calls_made_during_one_test():
    before = {"forward": 3, "backward": 1, "fallback": 0}
    after = {"forward": 3 + 5, "backward": 1 + 2, "fallback": 1}
    assert plugin.properties_for(before, after) == [("jitattn_forward", 5), ("jitattn_backward", 2),
                                                    ("jitattn_fallback", 1)]
    assert plugin.call_counts("off") == {"forward": 0, "backward": 0, "fallback": 0}


def test_the_counting_wrapper_counts_eager_forwards_and_their_backward():
    plugin.DROPIN_CALLS.clear()

    def fake_attention(q, return_lse=False):
        out = q * 2
        return (out, q.sum(-1)) if return_lse else out

    wrapped = plugin.counting(fake_attention)
    q = torch.randn(4, 3, requires_grad=True)
    out = wrapped(q)
    assert torch.equal(out, q * 2) and plugin.DROPIN_CALLS["forward"] == 1
    out.sum().backward()
    assert plugin.DROPIN_CALLS["backward"] == 1 and torch.equal(q.grad, torch.full_like(q, 2.0))
    with torch.no_grad():
        out, lse = wrapped(q, return_lse=True)
    assert plugin.DROPIN_CALLS == {"forward": 2, "backward": 1}
    assert wrapped.jitattn_dropin and wrapped.__name__ == "fake_attention"


def test_install_dropin_replaces_adds_and_gives_back_torchs_names():
    import types

    fake_varlen = types.ModuleType("fake_varlen")
    torch_varlen_attn = object()
    fake_varlen.varlen_attn = torch_varlen_attn  # no varlen_attn_out, as torch 2.11
    replacements = {"varlen_attn": object(), "varlen_attn_out": object(), "AuxRequest": object()}
    originals = plugin.install_dropin(fake_varlen, replacements)
    assert fake_varlen.varlen_attn is replacements["varlen_attn"]
    assert fake_varlen.varlen_attn_out is replacements["varlen_attn_out"]
    assert fake_varlen._should_use_cudnn(0) is False and fake_varlen._should_use_cudnn is plugin.never_cudnn
    test_module = types.ModuleType("test_mod")
    test_module.varlen_attn = torch_varlen_attn
    test_module.unrelated = object()
    assert plugin.rebind_module(test_module, originals, replacements) == ["varlen_attn"]
    assert test_module.varlen_attn is replacements["varlen_attn"]
    plugin.uninstall_dropin(fake_varlen, originals)
    assert fake_varlen.varlen_attn is torch_varlen_attn
    assert not hasattr(fake_varlen, "varlen_attn_out") and not hasattr(fake_varlen, "_should_use_cudnn")


TINY_TEST = textwrap.dedent("""
    import torch.nn.attention.varlen as varlen_module
    from torch.nn.attention.varlen import varlen_attn


    def test_names(record_property):
        import jitattn
        record_property("varlen_attn_is_jitattns", getattr(varlen_attn, "__wrapped__", None) is jitattn.varlen_attn)
        record_property("module_has_out", hasattr(varlen_module, "varlen_attn_out"))
        record_property("cudnn", getattr(getattr(varlen_module, "_should_use_cudnn", None), "__name__", "absent"))
""")


@pytest.mark.parametrize("mode", ["off", "dropin"])
def test_a_pytest_run_with_the_plugin_patches_torch_only_in_dropin_mode(tmp_path, mode):
    (tmp_path / "test_tiny.py").write_text(TINY_TEST)
    env = {**os.environ, "JITATTN_TORCH_TESTS": mode,
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tools"), os.environ.get("PYTHONPATH", "")])}
    xml = tmp_path / f"tiny.{mode}.xml"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "jitattn_torch_tests_plugin", "-p",
                           "no:cacheprovider", "-o", "junit_family=xunit1", f"--junitxml={xml}", "test_tiny.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"jitattn torch tests: mode={mode}" in done.stdout
    import xml.etree.ElementTree as ET

    props = {p.get("name"): p.get("value") for p in ET.parse(xml).iter("property")}
    assert props["varlen_attn_is_jitattns"] == str(mode == "dropin")
    assert props["jitattn_forward"] == "0" and props["jitattn_fallback"] == "0"
    if mode == "dropin":
        assert props["module_has_out"] == "True" and props["cudnn"] == "never_cudnn"
    else:
        assert props["cudnn"] != "never_cudnn"


def test_stand_ins_are_added_only_where_torch_lacks_the_name():
    import types

    modules = {"helpers": types.ModuleType("helpers")}
    modules["helpers"].PRESENT = "torch's own"

    def import_module(name):
        if name not in modules:
            raise ImportError(name)
        return modules[name]

    marker = object()
    stand_ins = {("helpers", "PRESENT"): lambda: marker, ("helpers", "MISSING"): lambda: marker,
                 ("not_importable", "X"): lambda: marker}
    assert plugin.install_stand_ins(stand_ins, import_module) == ["helpers.MISSING"]
    assert modules["helpers"].PRESENT == "torch's own" and modules["helpers"].MISSING is marker
    classification = plugin.TESTING_STAND_INS[("torch.testing._internal.common_utils", "HardwareClassification")]()
    assert classification.CUDA.value == "cuda"
    decorated = plugin.TESTING_STAND_INS[("torch.testing._internal.common_utils",
                                          "setSdpaBackendsToDefaultFinally")]()(lambda x: x + 1)
    assert decorated(41) == 42


def test_a_pass_that_only_fell_back_says_so_and_a_pass_through_jitattn_says_nothing(rng):
    def reason(calls):
        return report.reasons_for("test_flash_cuda", {"provider": report.Result("passed", "", calls)})

    assert "fallback" in reason((0, 0, rng.randint(1, 9)))
    assert reason((rng.randint(1, 9), 1, 2)) == ""
    assert reason((0, 0, 0)) == ""


def test_the_counting_wrapper_traces_under_fullgraph_compile_without_counting():
    """torch's tests compile varlen_attn with fullgraph=True: the wrapper must not break the graph."""
    plugin.DROPIN_CALLS.clear()
    wrapped = plugin.counting(lambda q, k: torch.softmax(q @ k.transpose(-1, -2), dim=-1))
    q, k = torch.randn(5, 8), torch.randn(6, 8)
    compiled = torch.compile(wrapped, backend="eager", fullgraph=True)
    assert torch.allclose(compiled(q, k), torch.softmax(q @ k.T, dim=-1))
    assert plugin.DROPIN_CALLS["forward"] == 0
    wrapped(q, k)
    assert plugin.DROPIN_CALLS["forward"] == 1
