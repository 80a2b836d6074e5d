"""Merging pools' recorders (fleetsim.merge): the same report as one recorder that saw
every event."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fleetsim.merge import merge_recorders
from fleetsim.recorder import Recorder
from fleetsim.records import TenantTable

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

TIERS = ["enterprise", "pro", "free"]


def table(n: int) -> TenantTable:
    t = TenantTable(tiers=list(TIERS))
    for i in range(n):
        t.add(f"t{i}", i % len(TIERS))
    return t


def feed(recs, pool_of, n_tenants: int, seed: int = 5) -> None:
    """The same random events into `recs[pool_of(tenant)]` (None: into every recorder
    of `recs`, which then sees them all)."""
    rng = np.random.default_rng(seed)
    codes = ["queue_full", "throttled", "prompt_too_long"]
    for i in range(6_000):
        tenant = int(rng.integers(0, n_tenants))
        rec = recs[pool_of(tenant)]
        t_s = 0.01 * i
        kind = rng.random()
        if kind < 0.05:
            rec.on_rejected(tenant, t_s, codes[tenant % 3])
        elif kind < 0.08:
            rec.on_preempted(tenant, t_s)
            rec.on_recomputed(tenant, t_s, int(rng.integers(1, 300)))
        else:
            ttft = float(rng.lognormal(math.log(0.05), 1.0))
            e2e = ttft + float(rng.uniform(0.5, 4.0))
            out = int(rng.integers(1, 400))
            rec.on_first_token(tenant, t_s - e2e + ttft, ttft)
            rec.on_tokens(tenant, t_s - e2e + ttft, t_s, out)
            rec.on_finished(tenant, t_s, e2e, ttft, out, int(kind < 0.1))


def sample(recs, pool_of, n_tenants, t_s):
    """Each pool's part of a fleet state: per tenant 1 queued, 2 running, 1 busy worker."""
    for p, rec in enumerate(recs):
        mine = [t for t in range(n_tenants) if pool_of(t) == p]
        queued = [sum(1 for t in mine if t % 3 == i) for i in range(3)]
        rec.sample(t_s, queued, 2 * len(mine), len(mine))


def close(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            close(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            close(x, y)
    elif isinstance(a, float):
        assert a == pytest.approx(b, rel=1e-9, abs=1e-9)
    else:
        assert a == b


@pytest.mark.parametrize("num_pools", [2, 3])
def test_merged_pools_report_what_one_recorder_of_every_event_reports(num_pools):
    n = 12
    tt = table(n)

    def pool_of(t):
        return t % num_pools

    whole = Recorder(tt, 60.0, 5.0, max_tenant_detail=n, max_sample_points=20,
                     flush_every=512)
    parts = [Recorder(tt, 60.0, 5.0, max_tenant_detail=n, max_sample_points=20,
                      flush_every=512) for _ in range(num_pools)]
    feed([whole], lambda t: 0, n)
    feed(parts, pool_of, n)
    for t_s in range(60):
        sample([whole], lambda t: 0, n, float(t_s))
        sample(parts, pool_of, n, float(t_s))
    merged = merge_recorders(parts).summary()
    want = whole.summary()
    # Every tenant is a detail tenant in both: the rows agree, whatever their order.
    assert set(merged["detail_tenants"]) == set(want["detail_tenants"])
    for key in ("pool", "by_tier", "detail_tenants", "top_tenants", "windows", "tiers",
                "tenants", "end_s", "duration_s"):
        close(merged[key], want[key])
    close(merged["samples"]["queued_by_tier"], want["samples"]["queued_by_tier"])
    close(merged["samples"]["busy_workers"], want["samples"]["busy_workers"])
    close(merged["samples"]["running"], want["samples"]["running"])
    close(merged["samples"]["t_s"], want["samples"]["t_s"])
    close(merged["histograms"]["ttft_s"]["tiers"], want["histograms"]["ttft_s"]["tiers"])


def test_detail_slots_named_first_then_each_pools_own_in_turn():
    tt = table(20)
    a = Recorder(tt, 10.0, max_tenant_detail=3)
    b = Recorder(tt, 10.0, max_tenant_detail=3)
    for rec, tenants in ((a, (2, 4, 6)), (b, (1, 3, 5))):
        for t in tenants:  # one flush per tenant: first come, first slotted
            rec.on_first_token(t, 1.0, 0.1)
            rec.flush()
    merged = merge_recorders([a, b], detail_tenants=["t9"])
    assert [tt.names[t] for t in merged.detail] == ["t9", "t2", "t1"]
    s = merged.summary()
    assert s["detail_tenants"]["t2"]["ttft_s"]["n"] == 1
    assert s["detail_tenants"]["t9"]["ttft_s"]["n"] == 0
    # tenants without a detail row still count everywhere else
    assert s["pool"]["first_tokens"] == 6


def test_different_tenant_tables_or_windows_are_refused():
    with pytest.raises(ValueError, match="nothing"):
        merge_recorders([])
    with pytest.raises(ValueError, match="tenant tables"):
        merge_recorders([Recorder(table(3), 10.0), Recorder(table(4), 10.0)])
    with pytest.raises(ValueError, match="windows"):
        merge_recorders([Recorder(table(3), 10.0, 1.0), Recorder(table(3), 10.0, 2.0)])


def test_a_recorder_pickles_with_everything_it_recorded():
    """A `--pools` run's processes send their recorders back pickled."""
    import pickle

    tt = table(12)
    rec = Recorder(tt, 60.0, 5.0, max_tenant_detail=4, max_sample_points=20, flush_every=512)
    feed([rec], lambda t: 0, 12)
    rec.sample(1.0, [1, 2, 3], 4, 5)
    copy = pickle.loads(pickle.dumps(rec))
    close(copy.summary(), rec.summary())
