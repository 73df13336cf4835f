"""The per-call environment knobs (jitattn/jit/env.py) read os.environ's backing store for speed:
they must still see every change at once, as os.environ.get would."""
import os

import pytest

from jitattn.jit import env


@pytest.mark.parametrize("value, expected", [(None, False), ("1", True), ("yes", True), ("0", False),
                                             ("", False), (" off ", False), ("FALSE", False)])
def test_debug_flag_follows_the_environment(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("JITATTN_DEBUG", raising=False)
    else:
        monkeypatch.setenv("JITATTN_DEBUG", value)
    assert env.debug() is expected and env.debug() is (env._flag("JITATTN_DEBUG"))


@pytest.mark.parametrize("value, expected", [(None, True), ("1", True), ("", True), ("0", False),
                                             ("off", False), ("No", False)])
def test_wgmma_knob_defaults_on(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("JITATTN_WGMMA", raising=False)
    else:
        monkeypatch.setenv("JITATTN_WGMMA", value)
    assert env.wgmma_enabled() is expected


def test_knob_reads_see_writes_through_os_environ_at_once():
    try:
        for value in ("1", "0", "1"):
            os.environ["JITATTN_DEBUG"] = value
            assert env.debug() is (value == "1")
        del os.environ["JITATTN_DEBUG"]
        assert env.debug() is False
        os.environ.update(JITATTN_DEBUG="on")
        assert env.debug() is True
    finally:
        os.environ.pop("JITATTN_DEBUG", None)


def test_record_reset_makes_the_next_use_of_a_spec_append_it_again(tmp_path, monkeypatch):
    from jitattn.decode.spec import DecodeSpec
    from jitattn.jit import record

    path = tmp_path / "recorded.toml"
    monkeypatch.setenv("JITATTN_RECORD", str(path))
    record.reset()
    spec = DecodeSpec(head_dim=64, soft_cap=True)
    record.record_spec(spec)
    record.record_spec(spec)
    assert path.read_text().count("[[spec]]") == 1
    record.reset()
    record.record_spec(spec)
    assert path.read_text().count("[[spec]]") == 2
