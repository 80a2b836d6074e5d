"""fleetsim.compiled's bookkeeping (the build itself: tests/integration/test_sim_compiled.py):
the cache key follows the source, the child's path puts the build first."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fleetsim import compiled

pytestmark = pytest.mark.unit


def _tree(root: Path) -> None:
    for pkg in compiled.PACKAGES:
        (root / pkg).mkdir(parents=True)
        (root / pkg / "__init__.py").write_text(f"# {pkg}\n")
    (root / "fleetsim" / "fleet.py").write_text("X = 1\n")


def test_the_key_follows_the_source_not_build_leftovers(tmp_path):
    _tree(tmp_path)
    key = compiled.build_key(tmp_path)
    assert compiled.build_key(tmp_path) == key
    # Compiler output and caches beside the source do not change what is built.
    (tmp_path / "fleetsim" / "fleet.cpython-311-x86_64-linux-gnu.so").write_bytes(b"\0")
    (tmp_path / "fleetsim" / "__pycache__").mkdir()
    (tmp_path / "fleetsim" / "__pycache__" / "fleet.pyc").write_bytes(b"\0")
    (tmp_path / "fleetsim" / "build").mkdir()
    (tmp_path / "fleetsim" / "build" / "fleet.c").write_text("/* mypyc */\n")
    assert compiled.build_key(tmp_path) == key
    (tmp_path / "fleetsim" / "fleet.py").write_text("X = 2\n")
    assert compiled.build_key(tmp_path) != key


def test_a_built_key_is_reused_without_compiling(tmp_path, monkeypatch):
    _tree(tmp_path / "src")
    monkeypatch.setenv("FAIRLANE_CACHE_DIR", str(tmp_path / "cache"))
    dest = compiled.cache_root() / compiled.build_key(tmp_path / "src")
    dest.mkdir(parents=True)
    (dest / ".built").write_text("fleetsim/fleet.py\n")
    monkeypatch.setattr(compiled.subprocess, "run", lambda *a, **k: pytest.fail("compiled"))
    assert compiled.build(tmp_path / "src") == dest


def test_the_child_imports_the_build_first_then_its_path_then_the_source(tmp_path):
    e = compiled.env(tmp_path, {"PYTHONPATH": "/elsewhere", "HOME": "/h"})
    assert e["PYTHONPATH"].split(os.pathsep) == [str(tmp_path), "/elsewhere",
                                                 str(compiled.source_root())]
    assert e["HOME"] == "/h"
    assert compiled.env(tmp_path, {})["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path)


def test_this_process_runs_the_interpreted_modules():
    assert compiled.is_compiled() is False


def test_compiled_without_a_compiler_is_a_clear_error(tmp_path, monkeypatch, capsys):
    from fleetsim.cli import cmd_simulate

    wl = tmp_path / "wl.yaml"
    wl.write_text("duration_s: 1\nclasses: []\n")

    def no_build(*_a, **_k):
        raise compiled.CompileError("mypyc is not installed: pip install -e '.[sim]'")

    monkeypatch.setattr(compiled, "build", no_build)
    assert cmd_simulate([str(wl), "--compiled", "--out", str(tmp_path / "o")]) == 2
    assert "--compiled: mypyc is not installed" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_child_that_did_not_load_the_build_says_so(tmp_path, monkeypatch, capsys):
    from fleetsim.cli import cmd_simulate

    wl = tmp_path / "wl.yaml"
    wl.write_text("duration_s: 1\nclasses: []\n")
    monkeypatch.setenv("FAIRLANE_SIM_COMPILED_CHILD", "1")  # as _run_compiled's child
    assert cmd_simulate([str(wl), "--compiled", "--out", str(tmp_path / "o")]) == 1
    assert "the compiled modules did not load" in capsys.readouterr().err
