"""The `fairlane` command's own arguments (no process is started)."""

from __future__ import annotations

import io
import json

import pytest

from fairlane.cli import main
from fairlane.tenants import hash_api_key

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


def test_help_lists_the_commands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "up " in out and "hash-key " in out


def test_no_or_unknown_command_is_usage_and_exit_2(capsys):
    assert main([]) == 2
    assert main(["nope"]) == 2
    assert "unknown command 'nope'" in capsys.readouterr().err


def test_hash_key_help_prints_help_not_a_hash(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["hash-key", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: fairlane hash-key") and "sha256:" not in out


def test_hash_key_from_argument_and_stdin(capsys, monkeypatch):
    assert main(["hash-key", "sk-x"]) == 0
    assert capsys.readouterr().out.strip() == hash_api_key("sk-x")
    monkeypatch.setattr("sys.stdin", io.StringIO("sk-y\n"))
    assert main(["hash-key"]) == 0
    assert capsys.readouterr().out.strip() == hash_api_key("sk-y")


def test_help_lists_usage_and_tenants(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "usage " in out and "tenants " in out


# --- fairlane usage: arguments and output shapes (the NATS part is an integration test)


NOW_MS = 1_795_000_000_000  # 2026-11-18T11:06:40Z


@pytest.mark.parametrize("text,expected_ms", [
    ("now", NOW_MS),
    ("-1h", NOW_MS - 3_600_000),
    ("-30m", NOW_MS - 1_800_000),
    ("now-7d", NOW_MS - 7 * 86_400_000),
    ("-1.5h", NOW_MS - 5_400_000),
    ("2026-11-23T10:00:00Z", 1_795_428_000_000),
    ("2026-11-23T11:00:00+01:00", 1_795_428_000_000),
    ("2026-11-23T10:00:00", 1_795_428_000_000),  # no zone: UTC
    ("2026-11-23", 1_795_392_000_000),
])
def test_usage_time_forms(text, expected_ms):
    from fairlane.usage_export import parse_time

    assert parse_time(text, NOW_MS, "--since") == expected_ms


def test_usage_bad_arguments_are_one_line_and_exit_2(capsys):
    cases = [
        (["--since", "yesterday"], "--since='yesterday': expected ISO-8601"),
        (["--since", "-1h", "--until", "-2h"], "must be before --until"),
        (["--since", "-1h", "--tenant", "a.b"], "--tenant='a.b'"),
        (["--since", "-1h", "--pool", "*"], "--pool='*'"),
        (["--since", "-1h", "--prefix", "x y"], "invalid prefix id"),
        (["--since", "-1h", "--connect-timeout-s", "0"], "must be > 0"),
    ]
    for argv, needle in cases:
        assert main(["usage", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, (argv, err)
    for argv, needle in ((["--until", "now"], "required: --since"),
                         (["--since", "-1h", "--format", "xml"], "invalid choice: 'xml'")):
        with pytest.raises(SystemExit) as exit_:
            main(["usage", *argv])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, err


def test_usage_relative_times_after_a_flag_and_env_only_for_the_connection(monkeypatch):
    from fairlane.usage_export import parse_args

    monkeypatch.setenv("FAIRLANE_NATS_URL", "nats://nats:4222")
    monkeypatch.setenv("FAIRLANE_POOL", "default")  # the fleet's: must not filter
    q = parse_args(["--since", "-1h", "--until", "-30m"])
    assert (q.since, q.until, q.pool, q.nats_url) == ("-1h", "-30m", "", "nats://nats:4222")


def test_usage_csv_and_json_shapes():
    from fairlane.protocol import Usage
    from fairlane.usage_export import COLUMNS, UsageReport, UsageTotals, render

    t = UsageTotals("acme", "default")
    for ts, n in ((NOW_MS - 5, 2), (NOW_MS - 9, 3)):
        t.add(Usage(request_id=f"r{n}", tenant="acme", pool="default", tier="paid",
                    prompt_tokens=n, completion_tokens=10 * n, cached_prompt_tokens=1,
                    num_recomputed_tokens=n - 1, kv_token_seconds=0.25 * n, ts_ms=ts))
    report = UsageReport(NOW_MS - 100, NOW_MS, None, "default", [t], 2, 0)
    lines = render(report, "csv").splitlines()
    assert lines[0] == ",".join(COLUMNS)
    assert lines[1].split(",")[:8] == ["acme", "default", "2", "5", "50", "2", "3", "1.25"]
    body = json.loads(render(report, "json"))
    assert (body["tenant"], body["pool"], body["incomplete_before"]) == (None, "default", None)
    assert body["rows"][0]["first_record_at"].endswith(".991Z")
    assert body["rows"][0]["last_record_at"].endswith(".995Z")
    assert body["until"] == "2026-11-18T11:06:40.000Z"
    assert render(UsageReport(0, 1, None, None, [], 0, 0), "csv") == ",".join(COLUMNS) + "\n"
