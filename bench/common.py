"""Helpers every benchmark script shares: percentiles and the machine description."""

from __future__ import annotations

import contextlib
import math
import os
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def quantile(xs: list[float], q: float) -> float:
    """Linear-interpolated quantile, q in [0, 1]; NaN for no samples."""
    if not xs:
        return math.nan
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"


def machine() -> str:
    return (f"nproc={os.cpu_count()}, {cpu_model()}, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}")


def git_rev() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                             capture_output=True, text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True, timeout=5).stdout.strip()
        return rev + (" + uncommitted changes" if dirty else "")
    except Exception:
        return "?"
