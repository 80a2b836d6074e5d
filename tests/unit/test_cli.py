"""The `fairlane` command's own arguments (no process is started)."""

from __future__ import annotations

import io

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
