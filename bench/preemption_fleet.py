"""The fleet, tenants and probes of `bench/preemption.py` (split out for size): the
tenants file per variant, a `Fleet` with the dispatcher's metrics port, request
tracking and the probe loop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fleet import Fleet  # noqa: E402
from bench.preemption_report import PROMPT_TOKENS  # noqa: E402
from fairlane.protocol import Finished, Preempted, ProtocolError, decode_event  # noqa: E402
from producer.client import FairlaneClient, RequestError, RequestSpec, SamplingParams  # noqa: E402
from producer.spec import new_request_id  # noqa: E402

VARIANTS = ["fifo", "drr", "drr+preempt"]
PROMPT = "x" * 4 * PROMPT_TOKENS  # 4 chars per token, the producer's estimate
OUT_MIN, OUT_MAX = 128, 384  # output tokens, uniform (mean 256)
WEIGHTED = {"w1": 1, "w2": 2, "w4": 4}
TIERS = ("enterprise", "free")
POOL = "default"


def tenants_yaml(variant: str, args) -> str:
    policy = "fifo" if variant == "fifo" else "drr"
    if variant.startswith("drr+preempt"):
        _, _, after = variant.partition("@")
        after_ms = float(after) if after else args.preempt_after_ms
        # None: the pool defaults (a quiet tenant preempts at once, a backlogged one
        # after 200 ms).
        after = "" if after_ms is None else f"preempt_after_ms: {after_ms:g}, "
        pre = (f"{{enabled: true, {after}"
               f"min_run_ms: {args.min_run_ms:g}, max_per_s: {args.max_per_s}}}")
    else:
        pre = "{enabled: false}"
    # Default: one mean request's `tokens` cost (32 + 2 x 256).
    quantum = args.quantum or PROMPT_TOKENS + 2 * (OUT_MIN + OUT_MAX) // 2
    lines = [
        "tiers:",
        "  - {name: enterprise, engine_priority: 0}",
        "  - {name: free, engine_priority: 10}",
        "pools:",
        f"  {POOL}:",
        f"    policy: {policy}",
        "    cost_model: tokens",
        f"    quantum: {quantum}",
        "    max_queued_total: 1000000",
        f"    preemption: {pre}",
        "tenants:",
        "  A: {tier: free}",
        "  B: {tier: free}",
        "  F: {tier: free}",
        "  E: {tier: enterprise}",
        "  L: {tier: free}",
    ]
    lines += [f"  {k}: {{tier: free, weight: {w}}}" for k, w in WEIGHTED.items()]
    return "\n".join(lines) + "\n"


def tier_of(tenant: str) -> str:
    return "enterprise" if tenant == "E" else "free"


# --- the fleet, with the dispatcher's metrics port and preemption events ------------------------


_PER_TENANT = re.compile(
    r'^fairlane_dispatcher_(?P<name>dispatched_cost_total|queue_depth)'
    r'\{[^}]*tenant="(?P<tenant>[^"]+)"[^}]*\} (?P<value>\S+)$')
_PER_TENANT_KEY = {"dispatched_cost_total": "dispatched_cost", "queue_depth": "queue_depth"}


@dataclass
class PFleet(Fleet):
    """bench.fleet.Fleet + a Prometheus port on the dispatcher + Preempted/Finished
    events from fl.evt.<pool> (monotonic receive time)."""

    metrics_port: int = 0
    preempted: list[tuple[float, str]] = field(default_factory=list)  # (t, request id)
    # (t, tenant, num_recomputed_tokens, completion_tokens) per Finished with usage
    finished: list[tuple[float, str, int, int]] = field(default_factory=list)

    def _spawn(self, name, args, source=None):
        if name == "dispatcher" and self.metrics_port:
            args = [*args, "--metrics-port", str(self.metrics_port)]
        return super()._spawn(name, args, source)

    async def _on_event(self, msg) -> None:
        await super()._on_event(msg)
        try:
            ev = decode_event(msg.data)
        except ProtocolError:
            return
        now = time.monotonic()
        if isinstance(ev, Preempted):
            self.preempted.append((now, ev.request_id))
        elif isinstance(ev, Finished) and ev.usage is not None:
            self.finished.append((now, ev.usage.tenant, ev.usage.num_recomputed_tokens,
                                  ev.usage.completion_tokens))

    def scrape(self) -> dict[str, float]:
        """Sums (over labels) of the dispatcher's preemption counters; {} if unreachable."""
        if not self.metrics_port:
            return {}
        want = ("fairlane_dispatcher_preemptions_total",
                "fairlane_dispatcher_recomputed_tokens_total")
        out = dict.fromkeys(want, 0.0)
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                        timeout=3) as resp:
                text = resp.read().decode()
        except OSError:
            return {}
        for line in text.splitlines():
            for name in want:
                if line.startswith(name + "{") or line.startswith(name + " "):
                    with contextlib.suppress(ValueError):
                        out[name] += float(line.rsplit(" ", 1)[1])
            # DRR's own account per tenant (estimates at dispatch), beside the tokens the
            # client counts: tells a scheduling skew from one downstream of dispatch. And
            # each tenant's queue in the dispatcher: a "backlogged" tenant must never run dry.
            m = _PER_TENANT.match(line)
            if m:
                with contextlib.suppress(ValueError):
                    key = f"{_PER_TENANT_KEY[m['name']]}/{m['tenant']}"
                    out[key] = out.get(key, 0.0) + float(m["value"])
        return out

    def preempted_for(self) -> dict[str, str]:
        """waiting request id -> victim request id, from the dispatcher's preempt_ordered
        log lines."""
        out: dict[str, str] = {}
        f = self.log_dir / "dispatcher.log"
        if not f.exists():
            return out
        for line in f.read_text(errors="replace").splitlines():
            if "preempt_ordered" not in line:
                continue
            with contextlib.suppress(ValueError):
                d = json.loads(line)
                out[d.get("for_request_id", "")] = d.get("request_id", "")
        return out


def counter_deltas(m0: dict[str, float], m1: dict[str, float]) -> dict[str, float]:
    """The counters' increase between two `PFleet.scrape`s (gauges left out); {} if
    either scrape failed."""
    if not (m0 and m1):
        return {}
    return {k: m1[k] - m0.get(k, 0) for k in m1 if not k.startswith("queue_depth/")}


# --- requests -----------------------------------------------------------------------------------


@dataclass
class Req:
    tenant: str
    request_id: str = ""
    n_out: int = 0
    t_submit: float = 0.0
    t_queued: float = 0.0
    t_first: float | None = None
    t_done: float | None = None
    num_tokens: int = 0
    error: str | None = None
    stream: object = None
    usage: object = None


@dataclass
class Tracker:
    client: FairlaneClient
    rng: random.Random
    out_range: tuple[int, int] = (OUT_MIN, OUT_MAX)
    reqs: list[Req] = field(default_factory=list)
    tasks: set[asyncio.Task] = field(default_factory=set)
    token_log: list[tuple[float, str, int]] | None = None

    def spawn(self, tenant: str, sem: asyncio.Semaphore | None = None) -> Req:
        r = Req(tenant, new_request_id(), self.rng.randint(*self.out_range))
        self.reqs.append(r)
        t = asyncio.get_running_loop().create_task(self._run(r, sem))
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)
        return r

    async def submit(self, r: Req) -> None:
        loop = asyncio.get_running_loop()
        r.t_submit = loop.time()
        r.stream = await self.client.submit(RequestSpec(
            tenant=r.tenant, tier=tier_of(r.tenant), request_id=r.request_id, prompt=PROMPT,
            sampling=SamplingParams(max_tokens=self.out_range[1]),
            expected_output_tokens=r.n_out))
        r.t_queued = loop.time()

    async def read(self, r: Req) -> None:
        loop = asyncio.get_running_loop()
        async for chunk in r.stream:
            now = loop.time()
            if r.t_first is None:
                r.t_first = now
            n = chunk.num_tokens or len(chunk.token_ids or ())
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
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*list(self.tasks), return_exceptions=True)
        n = 0
        for r in self.reqs:
            if r.t_done is None and r.stream is not None and not r.stream.is_done:
                with contextlib.suppress(Exception):
                    await r.stream.cancel("bench_done")
                n += 1
        with contextlib.suppress(Exception):
            await self.client.nc.flush(timeout=10)
        return n


async def wait_until(pred, timeout_s: float, step_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        await asyncio.sleep(step_s)
    return pred()


async def held(client: FairlaneClient, prefix: str) -> tuple[int, int]:
    """(un-acked held by the dispatcher, not yet delivered) over both tiers' consumers."""
    a = p = 0
    for tier in TIERS:
        with contextlib.suppress(Exception):
            info = await client.js.consumer_info(f"{prefix.upper()}_REQUESTS",
                                                 f"disp_{POOL}_{tier}")
            a += info.num_ack_pending
            p += info.num_pending
    return a, p


async def settle(fleet: PFleet, client: FairlaneClient, timeout_s: float = 40) -> str:
    deadline = time.monotonic() + timeout_s
    h = (-1, -1)
    while time.monotonic() < deadline:
        h = await held(client, fleet.prefix)
        if h == (0, 0):
            break
        await asyncio.sleep(0.2)
    idle = await fleet.wait_idle(max(1.0, deadline - time.monotonic()))
    return "ok" if h == (0, 0) and idle else f"NOT settled: held={h} idle={idle}"


# --- scenarios ----------------------------------------------------------------------------------


def probe_record(r: Req, cutoff: float, victims: dict[str, str]) -> dict:
    """One probe: client TTFT (ms; if none by `cutoff`, the censored lower bound) and
    the server-side parts from its Usage."""
    u = r.usage
    ttft = (r.t_first - r.t_submit) * 1000 if r.t_first is not None else None
    return {
        "ttft_ms": ttft if ttft is not None else (cutoff - r.t_submit) * 1000,
        "censored": ttft is None,
        "queue_ms": float(u.queue_ms) if u is not None else None,
        "worker_ms": float(u.ttft_ms) if u is not None else None,
        "preempted_for": r.request_id in victims,
        "n_out": r.n_out,
        "request_id": r.request_id,
        "error": r.error,
    }


async def probe(client: FairlaneClient, tenant: str, args, rng: random.Random,
                duration_s: float, out_range: tuple[int, int] = (OUT_MIN, OUT_MAX),
                done_grace_s: float | None = None) -> tuple[list[Req], Tracker, float]:
    """One request from `tenant` every `args.probe_interval_s` for `duration_s`; waits
    for their first tokens (bounded) and for those started to finish (bounded, for
    their Usage). Returns (probes, tracker, cutoff time)."""
    loop = asyncio.get_running_loop()
    tr = Tracker(client, rng, out_range)
    t0 = loop.time()
    k = 0
    while True:
        target = t0 + k * args.probe_interval_s
        if target >= t0 + duration_s:
            break
        delay = target - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tr.spawn(tenant)
        k += 1
    reqs = list(tr.reqs)
    await wait_until(lambda: all(r.t_first or r.error for r in reqs), args.first_grace_s)
    cutoff = loop.time()
    await wait_until(lambda: all(r.t_done or r.error for r in reqs if r.t_first),
                     args.done_grace_s if done_grace_s is None else done_grace_s)
    return reqs, tr, cutoff


async def probe_records(client: FairlaneClient, tenant: str, args, seed: int,
                        duration_s: float, out_range: tuple[int, int],
                        done_grace_s: float | None = None) -> tuple[list[dict], float]:
    """`probe`, then its leftovers cancelled: (the probe records, `preempted_for` unset:
    the caller reads the dispatcher's log; the loop time at which probing began)."""
    t0 = asyncio.get_running_loop().time()
    reqs, tr, cutoff = await probe(client, tenant, args, random.Random(seed), duration_s,
                                   out_range, done_grace_s=done_grace_s)
    await tr.cancel_all()
    return [probe_record(r, cutoff, {}) for r in reqs], t0
