"""The pure scheduler core: synchronous, no I/O, no clock reads (time is passed in).

The dispatcher shell calls it; tests, the simulator and benchmarks drive it directly.
This module owns the bookkeeping every policy shares (what is queued, what is in
flight, per-tenant quotas); *which* request goes next is the policy's job
(`dispatcher.scheduler.policies`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from dispatcher.scheduler.config import SchedulerConfig, TenantConfig
from dispatcher.scheduler.policies import Policy, make_policy
from dispatcher.scheduler.types import (
    ACCEPTED,
    DUPLICATE,
    ActualUsage,
    Admission,
    Dispatch,
    Dropped,
    QueuedRequest,
    Verdict,
)
from fairlane.protocol import ErrorCode


@dataclass(slots=True)
class TenantLoad:
    """Per-tenant live counters (quotas and metrics)."""

    num_queued: int = 0
    num_in_flight: int = 0
    kv_tokens_in_flight: int = 0
    dispatched_cost: float = 0.0


@dataclass(slots=True)
class _InFlight:
    request: QueuedRequest
    started: bool = False


class Scheduler:
    """Queue + in-flight bookkeeping around a selection `Policy`."""

    def __init__(self, config: SchedulerConfig, policy: Policy | None = None) -> None:
        self.config = config
        self.policy = policy or make_policy(config)
        self._queued: dict[str, QueuedRequest] = {}
        self._in_flight: dict[str, _InFlight] = {}
        self._loads: dict[str, TenantLoad] = {}
        self._next_seq = 0

    # --- queries -----------------------------------------------------------------------

    @property
    def num_queued(self) -> int:
        return len(self._queued)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def is_known(self, request_id: str) -> bool:
        return request_id in self._queued or request_id in self._in_flight

    def is_queued(self, request_id: str) -> bool:
        return request_id in self._queued

    def is_started(self, request_id: str) -> bool:
        f = self._in_flight.get(request_id)
        return f is not None and f.started

    def queued(self) -> Iterable[QueuedRequest]:
        return self._queued.values()

    def in_flight_request(self, request_id: str) -> QueuedRequest | None:
        f = self._in_flight.get(request_id)
        return f.request if f else None

    def tenant_loads(self) -> dict[str, TenantLoad]:
        return self._loads

    def _load(self, tenant: str) -> TenantLoad:
        load = self._loads.get(tenant)
        if load is None:
            load = self._loads[tenant] = TenantLoad()
        return load

    # --- admission ---------------------------------------------------------------------

    def submit(self, req: QueuedRequest, now_ms: float) -> Admission:
        """Admit `req` to its tenant's queue, or say why not."""
        if self.is_known(req.request_id):
            return DUPLICATE
        tcfg = self.config.tenant(req.tenant)
        if tcfg is None:
            return Admission(Verdict.REJECTED, ErrorCode.UNKNOWN_TENANT,
                             f"unknown tenant {req.tenant!r}")
        load = self._load(req.tenant)
        if tcfg.max_queued is not None and load.num_queued >= tcfg.max_queued:
            return Admission(Verdict.REJECTED, ErrorCode.QUEUE_FULL,
                             f"tenant {req.tenant!r} has {load.num_queued} requests queued "
                             f"(max_queued={tcfg.max_queued})", retry_after_ms=1_000)
        if len(self._queued) >= self.config.max_queued_total:
            return Admission(Verdict.REJECTED, ErrorCode.OVERLOADED,
                             "dispatcher queue is full", retry_after_ms=1_000)
        req.arrival_ms = now_ms if req.arrival_ms == 0 else req.arrival_ms
        req.seq = self._next_seq
        self._next_seq += 1
        self._queued[req.request_id] = req
        load.num_queued += 1
        self.policy.push(req, now_ms)
        return ACCEPTED

    # --- selection ---------------------------------------------------------------------

    def _within_quota(self, tenant: str, kv_tokens: int) -> bool:
        tcfg = self.config.tenant(tenant)
        if tcfg is None:
            return True
        load = self._load(tenant)
        if tcfg.max_concurrent is not None and load.num_in_flight >= tcfg.max_concurrent:
            return False
        return not (
            tcfg.max_kv_tokens is not None
            and load.num_in_flight > 0  # one request always fits, or it would wait forever
            and load.kv_tokens_in_flight + kv_tokens > tcfg.max_kv_tokens
        )

    def select(self, max_items: int, now_ms: float, free_kv_tokens: int | None = None) -> list[Dispatch]:
        """Pick up to `max_items` requests for one pulling worker.

        `free_kv_tokens` bounds the sum of the picks' KV needs (the first pick always
        goes: the engine preempts if it must, and a lone request must make progress).
        """
        out: list[Dispatch] = []
        kv_budget = free_kv_tokens
        while len(out) < max_items and self._queued:
            req = self.policy.pop(
                lambda tenant, kv: self._within_quota(tenant, kv), now_ms
            )
            if req is None:
                break
            if kv_budget is not None and out and req.kv_tokens > kv_budget:
                self.policy.push_front(req, now_ms)
                break
            if kv_budget is not None:
                kv_budget -= req.kv_tokens
            out.append(self._dispatch(req, now_ms))
        return out

    def _dispatch(self, req: QueuedRequest, now_ms: float) -> Dispatch:
        del self._queued[req.request_id]
        cost = self.policy.charge(req, now_ms)
        req.est_cost = cost
        req.est_kv_tokens = req.kv_tokens
        load = self._load(req.tenant)
        load.num_queued -= 1
        load.num_in_flight += 1
        load.kv_tokens_in_flight += req.est_kv_tokens
        load.dispatched_cost += cost
        self._in_flight[req.request_id] = _InFlight(req)
        tier = self.config.tier(req.tier)
        return Dispatch(req, tier.engine_priority if tier else 0, cost)

    # --- lifecycle ---------------------------------------------------------------------

    def on_started(self, request_id: str, now_ms: float) -> bool:
        f = self._in_flight.get(request_id)
        if f is None:
            return False
        f.started = True
        return True

    def _release(self, request_id: str) -> QueuedRequest | None:
        f = self._in_flight.pop(request_id, None)
        if f is None:
            return None
        load = self._load(f.request.tenant)
        load.num_in_flight -= 1
        load.kv_tokens_in_flight -= f.request.est_kv_tokens
        return f.request

    def on_finished(self, request_id: str, usage: ActualUsage | None, now_ms: float) -> QueuedRequest | None:
        """Release the request's quota and true its cost up to what it really used."""
        req = self._release(request_id)
        if req is not None and usage is not None:
            delta = self.policy.true_up(req, usage, now_ms)
            self._load(req.tenant).dispatched_cost += delta
        return req

    def requeue(self, request_id: str, now_ms: float) -> bool:
        """A dispatched request that never started goes back to the front of its
        priority class; its dispatch charge is refunded."""
        f = self._in_flight.get(request_id)
        if f is None or f.started:
            return False
        req = self._release(request_id)
        assert req is not None
        refund = self.policy.refund(req, now_ms)
        self._load(req.tenant).dispatched_cost -= refund
        req.requeued = True
        self._queued[req.request_id] = req
        self._load(req.tenant).num_queued += 1
        self.policy.push_front(req, now_ms)
        return True

    def cancel(self, request_id: str) -> QueuedRequest | None:
        """Remove a queued request. Returns None if it is not queued (maybe running)."""
        req = self._queued.pop(request_id, None)
        if req is None:
            return None
        self.policy.remove(req)
        self._load(req.tenant).num_queued -= 1
        return req

    def expire(self, now_ms: float) -> list[Dropped]:
        """Drop queued requests whose deadline has passed: they never reach a GPU."""
        expired = [r for r in self._queued.values()
                   if r.deadline_ms is not None and r.deadline_ms <= now_ms]
        for r in expired:
            self.cancel(r.request_id)
        return [Dropped(r, ErrorCode.EXPIRED, "deadline passed while queued") for r in expired]

    def tenant_config(self, tenant: str) -> TenantConfig | None:
        return self.config.tenant(tenant)
