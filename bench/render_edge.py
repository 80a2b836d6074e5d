"""The edge and the broker's cost: BENCHMARKS.md §4 (the streamer) and §8 (a 3-node NATS
cluster ÷ one node), their tables and Summary rows, and the results markdown's body of
bench/bench_streamer.py and bench/bench_cluster.py, all from the JSON those write:
{"meta", "data": {"setup": {...}, "warmup": [RunRecord, ...], "records": [RunRecord,
...]}} (bench.harness.RunRecord as a dict).

- streamer: variants "raw" (core-NATS subscribers, no streamer) and "streamer" (websocket
  clients through it); metrics {"throughput": {"tokens", "wall_s", "tokens_per_s",
  "streamer_cpu"}, "latency": {"chunks", "lat_ms": [publish → client, one per token]}}.
- cluster: variants "1-node" and "3-node" (R3 streams); metrics {"size", "req_per_s",
  "load_requests", "load_wall_s", "ttft_ms": [one per light-load request]}.

Per-repetition figures are summarised as median (min–max) over repetitions; ratios and
differences are paired (both variants of the same repetition; a repetition whose other
side failed gives none). The streamer's latency p99 is pooled over repetitions; the
cluster's TTFT p99 is per round, from that round's samples; either is a p99 only from
>= 200 samples (bench.harness.p99), else the max, labelled so. Pure: no fleet, no clock."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bench.common import quantile
from bench.harness import (
    MIN_P99_SAMPLES,
    RunRecord,
    Summary,
    by_variant,
    fmt_num,
    p99,
    ratio,
    summarize,
)
from bench.render_common import (
    RenderError,
    Results,
    failed_run_lines,
    measured_records,
    one_results_file,
    row_source,
    sources_line,
    table,
)

RAW, WS = "raw", "streamer"
STREAMER_VARIANTS = (RAW, WS)
ONE, THREE = "1-node", "3-node"
CLUSTER_VARIANTS = (ONE, THREE)
STREAMER_STEM, CLUSTER_STEM = "streamer", "cluster"  # the Summary rows' results files

Metric = Callable[[dict[str, Any]], float]


# --- records -----------------------------------------------------------------------------


def per_rep(records: Sequence[RunRecord], variant: str, metric: Metric) -> dict[int, float]:
    return {r.rep: metric(r.metrics) for r in by_variant(records).get(variant, [])}


def over_reps(records: Sequence[RunRecord], variant: str, metric: Metric) -> Summary:
    return summarize(per_rep(records, variant, metric).values())


def paired(records: Sequence[RunRecord], num: str, den: str, metric: Metric,
           op: Callable[[float, float], float] = ratio) -> list[float]:
    """op(num's value, den's value) per repetition in which both succeeded."""
    a, b = per_rep(records, num, metric), per_rep(records, den, metric)
    return [op(a[k], b[k]) for k in sorted(a.keys() & b.keys())]


def num_reps(records: Sequence[RunRecord]) -> int:
    return len({r.rep for r in records})


# --- formatting ----------------------------------------------------------------------------


def fmt_x(s: Summary, digits: int = 2) -> str:
    """A ratio over repetitions: "0.33× (0.30–0.35)"."""
    return s.fmt(digits, "×")


def fmt_signed(s: Summary, digits: int = 2, unit: str = " ms") -> str:
    """A difference over repetitions, signs kept: "+0.70 ms (+0.61 to +0.84)"."""
    if s.n == 0:
        return "n/a"
    med = f"{s.median:+.{digits}f}{unit}"
    return med if s.n == 1 else f"{med} ({s.lo:+.{digits}f} to {s.hi:+.{digits}f})"


def fmt_pct(s: Summary) -> str:
    return Summary(s.median * 100, s.lo * 100, s.hi * 100, s.n).fmt(0, "%")


# --- streamer ------------------------------------------------------------------------------


def tokens_per_s(m: dict) -> float:
    return m["throughput"]["tokens_per_s"]


def latency_p50_ms(m: dict) -> float:
    return quantile(m["latency"]["lat_ms"], 0.5)


def streamer_cpu(m: dict) -> float | None:
    return m["throughput"].get("streamer_cpu")


def pooled_latency(records: Sequence[RunRecord], variant: str) -> list[float]:
    """Every token's publish → client latency of the variant, over all repetitions."""
    return [x for r in by_variant(records).get(variant, []) for x in r.metrics["latency"]["lat_ms"]]


@dataclass(frozen=True)
class Tail:
    """A pooled tail: "p99" from >= MIN_P99_SAMPLES samples, else "max"."""

    label: str
    value: float
    samples: int

    def fmt(self, digits: int = 3) -> str:
        txt = fmt_num(self.value, digits)
        return txt if self.label == "p99" else f"max={txt}"


def pooled_tail(xs: Sequence[float]) -> Tail:
    v = p99(xs)
    if v is not None:
        return Tail("p99", v, len(xs))
    return Tail("max", max(xs) if xs else float("nan"), len(xs))


def added_tail(a: Tail, b: Tail) -> Tail:
    """a − b as one statistic: a p99 difference only when both are p99s, else the
    difference of the maxima (a p99 of one and the max of the other differ in kind)."""
    return Tail(a.label, a.value - b.value, min(a.samples, b.samples))


@dataclass(frozen=True)
class StreamerFigures:
    tokens_per_s: dict[str, Summary]
    throughput_ratio: Summary  # streamer ÷ raw, paired per repetition
    cpu: Summary  # the streamer process's CPU, share of one core, throughput phase
    p50_ms: dict[str, Summary]
    added_p50_ms: Summary  # streamer − raw, paired per repetition
    tail_ms: dict[str, Tail]  # pooled over repetitions
    added_tail_ms: Tail
    pairs: int
    reps: int


def streamer_figures(data: dict) -> StreamerFigures:
    recs = measured_records(data, STREAMER_STEM, STREAMER_VARIANTS)
    pools = {v: pooled_latency(recs, v) for v in STREAMER_VARIANTS}
    bad = [v for v, xs in pools.items() if not xs]
    if bad:
        raise RenderError(f"no latency samples for {bad}")
    tails = {v: pooled_tail(xs) for v, xs in pools.items()}
    if len({t.label for t in tails.values()}) > 1:  # one side under 200: both as max
        tails = {v: Tail("max", max(xs), len(xs)) for v, xs in pools.items()}
    thr = paired(recs, WS, RAW, tokens_per_s)
    return StreamerFigures(
        {v: over_reps(recs, v, tokens_per_s) for v in STREAMER_VARIANTS}, summarize(thr),
        over_reps(recs, WS, streamer_cpu),
        {v: over_reps(recs, v, latency_p50_ms) for v in STREAMER_VARIANTS},
        summarize(paired(recs, WS, RAW, latency_p50_ms, operator.sub)),
        tails, added_tail(tails[WS], tails[RAW]), len(thr), num_reps(recs))


def _reps_txt(pairs: int, reps: int, noun: str = "interleaved repetition") -> str:
    """"5 interleaved repetitions", or "4 of 5 ... (a side failed in the others)"."""
    nouns = noun if reps == 1 else noun + "s"
    if pairs == reps:
        return f"{reps} {nouns}"
    return f"{pairs} of {reps} {nouns} (a side failed in the others)"


def streamer_setup_text(setup: dict) -> str:
    s = setup
    return (f"{s['clients']} clients, loopback, the streamer in its own process and the "
            f"clients in {s['client_procs']} other(s); throughput: {s['tokens']:,} tokens "
            f"per client, one token per chunk, published as fast as possible; latency: "
            f"{s['rate']:g} chunks/s per stream × {s['clients']} streams "
            f"({s['rate'] * s['clients']:,.0f} tokens/s) for {s['seconds']:g} s, publish → "
            f"client receipt on CLOCK_MONOTONIC (one clock, shared by the processes). "
            f"{s['reps']} repetition(s) of {' and '.join(s['variants'])}, the order reversed "
            f"every other repetition, after {s['warmup']}.")


def streamer_table(data: dict) -> str:
    """BENCHMARKS.md §4's table: per variant, then what the streamer adds."""
    f = streamer_figures(data)
    tail_head = "p99 ms" if f.added_tail_ms.label == "p99" else "max ms (< 200 samples)"
    rows = [
        ["raw core NATS (publisher → subscriber)", f.tokens_per_s[RAW].fmt(0),
         f.p50_ms[RAW].fmt(3), f.tail_ms[RAW].fmt()],
        ["through the streamer to websocket clients", f.tokens_per_s[WS].fmt(0),
         f.p50_ms[WS].fmt(3), f.tail_ms[WS].fmt()],
        ["**added by the streamer**", f"**{fmt_x(f.throughput_ratio)}**",
         f"**{fmt_signed(f.added_p50_ms, 3, '')}**",
         f"**{f.added_tail_ms.value:+.3f}**"],
    ]
    return table(["", "tokens/s", "p50 ms", tail_head], "lrrr", rows)


def streamer_notes(data: dict) -> str:
    f = streamer_figures(data)
    return (f"Median (min–max) over {_reps_txt(f.pairs, f.reps)}; the ratio and the added "
            f"p50 are paired per repetition; the {f.added_tail_ms.label} is pooled over "
            f"repetitions ({f.tail_ms[RAW].samples:,} raw / {f.tail_ms[WS].samples:,} "
            f"streamer samples). Streamer process CPU during the throughput phase: "
            f"{fmt_pct(f.cpu)} of one core.")


def streamer_runs_table(data: dict) -> str:
    rows = []
    for r in data.get("records", []):
        if r.get("error"):
            continue
        m = r["metrics"]
        lat = m["latency"]["lat_ms"]
        cpu = streamer_cpu(m)
        rows.append([r["rep"], r["position"] + 1, r["variant"], fmt_num(tokens_per_s(m), 0),
                     fmt_num(m["throughput"]["wall_s"], 2),
                     "—" if cpu is None else fmt_num(cpu * 100, 0) + "%",
                     fmt_num(quantile(lat, 0.5), 3), fmt_num(max(lat), 3), f"{len(lat):,}"])
    header = ["rep", "#", "variant", "tokens/s", "throughput wall s", "streamer CPU",
              "latency p50 ms", "latency max ms", "latency samples"]
    return table(header, "rrlrrrrrr", rows)


def streamer_report(data: dict) -> str:
    """bench/bench_streamer.py's results markdown body (below the harness header)."""
    setup = data["setup"]
    lines = [streamer_setup_text(setup), "", streamer_table(data), "", streamer_notes(data),
             "", "## Every run", "", streamer_runs_table(data), "",
             f"Load average (1 min) at start / end: {setup.get('loadavg_start')} / "
             f"{setup.get('loadavg_end')}; measured part {fmt_num(setup.get('bench_s'), 0)} s.",
             *failed_run_lines(data)]
    return "\n".join(lines) + "\n"


def streamer_kind(res: Results, args: list[str], _old: str) -> str:
    """`<!-- generated: streamer STEM -->`: the setup, the table and how to read it."""
    data = one_results_file(res, "streamer", args)
    return "\n\n".join([sources_line(res, args), streamer_setup_text(data["setup"]),
                        streamer_table(data), streamer_notes(data)])


def summary_streamer_throughput(res: Results) -> list[str]:
    data = res.load(STREAMER_STEM).get("data", {})
    f, s = streamer_figures(data), data["setup"]
    return [f"tokens/s the streamer relays to {s['clients']} websocket clients vs raw core "
            f"NATS (one token per chunk, loopback)",
            f"{f.tokens_per_s[WS].fmt(0)} vs {f.tokens_per_s[RAW].fmt(0)} tokens/s: "
            f"**{fmt_x(f.throughput_ratio)}** over {_reps_txt(f.pairs, f.reps)}; streamer at "
            f"{fmt_pct(f.cpu)} of a core",
            "—", row_source(res, STREAMER_STEM)]


def summary_streamer_latency(res: Results) -> list[str]:
    data = res.load(STREAMER_STEM).get("data", {})
    f, s = streamer_figures(data), data["setup"]
    t = f.added_tail_ms
    return [f"per-token latency added by the streamer ({s['rate'] * s['clients']:,.0f} "
            f"tokens/s over {s['clients']} streams)",
            f"**{fmt_signed(f.added_p50_ms)} p50** per rep; {t.label} {t.value:+.2f} ms "
            f"(pooled, {f.tail_ms[WS].samples:,} / {f.tail_ms[RAW].samples:,} samples)",
            "—", row_source(res, STREAMER_STEM)]


# --- cluster -------------------------------------------------------------------------------


def req_per_s(m: dict) -> float:
    return m["req_per_s"]


def ttft_p50_ms(m: dict) -> float:
    return quantile(m["ttft_ms"], 0.5)


def ttft_p99_ms(m: dict) -> float:
    return quantile(m["ttft_ms"], 0.99)


def ttft_max_ms(m: dict) -> float:
    return max(m["ttft_ms"])


def cluster_tail_label(records: Sequence[RunRecord]) -> str:
    """"p99" when every round held >= MIN_P99_SAMPLES light-load samples, else "max"."""
    ok = all(len(r.metrics["ttft_ms"]) >= MIN_P99_SAMPLES for r in records if r.error is None)
    return "p99" if ok else "max"


@dataclass(frozen=True)
class ClusterFigures:
    per_variant: dict[str, dict[str, Summary]]  # metric -> variant -> over rounds
    ratios: dict[str, Summary]  # metric -> 3 ÷ 1, paired per round
    tail_label: str
    pairs: int
    reps: int


def cluster_figures(data: dict) -> ClusterFigures:
    recs = measured_records(data, CLUSTER_STEM, CLUSTER_VARIANTS)
    label = cluster_tail_label(recs)
    # One statistic for every round: a p99 of one round beside the max of another
    # would not compare.
    metrics: dict[str, Metric] = {"throughput": req_per_s, "ttft_p50": ttft_p50_ms,
                                  "ttft_tail": ttft_p99_ms if label == "p99" else ttft_max_ms}
    per = {k: {v: over_reps(recs, v, fn) for v in CLUSTER_VARIANTS} for k, fn in metrics.items()}
    ratios = {k: summarize(paired(recs, THREE, ONE, fn)) for k, fn in metrics.items()}
    return ClusterFigures(per, ratios, label, ratios["throughput"].n, num_reps(recs))


def cluster_setup_text(setup: dict) -> str:
    s = setup
    return (f"{s['reps']} round(s), each running both topologies (one nats-server; three on "
            f"loopback with routes, R3 streams and lease bucket), the order reversed every "
            f"other round; a fresh broker, dispatcher and {s['workers']} simulator workers "
            f"(time scale {s['time_scale']:g}) per round, after a warm-up on the measured "
            f"workload ({s['warmup_light']} light requests, {s['warmup_load']:,} loaded) that "
            f"is not counted. Light load: {s['light_requests']} sequential requests (4 output "
            f"tokens) per round, TTFT from just before `submit()` to the first chunk; "
            f"throughput: {s['load_requests']:,} requests (2 output tokens) at concurrency "
            f"{s['concurrency']}. One clock (`time.perf_counter`). Everything on one machine, "
            f"the three nodes sharing its CPUs with the fleet: an upper bound on the cost.")


def cluster_table(data: dict) -> str:
    f = cluster_figures(data)
    tail = ("light-load TTFT p99, ms (per round)" if f.tail_label == "p99" else
            f"light-load TTFT max, ms (per round; < {MIN_P99_SAMPLES} samples, no p99)")
    rows = []
    for key, label, digits in (("throughput", "throughput, requests/s", 0),
                               ("ttft_p50", "light-load TTFT p50, ms", 1),
                               ("ttft_tail", tail, 1)):
        rows.append([label, f.per_variant[key][ONE].fmt(digits),
                     f.per_variant[key][THREE].fmt(digits), f.ratios[key].fmt(2)])
    header = ["metric", "1 node", "3 nodes, R3", "3 ÷ 1 (median of per-round ratios)"]
    return table(header, "lrrr", rows)


def cluster_notes(data: dict) -> str:
    f = cluster_figures(data)
    return (f"Median (min–max) over {_reps_txt(f.pairs, f.reps, 'interleaved round')}; "
            "3 ÷ 1 paired per round.")


def cluster_runs_table(data: dict) -> str:
    rows = []
    for r in data.get("records", []):
        if r.get("error"):
            continue
        m = r["metrics"]
        tl = pooled_tail(m["ttft_ms"])
        rows.append([r["rep"], r["position"] + 1, r["variant"], fmt_num(req_per_s(m), 0),
                     fmt_num(m["load_wall_s"], 2), fmt_num(ttft_p50_ms(m), 2), tl.fmt(2),
                     len(m["ttft_ms"])])
    header = ["round", "#", "topology", "requests/s", "load wall s", "TTFT p50 ms",
              "TTFT p99 ms", "light samples"]
    return table(header, "rrlrrrrr", rows)


def cluster_report(data: dict) -> str:
    """bench/bench_cluster.py's results markdown body (below the harness header)."""
    setup = data["setup"]
    lines = [cluster_setup_text(setup), "", cluster_table(data), "", cluster_notes(data),
             "", "## Every round", "", cluster_runs_table(data), "",
             f"Load average (1 min) at start / end: {setup.get('loadavg_start')} / "
             f"{setup.get('loadavg_end')}; measured part {fmt_num(setup.get('bench_s'), 0)} s.",
             *failed_run_lines(data)]
    return "\n".join(lines) + "\n"


def cluster_kind(res: Results, args: list[str], _old: str) -> str:
    """`<!-- generated: cluster STEM -->`: the setup and the table."""
    data = one_results_file(res, "cluster", args)
    return "\n\n".join([sources_line(res, args), cluster_setup_text(data["setup"]),
                        cluster_table(data), cluster_notes(data)])


def summary_cluster(res: Results) -> list[str]:
    data = res.load(CLUSTER_STEM).get("data", {})
    f = cluster_figures(data)
    rounds = _reps_txt(f.pairs, f.reps, "round")
    return [f"§8 3-node NATS cluster (R3) ÷ one node, same run, {rounds}: throughput; "
            f"light-load TTFT p50; {f.tail_label} (per round)",
            f"{fmt_x(f.ratios['throughput'])}; {fmt_x(f.ratios['ttft_p50'])}; "
            f"{fmt_x(f.ratios['ttft_tail'])}",
            "—", row_source(res, CLUSTER_STEM)]


KINDS = {"streamer": streamer_kind, "cluster": cluster_kind}
SUMMARY_ROWS = {"streamer-throughput": summary_streamer_throughput,
                "streamer-latency": summary_streamer_latency,
                "cluster-cost": summary_cluster}
