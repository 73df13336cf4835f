"""A pytest plugin that runs torch's own attention tests against jitattn, in one of three modes.

    JITATTN_TORCH_TESTS=provider|dropin|off PYTHONPATH=.:tools \\
        python3 -m pytest -p jitattn_torch_tests_plugin .torchtests/test/test_varlen_attention.py

(tools/torch_tests_with_jitattn.sh runs the modes and files docs/torch-tests.md lists.)

- `provider` (the default): jitattn is torch's active flash-attention provider
  (jitattn.activate()); torch's own `varlen_attn` and SDPA run, and their flash kernels are
  jitattn's. A test that activates another provider (FA3 / FA4) and restores torch's default
  leaves jitattn inactive: the plugin activates it again before the next test.
- `dropin`: torch's `torch.nn.attention.varlen.varlen_attn` / `varlen_attn_out` / `AuxRequest`
  are replaced by jitattn's drop-ins (added where this torch lacks them, as torch 2.11 lacks
  `varlen_attn_out`), before the test modules import them and again in each collected module's
  namespace. torch's newest varlen tests then test jitattn's drop-in of the newest API on an
  older torch. `_should_use_cudnn` there answers False (jitattn's drop-in never routes to cuDNN),
  so torch's cuDNN-routing tests skip. Tests that call torch's private ops
  (`torch.ops.torch_attn._varlen_attn*`) or SDPA still test torch.
- `off`: nothing is patched: the baseline of what this torch passes with the test file.

In every mode, names that torch's newest test files import from torch.testing._internal and an
older torch lacks (torch 2.11: see TESTING_STAND_INS) are added as stand-ins with the newer
torch's meaning, before collection, and listed at the end: test infrastructure (device-capability
flags, decorators), never the code under test.

Every test records jitattn's calls during it (forward / backward / fallback to torch's kernel)
as junit properties `jitattn_forward`, `jitattn_backward`, `jitattn_fallback`, so that
tools/torch_tests_report.py can tell a pass through jitattn from a pass that never reached it.
The run ends with the totals. In dropin mode calls traced inside torch.compile are not counted
(counting there would break fullgraph tracing); their kernels still run.
"""
from __future__ import annotations

import collections
import functools
import os

import pytest

MODE_ENV = "JITATTN_TORCH_TESTS"
MODES = ("provider", "dropin", "off")
COUNTED = ("forward", "backward", "fallback")
PATCHED_NAMES = ("varlen_attn", "varlen_attn_out", "AuxRequest")

# dropin mode's count of jitattn drop-in calls (provider mode reads torch_flash.CALLS)
DROPIN_CALLS: collections.Counter = collections.Counter()


def mode_from_env(environ=os.environ) -> str:
    """The plugin's mode from JITATTN_TORCH_TESTS (provider when unset); a usage error otherwise."""
    mode = environ.get(MODE_ENV, "provider").strip().lower() or "provider"
    if mode not in MODES:
        raise pytest.UsageError(f"{MODE_ENV}={environ.get(MODE_ENV)!r}: expected one of {', '.join(MODES)}")
    return mode


# ----------------------------------------------------------------------------- dropin mode
def _count_backward(grad_inputs, grad_outputs):
    DROPIN_CALLS["backward"] += 1


def counting(function):
    """`function` (a jitattn drop-in) counting its eager calls in DROPIN_CALLS, and the backward
    of each result autograd records. Transparent under torch.compile."""
    import torch

    @functools.wraps(function)
    def call(*args, **kwargs):
        result = function(*args, **kwargs)
        if not torch.compiler.is_compiling():
            DROPIN_CALLS["forward"] += 1
            out = result[0] if isinstance(result, tuple) else result
            if isinstance(out, torch.Tensor) and out.grad_fn is not None:
                out.grad_fn.register_hook(_count_backward)
        return result

    call.jitattn_dropin = True
    return call


def dropin_replacements() -> dict:
    """torch.nn.attention.varlen's public names -> what dropin mode puts there."""
    import jitattn

    return {"varlen_attn": counting(jitattn.varlen_attn), "varlen_attn_out": counting(jitattn.varlen_attn_out),
            "AuxRequest": jitattn.AuxRequest}


def never_cudnn(*args, **kwargs) -> bool:
    """torch.nn.attention.varlen._should_use_cudnn in dropin mode: jitattn's drop-in never routes
    a call to cuDNN, so torch's cuDNN-routing tests skip rather than assert on cuDNN calls."""
    return False


def install_dropin(varlen_module, replacements: dict) -> dict:
    """Put `replacements` into torch's varlen module; returns what was there (None where absent)
    so that `uninstall_dropin` puts it back."""
    originals = {name: getattr(varlen_module, name, None) for name in replacements}
    originals["_should_use_cudnn"] = getattr(varlen_module, "_should_use_cudnn", None)
    for name, value in replacements.items():
        setattr(varlen_module, name, value)
    varlen_module._should_use_cudnn = never_cudnn
    return originals


def uninstall_dropin(varlen_module, originals: dict) -> None:
    for name, value in originals.items():
        if value is None:
            if hasattr(varlen_module, name):
                delattr(varlen_module, name)
        else:
            setattr(varlen_module, name, value)


def rebind_module(module, originals: dict, replacements: dict) -> list[str]:
    """Point the names a test module imported from torch's varlen module (`from
    torch.nn.attention.varlen import varlen_attn`) at the replacements; returns those rebound."""
    rebound = []
    for name, replacement in replacements.items():
        current = getattr(module, name, None)
        if current is not None and current is originals.get(name) and current is not replacement:
            setattr(module, name, replacement)
            rebound.append(name)
    return rebound


# ----------------------------------------------------------------------------- older torch's test helpers
def _capability_at_least(major: int) -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (major, 0)


def _is_sm90() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _hardware_classification():
    import enum

    return enum.Enum("HardwareClassification", [(n.upper(), n) for n in ("generic", "accelerator", "cpu", "cuda",
                                                                          "mps", "xpu")])


def _keep_rocm_fa_library(fn):
    """setSdpaBackendsToDefaultFinally: gives the ROCm flash library choice back after the test."""
    import torch

    @functools.wraps(fn)
    def run(*args, **kwargs):
        backends = torch.backends.cuda
        preferred = backends.preferred_rocm_fa_library() if hasattr(backends, "preferred_rocm_fa_library") else None
        try:
            return fn(*args, **kwargs)
        finally:
            if preferred is not None:
                backends.preferred_rocm_fa_library(preferred)

    return run


def _tf32_enabled():
    """common_cuda.tf32_enabled: TF32 matmuls on inside (a context manager, also a decorator)."""
    import contextlib

    import torch

    @contextlib.contextmanager
    def tf32_enabled():
        matmul = torch.backends.cuda.matmul.allow_tf32
        try:
            torch.backends.cuda.matmul.allow_tf32 = True
            with torch.backends.cudnn.flags(enabled=None, benchmark=None, deterministic=None, allow_tf32=True):
                yield
        finally:
            torch.backends.cuda.matmul.allow_tf32 = matmul

    return tf32_enabled


# (module, name) -> a function making the stand-in, added only where the installed torch lacks it
TESTING_STAND_INS = {
    ("torch.testing._internal.common_cuda", "IS_SM90"): _is_sm90,
    ("torch.testing._internal.common_cuda", "SM90OrLater"): lambda: _capability_at_least(9),
    ("torch.testing._internal.common_cuda", "SM100OrLater"): lambda: _capability_at_least(10),
    ("torch.testing._internal.common_cuda", "SM120OrLater"): lambda: _capability_at_least(12),
    ("torch.testing._internal.common_cuda", "PLATFORM_SUPPORTS_CK_SDPA"): lambda: False,  # ROCm's CK only
    ("torch.testing._internal.common_utils", "HardwareClassification"): _hardware_classification,
    ("torch.testing._internal.common_utils", "setSdpaBackendsToDefaultFinally"): lambda: _keep_rocm_fa_library,
    ("torch.testing._internal.common_cuda", "tf32_enabled"): _tf32_enabled,
    ("torch.testing._internal.common_device_type", "expectedFailureMPS"): lambda: (lambda fn: fn),  # no MPS here
}


def install_stand_ins(stand_ins=None, import_module=None) -> list[str]:
    """Add the stand-ins whose names the installed torch lacks; returns 'module.name' of each added.
    A module that does not import is left alone (the test file's import then says why)."""
    import importlib

    stand_ins = TESTING_STAND_INS if stand_ins is None else stand_ins
    import_module = import_module or importlib.import_module
    added = []
    for (module_name, name), make in stand_ins.items():
        try:
            module = import_module(module_name)
        except Exception:  # noqa: BLE001 - e.g. expecttest missing: the test file's own import reports it
            continue
        if not hasattr(module, name):
            setattr(module, name, make())
            added.append(f"{module_name}.{name}")
    return added


# ----------------------------------------------------------------------------- the calls per test
def call_counts(mode: str) -> dict:
    """Totals so far of jitattn's calls in `mode` (all zero in off mode)."""
    if mode == "provider":
        from jitattn.integrations import torch_flash

        source = torch_flash.CALLS
    elif mode == "dropin":
        source = DROPIN_CALLS
    else:
        source = {}
    return {kind: int(source.get(kind, 0)) for kind in COUNTED}


def properties_for(before: dict, after: dict) -> list[tuple[str, int]]:
    """The junit properties of one test: jitattn_<kind> = the calls made during it."""
    return [(f"jitattn_{kind}", after[kind] - before[kind]) for kind in COUNTED]


class JitattnTorchTests:
    """The plugin's state for one pytest session."""

    def __init__(self, config, mode: str):
        self.config = config
        self.mode = mode
        self.originals: dict = {}
        self.replacements: dict = {}
        self.reactivations = 0
        self.rebound: dict[str, list[str]] = {}
        self.stand_ins: list[str] = []

    # -- session
    def start(self) -> None:
        self.stand_ins = install_stand_ins()
        if self.mode == "provider":
            import jitattn

            jitattn.activate()
        elif self.mode == "dropin":
            import torch.nn.attention.varlen as varlen

            self.replacements = dropin_replacements()
            self.originals = install_dropin(varlen, self.replacements)

    def stop(self) -> None:
        if self.mode == "provider":
            import jitattn

            jitattn.restore()
        elif self.mode == "dropin" and self.originals:
            import torch.nn.attention.varlen as varlen

            uninstall_dropin(varlen, self.originals)

    # -- hooks
    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, session, config, items):
        if self.mode != "dropin":
            return
        for module in {id(m): m for m in (getattr(item, "module", None) for item in items) if m}.values():
            rebound = rebind_module(module, self.originals, self.replacements)
            if rebound:
                self.rebound[module.__name__] = rebound

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item):
        if self.mode == "provider":
            from jitattn.integrations import torch_registry

            if not torch_registry.is_active():  # a test activated FA3/FA4, then restored torch's default
                torch_registry.activate()
                self.reactivations += 1
        item.stash[_BEFORE] = call_counts(self.mode)
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item, nextitem):
        yield
        before = item.stash.get(_BEFORE, None)
        if before is not None:  # the teardown report, made after this, carries them into the junit XML
            item.user_properties.extend(properties_for(before, call_counts(self.mode)))

    def pytest_sessionstart(self, session):
        from _pytest.junitxml import xml_key

        xml = self.config.stash.get(xml_key, None)
        if xml is not None:
            xml.add_global_property("jitattn_mode", self.mode)
            xml.add_global_property("jitattn_stand_ins", " ".join(self.stand_ins) or "none")

    def pytest_terminal_summary(self, terminalreporter, exitstatus, config):
        line = f"jitattn torch tests: mode={self.mode} calls={call_counts(self.mode)}"
        if self.mode == "provider":
            from jitattn.integrations import torch_registry

            line += f" active={torch_registry.is_active()} reactivated={self.reactivations}"
        if self.mode == "dropin":
            line += f" rebound={self.rebound}"
        terminalreporter.write_line(line)
        terminalreporter.write_line("stand-ins for test helpers this torch lacks: " + (", ".join(self.stand_ins)
                                                                                      or "none"))


_BEFORE = pytest.StashKey[dict]()
_PLUGIN = "jitattn_torch_tests"


def pytest_configure(config):
    plugin = JitattnTorchTests(config, mode_from_env())
    plugin.start()  # before collection: the test modules import the patched names
    config.pluginmanager.register(plugin, _PLUGIN)


def pytest_unconfigure(config):
    plugin = config.pluginmanager.get_plugin(_PLUGIN)
    if plugin is not None:
        plugin.stop()
