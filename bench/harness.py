"""Shared benchmark harness: interleaved variants, robust summaries, honest tails, results files.

Every fleet benchmark compares *variants* (policies, settings) on a noisy shared machine.
What makes such a comparison trustworthy is the same each time, so it lives here:

- **Interleaving** (`interleaved_order`, `run_interleaved`): R repetitions, each running
  every variant once, the order reversed on every other repetition (A B C, C B A, A B C,
  ...), so a slow drift of the machine (another job starting, a cache warming) does not
  land on one variant.
- **Summaries** (`summarize`, `Summary`): per-(variant, repetition) numbers are reported
  as the median over repetitions with the min–max range, never a single run.
- **Tails** (`p99`, `tail`): a p99 from fewer than `MIN_P99_SAMPLES` (200) samples is a
  guess about one or two requests, so `p99` returns None there and `tail` reports the
  max instead ("max=…"), labelled as such.
- **Results files** (`results_header`, `write_results`): the markdown starts with the
  command line, the git commit (+ "dirty" when the tree has uncommitted changes), the
  UTC date and the machine (`bench.common.machine`); a JSON with the same metadata and
  the raw per-run numbers is written beside it.

Pure functions are unit-tested in tests/unit/test_bench_harness.py.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any

from bench.common import ROOT, machine, quantile

MIN_P99_SAMPLES = 200


# --- ordering -------------------------------------------------------------------------------


def interleaved_order(variants: Sequence[str], reps: int) -> list[tuple[int, str]]:
    """(repetition, variant) in run order: every variant once per repetition, in the
    given order on even repetitions and reversed on odd ones."""
    if reps < 0:
        raise ValueError("reps must be >= 0")
    if len(set(variants)) != len(variants):
        raise ValueError(f"duplicate variant names: {list(variants)}")
    out: list[tuple[int, str]] = []
    for r in range(reps):
        seq = list(variants) if r % 2 == 0 else list(reversed(variants))
        out += [(r, v) for v in seq]
    return out


@dataclass
class RunRecord:
    """One (variant, repetition): its metrics, or the error that ended it."""

    variant: str
    rep: int
    position: int  # index in the overall run order
    metrics: dict[str, Any]
    error: str | None = None
    elapsed_s: float = 0.0


async def run_interleaved(
    variants: Sequence[str],
    reps: int,
    run_one: Callable[[str, int], Awaitable[dict[str, Any]]],
    *,
    log: Callable[[str], None] | None = None,
) -> list[RunRecord]:
    """Run `run_one(variant, rep)` for every pair in `interleaved_order`. A run that
    raises is recorded with its error (and logged) and the others go on."""
    say = log or (lambda s: print(s, file=sys.stderr, flush=True))
    records: list[RunRecord] = []
    order = interleaved_order(variants, reps)
    for pos, (rep, variant) in enumerate(order):
        say(f"[{pos + 1}/{len(order)}] rep {rep} variant {variant} ...")
        t0 = time.monotonic()
        try:
            metrics = await run_one(variant, rep)
            err = None
        except Exception as exc:  # noqa: BLE001 - record it and go on
            metrics, err = {}, f"{exc!r}"
            say(f"  {variant} rep {rep} failed: {err}\n{traceback.format_exc()}")
        records.append(RunRecord(variant, rep, pos, metrics, err, time.monotonic() - t0))
        say(f"  done in {records[-1].elapsed_s:.0f} s")
    return records


def by_variant(records: Iterable[RunRecord]) -> dict[str, list[RunRecord]]:
    """Successful records grouped by variant, in repetition order."""
    out: dict[str, list[RunRecord]] = {}
    for r in sorted(records, key=lambda r: (r.rep, r.position)):
        if r.error is None:
            out.setdefault(r.variant, []).append(r)
    return out


def collect(records: Iterable[RunRecord], variant: str, path: str) -> list[Any]:
    """The value at dotted `path` of every successful record of `variant` (missing or
    None values skipped), in repetition order."""
    out = []
    for r in by_variant(records).get(variant, []):
        v = dig(r.metrics, path)
        if v is not None:
            out.append(v)
    return out


def dig(d: Any, path: str) -> Any:
    """d["a"]["b"] for path "a.b"; None if any step is missing."""
    for key in path.split("."):
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


# --- statistics -----------------------------------------------------------------------------


def p99(samples: Sequence[float]) -> float | None:
    """The 99th percentile (linear interpolation), or None with fewer than
    `MIN_P99_SAMPLES` samples: too few for a p99 to mean anything."""
    if len(samples) < MIN_P99_SAMPLES:
        return None
    return quantile(list(samples), 0.99)


def tail(samples: Sequence[float]) -> tuple[str, float]:
    """("p99", value) with enough samples, else ("max", the largest sample); ("max",
    NaN) for none."""
    v = p99(samples)
    if v is not None:
        return "p99", v
    return "max", (max(samples) if samples else math.nan)


def fmt_tail(samples: Sequence[float], digits: int = 1) -> str:
    """`tail` as text: "123.4" for a p99, "max=123.4" when there were too few samples."""
    label, v = tail(samples)
    txt = fmt_num(v, digits)
    return txt if label == "p99" else f"max={txt}"


@dataclass(frozen=True)
class Summary:
    """Median and range of one metric over repetitions (NaN-free values only)."""

    median: float
    lo: float
    hi: float
    n: int

    def fmt(self, digits: int = 1, unit: str = "") -> str:
        if self.n == 0:
            return "n/a"
        med = fmt_num(self.median, digits) + unit
        if self.n == 1:
            return med
        return f"{med} ({fmt_num(self.lo, digits)}–{fmt_num(self.hi, digits)})"


def summarize(values: Iterable[float | None]) -> Summary:
    """Median and min–max of the values, ignoring None and NaN."""
    xs = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not xs:
        return Summary(math.nan, math.nan, math.nan, 0)
    return Summary(statistics.median(xs), min(xs), max(xs), len(xs))


def ratio(num: float | None, den: float | None) -> float:
    """num / den, NaN when either is missing or den is 0."""
    if num is None or den is None or den == 0 or math.isnan(num) or math.isnan(den):
        return math.nan
    return num / den


def fmt_num(x: float | None, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if math.isinf(x):
        return "inf"
    return f"{x:,.{digits}f}"


def verdict(value: float, target: float, *, higher_is_better: bool = False) -> str:
    """"met" / "missed" for a value against its target; "n/a" when unmeasured."""
    if value is None or math.isnan(value):
        return "n/a"
    ok = value >= target if higher_is_better else value <= target
    return "met" if ok else "missed"


# --- results files --------------------------------------------------------------------------


RESULTS_PREFIX = "bench/results/"


def format_commit(rev: str, porcelain: str) -> str:
    """The commit line: the short hash, + " dirty" when `git status --porcelain` (of
    tracked files) names a changed file outside bench/results/: results files that this
    or an earlier benchmark of the same batch rewrote are not changes to what ran."""
    rev = rev.strip() or "unknown"
    changed = [line[3:].split(" -> ")[-1] for line in porcelain.splitlines() if line.strip()]
    dirty = any(not path.startswith(RESULTS_PREFIX) for path in changed)
    return f"{rev} dirty" if dirty else rev


def git_commit(cwd: Path = ROOT) -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=cwd,
                             capture_output=True, text=True, timeout=5).stdout
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                cwd=cwd, capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return format_commit(rev, status)


def short_rev(rev: str, cwd: Path = ROOT) -> str:
    """`rev` (a branch, HEAD, a hash) as its short hash; CalledProcessError if git does
    not know it. What a results file names a --base commit by."""
    return subprocess.run(["git", "-C", str(cwd), "rev-parse", "--short", rev], check=True,
                          capture_output=True, text=True).stdout.strip()


def command_line(argv: Sequence[str] | None = None) -> str:
    """How this script was started, as a shell would take it back."""
    argv = list(sys.argv if argv is None else argv)
    return "python " + " ".join(shlex.quote(a) for a in argv)


def utc_now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class RunMeta:
    command: str
    commit: str
    date_utc: str
    machine: str

    @classmethod
    def here(cls, argv: Sequence[str] | None = None) -> RunMeta:
        return cls(command_line(argv), git_commit(), utc_now(), machine())


def results_header(title: str, meta: RunMeta, how_to_read: str = "") -> str:
    """The top of a results markdown: title, metadata lines, then "how to read"."""
    lines = [f"# {title}", "",
             f"- command: `{meta.command}`",
             f"- commit: {meta.commit}",
             f"- date (UTC): {meta.date_utc}",
             f"- machine: {meta.machine}", ""]
    if how_to_read.strip():
        lines += ["## How to read this", "", how_to_read.strip(), ""]
    return "\n".join(lines) + "\n"


def _jsonable(x: Any) -> Any:
    if is_dataclass(x) and not isinstance(x, type):
        return _jsonable(asdict(x))
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None  # JSON has no NaN
    return x


def write_results(md_path: Path, title: str, body: str, data: Any, meta: RunMeta,
                  how_to_read: str = "") -> tuple[Path, Path]:
    """Write `md_path` (header + body) and the JSON beside it (same stem, .json):
    {"meta": ..., "data": ...}. Returns both paths."""
    md_path = Path(md_path)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(results_header(title, meta, how_to_read) + body.rstrip() + "\n")
    js = md_path.with_suffix(".json")
    js.write_text(json.dumps({"meta": _jsonable(meta), "data": _jsonable(data)}, indent=1,
                             sort_keys=False) + "\n")
    return md_path, js


def run_children(script: str, items: Sequence[str],
                 env_for: Callable[[str], dict[str, str] | None] | None = None,
                 python_for: Callable[[str], str | None] | None = None,
                 ) -> tuple[list[dict], list[tuple]]:
    """Run `script` once per item as ``script <this process's argv> --child ITEM`` in a
    process of its own (its memory and GC start fresh; peak RSS is its own), each
    printing its result as JSON on its last stdout line; `env_for(item)` may give an
    item its own environment (its PYTHONPATH is kept, the checkout appended), and
    `python_for(item)` its own interpreter (None: this one). Returns
    the results and the machine's load average before and after, for the results file."""
    load0 = tuple(round(x, 2) for x in os.getloadavg())
    runs = []
    for item in items:
        print(f"{item} ...", file=sys.stderr, flush=True)
        python = (python_for(item) if python_for else None) or sys.executable
        cmd = [python, script, *sys.argv[1:], "--child", item]
        own = env_for(item) if env_for else None
        env = dict(own if own is not None else os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in ((own or {}).get("PYTHONPATH", ""), str(ROOT)) if p)
        out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, check=False)
        if out.returncode != 0:
            raise SystemExit(f"{item}: child failed ({out.returncode})")
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return runs, [load0, tuple(round(x, 2) for x in os.getloadavg())]
