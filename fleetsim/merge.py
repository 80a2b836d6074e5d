"""One report from several pools' recorders (`fairlane simulate --pools K`).

Each pool of a `--pools` run has its own `Recorder` over the whole tenant table (its
tenants are a subset; the others never appear in it), so the pools' statistics add up
index by index: counters, histograms (same buckets), token windows and fleet samples
(every pool samples at the same simulated times, so a bucket's queue depths, running
sequences and busy workers are the fleet's when summed). Nothing is re-estimated: a
merged percentile is read from the summed histogram, as one pool's would be.

Detail tenants (the report's one-by-one rows): the ones named (`detail_tenants`) first,
then each pool's own in turn (its first, every pool's second, ...), up to the
recorder's `max_tenant_detail`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fleetsim.recorder import METRICS, Recorder, halve_samples


def merge_recorders(parts: Sequence[Recorder], detail_tenants: Sequence[str] = ()) -> Recorder:
    """A new Recorder holding what all of `parts` recorded (they are left as they are)."""
    if not parts:
        raise ValueError("nothing to merge")
    first = parts[0]
    for p in parts:
        if p.tenants is not first.tenants and p.tenants.names != first.tenants.names:
            raise ValueError("recorders of different tenant tables cannot be merged")
        if p.window_s != first.window_s or p.max_sample_points != first.max_sample_points:
            raise ValueError("recorders with different windows or sample budgets cannot be merged")
        p.flush()
    h = first.tier_hist["ttft_s"]
    out = Recorder(first.tenants, min(p.duration_s for p in parts), first.window_s,
                   max_tenant_detail=first.max_tenant_detail, detail_tenants=detail_tenants,
                   lo_s=h.lo_s, hi_s=h.hi_s, tier_growth=h.growth,
                   tenant_growth=first.detail_hist["ttft_s"].growth,
                   max_sample_points=first.max_sample_points)
    out.end_s = max(p.end_s for p in parts)
    for p in parts:
        _add_tenants(out, p)
        _add_tiers(out, p)
    _choose_detail(out, parts)
    for p in parts:
        _add_detail(out, p)
    _add_samples(out, parts)
    return out


def _codes(out: Recorder, part: Recorder) -> np.ndarray:
    """The part's rejection code columns -> the merged recorder's (new codes appended)."""
    for code in part.codes:
        if code not in out.codes:
            out.codes[code] = len(out.codes)
    nc = len(out.codes)
    for name in ("rejected_by_tier_code", "rejected_by_slot_code"):
        a = getattr(out, name)
        if a.shape[1] < nc:
            setattr(out, name, np.pad(a, ((0, 0), (0, nc - a.shape[1]))))
    return np.array([out.codes[c] for c in part.codes], dtype=np.int64)


def _add_tenants(out: Recorder, p: Recorder) -> None:
    for m in METRICS:
        out.t_n[m] += p.t_n[m]
        out.t_sum[m] += p.t_sum[m]
        np.maximum(out.t_max[m], p.t_max[m], out=out.t_max[m])
    for k, v in p.t_count.items():
        out.t_count[k] += v
    out.t_tokens += p.t_tokens
    out.seen |= p.seen


def _add_tiers(out: Recorder, p: Recorder) -> None:
    for m in METRICS:
        for row in range(len(out.tenants.tiers)):
            out.tier_hist[m].absorb(p.tier_hist[m], row, row)
    cols = _codes(out, p)
    if len(cols):
        out.rejected_by_tier_code[:, cols] += p.rejected_by_tier_code[:, : len(cols)]
    n = p.n_windows
    out._grow_windows(n)  # noqa: SLF001 - the recorder's own growth rule
    out.win_tier[:n] += p.win_tier[:n]


def _choose_detail(out: Recorder, parts: Sequence[Recorder]) -> None:
    """Named tenants have their slots already (the constructor); then the pools' own
    detail tenants, round-robin, while slots are left."""
    queues = [list(p.detail) for p in parts]
    depth = 0
    while len(out.detail) < out.max_tenant_detail and any(depth < len(q) for q in queues):
        for q in queues:
            if depth < len(q) and len(out.detail) < out.max_tenant_detail:
                out._give_slot(q[depth])  # noqa: SLF001 - skips tenants that have one
        depth += 1


def _add_detail(out: Recorder, p: Recorder) -> None:
    cols = _codes(out, p)
    for p_slot, tenant in enumerate(p.detail):
        slot = int(out.slot_of[tenant])
        if slot < 0:
            continue  # not among the merged report's detail tenants
        for m in METRICS:
            out.detail_hist[m].absorb(p.detail_hist[m], slot, p_slot)
        if len(cols):
            out.rejected_by_slot_code[slot, cols] += p.rejected_by_slot_code[p_slot, : len(cols)]
        n = p.n_windows
        out._grow_windows(n)  # noqa: SLF001
        out.win_detail[:n, slot] += p.win_detail[:n, p_slot]


def _add_samples(out: Recorder, parts: Sequence[Recorder]) -> None:
    """Per time bucket, the sum of the pools' mean queue depths, running sequences and
    busy workers: the fleet's (every pool samples at the same simulated times). The
    merged bucket holds that sum as one sample."""
    bucket_s = max(p.sample_bucket_s for p in parts)
    total = np.zeros_like(out.samp)
    for p in parts:
        s = p.samp.copy()
        b = p.sample_bucket_s
        while b < bucket_s:  # a pool that ran past the others halved less often
            halve_samples(s)
            b *= 2
        has = s[:, -1] > 0
        mean = s[has, :-1] / s[has, -1:]
        fresh = has & (total[:, -1] == 0)  # the bucket's time: the first pool's mean
        total[fresh, 0] = s[fresh, 0] / s[fresh, -1]
        total[has, 1:-1] += mean[:, 1:]
        total[has, -1] = 1
    out.samp = total
    out.sample_bucket_s = bucket_s
