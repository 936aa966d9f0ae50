"""One configuration: AMESH_* variables and amesh.configure, checked in one place."""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import amesh
from amesh import Actor, ConfigError, ProcMesh, _config, _wire, endpoint
from amesh._runtime import _links

PAGE = Path(__file__).parent.parent / "docs" / "guides" / "configuration.md"


class Seer(Actor):
    """Reports the settings its worker sees."""

    @endpoint
    def seen(self) -> dict[str, Any]:
        s = _config.settings()
        return {"send_window": s.send_window, "debug": s.debug, "output": s.output}


@pytest.fixture(autouse=True)
def fresh_config() -> Iterator[None]:
    """Each test starts from the environment alone, and leaves nothing configured."""
    _config.reset()
    yield
    _config.reset()


@pytest.mark.parametrize(
    ("var", "raw", "says"),
    [
        ("AMESH_FANOUT", "x", "0 (no relay tree) or an integer >= 2"),
        ("AMESH_FANOUT", "1", "0 (no relay tree) or an integer >= 2"),
        ("AMESH_HEARTBEAT_PERIOD", "0", "a number > 0"),
        ("AMESH_HEARTBEAT_TIMEOUT", "nan", "a number > 0"),
        ("AMESH_SEND_WINDOW", "10", "an integer >= 64"),
        ("AMESH_DEBUG", "maybe", "a boolean (1/0, true/false, yes/no, on/off)"),
        ("AMESH_OUTPUT", "loud", "one of 'folded', 'raw', 'off'"),
        ("AMESH_TRANSPORT_IMPL", "zmq", "one of 'stream', 'ext', 'nng'"),
    ],
)
def test_a_bad_variable_is_named_with_its_value(
    monkeypatch: pytest.MonkeyPatch, var: str, raw: str, says: str
) -> None:
    monkeypatch.setenv(var, raw)
    with pytest.raises(ConfigError) as info:
        _config.settings()
    assert str(info.value) == f"{var} must be {says}, not {raw!r}"
    assert isinstance(info.value, ValueError)


def test_a_bad_variable_fails_where_a_mesh_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AMESH_FANOUT", "sixteen")
    with pytest.raises(ConfigError, match="AMESH_FANOUT"):
        ProcMesh()


def test_settings_are_parsed_once_until_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AMESH_FANOUT", "8")
    first = _config.settings()
    assert first.fanout == 8 and _config.settings() is first
    os.environ["AMESH_FANOUT"] = "4"  # behind amesh's back: not read again...
    assert _config.settings() is first
    _config.reset(overrides=False)  # ...until reset (tests/conftest.py's monkeypatch does)
    assert _config.settings().fanout == 4
    monkeypatch.setenv("AMESH_FANOUT", "4")
    assert _config.settings().fanout == 4
    monkeypatch.delenv("AMESH_FANOUT")
    assert _config.settings().fanout == 16  # the default
    monkeypatch.setenv("AMESH_FANOUT", "")  # empty: unset
    assert _config.settings().fanout == 16


def test_configure_wins_over_the_environment_and_none_gives_it_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AMESH_SEND_WINDOW", "128")
    amesh.configure(send_window=256, state_dir=Path("/tmp/x"), heartbeat_timeout=7)
    s = _config.settings()
    assert (s.send_window, s.state_dir, s.heartbeat_timeout) == (256, "/tmp/x", 7.0)
    # what the workers get in their spec: typed values, by name
    assert _config.for_workers({}, {}) == {
        "send_window": 256,
        "state_dir": "/tmp/x",
        "heartbeat_timeout": 7.0,
    }
    amesh.configure(send_window=None)
    assert _config.settings().send_window == 128
    assert "send_window" not in _config.for_workers({}, {})


def test_configure_refuses_unknown_names_listing_the_valid_ones() -> None:
    with pytest.raises(ConfigError) as info:
        amesh.configure(fanot=4, fanout=4)
    message = str(info.value)
    assert message.startswith("no amesh setting fanot; the settings are: ")
    for f in dataclasses.fields(_config.Settings):
        assert f.name in message
    assert _config.for_workers({}, {}) == {}  # nothing was set, not even fanout


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"fanout": "4"}, "fanout (AMESH_FANOUT) must be 0 (no relay tree) or an integer >= 2"),
        ({"fanout": True}, "fanout (AMESH_FANOUT) must be"),
        ({"heartbeat_period": 0}, "heartbeat_period (AMESH_HEARTBEAT_PERIOD) must be a number"),
        ({"debug": 1}, "debug (AMESH_DEBUG) must be a boolean"),
        ({"output": "loud"}, "output (AMESH_OUTPUT) must be one of 'folded', 'raw', 'off'"),
    ],
)
def test_configure_checks_values_as_the_environment_is(
    values: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        amesh.configure(**values, send_window=128)
    assert str(info.value).startswith(message)
    assert repr(next(iter(values.values()))) in str(info.value)
    assert _config.for_workers({}, {}) == {}


def test_explicit_zeros_are_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AMESH_FANOUT", "0")
    assert ProcMesh()._fanout == 0
    monkeypatch.delenv("AMESH_FANOUT")
    amesh.configure(fanout=0, local_agent_idle=0, shm_threshold=0)
    assert ProcMesh()._fanout == 0
    assert ProcMesh(fanout=2)._fanout == 2  # a call's own argument wins
    assert _config.settings().local_agent_idle == 0.0
    assert _config.settings().shm_threshold == 0
    assert _wire.shm_threshold() == 64 * 1024  # smaller buffers cannot leave the stream


def test_explicit_zero_heartbeats_are_refused_not_replaced() -> None:
    with pytest.raises(ConfigError, match=r"^heartbeat_period=0 \(ProcMesh's argument\) must"):
        ProcMesh(heartbeat_period=0)
    with pytest.raises(ConfigError, match=r"^heartbeat_timeout=0 \(ProcMesh's argument\) must"):
        ProcMesh(heartbeat_timeout=0)
    amesh.configure(heartbeat_period=2.0, heartbeat_timeout=9.0)
    procs = ProcMesh(heartbeat_period=1.0)
    assert (procs._hb_period, procs._hb_timeout) == (1.0, 9.0)


def test_unset_heartbeats_stretch_with_the_mesh_and_set_ones_do_not() -> None:
    assert (ProcMesh(per_host={"procs": 256})._hb_period, _config.heartbeats(256)) == (
        0.5,
        (0.5, 5.0),
    )
    big = ProcMesh(per_host={"hosts": 4, "procs": 256})
    assert (big._hb_period, big._hb_timeout) == (2.0, 8.0)  # 512 beats a second
    assert _config.heartbeats(1024, period=0.5) == (0.5, 5.0)  # given: as given
    amesh.configure(heartbeat_period=0.25)
    assert _config.heartbeats(4096) == (0.25, 5.0)  # set: as set
    amesh.configure(heartbeat_period=None, heartbeat_timeout=3.0)
    with pytest.raises(ConfigError) as info:  # not more than the stretched period
        ProcMesh(per_host={"procs": 4096})
    assert str(info.value) == (
        "heartbeat_timeout=3.0 (amesh.configure) must be more than the heartbeat period "
        "(8 s, the default for 4096 processes): a number > 8"
    )


@pytest.mark.parametrize(
    ("env", "args", "message"),
    [
        (
            {"AMESH_HEARTBEAT_TIMEOUT": "0.2"},
            {},
            "AMESH_HEARTBEAT_TIMEOUT=0.2 must be more than the heartbeat period "
            "(0.5 s, the default): a number > 0.5",
        ),
        (
            {"AMESH_HEARTBEAT_PERIOD": "6"},
            {"heartbeat_timeout": 3},
            "heartbeat_timeout=3 (ProcMesh's argument) must be more than the heartbeat "
            "period (AMESH_HEARTBEAT_PERIOD=6): a number > 6",
        ),
        (
            {"AMESH_HEARTBEAT_PERIOD": "2", "AMESH_HEARTBEAT_TIMEOUT": "1.5"},
            {},
            "AMESH_HEARTBEAT_TIMEOUT=1.5 must be more than the heartbeat period "
            "(AMESH_HEARTBEAT_PERIOD=2): a number > 2",
        ),
    ],
)
def test_heartbeats_that_do_not_fit_name_their_variables(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], args: dict[str, Any], message: str
) -> None:
    """Issue 36, item 16: AMESH_HEARTBEAT_TIMEOUT=0.2 raised `need 0 < heartbeat_period
    < heartbeat_timeout, got 0.5 and 0.2`, naming no variable."""
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError) as info:
        ProcMesh(**args)
    assert str(info.value) == message


def test_unknown_variables_are_warned_of_once_with_the_closest_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 36, item 16: a misspelt variable was ignored silently. Those amesh sets
    for its children, and those of its test suite and scripts, are not warned of."""
    monkeypatch.setattr(_config, "_warned", set())
    for var in ("AMESH_HEARTBEAT_TIMOUT", "AMESH_FANOUTT", "AMESH_QQQQ"):
        monkeypatch.setenv(var, "1")
    known = ("AMESH_DEBUG_RELAYED", "AMESH_TEST_ANYTHING", "AMESH_SLURM_DIR", "AMESH_EXT_DEBUG")
    for var in known:
        monkeypatch.setenv(var, "1")
    with pytest.warns(UserWarning) as record:
        ProcMesh()
    said = {str(w.message).split()[0]: str(w.message) for w in record}
    assert {"AMESH_HEARTBEAT_TIMOUT", "AMESH_FANOUTT", "AMESH_QQQQ"} <= set(said), said
    assert not set(known) & set(said)
    assert said["AMESH_FANOUTT"] == (
        "AMESH_FANOUTT is not an amesh setting, and is ignored; did you mean AMESH_FANOUT? "
        "(the settings: docs/guides/configuration.md)"
    )
    assert "did you mean AMESH_HEARTBEAT_TIMEOUT?" in said["AMESH_HEARTBEAT_TIMOUT"]
    assert "did you mean" not in said["AMESH_QQQQ"]  # nothing close
    assert {w.filename for w in record} == {__file__}  # the line that made the mesh
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ProcMesh()  # once a process


def test_values_round_trip_through_the_environment() -> None:
    # a default as the table writes it, set as its variable, reads back the same
    for f in dataclasses.fields(_config.Settings):
        if f.default != "":
            assert _config._parse(f.name, _config._text(f.default)) == f.default, f.name


def test_the_send_window_floors_are_the_credit_batches() -> None:
    fields = {f.name: f for f in dataclasses.fields(_config.Settings)}
    assert fields["send_window"].metadata["rule"].minimum == 2 * _links.CREDIT_BATCH
    assert fields["send_window_bytes"].metadata["rule"].minimum == 2 * _links.CREDIT_BATCH_BYTES


def test_internal_variables_are_not_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    names = {_config._var(f.name) for f in dataclasses.fields(_config.Settings)}
    assert names.isdisjoint(_config.INTERNAL)
    monkeypatch.setenv("AMESH_DEBUG_RELAYED", "3")
    assert _config.take_internal("AMESH_DEBUG_RELAYED") == "3"
    assert "AMESH_DEBUG_RELAYED" not in os.environ
    with pytest.raises(KeyError):
        _config.take_internal("AMESH_FANOUT")


def test_the_documented_table_is_the_definition() -> None:
    page = PAGE.read_text()
    begin = page.index("-->\n", page.index("<!-- settings:begin")) + len("-->\n")
    end = page.index("<!-- settings:end -->")
    assert page[begin:end] == _config.table(), (
        "docs/guides/configuration.md is out of date: paste amesh._config.table() "
        "between its settings markers"
    )
    for var in _config.INTERNAL:
        assert f"`{var}`" in page[end:]


@pytest.mark.anyio
async def test_configured_settings_reach_a_worker_under_the_mesh_env() -> None:
    amesh.configure(send_window=100, debug=True, output="raw")
    with anyio.fail_after(60):
        async with ProcMesh(env={"AMESH_DEBUG": "0"}) as procs:
            seer = await procs.spawn("seer", Seer)
            seen = await seer.seen.call_one()
    # configure's values, except where the mesh's own env says otherwise
    assert seen == {"send_window": 100, "debug": False, "output": "raw"}


def test_logging_levels_are_read_in_any_case(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AMESH_LOG_LEVEL", "info")
    assert _config.settings().log_level == "INFO"
    amesh.configure(log_level="debug")
    assert _config.settings().log_level == "DEBUG"
    assert _config.for_workers({}, {}) == {"log_level": "DEBUG"}
