"""What one fidelity run saw (`bench/fidelity.py`), sim or real: per traffic class,
the requests arriving in the measurement window, their TTFT, end-to-end time and
TPOT, and the output tokens generated inside the window; then each class's numbers.
Pure; picklable (a client process sends its `Observations` back to be merged).

Where a TTFT goes (a diagnostic, not judged), for the requests that finished without
being preempted: the dispatcher's queue (its ingest to its dispatch), the worker (it
receiving the dispatch to the first token: the step in progress, the prefill step),
and the messages (all the rest: the client's publish and JetStream, the dispatch's
and the first token's way, the started record's ack). The real fleet's come from each
request's `Usage` (`queue_ms`, `ttft_ms`); the simulator's from its own clock.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from bench.harness import p99


@dataclass
class Observations:
    """What one run (sim or real) saw, in seconds from the workload's t = 0. Only
    requests ARRIVING inside [lo_s, hi_s) are timed, and only tokens generated inside
    it counted: the warm-up is dropped the same way in both variants."""

    lo_s: float
    hi_s: float
    arrived: dict[str, int] = field(default_factory=dict)
    ttft_s: dict[str, list[float]] = field(default_factory=dict)
    e2e_s: dict[str, list[float]] = field(default_factory=dict)
    tpot_s: dict[str, list[float]] = field(default_factory=dict)
    tokens: dict[str, float] = field(default_factory=dict)
    # (ttft, queue, worker) per finished request never preempted (module docstring)
    split_s: dict[str, list[tuple[float, float, float]]] = field(default_factory=dict)

    def in_window(self, t_s: float) -> bool:
        return self.lo_s <= t_s < self.hi_s

    def arrival(self, cls: str, arrival_s: float) -> None:
        if self.in_window(arrival_s):
            self.arrived[cls] = self.arrived.get(cls, 0) + 1

    def first_token(self, cls: str, arrival_s: float, ttft_s: float) -> None:
        if self.in_window(arrival_s):
            self.ttft_s.setdefault(cls, []).append(ttft_s)

    def finished(self, cls: str, arrival_s: float, e2e_s: float, ttft_s: float,
                 num_tokens: int) -> None:
        if self.in_window(arrival_s):
            self.e2e_s.setdefault(cls, []).append(e2e_s)
            if num_tokens > 1:  # TPOT: the decode pace after the first token
                self.tpot_s.setdefault(cls, []).append((e2e_s - ttft_s) / (num_tokens - 1))

    def ttft_split(self, cls: str, arrival_s: float, ttft_s: float, queue_s: float,
                   worker_s: float) -> None:
        """Where one request's TTFT went: the messages are what queue and worker leave."""
        if self.in_window(arrival_s):
            self.split_s.setdefault(cls, []).append((ttft_s, queue_s, worker_s))

    def absorb(self, other: Observations) -> None:
        """Add another run's observations of the same window (a client process's)."""
        if (other.lo_s, other.hi_s) != (self.lo_s, self.hi_s):
            raise ValueError("observations of different windows")
        for cls, n in other.arrived.items():
            self.arrived[cls] = self.arrived.get(cls, 0) + n
        for mine, theirs in ((self.ttft_s, other.ttft_s), (self.e2e_s, other.e2e_s),
                             (self.tpot_s, other.tpot_s)):
            for cls, xs in theirs.items():
                mine.setdefault(cls, []).extend(xs)
        for cls, x in other.tokens.items():
            self.tokens[cls] = self.tokens.get(cls, 0.0) + x
        for cls, parts in other.split_s.items():
            self.split_s.setdefault(cls, []).extend(parts)

    def generated(self, cls: str, start_s: float, end_s: float, num_tokens: float) -> None:
        """`num_tokens` generated evenly over [start_s, end_s] (one instant for a real
        chunk): the part inside the window counts."""
        if end_s <= start_s:
            inside = num_tokens if self.in_window(start_s) else 0.0
        else:
            overlap_s = min(end_s, self.hi_s) - max(start_s, self.lo_s)
            inside = num_tokens * max(0.0, overlap_s) / (end_s - start_s)
        if inside:
            self.tokens[cls] = self.tokens.get(cls, 0.0) + inside


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _ms(x: float | None) -> float | None:
    return None if x is None or math.isnan(x) else round(x * 1000, 3)


def split_metrics(split_s: list[tuple[float, float, float]]) -> dict[str, Any]:
    """p50 and p99 (>= 200 requests, else None) of each part of the TTFT."""
    parts = {"queue": [q for _, q, _ in split_s], "worker": [w for _, _, w in split_s],
             "messages": [t - q - w for t, q, w in split_s]}
    out: dict[str, Any] = {"n_split": len(split_s)}
    for name, xs in parts.items():
        out[f"{name}_p50_ms"], out[f"{name}_p99_ms"] = _ms(_median(xs)), _ms(p99(xs))
    return out


def metrics_of(arrived: int, ttft_s: list[float], e2e_s: list[float], tpot_s: list[float],
               tokens: float, window_s: float,
               split_s: list[tuple[float, float, float]] | None = None) -> dict[str, Any]:
    """One class's numbers for one run. p99 only from >= 200 TTFTs (bench.harness.p99),
    else None and the max stands in (render_fidelity.tail_label)."""
    return {**split_metrics(split_s or []),
        "n_arrived": arrived, "n_ttft": len(ttft_s), "n_e2e": len(e2e_s),
        "censored": arrived - len(ttft_s),
        "ttft_p50_ms": _ms(_median(ttft_s)), "ttft_p99_ms": _ms(p99(ttft_s)),
        "ttft_max_ms": _ms(max(ttft_s)) if ttft_s else None,
        "e2e_p50_ms": _ms(_median(e2e_s)), "tpot_p50_ms": _ms(_median(tpot_s)),
        "tokens_per_s": round(tokens / window_s, 2) if window_s > 0 else None,
    }


def class_metrics(obs: Observations, classes: list[str]) -> dict[str, dict[str, Any]]:
    """Every class's metrics, and the scenario's as a whole under "all"."""
    window_s = obs.hi_s - obs.lo_s
    out = {c: metrics_of(obs.arrived.get(c, 0), obs.ttft_s.get(c, []), obs.e2e_s.get(c, []),
                         obs.tpot_s.get(c, []), obs.tokens.get(c, 0.0), window_s,
                         obs.split_s.get(c, []))
           for c in classes}

    def merged(d: dict[str, list[Any]]) -> list[Any]:
        return [x for c in classes for x in d.get(c, [])]

    out["all"] = metrics_of(sum(obs.arrived.values()), merged(obs.ttft_s), merged(obs.e2e_s),
                            merged(obs.tpot_s), sum(obs.tokens.values()), window_s,
                            merged(obs.split_s))
    return out
