"""Arrival processes and length distributions of a simulator workload (`workload`).

A traffic class is N tenants with the same per-tenant process. Each process here
generates the whole class as ONE stream of ``(t_s, k)`` (k = the tenant's offset in
its class) in O(1) memory, however large N is: a superposition of N Poisson streams of
rate r is one Poisson stream of rate N*r whose every arrival belongs to a uniformly
drawn tenant, and per-tenant state (a phase) is a function of the tenant's offset
instead of a stored table. `class_arrivals` turns a class's stream into `Arrival`s
and `merge_arrivals` merges the classes' streams with a heap (`workload` calls both):
every arrival passes through here, so this module is compiled for `--compiled` runs
(`fleetsim.compiled`), unlike `workload`'s file parsing.

Validation errors raise `WorkloadError` naming the field path
(``classes[1].arrival.rate_per_s: must be >= 0, got -1``).
"""

from __future__ import annotations

import heapq
import math
import random
from bisect import bisect_right
from collections.abc import Iterator
from heapq import heapify, heappop, heapreplace  # by name: compiled, heapq.x is a lookup per call
from itertools import accumulate
from typing import Any, ClassVar

from fairlane.tenants_schema import TenantsFileError
from fleetsim.records import Arrival

PROCESSES = ("poisson", "burst", "on_off", "diurnal")
DISTS = ("fixed", "uniform", "lognormal", "normal", "choice", "empirical")
DAY_S = 86_400.0


class WorkloadError(TenantsFileError):
    """The workload cannot be used. The message names the source and the field path
    (the tenants file's error, whose sections a workload file shares)."""


def kind_of(obj: Any) -> str:
    if obj is None:
        return "null"
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(obj), type(obj).__name__)


class Fields:
    """A mapping under validation: unknown keys are refused up front (a typo is an
    error, not a silently default), then values are taken with range checks."""

    _MISSING: ClassVar[Any] = object()

    def __init__(self, raw: Any, source: str, path: str, known: tuple[str, ...]) -> None:
        self.source, self.path = source, path
        if not isinstance(raw, dict):
            raise WorkloadError(source, path, f"expected a mapping, got {kind_of(raw)}")
        for key in raw:
            if key not in known:
                raise self.fail(str(key), f"unknown field (expected one of: {', '.join(known)})")
        self.raw = raw

    def at(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def fail(self, key: str, message: str) -> WorkloadError:
        return WorkloadError(self.source, self.at(key), message)

    def get(self, key: str, default: Any = _MISSING) -> Any:
        if key in self.raw and self.raw[key] is not None:
            return self.raw[key]
        if default is Fields._MISSING:
            raise self.fail(key, "required")
        return default

    def num(self, key: str, default: Any = _MISSING, *, ge: float | None = None,
            gt: float | None = None, le: float | None = None, integer: bool = False) -> Any:
        value = self.get(key, default)
        if value is None:
            return None
        return check_num(value, self.source, self.at(key), ge=ge, gt=gt, le=le, integer=integer)


def check_num(value: Any, source: str, path: str, *, ge: float | None = None,
              gt: float | None = None, le: float | None = None, integer: bool = False) -> Any:
    ok = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok):
        what = "an integer" if integer else "a number"
        raise WorkloadError(source, path, f"expected {what}, got {kind_of(value)}")
    if not math.isfinite(value):
        raise WorkloadError(source, path, f"must be a finite number, got {value}")
    if ge is not None and value < ge:
        raise WorkloadError(source, path, f"must be >= {ge:g}, got {value}")
    if gt is not None and value <= gt:
        raise WorkloadError(source, path, f"must be > {gt:g}, got {value}")
    if le is not None and value > le:
        raise WorkloadError(source, path, f"must be <= {le:g}, got {value}")
    return value


# --- length distributions (token counts, always >= 1) ---


class Dist:
    """Draws a token count. `upper`: the largest it can draw (None = unbounded)."""

    upper: int | None = None

    def draw(self, rng: random.Random) -> int:
        raise NotImplementedError


class _Fixed(Dist):
    def __init__(self, value: int) -> None:
        self.value = self.upper = value

    def draw(self, rng: random.Random) -> int:
        return self.value


class _Uniform(Dist):
    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.upper = lo, hi
        self.span = hi - lo + 1

    def draw(self, rng: random.Random) -> int:
        # random() * span, not randint: a third of the cost, on the hot path.
        return self.lo + min(int(rng.random() * self.span), self.span - 1)


def gauss(rng: random.Random, mu: float, sigma: float) -> float:
    """rng.gauss(mu, sigma), written out as random.py has it (its second value kept on
    `rng` for the next call included): the same draws, without a call into interpreted
    code per request (~1.5% of a compiled run)."""
    # gauss_next: random.Random's own state, which typeshed does not declare.
    z: float | None = rng.gauss_next  # type: ignore[attr-defined]
    rng.gauss_next = None  # type: ignore[attr-defined]
    if z is None:
        rand = rng.random
        x2pi = rand() * (2.0 * math.pi)
        g2rad = math.sqrt(-2.0 * math.log(1.0 - rand()))
        z = math.cos(x2pi) * g2rad
        rng.gauss_next = math.sin(x2pi) * g2rad  # type: ignore[attr-defined]
    return mu + z * sigma


class _Clipped(Dist):
    """lognormal (`mean` is the distribution's mean in tokens, not the log's) or normal,
    rounded and clipped to [lo, hi]; clipping moves the mean slightly."""

    def __init__(self, lognormal: bool, mean: float, spread: float, lo: int,
                 hi: int | None) -> None:
        self.lognormal, self.lo, self.upper = lognormal, lo, hi
        self.hi = hi if hi is not None else math.inf
        # For a lognormal of mean m: mu = ln(m) - sigma^2 / 2.
        self.mu = math.log(mean) - spread * spread / 2 if lognormal else mean
        self.spread = spread

    def draw(self, rng: random.Random) -> int:
        x = gauss(rng, self.mu, self.spread)
        if self.lognormal:
            x = math.exp(min(x, 700.0))  # exp overflows past ~709
        return int(min(max(round(x), self.lo), self.hi))


class _Choice(Dist):
    def __init__(self, values: list[int], weights: list[float]) -> None:
        self.values = values
        self.cum = list(accumulate(weights))
        self.total = self.cum[-1]
        self.upper = max(values)

    def draw(self, rng: random.Random) -> int:
        i = bisect_right(self.cum, rng.random() * self.total)
        return self.values[min(i, len(self.values) - 1)]


def parse_dist(raw: Any, source: str, path: str) -> Dist:
    kind = raw.get("dist") if isinstance(raw, dict) else None
    known = {
        "fixed": ("value",), "uniform": ("min", "max"),
        "lognormal": ("mean", "sigma", "min", "max"), "normal": ("mean", "std", "min", "max"),
        "choice": ("values", "weights"), "empirical": ("samples",),
    }
    if isinstance(raw, dict) and not (isinstance(kind, str) and kind in known):
        if kind is None:
            raise WorkloadError(source, f"{path}.dist", f"required (one of: {', '.join(DISTS)})")
        raise WorkloadError(source, f"{path}.dist",
                            f"unknown distribution {kind!r} (expected one of: {', '.join(DISTS)})")
    f = Fields(raw, source, path, ("dist", *known.get(str(kind), ())))
    if kind == "fixed":
        return _Fixed(f.num("value", ge=1, integer=True))
    if kind == "uniform":
        lo, hi = f.num("min", ge=1, integer=True), f.num("max", ge=1, integer=True)
        if hi < lo:
            raise f.fail("max", f"must be >= min ({lo}), got {hi}")
        return _Uniform(lo, hi)
    if kind in ("lognormal", "normal"):
        mean = f.num("mean", gt=0)
        spread = f.num("sigma" if kind == "lognormal" else "std", ge=0)
        lo = f.num("min", 1, ge=1, integer=True)
        hi = f.num("max", None, ge=1, integer=True)
        if hi is not None and hi < lo:
            raise f.fail("max", f"must be >= min ({lo}), got {hi}")
        return _Clipped(kind == "lognormal", mean, spread, lo, hi)
    key = "values" if kind == "choice" else "samples"
    values = f.get(key)
    if not isinstance(values, list) or not values:
        raise f.fail(key, f"expected a non-empty list, got {kind_of(values)}")
    ints = [check_num(v, source, f"{f.at(key)}[{i}]", ge=1, integer=True)
            for i, v in enumerate(values)]
    weights = f.get("weights", None) if kind == "choice" else None
    if weights is None:
        return _Choice(ints, [1.0] * len(ints))
    if not isinstance(weights, list) or len(weights) != len(ints):
        raise f.fail("weights", f"expected a list of {len(ints)} numbers (one per value)")
    ws = [check_num(w, source, f"{f.at('weights')}[{i}]", ge=0) for i, w in enumerate(weights)]
    if sum(ws) <= 0:
        raise f.fail("weights", "must not all be 0")
    return _Choice(ints, ws)


# --- arrival processes (rates per tenant) ---


class Process:
    """A per-tenant arrival process, generated for a whole class at once."""

    def stream(self, rng: random.Random, num_tenants: int,
               duration_s: float) -> Iterator[tuple[float, int]]:
        """``(t_s, k)`` with 0 <= t_s < duration_s ascending, k in [0, num_tenants)."""
        raise NotImplementedError

    def expected(self, num_tenants: int, duration_s: float) -> float:
        """Mean number of arrivals in [0, duration_s) (over the seed's randomness)."""
        raise NotImplementedError


def _poisson_times(rng: random.Random, rate_per_s: float,
                   duration_s: float) -> Iterator[float]:
    if rate_per_s <= 0:
        return
    rand, t = rng.random, 0.0
    while True:
        # rng.expovariate(rate_per_s), written out as random.py has it: the same draws,
        # without a call into interpreted code per arrival (~1% of a compiled run).
        t += -math.log(1.0 - rand()) / rate_per_s
        if t >= duration_s:
            return
        yield t


def _poisson(rng: random.Random, rate_per_s: float, n: int,
             duration_s: float) -> Iterator[tuple[float, int]]:
    """A class's Poisson stream: each arrival's tenant drawn uniformly."""
    rand = rng.random
    for t in _poisson_times(rng, rate_per_s, duration_s):
        yield t, min(int(rand() * n), n - 1)


class Poisson(Process):
    def __init__(self, rate_per_s: float) -> None:
        self.rate_per_s = rate_per_s

    def stream(self, rng: random.Random, num_tenants: int,
               duration_s: float) -> Iterator[tuple[float, int]]:
        return _poisson(rng, self.rate_per_s * num_tenants, num_tenants, duration_s)

    def expected(self, num_tenants: int, duration_s: float) -> float:
        return self.rate_per_s * num_tenants * duration_s


class Burst(Process):
    """Each tenant sends `count` requests at `at_s` (again every `every_s`), evenly over
    `spread_s` (0 = all at the same instant), tenants interleaved round robin; plus a
    background Poisson `rate_per_s`."""

    def __init__(self, at_s: float, count: int, every_s: float | None, spread_s: float,
                 rate_per_s: float) -> None:
        self.at_s, self.count, self.every_s = at_s, count, every_s
        self.spread_s, self.rate_per_s = spread_s, rate_per_s

    def _starts(self, duration_s: float) -> Iterator[float]:
        t, j = self.at_s, 0
        while t < duration_s:
            yield t
            if self.every_s is None:
                return
            j += 1
            t = self.at_s + j * self.every_s  # multiplied, not summed: no drift

    def _bursts(self, n: int, duration_s: float) -> Iterator[tuple[float, int]]:
        total = n * self.count
        step_s = self.spread_s / total
        for start in self._starts(duration_s):
            for pos in range(total):
                t = start + step_s * pos
                if t >= duration_s:
                    return
                yield t, pos % n

    def stream(self, rng: random.Random, num_tenants: int,
               duration_s: float) -> Iterator[tuple[float, int]]:
        bursts = self._bursts(num_tenants, duration_s)
        if self.rate_per_s <= 0:
            return bursts
        background = _poisson(rng, self.rate_per_s * num_tenants, num_tenants, duration_s)
        return heapq.merge(bursts, background)

    def expected(self, num_tenants: int, duration_s: float) -> float:
        total = num_tenants * self.count
        step_s = self.spread_s / total
        n = 0.0
        for start in self._starts(duration_s):
            n += total if step_s == 0 else min(total, math.ceil((duration_s - start) / step_s))
        return n + self.rate_per_s * num_tenants * duration_s


def _permutation(rng: random.Random, n: int) -> tuple[int, int, int]:
    """A seeded affine permutation of [0, n): rank(k) = (a*k + c) % n; returns (a, c,
    a^-1 mod n). Shuffles which tenants share a phase without a table of n entries."""
    if n == 1:
        return 1, 0, 1
    while True:
        a = rng.randrange(1, n)
        if math.gcd(a, n) == 1:
            return a, rng.randrange(n), pow(a, -1, n)


class OnOff(Process):
    """Each tenant is Poisson at `rate_per_s` for `on_s`, then silent for `off_s`.

    Phases are spread evenly over the period, (rank + u) / n of it with u drawn once, and
    ranks are shuffled over tenants by a seeded affine permutation. The tenants that are
    on at t are then the ranks of one circular interval, as many (to within one) at any
    time: a class stream at the most-on rate, thinned by (on now / most on), picks a
    tenant that is on in O(1) and rejects almost nothing (a per-tenant hashed phase
    would reject off_s / (on_s + off_s) of candidates)."""

    def __init__(self, rate_per_s: float, on_s: float, off_s: float) -> None:
        self.rate_per_s, self.on_s, self.off_s = rate_per_s, on_s, off_s

    def stream(self, rng: random.Random, num_tenants: int,
               duration_s: float) -> Iterator[tuple[float, int]]:
        n, period_s = num_tenants, self.on_s + self.off_s
        duty = self.on_s / period_s
        u = rng.random()
        _a, c, a_inv = _permutation(rng, n)
        most_on = min(n, math.ceil(duty * n))
        rand = rng.random
        for t in _poisson_times(rng, self.rate_per_s * most_on, duration_s):
            # Rank k is on at t iff frac(t/period + (k+u)/n) < duty, i.e. k in
            # [n*s - u, n*s + n*duty - u) modulo n, with s = frac(-t/period).
            s = -t / period_s % 1.0
            lo = math.ceil(n * s - u)
            on = min(most_on, math.ceil(n * (s + duty) - u) - lo)
            if on <= 0 or (on < most_on and rand() * most_on >= on):
                continue
            rank = (lo + min(int(rand() * on), on - 1)) % n
            yield t, (rank - c) * a_inv % n

    def expected(self, num_tenants: int, duration_s: float) -> float:
        return self.rate_per_s * num_tenants * duration_s * self.on_s / (self.on_s + self.off_s)


class Diurnal(Process):
    """rate(t) = rate_per_s * (1 + amplitude * sin(2 pi (t + phase) / period)) per tenant,
    by thinning a class stream at the peak rate. Tenants' phases are `phase_s` plus an
    even spread over `phase_spread_s` (time zones; 0 = all in step), shuffled as in
    `OnOff`."""

    def __init__(self, rate_per_s: float, amplitude: float, period_s: float, phase_s: float,
                 phase_spread_s: float) -> None:
        self.rate_per_s, self.amplitude, self.period_s = rate_per_s, amplitude, period_s
        self.phase_s, self.phase_spread_s = phase_s, phase_spread_s

    def stream(self, rng: random.Random, num_tenants: int,
               duration_s: float) -> Iterator[tuple[float, int]]:
        n, amp = num_tenants, self.amplitude
        w = 2 * math.pi / self.period_s
        u = rng.random()
        a, c, _ = _permutation(rng, n)
        rand, sin, spread_s = rng.random, math.sin, self.phase_spread_s
        for t, k in _poisson(rng, self.rate_per_s * (1 + amp) * n, n, duration_s):
            phase_s = self.phase_s
            if spread_s:
                phase_s += spread_s * ((a * k + c) % n + u) / n
            if rand() * (1 + amp) < 1 + amp * sin(w * (t + phase_s)):
                yield t, k

    def expected(self, num_tenants: int, duration_s: float) -> float:
        w = 2 * math.pi / self.period_s

        def mean_cos(x_s: float) -> float:  # cos(w (x + phase)) averaged over the spread
            p, s = self.phase_s, self.phase_spread_s
            if s == 0:
                return math.cos(w * (x_s + p))
            return (math.sin(w * (x_s + p + s)) - math.sin(w * (x_s + p))) / (w * s)

        integral_s = duration_s + self.amplitude / w * (mean_cos(0.0) - mean_cos(duration_s))
        return self.rate_per_s * num_tenants * integral_s


def parse_process(raw: Any, source: str, path: str) -> Process:
    kind = raw.get("process") if isinstance(raw, dict) else None
    known = {
        "poisson": ("rate_per_s",),
        "burst": ("at_s", "count", "every_s", "spread_s", "rate_per_s"),
        "on_off": ("rate_per_s", "on_s", "off_s"),
        "diurnal": ("rate_per_s", "amplitude", "period_s", "phase_s", "phase_spread_s"),
    }
    if isinstance(raw, dict) and not (isinstance(kind, str) and kind in known):
        if kind is None:
            raise WorkloadError(source, f"{path}.process",
                                f"required (one of: {', '.join(PROCESSES)})")
        raise WorkloadError(source, f"{path}.process",
                            f"unknown process {kind!r} (expected one of: {', '.join(PROCESSES)})")
    f = Fields(raw, source, path, ("process", *known.get(str(kind), ())))
    if kind == "poisson":
        return Poisson(f.num("rate_per_s", ge=0))
    if kind == "burst":
        every_s = f.num("every_s", None, gt=0)
        spread_s = f.num("spread_s", 0.0, ge=0)
        if every_s is not None and spread_s > every_s:
            raise f.fail("spread_s", f"must be <= every_s ({every_s}), got {spread_s}")
        return Burst(f.num("at_s", ge=0), f.num("count", ge=1, integer=True), every_s,
                     spread_s, f.num("rate_per_s", 0.0, ge=0))
    if kind == "on_off":
        return OnOff(f.num("rate_per_s", ge=0), f.num("on_s", gt=0), f.num("off_s", ge=0))
    return Diurnal(f.num("rate_per_s", ge=0), f.num("amplitude", ge=0, le=1),
                   f.num("period_s", DAY_S, gt=0), f.num("phase_s", 0.0),
                   f.num("phase_spread_s", 0.0, ge=0))


# --- a workload's arrivals ---


def class_arrivals(process: Process, prompt_tokens: Dist, output_tokens: Dist,
                   first_tenant: int, num_tenants: int, max_tokens: int,
                   times_rng: random.Random, lengths_rng: random.Random,
                   duration_s: float) -> Iterator[Arrival]:
    """One traffic class's arrivals: times from `times_rng`, lengths from `lengths_rng`
    (separate generators, so a class's lengths can change without moving its times)."""
    prompt, output = prompt_tokens.draw, output_tokens.draw
    for t_s, k in process.stream(times_rng, num_tenants, duration_s):
        yield Arrival(t_s, first_tenant + k, prompt(lengths_rng), output(lengths_rng),
                      max_tokens)


def merge_arrivals(streams: list[Iterator[Arrival]]) -> Iterator[Arrival]:
    """The streams' arrivals in time order; ties go to the earlier stream."""
    heap: list[tuple[float, int, Arrival, Iterator[Arrival]]] = []
    for i, it in enumerate(streams):
        first = next(it, None)
        if first is not None:
            heap.append((first.t_s, i, first, it))
    heapify(heap)
    # (t_s, stream index) is unique within the heap, so Arrivals are never compared.
    while heap:
        _, i, arrival, it = heap[0]
        yield arrival
        nxt = next(it, None)
        if nxt is None:
            heappop(heap)
        else:
            heapreplace(heap, (nxt.t_s, i, nxt, it))
