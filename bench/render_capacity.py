"""BENCHMARKS.md's capacity-plan table and Summary row, rendered from the JSON
bench/capacity_plan.py writes ({"meta", "data": {"paid_tier", "free_tier", "target_s",
"workers", "seeds", "runs": [{"workers", "preemption", "seed", "tiers": {TIER:
{"ttft_p50_s", "ttft_p99_s", "ttft_max_s", ...}}, "throughput_tok_s",
"preemptions_per_s", ...}], ...}}): every cell the median (min–max) over the seeds
(bench.harness.summarize, as its own markdown), and the answer recomputed from the runs
by the sweep's own rule (`bench.capacity_plan.answers`), so the two cannot disagree."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bench.capacity_plan import PREEMPTION, answers, meets, tail_s
from bench.render_common import (
    RenderError,
    Results,
    fmt_sum,
    one_stem,
    row_source,
    sources_line,
    table,
)

STEM = "capacity_plan"


def _data(res: Results, stem: str) -> dict:
    data = res.load(stem).get("data", {})
    if not data.get("runs"):
        raise RenderError(f"{stem}.json has no runs")
    return data


def _groups(runs: Sequence[Mapping[str, Any]]) -> list[tuple[int, str, list]]:
    """(workers, preemption, its runs), preemption on first, then by workers."""
    groups: dict[tuple[int, str], list] = {}
    for r in runs:
        groups.setdefault((r["workers"], r["preemption"]), []).append(r)
    order = sorted(groups, key=lambda k: (PREEMPTION.index(k[1]), k[0]))
    return [(w, p, groups[(w, p)]) for w, p in order]


def _tail_cell(rs: Sequence[Mapping[str, Any]], tier: str) -> str:
    """The tier's TTFT p99 over the seeds, "max=" when a run had too few samples."""
    few = any(r["tiers"][tier]["ttft_p99_s"] is None for r in rs)
    return ("max=" if few else "") + fmt_sum(tail_s(r["tiers"][tier]) for r in rs)


def _meets_cell(tails: list, target_s: float) -> str:
    if meets(tails, target_s, every_seed=True):
        return "yes"
    return "median only" if meets(tails, target_s, every_seed=False) else "no"


def _workers(w: int | None, swept: Sequence[int]) -> str:
    return f"**{w}**" if w is not None else f"**none up to {max(swept)}**"


def answer_line(data: Mapping[str, Any]) -> str:
    """One sentence: the answer per preemption setting (every seed; median)."""
    ans = answers(data["runs"], data["paid_tier"], data["target_s"])
    swept = sorted({r["workers"] for r in data["runs"]})
    parts = [f"preemption {p}: {_workers(a['every_seed'], swept)} workers "
             f"(by the median over seeds: {a['median'] if a['median'] is not None else 'none'})"
             for p, a in ans.items()]
    return (f"Smallest worker count keeping {data['paid_tier']} TTFT p99 ≤ "
            f"{data['target_s']:g} s in every seed (and at every larger count swept): "
            + "; ".join(parts) + ".")


def capacity_table(res: Results, args: list[str], _old: str) -> str:
    """`<!-- generated: capacity-plan STEM -->`: one row per (workers, preemption)."""
    stem = one_stem("capacity-plan", args)
    data = _data(res, stem)
    paid, free, target_s = data["paid_tier"], data["free_tier"], data["target_s"]
    rows = []
    for workers, pre, rs in _groups(data["runs"]):
        paid_tails = [tail_s(r["tiers"][paid]) for r in rs]
        rows.append([
            str(workers), pre, fmt_sum(r["tiers"][paid]["ttft_p50_s"] for r in rs),
            _tail_cell(rs, paid), _tail_cell(rs, free),
            fmt_sum((r["throughput_tok_s"] for r in rs), digits=0),
            fmt_sum((r["preemptions_per_s"] for r in rs), digits=1),
            _meets_cell(paid_tails, target_s)])
    header = ["workers", "preemption", f"{paid} TTFT p50 s", f"{paid} TTFT p99 s",
              f"{free} TTFT p99 s", "output tok/s", "preemptions/s",
              f"{paid} p99 ≤ {target_s:g} s"]
    setup = (f"`{data['workload']}`, {data['slots']} slots per worker, step model "
             f"`{data.get('step_model', 'default')}`, "
             f"{data['duration_s']:g} simulated s per run (requests arriving in the first "
             f"{data['warmup_s']:g} s left out), median (min–max) over {data['seeds']} seeds.")
    return "\n\n".join([sources_line(res, [stem]), setup, table(header, "llrrrrrl", rows),
                        answer_line(data)])


def _at(data: Mapping[str, Any], workers: int, pre: str, tier: str) -> str:
    rs = [r for r in data["runs"] if r["workers"] == workers and r["preemption"] == pre]
    return fmt_sum(tail_s(r["tiers"][tier]) for r in rs)


def summary_capacity(res: Results, stem: str = STEM) -> list[str]:
    data = _data(res, stem)
    paid, free, target_s = data["paid_tier"], data["free_tier"], data["target_s"]
    ans = answers(data["runs"], paid, target_s)
    swept = sorted({r["workers"] for r in data["runs"]})
    parts = []
    for pre, a in ans.items():
        w = a["every_seed"]
        part = f"preemption {pre}: {_workers(w, swept)} workers"
        if w is not None:
            part += (f" ({paid} p99 {_at(data, w, pre, paid)} s, {free} p99 "
                     f"{_at(data, w, pre, free)} s there)")
        parts.append(part)
    found = all(a["every_seed"] is not None for a in ans.values())
    model = "" if data.get("step_model", "default") == "default" else \
        f", step model `{data['step_model']}`"
    return [f"capacity plan (simulated): workers of {data['slots']} slots that keep "
            f"{paid} TTFT p99 ≤ {target_s:g} s for `{data['workload']}`, {data['seeds']} "
            f"seeds{model}",
            "; ".join(parts),
            f"p99 ≤ {target_s:g} s in every seed" + ("" if found else " — **not met in the sweep**"),
            row_source(res, stem)]


KINDS = {"capacity-plan": capacity_table}
STEM_H100 = "capacity_plan_h100"  # the same sweep on the H100-measured step model
SUMMARY_ROWS = {"capacity-plan": summary_capacity,
                "capacity-plan-h100": lambda res: summary_capacity(res, STEM_H100)}
