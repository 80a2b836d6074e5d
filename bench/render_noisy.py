"""The fairness figures of bench/noisy_neighbor.py (BENCHMARKS.md section 2): its results
markdown, BENCHMARKS.md's tables and Summary rows, from the JSON the bench writes
({"meta", "data": {"setup", "calibration", "records": [RunRecord, ...], "notes",
"wall_s", "args"}}). Pure: no fleet, no clock; the bench's own markdown is rendered by
the same functions.

Each (policy, repetition) record holds, per length profile ("long": 128–384 output
tokens, the headline; "short": 8–24, the extra row), two scenarios' raw numbers:

- `weighted`: tenants of weights 1:2:4, all backlogged (closed loop); completion tokens
  streamed to the client inside the window, per tenant.
- `asymmetric`: 4 tenants of equal weight, one (heavy) offering 10× the request rate of
  each other (open-loop Poisson arrivals, same seed for every policy of a repetition),
  in all well above capacity; per tenant the tokens streamed in the window and its
  demand (`fluid_tokens` of its arrivals), and the light tenants' TTFTs.

Figures are computed here, per record, then summarised over repetitions as the median
(min–max) (bench.harness.summarize). The asymmetric scenario is judged against the
max–min fair allocation (water-filling) of the throughput the fleet delivered in that
window over the tenants' demands: light tenants are owed their whole demand, the heavy
one the rest. x_i = throughput_i ÷ owed_i; Jain's index over x_i is 1 only when every
tenant gets what max–min fairness owes it, so fifo (service in arrival order, i.e. in
proportion to the offered rates) scores visibly below 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

from bench.common import quantile
from bench.harness import (
    MIN_P99_SAMPLES,
    RunRecord,
    Summary,
    by_variant,
    fmt_num,
    ratio,
    summarize,
    verdict,
)
from bench.render_common import (
    RenderError,
    Results,
    measured_records,
    one_stem,
    row_source,
    sources_line,
    table,
)

STEM = "noisy_neighbor"
LONG, SHORT = "long", "short"
WEIGHTED, ASYM = "weighted", "asymmetric"
TARGET_SHARE_ERR = 0.03  # max relative error of a 1:2:4 share (the doc's ±3%)
TARGET_JAIN = 0.99
TARGET_THROUGHPUT = 0.97  # policy ÷ fifo, same repetition
CHECKED = "drr"  # the policy the targets are checked against
BASE = "fifo"  # the throughput reference


# --- fairness arithmetic ---------------------------------------------------------------------


def jain(xs: Iterable[float]) -> float:
    """Jain's index (Σx)² / (n Σx²): 1 when all equal, 1/n when one gets everything."""
    xs = list(xs)
    sq = sum(x * x for x in xs)
    return sum(xs) ** 2 / (len(xs) * sq) if xs and sq > 0 else math.nan


def max_min_fair(demand: Mapping[str, float], capacity: float,
                 weights: Mapping[str, float] | None = None) -> dict[str, float]:
    """Weighted max–min fair allocation of `capacity` (water-filling): a tenant whose
    demand is below its weighted level gets its demand, the others split what is left
    by weight. With more capacity than demand, everyone gets their demand."""
    w = {k: (weights or {}).get(k, 1.0) for k in demand}
    out: dict[str, float] = {}
    left, cap = dict(demand), float(capacity)
    while left:
        level = cap / sum(w[k] for k in left)
        sated = [k for k, d in left.items() if d <= level * w[k]]
        if not sated:
            out.update({k: level * w[k] for k in left})
            break
        for k in sated:
            out[k] = left.pop(k)
            cap -= out[k]
    return out


def fluid_tokens(arrival_s: float, n_out: int, token_s: float, w0: float, w1: float) -> float:
    """The tokens a request would stream inside [w0, w1) if it started on arrival and
    streamed at `token_s` seconds per token (the fleet's per-sequence pace, calibrated):
    a tenant's demand in the window, without the noise of counting whole requests at
    the window's edges (a request arriving just before w1 streams mostly after it)."""
    dur = n_out * token_s
    if dur <= 0:
        return float(n_out) if w0 <= arrival_s < w1 else 0.0
    overlap = min(arrival_s + dur, w1) - max(arrival_s, w0)
    return n_out * max(0.0, overlap) / dur


def rel_errors(actual: Mapping[str, float], target: Mapping[str, float]) -> dict[str, float]:
    """|actual − target| ÷ target per key."""
    return {k: abs(actual[k] - t) / t if t else math.nan for k, t in target.items()}


# --- per record ------------------------------------------------------------------------------


def weighted_figures(w: dict) -> dict:
    """One window of the 1:2:4 scenario: shares of the completion tokens, their targets
    (weight ÷ Σweights), the largest relative error and the tokens/s."""
    tokens, weights = w["tokens"], w["weights"]
    total = sum(tokens.values())
    if total <= 0:
        raise RenderError("a weighted window streamed no tokens")
    wsum = sum(weights.values())
    shares = {k: tokens[k] / total for k in weights}
    target = {k: v / wsum for k, v in weights.items()}
    return {"shares": shares, "target": target,
            "max_rel_err": max(rel_errors(shares, target).values()),
            "tok_per_s": total / w["window_s"]}


def asym_figures(a: dict) -> dict:
    """One window of the asymmetric scenario: per tenant throughput and demand (tokens/s),
    the max–min fair allocation of the delivered total, x_i, Jain's index, the largest
    relative error; the light tenants' TTFTs (pooled over the three)."""
    span = a["window_s"]
    tput = {k: v / span for k, v in a["tokens"].items()}
    demand = {k: v / span for k, v in a["demand_tokens"].items()}
    total = sum(tput.values())
    if total <= 0:
        raise RenderError("an asymmetric window streamed no tokens")
    owed = max_min_fair(demand, total)
    x = {k: tput[k] / owed[k] if owed[k] else math.nan for k in owed}
    return {"tput": tput, "demand": demand, "owed": owed, "x": x,
            "jain": jain(x.values()), "max_rel_err": max(abs(v - 1) for v in x.values()),
            "tok_per_s": total, "heavy": a["heavy"],
            "light_ttft_ms": list(a.get("light_ttft_ms", [])),
            "light_censored": int(a.get("light_censored", 0))}


# --- over repetitions ------------------------------------------------------------------------


def policies_in(records: list[RunRecord]) -> list[str]:
    """Policies with a successful run, in their first run's order."""
    return list(by_variant(sorted(records, key=lambda r: r.position)))


def profiles_in(records: list[RunRecord]) -> list[str]:
    seen = {p for r in records if r.error is None for p in r.metrics.get("profiles", {})}
    return [p for p in (LONG, SHORT) if p in seen]


def _scenario(r: RunRecord, profile: str, scen: str) -> dict | None:
    return r.metrics.get("profiles", {}).get(profile, {}).get(scen)


def per_rep(records: list[RunRecord], policy: str, profile: str, scen: str,
            fn: Callable[[dict], object]) -> dict[int, object]:
    """rep -> fn(the scenario's raw numbers), for the policy's successful records."""
    fig = weighted_figures if scen == WEIGHTED else asym_figures
    out = {}
    for r in by_variant(records).get(policy, []):
        raw = _scenario(r, profile, scen)
        if raw is not None:
            out[r.rep] = fn(fig(raw))
    return out


def vs_base(records: list[RunRecord], policy: str, profile: str, scen: str) -> list[float]:
    """tokens/s of `policy` ÷ fifo's in the same repetition, for the reps with both."""
    mine = per_rep(records, policy, profile, scen, lambda f: f["tok_per_s"])
    base = per_rep(records, BASE, profile, scen, lambda f: f["tok_per_s"])
    return [ratio(mine[k], base[k]) for k in sorted(mine) if k in base]


def summ(records: list[RunRecord], policy: str, profile: str, scen: str,
         fn: Callable[[dict], float]) -> Summary:
    return summarize(per_rep(records, policy, profile, scen, fn).values())


def ttft_cells(records: list[RunRecord], policy: str, profile: str) -> tuple[str, str]:
    """Light tenants' TTFT p50 and tail, median (min–max) over repetitions. The tail is
    a p99 when every repetition has >= 200 samples, else every repetition's max
    ("max="); "≥" when some request had no first token by the cut-off (its TTFT
    counted as the cut-off: a lower bound)."""
    reps = per_rep(records, policy, profile, ASYM,
                   lambda f: (f["light_ttft_ms"], f["light_censored"]))
    samples = [s for s, _ in reps.values() if s]
    if not samples:
        return "n/a", "n/a"
    ge = "≥ " if any(c for _, c in reps.values()) else ""
    p50 = summarize(quantile(s, 0.5) for s in samples)
    if all(len(s) >= MIN_P99_SAMPLES for s in samples):
        tail = summarize(quantile(s, 0.99) for s in samples)
        tail_txt = _fmt(tail, 0)
    else:
        tail_txt = "max=" + _fmt(summarize(max(s) for s in samples), 0)
    return ge + _fmt(p50, 0), ge + tail_txt


def _fmt(s: Summary, digits: int, unit: str = "", scale: float = 1.0) -> str:
    return Summary(s.median * scale, s.lo * scale, s.hi * scale, s.n).fmt(digits, unit)


def _pct(s: Summary) -> str:
    return _fmt(s, 1, "%", 100.0)


def _verdict(value: float, target: float, *, higher_is_better: bool = False) -> str:
    v = verdict(value, target, higher_is_better=higher_is_better)
    return f"**{v}**" if v == "missed" else v


# --- tables ----------------------------------------------------------------------------------


def lengths_text(setup: dict, profile: str) -> str:
    p = setup["profiles"][profile]
    return f"{p['out_min']}–{p['out_max']} tokens (mean {(p['out_min'] + p['out_max']) / 2:g})"


def profile_label(setup: dict, profile: str) -> str:
    """A table row's lengths cell: the short-request rows are marked as the extra row."""
    label = lengths_text(setup, profile)
    return label if profile == LONG else f"short (extra row): {label}"


def setup_text(data: dict) -> str:
    s, cal = data["setup"], data.get("calibration", {})
    asym = s["asymmetric"]
    lines = [
        f"Fleet per (policy, repetition): a fresh dispatcher (tenants file, cost model "
        f"`tokens`, DRR quantum {s['quantum']:g}, preemption: {s['preemption']}) and "
        f"{s['workers']} simulated workers × `max_num_seqs` {s['max_num_seqs']} (prefetch "
        f"{s['prefetch_seqs']}) = {s['slots']} slots, step model `{s['step_model']}`, time "
        f"scale {s['time_scale']:g}; {s['prompt_tokens']} prompt tokens; policies run "
        f"interleaved, order reversed every other repetition, {s['reps']} repetition"
        f"{'s' if s['reps'] != 1 else ''}.",
        f"**1:2:4**: tenants of weights {' : '.join(f'{v:g}' for v in s['weights'].values())}, "
        f"{s['outstanding']} closed-loop requests each (every tenant backlogged); "
        f"{s['warmup_s']['weighted']:g} s warm-up, then a {s['window_s']['weighted']:g} s "
        "window of completion tokens streamed to the client (timestamped per chunk).",
        f"**Asymmetric**: 4 tenants of equal weight; each light one offers "
        f"{asym['light_share_frac']:g} of an equal share of the measured capacity, the heavy "
        f"one {asym['heavy_factor']:g}× that (Poisson arrivals, one seed per repetition, "
        f"the same for every policy): {asym['offered_over_capacity']:.2f}× capacity in "
        f"all. {s['warmup_s']['asymmetric']:g} s warm-up, {s['window_s']['asymmetric']:g} s "
        "window. Owed = the max–min fair split (water-filling) of the tokens/s the fleet "
        "delivered over each tenant's demand (the tokens its arrivals would stream inside "
        "the window if each started on arrival at the fleet's calibrated per-sequence "
        "pace): light tenants are owed their demand, the heavy one the rest; x = "
        "throughput ÷ owed, Jain's index over the four x. Light TTFT: submit → first "
        "chunk, the three light tenants' requests of the window pooled.",
    ]
    for prof, c in cal.items():
        lines.append(f"Capacity with outputs of {lengths_text(s, prof)}: {fmt_num(c['tok_per_s'], 0)} "
                     f"tokens/s = {fmt_num(c['req_per_s'], 1)} requests/s, measured once "
                     f"before the repetitions ({c['policy']}, closed loop, "
                     f"{c['window_s']:.0f} s; {c['token_s'] * 1000:.1f} ms per token per "
                     "sequence); offered: "
                     + ", ".join(f"{k} {v:.2f}/s" for k, v in c["offered_req_per_s"].items())
                     + ".")
    return "\n\n".join(lines)


def weighted_table(data: dict) -> str:
    records = measured_records(data, STEM)
    weights = data["setup"]["weights"]
    wsum = sum(weights.values())
    header = ["policy", "output lengths",
              *(f"{k} share (target {v / wsum:.3f})" for k, v in weights.items()),
              "max rel. error", "tokens/s", "÷ fifo (same rep)", "reps"]
    rows = []
    for prof in profiles_in(records):
        for pol in policies_in(records):
            n = summ(records, pol, prof, WEIGHTED, lambda f: f["max_rel_err"]).n
            if n == 0:
                continue
            shares = [_fmt(summ(records, pol, prof, WEIGHTED,
                                lambda f, k=k: f["shares"][k]), 3) for k in weights]
            err = _pct(summ(records, pol, prof, WEIGHTED, lambda f: f["max_rel_err"]))
            rows.append([pol, profile_label(data["setup"], prof), *shares,
                         f"**{err}**" if pol == CHECKED and prof == LONG else err,
                         _fmt(summ(records, pol, prof, WEIGHTED, lambda f: f["tok_per_s"]), 0),
                         _fmt(summarize(vs_base(records, pol, prof, WEIGHTED)), 3), n])
    return table(header, "ll" + "r" * (len(header) - 2), rows)


def asym_table(data: dict) -> str:
    records = measured_records(data, STEM)
    header = ["policy", "output lengths", "heavy tok/s (owed)", "light tok/s each (demand)",
              "x heavy", "x light (lowest)", "Jain's index", "max rel. error",
              "light TTFT p50 ms", "light TTFT p99 ms", "tokens/s ÷ fifo", "reps"]
    rows = []
    for prof in profiles_in(records):
        for pol in policies_in(records):
            def s(fn: Callable[[dict], float], p: str = pol, pr: str = prof) -> Summary:
                return summ(records, p, pr, ASYM, fn)

            jn = s(lambda f: f["jain"])
            if jn.n == 0:
                continue

            def light(f: dict) -> list[str]:
                return [k for k in f["x"] if k != f["heavy"]]

            heavy = (f"{_fmt(s(lambda f: f['tput'][f['heavy']]), 0)} "
                     f"({fmt_num(s(lambda f: f['owed'][f['heavy']]).median, 0)})")
            lt = (f"{_fmt(s(lambda f: _mean(f['tput'][k] for k in light(f))), 0)} "
                  f"({fmt_num(s(lambda f: _mean(f['demand'][k] for k in light(f))).median, 0)})")
            jtxt = _fmt(jn, 3)
            p50, tail = ttft_cells(records, pol, prof)
            rows.append([pol, profile_label(data["setup"], prof), heavy, lt,
                         _fmt(s(lambda f: f["x"][f["heavy"]]), 2),
                         _fmt(s(lambda f: min(f["x"][k] for k in light(f))), 2),
                         f"**{jtxt}**" if pol == CHECKED and prof == LONG else jtxt,
                         _pct(s(lambda f: f["max_rel_err"])), p50, tail,
                         _fmt(summarize(vs_base(records, pol, prof, ASYM)), 3), jn.n])
    return table(header, "ll" + "r" * (len(header) - 2), rows)


def _mean(xs: Iterable[float]) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else math.nan


def runs_table(data: dict) -> str:
    """Every (policy, repetition, profile) in run order: the raw figures behind the
    medians, with errors and preemptions."""
    rows = []
    for r in sorted(measured_records(data, STEM), key=lambda r: r.position):
        if r.error is not None:
            rows.append([r.position + 1, r.variant, r.rep, "—", f"failed: {r.error}",
                         "", "", "", "", "", ""])
            continue
        for prof, sc in r.metrics.get("profiles", {}).items():
            w, a = sc.get(WEIGHTED), sc.get(ASYM)
            wf = weighted_figures(w) if w else None
            af = asym_figures(a) if a else None
            rows.append([
                r.position + 1, r.variant, r.rep, prof,
                " / ".join(f"{v:.3f}" for v in wf["shares"].values()) if wf else "—",
                fmt_num(wf["tok_per_s"], 0) if wf else "—",
                " / ".join(f"{k} {v:.2f}" for k, v in af["x"].items()) if af else "—",
                f"{af['jain']:.3f}" if af else "—",
                f"{len(af['light_ttft_ms'])} ({af['light_censored']} cut off)" if af else "—",
                sum(len(x.get("errors", [])) for x in (w or {}, a or {})),
                "; ".join(f"{x.get('preemptions', 0)}" for x in (w or {}, a or {}))])
    header = ["#", "policy", "rep", "lengths", "1:2:4 shares", "1:2:4 tok/s",
              "asymmetric x", "Jain", "light TTFT samples", "errors",
              "preemptions (1:2:4; asym)"]
    return table(header, "rlrllrlrrrr", rows)


TITLE = "Fairness on the real fleet: weighted shares and asymmetric demand"
HOW_TO_READ = (
    "Each figure is the median (min–max) over the repetitions; every policy ran once per "
    "repetition, interleaved (order reversed every other repetition) on a fresh fleet. "
    "**1:2:4**: the share of the tokens each backlogged tenant streamed vs weight ÷ Σ"
    "weights. **Asymmetric**: one tenant offers 10× each other's rate, above capacity; "
    "x = throughput ÷ its max–min fair allocation; Jain's index over x is 1 only when "
    "each tenant gets what max–min fairness owes it (fifo serves in proportion to the "
    "offered rates, so it cannot score 1 here). ÷ fifo = tokens/s over fifo's in the "
    "same repetition. A TTFT tail is a p99 only from >= 200 samples per repetition, else "
    "max=; ≥ marks a lower bound (requests without a first token by the cut-off).")


def report(data: dict) -> str:
    """The results markdown's body (below bench.harness.results_header)."""
    notes = data.get("notes") or []
    parts = [setup_text(data), "## Weighted shares 1:2:4, every tenant backlogged",
             weighted_table(data),
             "## Asymmetric demand: one tenant offers 10× each other's rate",
             asym_table(data), "## Runs", runs_table(data), "## Notes",
             "\n".join(f"- {n}" for n in notes) if notes else "None: every run settled.",
             f"Wall time {fmt_num(data.get('wall_s', math.nan) / 60, 1)} min."]
    return "\n\n".join(parts)


# --- BENCHMARKS.md ---------------------------------------------------------------------------


def _data(res: Results, stem: str) -> dict:
    return res.load(stem).get("data", {})


def weighted_kind(res: Results, args: list[str], _old: str) -> str:
    """`<!-- generated: noisy-weighted STEM -->`: the setup and the 1:2:4 table."""
    stem = one_stem("noisy-weighted", args)
    data = _data(res, stem)
    return "\n\n".join([sources_line(res, [stem]), setup_text(data), weighted_table(data)])


def asym_kind(res: Results, args: list[str], _old: str) -> str:
    """`<!-- generated: noisy-asymmetric STEM -->`: the asymmetric-demand table."""
    stem = one_stem("noisy-asymmetric", args)
    return "\n\n".join([sources_line(res, [stem]), asym_table(_data(res, stem))])


def _others(records: list[RunRecord], fmt: Callable[[str], str]) -> str:
    return "; ".join(f"{p} {fmt(p)}" for p in policies_in(records) if p != CHECKED)


def _reps(records: list[RunRecord]) -> str:
    n = len({r.rep for r in records if r.error is None})
    return f"{n} interleaved rep{'s' if n != 1 else ''}"


def summary_shares(res: Results) -> list[str]:
    records = measured_records(_data(res, STEM), STEM, [CHECKED])

    def err(p: str) -> Summary:
        return summ(records, p, LONG, WEIGHTED, lambda f: f["max_rel_err"])

    return ["§2 weights 1:2:4, every tenant backlogged, 128–384-token outputs: largest "
            f"relative error of a tenant's token share ({CHECKED})",
            f"**{_pct(err(CHECKED))}** ({_reps(records)}); {_others(records, lambda p: _pct(err(p)))}",
            f"≤ {TARGET_SHARE_ERR:.0%} — {_verdict(err(CHECKED).median, TARGET_SHARE_ERR)}",
            row_source(res, STEM)]


def summary_jain(res: Results) -> list[str]:
    records = measured_records(_data(res, STEM), STEM, [CHECKED, BASE])

    def jn(p: str) -> Summary:
        return summ(records, p, LONG, ASYM, lambda f: f["jain"])

    return ["§2 asymmetric demand (one tenant offers 10× each of 3 others, above capacity), "
            f"128–384-token outputs: Jain's index over throughput ÷ max–min fair share ({CHECKED})",
            f"**{_fmt(jn(CHECKED), 3)}** ({_reps(records)}); "
            f"{_others(records, lambda p: _fmt(jn(p), 3))}",
            f"≥ {TARGET_JAIN:g} — {_verdict(jn(CHECKED).median, TARGET_JAIN, higher_is_better=True)}",
            row_source(res, STEM)]


def summary_throughput(res: Results) -> list[str]:
    records = measured_records(_data(res, STEM), STEM, [CHECKED, BASE])
    w = summarize(vs_base(records, CHECKED, LONG, WEIGHTED))
    a = summarize(vs_base(records, CHECKED, LONG, ASYM))
    vtc = ("; vtc 1:2:4 " + _fmt(summarize(vs_base(records, "vtc", LONG, WEIGHTED)), 3)
           if "vtc" in policies_in(records) else "")
    return [f"§2 throughput {CHECKED} ÷ fifo, same repetition, 128–384-token outputs: "
            "1:2:4 backlogged; asymmetric",
            f"1:2:4 **{_fmt(w, 3)}**, asymmetric {_fmt(a, 3)} ({_reps(records)}){vtc}",
            f"≥ {TARGET_THROUGHPUT:g} — "
            f"{_verdict(w.median, TARGET_THROUGHPUT, higher_is_better=True)}; "
            f"{_verdict(a.median, TARGET_THROUGHPUT, higher_is_better=True)}",
            row_source(res, STEM)]


KINDS = {"noisy-weighted": weighted_kind, "noisy-asymmetric": asym_kind}
SUMMARY_ROWS = {"noisy-shares": summary_shares, "noisy-jain": summary_jain,
                "noisy-throughput": summary_throughput}
