"""The fleet simulator's records (`fleetsim.fleet`): settings, requests, workers, runs.

Plain data, no behaviour beyond a run's step times, so that `fleet` holds the events.
The records made per request or per run (`Req`, `Pull`, `Run`) spell out their
`__init__` (`init=False`): mypyc compiles a written one to C, while a dataclass's
generated one stays interpreted, ~5x slower to call (a few per request, millions a run).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from dispatcher.scheduler.spread import PullShare
from fairlane.protocol import EngineLoad
from fleetsim.records import Arrival
from gpu_worker.sim.batch import BatchCore, Seq


@dataclass(slots=True)
class FleetSettings:
    """The fleet's shape and the product's timing knobs (their defaults)."""

    num_workers: int = 2
    step_model: str = "default"  # gpu_worker/sim/step_models/<name>.json or a path
    max_num_seqs: int | None = None  # None: the step model's
    kv_tokens_total: int | None = None  # None: the step model's
    prefetch_seqs: int = 4  # gpu_worker --prefetch-seqs
    # gpu_worker --max-model-len: prompt + output a sequence may reach. None: unset, as
    # the simulator engine's 0, so the KV cache bounds it (the engine caps the output
    # there and refuses a prompt that reaches it, `gpu_worker.sim.engine`).
    max_model_len: int | None = None
    pull_wait_ms: float = 1_000.0  # gpu_worker --pull-wait-ms
    heartbeat_ms: float = 1_000.0  # gpu_worker --heartbeat-ms
    worker_timeout_ms: float = 3_500.0  # dispatcher --worker-timeout-ms
    housekeeping_ms: float = 200.0  # dispatcher --housekeeping-ms
    network_ms: float = 0.5  # one NATS hop between dispatcher and worker
    # The client's legs (its submit through JetStream to the dispatcher, the tokens'
    # way back), which the hops above leave out: each request draws one of these
    # (client_seed), added to what its client sees (TTFT, end-to-end, token times);
    # one value is a constant, measured ones a distribution; () not modelled (0).
    client_ms: tuple[float, ...] = ()
    client_seed: int = 0
    sample_every_s: float = 1.0
    # Clients send `expected_output_tokens` = the length they will get (the benches do:
    # the cost model then charges what is generated); else the core estimates from
    # max_tokens, as for a client that gives no hint.
    hint_output_tokens: bool = False
    # Run whole runs of engine steps as one event when nothing can change the batch
    # (exact: tests compare with False, which steps one at a time).
    batch_runs: bool = True

    def __post_init__(self) -> None:
        """Refuse settings no fleet has: a zero-slot worker never runs anything, and a
        negative or NaN delay breaks virtual time's order (NaN compares false, so every
        event after the first one would silently never happen)."""
        for name, value, least in (("num_workers", self.num_workers, 1),
                                   ("max_num_seqs", self.max_num_seqs, 1),
                                   ("kv_tokens_total", self.kv_tokens_total, 1),
                                   ("max_model_len", self.max_model_len, 2),
                                   ("prefetch_seqs", self.prefetch_seqs, 0)):
            if value is not None and value < least:
                raise SettingError(name, f"must be >= {least}, got {value}")
        for name, ms, positive in (("network_ms", self.network_ms, False),
                                   ("pull_wait_ms", self.pull_wait_ms, True),
                                   ("heartbeat_ms", self.heartbeat_ms, True),
                                   ("worker_timeout_ms", self.worker_timeout_ms, True),
                                   ("housekeeping_ms", self.housekeeping_ms, True),
                                   ("sample_every_s", self.sample_every_s, True)):
            if not math.isfinite(ms) or ms < 0 or (positive and ms == 0):
                raise SettingError(name, f"must be a finite number {'>' if positive else '>='} 0, "
                                         f"got {ms}")
        bad = [ms for ms in self.client_ms if not math.isfinite(ms) or ms < 0]
        if bad:
            raise SettingError("client_ms", f"must be finite numbers >= 0, got {bad[0]}")


class SettingError(ValueError):
    """A `FleetSettings` field out of range; `name` is the field."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.name, self.message = name, message


@dataclass(slots=True, init=False)
class Req:
    """A request's life in the simulation (the QueuedRequest's payload)."""

    arrival: Arrival
    tenant: str
    num_generated: int  # tokens its client has (continuations start here)
    first_token_ms: float | None
    preemptions: int
    started: bool  # this attempt's first token went out (the message's ack)
    # Tokens are reported per sequence when it leaves the batch (or is preempted):
    # those after `tok_out`, spread over [tok_ms, then].
    tok_ms: float
    tok_out: int
    # When a worker received this attempt's dispatch, and the first token's time from
    # its attempt's receipt (the worker-side TTFT, as the real worker's Usage.ttft_ms).
    accepted_ms: float
    worker_ttft_ms: float
    client_ms: float  # its client's legs (FleetSettings.client_ms), on all it reports

    def __init__(self, arrival: Arrival, tenant: str) -> None:
        self.arrival, self.tenant = arrival, tenant
        self.num_generated, self.first_token_ms, self.preemptions = 0, None, 0
        self.started, self.tok_ms, self.tok_out = False, 0.0, 0
        self.accepted_ms, self.worker_ttft_ms, self.client_ms = 0.0, 0.0, 0.0


@dataclass(eq=False, slots=True, kw_only=True, init=False)
class Pull(PullShare):
    """A worker's pull waiting at the dispatcher (`fairlane.protocol.PullRequest`)."""

    worker: Worker
    expires_ms: float
    waiting: bool  # in its `PullLine` (answered or expired: no longer)
    # The worker's pull this one replaces (a slot freed while that one waited, with no
    # free slot: `gpu_worker.pulling`), until the dispatcher has it.
    replaces: Pull | None
    asked: int  # max_items as sent (leaving its line sets max_items to 0)

    def __init__(self, *, max_items: int, free_slots: int, free_kv_tokens: int,
                 worker: Worker, expires_ms: float, replaces: Pull | None = None) -> None:
        # Not super(): a slots dataclass is a new class, which zero-argument super()
        # does not see.
        PullShare.__init__(self, max_items, free_slots, free_kv_tokens)
        self.worker, self.expires_ms, self.waiting = worker, expires_ms, False
        self.replaces, self.asked = replaces, max_items


class PullLine:
    """Waiting pulls in arrival order, for `dispatcher.scheduler.spread`.

    Not a dict of pulls by key: pulls leave near the front (the oldest are served and
    expire first) and join at the back, and a dict keeps a deleted entry's place until
    it grows, so every pass's first step walked the holes left by the pulls that had
    left (at 1,000 workers ~2,600 instructions and a string of cache misses per pass).
    Here a pull that leaves is dropped at once if it is first, else marked (`waiting`
    False) and given no room (`max_items` 0: `spread` passes over it) until it reaches
    the front."""

    __slots__ = ("_line", "num_waiting")

    def __init__(self) -> None:
        self._line: deque[Pull] = deque()
        self.num_waiting = 0

    def __iter__(self) -> Iterator[Pull]:
        return iter(self._line)

    def add(self, p: Pull) -> None:
        p.waiting = True
        self._line.append(p)
        self.num_waiting += 1

    def remove(self, p: Pull) -> bool:
        """Take `p` out of the line; False if it was not waiting."""
        if not p.waiting:
            return False
        p.waiting, p.max_items = False, 0
        self.num_waiting -= 1
        line = self._line
        while line and not line[0].waiting:
            line.popleft()
        return True


@dataclass(slots=True, init=False)
class Run:
    """Steps in progress on a worker, applied to its core when they end or are cut:
    step j (1..k) ends at `end_of(j)` (`BatchCore.run_coeffs`: a + b*i ms for step i
    from 0, plus the prefill in the first)."""

    start_ms: float
    k: int
    a_ms: float
    b_ms: float
    pre_ms: float
    prefill_tokens: int
    step_ms: float  # a one-step run's duration
    admitted: list[Seq]  # admitted by its schedule (then k == 1): their first tokens
    version: int

    def __init__(self, start_ms: float, k: int, a_ms: float, b_ms: float, pre_ms: float,
                 prefill_tokens: int, step_ms: float, admitted: list[Seq],
                 version: int) -> None:
        self.start_ms, self.k, self.a_ms, self.b_ms = start_ms, k, a_ms, b_ms
        self.pre_ms, self.prefill_tokens, self.step_ms = pre_ms, prefill_tokens, step_ms
        self.admitted, self.version = admitted, version

    def end_of(self, j: int) -> float:
        if not j:
            return self.start_ms
        return self.start_ms + (self.pre_ms + self.a_ms * j + self.b_ms * (j * (j - 1) / 2))

    def steps_done_by(self, now_ms: float) -> int:
        """The last j < k with end_of(j) <= now_ms (0: none; for a run whose end is later)."""
        lo, hi = 0, self.k
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.end_of(mid) <= now_ms:
                lo = mid
            else:
                hi = mid
        return lo


@dataclass(eq=False, slots=True)
class Worker:
    """One simulated worker: its engine and what it accepted."""

    worker_id: str
    core: BatchCore
    seqs: dict[str, Seq] = field(default_factory=dict)  # accepted, not ended
    pull: Pull | None = None  # its pull not answered yet (the newest, if it replaced one)
    asked: int = 0  # what its pulls not answered yet asked for, together
    run: Run | None = None
    version: int = 0  # bumps when a run is cut: its end event is stale


def engine_load(core: BatchCore) -> EngineLoad:
    """What a worker's heartbeat says of its engine (as `SimEngine.load`)."""
    return EngineLoad(num_running=len(core.running), num_waiting=core.num_waiting,
                      max_num_seqs=core.max_num_seqs, kv_tokens_used=core.kv_tokens_used,
                      kv_tokens_total=core.kv_tokens_total)
