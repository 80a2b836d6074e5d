"""Scheduler configuration: tenants, tiers and the pool's policy knobs.

Filled from the tenants file (`dispatcher.tenants`) or built directly in tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TenantConfig:
    name: str
    tier: str = "standard"
    weight: float = 1.0
    max_concurrent: int | None = None  # sequences in flight
    max_kv_tokens: int | None = None  # KV tokens (prompt + max output) in flight
    max_queued: int | None = None  # requests waiting in the dispatcher


@dataclass(slots=True)
class TierConfig:
    name: str
    floor_share: float = 0.0  # reserved fraction of dispatched cost (soft, borrowable)
    aging_ms: float = 0.0  # how fast waiting work of this tier rises; 0 = no aging
    engine_priority: int = 0  # vLLM priority: lower runs first, evicted last


@dataclass(slots=True)
class SchedulerConfig:
    policy: str = "fifo"  # fifo | drr | vtc
    cost_model: str = "requests"  # requests | tokens | kv_seconds
    quantum: float = 1.0  # DRR budget per turn at weight 1, in cost units
    tiers: list[TierConfig] = field(default_factory=lambda: [TierConfig("standard")])
    tenants: dict[str, TenantConfig] = field(default_factory=dict)
    # Tenants not listed: allowed (with defaults) or refused with unknown_tenant.
    allow_unknown_tenants: bool = True
    default_tenant: TenantConfig = field(default_factory=lambda: TenantConfig("_default"))
    max_queued_total: int = 1_000_000
    # Cost models (`dispatcher.scheduler.cost`).
    prompt_token_weight: float = 1.0  # w_p of the `tokens` model
    output_token_weight: float = 2.0  # w_q of the `tokens` model (as in VTC)
    kv_step_ms: float = 30.0  # the pool's decode step time, for `kv_seconds` estimates
    kv_prefill_ms_per_token: float = 0.1  # prefill time per prompt token, same purpose
    # Tier floors are measured over this (exponentially decayed) window of dispatched cost.
    share_window_ms: float = 10_000.0
    # Throttling: the service rate is measured over this sliding window; 0 disables it.
    throttle_window_ms: float = 10_000.0
    _unknown: dict[str, TenantConfig] = field(default_factory=dict, repr=False, compare=False)

    def tenant(self, name: str) -> TenantConfig | None:
        cfg = self.tenants.get(name)
        if cfg is None and self.allow_unknown_tenants:
            # Cached: this runs on every quota check, so don't allocate each time.
            cfg = self._unknown.get(name)
            if cfg is None:
                d = self.default_tenant
                cfg = self._unknown[name] = TenantConfig(
                    name, d.tier, d.weight, d.max_concurrent, d.max_kv_tokens, d.max_queued
                )
        return cfg

    def tier(self, name: str) -> TierConfig | None:
        for t in self.tiers:
            if t.name == name:
                return t
        return None
