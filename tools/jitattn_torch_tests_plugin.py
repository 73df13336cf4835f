"""A pytest plugin that runs torch's own tests with jitattn active as torch's flash-attention provider.

    PYTHONPATH=tools python3 -m pytest -p jitattn_torch_tests_plugin <pytorch>/test/test_varlen_attention.py

(tools/torch_tests_with_jitattn.sh does this for the tests docs/torch-tests.md lists.) It activates
jitattn before the first test, and at the end prints how many calls jitattn's kernels took and how
many fell back to torch's (jitattn/integrations/torch_flash.py CALLS): a run whose tests pass with
no jitattn call proves nothing.
"""
import jitattn


def pytest_configure(config):
    jitattn.activate()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    from jitattn.integrations import torch_flash, torch_registry

    calls = dict(torch_flash.CALLS)
    terminalreporter.write_line(f"jitattn flash provider: active={torch_registry.is_active()} calls={calls}")


def pytest_unconfigure(config):
    jitattn.restore()
