"""The fidelity benchmark's load generator (`bench/fidelity_real.py`): requests
submitted at their arrival times with the producer library, every stream read and
timed on the machine's monotonic clock (`loop.time()`, the same in every process).

Used in one process for every traffic class (`fidelity_real.SHARED`) or in one client
process per class (`bench/fidelity_clients.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

from fleetsim.records import Arrival
from fleetsim.workload import Workload
from producer.client import FairlaneClient, RequestError, RequestSpec, SamplingParams

CHARS_PER_TOKEN = 4  # fairlane.validation.estimate_prompt_tokens: (chars + 3) // 4
PUBLISH_CONCURRENCY = 256  # a tenant's submits in flight at once (as bench/preemption.py)


def prompt_of(num_tokens: int) -> str:
    """A prompt the workers count as exactly `num_tokens` tokens."""
    return "x" * (CHARS_PER_TOKEN * num_tokens)


@dataclass
class Live:
    """One arrival's request on the real fleet (loop-clock seconds)."""

    cls: str
    tenant: str
    tier: str
    arrival: Arrival
    t_sub: float | None = None
    t_first: float | None = None
    t_done: float | None = None
    num_tokens: int = 0
    error: str | None = None
    stream: Any = None  # its RequestStream once submitted
    usage: Any = None  # its last chunk's `Usage` (where its TTFT went)


@dataclass
class LoadGen:
    """Submits arrivals at t0 + t_s and reads their streams; tokens go to `obs` as
    they arrive (it counts those inside its window)."""

    client: FairlaneClient
    obs: Any  # bench.fidelity_obs.Observations
    t0: float = 0.0
    lives: list[Live] = field(default_factory=list)
    tasks: set[asyncio.Task] = field(default_factory=set)
    # Per tenant: a burst's publishes must not hold up another tenant's submit (they
    # would be separate clients in production).
    sems: dict[str, asyncio.Semaphore] = field(default_factory=dict)

    async def request(self, live: Live) -> None:
        loop = asyncio.get_running_loop()
        live.t_sub = loop.time()
        a = live.arrival
        try:
            sem = self.sems.setdefault(live.tenant, asyncio.Semaphore(PUBLISH_CONCURRENCY))
            async with sem:
                stream = live.stream = await self.client.submit(RequestSpec(
                    tenant=live.tenant, tier=live.tier, prompt=prompt_of(a.prompt_tokens),
                    sampling=SamplingParams(max_tokens=a.max_tokens),
                    expected_output_tokens=min(a.output_tokens, a.max_tokens)))
            async for chunk in stream:
                if chunk.usage is not None:
                    live.usage = chunk.usage
                n = chunk.num_tokens or len(chunk.token_ids or ())
                if not n:
                    continue
                now = loop.time()
                if live.t_first is None:
                    live.t_first = now
                live.num_tokens += n
                self.obs.generated(live.cls, now - self.t0, now - self.t0, n)
            live.t_done = loop.time()
        except RequestError as exc:
            live.error = exc.error.code.value

    async def run(self, lives: list[Live], t0: float) -> None:
        """Start each request at its arrival time (`lives` in time order)."""
        loop = asyncio.get_running_loop()
        self.t0 = t0
        for live in lives:
            delay = t0 + live.arrival.t_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            self.lives.append(live)
            task = loop.create_task(self.request(live))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def run_window(self, lives: list[Live], t0: float, run_s: float) -> None:
        """`run`, then wait until t0 + run_s or until every request arriving in the
        window has ended (the CPU snapshot goes between this and `finish`)."""
        await self.run(lives, t0)
        loop = asyncio.get_running_loop()
        while loop.time() < t0 + run_s and any(
                lv.t_done is None and lv.error is None for lv in self.lives
                if self.obs.in_window(lv.arrival.t_s)):
            await asyncio.sleep(0.1)

    async def finish(self) -> tuple[list[float], list[str]]:
        """Cancel what is left, report every request into `obs`; (lag ms, error codes)."""
        await self.cancel_all()
        self.report()
        return self.lag_ms(), [lv.error for lv in self.lives if lv.error]

    async def cancel_all(self) -> None:
        """Stop reading and cancel the unfinished requests upstream (a stream whose
        reader stops is only forgotten by the client library; its work would go on)."""
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*list(self.tasks), return_exceptions=True)
        for live in self.lives:
            if live.t_done is None and live.stream is not None and not live.stream.is_done:
                with contextlib.suppress(Exception):
                    await live.stream.cancel("bench_done")
        with contextlib.suppress(Exception):
            await self.client.nc.flush(timeout=10)

    def report(self) -> None:
        """Every request's times into `obs` (relative to t0); unfinished ones count as
        arrived, and with their first token if they had one (censored otherwise)."""
        for live in self.lives:
            a, cls = live.arrival, live.cls
            self.obs.arrival(cls, a.t_s)
            if live.t_sub is None or live.t_first is None:
                continue
            ttft_s = live.t_first - live.t_sub
            self.obs.first_token(cls, a.t_s, ttft_s)
            if live.t_done is not None and live.error is None:
                self.obs.finished(cls, a.t_s, live.t_done - live.t_sub, ttft_s, live.num_tokens)
                u = live.usage
                if u is not None and u.attempt == 0:  # never preempted: one attempt
                    self.obs.ttft_split(cls, a.t_s, ttft_s, u.queue_ms / 1000, u.ttft_ms / 1000)

    def lag_ms(self) -> list[float]:
        """How late each measured arrival's submit began (the generator's lag)."""
        return [(lv.t_sub - self.t0 - lv.arrival.t_s) * 1000 for lv in self.lives
                if lv.t_sub is not None and self.obs.in_window(lv.arrival.t_s)]


def lives_of(wl: Workload, arrivals: list[Arrival], class_of: list[str]) -> list[Live]:
    t = wl.tenants
    return [Live(class_of[a.tenant], t.names[a.tenant], t.tiers[t.tier_of[a.tenant]], a)
            for a in arrivals]


async def warm_up(client: FairlaneClient, lives: list[Live]) -> None:
    """One short request per class (imports, connections, the first pulls), awaited."""
    seen: dict[str, Live] = {}
    for lv in lives:
        seen.setdefault(lv.cls, lv)
    gen = LoadGen(client, obs=NullObservations())
    for lv in seen.values():
        a = Arrival(0.0, lv.arrival.tenant, 32, 8, 8)
        await asyncio.wait_for(gen.request(Live(lv.cls, lv.tenant, lv.tier, a)), 30)


class NullObservations:
    """Observations that keep nothing (warm-up and idle probes)."""

    def generated(self, *args: Any) -> None:
        pass

