"""Fairness on the REAL fleet (issue 12, BENCHMARKS.md section 2): `python bench/noisy_neighbor.py [--quick]`.

Policies (fifo, drr, vtc) run interleaved (order reversed every other repetition,
`bench.harness`), each (policy, repetition) on a fresh dispatcher + 2 simulated GPU
workers (`python -m gpu_worker --engine sim`, `--max-num-seqs 32`, prefetch 4, step
model `default`, time scale 1.0: the fleet of bench/preemption.py) behind one loopback
nats-server. Requests: 32 prompt tokens, output lengths uniform in 128–384 (mean 256;
the simulator honours `expected_output_tokens`). Preemption: the pool defaults (fifo
never preempts); `--no-preemption` turns it off. Per (policy, repetition), fleet idle
in between:

 1. weighted: tenants w1, w2, w4 (weights 1:2:4) each keep `--outstanding` requests in
    the system (closed loop, far above the 64 slots): after a warm-up on this same
    workload, completion tokens streamed to the client in the window (timestamped per
    chunk on the event loop's clock) give each tenant's share, the max relative error
    vs weight ÷ Σweights, and tokens/s (÷ fifo's in the same repetition).
 2. asymmetric: tenants h, l1, l2, l3 of equal weight; each light one offers
    `--light-share` (0.5) of an equal share of the fleet's capacity, h offers
    `--heavy-factor` (10) × that: 1.625× capacity in all (open-loop Poisson arrivals,
    one seed per repetition, the same for every policy). Capacity is measured once
    before the repetitions (fifo, 4 equal closed-loop tenants) and recorded with the
    offered rates. Per tenant: tokens/s in the window and its demand (the tokens its
    arrivals would stream inside the window if each started on arrival at the
    calibrated per-sequence pace); bench/render_noisy.py computes the max–min fair
    allocation, x_i, Jain's index and the light tenants' TTFT (submit -> first chunk;
    requests without a first token `--first-grace-s` after the window count as that
    cut-off, a lower bound).
 3. `--short` (off by default): both again with 8–24-token outputs (tenants s*), the
    extra short-request row (its own capacity calibration).

The old "B behind A's 10,000 burst" scenario is gone: bench/preemption.py measures it at
realistic lengths with >= 200 probes per repetition.

Writes bench/results/noisy_neighbor.md + .json (--quick: noisy_neighbor.quick.*), the
markdown rendered by bench/render_noisy.py. Runtime on the 2-core dev VM: full ~30 min
(3 policies x 5 reps, ~115 s per (policy, rep) + ~30 s calibration; `--short` adds
~75 s per (policy, rep) and a second calibration), --quick ~1.7 min (1 rep, 6-8 s
windows: the 1:2:4 shares have not settled by then and the tails are "max=").
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fleet import WorkerSpec  # noqa: E402
from bench.harness import RunMeta, run_interleaved, write_results  # noqa: E402
from bench.preemption_fleet import PFleet, Req, Tracker, held, settle, wait_until  # noqa: E402
from bench.render_noisy import HOW_TO_READ, TITLE, fluid_tokens, report  # noqa: E402
from fairlane.embedded import NatsServer  # noqa: E402
from producer.client import FairlaneClient, RequestError  # noqa: E402
from producer.spec import new_request_id  # noqa: E402

POLICIES = ["fifo", "drr", "vtc"]
PROMPT_TOKENS = 32  # bench.preemption_fleet.PROMPT: 128 characters
PROFILES = {"long": (128, 384), "short": (8, 24)}
TENANT_PREFIX = {"long": "", "short": "s"}  # distinct tenants per profile: no carried state
WEIGHTS = {"w1": 1, "w2": 2, "w4": 4}
HEAVY, LIGHTS = "h", ("l1", "l2", "l3")
CALIB = ("c1", "c2", "c3", "c4")


def tenants_yaml(policy: str, args) -> str:
    """One tier ("free", the tier bench.preemption_fleet.Tracker submits at), every
    tenant of every profile listed."""
    pre = "    preemption: {enabled: false}\n" if args.no_preemption else ""
    lines = ["tiers:", "  - {name: free}", "pools:", "  default:", f"    policy: {policy}",
             "    cost_model: tokens", f"    quantum: {args.quantum:g}",
             "    max_queued_total: 1000000", pre.rstrip("\n"), "tenants:"]
    for p in TENANT_PREFIX.values():
        lines += [f"  {p}{k}: {{tier: free, weight: {w}}}" for k, w in WEIGHTS.items()]
        lines += [f"  {p}{k}: {{tier: free}}" for k in (HEAVY, *LIGHTS, *CALIB)]
    return "\n".join(x for x in lines if x) + "\n"


def poisson_schedule(rates_per_s: dict[str, float], horizon_s: float,
                     seed: int) -> list[tuple[float, str]]:
    """(offset s, tenant) of every arrival in [0, horizon), merged in time order; each
    tenant its own RNG stream, so the schedule is a function of the seed alone."""
    out: list[tuple[float, str]] = []
    for i, (tenant, rate) in enumerate(rates_per_s.items()):
        rng, t = random.Random(seed * 100 + i), 0.0
        while rate > 0:
            t += rng.expovariate(rate)
            if t >= horizon_s:
                break
            out.append((t, tenant))
    return sorted(out)


def offered_rates(capacity_req_s: float, args, prefix: str = "") -> dict[str, float]:
    """Requests/s per tenant: each light one `light_share` of an equal (1/4) share, the
    heavy one `heavy_factor` × a light one."""
    light = args.light_share * capacity_req_s / (1 + len(LIGHTS))
    return {prefix + HEAVY: args.heavy_factor * light, **{prefix + k: light for k in LIGHTS}}


# --- scenarios -----------------------------------------------------------------------------------


async def closed_loop_window(fleet: PFleet, client, tenants: list[str], out_range, args,
                             warmup_s: float, window_s: float, seed: int, notes: list[str],
                             tag: str) -> dict:
    """`args.outstanding` closed-loop requests per tenant; after `warmup_s` (the same
    workload, not counted) the completion tokens each tenant streamed in the window."""
    loop = asyncio.get_running_loop()
    tr = Tracker(client, random.Random(seed), out_range)
    tr.token_log = []
    stop = False

    async def one_client(tenant: str) -> None:
        while not stop:
            r = Req(tenant, new_request_id(), tr.rng.randint(*out_range))
            tr.reqs.append(r)
            try:
                await tr.submit(r)
                await tr.read(r)
            except RequestError as exc:
                r.error = exc.error.code.value
                await asyncio.sleep(0.05)

    for tenant in tenants:
        for _ in range(args.outstanding):
            t = loop.create_task(one_client(tenant))
            tr.tasks.add(t)
            t.add_done_callback(tr.tasks.discard)
    await asyncio.sleep(warmup_s)
    # One clock: Tracker stamps chunks with loop.time(), which is time.monotonic(), the
    # clock PFleet stamps Preempted events with.
    w0 = loop.time()
    await asyncio.sleep(window_s)
    w1 = loop.time()
    queued = await held(client, fleet.prefix)
    stop = True
    await tr.cancel_all()
    st = await settle(fleet, client)
    if st != "ok":
        notes.append(f"{tag}: after cancel, {st}")
    tokens = dict.fromkeys(tenants, 0)
    for t, tenant, n in tr.token_log:
        if w0 <= t < w1:
            tokens[tenant] += n
    return {"window_s": w1 - w0, "tokens": tokens,
            "preemptions": sum(1 for t, _ in fleet.preempted if w0 <= t < w1),
            "held_at_end": list(queued),
            "errors": [r.error for r in tr.reqs if r.error and r.error != "bench_cancelled"]}


async def scenario_weighted(fleet, client, args, profile: str, seed: int, notes, tag) -> dict:
    p = TENANT_PREFIX[profile]
    out = await closed_loop_window(fleet, client, [p + k for k in WEIGHTS], PROFILES[profile],
                                   args, args.weighted_warmup_s, args.weighted_window_s, seed,
                                   notes, f"{tag}/{profile}/weighted")
    out["tokens"] = {k: out["tokens"][p + k] for k in WEIGHTS}
    out["weights"] = dict(WEIGHTS)
    return out


async def scenario_asymmetric(fleet: PFleet, client, args, profile: str, cal: dict,
                              seed: int, notes: list[str], tag: str) -> dict:
    """Open-loop Poisson arrivals at the offered rates for warm-up + window; per tenant
    the tokens streamed in the window and its demand (`fluid_tokens` of its arrivals,
    at the calibrated per-sequence pace); the light tenants' TTFTs."""
    loop = asyncio.get_running_loop()
    p = TENANT_PREFIX[profile]
    rates = {p + k: v for k, v in cal["offered_req_per_s"].items()}
    tr = Tracker(client, random.Random(seed + 1), PROFILES[profile])
    tr.token_log = []
    warm, span = args.asym_warmup_s, args.asym_window_s
    schedule = poisson_schedule(rates, warm + span, seed)
    planned: dict[str, float] = {}  # request id -> its scheduled arrival (loop clock)
    t0 = loop.time()
    for off, tenant in schedule:
        delay = t0 + off - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        planned[tr.spawn(tenant).request_id] = t0 + off
    w0, w1 = t0 + warm, t0 + warm + span
    await asyncio.sleep(max(0.0, w1 - loop.time()))
    queued = await held(client, fleet.prefix)
    lights = {p + k for k in LIGHTS}
    in_win = [r for r in tr.reqs if w0 <= planned[r.request_id] < w1]
    light_reqs = [r for r in in_win if r.tenant in lights]
    # Let the window's light requests get their first token (bounded: under fifo the
    # backlog only grows); the ones still without one count as the cut-off.
    await wait_until(lambda: all(r.t_first or r.error for r in light_reqs), args.first_grace_s)
    cutoff = loop.time()
    await tr.cancel_all()
    st = await settle(fleet, client)
    if st != "ok":
        notes.append(f"{tag}/{profile}/asymmetric: after cancel, {st}")
    tokens = dict.fromkeys(rates, 0)
    for t, tenant, n in tr.token_log:
        if w0 <= t < w1:
            tokens[tenant] += n
    offered = dict.fromkeys(rates, 0)  # whole requests arriving in the window
    for r in in_win:
        offered[r.tenant] += r.n_out
    demand = dict.fromkeys(rates, 0.0)
    for r in tr.reqs:
        demand[r.tenant] += fluid_tokens(planned[r.request_id], r.n_out, cal["token_s"], w0, w1)
    strip = len(p)
    ttft = [((r.t_first if r.t_first is not None else cutoff) - r.t_submit) * 1000
            for r in light_reqs if r.t_submit and not r.error]
    return {
        "window_s": span, "heavy": HEAVY,
        "tokens": {k[strip:]: v for k, v in tokens.items()},
        "offered_tokens": {k[strip:]: v for k, v in offered.items()},
        "demand_tokens": {k[strip:]: v for k, v in demand.items()},
        "offered_req_per_s": {k[strip:]: v for k, v in rates.items()},
        "arrivals_in_window": {k[strip:]: sum(1 for r in in_win if r.tenant == k) for k in rates},
        "light_ttft_ms": ttft,
        "light_censored": sum(1 for r in light_reqs if r.t_first is None and not r.error),
        "preemptions": sum(1 for t, _ in fleet.preempted if w0 <= t < w1),
        "held_at_end": list(queued),
        "errors": [r.error for r in tr.reqs if r.error and r.error != "bench_cancelled"],
    }


# --- fleets --------------------------------------------------------------------------------------


def make_fleet(policy: str, prefix: str, args, log_dir: Path, nats_url: str) -> PFleet:
    spec = WorkerSpec(max_num_seqs=args.max_num_seqs, prefetch_seqs=args.prefetch_seqs,
                      time_scale=args.time_scale, step_model="default")
    return PFleet(nats_url, prefix, tenants_yaml(policy, args), policy, log_dir,
                  num_workers=args.workers, worker=spec)


async def with_fleet(policy: str, prefix: str, args, log_dir: Path, nats_url: str,
                     notes: list[str], body) -> dict:
    """Start a fresh fleet, connect, warm the path up (imports, connections, first
    pulls), run `body(fleet, client)`, stop everything."""
    fleet = make_fleet(policy, prefix, args, log_dir, nats_url)
    client = None
    try:
        await fleet.start()
        client = await FairlaneClient.connect(nats_url, prefix=prefix, max_buffered_chunks=4096)
        wtr = Tracker(client, random.Random(0))
        # The calibration tenants: no measured tenant starts with a policy state.
        warm = [wtr.spawn(t) for t in (*CALIB, *CALIB)]
        await wait_until(lambda: all(r.t_first or r.error for r in warm), 30)
        await wtr.cancel_all()
        await settle(fleet, client)
        out = await body(fleet, client)
    finally:
        if client is not None:
            try:
                await asyncio.wait_for(client.close(), 15)
            except Exception as exc:  # noqa: BLE001
                notes.append(f"{prefix}: client.close failed: {exc!r}")
        codes = await fleet.stop(grace_s=args.stop_grace_s)
        bad = {k: v for k, v in codes.items() if v != 0}
        if bad:
            notes.append(f"{prefix}: processes did not exit cleanly on SIGTERM: {bad} "
                         "(None = SIGKILLed after the grace period)")
    out["log_problems"] = fleet.log_problems(max_lines=0)
    return out


async def calibrate(profile: str, args, log_root: Path, nats_url: str, run_id: str,
                    notes: list[str]) -> dict:
    """The fleet's capacity for this profile: fifo, 4 equal closed-loop tenants."""
    p = TENANT_PREFIX[profile]
    lo, hi = PROFILES[profile]

    async def body(fleet, client) -> dict:
        return await closed_loop_window(fleet, client, [p + k for k in CALIB], (lo, hi), args,
                                        args.calib_warmup_s, args.calib_window_s, 7,
                                        notes, f"calibration/{profile}")

    w = await with_fleet("fifo", f"nbc{run_id}{p}", args, log_root / f"calib-{profile}",
                         nats_url, notes, body)
    tok_s = sum(w["tokens"].values()) / w["window_s"]
    req_s = tok_s / ((lo + hi) / 2)
    # Every slot busy: each sequence streams one token per slots / tok_s seconds.
    return {"policy": "fifo", "warmup_s": args.calib_warmup_s, "window_s": w["window_s"],
            "tok_per_s": tok_s, "req_per_s": req_s, "errors": w["errors"],
            "token_s": args.workers * args.max_num_seqs / tok_s,
            "offered_req_per_s": {k: v for k, v in offered_rates(req_s, args).items()}}


async def run_unit(policy: str, rep: int, *, nats_url: str, args, log_root: Path, run_id: str,
                   calibration: dict, notes: list[str]) -> dict:
    tag = f"{policy}#{rep}"
    seed = 1000 * (rep + 1)  # the same for every policy of a repetition

    async def body(fleet, client) -> dict:
        t = time.monotonic()
        out: dict = {"profiles": {}}
        for k, profile in enumerate(args.profiles):
            out["profiles"][profile] = {
                "weighted": await scenario_weighted(fleet, client, args, profile,
                                                    seed + 10 * k, notes, tag),
                "asymmetric": await scenario_asymmetric(fleet, client, args, profile,
                                                        calibration[profile], seed + 10 * k + 5,
                                                        notes, tag)}
        out["elapsed_s"] = time.monotonic() - t
        return out

    return await with_fleet(policy, f"nb{run_id}{policy[0]}{rep}", args,
                            log_root / f"{policy}-{rep}", nats_url, notes, body)


def setup_of(args) -> dict:
    light, n = args.light_share, 1 + len(LIGHTS)
    return {
        "policies": args.policies.split(","), "reps": args.reps, "workers": args.workers,
        "max_num_seqs": args.max_num_seqs, "slots": args.workers * args.max_num_seqs,
        "prefetch_seqs": args.prefetch_seqs, "step_model": "default",
        "time_scale": args.time_scale, "prompt_tokens": PROMPT_TOKENS, "quantum": args.quantum,
        "preemption": "off" if args.no_preemption else "the pool defaults (fifo never preempts)",
        "profiles": {p: {"out_min": PROFILES[p][0], "out_max": PROFILES[p][1]}
                     for p in args.profiles},
        "weights": dict(WEIGHTS), "outstanding": args.outstanding,
        "warmup_s": {"weighted": args.weighted_warmup_s, "asymmetric": args.asym_warmup_s},
        "window_s": {"weighted": args.weighted_window_s, "asymmetric": args.asym_window_s},
        "asymmetric": {"light_share_frac": light, "heavy_factor": args.heavy_factor,
                       "offered_over_capacity": light * (len(LIGHTS) + args.heavy_factor) / n},
    }


async def amain(args) -> int:
    meta = RunMeta.here()
    run_id = f"{os.getpid() % 100000}"
    notes: list[str] = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fl-nb-") as tmp:
        log_root = Path(args.log_dir) if args.log_dir else Path(tmp) / "logs"
        with NatsServer(store_dir=str(Path(tmp) / "js")) as ns:
            calibration = {}
            for profile in args.profiles:
                print(f"calibrating {profile} ...", file=sys.stderr, flush=True)
                calibration[profile] = await calibrate(profile, args, log_root, ns.url, run_id,
                                                       notes)
                c = calibration[profile]
                print(f"  {c['tok_per_s']:,.0f} tok/s = {c['req_per_s']:.1f} req/s",
                      file=sys.stderr, flush=True)

            async def one(policy: str, rep: int) -> dict:
                return await run_unit(policy, rep, nats_url=ns.url, args=args, log_root=log_root,
                                      run_id=run_id, calibration=calibration, notes=notes)

            records = await run_interleaved(args.policies.split(","), args.reps, one)
    wall = time.monotonic() - t0
    data = {"setup": setup_of(args), "calibration": calibration, "notes": notes, "wall_s": wall,
            "records": [r.__dict__ for r in records], "args": vars(args)}
    body = report(data)
    print(body)
    out = Path(args.output) if args.output else (
        Path(__file__).with_name("results") / ("noisy_neighbor.quick.md" if args.quick
                                               else "noisy_neighbor.md"))
    md, js = write_results(out, TITLE, body, data, meta, HOW_TO_READ)
    print(f"(written to {md} and {js})", file=sys.stderr)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="1 rep, short windows: a ~2.5 min smoke (tails become max=)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--reps", type=int, default=None, help="default 5 (--quick: 1)")
    ap.add_argument("--short", action="store_true",
                    help="also the extra row: both scenarios with 8–24-token outputs")
    ap.add_argument("--outstanding", type=int, default=100,
                    help="closed-loop requests per backlogged tenant")
    ap.add_argument("--heavy-factor", type=float, default=10.0,
                    help="the heavy tenant's rate ÷ each light tenant's")
    ap.add_argument("--light-share", type=float, default=0.5,
                    help="each light tenant's rate as a fraction of an equal (1/4) share")
    ap.add_argument("--weighted-warmup-s", type=float, default=None)
    ap.add_argument("--weighted-window-s", type=float, default=None,
                    help="the 1:2:4 shares' window (default 60 s: the window the shares "
                         "target is stated over; --quick 6 s)")
    ap.add_argument("--asym-warmup-s", type=float, default=None)
    ap.add_argument("--asym-window-s", type=float, default=None)
    ap.add_argument("--calib-warmup-s", type=float, default=None)
    ap.add_argument("--calib-window-s", type=float, default=None)
    ap.add_argument("--first-grace-s", type=float, default=5.0,
                    help="after the asymmetric window, how long light requests may wait "
                         "for a first token before counting as the cut-off")
    ap.add_argument("--no-preemption", action="store_true",
                    help="preemption: {enabled: false} (default: the pool defaults)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--prefetch-seqs", type=int, default=4)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--quantum", type=float, default=PROMPT_TOKENS + 2 * 256,
                    help="DRR quantum (default 544: one mean request's tokens cost)")
    ap.add_argument("--stop-grace-s", type=float, default=6.0)
    ap.add_argument("--log-dir", default="", help="keep process logs here (default: temp)")
    ap.add_argument("--output", default="")
    args = ap.parse_args()
    q = args.quick
    defaults = {"reps": 1 if q else 5,
                "weighted_warmup_s": 4.0 if q else 8.0, "weighted_window_s": 6.0 if q else 60.0,
                "asym_warmup_s": 4.0 if q else 8.0, "asym_window_s": 8.0 if q else 35.0,
                "calib_warmup_s": 4.0 if q else 8.0, "calib_window_s": 5.0 if q else 15.0}
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.reps < 5 and not q:
        ap.error("headline figures need >= 5 repetitions (fewer only with --quick)")
    args.profiles = ["long", "short"] if args.short else ["long"]
    return asyncio.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
