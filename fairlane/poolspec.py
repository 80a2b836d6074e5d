"""The tenants file's pool and tier types (msgspec Structs) and the defaults they share
with `fairlane.poolconfig`, which re-exports all of them: import from there.

They live apart from the dataclasses the scheduler core runs on (`poolconfig.TenantConfig`,
`SchedulerConfig`) so that mypyc can compile those (`fleetsim.compiled`: the simulator
calls `SchedulerConfig.tenant` ~10 times a request); it cannot compile a module that
defines msgspec Structs (their field defaults are `msgspec.field` objects).
"""

from __future__ import annotations

from typing import Literal, get_args

import msgspec

DEFAULT_TIER = "standard"
DEFAULT_POOL = "default"

Policy = Literal["fifo", "drr", "vtc"]
CostModelName = Literal["requests", "tokens", "kv_seconds"]
POLICIES: tuple[str, ...] = get_args(Policy)
COST_MODELS: tuple[str, ...] = get_args(CostModelName)

# Defaults shared by the tenants file's pool section and a bare `SchedulerConfig`, so a
# pool behaves the same whether it was configured in a file or built in code.
DEFAULT_POLICY: Policy = "drr"
DEFAULT_COST_MODEL: CostModelName = "requests"
DEFAULT_QUANTUM = 1.0
DEFAULT_MAX_QUEUED_TOTAL = 1_000_000
# Unlisted tenants run with the pool's default tenant settings unless the pool says
# ``allow_unknown_tenants: false``. Open by default because the edge already refuses
# unknown API keys, and NATS auth confines a direct publisher to its own subjects; a
# pool that must refuse strangers says so (the demo tenants file does).
DEFAULT_ALLOW_UNKNOWN_TENANTS = True


class TierConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One tier (the tenants file's ``tiers`` entries); tiers are ordered, highest first."""

    name: str
    floor_share: float = 0.0  # reserved fraction of dispatched cost, in [0, 1] (soft)
    aging_ms: float = 0.0  # how fast waiting work of this tier rises; 0 = no aging
    engine_priority: int = 0  # vLLM priority: lower runs first, evicted last


class PreemptionConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Fleet-level preemption for fairness (DESIGN.md 5b): a pool's ``preemption`` entry.

    When a tenant short of its fair share (by a whole slot, and owed by its policy's
    accounts) has a request that waited `preempt_after_ms` (`quiet_preempt_after_ms`
    if its whole demand fits in its share) and no worker has room, the
    core preempts one running request of a tenant above its share (lowest tier first)
    and hands the freed slot to the waiting request; the victim resumes later from the
    tokens it has (`dispatcher.scheduler.preempt`). `fifo` never preempts.
    """

    enabled: bool = True
    # How long a backlogged tenant (more demand than its share) must have been short of
    # its share by a whole slot before a slot is preempted for it: its head waits behind
    # its own queue anyway, and turnover makes up such shortfalls within a few hundred
    # ms at LLM lengths; preempting sooner only burns recompute and, measured, skews
    # the weighted shares (bench/preemption.py, backlogged 1:2:4).
    preempt_after_ms: float = 2_000.0
    # The same for a quiet tenant (running + queued within its fair share): fair
    # queueing promises it no wait, so by default it preempts at once.
    quiet_preempt_after_ms: float = 0.0
    # Hysteresis: a continuation runs at least this long after it restarted before it
    # may be preempted again, so a slot is not handed back and forth. A first run is not
    # guarded: it is the cheapest victim, and a batch that turned over at once would
    # otherwise make a quiet tenant wait this long.
    min_run_ms: float = 1_000.0
    max_per_s: int = 20  # preemptions ordered in any 1 s window, per pool
    max_per_request: int = 3  # after this many, a request runs to its end


class PoolSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """One pool of the tenants file's ``pools`` section."""

    policy: Policy = DEFAULT_POLICY
    cost_model: CostModelName = DEFAULT_COST_MODEL
    quantum: float = DEFAULT_QUANTUM  # DRR budget per turn at weight 1, in cost units
    max_tokens: int | None = None  # request limit (output tokens); None = built-in default
    max_prompt_tokens: int | None = None  # request limit; None = built-in default
    max_queued_total: int = DEFAULT_MAX_QUEUED_TOTAL
    allow_unknown_tenants: bool = DEFAULT_ALLOW_UNKNOWN_TENANTS
    default_tier: str | None = None  # tier of unlisted tenants; None = lowest tier
    preemption: PreemptionConfig = msgspec.field(default_factory=PreemptionConfig)
