"""Fleet-level fairness benchmark against the REAL fleet: `python bench/noisy_neighbor.py [--quick]`.

Starts a real nats-server (loopback, temp store) and, for each policy (fifo, drr, vtc),
a fresh dispatcher process plus simulated GPU workers (`python -m gpu_worker`, SimEngine),
then drives load with the producer library (`FairlaneClient`) from this process and
measures TTFT per request on the client's monotonic clock (submit -> first chunk).

Scenarios, per policy, on the same dispatcher (distinct tenants, fleet idle in between):
 0. B alone: tenant B sends 5 requests on an idle fleet (the reference).
 1. Noisy neighbour: A bursts N (10,000) requests, published with bounded concurrency;
    once all are queued, B sends 5. B's TTFT p50/p99. A's streams are read throughout;
    after B finishes, A's remainder is drained (fifo) or cancelled (others: cut off after
    `--drain-s`), so each run is bounded.
 2. Backlogged tenants, weights 1:2:4, and equal weights (4 tenants): closed-loop clients
    keep `--outstanding` requests per tenant in the system (far more than the fleet's
    slots), so every tenant is backlogged in the dispatcher for the whole window.
    Completed work = completion tokens streamed to the client inside the window (all
    requests have the same shape, so this is also the `tokens` cost share).

Prints markdown and writes the same to bench/results/noisy_neighbor.md (full mode) or
bench/results/noisy_neighbor.quick.md (--quick).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import quantile  # noqa: E402
from bench.fleet import Fleet, WorkerSpec  # noqa: E402
from bench.noisy_neighbor_report import report  # noqa: E402
from fairlane.embedded import NatsServer  # noqa: E402
from producer.client import FairlaneClient, RequestError, RequestSpec, SamplingParams  # noqa: E402

POLICIES = ["fifo", "drr", "vtc"]
WEIGHTED = {"w1": 1, "w2": 2, "w4": 4}
EQUAL = {"e1": 1, "e2": 1, "e3": 1, "e4": 1}
PROMPT = "x" * 128  # 32 prompt tokens (4 chars/token estimate)
PROMPT_TOKENS = 32
_RNG = random.Random(12345)
FIXED_LENGTHS = False


def tenants_yaml(quantum: float) -> str:
    tenants = {"A": 1, "B": 1, **WEIGHTED, **EQUAL}
    lines = [
        "tiers:",
        "  - {name: standard}",
        "pools:",
        "  default:",
        "    policy: drr",
        "    cost_model: tokens",
        f"    quantum: {quantum}",
        "    max_queued_total: 1000000",
        "tenants:",
    ]
    lines += [f"  {name}: {{tier: standard, weight: {w}}}" for name, w in tenants.items()]
    return "\n".join(lines) + "\n"


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if any(xs) else float("nan")


@dataclass
class Req:
    tenant: str
    t_submit: float = 0.0
    t_queued: float = 0.0  # publish acked
    t_first: float | None = None
    t_done: float | None = None
    num_tokens: int = 0
    error: str | None = None
    stream: object = None
    usage: object = None  # the final chunk's Usage (server-side queue_ms, ttft_ms)


@dataclass
class Tracker:
    """Submits requests and reads their streams; keeps per-request timings (seconds)."""

    client: FairlaneClient
    max_tokens: int
    reqs: list[Req] = field(default_factory=list)
    tasks: set[asyncio.Task] = field(default_factory=set)
    # (monotonic time, tenant, tokens) for every chunk, when recording
    token_log: list[tuple[float, str, int]] | None = None

    def spawn(self, tenant: str, sem: asyncio.Semaphore | None = None) -> Req:
        r = Req(tenant)
        self.reqs.append(r)
        t = asyncio.get_running_loop().create_task(self._run(r, sem))
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)
        return r

    async def submit(self, r: Req) -> None:
        loop = asyncio.get_running_loop()
        # Output lengths uniform in [mean/2, 3·mean/2] (deterministic RNG): with one fixed
        # length every batch slot frees in lockstep, an artifact (see --fixed-lengths).
        mean = self.max_tokens
        n_out = mean if FIXED_LENGTHS else _RNG.randint(max(1, mean // 2), mean * 3 // 2)
        r.t_submit = loop.time()
        r.stream = await self.client.submit(RequestSpec(
            tenant=r.tenant, prompt=PROMPT, sampling=SamplingParams(max_tokens=mean * 3 // 2),
            expected_output_tokens=n_out, return_token_ids=True))
        r.t_queued = loop.time()

    async def read(self, r: Req) -> None:
        loop = asyncio.get_running_loop()
        async for chunk in r.stream:
            now = loop.time()
            if r.t_first is None:
                r.t_first = now
            n = len(chunk.token_ids or ())
            if chunk.usage is not None:
                r.usage = chunk.usage
            r.num_tokens += n
            if self.token_log is not None and n:
                self.token_log.append((now, r.tenant, n))
        r.t_done = loop.time()

    async def _run(self, r: Req, sem: asyncio.Semaphore | None) -> None:
        try:
            if sem is not None:
                async with sem:
                    await self.submit(r)
            else:
                await self.submit(r)
            await self.read(r)
        except RequestError as exc:
            r.error = exc.error.code.value
        except asyncio.CancelledError:
            r.error = r.error or "bench_cancelled"
            raise

    async def cancel_all(self) -> int:
        """Cancel every unfinished request (stop reading, tell the fleet). Returns count."""
        n = 0
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*list(self.tasks), return_exceptions=True)
        for r in self.reqs:
            if r.t_done is None and r.stream is not None and not r.stream.is_done:
                await r.stream.cancel("bench_done")
                n += 1
        await self.client.nc.flush()
        return n


def ttft_ms(reqs: list[Req]) -> list[float]:
    return [(r.t_first - r.t_submit) * 1000 for r in reqs if r.t_first is not None]


def breakdown(reqs: list[Req]) -> dict:
    """p50 of client TTFT and its server-side parts (from the final chunk's Usage):
    dispatcher queue (ingest -> dispatch) and worker (accept -> first token)."""
    done = [r for r in reqs if r.t_first is not None and r.usage is not None]
    cl = [(r.t_first - r.t_submit) * 1000 for r in done]
    q = [float(r.usage.queue_ms) for r in done]
    w = [float(r.usage.ttft_ms) for r in done]
    rest = [c - a - b for c, a, b in zip(cl, q, w, strict=True)]
    return {"n": len(done), "client": quantile(cl, .5), "queue": quantile(q, .5), "worker": quantile(w, .5),
            "rest": quantile(rest, .5)}


async def wait_until(pred, timeout_s: float, step_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        await asyncio.sleep(step_s)
    return pred()


async def dispatcher_held(client: FairlaneClient, prefix: str) -> tuple[int, int]:
    """(un-acked held by the dispatcher, not yet delivered) on its JetStream consumer."""
    info = await client.js.consumer_info(f"{prefix.upper()}_REQUESTS", "disp_default_standard")
    return info.num_ack_pending, info.num_pending


async def settle(fleet: Fleet, client: FairlaneClient, prefix: str, timeout_s: float = 30) -> str:
    """Wait until the dispatcher holds nothing and the workers are idle."""
    deadline = time.monotonic() + timeout_s
    held = (-1, -1)
    while time.monotonic() < deadline:
        held = await dispatcher_held(client, prefix)
        if held == (0, 0):
            break
        await asyncio.sleep(0.2)
    idle = await fleet.wait_idle(max(1.0, deadline - time.monotonic()))
    return "ok" if held == (0, 0) and idle else f"NOT settled: held={held} idle={idle}"


# --- scenarios -------------------------------------------------------------------------------


async def b_probe(client: FairlaneClient, args, timeout_s: float) -> tuple[list[Req], Tracker]:
    tr = Tracker(client, args.max_tokens)
    bs = [tr.spawn("B") for _ in range(5)]
    await wait_until(lambda: all(r.t_done or r.error for r in bs), timeout_s)
    return bs, tr


async def scenario_alone(fleet, client, args) -> dict:
    bs, tr = await b_probe(client, args, 30)
    await tr.cancel_all()
    return {"b_ttft": ttft_ms(bs), "b_err": [r.error for r in bs if r.error],
            "b_parts": breakdown(bs)}


async def scenario_noisy(fleet, client, args, policy: str, notes: list[str]) -> dict:
    loop = asyncio.get_running_loop()
    tr = Tracker(client, args.max_tokens)
    sem = asyncio.Semaphore(args.publish_concurrency)
    t0 = loop.time()
    a_reqs = [tr.spawn("A", sem) for _ in range(args.burst)]
    await wait_until(lambda: all(r.t_queued or r.error for r in a_reqs), 300, 0.01)
    t_queued = loop.time()
    await asyncio.sleep(0.05)  # "shortly after"
    btr = Tracker(client, args.max_tokens)
    bs = [btr.spawn("B") for _ in range(5)]
    b_ok = await wait_until(lambda: all(r.t_done or r.error for r in bs), args.b_timeout_s)
    t_b = loop.time()
    # A's remainder: drain it (bounded), so fifo's makespan is real; then cancel the rest.
    await wait_until(lambda: all(r.t_done or r.error for r in a_reqs),
                     max(0.0, args.drain_s - (t_b - t_queued)))
    t_end = loop.time()
    a_done = [r for r in a_reqs if r.t_done]
    n_cancelled = await tr.cancel_all()
    await btr.cancel_all()
    st = await settle(fleet, client, fleet.prefix)
    if st != "ok":
        notes.append(f"{policy}/noisy: after cancel, {st}")
    a_err = [r.error for r in a_reqs if r.error and r.error != "bench_cancelled"]
    b_err = [r.error for r in bs if r.error]
    if not b_ok:
        notes.append(f"{policy}/noisy: B not finished within {args.b_timeout_s}s "
                     f"({sum(1 for r in bs if r.t_first)} of 5 got a first token)")
    return {
        "publish_s": t_queued - t0,
        "b_ttft": ttft_ms(bs),
        "b_parts": breakdown(bs),
        "b_first_after_queued_ms": [(r.t_first - t_queued) * 1000 for r in bs if r.t_first],
        "b_err": b_err,
        "a_done": len(a_done),
        "a_cancelled": n_cancelled,
        "a_err": a_err,
        "a_ttft_p50": quantile(ttft_ms(a_done), 0.5),
        "a_rate": len(a_done) / max(t_end - t0, 1e-9),
        "b_wait_s": t_b - t_queued,
    }


async def scenario_backlogged(fleet, client, args, weights: dict[str, float], policy: str,
                              notes: list[str]) -> dict:
    loop = asyncio.get_running_loop()
    tr = Tracker(client, args.max_tokens)
    tr.token_log = []
    stop = False

    async def closed_loop(tenant: str) -> None:
        while not stop:
            r = Req(tenant)
            tr.reqs.append(r)
            try:
                await tr.submit(r)
                await tr.read(r)
            except RequestError as exc:
                r.error = exc.error.code.value
                await asyncio.sleep(0.05)

    for tenant in weights:
        for _ in range(args.outstanding):
            t = loop.create_task(closed_loop(tenant))
            tr.tasks.add(t)
            t.add_done_callback(tr.tasks.discard)
    await asyncio.sleep(args.warmup_s)
    w0 = loop.time()
    held_samples = []
    while loop.time() < w0 + args.window_s:
        await asyncio.sleep(1.0)
        held_samples.append(await dispatcher_held(client, fleet.prefix))
    w1 = loop.time()
    stop = True
    await tr.cancel_all()
    st = await settle(fleet, client, fleet.prefix)
    if st != "ok":
        notes.append(f"{policy}/backlogged {list(weights)}: after cancel, {st}")
    tokens = dict.fromkeys(weights, 0)
    for t, tenant, n in tr.token_log:
        if w0 <= t < w1:
            tokens[tenant] += n
    total = sum(tokens.values())
    shares = {k: v / total if total else float("nan") for k, v in tokens.items()}
    wsum = sum(weights.values())
    target = {k: w / wsum for k, w in weights.items()}
    errs = [r.error for r in tr.reqs if r.error and r.error not in ("bench_cancelled",)]
    in_window = [r for r in tr.reqs if r.t_first and w0 <= r.t_first < w1]
    return {
        "tokens": tokens, "shares": shares, "target": target,
        "jain": jain([shares[k] / target[k] for k in weights]),
        "tok_per_s": total / (w1 - w0),
        "min_held": min(h[0] for h in held_samples) if held_samples else None,
        "errors": errs,
        "ttft_p50": {k: quantile(ttft_ms([r for r in in_window if r.tenant == k]), 0.5)
                     for k in weights},
    }


async def run_policy(policy: str, nats_url: str, args, log_root: Path, run_id: str,
                     notes: list[str]) -> dict:
    # A variant "drr-p0" runs policy drr with workers' --prefetch-seqs 0.
    base_policy, _, variant = policy.partition("-p")
    prefetch = int(variant) if variant else args.prefetch_seqs
    prefix = f"nb{run_id}{base_policy}{variant and 'p' + variant}"
    spec = WorkerSpec(max_num_seqs=args.max_num_seqs, prefetch_seqs=prefetch,
                      time_scale=args.time_scale)
    fleet = Fleet(nats_url, prefix, tenants_yaml(args.quantum), base_policy, log_root / policy,
                  num_workers=args.workers, worker=spec)
    out: dict = {}
    client = None
    try:
        await fleet.start()
        client = await FairlaneClient.connect(nats_url, prefix=prefix,
                                              max_buffered_chunks=4096)
        # Warm up (imports, connections, first pulls).
        _, tr = await b_probe(client, args, 30)
        await tr.cancel_all()
        await settle(fleet, client, prefix)
        t = time.monotonic()
        out["alone"] = await scenario_alone(fleet, client, args)
        out["noisy"] = await scenario_noisy(fleet, client, args, policy, notes)
        out["alone_after"] = await scenario_alone(fleet, client, args)
        out["weighted"] = await scenario_backlogged(fleet, client, args, WEIGHTED, policy, notes)
        out["equal"] = await scenario_backlogged(fleet, client, args, EQUAL, policy, notes)
        out["elapsed_s"] = time.monotonic() - t
        print(f"  [{policy}] done in {out['elapsed_s']:.0f}s", file=sys.stderr, flush=True)
    finally:
        if client is not None:
            try:
                await asyncio.wait_for(client.close(), 10)
            except Exception as exc:  # noqa: BLE001
                notes.append(f"{policy}: client.close failed: {exc!r}")
        codes = await fleet.stop(grace_s=args.stop_grace_s)
        bad = {k: v for k, v in codes.items() if v not in (0,)}
        if bad:
            notes.append(f"{policy}: processes did not exit cleanly on SIGTERM: {bad} "
                         "(None = SIGKILLed after the grace period)")
        problems = fleet.log_problems(max_lines=0)
        out["log_problems"] = problems
    return out


async def amain(args) -> int:
    cmd = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    run_id = f"{os.getpid() % 100000}"
    notes: list[str] = []
    res: dict[str, dict] = {}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fl-nb-") as tmp:
        log_root = Path(args.log_dir) if args.log_dir else Path(tmp) / "logs"
        with NatsServer(store_dir=str(Path(tmp) / "js")) as ns:
            for policy in args.policies.split(","):
                print(f"policy {policy} ...", file=sys.stderr, flush=True)
                try:
                    res[policy] = await run_policy(policy, ns.url, args, log_root, run_id, notes)
                except Exception as exc:  # noqa: BLE001 - report and go on
                    notes.append(f"{policy}: run failed: {exc!r}")
                    res[policy] = {"error": repr(exc)}
    text = report(res, args, cmd, notes, time.monotonic() - t0,
                  prompt_tokens=PROMPT_TOKENS, weighted=WEIGHTED, equal=EQUAL)
    print(text)
    out = Path(args.output) if args.output else (
        Path(__file__).with_name("results") / ("noisy_neighbor.quick.md" if args.quick
                                               else "noisy_neighbor.md"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"(written to {out})", file=sys.stderr)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller burst, shorter windows (<3 min)")
    ap.add_argument("--policies", default=None,
                    help="comma-separated; 'drr-p0' = drr with workers' prefetch_seqs 0 "
                         "(default: fifo,drr,vtc,drr-p0; --quick: fifo,drr,vtc)")
    ap.add_argument("--stop-grace-s", type=float, default=6.0,
                    help="SIGTERM -> SIGKILL grace per fleet")
    ap.add_argument("--burst", type=int, default=None)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--prefetch-seqs", type=int, default=4)
    ap.add_argument("--time-scale", type=float, default=0.5)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--quantum", type=float, default=None,
                    help="DRR quantum (default: one request's tokens cost)")
    ap.add_argument("--publish-concurrency", type=int, default=256)
    ap.add_argument("--b-timeout-s", type=float, default=None)
    ap.add_argument("--drain-s", type=float, default=None,
                    help="max time to let A's burst drain after it is queued")
    ap.add_argument("--outstanding", type=int, default=None)
    ap.add_argument("--warmup-s", type=float, default=None)
    ap.add_argument("--window-s", type=float, default=None)
    ap.add_argument("--fixed-lengths", action="store_true",
                    help="every request exactly --max-tokens output tokens (lockstep batches)")
    ap.add_argument("--log-dir", default="", help="keep process logs here (default: temp)")
    ap.add_argument("--output", default="")
    args = ap.parse_args()
    q = args.quick
    defaults = {"burst": 2_000 if q else 10_000, "b_timeout_s": 60 if q else 150,
                "drain_s": 20 if q else 150, "outstanding": 60 if q else 100,
                "warmup_s": 2 if q else 3, "window_s": 6 if q else 15}
    if args.policies is None:
        args.policies = ",".join(POLICIES if q else [*POLICIES, "drr-p0"])
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    global FIXED_LENGTHS
    FIXED_LENGTHS = args.fixed_lengths
    if args.quantum is None:
        args.quantum = PROMPT_TOKENS + 2 * args.max_tokens
    return asyncio.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
