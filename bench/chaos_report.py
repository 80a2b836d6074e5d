"""Number formatting of bench/chaos.py's results (pure; no fleet, no NATS), shared by
its markdown (`bench.chaos.report`) and the tables of BENCHMARKS.md that
bench/render_benchmarks.py renders from the same JSON, so the two cannot differ."""

from __future__ import annotations

import statistics

MUST = ("lost", "generated_twice", "failed_but_billed", "wrongly_failed")


def agg(values: list) -> str:
    """One number, or median (min-max) over reps; '-' if never measured."""
    xs = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if not xs:
        return "-" if not values or all(v is None for v in values) else str(values[0])
    if len(xs) == 1 or min(xs) == max(xs):
        return num(xs[0])
    return f"{num(statistics.median(xs))} ({num(min(xs))}–{num(max(xs))})"


def num(x: float) -> str:
    if isinstance(x, int) or float(x).is_integer() or abs(x) >= 100:
        return str(round(x))
    return f"{x:.2f}"


def failed_by_code(runs: list[dict]) -> str:
    codes = sorted({c for r in runs for c in r.get("failed", {})})
    if not codes:
        return "0"
    return ", ".join(f"{c} {agg([r.get('failed', {}).get(c, 0) for r in runs])}" for c in codes)
