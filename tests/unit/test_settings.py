"""Strict settings: every bad flag or FAIRLANE_* variable is one line naming it, exit 2."""

from __future__ import annotations

import pytest

from dispatcher.config import DispatcherSettings
from fairlane.cli import UpSettings
from fairlane.settings import (
    SettingsError,
    build_parser,
    fleet_env_names,
    load_settings,
    parse_settings,
)
from gpu_worker.config import WorkerSettings
from producer.config import ProducerSettings
from streamer.config import StreamerSettings

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

ALL_SETTINGS = [DispatcherSettings, WorkerSettings, StreamerSettings, ProducerSettings,
                UpSettings]


def _error(cls, argv=(), env=None, capsys=None) -> str:
    """The one line `load_settings` prints before exiting 2."""
    with pytest.raises(SystemExit) as exit_:
        load_settings(cls, list(argv), env=env or {}, prog="proc")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("raw", ["maybe", "2", ""])
def test_malformed_bool_in_env_names_the_variable(raw, capsys):
    err = _error(DispatcherSettings, env={"FAIRLANE_LOG_JSON": raw}, capsys=capsys)
    assert "FAIRLANE_LOG_JSON" in err and "expected a bool" in err


@pytest.mark.parametrize("raw", ["1", "true", "YES", "on"])
def test_bool_spellings_in_env(raw):
    s = parse_settings(WorkerSettings, [], {"FAIRLANE_ENFORCE_EAGER": raw})
    assert s.enforce_eager is True


def test_malformed_int_in_env_and_flag_names_the_source(capsys):
    err = _error(WorkerSettings, env={"FAIRLANE_MAX_NUM_SEQS": "lots"}, capsys=capsys)
    assert "FAIRLANE_MAX_NUM_SEQS='lots': expected an integer" in err
    err = _error(WorkerSettings, ["--max-num-seqs", "1.5"], capsys=capsys)
    assert "--max-num-seqs='1.5': expected an integer" in err


def test_unknown_fairlane_variable_is_refused_with_a_suggestion(capsys):
    err = _error(DispatcherSettings, env={"FAIRLANE_ACK_WAIT": "5"}, capsys=capsys)
    assert "unknown environment variable FAIRLANE_ACK_WAIT" in err
    assert "did you mean FAIRLANE_ACK_WAIT_S" in err


def test_another_processs_variable_is_not_unknown():
    # `FAIRLANE_DTYPE=float32 fairlane up` gives every child the workers' variables.
    env = {"FAIRLANE_DTYPE": "float32", "FAIRLANE_MAX_NUM_SEQS": "4",
           "FAIRLANE_ANONYMOUS_TENANT": "x", "FAIRLANE_SKIP_VLLM": "1", "OTHER": "y"}
    for cls in ALL_SETTINGS:
        parse_settings(cls, [], env)
    assert {"FAIRLANE_DTYPE", "FAIRLANE_HTTP_PORT", "FAIRLANE_USAGE_MAX_AGE_S"} <= (
        fleet_env_names())


@pytest.mark.parametrize("cls,name", [
    (DispatcherSettings, "stop_timeout_s"), (WorkerSettings, "drain_timeout_s"),
    (StreamerSettings, "tenants_reload_s"), (WorkerSettings, "coalesce_ms"),
    (ProducerSettings, "deadline_s"), (UpSettings, "ready_timeout_s"),
])
def test_negative_duration_is_refused(cls, name, capsys):
    flag = "--" + name.replace("_", "-")
    err = _error(cls, [flag, "-1"], capsys=capsys)
    assert f"{flag}='-1': must be >= 0" in err
    err = _error(cls, env={"FAIRLANE_" + name.upper(): "-5"}, capsys=capsys)
    assert f"FAIRLANE_{name.upper()}='-5': must be >= 0" in err


def test_unknown_policy_or_engine_lists_the_choices(capsys):
    err = _error(DispatcherSettings, ["--policy", "lottery"], capsys=capsys)
    assert "--policy" in err and "'fifo'" in err and "'vtc'" in err
    err = _error(DispatcherSettings, env={"FAIRLANE_POLICY": "lottery"}, capsys=capsys)
    assert "FAIRLANE_POLICY='lottery': expected one of: drr|fifo|vtc" in err
    err = _error(WorkerSettings, ["--engine", "tpu"], capsys=capsys)
    assert "--engine" in err and "'vllm'" in err
    err = _error(UpSettings, env={"FAIRLANE_ENGINE": "tpu"}, capsys=capsys)
    assert "FAIRLANE_ENGINE='tpu': expected one of: sim|vllm" in err


def test_zero_workers_is_refused(capsys):
    err = _error(UpSettings, ["--workers", "0"], capsys=capsys)
    assert "--workers='0': must be >= 1" in err


def test_unknown_flag_is_one_line(capsys):
    err = _error(DispatcherSettings, ["--polcy", "drr"], capsys=capsys)
    assert "unrecognized arguments: --polcy drr" in err


def test_empty_policy_means_no_override():
    assert parse_settings(DispatcherSettings, [], {"FAIRLANE_POLICY": ""}).policy is None
    assert parse_settings(DispatcherSettings, ["--policy", "vtc"], {}).policy == "vtc"


@pytest.mark.parametrize("cls", ALL_SETTINGS, ids=lambda c: c.__name__)
def test_every_flag_has_a_help_sentence(cls):
    parser = build_parser(cls, "proc")
    for action in parser._actions:
        if action.dest == "help":
            continue
        sentence = action.help.split("[env ")[0].strip()
        assert sentence, f"{cls.__name__}: {action.option_strings[0]} has no help sentence"


def _help(cls) -> str:
    return " ".join(build_parser(cls, "proc").format_help().split())  # unwrapped


def test_help_lists_the_choices():
    assert "One of: drr|fifo|vtc" in _help(DispatcherSettings)
    assert "One of: drr|fifo|vtc" in _help(UpSettings)
    assert "One of: sim|vllm" in _help(WorkerSettings)
    assert "One of: sim|vllm" in _help(UpSettings)


def test_parse_settings_raises_settings_error_for_library_callers():
    with pytest.raises(SettingsError, match="FAIRLANE_PORT='http'"):
        parse_settings(StreamerSettings, [], {"FAIRLANE_PORT": "http"})


def test_stream_settings_are_flags_of_every_nats_process():
    for cls in (DispatcherSettings, WorkerSettings, StreamerSettings, ProducerSettings):
        s = parse_settings(cls, ["--stream-replicas", "3"],
                           {"FAIRLANE_USAGE_MAX_AGE_S": "3600"})
        assert (s.stream_replicas, s.usage_max_age_s, s.requests_max_bytes) == (3, 3600, None)
