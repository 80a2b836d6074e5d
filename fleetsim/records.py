"""The contract between the simulator's parts: what arrives, and what the fleet reports.

`workload` yields `Arrival`s in time order; `fleet` turns each into a request for the
production `PoolCore` and reports what happened to it through the `Sink` protocol;
`recorder.Recorder` implements `Sink` with bounded memory (histograms, not per-request
lists), so an hour of 1,000 workers and 100,000 tenants fits in RAM.

Tenants and tiers are referred to by index (`TenantTable`) on the hot path: 100,000
tenant names would otherwise be hashed on every token window update.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(slots=True, init=False)
class Arrival:
    """One request arriving at the pool, in simulated seconds from the start. (Its
    `__init__` written out: mypyc compiles it, one call per request; see `state`.)"""

    t_s: float
    tenant: int  # index into TenantTable.names
    prompt_tokens: int
    output_tokens: int  # what the model would generate if not cut (natural length)
    max_tokens: int  # the request's cap; generated = min(output_tokens, max_tokens)
    priority: int  # within the tenant (higher first), as InferenceRequest.priority

    def __init__(self, t_s: float, tenant: int, prompt_tokens: int, output_tokens: int,
                 max_tokens: int, priority: int = 0) -> None:
        self.t_s, self.tenant, self.prompt_tokens = t_s, tenant, prompt_tokens
        self.output_tokens, self.max_tokens, self.priority = output_tokens, max_tokens, priority


@dataclass(slots=True)
class TenantTable:
    """Tenants by index, each with its tier (index into `tiers`, highest tier first)."""

    names: list[str] = field(default_factory=list)
    tier_of: list[int] = field(default_factory=list)
    tiers: list[str] = field(default_factory=list)
    weight_of: list[float] = field(default_factory=list)

    def add(self, name: str, tier: int, weight: float = 1.0) -> int:
        self.names.append(name)
        self.tier_of.append(tier)
        self.weight_of.append(weight)
        return len(self.names) - 1

    def __len__(self) -> int:
        return len(self.names)


class Sink(Protocol):
    """What the fleet reports; all times are simulated seconds."""

    def on_rejected(self, tenant: int, t_s: float, code: str) -> None:
        """Refused at admission (queue cap, throttled, bad request) or dropped while queued."""

    def on_first_token(self, tenant: int, t_s: float, ttft_s: float) -> None:
        """The request's first token (TTFT from its arrival)."""

    def on_finished(self, tenant: int, t_s: float, e2e_s: float, ttft_s: float,
                    output_tokens: int, preemptions: int, worker_ttft_s: float = 0.0,
                    client_s: float = 0.0) -> None:
        """The last token. TPOT = (e2e - ttft) / (output_tokens - 1) when > 1 token.
        `worker_ttft_s`: of the TTFT, the part from a worker receiving the dispatch
        that made the first token to that token; `client_s`: its client's legs
        (`FleetSettings.client_ms`; the rest: the dispatcher's queue and the hops)."""

    def on_tokens(self, tenant: int, start_s: float, end_s: float, num_tokens: int) -> None:
        """`num_tokens` generated for the tenant evenly over [start_s, end_s] (for
        shares over time): the fleet reports a run of engine steps at once."""

    def on_preempted(self, tenant: int, t_s: float) -> None:
        """One of the tenant's running requests was preempted for fairness."""

    def on_recomputed(self, tenant: int, t_s: float, num_tokens: int) -> None:
        """An engine admitted one of the tenant's requests again (resumed after a
        fleet preemption, or after its own KV preemption) and prefills `num_tokens`
        it had computed before (less what its prefix cache still held)."""

    def sample(self, t_s: float, queued_by_tier: list[int], running: int,
               busy_workers: int) -> None:
        """Periodic fleet state (every `sample_every_s` of simulated time)."""


class StopRun(Exception):
    """Raised by `Fleet.run`'s progress callback: the run ends at that simulated time as
    if it had been its duration (the events due then still run, later arrivals are not
    taken, the running sequences' tokens are reported)."""
