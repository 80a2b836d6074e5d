"""The shared kernel (`fairlane/`) depends on no process package (DESIGN.md section 2)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

KERNEL = Path(__file__).resolve().parents[2] / "fairlane"
PROCESS_PACKAGES = {"dispatcher", "producer", "streamer", "gpu_worker"}


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every absolute module `path` imports, at any depth (inside functions too)."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def test_kernel_imports_no_process_package():
    offenders = [
        f"{path.relative_to(KERNEL.parent)}:{lineno}: imports {module}"
        for path in sorted(KERNEL.rglob("*.py"))
        for lineno, module in _imported_modules(path)
        if module.split(".")[0] in PROCESS_PACKAGES
    ]
    assert not offenders, "\n".join(offenders)


def test_the_scan_sees_imports_inside_functions(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("def f():\n    from dispatcher.service import Dispatcher\n", encoding="utf-8")
    assert _imported_modules(p) == [(2, "dispatcher.service")]
