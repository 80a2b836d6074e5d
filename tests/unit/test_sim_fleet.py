"""The fleet simulator's event loop (fleetsim.fleet) over the real PoolCore.

Pure and fast: no processes, virtual time. Checks that nothing is lost, that skipping
runs of engine steps changes nothing, and that the product's policies show through
(preemption shortens a quiet tenant's wait; DRR weights become token shares).
"""

from __future__ import annotations

import gc
import random
from collections import defaultdict

import pytest

from dispatcher.scheduler.spread import NOTHING_ELIGIBLE
from dispatcher.scheduler.types import QueuedRequest
from fairlane.poolconfig import PreemptionConfig, SchedulerConfig, TenantConfig
from fleetsim.fleet import Fleet, FleetSettings
from fleetsim.records import Arrival, TenantTable
from fleetsim.state import Pull, PullLine

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


class Collect:
    """A Sink that keeps everything (fine for a few thousand requests)."""

    def __init__(self) -> None:
        self.ttft: dict[int, list[tuple[float, float]]] = defaultdict(list)
        self.finished: list[tuple] = []
        self.rejected: list[tuple] = []
        self.tokens: dict[int, float] = defaultdict(float)
        self.window_tokens: dict[int, float] = defaultdict(float)
        self.window = (0.0, 0.0)
        self.preempted = 0
        self.recomputed: dict[int, int] = defaultdict(int)
        self.samples = 0

    def on_rejected(self, tenant, t_s, code):
        self.rejected.append((tenant, t_s, code))

    def on_first_token(self, tenant, t_s, ttft_s):
        self.ttft[tenant].append((round(t_s - ttft_s, 9), round(ttft_s, 9)))

    def on_finished(self, tenant, t_s, e2e_s, ttft_s, output_tokens, preemptions,
                    worker_ttft_s=0.0, client_s=0.0):
        self.finished.append((tenant, round(t_s, 9), round(e2e_s, 9), output_tokens, preemptions))

    def on_tokens(self, tenant, start_s, end_s, num_tokens):
        self.tokens[tenant] += num_tokens
        lo, hi = self.window
        if end_s > start_s and hi > lo:
            overlap = max(0.0, min(end_s, hi) - max(start_s, lo))
            self.window_tokens[tenant] += num_tokens * overlap / (end_s - start_s)

    def on_preempted(self, tenant, t_s):
        self.preempted += 1

    def on_recomputed(self, tenant, t_s, num_tokens):
        self.recomputed[tenant] += num_tokens

    def sample(self, t_s, queued_by_tier, running, busy_workers):
        self.samples += 1


def table(*names: str, weights=None) -> TenantTable:
    t = TenantTable(tiers=["standard"])
    for n in names:
        t.add(n, 0, (weights or {}).get(n, 1.0))
    return t


def config(t: TenantTable, *, policy="drr", preempt=True) -> SchedulerConfig:
    return SchedulerConfig(
        policy=policy, cost_model="tokens", quantum=544,
        tenants={n: TenantConfig(n, weight=w) for n, w in zip(t.names, t.weight_of, strict=True)},
        preemption=PreemptionConfig(enabled=preempt))


def flood_and_probe(seed=1, burst=3000, duration_s=40.0, probe_per_s=10.0):
    """A bursts at t=2 s (128-384 tokens); L probes (16-48 tokens) throughout."""
    rng = random.Random(seed)
    out = [Arrival(2.0 + i * 1e-4, 0, 32, rng.randint(128, 384), 384) for i in range(burst)]
    t = 0.0
    while True:
        t += rng.expovariate(probe_per_s)
        if t >= duration_s:
            break
        out.append(Arrival(t, 1, 32, rng.randint(16, 48), 48))
    out.sort(key=lambda a: a.t_s)
    return out


def run(arrivals, t, cfg, duration_s, **kw) -> tuple[Fleet, Collect]:
    sink = Collect()
    settings = FleetSettings(**{"num_workers": 2, "max_num_seqs": 32, "hint_output_tokens": True,
                                **kw})
    fleet = Fleet(cfg, t, sink, settings)
    fleet.run(iter(arrivals), duration_s)
    return fleet, sink


def test_every_request_ends_and_every_token_is_counted():
    rng = random.Random(3)
    t = table("a", "b", "c")
    arrivals = sorted((Arrival(rng.uniform(0, 20), rng.randrange(3), rng.randint(8, 64),
                               rng.randint(1, 300), 256) for _ in range(600)),
                      key=lambda a: a.t_s)
    fleet, sink = run(arrivals, t, config(t), 200.0)
    assert len(sink.finished) + len(sink.rejected) == len(arrivals)
    assert not sink.rejected
    want = sum(min(a.output_tokens, a.max_tokens) for a in arrivals)
    assert sum(f[3] for f in sink.finished) == want
    assert sum(sink.tokens.values()) == pytest.approx(want)
    assert fleet.scheduler.num_queued == 0 and fleet.scheduler.num_in_flight == 0
    assert sink.samples >= 200


def engines(fleet: Fleet) -> list[tuple]:
    """Each worker's engine at the end: steps, time, KV, preemptions, prefix cache."""
    return [(w.core.num_steps, round(w.core.sim_time_s, 6), w.core.free_blocks,
             w.core.kv_tokens_in_use, w.core.num_preemptions, w.core.num_recomputed_tokens,
             w.core.prefix_cache.num_blocks, len(w.core.running), w.core.num_waiting)
            for w in fleet.workers]


def test_runs_of_steps_change_nothing():
    """Whole runs of steps as one event (the speed-up) give exactly the step-by-step
    result: same finishes at the same times, same first tokens, same tokens per tenant,
    the same engines at the end (steps, KV, prefix cache)."""
    arrivals = flood_and_probe(burst=800, duration_s=15.0)
    t = table("A", "L")
    fast, a = run(arrivals, t, config(t), 60.0)
    slow, b = run(arrivals, t, config(t), 60.0, batch_runs=False)
    assert sorted(a.finished) == sorted(b.finished)
    assert a.ttft == b.ttft
    assert a.tokens == b.tokens
    assert a.preempted == b.preempted > 0
    assert a.recomputed == b.recomputed
    assert engines(fast) == engines(slow)
    assert fast.num_events < slow.num_events * 0.7


def test_recomputed_tokens_are_reported_per_tenant_as_the_engines_count_them():
    """A preemption's cost, the tokens prefilled again when the request is admitted
    again (fleet preemption: the continuation; KV exhaustion: the engine's own), goes
    to the tenant whose request it is, and adds up to the engines' counters."""
    arrivals = flood_and_probe(burst=800, duration_s=15.0)
    t = table("A", "L")
    fleet, sink = run(arrivals, t, config(t), 60.0)
    assert fleet.num_preemptions > 0
    engine_total = sum(w.core.num_recomputed_tokens for w in fleet.workers)
    assert sum(sink.recomputed.values()) == engine_total > 0
    # The flood's requests are the ones preempted for the light tenant.
    assert sink.recomputed[0] == engine_total
    # KV exhaustion alone (no fleet preemption: one tenant).
    rng = random.Random(8)
    t1 = table("a")
    arrivals = sorted((Arrival(rng.uniform(0, 12), 0, rng.randint(8, 900),
                               rng.randint(1, 400), 400) for _ in range(300)),
                      key=lambda a: a.t_s)
    fleet, sink = run(arrivals, t1, config(t1), 120.0, kv_tokens_total=16 * 400)
    assert fleet.num_preemptions == 0
    assert sum(w.core.num_preemptions for w in fleet.workers) > 0
    assert sink.recomputed[0] == sum(w.core.num_recomputed_tokens for w in fleet.workers) > 0


def test_runs_cut_mid_run_change_nothing():
    """Ended early (arrivals cut runs, work is still running at the end): the same."""
    rng = random.Random(8)
    t = table("a", "b", "c")
    arrivals = sorted((Arrival(rng.uniform(0, 12), rng.randrange(3), rng.randint(8, 900),
                               rng.randint(1, 400), 400) for _ in range(900)),
                      key=lambda a: a.t_s)
    fast, a = run(arrivals, t, config(t), 10.0, kv_tokens_total=16 * 400)
    slow, b = run(arrivals, t, config(t), 10.0, kv_tokens_total=16 * 400, batch_runs=False)
    assert sorted(a.finished) == sorted(b.finished)
    assert a.ttft == b.ttft
    assert a.tokens == b.tokens
    assert a.recomputed == b.recomputed
    assert engines(fast) == engines(slow)
    assert sum(w.core.num_preemptions for w in fast.workers) > 0  # KV exhaustion too


def test_a_run_makes_no_cyclic_garbage():
    """`fleetsim.cli.tuned_gc` lets the cycle collector run rarely (every 500,000 net
    allocations): memory stays bounded only because a run leaves next to no cycles,
    whatever happens to its requests (preemptions, KV exhaustion, refusals)."""
    arrivals = flood_and_probe(burst=800, duration_s=15.0)
    arrivals.append(Arrival(3.0, 1, 10**6, 16, 48))  # prompt_too_long
    t = table("A", "L")
    gc.collect()
    gc.disable()
    try:
        fleet, sink = run(arrivals, t, config(t), 60.0, kv_tokens_total=16 * 300)
        found = gc.collect()
    finally:
        gc.enable()
    assert fleet.num_preemptions > 0 and sink.rejected
    assert sum(w.core.num_preemptions for w in fleet.workers) > 0
    assert found < 50, f"{found} objects in cycles after {len(arrivals)} requests"


class AskEveryPull(Fleet):
    """The shortcut's reference: every waiting pull gets a select, even after one found
    nothing (`spread` stops the pass there, in the simulator and the dispatcher)."""

    empty = 0

    def _take(self, p, n):
        got = super()._take(p, n)
        if got == NOTHING_ELIGIBLE:
            self.empty += 1
            return 0
        return got


@pytest.mark.parametrize("policy", ["drr", "vtc", "fifo"])
def test_skipping_pulls_nothing_may_take_changes_nothing(policy):
    """Quota-blocked tenants (max_concurrent) leave work queued that no pull may take:
    asking every other pull too gives the same run."""
    rng = random.Random(4)
    t = table("big", "mid", "small")
    limits = {"big": 6, "mid": 3, "small": 2}
    cfg = SchedulerConfig(
        policy=policy, cost_model="tokens", quantum=544,
        tenants={n: TenantConfig(n, max_concurrent=limits[n]) for n in t.names},
        preemption=PreemptionConfig(enabled=policy != "fifo"))
    arrivals = sorted((Arrival(rng.uniform(0, 15), rng.choice((0, 0, 0, 1, 2)), 32,
                               rng.randint(16, 200), 200) for _ in range(700)),
                      key=lambda a: a.t_s)
    settings = FleetSettings(num_workers=4, max_num_seqs=4, hint_output_tokens=True)
    out = []
    for cls in (Fleet, AskEveryPull):
        sink = Collect()
        fleet = cls(cfg, t, sink, settings)
        fleet.run(iter(arrivals), 60.0)
        out.append((fleet, sink))
    (fast, a), (naive, b) = out
    assert naive.empty > 100  # the case happened
    assert sorted(a.finished) == sorted(b.finished)
    assert a.ttft == b.ttft
    assert engines(fast) == engines(naive)
    assert fast.num_preemptions == naive.num_preemptions


def test_preemption_spares_the_quiet_tenant_the_flood():
    arrivals = flood_and_probe()
    t = table("A", "L")
    p99 = {}
    for preempt in (False, True):
        fleet, sink = run(arrivals, t, config(t, preempt=preempt), 40.0)
        during = sorted(ttft for start, ttft in sink.ttft[1] if start > 10.0)
        assert len(during) > 200
        p99[preempt] = during[int(0.99 * len(during))]
        assert (fleet.num_preemptions > 0) == preempt
    assert p99[True] < p99[False] / 3


def test_drr_weights_become_token_shares():
    t = table("w1", "w2", "w4", weights={"w1": 1, "w2": 2, "w4": 4})
    rng = random.Random(5)
    arrivals = sorted((Arrival(rng.uniform(0, 1), i, 32, rng.randint(128, 384), 384)
                       for i in range(3) for _ in range(1500)), key=lambda a: a.t_s)
    sink = Collect()
    sink.window = (20.0, 80.0)  # all three backlogged throughout
    fleet = Fleet(config(t, preempt=True), t, sink,
                  FleetSettings(num_workers=2, max_num_seqs=32, hint_output_tokens=True))
    fleet.run(iter(arrivals), 80.0)
    total = sum(sink.window_tokens.values())
    shares = [sink.window_tokens[i] / total for i in range(3)]
    for got, want in zip(shares, (1 / 7, 2 / 7, 4 / 7), strict=True):
        assert got == pytest.approx(want, abs=0.02)


def test_queued_work_goes_to_free_slots_first_spread_over_the_pulls():
    """Four requests queued at once, two pulls waiting (as `dispatcher.service`): A has
    1 slot free and room for 5, B 3 free and room for 7. The free slots are filled
    first, evenly (A 1, B 3), not A's whole room (1 starting, 3 waiting in A's engine
    queue while B's slots stay empty)."""
    t = table("a")
    fleet = Fleet(config(t), t, Collect(), FleetSettings(num_workers=2, max_num_seqs=8))
    a, b = fleet.workers
    for w, max_items, free_slots in [(a, 5, 1), (b, 7, 3)]:
        fleet.core.on_pull(w.worker_id, 0, 0.0)
        fleet._pulls_free.add(Pull(max_items=max_items, free_slots=free_slots,
                                   free_kv_tokens=0, worker=w, expires_ms=1_000.0))
    for i in range(4):
        fleet.core.submit(QueuedRequest(f"r{i}", "a", "standard", 32, 64, 64), 0.0)
    fleet._serve_pulls()
    batches = {arg[0].worker.worker_id: len(arg[1]) for _, _, fn, arg in fleet._net
               if getattr(fn, "__name__", "") == "_on_batch"}
    assert batches == {a.worker_id: 1, b.worker_id: 3}
    assert fleet._pulls_free.num_waiting == 0 and fleet.scheduler.num_queued == 0


def test_a_pull_line_keeps_arrival_order_and_spread_passes_over_pulls_that_left():
    """Pulls that leave the line (answered, expired) from its middle stay in it until
    they reach the front, but with no room: `spread` hands out work as if they were
    gone, and a pull never leaves twice."""
    from dispatcher.scheduler.spread import spread

    t = table("a")
    fleet = Fleet(config(t), t, Collect(), FleetSettings(num_workers=1))
    line = PullLine()
    pulls = [Pull(max_items=2, free_slots=2, free_kv_tokens=0, worker=fleet.workers[0],
                  expires_ms=1_000.0) for _ in range(4)]
    for p in pulls:
        line.add(p)
    assert line.remove(pulls[1]) and not line.remove(pulls[1])
    assert line.num_waiting == 3 and list(line) == pulls  # marked, still in place
    queued = [5]
    got: list[tuple[int, int]] = []

    def take(p: Pull, n: int) -> int:
        n = min(n, queued[0])
        queued[0] -= n
        got.append((pulls.index(p), n))
        return n

    spread(line, lambda: queued[0], take, Pull.room_now)
    assert got == [(0, 1), (2, 1), (3, 1), (0, 1), (2, 1)]  # one each, then water-filled
    assert line.remove(pulls[0]) and list(line) == pulls[2:]  # the front drops at once
    assert line.remove(pulls[2]) and line.remove(pulls[3]) and line.num_waiting == 0
    assert list(line) == []


def test_messages_timers_and_expiries_run_in_one_time_then_schedule_order():
    """Messages and pull expiries have fixed delays and wait in FIFOs beside the timer
    heap; events at the same time still run in the order they were scheduled, whichever
    queue holds them (as one heap of all of them ran them)."""
    t = table("a")
    fleet = Fleet(config(t), t, Collect(), FleetSettings(num_workers=1, network_ms=0.5))
    ran: list[str] = []
    fleet._at(0.5, ran.append, "timer 1")
    fleet._send(ran.append, "message 2")  # now 0: at 0.5, scheduled after timer 1
    fleet._at(0.5, ran.append, "timer 3")
    gone = Pull(max_items=1, free_slots=1, free_kv_tokens=0, worker=fleet.workers[0],
                expires_ms=0.5)  # answered already (never added): its expiry is a no-op
    fleet._expiries.append((0.5, fleet._next_seq(), gone))
    fleet._send(ran.append, "message 4")
    fleet._at(0.25, ran.append, "timer 0")
    fleet._at(0.75, ran.append, "timer 5")
    fleet.run(iter(()), 0.001)
    assert ran == ["timer 0", "timer 1", "message 2", "timer 3", "message 4", "timer 5"]


@pytest.mark.parametrize(("field", "value", "message"), [
    ("num_workers", 0, "num_workers: must be >= 1, got 0"),
    ("max_num_seqs", 0, "max_num_seqs: must be >= 1, got 0"),
    ("kv_tokens_total", -1, "kv_tokens_total: must be >= 1, got -1"),
    ("prefetch_seqs", -2, "prefetch_seqs: must be >= 0, got -2"),
    ("network_ms", float("nan"), "network_ms: must be a finite number >= 0, got nan"),
    ("heartbeat_ms", 0.0, "heartbeat_ms: must be a finite number > 0, got 0.0"),
    ("pull_wait_ms", float("inf"), "pull_wait_ms: must be a finite number > 0, got inf"),
    ("housekeeping_ms", -1.0, "housekeeping_ms: must be a finite number > 0, got -1.0"),
])
def test_settings_no_fleet_has_are_refused(field, value, message):
    from fleetsim.state import SettingError

    with pytest.raises(SettingError, match=message) as exc:
        FleetSettings(**{field: value})
    assert exc.value.name == field
    FleetSettings(network_ms=0.0, prefetch_seqs=0, max_num_seqs=1)  # the edges are fine


def test_a_run_stopped_by_its_progress_callback_is_a_run_of_that_duration():
    """`StopRun` (Ctrl-C in `fairlane simulate`) ends the run at a simulated time T as a
    run of duration T would have: the same events, arrivals, first tokens, finishes and
    tokens (the running sequences' included)."""
    from fleetsim.fleet import StopRun

    t = table("A", "L")
    arrivals = flood_and_probe(duration_s=40.0)

    def stop_after_12_s(t_s: float) -> None:
        if t_s >= 12.0:
            raise StopRun

    stopped_sink = Collect()
    stopped = Fleet(config(t), t, stopped_sink, FleetSettings(
        num_workers=2, max_num_seqs=32, hint_output_tokens=True))
    stopped.run(iter(arrivals), 40.0, stop_after_12_s, progress_every_s=1.0)
    assert 12_000 <= stopped.end_ms < 13_000  # the first event at or after 12 s
    full, full_sink = run(arrivals, t, config(t), stopped.end_ms / 1000)
    assert (stopped.num_events, stopped.num_arrivals) == (full.num_events, full.num_arrivals)
    assert stopped_sink.finished == full_sink.finished and stopped_sink.ttft == full_sink.ttft
    assert stopped_sink.tokens == full_sink.tokens
    assert len(stopped_sink.finished) > 100 and stopped.num_arrivals < len(arrivals)


def test_the_engines_length_limit_as_the_simulator_engine_applies_it():
    """As `SimEngine`: a prompt that reaches the engine's longest sequence (the smaller of
    max_model_len and the KV cache) is refused with prompt_too_long and released at the
    dispatcher; an output is cut where prompt + output reaches it. Before, such
    a sequence outgrew the cache and the fleet stalled without a word."""
    from gpu_worker.sim.engine import SimEngine

    t = table("long", "fits")
    arrivals = ([Arrival(1.0 + i * 0.01, 0, 1500, 1000, 1000) for i in range(20)]
                + [Arrival(1.0 + i * 0.01, 1, 900, 1000, 1000) for i in range(20)])
    arrivals.sort(key=lambda a: a.t_s)
    for max_model_len, kv_tokens in ((1200, 4096), (None, 2048)):
        sink = Collect()
        fleet = Fleet(config(t), t, sink, FleetSettings(
            num_workers=2, max_num_seqs=8, kv_tokens_total=kv_tokens,
            max_model_len=max_model_len))
        engine = SimEngine(kv_tokens_total=kv_tokens, max_model_len=max_model_len or 0)
        assert fleet.max_seq_len == engine.max_seq_len
        fleet.run(iter(arrivals), 200.0)
        limit = fleet.max_seq_len
        refused = [r for r in sink.rejected if r[2] == "prompt_too_long"]
        assert {r[0] for r in refused} == ({0} if limit <= 1500 else set())
        assert len(refused) == (20 if limit <= 1500 else 0)
        # Everything else finished, each output cut at the limit (not its 1,000 tokens).
        assert len(sink.finished) == 40 - len(refused)
        for tenant, *_, output_tokens, _ in sink.finished:
            prompt = 1500 if tenant == 0 else 900
            assert output_tokens == min(1000, limit - prompt)
        # Nothing is left in flight or queued at the dispatcher.
        assert fleet.scheduler.num_queued == 0 and fleet.scheduler.num_in_flight == 0


def test_a_slot_that_frees_while_a_full_pull_waits_takes_the_next_request():
    """Two workers, one slot and one prefetch each; a's long request on w0, its short
    one on w1, both workers' next pulls sent full (prefetch room only). When the short
    one ends, w1 replaces its pull with one that has the free slot (`gpu_worker.pulling`),
    so b's request, arriving while the old pull would still wait (its wait is 30 s here),
    starts on w1 at once instead of queueing behind the long request on w0."""
    t = table("a", "b")
    arrivals = [Arrival(0.1, 0, 32, 2_000, 2_000), Arrival(0.1, 0, 32, 20, 20),
                Arrival(2.0, 1, 32, 20, 20)]
    fleet, sink = run(arrivals, t, config(t, preempt=False), 5.0, num_workers=2,
                      max_num_seqs=1, prefetch_seqs=1, pull_wait_ms=30_000.0)
    w0, w1 = fleet.workers
    assert [len(w.seqs) for w in fleet.workers] == [1, 0]  # b's ran on w1 and ended
    assert sink.ttft[1][0][1] < 0.1  # not behind the 2,000-token request (~20 s)
    # w1 is back to one pull, waiting with its free slot; nothing asked twice.
    assert w1.pull is not None and w1.pull.free_slots == 1 and w1.asked == 1
    assert fleet._pulls_free.num_waiting == 1 and fleet._pulls_prefetch.num_waiting == 1
    assert w0.pull is not None and w0.pull.free_slots == 0 and w0.asked == 1
