"""Chaos benchmark (issue 9, "Exactly-once under every single fault").

    python bench/chaos.py                                  # every scenario, once
    python bench/chaos.py --scenario worker_restart --scenario nats_restart --reps 3
    python bench/chaos.py --requests 60 --out /tmp/chaos.md

Each scenario runs the real fleet as separate processes on 127.0.0.1 (its own
nats-server with a JetStream store, dispatcher(s), two simulated workers, the producer
library as client), submits --requests requests at --rate per second, injects ONE fault
mid-run and counts submitted / completed / failed (by code) / lost / generated twice /
failed but billed / wrongly failed, with recovery times. The scenarios and every
definition live in `tests/chaos/scenarios.py`, which `tests/chaos/test_faults.py` runs
too, so the tests assert exactly what this reports.

Writes bench/results/chaos.md (tables; median and min-max over --reps) and chaos.json
beside it (every run's full result), and prints the markdown. Run one at a time on a
quiet machine: the simulator's timing stretches with CPU contention.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.chaos_report import MUST  # noqa: E402
from bench.chaos_report import agg as _agg  # noqa: E402
from bench.chaos_report import failed_by_code as _failed  # noqa: E402
from bench.common import git_rev, machine  # noqa: E402
from tests.chaos.scenarios import SCENARIOS, Params, run_scenario  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "chaos.md"


def report(results: dict[str, list[dict]], command: str, started: str, took_s: float,
           load: str, dirty: str) -> str:
    lines = [
        "# Chaos: exactly-once under every single fault (issue 9)",
        "",
        f"- command: `{command}`",
        f"- git commit: {git_rev()}",
        f"- date: {started}; the whole run took {took_s:.0f} s",
        f"- machine: {machine()}; loadavg at start {load}",
        f"- product code: the working tree at that commit; tracked files with uncommitted "
        f"changes (others' work in progress) at the start: {dirty or 'none'}",
        "- fleet per scenario: its own nats-server (JetStream store on disk), dispatcher(s) "
        "with `--ack-wait-s 10` (lease TTL 3 s, worker timeout 3.5 s, as shipped), two "
        "simulated workers `worker-0`/`worker-1` (`--max-num-seqs 8 --time-scale 4`, default "
        "step model: 30-90 output tokens take ~1-3 s; heartbeat 1 s), the producer library "
        "in-process; everything on 127.0.0.1",
        "- definitions (lost, generated twice, failed but billed, wrongly failed, recovery): "
        "the docstring of `tests/chaos/scenarios.py`; `tests/chaos/test_faults.py` asserts the "
        "same checks (on 40 requests)",
        "- the client library resumes a stream whose worker was lost or that went silent by "
        "itself (the next attempt, a continuation: `library_resumes`), so most faults end "
        "in a complete answer rather than a `worker_lost`; `retry_after_worker_lost` turns "
        "that off to exercise explicit re-submission",
        "- a dispatcher that exits by itself (a leader that cannot renew its lease exits "
        "non-zero) is restarted 0.5 s later by the harness, as compose's `restart: "
        "unless-stopped` would (`dispatcher_restarts_by_supervisor`); `fairlane up` restarts "
        "nothing",
        "",
        "## Summary",
        "",
        "Numbers are per run; with several reps, median (min–max). Times in seconds.",
        "",
        "| scenario | submitted | completed | failed (by code) | lost | generated twice | "
        "failed but billed | wrongly failed | fault → next Started | fault → all answered "
        "| victims told (max) | checks |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, runs in results.items():
        ok_runs = [r for r in runs if "error" not in r]
        if not ok_runs:
            last = runs[0]["error"].strip().splitlines()[-1][:100].replace("|", "/")
            lines.append(f"| {name} | error: {last} |" + " |" * 10)
            continue
        rec = [r["recovery_s"] for r in ok_runs]
        passed = sum(r["ok"] for r in ok_runs)
        failing = sorted({c["name"] for r in ok_runs for c in r["checks"] if not c["ok"]})
        lines.append(
            f"| {name} | {_agg([r['submitted'] for r in ok_runs])} "
            f"| {_agg([r['completed'] for r in ok_runs])} | {_failed(ok_runs)} "
            + "".join(f"| {_agg([r[k] for r in ok_runs])} " for k in MUST)
            + f"| {_agg([x.get('fault_to_next_started') for x in rec])} "
            f"| {_agg([x.get('fault_to_all_answered') for x in rec])} "
            f"| {_agg([x.get('victims_told_max') for x in rec])} "
            f"| {'pass' if passed == len(runs) else f'FAIL in {len(runs) - passed}/{len(runs)}: '}"
            f"{'; '.join(failing)} |")
    for name, runs in results.items():
        lines += ["", f"## {name}", ""]
        ok_runs = [r for r in runs if "error" not in r]
        for r in runs:
            if "error" in r:
                lines += ["```", r["error"].strip()[-1500:], "```", ""]
        if not ok_runs:
            continue
        lines += [f"Fault: {ok_runs[0]['fault']}.", ""]
        lines += ["| measure | value |", "|---|---|"]
        scalar = ("submit_retries", "client_resubmissions", "library_resumes", "incomplete_ok",
                  "usage_republished", "completed_billing_mismatch", "finished_attempt_resumed",
                  "dispatcher_restarts_by_supervisor", "wall_s")
        for k in scalar:
            lines.append(f"| {k} | {_agg([r.get(k) for r in ok_runs])} |")
        for k in sorted({k for r in ok_runs for k in r["recovery_s"]}):
            lines.append(f"| recovery: {k} | {_agg([r['recovery_s'].get(k) for r in ok_runs])} |")
        for k in ("ttft_ms",):
            for q in ("p50", "p99"):
                lines.append(f"| TTFT {q} ms (all) | "
                             f"{_agg([r.get(k, {}).get(q) for r in ok_runs])} |")
        for k in sorted({k for r in ok_runs for k in r["extra"]}):
            lines.append(f"| {k} | {_agg([r['extra'].get(k) for r in ok_runs])} |")
        if any(r.get("victim_outcomes") for r in ok_runs):
            lines.append(f"| victim outcomes | {ok_runs[-1].get('victim_outcomes')} |")
        if any(r.get("supervisor_restarts") for r in ok_runs):
            lines.append("| dispatcher exits restarted by the harness (s after fault, name, rc) "
                         f"| {[r.get('supervisor_restarts') for r in ok_runs]} |")
        lines += ["", "| check | target | value | result |", "|---|---|---|---|"]
        for i, c in enumerate(ok_runs[0]["checks"]):
            vals = [r["checks"][i]["value"] for r in ok_runs]
            oks = sum(r["checks"][i]["ok"] for r in ok_runs)
            lines.append(f"| {c['name']} | {c['target']} | {_agg(vals)} | "
                         f"{'pass' if oks == len(ok_runs) else f'FAIL in {len(ok_runs) - oks}/{len(ok_runs)}'} |")
        if any(not r["ok"] for r in ok_runs) and ok_runs[0].get("known_gap"):
            lines += ["", f"**Known gap** ({ok_runs[0]['scenario']}): {ok_runs[0]['known_gap']}."]
        for r in ok_runs:
            bad = {k: v for k, v in r["ids"].items() if v}
            if not bad:
                continue
            lines += ["", f"Request ids (rep {r['rep']}): {bad}"]
            must = [i for k in MUST for i in r["ids"].get(k, [])]
            first = next((i for i in [*must, *[i for v in bad.values() for i in v]]
                          if i in r["evidence"]), None)
            if first is not None:
                lines += ["", f"Evidence for {first} (seconds from the fault):", "",
                          "```", *(f"{k}: {json.dumps(v)}" for k, v in
                                   r["evidence"][first].items() if v), "```"]
            break
        notes = [n for r in ok_runs for n in r.get("notes", [])]
        if notes:
            lines += ["", "Notes: " + "; ".join(notes)]
    return "\n".join(lines) + "\n"


async def run_all(args) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {}
    params = Params(num_requests=args.requests, rate_per_s=args.rate)
    keep = Path(args.keep_logs) if args.keep_logs else None
    for name in args.scenario:
        results[name] = []
        for rep in range(args.reps):
            with tempfile.TemporaryDirectory(prefix=f"chaos-{name}-") as tmp:
                workdir = (keep / f"{name}-{rep}") if keep else Path(tmp)
                shutil.rmtree(workdir, ignore_errors=True)  # a fresh store and fresh logs
                t0 = time.monotonic()
                try:
                    res = await asyncio.wait_for(run_scenario(name, params, workdir), 600)
                except Exception:  # noqa: BLE001 - reported, the other scenarios still run
                    res = {"scenario": name, "error": traceback.format_exc()}
                res["rep"] = rep
                results[name].append(res)
                verdict = ("ERROR" if "error" in res else "pass" if res["ok"] else "FAIL")
                print(f"{name} rep {rep}: {verdict} in {time.monotonic() - t0:.0f} s "
                      + ("" if "error" in res else " ".join(f"{k}={res[k]}" for k in MUST)),
                      flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", action="append", choices=sorted(SCENARIOS),
                    help="run only this scenario (repeatable); default: all, in order")
    ap.add_argument("--requests", type=int, default=150, help="requests per scenario")
    ap.add_argument("--rate", type=float, default=6.0, help="submissions per second")
    ap.add_argument("--reps", type=int, default=1, help="repetitions per scenario")
    ap.add_argument("--out", default=str(RESULTS), help="markdown report (JSON beside it)")
    ap.add_argument("--keep-logs", default="", help="keep each run's logs under this folder")
    args = ap.parse_args()
    args.scenario = args.scenario or list(SCENARIOS)
    command = "python bench/chaos.py " + shlex.join(sys.argv[1:])
    started = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    load = "/".join(f"{x:.2f}" for x in os.getloadavg())
    dirty = ", ".join(sorted(line[3:] for line in subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
        capture_output=True, text=True).stdout.splitlines()))
    t0 = time.monotonic()
    from fairlane.logs import configure_logging

    configure_logging("warning")  # the client library's info lines (resumes) are counted
    results = asyncio.run(run_all(args))
    md = report(results, command.strip(), started, time.monotonic() - t0, load, dirty)
    rev = git_rev()  # before writing: a tracked results file rewritten makes the tree dirty
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(md)
    out.with_suffix(".json").write_text(json.dumps(
        {"command": command.strip(), "commit": rev, "date": started, "machine": machine(),
         "results": results}, indent=1, default=str))
    print(md)
    sys.exit(0 if all("error" not in r and r["ok"] for rs in results.values() for r in rs) else 1)


if __name__ == "__main__":
    main()
