"""The report of a simulated run: `simulate.md`, `simulate.json` and three PNG plots.

The markdown is headed like the benchmark results files (bench/harness.py: command,
commit, date, machine), so a simulation sits beside BENCHMARKS.md's numbers with the
same provenance. Latencies come from `Recorder.summary()`'s histograms: a tail
percentile with too few samples is shown as "max=..." (see `histogram.min_samples`).

matplotlib is only needed for the plots, and only imported when they are drawn
(`pip install 'fairlane[sim]'`); `write_report(..., plots=False)` works without it.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import platform
import re
import shlex
import sys
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

# Filled in and re-wrapped per report (the bucket widths are the recorder's settings).
HOW_TO_READ = (
    "Simulated time, not wall time: the production scheduler (`PoolCore`) over simulated "
    "workers. Latencies are read from log-spaced histograms ({tier_pct:g} % buckets per "
    "tier, {tenant_pct:g} % per detail tenant), so a percentile is within one bucket of the "
    "exact value; a p99 from fewer than 200 samples (p99.9: 2,000) is shown as the largest "
    "sample, \"max=...\". TTFT and TPOT are in ms, end-to-end (e2e) in s. \"share\" is the "
    "tier's (tenant's) part of all generated tokens; \"rejected\" counts admission refusals "
    "and drops while queued.")


# --- provenance -------------------------------------------------------------------------


def _harness() -> ModuleType | None:
    """bench/harness.py, whose results header every benchmark file uses. It is importable
    from a source checkout's root; run through the `fairlane` script the checkout is not
    on sys.path, so it is added (at the end, shadowing nothing). None when fairlane is
    installed without its repository."""
    try:
        from bench import harness
        return harness
    except ImportError:
        pass
    root = Path(__file__).resolve().parents[1]
    if not (root / "bench" / "harness.py").is_file():
        return None
    sys.path.append(str(root))
    try:
        from bench import harness
        return harness
    except ImportError:
        return None


def run_meta(command: str | None = None) -> dict[str, str]:
    """command, commit, date_utc, machine, as bench/harness.RunMeta records them."""
    h = _harness()
    if h is not None:
        meta = h.RunMeta.here()
        return {"command": command or meta.command, "commit": meta.commit,
                "date_utc": meta.date_utc, "machine": meta.machine}
    from importlib.metadata import PackageNotFoundError, version
    try:
        commit = f"fairlane {version('fairlane')} (installed, no source checkout)"
    except PackageNotFoundError:
        commit = "unknown"
    return {"command": command or "python " + " ".join(shlex.quote(a) for a in sys.argv),
            "commit": commit,
            "date_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "machine": f"{platform.system()} {platform.release()}, "
                       f"Python {platform.python_version()}"}


def _header(title: str, meta: Mapping[str, str], how_to_read: str) -> str:
    h = _harness()
    if h is not None:
        rm = h.RunMeta(meta["command"], meta["commit"], meta["date_utc"], meta["machine"])
        return h.results_header(title, rm, how_to_read)
    return "\n".join([f"# {title}", "", f"- command: `{meta['command']}`",
                      f"- commit: {meta['commit']}", f"- date (UTC): {meta['date_utc']}",
                      f"- machine: {meta['machine']}", "", "## How to read this", "",
                      how_to_read, "", ""])


# --- tables -----------------------------------------------------------------------------

_NUMERIC = re.compile(r"^(max=)?[-+]?[\d,]*\.?\d+\s*(%|×|x|ms|s)?$")


def fmt_value(v: Any, digits: int = 2) -> str:
    """A table cell: thousands separators, `digits` decimals for floats, n/a for None."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return "inf" if math.isinf(v) else f"{v:,.{digits}f}"
    return str(v).replace("|", "\\|")


def compare_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None,
                  digits: int = 2) -> str:
    """A markdown table of `rows` (dicts), columns in the given order or else in order of
    first appearance; numeric columns are right-aligned. A missing cell is "n/a"."""
    if columns is None:
        columns = list(dict.fromkeys(k for r in rows for k in r))
    cells = [[fmt_value(r.get(c), digits) for c in columns] for r in rows]
    right = [bool(rows) and all(_NUMERIC.match(row[i]) or row[i] == "n/a" for row in cells)
             for i in range(len(columns))]
    lines = ["| " + " | ".join(columns) + " |",
             "|" + "|".join("---:" if r else "---" for r in right) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines) + "\n"


def fmt_quantile(stats: Mapping[str, Any], name: str, scale: float = 1.0,
                 digits: int = 1) -> str:
    """A percentile from `histogram.LogHist.stats` scaled (1e3: s -> ms); "max=..." where
    there were too few samples for it, "n/a" with none."""
    if not stats or not stats.get("n"):
        return "n/a"
    v = stats.get(name)
    if v is not None:
        return f"{v * scale:,.{digits}f}"
    return f"max={stats['max'] * scale:,.{digits}f}"


def _latency_cells(s: Mapping[str, Any]) -> dict[str, str]:
    ttft, tpot, e2e = s.get("ttft_s", {}), s.get("tpot_s", {}), s.get("e2e_s", {})
    return {"TTFT p50 ms": fmt_quantile(ttft, "p50", 1e3),
            "TTFT p90 ms": fmt_quantile(ttft, "p90", 1e3),
            "TTFT p99 ms": fmt_quantile(ttft, "p99", 1e3),
            "TPOT p50 ms": fmt_quantile(tpot, "p50", 1e3, 2),
            "TPOT p99 ms": fmt_quantile(tpot, "p99", 1e3, 2),
            "e2e p50 s": fmt_quantile(e2e, "p50", 1.0, 2),
            "e2e p99 s": fmt_quantile(e2e, "p99", 1.0, 2)}


def _group_row(name: str, s: Mapping[str, Any], **first: Any) -> dict[str, Any]:
    return ({"": name} | first | {"requests": s.get("finished", 0)} | _latency_cells(s)
            | {"share": f"{100 * s.get('share', 0.0):.1f}%",
               "preemptions": s.get("preemptions", 0), "rejected": s.get("rejected", 0)})


def _sim_per_wall(summary: Mapping[str, Any], extra: Mapping[str, Any]) -> float | None:
    if extra.get("sim_s_per_wall_s") is not None:
        return float(extra["sim_s_per_wall_s"])
    wall_s = extra.get("wall_s")
    if wall_s:
        return max(summary["duration_s"], summary.get("end_s", 0.0)) / float(wall_s)
    return None


def render_markdown(summary: Mapping[str, Any], meta: Mapping[str, str], title: str,
                    extra_meta: Mapping[str, Any], pngs: Sequence[str] = ()) -> str:
    """The whole `simulate.md` (see write_report)."""
    pool = summary["pool"]
    setup = [{"setting": "simulated duration s", "value": _plain(summary["duration_s"])},
             {"setting": "last event s", "value": _plain(summary.get("end_s"))},
             {"setting": "share window s", "value": _plain(summary["window_s"])},
             {"setting": "tiers", "value": ", ".join(summary["tiers"])},
             {"setting": "tenants", "value": summary["tenants"]},
             {"setting": "detail tenants", "value": len(summary["detail_tenants"])}]
    setup += [{"setting": str(k), "value": _plain(v)} for k, v in extra_meta.items()]
    generated = pool.get("tokens_generated", 0.0)
    fleet = [{"metric": "throughput tokens/s", "value": pool.get("throughput_tok_s")},
             {"metric": "requests finished", "value": pool.get("finished", 0)},
             {"metric": "first tokens", "value": pool.get("first_tokens", 0)},
             {"metric": "rejected", "value": pool.get("rejected", 0)},
             {"metric": "preemptions", "value": pool.get("preemptions", 0)},
             {"metric": "recomputed tokens", "value": pool.get("recomputed_tokens", 0)},
             {"metric": "recomputed ÷ generated",
              "value": f"{100 * pool.get('recomputed_tokens', 0) / generated:.2f}%"
              if generated else None},
             {"metric": "output tokens (finished requests)",
              "value": pool.get("output_tokens", 0)},
             {"metric": "sim seconds per wall second",
              "value": _sim_per_wall(summary, extra_meta)}]
    res = summary["histogram"]
    how = textwrap.fill(HOW_TO_READ.format(
        tier_pct=round(100 * (res["tier_growth"] - 1), 2),
        tenant_pct=round(100 * (res["tenant_growth"] - 1), 2)), width=88)
    parts = [_header(title, meta, how).rstrip() + "\n", "## Setup\n", compare_table(setup),
             "## Fleet\n", compare_table(fleet)]
    rows = [_group_row(t, s, tenants=s.get("tenants", 0))
            for t, s in summary["by_tier"].items()]
    rows.append(_group_row("**all**", pool, tenants=pool.get("tenants", 0)))
    parts += ["## Per tier\n", compare_table(rows)]
    if summary.get("pools"):
        parts += ["## Per pool\n",
                  "Each pool its own dispatcher, workers and tenants (`--pools`); "
                  "the tables above merge them. *wall s* / *cpu s*: its process's.\n",
                  compare_table([_pool_row(r) for r in summary["pools"]])]
    rejected = {t: s.get("rejected_by_code", {}) for t, s in summary["by_tier"].items()}
    codes = sorted({c for by in rejected.values() for c in by})
    if codes:
        parts += ["Rejections by code:\n",
                  compare_table([{"tier": t} | {c: by.get(c, 0) for c in codes}
                                 for t, by in rejected.items()])]
    if summary["detail_tenants"]:
        rows = [_group_row(n, s, tier=s.get("tier")) for n, s in summary["detail_tenants"].items()]
        parts += ["## Detail tenants\n",
                  "Per-tenant histograms (5 % buckets) for these tenants only: the ones named "
                  "up front, then the busiest first seen.\n", compare_table(rows)]
    if summary.get("top_tenants"):
        rows = [{"tenant": r["tenant"], "tier": r["tier"], "requests": r["finished"],
                 "TTFT mean ms": _ms(r.get("ttft_s_mean")), "TTFT max ms": _ms(r.get("ttft_s_max")),
                 "e2e mean s": r.get("e2e_s_mean"), "e2e max s": r.get("e2e_s_max"),
                 "tokens": round(r.get("tokens_generated", 0.0)),
                 "preemptions": r["preemptions"], "rejected": r["rejected"]}
                for r in summary["top_tenants"]]
        parts += ["## Busiest tenants\n",
                  "By finished requests, over all tenants (mean and max only: every tenant "
                  "keeps count, sum and max, not a histogram).\n", compare_table(rows)]
    if pngs:
        parts += ["## Plots\n"] + [f"![{Path(p).stem}]({Path(p).name})\n" for p in pngs]
    return "\n".join(parts).rstrip() + "\n"


def _pool_row(r: Mapping[str, Any]) -> dict[str, Any]:
    row = {"pool": r["pool"], "workers": r["workers"], "tenants": r["tenants"],
           "requests": r["finished"], "TTFT p50 ms": _round(_ms(r.get("ttft_p50_s"))),
           "TTFT p99 ms": _round(_ms(r.get("ttft_p99_s"))),
           "tokens/s": round(r["throughput_tok_s"]), "preemptions": r["preemptions"],
           "rejected": r["rejected"]}
    if r.get("dispatcher_core_pct_of_a_core") is not None:
        row["dispatcher core, % of a core"] = r["dispatcher_core_pct_of_a_core"]
    return row | {"wall s": r["wall_s"], "cpu s": r["cpu_s"], "peak RSS MiB": r["peak_rss_mib"]}


def _plain(v: Any) -> Any:
    """Whole floats as ints (3600.0 -> 3,600), other non-numbers as text."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v if isinstance(v, (int, float)) or v is None else str(v)


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1e3


def _round(v: float | None, digits: int = 1) -> float | None:
    return None if v is None else round(v, digits)


def _jsonable(x: Any) -> Any:
    """JSON has no NaN or inf: they become null."""
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def write_report(summary: Mapping[str, Any], out_dir: Path, *, title: str = "fairlane simulate",
                 command: str | None = None, extra_meta: Mapping[str, Any] | None = None,
                 plots: bool = True) -> list[Path]:
    """Write simulate.md, simulate.json ({"meta": ..., "summary": ...}) and, with
    `plots`, shares.png, ttft_cdf.png and queue_depth.png into `out_dir`. The markdown
    and JSON are written before the plots, so a missing matplotlib (a RuntimeError)
    still leaves them. Returns the paths written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    extra = dict(extra_meta or {})
    meta = run_meta(command)
    pngs = [out_dir / n for n in PLOTS] if plots else []
    md = out_dir / "simulate.md"
    md.write_text(render_markdown(summary, meta, title, extra, [p.name for p in pngs]),
                  encoding="utf-8")
    js = out_dir / "simulate.json"
    js.write_text(json.dumps(_jsonable({"meta": meta | {"title": title} | extra,
                                        "summary": summary}), allow_nan=False) + "\n",
                  encoding="utf-8")
    written = [md, js]
    if plots:
        written += plot_all(summary, out_dir)
    return written


# --- plots ------------------------------------------------------------------------------

PLOTS = ("shares.png", "ttft_cdf.png", "queue_depth.png")
MAX_TENANT_LINES = 10  # more lines than this make a plot unreadable


def _figure(rows: int, height_in: float) -> Any:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise RuntimeError("the simulate plots need matplotlib: pip install 'fairlane[sim]' "
                           "(or write the report with plots=False)") from exc
    # A Figure on its own Agg canvas, not pyplot: no global backend switch, no GUI,
    # nothing left open between reports.
    fig = Figure(figsize=(10, height_in * rows), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]


def _time_axis(summary: Mapping[str, Any], t_s: Sequence[float]) -> tuple[list[float], str]:
    """Minutes for runs of 10 minutes or more, else seconds."""
    if max(summary["duration_s"], summary.get("end_s", 0.0)) >= 600:
        return [t / 60 for t in t_s], "simulated time (min)"
    return list(t_s), "simulated time (s)"


def plot_all(summary: Mapping[str, Any], out_dir: Path) -> list[Path]:
    """shares.png, ttft_cdf.png, queue_depth.png in `out_dir`."""
    out_dir = Path(out_dir)
    return [_plot_shares(summary, out_dir / PLOTS[0]),
            _plot_ttft_cdf(summary, out_dir / PLOTS[1]),
            _plot_queue_depth(summary, out_dir / PLOTS[2])]


def _plot_shares(summary: Mapping[str, Any], path: Path) -> Path:
    win = summary["windows"]
    tenants = win.get("share_by_tenant", {})
    lines = 0 < len(tenants) <= MAX_TENANT_LINES
    fig, axes = _figure(3 if lines else 2, 2.6)
    mid = [s + summary["window_s"] / 2 for s in win["start_s"]]
    x, xlabel = _time_axis(summary, mid)
    tiers = list(win["share_by_tier"])
    if x:
        axes[0].stackplot(x, [win["share_by_tier"][t] for t in tiers], labels=tiers, alpha=0.85)
    axes[0].set(ylabel="share of tokens", ylim=(0, 1),
                title=f"share of generated tokens per tier, {summary['window_s']:g} s windows")
    axes[0].legend(loc="upper right", fontsize="small")
    if lines:
        for name, share in tenants.items():
            axes[1].plot(x, share, label=name)
        axes[1].set(ylabel="share of tokens", title="detail tenants")
        axes[1].legend(loc="upper right", fontsize="small", ncol=2)
    axes[-1].plot(x, win["throughput_tok_s"], color="black")
    axes[-1].set(ylabel="tokens/s", xlabel=xlabel, title="fleet throughput")
    fig.savefig(path, dpi=100)
    return path


def _cdf(sparse: Mapping[str, list[int]], stats: Mapping[str, Any],
         h: Mapping[str, float]) -> tuple[list[float], list[float]]:
    """(upper edge in ms, fraction of samples at or below it) per non-empty bucket of a
    `LogHist.sparse` histogram; the outer buckets end at the row's min / max."""
    n = sum(sparse["count"])
    if not n:
        return [], []
    lo_s, hi_s = h["lo_s"], h["hi_s"]
    nb = math.ceil(math.log(hi_s / lo_s) / math.log(h["growth"]))
    xs, ps, cum = [], [], 0
    first = sparse["index"][0]
    start = stats.get("min") or lo_s
    xs.append(1e3 * (start if first == 0 else lo_s * h["growth"] ** (first - 1)))
    ps.append(0.0)
    for i, c in zip(sparse["index"], sparse["count"], strict=True):
        cum += c
        edge = lo_s if i == 0 else (stats.get("max") or hi_s) if i > nb else lo_s * h["growth"] ** i
        xs.append(1e3 * edge)
        ps.append(cum / n)
    return xs, ps


def _plot_ttft_cdf(summary: Mapping[str, Any], path: Path) -> Path:
    fig, axes = _figure(1, 4.5)
    ax = axes[0]
    hist = summary["histograms"]["ttft_s"]
    res = summary["histogram"]
    for tier, sparse in hist["tiers"].items():
        stats = summary["by_tier"][tier]["ttft_s"]
        x, p = _cdf(sparse, stats, {**res, "growth": res["tier_growth"]})
        if x:
            ax.plot(x, p, lw=2, label=f"{tier} (n={stats['n']:,})")
    tenants = hist["tenants"]
    if len(tenants) <= MAX_TENANT_LINES:
        for name, sparse in tenants.items():
            stats = summary["detail_tenants"][name]["ttft_s"]
            x, p = _cdf(sparse, stats, {**res, "growth": res["tenant_growth"]})
            if x:
                ax.plot(x, p, lw=1, ls="--", label=f"{name} (n={stats['n']:,})")
    ax.set(xscale="log", xlabel="TTFT (ms)", ylabel="fraction of requests", ylim=(0, 1.01),
           title="TTFT CDF per tier" + (" and detail tenant" if 0 < len(tenants) <= MAX_TENANT_LINES else ""))
    ax.grid(True, which="both", alpha=0.3)
    if ax.lines:
        ax.legend(loc="lower right", fontsize="small")
    fig.savefig(path, dpi=100)
    return path


def _plot_queue_depth(summary: Mapping[str, Any], path: Path) -> Path:
    fig, axes = _figure(2, 2.8)
    s = summary["samples"]
    x, xlabel = _time_axis(summary, s["t_s"])
    for tier, depth in s["queued_by_tier"].items():
        axes[0].plot(x, depth, label=tier)
    axes[0].set(ylabel="queued requests",
                title=f"queue depth per tier (mean per {s.get('bucket_s', 0):g} s)")
    if axes[0].lines:
        axes[0].legend(loc="upper right", fontsize="small")
    axes[1].plot(x, s["running"], label="running requests")
    axes[1].set(ylabel="running requests", xlabel=xlabel, title="running and busy workers")
    busy = axes[1].twinx()
    busy.plot(x, s["busy_workers"], color="tab:red", label="busy workers")
    busy.set_ylabel("busy workers")
    axes[1].legend(handles=axes[1].lines + busy.lines, loc="upper right", fontsize="small")
    fig.savefig(path, dpi=100)
    return path
