"""BENCHMARKS.md's preemption tables (section 6) and Summary rows, rendered from the JSON
bench/preemption.py writes, through the figures bench/preemption_report.py prints in the
results markdown (`probe_stats`, `backlog_stats`): the same numbers, not a second
computation of them."""

from __future__ import annotations

from argparse import Namespace

from bench.common import quantile
from bench.harness import RunRecord, by_variant, fmt_num, summarize, verdict
from bench.preemption_report import (
    TARGET_RATIO,
    TARGET_RECOMPUTED_PCT,
    TARGET_SHARE_ERR,
    TARGET_THROUGHPUT,
    backlog_stats,
    dry_tenants,
    light_floor_ratio,
    load_records,
    probe_stats,
    queue_depth_recorded,
)
from bench.render_common import (
    RenderError,
    Results,
    fmt_sig,
    fmt_sum,
    median,
    one_stem,
    row_source,
    sources_line,
    table,
)

PV = "drr+preempt"  # the variant the targets are checked against
ALONE = {"noisy": "alone_B", "light": "alone_L", "tier": "alone_E"}
ORDER = ("tier", "light", "noisy")


def _run(res: Results, stem: str) -> tuple[dict[str, list[RunRecord]], Namespace]:
    records, args = load_records(res.load(stem))
    return by_variant(records), args


def _stats(recs: dict[str, list[RunRecord]], scen: str) -> dict[str, dict]:
    if not any(scen in r.metrics for rs in recs.values() for r in rs):
        return {}
    return probe_stats(recs, scen, ALONE[scen])


def scenario_label(scen: str, args: Namespace) -> str:
    a = vars(args)
    burst, tier_burst = a.get("burst", 0), a.get("tier_burst", 0)
    if scen == "tier":
        return f"tier reclaim: enterprise E probes while free F's {tier_burst:,} burst fills the fleet"
    if scen == "light":
        lo, hi = (list(a.get("light_out") or []) + ["?", "?"])[:2]
        return f"light neighbour: L ({lo}–{hi}-token outputs) probes behind A's {burst:,} burst"
    interval = a.get("probe_interval_s", 0) * 1000
    return (f"noisy neighbour: B (one request every {interval:g} ms with A's lengths) "
            f"during A's {burst:,} burst")


def _ratio_txt(st: dict | None, unit: str = "×") -> str:
    """The tail ratio during ÷ alone: median (min–max) over repetitions, ≥ if censored."""
    if not st or not st["ratios"]:
        return "n/a"
    return ("≥ " if st["censored"] else "") + fmt_sum(st["ratios"], unit)


def _ratio_median(st: dict | None) -> str:
    if not st or not st["ratios"]:
        return "n/a"
    return ("≥ " if st["censored"] else "") + fmt_sig(median(st["ratios"]), "×")


def _tail(label: str, value: str) -> str:
    return value if label == "p99" else f"max={value}"


def _verdict(value: float, target: float, *, higher_is_better: bool = False) -> str:
    v = verdict(value, target, higher_is_better=higher_is_better)
    return f"**{v}**" if v == "missed" else v


# --- tables --------------------------------------------------------------------------------


def isolation_table(res: Results, args: list[str], _old: str) -> str:
    """`<!-- generated: preemption-isolation STEM SCENARIOS -->`: one row per scenario
    (light, tier, noisy; comma-separated) of drr+preemption, with drr's ratio beside."""
    if len(args) != 2:
        raise RenderError("preemption-isolation takes a results file and scenarios")
    stem, scenarios = args[0], [s for s in args[1].split(",") if s]
    recs, run_args = _run(res, stem)
    rows = []
    for scen in scenarios:
        if scen not in ALONE:
            raise RenderError(f"unknown preemption scenario {scen!r} (known: {sorted(ALONE)})")
        stats = _stats(recs, scen)
        st = stats.get(PV)
        if st is None:
            rows.append([scenario_label(scen, run_args)] + ["n/a"] * 5 + [f"≤ {TARGET_RATIO:g}"])
            continue
        cs = "≥ " if st["censored"] else ""
        ratio = summarize(st["ratios"]).median
        rows.append([
            scenario_label(scen, run_args),
            f"{fmt_sig(quantile(st['alone'], .5))} / "
            f"{_tail(st['alone_label'], fmt_sig(st['alone_tail']))}",
            cs + fmt_sum(st["p50s"]),
            _tail(st["label"], cs + fmt_sum(st["tails"])),
            f"**{_ratio_txt(st, '')}**",
            _ratio_txt(stats.get("drr"), ""),
            f"≤ {TARGET_RATIO:g} — {_verdict(ratio, TARGET_RATIO)}",
        ])
    header = ["row (drr+preemption)", "alone p50 / p99 ms", "during p50 ms", "during p99 ms",
              "**p99 during ÷ alone**", "drr (no preemption)", "target"]
    return sources_line(res, [stem]) + "\n\n" + table(header, "lrrrrrl", rows)


def targets_table(res: Results, args: list[str], _old: str) -> str:
    """`<!-- generated: preemption-targets STEM -->`: issue 10's targets checked against
    drr+preemption (probe scenarios, then the backlogged 1:2:4 phase)."""
    stem = one_stem("preemption-targets", args)
    recs, run_args = _run(res, stem)
    rows = []
    for scen in ORDER:
        stats = _stats(recs, scen)
        st = stats.get(PV)
        if st is None:
            continue
        others = [f"{v} {_ratio_median(stats.get(v))}" for v in ("drr", "fifo") if v in stats]
        rows.append([
            scenario_label(scen, run_args) + ", p99 during ÷ alone",
            f"**{_ratio_txt(st)}**; p50 {fmt_sig(median(st['p50s']))} ms vs "
            f"{fmt_sig(quantile(st['alone'], .5))} alone" + "".join(f"; {o}" for o in others),
            f"≤ {TARGET_RATIO:g}", _verdict(median(st["ratios"]), TARGET_RATIO)])
    back = backlog_stats(recs)
    b = back.get(PV)
    if b is not None:
        runs = [m for _, m in b["runs"]]
        rel_drr = back.get("drr", {}).get("rel", [])
        rows += [
            ["throughput with preemption ÷ fifo (backlogged 1:2:4)",
             f"**{fmt_sum(b['vs_fifo'], digits=3)}**", f"≥ {TARGET_THROUGHPUT:g}",
             _verdict(median(b["vs_fifo"]), TARGET_THROUGHPUT, higher_is_better=True)],
            ["recomputed tokens ÷ generated (backlogged)",
             f"**{fmt_sum([m['recomputed_pct'] for m in runs], '%', digits=2)}**, "
             f"{fmt_sig(median([m['preemptions_per_s'] for m in runs]), digits=2)} "
             "preemptions/s", f"≤ {TARGET_RECOMPUTED_PCT:g}%",
             _verdict(median([m["recomputed_pct"] for m in runs]), TARGET_RECOMPUTED_PCT)],
            ["1:2:4 weighted shares, max relative error, preemption on",
             fmt_sum([x * 100 for x in b["rel"]], "%", digits=1)
             + (f"; drr alone {fmt_sig(median(rel_drr) * 100, '%', digits=1)}" if rel_drr else ""),
             f"≤ {TARGET_SHARE_ERR * 100:g}%", _verdict(median(b["rel"]), TARGET_SHARE_ERR)],
        ]
    if not rows:
        raise RenderError(f"{stem}.json has no {PV} variant to check the targets on")
    header = ["claim (drr+preemption)", "measured", "target", "verdict"]
    return sources_line(res, [stem]) + "\n\n" + table(header, "llll", rows)


def shares_table(res: Results, args: list[str], _old: str) -> str:
    """`<!-- generated: preemption-shares STEM -->`: the backlogged 1:2:4 phase per
    variant: streamed-token shares and their largest relative error, the same error of
    DRR's dispatched cost, throughput ÷ fifo, preemptions and recomputed tokens."""
    stem = one_stem("preemption-shares", args)
    recs, run_args = _run(res, stem)
    back = backlog_stats(recs)
    if PV not in back:
        raise RenderError(f"{stem}.json has no backlogged phase for {PV}")
    rows = []
    for v, b in back.items():
        runs = [m for _, m in b["runs"]]
        dry = sorted({t for m in runs for t in dry_tenants(m)})
        rows.append([
            v, str(len(runs)),
            " / ".join(fmt_sum([m["shares"][k] for m in runs], digits=3) for k in ("w1", "w2", "w4")),
            f"**{fmt_sum([x * 100 for x in b['rel']], '%', digits=1)}**",
            fmt_sum([x * 100 for x in b["cost_rel"]], "%", digits=1),
            fmt_sum(b["vs_fifo"], digits=3) if v != "fifo" else "1",
            fmt_sum([m["preemptions_per_s"] for m in runs], digits=2),
            fmt_sum([m["recomputed_pct"] for m in runs], "%", digits=2),
            ("ran dry: " + ", ".join(dry)) if dry else
            ("yes" if queue_depth_recorded(runs) else "not recorded"),
        ])
    header = ["variant", "reps", "w1 / w2 / w4 token shares", "**max rel. error**",
              "dispatched-cost error (drr: the scheduler's split)", "tok/s ÷ fifo", "preemptions/s", "recomputed",
              "all backlogged"]
    window = vars(run_args).get("window_s", 0)
    return (sources_line(res, [stem]) + f"\n\n{window:g} s window; targets 0.143 / 0.286 / "
            "0.571.\n\n" + table(header, "lrrrrrrrl", rows))


# --- Summary rows --------------------------------------------------------------------------

ISOLATION, FULL = "preemption_isolation", "preemption"


def _isolation_row(res: Results, scen: str, claim: str,
                   stem: str = ISOLATION) -> tuple[list[str], list[str]]:
    recs, run_args = _run(res, stem)
    stats = _stats(recs, scen)
    st = stats.get(PV)
    if st is None:
        raise RenderError(f"{stem}.json has no {scen} scenario for {PV}")
    n = sorted(set(st["n_samples"]))
    per_rep = f"{n[0]}" if len(n) == 1 else f"{n[0]}–{n[-1]}"
    measured = (f"**{_ratio_txt(st)}** (drr {_ratio_median(stats.get('drr'))}), "
                f"{len(st['ratios'])} interleaved reps, {per_rep} probes per rep")
    if scen == "light":  # the estimate's premise: the prober alone finds an idle engine
        predicted = light_floor_ratio(st["alone"], st["alone_tail"],
                                      vars(run_args).get("max_num_seqs", 32))
        measured += f"; what batching alone predicts, any scheduler: {fmt_sig(predicted, '×')}"
    target = f"≤ {TARGET_RATIO:g}× — {verdict(median(st['ratios']), TARGET_RATIO)}"
    return [claim, measured, target], [stem]


def summary_isolation_tier(res: Results) -> list[str]:
    row, _ = _isolation_row(res, "tier", "§6 realistic lengths, tier reclaim: enterprise p99 "
                            "during a free-tier burst ÷ alone, drr+preemption (drr)")
    return row + [row_source(res, ISOLATION)]


def summary_isolation_light(res: Results) -> list[str]:
    _, args = _run(res, ISOLATION)
    lo, hi = (list(vars(args).get("light_out") or []) + ["?", "?"])[:2]
    row, _ = _isolation_row(res, "light", f"§6 light neighbour ({lo}–{hi}-token probes) behind "
                            f"a {vars(args).get('burst', 0):,} burst, drr+preemption (drr)")
    noisy = _stats(_run(res, FULL)[0], "noisy")
    if PV in noisy:
        row[1] += (f"; B probing at its whole share ({FULL}.json): {_ratio_median(noisy[PV])}"
                   f" (drr {_ratio_median(noisy.get('drr'))})")
    return row + [row_source(res, ISOLATION) + ", " + row_source(res, FULL)]


def summary_full_tier(res: Results) -> list[str]:
    """The tier-reclaim row from the full three-variant run (`preemption.json`)."""
    row, _ = _isolation_row(res, "tier", "§6 realistic lengths, tier reclaim: enterprise p99 "
                            "during a free-tier burst ÷ alone, drr+preemption (drr)", FULL)
    return row + [row_source(res, FULL)]


def summary_full_light(res: Results) -> list[str]:
    """The light-neighbour row (and B's) from the full run (`preemption.json`)."""
    _, args = _run(res, FULL)
    lo, hi = (list(vars(args).get("light_out") or []) + ["?", "?"])[:2]
    row, _ = _isolation_row(res, "light", f"§6 light neighbour ({lo}–{hi}-token probes) behind "
                            f"a {vars(args).get('burst', 0):,} burst, drr+preemption (drr)", FULL)
    noisy = _stats(_run(res, FULL)[0], "noisy")
    if PV in noisy:
        row[1] += (f"; B probing at its whole share: {_ratio_median(noisy[PV])}"
                   f" (drr {_ratio_median(noisy.get('drr'))})")
    return row + [row_source(res, FULL)]


def summary_backlogged(res: Results) -> list[str]:
    recs, _ = _run(res, FULL)
    b = backlog_stats(recs).get(PV)
    if b is None:
        raise RenderError(f"{FULL}.json has no backlogged phase for {PV}")
    runs = [m for _, m in b["runs"]]
    thr, rec, rel = (median(b["vs_fifo"]), median([m["recomputed_pct"] for m in runs]),
                     median(b["rel"]))
    return ["§6 throughput drr+preemption ÷ fifo; recomputed ÷ generated; 1:2:4 shares",
            f"{fmt_num(thr, 3)}; {fmt_num(rec, 2)}%; {fmt_num(rel * 100, 1)}%",
            f"≥ {TARGET_THROUGHPUT:g} {verdict(thr, TARGET_THROUGHPUT, higher_is_better=True)}; "
            f"≤ {TARGET_RECOMPUTED_PCT:g}% {verdict(rec, TARGET_RECOMPUTED_PCT)}; "
            f"≤ {TARGET_SHARE_ERR * 100:g}% {verdict(rel, TARGET_SHARE_ERR)}",
            row_source(res, FULL)]


SHARES = "preemption_shares"


def summary_shares(res: Results) -> list[str]:
    """The 1:2:4 shares target from the backlogged phase's own run
    (`preemption_shares.json`: a fresh fleet per repetition, nothing before it)."""
    recs, run_args = _run(res, SHARES)
    back = backlog_stats(recs)
    b = back.get(PV)
    if b is None:
        raise RenderError(f"{SHARES}.json has no backlogged phase for {PV}")
    rel = median(b["rel"])
    drr = back.get("drr", {})
    return [f"§6 1:2:4 weighted shares with preemption on, all backlogged, own run "
            f"({len(b['rel'])} interleaved reps, {vars(run_args).get('window_s', 0):g} s "
            "window): largest relative error of a tenant's streamed-token share (drr alone)",
            f"**{fmt_sum([x * 100 for x in b['rel']], '%', digits=1)}**"
            + (f" (drr {fmt_sum([x * 100 for x in drr['rel']], '%', digits=1)})"
               if drr.get("rel") else "")
            # drr's: with preemption a continuation is charged again at its dispatch.
            + (f"; drr's dispatched cost: {fmt_sum([x * 100 for x in drr['cost_rel']], '%', digits=1)}"
               if drr.get("cost_rel") else ""),
            f"≤ {TARGET_SHARE_ERR * 100:g}% — {verdict(rel, TARGET_SHARE_ERR)}",
            row_source(res, SHARES)]


KINDS = {"preemption-isolation": isolation_table, "preemption-targets": targets_table,
         "preemption-shares": shares_table}
SUMMARY_ROWS = {"isolation-tier": summary_isolation_tier,
                "isolation-light": summary_isolation_light,
                "full-tier": summary_full_tier, "full-light": summary_full_light,
                "preemption-backlogged": summary_backlogged,
                "preemption-shares": summary_shares}
