"""`fairlane simulate`: a workload through the production scheduler over N simulated GPUs.

    fairlane simulate bench/workloads/noisy_neighbor.yaml --workers 2 --out /tmp/sim
    fairlane simulate bench/workloads/scale.yaml --workers 1000 --max-num-seqs 32 --duration-s 600
    fairlane simulate --usage usage.jsonl --workers 8     # replay FL_USAGE records

Virtual time: an hour of fleet runs in minutes, deterministic for a seed. Writes
simulate.md, simulate.json and PNG plots (share over time, TTFT CDF per tier and
tenant, queue depth) into --out. What is and is not modelled: `fleetsim.fleet`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import re
import resource
import shlex
import signal
import sys
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from fairlane import gctune

if TYPE_CHECKING:
    from fleetsim.state import FleetSettings

PROG = "fairlane simulate"
# FleetSettings' fields as this command's flags (its errors name the field).
_FLAG_OF = {"num_workers": "--workers", "max_num_seqs": "--max-num-seqs",
            "prefetch_seqs": "--prefetch-seqs", "network_ms": "--network-ms",
            "max_model_len": "--max-model-len", "client_ms": "--client-ms"}


def _parser() -> argparse.ArgumentParser:
    from fleetsim.fleet import FleetSettings

    d = FleetSettings()
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workload", nargs="?", help="workload YAML file (bench/workloads/*.yaml)")
    p.add_argument("--usage", metavar="JSONL",
                   help="instead of a workload file: replay FL_USAGE records (one JSON "
                        "Usage per line) as arrivals")
    p.add_argument("--workers", type=int, default=d.num_workers, help="simulated GPU workers")
    p.add_argument("--step-model", default=d.step_model,
                   help="step-time model: a name under gpu_worker/sim/step_models or a path")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="batch slots per worker (default: the step model's)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + output a sequence may reach, as gpu_worker's / vLLM's "
                        "(default: unset, the KV cache bounds it); longer prompts are "
                        "refused with prompt_too_long, outputs cut there")
    p.add_argument("--prefetch-seqs", type=int, default=d.prefetch_seqs,
                   help="work a worker accepts beyond its batch cap (as gpu_worker)")
    p.add_argument("--network-ms", type=float, default=d.network_ms,
                   help="one dispatcher<->worker message's latency")
    p.add_argument("--client-ms", metavar="MS[,MS...]|@FILE", default=None,
                   help="the client's legs (its submit through JetStream to the dispatcher, "
                        "the tokens' way back), added to each request's TTFT, end-to-end "
                        "and token times: one value, or measured ones (listed, or a file of "
                        "numbers) each request draws one of (seeded by the workload's seed); "
                        "default: not modelled (0)")
    p.add_argument("--policy", choices=("fifo", "drr", "vtc"), default=None,
                   help="override the workload's pool policy")
    p.add_argument("--no-preemption", action="store_true",
                   help="turn the pool's fleet-level preemption off")
    p.add_argument("--hint-output-tokens", action="store_true",
                   help="clients send expected_output_tokens = their real output length")
    p.add_argument("--duration-s", type=float, default=None,
                   help="simulated seconds (default: the workload's duration_s)")
    p.add_argument("--seed", type=int, default=None, help="override the workload's seed")
    p.add_argument("--window-s", type=float, default=10.0, help="share-over-time window")
    p.add_argument("--detail-tenants", default="",
                   help="comma-separated tenants to report one by one (besides the busiest)")
    p.add_argument("--out", default="simulate-out", help="directory for the report and plots")
    p.add_argument("--no-plots", action="store_true", help="markdown and JSON only")
    p.add_argument("--time-dispatcher", action="store_true",
                   help="time every call into the dispatcher's core (interpreted, as the "
                        "dispatcher runs it) and report the CPU it would take: does one "
                        "dispatcher keep up with this pool (fleetsim.core_clock)")
    p.add_argument("--pools", type=int, default=1,
                   help="split the fleet into this many pools, one dispatcher each: tenants "
                        "and workers spread evenly (fleetsim.pools); the report merges them, "
                        "with a row per pool")
    p.add_argument("--jobs", type=int, default=None,
                   help="with --pools: pools simulated at once, one process each "
                        "(default: the CPUs, at most --pools); the result is the same")
    p.add_argument("--compiled", action="store_true",
                   help="run the simulator's modules compiled with mypyc (same source, same "
                        "result, ~2x faster; built once into a cache: fleetsim.compiled)")
    return p


SIM_YOUNG_OBJECTS = 500_000  # fairlane.gctune: net allocations between young collections


def tuned_gc() -> contextlib.AbstractContextManager[None]:
    """Around a run (`fairlane.gctune.tuned_gc`): the workload, tenant table and scheduler
    config (O(tenants), alive throughout) leave the collector's view, and young
    collections come less often. A run allocates millions of short-lived objects and
    makes almost no cycles (`test_sim_fleet.py::test_a_run_makes_no_cyclic_garbage`);
    with the defaults the collector re-walked the 100,000 tenants' objects often enough
    to take 60% of a 1,000-worker run, and at 50,000 net allocations (the dispatcher's
    setting) a young collection (walking the requests in flight) still took 7% of it.
    At 500,000 it runs about once a simulated minute there; what cycles a run could
    leave stay bounded by that count. Restored afterwards."""
    return gctune.tuned_gc(SIM_YOUNG_OBJECTS)


PRINT_EVERY_S = 60.0  # simulated seconds between progress lines


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


class _Interrupt:
    """Ctrl-C (SIGINT) during a run: the first one ends it at the next simulated second
    and the report covers what ran (an hour-long run keeps its first 50 minutes); a
    second one stops at once, without a report. Only in the main thread (signals are
    delivered there); elsewhere Ctrl-C keeps its usual meaning."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: object = None

    def __enter__(self) -> _Interrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)  # type: ignore[arg-type]

    def _on_sigint(self, signum: int, frame: object) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print(f"{PROG}: interrupted: stopping at the next simulated second and writing the "
              f"report (Ctrl-C again: stop now, no report)", file=sys.stderr)


_COMPILED_CHILD = "FAIRLANE_SIM_COMPILED_CHILD"


def _run_compiled(argv: list[str]) -> int:
    """The same command in a child process that imports the compiled copy first."""
    from fairlane.runtime import run_in_foreground
    from fleetsim import compiled

    try:
        build_dir = compiled.build()
    except compiled.CompileError as exc:
        print(f"{PROG}: --compiled: {exc}", file=sys.stderr)
        return 2
    env = compiled.env(build_dir) | {_COMPILED_CHILD: "1"}
    # -P: the working directory is not put first on sys.path (run from a checkout, its
    # interpreted packages would shadow the compiled copy).
    # Ctrl-C is the child's to handle (`_Interrupt`): this process waits for its report.
    return run_in_foreground([sys.executable, "-P", "-m", "fleetsim", *argv], env=env)


def not_positive(flags: Iterable[tuple[str, float | None]]) -> str | None:
    """What is wrong with the first given flag that is not a finite number > 0 (None:
    all are, or were not given). Also bench/capacity_plan.py's."""
    for flag, value in flags:
        if value is not None and not (math.isfinite(value) and value > 0):
            return f"{flag} must be a finite number > 0, got {value:g}"
    return None


def parse_client_ms(text: str) -> tuple[float, ...]:
    """--client-ms: numbers separated by commas or whitespace, or `@FILE` holding them."""
    if text.startswith("@"):
        text = Path(text[1:]).read_text()
    values = [v for v in re.split(r"[\s,]+", text.strip()) if v]
    if not values:
        raise ValueError("no values given")
    out = []
    for v in values:
        try:
            out.append(float(v))
        except ValueError:
            raise ValueError(f"not a number: {v!r}") from None
    return tuple(out)


def _check_flags(args: argparse.Namespace) -> FleetSettings | str:
    """The fleet's settings from the flags, or what is wrong with them (before anything
    is loaded or compiled: a bad flag is answered at once)."""
    from fleetsim.state import FleetSettings, SettingError

    if bool(args.workload) == bool(args.usage):
        return "give a workload file or --usage FILE (one of them)"
    if args.time_dispatcher and args.compiled:
        return ("--time-dispatcher times the interpreted core the dispatcher runs; "
                "it cannot be used with --compiled")
    bad = not_positive((("--duration-s", args.duration_s), ("--window-s", args.window_s)))
    if bad:
        return bad
    if args.pools < 1 or (args.jobs is not None and args.jobs < 1):
        return f"--pools and --jobs must be >= 1, got {args.pools} and {args.jobs}"
    if args.workers >= 1 and args.pools > args.workers:
        return f"--pools {args.pools}: more pools than --workers ({args.workers})"
    if args.time_dispatcher and args.pools > 1 and (args.jobs or 2) > 1:
        return ("--time-dispatcher with --pools needs --jobs 1: pools running side by side "
                "share the CPUs the clock measures")
    try:
        client_ms = parse_client_ms(args.client_ms) if args.client_ms is not None else ()
    except (OSError, ValueError) as exc:
        return f"--client-ms: {exc}"
    try:
        return FleetSettings(num_workers=args.workers, step_model=args.step_model,
                             max_num_seqs=args.max_num_seqs, prefetch_seqs=args.prefetch_seqs,
                             max_model_len=args.max_model_len,
                             network_ms=args.network_ms, client_ms=client_ms,
                             hint_output_tokens=args.hint_output_tokens)
    except SettingError as exc:
        return f"{_FLAG_OF.get(exc.name, exc.name)}: {exc.message}"


def cmd_simulate(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if os.environ.get(_COMPILED_CHILD) and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the parent ignores it
    settings = _check_flags(args)
    if isinstance(settings, str):
        print(f"{PROG}: {settings}", file=sys.stderr)
        return 2
    if args.compiled:
        from fleetsim import compiled

        if not compiled.is_compiled():
            if os.environ.get(_COMPILED_CHILD):
                print(f"{PROG}: the compiled modules did not load (PYTHONPATH="
                      f"{os.environ.get('PYTHONPATH', '')!r})", file=sys.stderr)
                return 1
            return _run_compiled(argv)
    from fleetsim.fleet import Fleet
    from fleetsim.pools import Job, PoolFailed, run_pools
    from fleetsim.recorder import Recorder
    from fleetsim.report import write_report
    from fleetsim.workload import WorkloadError, from_usage, load_workload

    try:
        wl = from_usage(args.usage) if args.usage else load_workload(args.workload)
    except (OSError, WorkloadError, ValueError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    if args.seed is not None:
        wl.seed = args.seed
    settings = dataclasses.replace(settings, client_seed=wl.seed)  # the legs' draws
    duration_s = wl.duration_s if args.duration_s is None else args.duration_s
    wl.duration_s = duration_s
    cfg = wl.scheduler_config
    if args.policy:
        cfg.policy = args.policy
    if args.no_preemption:
        cfg.preemption = msgspec.structs.replace(cfg.preemption, enabled=False)
    detail = [t for t in args.detail_tenants.split(",") if t]
    job = Job(workload=wl, config=cfg, settings=settings, duration_s=duration_s,
              window_s=args.window_s, detail_tenants=detail, num_pools=args.pools,
              time_dispatcher=args.time_dispatcher)
    # What a pool would refuse (an unreadable step model, an unknown detail tenant),
    # refused here and now, with exit code 2: not from a pool's process after a fork.
    try:
        Recorder(wl.tenants, duration_s, args.window_s, detail_tenants=detail)
        Fleet(cfg, wl.tenants, Recorder(wl.tenants, duration_s, args.window_s), settings)
    except (OSError, ValueError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    # The report's directory, made (or found writable) now: not after an hour's run.
    out_dir = Path(args.out)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        if not os.access(out_dir, os.W_OK | os.X_OK):
            raise PermissionError(f"[Errno 13] Permission denied: {str(out_dir)!r}")
    except OSError as exc:
        print(f"{PROG}: --out {args.out}: cannot write the report there: {exc}", file=sys.stderr)
        return 2
    jobs = max(1, min(args.jobs or os.cpu_count() or 1, args.pools))
    pools = f" in {args.pools} pools ({jobs} processes)" if args.pools > 1 else ""
    print(f"{PROG}: {len(wl.tenants):,} tenants, ~{wl.expected_requests():,.0f} requests, "
          f"{args.workers} workers{pools}, {duration_s:g} simulated s", file=sys.stderr)

    interrupt = _Interrupt()
    next_print_s = 0.0

    def progress(t_s: float, wall: float) -> None:  # simulated s (the pools' mean)
        nonlocal next_print_s
        if t_s >= next_print_s:
            # At the rate so far (the first minute includes filling the fleet).
            left = f", ~{_duration((duration_s - t_s) * wall / t_s)} left" if t_s else ""
            print(f"  simulated {t_s:,.0f} s in {wall:,.1f} s wall{left}", file=sys.stderr)
            next_print_s = (t_s // PRINT_EVERY_S + 1) * PRINT_EVERY_S

    try:
        with interrupt:
            outcome = run_pools(job, jobs, interrupt, progress)
    except PoolFailed as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    if outcome is None:
        print(f"{PROG}: stopped; no report", file=sys.stderr)
        return 130
    recorder, wall_s, simulated_s = outcome.recorder, outcome.wall_s, outcome.simulated_s
    results = outcome.pools
    # Peak RSS of this process and, with pools in processes, each child's own (not
    # tracemalloc: it would slow the run and inflate it).
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    summary = recorder.summary()
    extra = {
        "workload": args.usage or args.workload,
        "workers": args.workers,
        "step_model": args.step_model,
        "max_seq_len": results[0].max_seq_len,
        "policy": cfg.policy,
        "preemption": "on" if cfg.preemption.enabled else "off",
        "simulated_s": simulated_s,
        "stopped_early": (f"interrupted at {simulated_s:g} of {duration_s:g} simulated s: "
                          f"this report covers [0, {simulated_s:g}) s"
                          if outcome.stopped else None),
        "wall_s": round(wall_s, 2),
        "sim_s_per_wall_s": round(simulated_s / wall_s, 2) if wall_s > 0 else None,
        "arrivals": sum(r.arrivals for r in results),
        "events": sum(r.events for r in results),
        "preemptions_ordered": sum(r.preemptions_ordered for r in results),
        # The dispatchers' work for them: decisions, and tenants those weighed.
        "preemption_decisions": sum(r.preemption_decisions for r in results),
        "preemption_tenants_weighed": sum(r.preemption_tenants_weighed for r in results),
        "recomputed_tokens": sum(r.recomputed_tokens for r in results),
        "peak_rss_mib": round(peak_rss_mib, 1),
        "compiled": args.compiled,
    }
    if settings.client_ms:  # what each request's client leg was drawn from
        legs = sorted(settings.client_ms)
        extra["client_ms"] = (f"{legs[0]:g}" if len(legs) == 1 else
                              f"{len(legs)} values, {legs[0]:g} to {legs[-1]:g}, "
                              f"p50 {legs[len(legs) // 2]:g}")
    if args.pools > 1:
        extra |= {"pools": args.pools, "processes": jobs,
                  "peak_rss_mib_per_pool": [round(r.peak_rss_mib, 1) for r in results]}
        summary["pools"] = outcome.rows
    elif args.time_dispatcher:
        extra |= results[0].core
    command = "fairlane simulate " + shlex.join(argv)
    try:
        paths = write_report(summary, out_dir, command=command, extra_meta=extra,
                             plots=not args.no_plots)
    except RuntimeError as exc:  # matplotlib missing: md + json are written already
        print(f"{PROG}: {exc}", file=sys.stderr)
        paths = [out_dir / "simulate.md", out_dir / "simulate.json"]
    except OSError as exc:  # the directory went away or the disk filled meanwhile
        print(f"{PROG}: the run finished but its report could not be written to "
              f"{out_dir}: {exc}", file=sys.stderr)
        return 1
    print(f"{PROG}: {simulated_s:g} simulated s in {wall_s:.1f} s "
          f"({extra['sim_s_per_wall_s']} sim-s per wall-s); wrote "
          + ", ".join(str(p) for p in paths), file=sys.stderr)
    if outcome.stopped:
        print(f"{PROG}: {extra['stopped_early']}", file=sys.stderr)
        return 130  # as a shell reports a run stopped by Ctrl-C
    return 0
