"""BENCHMARKS.md's fault tables (sections 5 and 8) and Summary rows, rendered from the
JSON bench/chaos.py writes ({"command", "commit", "date", "machine", "results":
{scenario: [run, ...]}}), with the number formatting of its own markdown
(`bench.chaos_report.agg`)."""

from __future__ import annotations

from collections.abc import Callable

from bench.chaos_report import MUST, agg
from bench.render_common import (
    RenderError,
    Results,
    fmt_sig,
    one_stem,
    row_source,
    sources_line,
    table,
)

Runs = list[dict]


def ok_runs(res: Results, stem: str, scenario: str | None = None) -> dict[str, Runs]:
    """{scenario: its runs that did not crash}, in the file's order."""
    results = res.load(stem).get("results")
    if not isinstance(results, dict):
        raise RenderError(f"{stem}.json has no chaos results")
    return {k: [r for r in v if "error" not in r] for k, v in results.items()
            if scenario is None or k == scenario}


def agg_s(values: list) -> str:
    """`agg` with the unit after the median: "0.56 s (0.56–0.57)"."""
    txt = agg(values)
    if txt == "-":
        return txt
    med, _, rest = txt.partition(" (")
    return f"{med} s" + (f" ({rest}" if rest else "")


def _rec(runs: Runs, key: str) -> list:
    return [r.get("recovery_s", {}).get(key) for r in runs]


def _extra(runs: Runs, key: str) -> list:
    return [r.get("extra", {}).get(key) for r in runs]


def _check(runs: Runs, prefix: str) -> tuple[str, list, bool]:
    """(target, values, every run passed) of the check whose name starts with prefix."""
    found = [c for r in runs for c in r.get("checks", []) if c["name"].startswith(prefix)]
    if not found:
        return "?", [], False
    return found[0]["target"], [c["value"] for c in found], all(c["ok"] for c in found)


def _n(runs: Runs) -> str:
    return f", {len(runs)} runs" if len(runs) > 1 else ""


def _completed(runs: Runs) -> str:
    comp = sum(r["completed"] for r in runs)
    sub = sum(r["submitted"] for r in runs)
    codes: dict[str, int] = {}
    for r in runs:
        for code, n in r.get("failed", {}).items():
            codes[code] = codes.get(code, 0) + n
    cancelled = codes.pop("cancelled", 0)
    txt = f"{comp}/{sub - cancelled}" + (f" + {cancelled} cancelled" if cancelled else "")
    if codes:
        txt += " (" + ", ".join(f"{n} `{c}`" for c, n in sorted(codes.items())) + ")"
    return txt


# --- the recovery column, one function per scenario (runs: the repeated ones if any) ----


def _worker_restart(rs: Runs) -> str:
    target, _, _ = _check(rs, "victims' clients told")
    return (f"its clients told (and resumed elsewhere) **{agg_s(_rec(rs, 'victims_told_max'))}** "
            f"after the kill{_n(rs)} (target {target}); their answers complete "
            f"{agg_s(_rec(rs, 'victims_answered_max'))} after")


def _nats(what: str, restored: str) -> Callable[[Runs], str]:
    def cell(rs: Runs) -> str:
        return (f"next dispatch {agg_s(_rec(rs, 'fault_to_next_started'))} after the {what}, "
                f"{agg_s(_rec(rs, 'restore_to_next_started'))} after {restored}")
    return cell


def _worker_stall(rs: Runs) -> str:
    target, _, _ = _check(rs, "victims' clients told")
    _, published, _ = _check(rs, "stalled incarnation published")
    fenced = [x for x in _extra(rs, "worker_0_fenced") if x is not None]
    woken = ("the woken worker fenced itself and published nothing"
             if fenced and min(fenced) >= 1 and published and not any(published)
             else f"the woken worker: fenced {agg(fenced)}, events after waking {agg(published)}")
    return (f"clients told {agg_s(_rec(rs, 'victims_told_max'))} after the stall (target "
            f"{target}: the worker timeout + 2 heartbeats); {woken}")


def _client_close(rs: Runs) -> str:
    return (f"running streams aborted on the workers within "
            f"{agg_s(_extra(rs, 'abort_latency_max_s'))}; started after close: "
            f"{agg(_extra(rs, 'started_after_close'))}, ran to their end: "
            f"{agg(_extra(rs, 'finished_normally_after_close'))}")


def _retry(rs: Runs) -> str:
    _, billed, _ = _check(rs, "every retried completion billed once")
    return (f"{agg(_extra(rs, 'retried_completed'))}/{agg(_extra(rs, 'retried'))} retried "
            f"completed; billed once, in full: {', '.join(map(str, billed)) or '?'}")


def _duplicate(rs: Runs) -> str:
    _, again, _ = _check(rs, "no duplicate generated again")
    return (f"{agg(_extra(rs, 'duplicate_answers'))} of {agg(_extra(rs, 'duplicates_published'))} "
            f"repeats answered `duplicate`; generated again: {agg(again)}")


def _unknown(rs: Runs) -> str:
    parts = []
    for what in ("unknown tier", "unserved pool"):
        answers = [a for a in _extra(rs, f"{what}: answer, s") if a]
        _, _, gone = _check(rs, f"{what}: message gone")
        code = answers[0][0] if answers else "?"
        parts.append(f"{what} answered `{code}` in {agg_s([a[1] for a in answers])}"
                     + (", removed from the stream" if gone else ", **left in the stream**"))
    return "; ".join(parts)


def _two_dispatchers(rs: Runs) -> str:
    epochs = sorted({e for r in rs for e in r.get("extra", {}).get("dispatching_epochs", [])})
    return (f"the capped tenant never above {agg(_extra(rs, 'capped_max_running'))} running; "
            f"epochs that dispatched: {', '.join(map(str, epochs)) or 'none'}")


def _crash_loop(rs: Runs) -> str:
    return f"{agg(_extra(rs, 'waited_past_one_failover'))} requests waited a second `ack_wait`"


def _leader_kill(rs: Runs) -> str:
    target, _, _ = _check(rs, "standby dispatches")
    return (f"standby's first dispatch **{agg_s(_extra(rs, 'standby_first_dispatch_s'))}** after "
            f"the kill{_n(rs)} (target {target})")


def _leader_graceful(rs: Runs) -> str:
    target, _, _ = _check(rs, "standby dispatches")
    _, _, handed = _check(rs, "held requests handed over")
    return (f"standby's first dispatch **{agg_s(_extra(rs, 'standby_first_dispatch_s'))}** after "
            f"SIGTERM{_n(rs)} (target {target}); the {agg(_extra(rs, 'held_at_stop'))} requests "
            "the leader held were "
            + ("all handed over (none waited for `ack_wait`)" if handed else "**not all handed over**")
            + f", the last dispatched {agg_s(_extra(rs, 'held_dispatched_max_s'))} after")


def _section_8(_rs: Runs) -> str:
    return "section 8"


def _default(rs: Runs) -> str:
    return (f"next Started {agg_s(_rec(rs, 'fault_to_next_started'))} after the fault, all "
            f"answered {agg_s(_rec(rs, 'fault_to_all_answered'))} after")


RECOVERY: dict[str, Callable[[Runs], str]] = {
    "worker_restart": _worker_restart,
    "nats_restart": _nats("kill", "the restart"),
    "nats_down_5s": _nats("fault", "it ended"),
    "worker_stall": _worker_stall,
    "client_close": _client_close,
    "retry_after_worker_lost": _retry,
    "duplicate_without_msg_id": _duplicate,
    "unknown_tier_and_pool": _unknown,
    "two_dispatchers": _two_dispatchers,
    "dispatcher_crash_loop": _crash_loop,
    "leader_kill": _leader_kill,
    "leader_graceful": _leader_graceful,
    "nats_leader_kill": _section_8,
    "nats_lease_leader_kill": _section_8,
    "nats_follower_kill": _section_8,
}


def scenarios_table(res: Results, args: list[str], _old: str) -> str:
    """`<!-- generated: chaos-scenarios RECORDED [MORE ...] -->`: one row per scenario of
    the recorded run; a scenario that MORE files repeated gets their runs in the
    completed and must-be-0 columns, and its recovery column from them."""
    if not args:
        raise RenderError("chaos-scenarios takes at least one results file")
    main, more = ok_runs(res, args[0]), [(s, ok_runs(res, s)) for s in args[1:]]
    rows = []
    for name, runs in main.items():
        if not runs:
            rows.append([f"`{name}`", "error: no run finished", "", "", "", "", ""])
            continue
        completed = _completed(runs)
        every, repeated = list(runs), []
        for stem, other in more:
            if other.get(name):
                completed += f"; {stem}, {len(other[name])} runs: {_completed(other[name])}"
                every += other[name]
                repeated += other[name]
        rows.append([f"`{name}`: {runs[0].get('fault', '')}", completed,
                     *(str(sum(r[k] for r in every)) for k in MUST),
                     RECOVERY.get(name, _default)(repeated or runs)])
    header = ["scenario: fault", "completed", "lost", "generated twice", "failed but billed",
              "wrongly failed", "recovery"]
    return sources_line(res, args) + "\n\n" + table(header, "llrrrrl", rows)


def _at(x: float | None, zero: str = "at once", suffix: str = "") -> str:
    if x is None:
        return "-"
    return zero if x == 0 else f"{fmt_sig(x)} s{suffix}"


def cluster_table(res: Results, args: list[str], _old: str) -> str:
    """`<!-- generated: chaos-cluster STEM -->`: a NATS node killed, one row per run."""
    stem = one_stem("chaos-cluster", args)
    rows = []
    for name, runs in ok_runs(res, stem).items():
        for r in runs:
            ex = r.get("extra", {})
            rows.append([f"`{name}`: {r.get('fault', '')}", r["submitted"], r["completed"],
                         *(r[k] for k in MUST),
                         _at(ex.get("fault_to_first_new_dispatch_s"), "0 s"),
                         _at(ex.get("caught_up_s"), suffix=" after restart"),
                         ex.get("lease_fenced", 0), r.get("library_resumes", 0)])
    header = ["node killed", "submitted", "completed", "lost", "generated twice",
              "failed but billed", "wrongly failed",
              "first dispatch of work submitted after the kill", "restarted node current",
              "dispatcher fenced", "library resumes"]
    return sources_line(res, args) + "\n\n" + table(header, "lrrrrrrrrrr", rows)


def _conn(name: str) -> str:
    name = name.removeprefix("gpu_worker:")
    return "dispatcher" if name.startswith("fairlane-dispatcher") else name.removeprefix("fairlane-")


def partition_table(res: Results, args: list[str], _old: str) -> str:
    """`<!-- generated: chaos-partition STEM -->`: a node cut off, one row per run."""
    stem = one_stem("chaos-partition", args)
    rows, cut = [], set()
    for name, runs in ok_runs(res, stem).items():
        for i, r in enumerate(runs, 1):
            ex = r.get("extra", {})
            cut.add(ex.get("cut_node", "?"))
            _, _, equal = _check([r], f"{ex.get('cut_node', '?')}'s FL_REQUESTS and FL_USAGE")
            rows.append([f"{ex.get('role') or name} {i}",
                         ", ".join(_conn(c) for c in ex.get("connections_on_cut_node", []))
                         or "nothing",
                         r["completed"], *(r[k] for k in MUST), r.get("finished_attempt_resumed", 0),
                         ex.get("leader_during", "?"),
                         _at(ex.get("fault_to_first_new_dispatch_s"), "0 s"),
                         _at(ex.get("caught_up_s"), "0 s"), "yes" if equal else "**no**"])
    node = f"`{cut.pop()}`" if len(cut) == 1 else "the cut node"
    header = ["run", f"on {node} when cut", "completed", "lost", "generated twice",
              "failed but billed", "wrongly failed", "tail resumed (see below)",
              "FL_REQUESTS leader during the cut", "first dispatch of work submitted after the cut",
              f"{node} current after the heal", "stores equal"]
    return sources_line(res, args) + "\n\n" + table(header, "llrrrrrrlrrl", rows)


# --- Summary rows --------------------------------------------------------------------------


def _must(runs: Runs) -> str:
    return " / ".join(str(sum(r[k] for r in runs)) for k in MUST)


RERUN = "chaos_lease_leader_kill"  # the re-run after the fix of a failure in the recorded run


def summary_chaos(res: Results) -> list[str]:
    main = ok_runs(res, "chaos")
    every = [r for rs in main.values() for r in rs]
    reqs = sorted({r.get("params", {}).get("num_requests") for r in every} - {None})
    zero = all(r[k] == 0 for r in every for k in MUST)
    measured = _must(every) + (" in every scenario" if zero else "")
    for name, runs in main.items():
        codes = {c: n for r in runs for c, n in r.get("failed", {}).items() if c != "cancelled"}
        for code, n in sorted(codes.items()):
            measured += (f"; `{name}` answered {n} of {sum(r['submitted'] for r in runs)} with "
                         f"`{code}` (not billed)" if zero else f"; `{name}`: {n} `{code}`")
            rerun = ok_runs(res, RERUN).get(name)
            if rerun:
                measured += (f", re-run at {res.source(RERUN).commit}: "
                             f"{_completed(rerun)} in {len(rerun)} runs, see §5")
    return [f"§5 chaos: {len(main)} single faults × {', '.join(map(str, reqs))} requests: lost / "
            "generated twice / failed-but-billed / wrongly failed", measured, "all 0",
            row_source(res, "chaos") + ", " + row_source(res, RERUN, "re-run")]


def summary_recovery(res: Results) -> list[str]:
    rec = ok_runs(res, "chaos_recovery")
    parts, targets, n = [], [], set()
    for name, key, where, prefix in (
            ("leader_kill", "standby_first_dispatch_s", "extra", "standby dispatches"),
            ("leader_graceful", "standby_first_dispatch_s", "extra", "standby dispatches"),
            ("worker_restart", "victims_told_max", "recovery_s", "victims' clients told")):
        rs = rec.get(name, [])
        parts.append(agg_s([r.get(where, {}).get(key) for r in rs]) if rs else "n/a")
        targets.append(_check(rs, prefix)[0] if rs else "?")
        n.add(len(rs))
    runs = f" — {n.pop()} runs each" if len(n) == 1 else ""
    return ["§5 leader kill → standby's first dispatch; graceful stop → served by the standby; "
            "worker kill → its clients told", "; ".join(parts) + runs, "; ".join(targets),
            row_source(res, "chaos_recovery", "recovery")]


def summary_partition(res: Results) -> list[str]:
    part = ok_runs(res, "chaos_partition")
    every = [r for rs in part.values() for r in rs]
    cut = sorted({r.get("extra", {}).get("cut_s") for r in every} - {None})
    reps = sorted({len(rs) for rs in part.values()})
    roles = " / ".join(k.removeprefix("nats_partition_") for k in part)
    passed = sum(1 for r in every if r.get("ok"))
    return [f"§8 a NATS node cut off by a network partition for {', '.join(f'{c:g}' for c in cut)} s "
            f"({roles}), {', '.join(map(str, reps))} runs each: lost / generated twice / "
            "failed-but-billed / wrongly failed",
            f"{_must(every)}; every check passed in {passed} of {len(every)} runs", "all 0",
            row_source(res, "chaos_partition")]


KINDS = {"chaos-scenarios": scenarios_table, "chaos-cluster": cluster_table,
         "chaos-partition": partition_table}
SUMMARY_ROWS = {"chaos": summary_chaos, "chaos-recovery": summary_recovery,
                "chaos-partition": summary_partition}
