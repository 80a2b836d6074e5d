"""Fleet-level preemption on the REAL fleet (issue 10): `python bench/preemption.py [--quick]`.

Three variants that differ ONLY in the tenants file, run interleaved (order reversed
every other repetition, `bench.harness`), each on a fresh dispatcher + 2 simulated GPU
workers (`python -m gpu_worker --engine sim`) behind one loopback nats-server:

    fifo          policy: fifo, preemption: {enabled: false}
    drr           policy: drr,  preemption: {enabled: false}
    drr+preempt   policy: drr,  preemption: {enabled: true}  (the pool defaults)

Workload: step model `default` (7B-class step times) at time scale 1.0, 2 workers x
`--max-num-seqs 32`, 32 prompt tokens, output lengths uniform in 128-384 (mean 256; the
simulator honours `expected_output_tokens`). TTFT = the client's monotonic clock from
`submit()` to the first chunk. Scenarios per (variant, repetition), fleet idle between:

 0. alone (first `--alone-reps` repetitions): B probes the idle fleet, one request every
    100 ms for `--alone-s` (20.5 s -> >= 200 samples); then E (enterprise) and L (short
    outputs) the same. The references.
 1. noisy neighbour: A (free tier) publishes `--burst` requests (10,000; bounded publish
    concurrency) so the fleet is full with a deep backlog; `--turnover-s` (5 s) later,
    when slots turn over steadily, B (same tier, same weight) probes every 100 ms for
    `--probe-s` (20.5 s -> >= 200 samples). B's requests have A's length distribution
    and run to their end. NOTE: at 10/s x ~3 s each, B alone holds ~27-32 of the 64
    slots, i.e. B's demand IS its equal-weight fair share: under any fair policy B is a
    critically loaded queue of its own once A competes.
 1b. light neighbour (not in the issue): on the same backlog of A, after B's phase, L
    probes every 100 ms with 16-48 output tokens (~2 slots: well under its share).
 2. tier reclaim: F (free) bursts `--tier-burst` (2,000, ~100 s of work), E (enterprise,
    above free) probes every 100 ms for `--probe-s`.
 3. backlogged 1:2:4: tenants w1, w2, w4 (free tier, weights 1, 2, 4) each keep
    `--outstanding` requests in the system (closed loop; far above the 64 slots), every
    slot busy; after a `--warmup-s` (15 s) start-up, over a `--window-s` (60 s)
    window: completion tokens/s (throughput, compared with fifo of the same
    repetition), each tenant's share of the tokens
    streamed, preemptions/s (Preempted events on fl.evt.<pool>, cross-checked with the
    dispatcher's fairlane_dispatcher_preemptions_total) and recomputed prefill tokens
    (Finished events' usage) as % of tokens generated.

Workers run with the worker's default prefetch (`--prefetch-seqs 4`) in every variant:
the waiting request travels with the preemption order and outranks the prefetched work
in the engine's queue (its tier's first engine priority), and pulls report how many of
their items would start at once, so prefetch no longer hides a full fleet from the
preemption decision. `--prefetch-seqs 0` runs without prefetch.

drr+preempt runs the pool defaults: a quiet tenant (running + queued within its fair
share) preempts at once, a backlogged one after being short for `preempt_after_ms`
(2,000); the target is
B's p99 <= 1.5x its p99 on an idle fleet (~20-30 ms), about one decode step of slack.
The hysteresis (min_run_ms, default 1 s) and the rate cap (max_per_s, default 20) bound
the cost. `--preempt-after-ms` sets the backlogged threshold (variant `drr+preempt@50`
runs 50 ms beside it).

Writes bench/results/preemption.md + .json (--quick: preemption.quick.md/.json).
Runtime on the 2-core dev VM: full 29 min (3 reps x 3 variants; alone references in
the first rep only), --quick ~4 min (1 rep, burst 1,000, 5 s probe windows: tails there
are "max=" by construction).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fleet import WorkerSpec  # noqa: E402
from bench.harness import RunMeta, run_interleaved, write_results  # noqa: E402
from bench.preemption_fleet import (  # noqa: E402
    OUT_MAX,
    OUT_MIN,
    VARIANTS,
    WEIGHTED,
    PFleet,
    Req,
    Tracker,
    counter_deltas,
    held,
    probe_records,
    settle,
    tenants_yaml,
    wait_until,
)
from bench.preemption_prober import prober_argv, run_prober  # noqa: E402
from bench.preemption_report import HOW_TO_READ, STEP_MODEL, TITLE, report  # noqa: E402
from fairlane.embedded import NatsServer, free_port  # noqa: E402
from producer.client import FairlaneClient, RequestError  # noqa: E402
from producer.spec import new_request_id  # noqa: E402


async def run_probe(fleet: PFleet, client, args, tenant: str, seed: int, duration_s: float,
                    out_range: tuple[int, int],
                    done_grace_s: float | None = None) -> tuple[list[dict], float]:
    """Probe as `tenant` for `duration_s`: in a client process of its own (`--prober
    process`, bench/preemption_prober.py) or on the bench's client (`inline`). Returns
    the probe records (`preempted_for` still False: the caller fills it in) and this
    loop's time when probing began. Leftover probes are cancelled."""
    if args.prober == "process":
        argv = prober_argv(nats_url=fleet.nats_url, prefix=fleet.prefix, tenant=tenant,
                           seed=seed, duration_s=duration_s, out_range=out_range, args=args,
                           done_grace_s=done_grace_s)
        grace = args.done_grace_s if done_grace_s is None else done_grace_s
        return await run_prober(argv, duration_s + args.first_grace_s + grace + 60)
    return await probe_records(client, tenant, args, seed, duration_s, out_range, done_grace_s)


async def scenario_alone(fleet: PFleet, client, args, tenant: str, seed: int,
                         notes: list[str], tag: str,
                         out_range: tuple[int, int] = (OUT_MIN, OUT_MAX)) -> dict:
    # No Usage needed here (the split is reported for the bursts only): cancel at once.
    records, _ = await run_probe(fleet, client, args, tenant, seed, args.alone_s, out_range,
                                 done_grace_s=0.0)
    st = await settle(fleet, client)
    if st != "ok":
        notes.append(f"{tag}/alone {tenant}: {st}")
    return {"probes": records}


Phase = tuple[str, str, tuple[int, int]]  # (result key, prober tenant, output range)


async def scenario_burst(fleet: PFleet, client, args, *, flood: str, burst: int,
                         phases: list[Phase], seed: int, notes: list[str],
                         tag: str) -> dict[str, dict]:
    """`flood` publishes `burst` requests; once they are all queued and the fleet is
    full, and `args.turnover_s` later (the burst's first requests all started together
    and would otherwise end together: no slot frees for ~1.6 s, then many at once), each
    phase's prober probes in turn (its leftovers cancelled before the next phase), all
    on the same backlog. Then the burst's remainder is cancelled. {key: result}."""
    loop = asyncio.get_running_loop()
    tr = Tracker(client, random.Random(seed))
    sem = asyncio.Semaphore(args.publish_concurrency)
    t0 = loop.time()
    flood_reqs = [tr.spawn(flood, sem) for _ in range(burst)]
    await wait_until(lambda: all(r.t_queued or r.error for r in flood_reqs), 300, 0.02)
    publish_s = loop.time() - t0
    # The fleet is full once the first `slots` of the burst have started.
    await wait_until(lambda: sum(1 for r in flood_reqs if r.t_first) >= args.slots, 30)
    await asyncio.sleep(args.turnover_s)
    out: dict[str, dict] = {}
    for k, (key, prober, out_range) in enumerate(phases):
        m0 = await asyncio.to_thread(fleet.scrape)
        probes, t_probe = await run_probe(fleet, client, args, prober, seed + 1 + k,
                                          args.probe_s, out_range)
        t_end = t_probe + args.probe_s
        m1 = await asyncio.to_thread(fleet.scrape)
        victims = fleet.preempted_for()
        for p in probes:
            p["preempted_for"] = p["request_id"] in victims
        n_pre = sum(1 for t, _ in fleet.preempted if t_probe <= t < t_end)
        out[key] = {
            "publish_s": publish_s,
            "probes": probes,
            "probe_window_s": args.probe_s,
            "preempted_events": n_pre,
            "prom_delta": counter_deltas(m0, m1),
            "flood_backlog": sum(1 for r in flood_reqs if not r.t_first and not r.error),
            "errors": [p["error"] for p in probes
                       if p["error"] and p["error"] != "bench_cancelled"],
        }
    n_cancel = await tr.cancel_all()
    st = await settle(fleet, client)
    if st != "ok":
        notes.append(f"{tag}/{flood} burst: after cancel, {st}")
    errs = [r.error for r in flood_reqs if r.error and r.error != "bench_cancelled"]
    if errs:
        notes.append(f"{tag}/{flood} burst: {len(errs)} errors {sorted(set(errs))}")
    for v in out.values():
        v["flood_cancelled"] = n_cancel
    return out


async def scenario_backlogged(fleet: PFleet, client, args, seed: int, notes: list[str],
                              tag: str) -> dict:
    loop = asyncio.get_running_loop()
    tr = Tracker(client, random.Random(seed))
    tr.token_log = []
    stop = False

    async def closed_loop(tenant: str) -> None:
        while not stop:
            r = Req(tenant, new_request_id(), tr.rng.randint(OUT_MIN, OUT_MAX))
            tr.reqs.append(r)
            try:
                await tr.submit(r)
                await tr.read(r)
            except RequestError as exc:
                r.error = exc.error.code.value
                await asyncio.sleep(0.05)

    for tenant in WEIGHTED:
        for _ in range(args.outstanding):
            t = loop.create_task(closed_loop(tenant))
            tr.tasks.add(t)
            t.add_done_callback(tr.tasks.discard)
    await asyncio.sleep(args.warmup_s)
    m0 = await asyncio.to_thread(fleet.scrape)
    w0 = time.monotonic()
    lw0 = loop.time()
    held_samples = []
    # Each tenant's dispatcher queue, once a second: the shares mean something only if
    # every tenant stayed backlogged (a tenant whose queue ran dry got less by demand).
    min_queue = dict.fromkeys(WEIGHTED, math.inf)
    while loop.time() < lw0 + args.window_s:
        await asyncio.sleep(min(1.0, max(0.0, lw0 + args.window_s - loop.time())))
        held_samples.append(await held(client, fleet.prefix))
        depths = await asyncio.to_thread(fleet.scrape)
        for tenant in WEIGHTED:
            if f"queue_depth/{tenant}" in depths:
                min_queue[tenant] = min(min_queue[tenant], depths[f"queue_depth/{tenant}"])
    lw1 = loop.time()
    w1 = time.monotonic()
    m1 = await asyncio.to_thread(fleet.scrape)
    stop = True
    await tr.cancel_all()
    st = await settle(fleet, client)
    if st != "ok":
        notes.append(f"{tag}/backlogged: after cancel, {st}")
    tokens = dict.fromkeys(WEIGHTED, 0)
    for t, tenant, n in tr.token_log:
        if lw0 <= t < lw1:
            tokens[tenant] += n
    total = sum(tokens.values())
    span = lw1 - lw0
    wsum = sum(WEIGHTED.values())
    n_pre = sum(1 for t, _ in fleet.preempted if w0 <= t < w1)
    recomputed = sum(rc for t, _, rc, _ in fleet.finished if w0 <= t < w1)
    # The same shares counted on the server's side: completion tokens of the requests
    # that finished in the window (Finished events), beside the client's streamed count.
    finished_tokens = dict.fromkeys(WEIGHTED, 0)
    for t, tenant, _, n in fleet.finished:
        if w0 <= t < w1 and tenant in finished_tokens:
            finished_tokens[tenant] += n
    errs = [r.error for r in tr.reqs if r.error and r.error != "bench_cancelled"]
    return {
        "window_s": span,
        "tokens": tokens,
        "tok_per_s": total / span,
        "shares": {k: v / total if total else None for k, v in tokens.items()},
        "finished_tokens": finished_tokens,
        "target": {k: w / wsum for k, w in WEIGHTED.items()},
        "preemptions": n_pre,
        "preemptions_per_s": n_pre / span,
        "recomputed_tokens": recomputed,
        "recomputed_pct": 100 * recomputed / total if total else None,
        "prom_delta": counter_deltas(m0, m1),
        "min_queued": min((h[0] + h[1] for h in held_samples), default=None),
        "min_queue_depth": {k: (None if v == math.inf else v) for k, v in min_queue.items()},
        "errors": errs,
    }


# --- one (variant, repetition) -------------------------------------------------------------------


async def run_unit(variant: str, rep: int, *, nats_url: str, args, log_root: Path, run_id: str,
                   notes: list[str]) -> dict:
    short = {"fifo": "f", "drr": "d"}.get(variant) or "p" + variant.partition("@")[2]
    prefix = f"pe{run_id}{short}{rep}"
    tag = f"{variant}#{rep}"
    spec = WorkerSpec(max_num_seqs=args.max_num_seqs, prefetch_seqs=args.prefetch_seqs,
                      time_scale=args.time_scale, step_model=STEP_MODEL)
    fleet = PFleet(nats_url, prefix, tenants_yaml(variant, args), "fifo" if variant == "fifo"
                   else "drr", log_root / f"{variant}-{rep}", num_workers=args.workers,
                   worker=spec, metrics_port=free_port())
    out: dict = {"variant": variant, "rep": rep}
    client = None
    seed = 1000 * (rep + 1)
    try:
        await fleet.start()
        extra = {"silence_s": args.client_silence_s} if args.client_silence_s else {}
        client = await FairlaneClient.connect(nats_url, prefix=prefix, max_buffered_chunks=4096,
                                              **extra)
        # Warm-up: imports, connections, the first pulls.
        wtr = Tracker(client, random.Random(0))
        warm = [wtr.spawn(t) for t in ("B", "E", "B", "E")]
        await wait_until(lambda: all(r.t_first or r.error for r in warm), 30)
        await wtr.cancel_all()
        await settle(fleet, client)
        t = time.monotonic()
        sc = set(args.scenarios.split(","))
        light = tuple(args.light_out)
        if rep < args.alone_reps:
            if "noisy" in sc:
                out["alone_B"] = await scenario_alone(fleet, client, args, "B", seed + 1, notes,
                                                      tag)
            if "tier" in sc:
                out["alone_E"] = await scenario_alone(fleet, client, args, "E", seed + 2, notes,
                                                      tag)
            if "light" in sc:
                out["alone_L"] = await scenario_alone(fleet, client, args, "L", seed + 9, notes,
                                                      tag, light)
        phases = [(k, who, rng) for k, who, rng in
                  (("noisy", "B", (OUT_MIN, OUT_MAX)), ("light", "L", light)) if k in sc]
        if phases:
            out.update(await scenario_burst(fleet, client, args, flood="A", burst=args.burst,
                                            phases=phases, seed=seed + 3, notes=notes, tag=tag))
        if "tier" in sc:
            out.update(await scenario_burst(fleet, client, args, flood="F",
                                            burst=args.tier_burst, seed=seed + 5, notes=notes,
                                            tag=tag, phases=[("tier", "E", (OUT_MIN, OUT_MAX))]))
        if "backlogged" in sc:
            out["backlogged"] = await scenario_backlogged(fleet, client, args, seed + 7, notes,
                                                          tag)
        out["elapsed_s"] = time.monotonic() - t
    finally:
        if client is not None:
            try:
                await asyncio.wait_for(client.close(), 15)
            except Exception as exc:  # noqa: BLE001
                notes.append(f"{tag}: client.close failed: {exc!r}")
        codes = await fleet.stop(grace_s=args.stop_grace_s)
        bad = {k: v for k, v in codes.items() if v != 0}
        if bad:
            notes.append(f"{tag}: processes did not exit cleanly on SIGTERM: {bad} "
                         "(None = SIGKILLed after the grace period)")
        out["log_problems"] = fleet.log_problems(max_lines=0)
        out["num_preempt_ordered"] = len(fleet.preempted_for())
    return out


async def amain(args) -> int:
    meta = RunMeta.here()
    run_id = f"{os.getpid() % 100000}"
    notes: list[str] = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fl-pre-") as tmp:
        log_root = Path(args.log_dir) if args.log_dir else Path(tmp) / "logs"
        with NatsServer(store_dir=str(Path(tmp) / "js")) as ns:
            async def one(variant: str, rep: int) -> dict:
                return await run_unit(variant, rep, nats_url=ns.url, args=args,
                                      log_root=log_root, run_id=run_id, notes=notes)

            records = await run_interleaved(args.variants.split(","), args.reps, one)
    wall = time.monotonic() - t0
    body = report(records, args, notes, wall)
    print(body)
    out = Path(args.output) if args.output else (
        Path(__file__).with_name("results") / ("preemption.quick.md" if args.quick
                                               else "preemption.md"))
    data = {"args": vars(args), "wall_s": wall, "notes": notes,
            "records": [r.__dict__ for r in records]}
    md, js = write_results(out, TITLE, body, data, meta, HOW_TO_READ)
    print(f"(written to {md} and {js})", file=sys.stderr)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="1 rep, burst 1,000, 5 s windows: a ~4 min smoke (p99s become max=)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="of fifo, drr, drr+preempt (--preempt-after-ms), drr+preempt@MS")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--alone-reps", type=int, default=1,
                    help="repetitions (from the first) that also measure B and E alone")
    ap.add_argument("--burst", type=int, default=None, help="A's burst (default 10,000)")
    ap.add_argument("--tier-burst", type=int, default=None,
                    help="F's free-tier burst (default 2,000: ~100 s of fleet work)")
    ap.add_argument("--probe-s", type=float, default=None, help="probe window (default 20.5)")
    ap.add_argument("--alone-s", type=float, default=None, help="alone window (default 20.5)")
    ap.add_argument("--probe-interval-s", type=float, default=0.1)
    ap.add_argument("--turnover-s", type=float, default=5.0,
                    help="after the burst fills the fleet, wait this long before probing "
                         "(longer than the longest request: slots turn over steadily)")
    ap.add_argument("--scenarios", default="noisy,light,tier,backlogged",
                    help="of noisy,light,tier,backlogged ('light': A's burst again, probed "
                         "by L, whose outputs are --light-out tokens)")
    ap.add_argument("--light-out", type=int, nargs=2, default=[16, 48], metavar=("MIN", "MAX"))
    ap.add_argument("--first-grace-s", type=float, default=5.0,
                    help="after the window, how long probes may wait for a first token")
    ap.add_argument("--done-grace-s", type=float, default=5.0,
                    help="after that, how long started probes may take to finish (Usage)")
    ap.add_argument("--outstanding", type=int, default=60,
                    help="closed-loop requests per backlogged tenant")
    ap.add_argument("--warmup-s", type=float, default=None,
                    help="backlogged: seconds before the window (default 15): the closed "
                         "loops start one tenant after another, so the first fills the idle "
                         "fleet (work-conserving, not debt) and holds the excess until those "
                         "requests end (up to ~5 s at 384 tokens) or are preempted")
    ap.add_argument("--window-s", type=float, default=None)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--prefetch-seqs", type=int, default=4,
                    help="worker prefetch (the worker's default is 4; see the docstring)")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--preempt-after-ms", type=float, default=None,
                    help="default: the pool's (200 ms for a backlogged tenant; a quiet "
                         "one preempts at once)")
    ap.add_argument("--min-run-ms", type=float, default=1000.0)
    ap.add_argument("--max-per-s", type=int, default=20)
    ap.add_argument("--publish-concurrency", type=int, default=256)
    ap.add_argument("--quantum", type=float, default=0.0,
                    help="DRR quantum (default 544: one mean request's tokens cost)")
    ap.add_argument("--client-silence-s", type=float, default=0.0,
                    help="the bench client's silence_s (0: the library default, 3 s: every "
                         "queued stream silent that long asks the dispatcher its status)")
    ap.add_argument("--prober", choices=("process", "inline"), default="process",
                    help="where the quiet tenant's client runs: a process of its own, as "
                         "another organisation's client would (bench/preemption_prober.py), "
                         "or the bench's client that also reads the flood's tokens (the "
                         "layout of every run before 2026-11-27)")
    ap.add_argument("--stop-grace-s", type=float, default=6.0)
    ap.add_argument("--log-dir", default="", help="keep process logs here (default: temp)")
    ap.add_argument("--output", default="")
    args = ap.parse_args()
    q = args.quick
    defaults = {"reps": 1 if q else 3, "burst": 1_000 if q else 10_000,
                "tier_burst": 600 if q else 2_000, "probe_s": 5.0 if q else 20.5,
                "alone_s": 5.0 if q else 20.5, "warmup_s": 4.0 if q else 15.0,
                "window_s": 10.0 if q else 60.0}
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.slots = args.workers * args.max_num_seqs
    return asyncio.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
