"""Tenant churn: 100,000 tenants pass through the dispatcher's core, each once.

    PYTHONPATH=. python bench/bench_tenant_churn.py [--num-tenants 100000] [--reps 5]

Drives the real pure core (`PoolCore` around a `Scheduler`), with the pool's stats
tracker as its observer (as `dispatcher.stats_publisher` installs it), and the
dispatcher's Prometheus metrics recorded through the hooks the shell calls, nothing
written directly: `metrics.configure(--metrics-max-tenants, --idle-s)` at start (as
`Dispatcher.__post_init__`, the bound's default taken from `DispatcherSettings`);
per request fetched `INGESTED` (`dispatcher.ingest`); per dispatch
`metrics.dispatched` (`dispatcher.held.work_item`); per Started event
`metrics.started` with the core's actions (`Dispatcher._on_event`); per `Term` action
any core call returns `metrics.rejected` (`Dispatcher._apply`); per housekeeping pass
what `Dispatcher._housekeeping` calls that is not I/O (`PoolCore.tick`, its actions
applied, then `metrics.observe_scheduler`). The tenant label bound
(`metrics.TENANTS`, a `TenantLabels`) reads the simulated clock, as the production
one reads the monotonic clock the core's times come from. No NATS, no workers'
processes, no clock: simulated time.

Tenants arrive at `--tenants-per-s` (simulated), each submits 1-3 requests (tokens
cost model: 100 prompt tokens, 64 expected output tokens), 8 simulated workers with 64
slots each take them and finish them 2 s later, then the tenant never comes back. One
tenant in `--debtor-every` (100) used more than it declared (its true-up leaves it in
debt); the rest used less. A housekeeping pass runs every 200 ms (simulated) for the
idle period before each checkpoint, and every `--churn-pass-s` (5 s: cheap enough
that the code before the fix finishes too) before that; a stats snapshot every 1 s.
At each checkpoint (tenants arrived so far):

- live per-tenant entries: the scheduler's tenant loads, the policy's tenant states
  (and how many of those are in debt), the stats tracker's per-tenant entries, and the
  tenant label sets in the Prometheus registry (children of a metric: a histogram's
  buckets are one label set), at most `--metrics-max-tenants` tenants plus `_other`;
- memory: RSS and Python's allocated blocks after `gc.collect()` (no tracemalloc);
- timings, `--reps` times each, as median (min–max): one housekeeping pass after
  200 ms of churn (what a 200 ms pass sees in production), one stats snapshot, and
  rendering `/metrics` (`prometheus_client.generate_latest` of the default registry,
  the one the dispatcher serves) with its size.

Each policy runs in its own child process (a fresh registry and heap). The same script
measured the code before the fix (`bench/results/tenant_churn_before.md`): where the
core has no idle sweep (`PoolCore.tenant_changes`) it calls the old housekeeping, and
where `dispatcher.metrics` has no hooks (before the tenant label bound) it records what
`work_item` recorded then (`QUEUE_WAIT`, `DISPATCHED_COST`).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import RunMeta, fmt_num, run_children, summarize, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "tenant_churn.md"
TITLE = "Tenant churn: 100,000 tenants pass through the dispatcher core"
STEP_MS = 50.0
NUM_WORKERS = 8
SLOTS = 64
SERVICE_MS = 2_000.0
PASS_MS = 200.0  # the dispatcher's housekeeping period
SNAPSHOT_MS = 1_000.0  # the stats snapshot's period (--stats-interval-s)


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class Churn:
    """One policy's run: the core, the stats tracker and the metrics, in simulated time."""

    def __init__(self, policy: str, tenants_per_s: float, idle_s: float,
                 debtor_every: int, metrics_max_tenants: int) -> None:
        from dispatcher import metrics
        from dispatcher.scheduler.core import Scheduler
        from dispatcher.scheduler.pool import PoolCore
        from dispatcher.stats import StatsTracker
        from fairlane.poolconfig import SchedulerConfig

        cfg = SchedulerConfig(policy=policy, cost_model="tokens", quantum=512.0)
        self.core = PoolCore(Scheduler(cfg), 3_500.0)
        if hasattr(self.core, "tenant_idle_ms"):
            self.core.tenant_idle_ms = idle_s * 1000
        self.tracker = StatsTracker()
        self.core.observer = self.tracker
        self.now = 0.0
        self.per_step = tenants_per_s * STEP_MS / 1000
        self.debtor_every = debtor_every
        self.num_arrived = 0
        self._arrivals = 0.0
        self._running = {f"w{i}": 0 for i in range(NUM_WORKERS)}
        self._to_start: list[tuple[str, str]] = []
        self._to_finish: deque[tuple[float, str, str]] = deque()
        self._next_pass = PASS_MS
        self._next_snapshot = SNAPSHOT_MS
        self.num_rejected = 0
        self.hooks = hasattr(metrics, "dispatched")  # False: the code before the hooks
        if self.hooks:
            # The bound on the simulated clock (the dispatcher's runs on the monotonic
            # clock its core's times come from), then configured as the dispatcher
            # configures it: --metrics-max-tenants and the core's --tenant-idle-s.
            from fairlane.metrics_labels import TenantLabels

            metrics.TENANTS = TenantLabels(metrics_max_tenants, idle_s,
                                           clock=lambda: self.now / 1000)
            metrics.configure(metrics_max_tenants, idle_s)

    # --- what the shell does -----------------------------------------------------------

    def housekeeping(self) -> None:
        """The pure part of `Dispatcher._housekeeping`: the core's tick (its actions
        applied) and the metrics. (`_maybe_preempt` is skipped: it only runs when no
        pull has a slot free, and these workers always have one.)"""
        from dispatcher import metrics

        self._apply(self.core.tick(self.now))
        changes = getattr(self.core, "tenant_changes", None)
        if changes is None:  # the code before the idle sweep
            metrics.observe_scheduler(self.core.scheduler, self.now)
        else:
            metrics.observe_scheduler(self.core.scheduler, self.now, changes)

    def snapshot(self) -> None:
        self.tracker.snapshot(self.core, self.now, pool="p")

    def _apply(self, actions: list[Any]) -> None:
        """What `Dispatcher._apply` records of the core's actions (the rest is I/O):
        a refusal or a drop (`Term`) counts in `rejected_total`."""
        from dispatcher import metrics
        from dispatcher.scheduler.actions import Term

        for a in actions:
            if isinstance(a, Term):
                self.num_rejected += 1
                if self.hooks:
                    metrics.rejected(a.request.tenant, a.reason)

    def _submit(self, req: Any) -> None:
        """As `dispatcher.ingest` takes a request fetched from JetStream."""
        from dispatcher import metrics

        metrics.INGESTED.inc()
        self._apply(self.core.submit(req, self.now))

    def _started(self, wid: str, rid: str) -> None:
        """As `Dispatcher._on_event` takes a worker's Started event (no preemptions
        here: never a continuation)."""
        from dispatcher import metrics

        actions = self.core.on_started(rid, wid, self.now)
        if self.hooks:
            metrics.started(actions, None, self.now)
        self._apply(actions)

    def _dispatched(self, d: Any) -> None:
        from dispatcher import metrics

        # As `dispatcher.held.work_item` records every dispatch.
        queue_ms = int(self.now - d.request.arrival_ms)
        if self.hooks:
            metrics.dispatched(d.request, queue_ms / 1000, d.cost)
        else:  # what work_item recorded before the hooks
            metrics.QUEUE_WAIT.labels(tier=d.request.tier).observe(queue_ms / 1000)
            metrics.DISPATCHED_COST.labels(tenant=d.request.tenant,
                                           tier=d.request.tier).inc(d.cost)

    # --- simulated traffic -------------------------------------------------------------

    def step(self, pass_every_ms: float | None) -> None:
        from dispatcher.scheduler.types import ActualUsage, QueuedRequest

        core, now = self.core, self.now
        self._arrivals += self.per_step
        while self._arrivals >= 1:
            self._arrivals -= 1
            i = self.num_arrived
            self.num_arrived += 1
            tenant = f"t{i:06d}"
            for j in range(1 + i % 3):
                # arrival_ms: the fetch's time, as ingest stamps it.
                self._submit(QueuedRequest(f"{tenant}-{j}", tenant, "standard", 100, 64, 64,
                                           arrival_ms=now))
        for wid, rid in self._to_start:
            self._started(wid, rid)
        self._to_start = []
        while self._to_finish and self._to_finish[0][0] <= now:
            _, wid, rid = self._to_finish.popleft()
            debtor = int(rid[1:7]) % self.debtor_every == 0
            self._apply(core.on_finished(rid, wid, ActualUsage(100, 128 if debtor else 32),
                                         now))
            self._running[wid] -= 1
        for wid, running in self._running.items():
            self._apply(core.on_pull(wid, 0, now))
            for d in core.select(wid, SLOTS - running, now):
                self._dispatched(d)
                self._running[wid] += 1
                self._to_start.append((wid, d.request.request_id))
                self._to_finish.append((now + SERVICE_MS, wid, d.request.request_id))
        self.now += STEP_MS
        if pass_every_ms is not None and self.now >= self._next_pass:
            self._next_pass = self.now + pass_every_ms
            self.housekeeping()
        if self.now >= self._next_snapshot:
            self._next_snapshot = self.now + SNAPSHOT_MS
            self.snapshot()

    def run_for(self, ms: float, pass_every_ms: float | None) -> None:
        end = self.now + ms
        while self.now < end:
            self.step(pass_every_ms)

    # --- inspection --------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        from prometheus_client import REGISTRY

        from dispatcher import metrics

        sched = self.core.scheduler
        book = getattr(sched.policy, "_book", None)
        states = list(book.states.values()) if book is not None else []
        t = self.tracker
        tracker_entries = sum(len(getattr(t, name, ())) for name in
                              ("_cum", "_recent", "_configs", "_tenants"))
        # A label set: one child of a metric (a histogram's buckets, _sum, _count and
        # _created are one); samples: the lines of /metrics with a tenant label.
        label_sets, samples = set(), 0
        for family in REGISTRY.collect():
            for s in family.samples:
                if "tenant" in s.labels:
                    samples += 1
                    label_sets.add((family.name, tuple(sorted(
                        (k, v) for k, v in s.labels.items() if k != "le"))))
        tenant_labels = getattr(metrics, "TENANTS", None)
        return {
            "tenant_loads": len(sched.tenant_loads()),
            "policy_states": len(states),
            "policy_states_in_debt": sum(1 for st in states if st.credit < 0)
            if sched.config.policy == "drr" else -1,
            "unknown_tenant_configs": len(sched.config._unknown),
            "stats_entries": tracker_entries,
            "tenant_label_sets": len(label_sets),
            "tenant_samples": samples,
            "metric_tenants": len(tenant_labels) if tenant_labels is not None else -1,
            "num_rejected": self.num_rejected,
            "num_in_flight": sched.num_in_flight,
        }

    def checkpoint(self, reps: int) -> dict[str, Any]:
        from prometheus_client import REGISTRY, generate_latest

        self.housekeeping()  # flush what the coarse churn passes left
        self.now += PASS_MS
        gc.collect()
        out: dict[str, Any] = {"tenants_arrived": self.num_arrived, "sim_s": self.now / 1000,
                               **self.counts(), "rss_mib": rss_mib(),
                               "allocated_blocks": sys.getallocatedblocks()}
        passes, snaps, renders, size = [], [], [], 0
        for _ in range(reps):
            # 200 ms of churn without a pass, then the pass a 200 ms period would run.
            self.run_for(PASS_MS, pass_every_ms=None)
            t0 = time.perf_counter()
            self.housekeeping()
            passes.append((time.perf_counter() - t0) * 1000)
            t0 = time.perf_counter()
            self.snapshot()
            snaps.append((time.perf_counter() - t0) * 1000)
            t0 = time.perf_counter()
            text = generate_latest(REGISTRY)
            renders.append((time.perf_counter() - t0) * 1000)
            size = len(text)
        out.update(pass_ms=passes, snapshot_ms=snaps, render_ms=renders, render_bytes=size)
        return out


def child(policy: str, a: argparse.Namespace) -> dict[str, Any]:
    churn = Churn(policy, a.tenants_per_s, a.idle_s, a.debtor_every, a.metrics_max_tenants)
    checkpoints = sorted(int(x) for x in a.checkpoints.split(","))
    t0 = time.perf_counter()
    rows = []
    # The passes run every 200 ms, as in the dispatcher, for the idle period (+ 5 s)
    # before each checkpoint, so the timed ones forget what 200 ms passes would.
    warm = (a.idle_s + 5) * a.tenants_per_s
    for target in checkpoints:
        while churn.num_arrived < target:
            coarse = churn.num_arrived < target - warm
            churn.step(a.churn_pass_s * 1000 if coarse else PASS_MS)
        rows.append(churn.checkpoint(a.reps))
        print(f"  {policy}: {target:,} tenants at {time.perf_counter() - t0:.0f} s",
              file=sys.stderr, flush=True)
    return {"policy": policy, "checkpoints": rows, "wall_s": time.perf_counter() - t0,
            "has_idle_sweep": hasattr(churn.core, "tenant_changes"),
            "has_metrics_hooks": churn.hooks}


# --- the parent: one child per policy, then the results file ----------------------------


def fmt_s(values: list[float], digits: int = 1) -> str:
    return summarize(values).fmt(digits)


def metrics_line(runs: list[dict[str, Any]], a: argparse.Namespace) -> str:
    if not all(r.get("has_metrics_hooks") for r in runs):
        return " Metrics: no tenant label bound (this code labels every tenant)."
    rejected = sum(r["checkpoints"][-1]["num_rejected"] for r in runs)
    return (f" Metrics through the dispatcher's hooks; at most {a.metrics_max_tenants:,} "
            f"tenants have label values of their own (`--metrics-max-tenants`), the rest "
            f"count as `_other`; requests refused or dropped (`rejected_total`): "
            f"{rejected:,}.")


def report(runs: list[dict[str, Any]], a: argparse.Namespace, load: tuple) -> str:
    lines = []
    sweep = all(r["has_idle_sweep"] for r in runs)
    lines.append(
        f"{a.num_tenants:,} tenants arrive at {a.tenants_per_s:g}/s (simulated), each "
        f"submits 1-3 requests (tokens cost), finished 2 s later on 8 × 64 slots; then the "
        f"tenant is gone for good. 1 tenant in {a.debtor_every} ends in debt (used more "
        f"than it declared). Idle period: "
        + (f"{a.idle_s:g} s (`PoolCore.tenant_idle_ms`), so the live set is about "
           f"{a.tenants_per_s:g}/s × {a.idle_s:g} s = {a.tenants_per_s * a.idle_s:,.0f} "
           f"tenants." if sweep else "none (this code keeps every tenant).")
        + metrics_line(runs, a)
        + f" Timings: {a.reps} repetitions at each checkpoint, median (min–max).")
    lines.append("")
    lines.append(f"Load average (1, 5, 15 min) at start: {load[0]}; at end: {load[1]} "
                 f"(2 cores shared with other work).")
    for r in runs:
        lines += ["", f"## {r['policy']} (wall {r['wall_s']:.0f} s)", ""]
        lines.append("| tenants arrived | tenant loads | policy states (in debt) | stats entries "
                     "| configs cached | tenant label sets | RSS MiB | allocated blocks "
                     "| housekeeping pass ms | stats snapshot ms | /metrics render ms "
                     "| /metrics KB |")
        lines.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for c in r["checkpoints"]:
            debt = c["policy_states_in_debt"]
            states = f"{c['policy_states']:,}" + (f" ({debt:,})" if debt >= 0 else "")
            lines.append(
                f"| {c['tenants_arrived']:,} | {c['tenant_loads']:,} | {states} "
                f"| {c['stats_entries']:,} | {c['unknown_tenant_configs']:,} "
                f"| {c['tenant_label_sets']:,} "
                f"| {fmt_num(c['rss_mib'], 0)} | {c['allocated_blocks']:,} "
                f"| {fmt_s(c['pass_ms'], 2)} | {fmt_s(c['snapshot_ms'], 2)} "
                f"| {fmt_s(c['render_ms'], 1)} | {c['render_bytes'] / 1024:,.0f} |")
    return "\n".join(lines) + "\n"


HOW_TO_READ = """\
Each row is a checkpoint: after that many tenants arrived. *Tenant loads* are the
scheduler's per-tenant counters (`Scheduler.tenant_loads`), *policy states* the policy's
per-(tier, tenant) fairness accounts (DRR deficits, VTC counters; "in debt": DRR states
with a negative deficit, kept until repaid), *stats entries* the stats tracker's
per-tenant dicts, *configs cached* the unlisted tenants' settings the pool config
caches, *tenant label sets* the children with a `tenant` label of the metrics in the
registry `/metrics` serves (a histogram's buckets count once). Flat columns from 10,000 tenants on mean the state follows the live
set (arrival rate × idle period), not every tenant ever seen. The housekeeping pass is
timed after 200 ms of churn, as the dispatcher's 200 ms pass sees it. RSS does not give
memory back to the OS readily: read allocated blocks for what is live."""


def dispatcher_default(name: str, fallback: Any) -> Any:
    """A `DispatcherSettings` field's default (`fallback` where the code has none)."""
    import msgspec

    from dispatcher.config import DispatcherSettings

    for f in msgspec.structs.fields(DispatcherSettings):
        if f.name == name:
            return f.default
    return fallback


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-tenants", type=int, default=100_000)
    ap.add_argument("--checkpoints", default="")
    ap.add_argument("--tenants-per-s", type=float, default=100.0)
    ap.add_argument("--idle-s", type=float, default=60.0)
    ap.add_argument("--debtor-every", type=int, default=100)
    ap.add_argument("--churn-pass-s", type=float, default=5.0)
    ap.add_argument("--metrics-max-tenants", type=int,
                    default=dispatcher_default("metrics_max_tenants", 1000),
                    help="the tenant label bound (default: the dispatcher's)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--policies", default="drr,vtc")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if not a.checkpoints:
        a.checkpoints = ",".join(str(n) for n in (1_000, 10_000, 50_000, 100_000)
                                 if n <= a.num_tenants)
    if a.child:
        print(json.dumps(child(a.child, a)))
        return
    meta = RunMeta.here()
    runs, (load0, load1) = run_children(__file__, a.policies.split(","))
    body = report(runs, a, (load0, load1))
    md, js = write_results(a.out, TITLE, body, {"runs": runs, "load_avg": [load0, load1],
                                                "args": vars(a) | {"out": str(a.out)}},
                           meta, HOW_TO_READ)
    print(body)
    print(f"wrote {md} and {js}", file=sys.stderr)


if __name__ == "__main__":
    main()
