"""The one set of tier, tenant and pool configuration types (DESIGN.md section 5).

The tenants file (`fairlane.tenants`) decodes into these, the dispatcher's scheduler
core runs on them, and the edge reads tenants' rate limits from them: one type per
concept, one default per knob. `fairlane.tenants.resolve_pool_config` is the only place
a pool's `SchedulerConfig` is built from a file and command-line overrides.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field

# The file's types and defaults live in fairlane.poolspec (see there why); one place to
# import them from is this module.
from fairlane.poolspec import (
    COST_MODELS,
    DEFAULT_ALLOW_UNKNOWN_TENANTS,
    DEFAULT_COST_MODEL,
    DEFAULT_MAX_QUEUED_TOTAL,
    DEFAULT_POLICY,
    DEFAULT_POOL,
    DEFAULT_QUANTUM,
    DEFAULT_TIER,
    POLICIES,
    CostModelName,
    Policy,
    PoolSpec,
    PreemptionConfig,
    TierConfig,
)

__all__ = [
    "COST_MODELS", "DEFAULT_ALLOW_UNKNOWN_TENANTS", "DEFAULT_COST_MODEL",
    "DEFAULT_MAX_QUEUED_TOTAL", "DEFAULT_POLICY", "DEFAULT_POOL", "DEFAULT_QUANTUM",
    "DEFAULT_TIER", "MAX_UNKNOWN_CACHED", "POLICIES", "SMALL_REQUEST_COST", "CostModelName",
    "Policy", "PoolSpec", "PreemptionConfig", "SchedulerConfig", "TenantConfig", "TierConfig",
    "check_policy", "quantum_warning",
]

# Unlisted tenants' settings are cached per name (quota checks ask on every decision);
# the scheduler drops idle ones, and this bounds the cache whatever calls `tenant`.
MAX_UNKNOWN_CACHED = 100_000



@dataclass(frozen=True, slots=True)
class TenantConfig:
    """A tenant as the edge and the dispatcher see it (API keys are not kept here)."""

    name: str
    tier: str = DEFAULT_TIER
    weight: float = 1.0
    max_concurrent: int | None = None  # sequences in flight
    max_kv_tokens: int | None = None  # KV tokens (prompt + max output) in flight
    max_queued: int | None = None  # requests waiting in the dispatcher
    requests_per_min: int | None = None  # edge rate limit (Redis)
    tokens_per_min: int | None = None  # edge rate limit (Redis)
    pools: tuple[str, ...] | None = None  # None = every pool

    def allows_pool(self, pool: str) -> bool:
        return self.pools is None or pool in self.pools


@dataclass(slots=True)
class SchedulerConfig:
    """Everything the scheduler core needs for one pool."""

    policy: str = DEFAULT_POLICY  # one of POLICIES
    cost_model: str = DEFAULT_COST_MODEL  # one of COST_MODELS
    quantum: float = DEFAULT_QUANTUM
    tiers: list[TierConfig] = field(default_factory=lambda: [TierConfig(DEFAULT_TIER)])
    tenants: dict[str, TenantConfig] = field(default_factory=dict)
    # Tenants not listed: allowed (with `default_tenant`'s settings) or refused with
    # unknown_tenant.
    allow_unknown_tenants: bool = DEFAULT_ALLOW_UNKNOWN_TENANTS
    default_tenant: TenantConfig = field(default_factory=lambda: TenantConfig("_default"))
    max_queued_total: int = DEFAULT_MAX_QUEUED_TOTAL
    # Cost models (`dispatcher.scheduler.cost`).
    prompt_token_weight: float = 1.0  # w_p of the `tokens` model
    output_token_weight: float = 2.0  # w_q of the `tokens` model (as in VTC)
    kv_step_ms: float = 30.0  # the pool's decode step time, for `kv_seconds` estimates
    kv_prefill_ms_per_token: float = 0.1  # prefill time per prompt token, same purpose
    # Tier floors are measured over this (exponentially decayed) window of dispatched cost.
    share_window_ms: float = 10_000.0
    # Throttling: the service rate is measured over this sliding window; 0 disables it.
    throttle_window_ms: float = 10_000.0
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)
    _unknown: dict[str, TenantConfig] = field(default_factory=dict, repr=False, compare=False)

    def tenant(self, name: str) -> TenantConfig | None:
        cfg = self.tenants.get(name)
        if cfg is None and self.allow_unknown_tenants:
            # Cached: this runs on every quota check, so don't allocate each time.
            cfg = self._unknown.get(name)
            if cfg is None:
                if len(self._unknown) >= MAX_UNKNOWN_CACHED:  # bounded: oldest out first
                    del self._unknown[next(iter(self._unknown))]
                cfg = self._unknown[name] = dataclasses.replace(self.default_tenant, name=name)
        return cfg

    def weight(self, name: str) -> float:
        """The tenant's DRR/VTC weight (1.0 for a tenant this pool does not know)."""
        cfg = self.tenant(name)
        return cfg.weight if cfg else 1.0

    def forget_unknown(self, names: Iterable[str]) -> None:
        """Drop the cached settings of these tenants (the scheduler forgot them: idle)."""
        for name in names:
            self._unknown.pop(name, None)

    def tier(self, name: str) -> TierConfig | None:
        for t in self.tiers:
            if t.name == name:
                return t
        return None


# A small chat request (32 prompt + 32 output tokens) under each cost model, roughly:
# tokens = 32 x 1 + 32 x 2 (the default token weights); kv_seconds ~ 48 KV tokens held
# for ~1 s. A DRR quantum below it is almost surely a leftover of the `requests` default.
SMALL_REQUEST_COST = {"tokens": 96.0, "kv_seconds": 48.0}


def quantum_warning(pool: str, spec: PoolSpec) -> str | None:
    """A warning when a DRR pool's quantum is below one small request's cost under its
    cost model: a turn then rarely fits a request (DRR needs many ring passes per
    request) and a quiet tenant is almost never owed a preemption (its early turn is
    one quantum). Measured: `bench/preemption_vllm.py` with cost_model tokens and the
    default quantum 1 ordered no preemption at all."""
    small = SMALL_REQUEST_COST.get(spec.cost_model)
    if spec.policy != "drr" or small is None or spec.quantum >= small:
        return None
    return (f"pools.{pool}.quantum: {spec.quantum:g} is below one small request's cost "
            f"under cost_model {spec.cost_model} (~{small:g}); a DRR turn rarely fits a "
            f"request and a quiet tenant is almost never owed a preemption: set it near "
            f"a typical request's cost (tokens: prompt + 2 x output tokens, e.g. 1024)")


def check_policy(policy: str) -> str:
    """`policy` if it names a policy; ValueError listing the choices otherwise."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r} (expected one of: {'|'.join(POLICIES)})")
    return policy
