"""Streaming statistics of a simulated fleet, in memory independent of the request count.

An hour of 1,000 workers and 100,000 tenants is ~30 million requests; keeping a
latency per request would not fit beside the simulation, so `Recorder` keeps:

- **Latency histograms** (TTFT, TPOT, end-to-end; `fleetsim.histogram`), log-spaced so
  a bucket is a fixed *relative* width: per tier at 1 % (`tier_growth`, ~1,750 buckets
  from 0.1 ms to 1 h; the pool is the sum of the tiers) and per *detail* tenant at 5 %
  (`tenant_growth`, ~360 buckets). 100,000 tenants x 3 metrics at 5 % would be ~400
  MB, so only `max_tenant_detail` tenants get histograms: the `detail_tenants` named
  up front, then the tenants with the most events among those first seen while slots
  are free. Every tenant gets count / sum / max of each metric and its counters.
- **Counters** per tenant (numpy arrays) and per tier: finished, rejected (by code),
  preemptions, recomputed tokens, output tokens, generated tokens.
- **Tokens per window** (`window_s`) per tier and per detail tenant, for shares and
  throughput over time.
- **Fleet samples** (`sample`) averaged into at most `max_sample_points` time buckets.

The hot path (one call per event, tens of millions of them) only packs the event's
numbers as float64s into a buffer per event kind (`_Rows`); every `flush_every` events
the buffers are folded into the numpy state at once, where the per-event work is
vectorised. (The buffers were `array('d')`s extended with a tuple, which converts each
number through the C API's argument parser: ~2,900 instructions an event, ~5% of a
compiled run. A list per kind is cheaper to fill, but holds a Python float per number
until the flush: +20 MB per process, and in bench/results/simulate_scale_base.md two
pools side by side ran slower with it in 4 of 5 repetitions.)
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from fleetsim.histogram import LogHist
from fleetsim.records import TenantTable

METRICS = ("ttft_s", "tpot_s", "e2e_s")
# Share-over-time windows a run may have: the window tables are windows x (tiers + 64
# detail tenants) doubles and the report lists every window, so a window far below
# the run's length (an hour in 0.1-ms windows: 19 GB) is refused, not attempted.
MAX_WINDOWS = 100_000


class Recorder:
    """Implements `records.Sink`; `summary()` returns a JSON-serialisable dict."""

    def __init__(self, tenants: TenantTable, duration_s: float, window_s: float = 10.0, *,
                 max_tenant_detail: int = 64, detail_tenants: Sequence[str] = (),
                 lo_s: float = 1e-4, hi_s: float = 3600.0, tier_growth: float = 1.01,
                 tenant_growth: float = 1.05, max_sample_points: int = 2000,
                 flush_every: int = 1 << 16) -> None:
        if not (math.isfinite(duration_s) and duration_s > 0
                and math.isfinite(window_s) and window_s > 0):
            raise ValueError(f"duration_s and window_s must be finite numbers > 0, got "
                             f"{duration_s:g} and {window_s:g}")
        if math.ceil(duration_s / window_s) > MAX_WINDOWS:
            # The least window that fits, rounded up to 3 digits (and so it does fit).
            least = duration_s / MAX_WINDOWS * (1 + 1e-9)
            unit = 10.0 ** (math.floor(math.log10(least)) - 2)
            raise ValueError(f"a {window_s:g}-s window over {duration_s:g} s is "
                             f"{math.ceil(duration_s / window_s):,} windows, more than "
                             f"{MAX_WINDOWS:,}: use a window of at least "
                             f"{math.ceil(least / unit) * unit:.3g} s (--window-s)")
        self.tenants = tenants
        self.duration_s, self.window_s = float(duration_s), float(window_s)
        self.flush_every = flush_every
        nt, ntiers = len(tenants), len(tenants.tiers)
        self._tier_of = np.asarray(tenants.tier_of, dtype=np.int64)
        # Per-tier (fine) and per-detail-tenant (coarse) histograms, one per metric.
        self.tier_hist = {m: LogHist(ntiers, lo_s, hi_s, tier_growth) for m in METRICS}
        self.detail_hist = {m: LogHist(max_tenant_detail, lo_s, hi_s, tenant_growth,
                                       dtype=np.uint32) for m in METRICS}
        # Every tenant: n / sum / max per metric and its counters.
        self.t_n = {m: np.zeros(nt, dtype=np.int64) for m in METRICS}
        self.t_sum = {m: np.zeros(nt) for m in METRICS}
        self.t_max = {m: np.zeros(nt) for m in METRICS}
        self.t_count = {k: np.zeros(nt, dtype=np.int64) for k in (
            "finished", "rejected", "preemptions", "preempted_requests", "recomputed_tokens",
            "output_tokens")}
        self.t_tokens = np.zeros(nt)  # generated (on_tokens), fractional while spread
        # Rejections by code: codes become small ints so the buffer holds no strings.
        self.codes: dict[str, int] = {}
        self.rejected_by_tier_code = np.zeros((ntiers, 0), dtype=np.int64)
        self.rejected_by_slot_code = np.zeros((max_tenant_detail, 0), dtype=np.int64)
        # Detail tenants: slot per tenant (-1 none), in slot order.
        self.max_tenant_detail = max_tenant_detail
        self.slot_of = np.full(nt, -1, dtype=np.int64)
        self.detail: list[int] = []
        self.seen = np.zeros(nt, dtype=bool)
        index = {name: i for i, name in enumerate(tenants.names)}
        if len(set(detail_tenants)) > max_tenant_detail:
            raise ValueError(f"{len(set(detail_tenants))} detail tenants named, at most "
                             f"{max_tenant_detail} are reported one by one")
        for name in detail_tenants:
            if name not in index:
                raise ValueError(f"detail tenant {name!r} is not in the tenant table")
            self._give_slot(index[name])
        # Tokens per window: rows grow (doubling) if the run goes past duration_s.
        self.n_windows = max(1, math.ceil(self.duration_s / self.window_s))
        self.win_tier = np.zeros((self.n_windows, ntiers))
        self.win_detail = np.zeros((self.n_windows, max_tenant_detail))
        # Fleet samples: sums per time bucket; buckets merge in pairs when the run
        # outgrows them, so there are never more than max_sample_points.
        self.max_sample_points = max(2, max_sample_points - max_sample_points % 2)  # pairs
        self.sample_bucket_s = self.duration_s / self.max_sample_points
        self.samp = np.zeros((self.max_sample_points, ntiers + 4))  # t, queued..., running, busy, n
        self.end_s = 0.0
        # Pending events, a row of float64s each, per kind (no Python objects, and one
        # call per event); columns as in `flush`. Tenant indices and token counts are
        # exact in a double up to 2**53.
        self._first, self._fin, self._tok = _Rows(3), _Rows(6), _Rows(4)
        self._rej, self._pre, self._rec = _Rows(3), _Rows(2), _Rows(3)

    # --- Sink (hot path: one row packed into a float64 buffer, folded in `flush`) ------

    def on_rejected(self, tenant: int, t_s: float, code: str) -> None:
        c = self.codes.get(code)
        if c is None:
            c = self.codes[code] = len(self.codes)
        rows = self._rej
        rows.pack_into(rows.buf, rows.next_row(), tenant, t_s, c)
        if rows.n >= self.flush_every:
            self.flush()

    def on_first_token(self, tenant: int, t_s: float, ttft_s: float) -> None:
        rows = self._first
        rows.pack_into(rows.buf, rows.next_row(), tenant, t_s, ttft_s)
        if rows.n >= self.flush_every:
            self.flush()

    def on_finished(self, tenant: int, t_s: float, e2e_s: float, ttft_s: float,
                    output_tokens: int, preemptions: int, worker_ttft_s: float = 0.0,
                    client_s: float = 0.0) -> None:
        rows = self._fin
        rows.pack_into(rows.buf, rows.next_row(), tenant, t_s, e2e_s, ttft_s, output_tokens,
                       preemptions)
        if rows.n >= self.flush_every:
            self.flush()

    def on_tokens(self, tenant: int, start_s: float, end_s: float, num_tokens: int) -> None:
        rows = self._tok
        rows.pack_into(rows.buf, rows.next_row(), tenant, end_s, start_s, num_tokens)
        if rows.n >= self.flush_every:
            self.flush()

    def on_preempted(self, tenant: int, t_s: float) -> None:
        rows = self._pre
        rows.pack_into(rows.buf, rows.next_row(), tenant, t_s)
        if rows.n >= self.flush_every:
            self.flush()

    def on_recomputed(self, tenant: int, t_s: float, num_tokens: int) -> None:
        rows = self._rec
        rows.pack_into(rows.buf, rows.next_row(), tenant, t_s, num_tokens)
        if rows.n >= self.flush_every:
            self.flush()

    def sample(self, t_s: float, queued_by_tier: list[int], running: int,
               busy_workers: int) -> None:
        i = max(0, int(t_s / self.sample_bucket_s))
        while i >= self.max_sample_points:  # past duration_s: halve the resolution
            halve_samples(self.samp)
            self.sample_bucket_s *= 2
            i = int(t_s / self.sample_bucket_s)
        row = self.samp[i]
        row[0] += t_s
        row[1:-3] += queued_by_tier
        row[-3] += running
        row[-2] += busy_workers
        row[-1] += 1
        if t_s > self.end_s:
            self.end_s = t_s

    # --- batch folding --------------------------------------------------------------

    def _give_slot(self, tenant: int) -> None:
        if self.slot_of[tenant] < 0 and len(self.detail) < self.max_tenant_detail:
            self.slot_of[tenant] = len(self.detail)
            self.detail.append(tenant)
        self.seen[tenant] = True

    def flush(self) -> None:
        """Fold every pending event into the numpy state (also done by `summary`)."""
        first, fin, tok, rej, pre, rec = (b.take() for b in (
            self._first, self._fin, self._tok, self._rej, self._pre, self._rec))
        batches = (first, fin, tok, rej, pre, rec)
        # Column 0 is the tenant and column 1 the event's time in every kind.
        tenants = np.concatenate([b[:, 0] for b in batches]).astype(np.int64)
        if not len(tenants):
            return
        self.end_s = max(self.end_s, float(np.concatenate([b[:, 1] for b in batches]).max()))
        if tenants.max() >= len(self.slot_of):
            raise ValueError(f"tenant index {int(tenants.max())} is past the {len(self.slot_of)}"
                             " tenants the Recorder was made with (complete the table first)")
        self._assign_detail(tenants)
        self._add_latency("ttft_s", first[:, 0].astype(np.int64), first[:, 2])
        t, e2e, ttft, out = fin[:, 0].astype(np.int64), fin[:, 2], fin[:, 3], fin[:, 4]
        self._add_latency("e2e_s", t, e2e)
        many = out > 1  # TPOT is undefined for a one-token answer
        self._add_latency("tpot_s", t[many], (e2e[many] - ttft[many]) / (out[many] - 1))
        nt = len(self.slot_of)

        def per_tenant(rows: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
            return np.rint(np.bincount(rows[:, 0].astype(np.int64), weights=weights,
                                       minlength=nt)).astype(np.int64)
        c = self.t_count
        c["finished"] += per_tenant(fin)
        c["output_tokens"] += per_tenant(fin, out)
        c["preempted_requests"] += per_tenant(fin[fin[:, 5] > 0])
        c["preemptions"] += per_tenant(pre)
        c["recomputed_tokens"] += per_tenant(rec, rec[:, 2])
        c["rejected"] += per_tenant(rej)
        self._add_rejections(rej[:, 0].astype(np.int64), rej[:, 2].astype(np.int64))
        self._add_tokens(tok[:, 0].astype(np.int64), tok[:, 2], tok[:, 1], tok[:, 3])

    def _assign_detail(self, tenants: np.ndarray) -> None:
        """Free detail slots go to tenants seen for the first time in this batch, the
        ones with the most events first (a proxy for 'most requests')."""
        if len(self.detail) >= self.max_tenant_detail:
            return
        events = np.bincount(tenants, minlength=len(self.seen))
        new = np.flatnonzero((events > 0) & ~self.seen)
        for tenant in new[np.argsort(-events[new], kind="stable")]:
            self._give_slot(int(tenant))
        self.seen[new] = True

    def _add_latency(self, metric: str, tenants: np.ndarray, values_s: np.ndarray) -> None:
        ok = np.isfinite(values_s) & (values_s >= 0)
        tenants, values_s = tenants[ok], values_s[ok]
        if not len(tenants):
            return
        self.tier_hist[metric].add(self._tier_of[tenants], values_s)
        slots = self.slot_of[tenants]
        d = slots >= 0
        self.detail_hist[metric].add(slots[d], values_s[d])
        nt = len(self.slot_of)
        self.t_n[metric] += np.bincount(tenants, minlength=nt)
        self.t_sum[metric] += np.bincount(tenants, weights=values_s, minlength=nt)
        np.maximum.at(self.t_max[metric], tenants, values_s)

    def _add_rejections(self, tenants: np.ndarray, codes: np.ndarray) -> None:
        nc = len(self.codes)
        for name in ("rejected_by_tier_code", "rejected_by_slot_code"):
            a = getattr(self, name)
            if a.shape[1] < nc:
                setattr(self, name, np.pad(a, ((0, 0), (0, nc - a.shape[1]))))
        if not len(tenants):
            return
        np.add.at(self.rejected_by_tier_code, (self._tier_of[tenants], codes), 1)
        slots = self.slot_of[tenants]
        d = slots >= 0
        np.add.at(self.rejected_by_slot_code, (slots[d], codes[d]), 1)

    def _add_tokens(self, tenants: np.ndarray, start_s: np.ndarray, end_s: np.ndarray,
                    num: np.ndarray) -> None:
        """Spread each event's tokens evenly over [start_s, end_s] across the windows it
        overlaps (an instant event lands whole in its window)."""
        if not len(tenants):
            return
        nt = len(self.slot_of)
        self.t_tokens += np.bincount(tenants, weights=num, minlength=nt)
        w = self.window_s
        start_s = np.maximum(start_s, 0.0)
        end_s = np.maximum(end_s, start_s)
        w0, w1 = (start_s // w).astype(np.int64), (end_s // w).astype(np.int64)
        self._grow_windows(int(w1.max()) + 1)
        span = w1 - w0 + 1
        ev = np.repeat(np.arange(len(tenants)), span)
        win = w0[ev] + (np.arange(len(ev)) - np.repeat(np.cumsum(span) - span, span))
        dur = end_s - start_s
        lo = np.maximum(start_s[ev], win * w)
        hi = np.minimum(end_s[ev], (win + 1) * w)
        with np.errstate(divide="ignore", invalid="ignore"):
            part = np.where(dur[ev] > 0, (hi - lo) / dur[ev], 1.0)
        amount = num[ev] * part
        ntiers = self.win_tier.shape[1]
        tier = self._tier_of[tenants[ev]]
        self.win_tier += np.bincount(win * ntiers + tier, weights=amount,
                                     minlength=self.win_tier.size).reshape(self.win_tier.shape)
        slots = self.slot_of[tenants[ev]]
        d = slots >= 0
        nd = self.win_detail.shape[1]
        if d.any() and nd:
            self.win_detail += np.bincount(
                win[d] * nd + slots[d], weights=amount[d],
                minlength=self.win_detail.size).reshape(self.win_detail.shape)

    def _grow_windows(self, needed: int) -> None:
        if needed <= len(self.win_tier):
            self.n_windows = max(self.n_windows, needed)
            return
        rows = max(needed, 2 * len(self.win_tier))
        self.win_tier = np.pad(self.win_tier, ((0, rows - len(self.win_tier)), (0, 0)))
        self.win_detail = np.pad(self.win_detail, ((0, rows - len(self.win_detail)), (0, 0)))
        self.n_windows = needed

    def stopped_at(self, t_s: float) -> None:
        """The run ended at `t_s`, before its duration (`fleet.StopRun`): rates and
        windows cover [0, t_s), not the time that was never simulated."""
        self.flush()
        self.duration_s = min(self.duration_s, max(t_s, 1e-9))
        self.n_windows = max(1, math.ceil(self.duration_s / self.window_s))

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its state (a `--pools` run's processes send theirs back): compiled
        (mypyc), the default would call __init__ bare. Pending events are folded first."""
        self.flush()
        return (_restore, (self.tenants, self.duration_s, self.window_s,
                           {name: getattr(self, name) for name in _STATE}))

    # --- results --------------------------------------------------------------------

    def shares_by_window(self) -> np.ndarray:
        """(windows, tiers): each tier's share of the window's tokens (0 where none)."""
        self.flush()
        tok = self.win_tier[: self.n_windows]
        total = tok.sum(axis=1, keepdims=True)
        return np.divide(tok, total, out=np.zeros_like(tok), where=total > 0)

    def summary(self) -> dict[str, Any]:
        """Everything the report needs, as plain JSON types (see report.py)."""
        self.flush()
        tiers, names = self.tenants.tiers, self.tenants.names
        nt, tier_of = len(self.slot_of), self._tier_of
        total_tokens = float(self.t_tokens.sum())
        span_s = max(self.duration_s, self.end_s)

        def counters(mask: np.ndarray) -> dict[str, Any]:
            out: dict[str, Any] = {k: int(v[mask].sum()) for k, v in self.t_count.items()}
            out["tokens_generated"] = float(self.t_tokens[mask].sum())
            out["share"] = out["tokens_generated"] / total_tokens if total_tokens else 0.0
            out["first_tokens"] = int(self.t_n["ttft_s"][mask].sum())
            return out

        def by_code(counts: np.ndarray) -> dict[str, int]:
            return {c: int(n) for c, n in zip(self.codes, counts, strict=True) if n}

        def latency(hists: dict[str, LogHist], row: int | None) -> dict[str, Any]:
            if row is not None:
                return {m: h.stats(row) for m, h in hists.items()}
            return {m: _pooled(h) for m, h in hists.items()}

        by_tier: dict[str, Any] = {}
        for i, tier in enumerate(tiers):
            mask = tier_of == i
            by_tier[tier] = (counters(mask) | {"tenants": int(mask.sum())}
                             | {"rejected_by_code": by_code(self.rejected_by_tier_code[i])}
                             | latency(self.tier_hist, i))
        pool = (counters(np.ones(nt, dtype=bool)) | {"tenants": nt}
                | {"rejected_by_code": by_code(self.rejected_by_tier_code.sum(axis=0))}
                | latency(self.tier_hist, None))
        pool["throughput_tok_s"] = total_tokens / span_s

        detail: dict[str, Any] = {}
        for slot, tenant in enumerate(self.detail):
            mask = np.zeros(nt, dtype=bool)
            mask[tenant] = True
            detail[names[tenant]] = (
                counters(mask) | {"tier": tiers[tier_of[tenant]]}
                | {"rejected_by_code": by_code(self.rejected_by_slot_code[slot])}
                | latency(self.detail_hist, slot))

        return {
            "version": 1,
            "duration_s": self.duration_s,
            "end_s": self.end_s,
            "window_s": self.window_s,
            "tiers": list(tiers),
            "tenants": nt,
            "histogram": {"lo_s": self.tier_hist["ttft_s"].lo_s,
                          "hi_s": self.tier_hist["ttft_s"].hi_s,
                          "tier_growth": self.tier_hist["ttft_s"].growth,
                          "tenant_growth": self.detail_hist["ttft_s"].growth},
            "pool": pool,
            "by_tier": by_tier,
            "detail_tenants": detail,
            "top_tenants": self._top_tenants(20),
            "windows": self._windows(),
            "samples": self._samples(),
            "histograms": {
                m: {"tiers": {t: self.tier_hist[m].sparse(i) for i, t in enumerate(tiers)},
                    "tenants": {names[t]: self.detail_hist[m].sparse(s)
                                for s, t in enumerate(self.detail)}}
                for m in METRICS},
        }

    def _top_tenants(self, k: int) -> list[dict[str, Any]]:
        """The k tenants with the most finished requests (mean / max from the
        per-tenant sums, which every tenant has)."""
        fin = self.t_count["finished"]
        top = np.argsort(-fin, kind="stable")[:k]
        out = []
        for t in top:
            if fin[t] == 0:
                break
            row: dict[str, Any] = {"tenant": self.tenants.names[t],
                                   "tier": self.tenants.tiers[self._tier_of[t]]}
            row |= {k2: int(v[t]) for k2, v in self.t_count.items()}
            row["tokens_generated"] = float(self.t_tokens[t])
            for m in METRICS:
                n = int(self.t_n[m][t])
                row[f"{m}_mean"] = float(self.t_sum[m][t] / n) if n else None
                row[f"{m}_max"] = float(self.t_max[m][t]) if n else None
            out.append(row)
        return out

    def _windows(self) -> dict[str, Any]:
        tok = self.win_tier[: self.n_windows]
        total = tok.sum(axis=1)
        shares = self.shares_by_window()
        names = self.tenants.names
        return {
            "start_s": (np.arange(self.n_windows) * self.window_s).tolist(),
            "throughput_tok_s": (total / self.window_s).tolist(),
            "tokens_by_tier": {t: tok[:, i].tolist() for i, t in enumerate(self.tenants.tiers)},
            "share_by_tier": {t: shares[:, i].tolist() for i, t in enumerate(self.tenants.tiers)},
            "share_by_tenant": {
                names[t]: np.divide(self.win_detail[: self.n_windows, s], total,
                                    out=np.zeros(self.n_windows), where=total > 0).tolist()
                for s, t in enumerate(self.detail)},
        }

    def _samples(self) -> dict[str, Any]:
        s = self.samp[self.samp[:, -1] > 0]
        mean = s[:, :-1] / s[:, -1:]
        return {
            "t_s": mean[:, 0].tolist(),
            "queued_by_tier": {t: mean[:, 1 + i].tolist()
                               for i, t in enumerate(self.tenants.tiers)},
            "running": mean[:, -2].tolist(),
            "busy_workers": mean[:, -1].tolist(),
            "bucket_s": self.sample_bucket_s,
        }


# What `__reduce__` carries besides the constructor's arguments (the rest is derived
# from those, or empty after a flush).
_STATE = ("flush_every", "tier_hist", "detail_hist", "t_n", "t_sum", "t_max", "t_count",
          "t_tokens", "codes", "rejected_by_tier_code", "rejected_by_slot_code",
          "max_tenant_detail", "slot_of", "detail", "seen", "n_windows", "win_tier",
          "win_detail", "max_sample_points", "sample_bucket_s", "samp", "end_s")


def _restore(tenants: TenantTable, duration_s: float, window_s: float,
             state: dict[str, Any]) -> Recorder:
    rec = Recorder(tenants, duration_s, window_s, max_tenant_detail=0)
    for name, value in state.items():
        setattr(rec, name, value)
    return rec


def halve_samples(samp: np.ndarray) -> None:
    """Fleet sample buckets merged in pairs, in place (the second half emptied)."""
    samp[: len(samp) // 2] = samp[0::2] + samp[1::2]
    samp[len(samp) // 2:] = 0


def _pooled(h: LogHist) -> dict[str, Any]:
    """The stats of all rows of a (same-resolution) histogram together."""
    n = int(h.n.sum())
    pooled = LogHist(1, h.lo_s, h.hi_s, h.growth)
    pooled.counts[0] = h.counts.sum(axis=0)
    pooled.n[0], pooled.sum[0] = n, h.sum.sum()
    pooled.min[0] = h.min.min() if len(h.min) else np.inf
    pooled.max[0] = h.max.max() if len(h.max) else 0.0
    return pooled.stats(0)


class _Rows:
    """One event kind's pending events: rows of `width` float64s, packed in place
    (`pack_into(buf, next_row(), *numbers)`: each number converted as a float, in C,
    and no object kept). The buffer doubles when full and is kept between flushes."""

    def __init__(self, width: int, rows: int = 256) -> None:
        self.width = width
        self.row_bytes = 8 * width
        # Native order and size (no prefix): `take` reads the bytes back as float64s.
        self.pack_into = struct.Struct(f"{width}d").pack_into
        self.buf = bytearray(self.row_bytes * rows)
        self.capacity = rows
        self.n = 0  # rows pending

    def next_row(self) -> int:
        """The byte offset of a new row (the buffer grows to hold it)."""
        if self.n == self.capacity:
            self.buf.extend(bytes(len(self.buf)))
            self.capacity *= 2
        self.n += 1
        return (self.n - 1) * self.row_bytes

    def take(self) -> np.ndarray:
        """The pending rows as a (rows, width) array (a copy); none are pending after."""
        rows = np.frombuffer(self.buf, dtype=np.float64, count=self.n * self.width).copy()
        self.n = 0
        return rows.reshape(-1, self.width)
