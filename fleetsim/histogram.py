"""Log-spaced latency histograms (`LogHist`) and when a tail quantile may be reported
(`min_samples`): the recorder's statistics, in memory independent of the sample count."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

QUANTILES = {"p50": 0.50, "p90": 0.90, "p99": 0.99, "p999": 0.999}


def min_samples(q: float) -> int:
    """Samples needed before quantile `q` is reported: a tail quantile from fewer is a
    guess about the last one or two requests, so, as bench/harness.MIN_P99_SAMPLES,
    2 / (1 - q): p99 from 200, p99.9 from 2,000 (else the report shows "max=...")."""
    return max(1, math.ceil(round(2.0 / (1.0 - q), 6))) if q > 0.5 else 1


class LogHist:
    """Rows of log-spaced histograms of positive values (seconds), plus each row's
    exact n / sum / min / max. Bucket 0 is below `lo_s` (and 0), bucket i in
    1..nb holds [lo_s * g**(i-1), lo_s * g**i), bucket nb+1 is at or above `hi_s`."""

    def __init__(self, rows: int, lo_s: float, hi_s: float, growth: float,
                 dtype: Any = np.uint64) -> None:
        if not (0 < lo_s < hi_s) or growth <= 1.0:
            raise ValueError("need 0 < lo_s < hi_s and growth > 1")
        self.lo_s, self.hi_s, self.growth = lo_s, hi_s, growth
        self.ln_growth = math.log(growth)
        self.nb = math.ceil(math.log(hi_s / lo_s) / self.ln_growth)
        self.counts = np.zeros((rows, self.nb + 2), dtype=dtype)
        self.n = np.zeros(rows, dtype=np.int64)
        self.sum = np.zeros(rows)
        self.min = np.full(rows, np.inf)
        self.max = np.zeros(rows)

    def bucket(self, values_s: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            b = np.floor(np.log(np.maximum(values_s, self.lo_s) / self.lo_s)
                         / self.ln_growth) + 1
        b = np.clip(b, 1, self.nb + 1).astype(np.int64)
        b[values_s < self.lo_s] = 0
        return b

    def add(self, rows: np.ndarray, values_s: np.ndarray) -> None:
        """One sample per (row, value); non-finite or negative values are skipped."""
        ok = np.isfinite(values_s) & (values_s >= 0)
        rows, values_s = rows[ok], values_s[ok]
        if not len(rows):
            return
        nr, width = self.counts.shape
        flat = np.bincount(rows * width + self.bucket(values_s), minlength=nr * width)
        self.counts += flat.reshape(nr, width).astype(self.counts.dtype)
        self.n += np.bincount(rows, minlength=nr)
        self.sum += np.bincount(rows, weights=values_s, minlength=nr)
        np.minimum.at(self.min, rows, values_s)
        np.maximum.at(self.max, rows, values_s)

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled explicitly: compiled (mypyc), the default would call __init__ bare.
        return (_restore_hist, (self.lo_s, self.hi_s, self.growth, self.counts, self.n,
                                self.sum, self.min, self.max))

    def absorb(self, other: LogHist, row: int, other_row: int) -> None:
        """Add `other`'s row `other_row` into this row (another run's samples of the same
        thing: pools of a `--pools` run). Both must have the same buckets."""
        if (other.lo_s, other.hi_s, other.growth) != (self.lo_s, self.hi_s, self.growth):
            raise ValueError("histograms with different buckets cannot be merged")
        self.counts[row] += other.counts[other_row].astype(self.counts.dtype)
        self.n[row] += other.n[other_row]
        self.sum[row] += other.sum[other_row]
        self.min[row] = min(self.min[row], other.min[other_row])
        self.max[row] = max(self.max[row], other.max[other_row])

    def edges(self, i: int, row: int) -> tuple[float, float]:
        """Value range of bucket i of a row (the outer buckets end at the row's min/max)."""
        if i == 0:
            return float(self.min[row]), self.lo_s
        if i == self.nb + 1:
            return self.hi_s, float(self.max[row])
        return self.lo_s * self.growth ** (i - 1), self.lo_s * self.growth ** i

    def quantile(self, row: int, q: float) -> float | None:
        """numpy's linear-interpolation quantile, read from the buckets: the samples of a
        bucket are taken as spread evenly (in log space) across it, so the answer is
        within one bucket of the exact one. None without samples."""
        c = self.counts[row]
        n = int(c.sum())
        if n == 0:
            return None
        rank = q * (n - 1)
        cum = np.cumsum(c)
        i = int(np.searchsorted(cum, math.floor(rank), side="right"))
        before = int(cum[i - 1]) if i else 0
        frac = (rank - before + 0.5) / int(c[i])
        lo, hi = self.edges(i, row)
        lo, hi = max(lo, float(self.min[row])), min(hi, float(self.max[row]))
        value = lo + (hi - lo) * frac if lo <= 0 or hi <= lo else lo * (hi / lo) ** frac
        return float(min(max(value, self.min[row]), self.max[row]))

    def stats(self, row: int) -> dict[str, Any]:
        """n, mean, min, max and the quantiles of `QUANTILES` (None where too few)."""
        n = int(self.n[row])
        out: dict[str, Any] = {"n": n, "mean": float(self.sum[row] / n) if n else None,
                               "min": float(self.min[row]) if n else None,
                               "max": float(self.max[row]) if n else None}
        for name, q in QUANTILES.items():
            out[name] = self.quantile(row, q) if n >= min_samples(q) else None
        return out

    def sparse(self, row: int) -> dict[str, list[int]]:
        """The non-empty buckets of a row: {"index": [...], "count": [...]}."""
        idx = np.flatnonzero(self.counts[row])
        return {"index": idx.tolist(), "count": self.counts[row][idx].tolist()}


def _restore_hist(lo_s: float, hi_s: float, growth: float, counts: np.ndarray, n: np.ndarray,
                  total: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> LogHist:
    h = LogHist(0, lo_s, hi_s, growth)
    h.counts, h.n, h.sum, h.min, h.max = counts, n, total, lo, hi
    return h
