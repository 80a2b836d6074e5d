"""Selection policies: strategies behind one small interface, chosen by `make_policy`.

- `fifo`: one line per tier in arrival order — the baseline that lets a flood win;
- `drr`: weighted Deficit Round Robin across tenants (`dispatcher.scheduler.drr`);
- `vtc`: Virtual Token Counter with counter lift (`dispatcher.scheduler.vtc`).

The interface (`Policy`) and the meaning of `eligible` are in `dispatcher.scheduler.base`.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import ClassVar

from dispatcher.scheduler.base import Eligible, FairShares, Policy, estimate_cost
from dispatcher.scheduler.cost import CostModel, make_cost_model
from dispatcher.scheduler.drr import DrrPolicy
from dispatcher.scheduler.types import ActualUsage, QueuedRequest
from dispatcher.scheduler.vtc import VtcPolicy
from fairlane.poolconfig import SchedulerConfig
from fairlane.registry import choose

__all__ = ["DrrPolicy", "Eligible", "FifoPolicy", "Policy", "VtcPolicy", "make_policy"]


class FifoPolicy:
    """One shared line per tier in arrival order (requeued work at the front).

    Quota-blocked heads are skipped (scanning at most `max_scan` entries), so FIFO
    honours quotas too and the comparison with fair policies is only about order.
    Removal is lazy: an entry is live while `_live[request_id]` is its token.
    """

    name: ClassVar[str] = "fifo"
    max_scan = 4096

    def __init__(self, config: SchedulerConfig, cost_model: CostModel | None = None) -> None:
        self.cost_model = cost_model or make_cost_model(config)
        self._lines: dict[str, deque[tuple[int, QueuedRequest]]] = {}
        self._live: dict[str, int] = {}
        self._tokens = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def _line(self, tier: str) -> deque[tuple[int, QueuedRequest]]:
        line = self._lines.get(tier)
        if line is None:
            line = self._lines[tier] = deque()
        return line

    def push(self, req: QueuedRequest, now_ms: float) -> None:
        token = self._live[req.request_id] = next(self._tokens)
        self._line(req.tier).append((token, req))

    def push_front(self, req: QueuedRequest, now_ms: float) -> None:
        token = self._live[req.request_id] = next(self._tokens)
        self._line(req.tier).appendleft((token, req))

    def remove(self, req: QueuedRequest) -> None:
        self._live.pop(req.request_id, None)

    def take(self, req: QueuedRequest, now_ms: float) -> None:
        self.remove(req)

    def pop(self, tier: str, eligible: Eligible, now_ms: float) -> QueuedRequest | None:
        line = self._lines.get(tier)
        if not line:
            return None
        skipped: list[tuple[int, QueuedRequest]] = []
        found: QueuedRequest | None = None
        while line and len(skipped) < self.max_scan:
            token, req = line.popleft()
            if self._live.get(req.request_id) != token:
                continue
            if eligible(req.tenant, req.kv_tokens):
                del self._live[req.request_id]
                found = req
                break
            skipped.append((token, req))
        line.extendleft(reversed(skipped))
        return found

    def charge(self, req: QueuedRequest, now_ms: float) -> float:
        return estimate_cost(self.cost_model, req)

    def refund(self, req: QueuedRequest, now_ms: float) -> float:
        return req.est_cost

    def true_up(self, req: QueuedRequest, usage: ActualUsage, now_ms: float) -> float:
        return self.cost_model.actual(req, usage) - req.est_cost - req.paid_cost

    def on_release(self, tenant: str, now_ms: float) -> None:
        pass

    def forget_idle(self, tenants: Iterable[str], now_ms: float) -> None:
        pass  # no per-tenant state

    def update_config(self, config: SchedulerConfig) -> None:
        pass  # FIFO has no per-tenant state: weights do not affect its order

    def fair_shares(self, tier: str, running: Mapping[str, int], num_slots: int) -> FairShares | None:
        return None  # arrival order is all FIFO promises: it never preempts


# Each takes (config) or (config, cost_model).
_POLICIES: dict[str, Callable[..., Policy]] = {
    FifoPolicy.name: FifoPolicy,
    DrrPolicy.name: DrrPolicy,
    VtcPolicy.name: VtcPolicy,
}


def make_policy(config: SchedulerConfig, cost_model: CostModel | None = None) -> Policy:
    factory = choose(_POLICIES, config.policy, "policy")
    return factory(config, cost_model) if cost_model is not None else factory(config)
