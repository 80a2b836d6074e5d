"""No Python module over 500 lines (DESIGN.md section 9: modules stay small)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 500
SKIP_DIRS = {".git", ".venv", "venv", "build", "dist", "__pycache__", ".fairlane"}


def python_files() -> list[Path]:
    return [
        p for p in ROOT.rglob("*.py")
        if not SKIP_DIRS.intersection(p.relative_to(ROOT).parts[:-1])
        and not any(part.endswith(".egg-info") for part in p.parts)
    ]


def test_no_module_over_500_lines():
    files = python_files()
    assert len(files) > 50  # the walk found the repository
    too_long = {
        str(p.relative_to(ROOT)): n
        for p in files
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not too_long, f"split these modules (over {MAX_LINES} lines): {too_long}"
