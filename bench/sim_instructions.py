"""The simulator's cost in CPU instructions (callgrind), this checkout against a base commit.

    PYTHONPATH=. python bench/sim_instructions.py --base REV [--scale 100x10000]
        [--duration-s 20] [--alt-python PATH] [--reps 2]

Wall-clock figures on a shared 2-core VM move by 10-20% from one minute to the next
(bench/bench_simulate_scale.py interleaves and repeats for that reason); a change of a
few percent in the simulator's own cost drowns in that. Instructions do not: valgrind's
callgrind counts every instruction the process executes inside `Fleet.run` (the
simulation, not the workload's building or the imports: `--toggle-collect` on the
compiled `Fleet.run`), the same count on a busy machine as on an idle one. Counts are
not time (a cache miss costs more than an add), so this complements the timed
benchmark, never replaces it.

Variants, each a compiled copy (`fleetsim.compiled`) built as its tree builds it
(bench_simulate_scale.compiled_copy): `base` (commit `--base`, unpacked with `git
archive`), `now` (this checkout), and `alt` (this checkout under `--alt-python`, if
given). Each runs `bench/bench_simulate_scale.py`'s workload at `--scale` for
`--duration-s` simulated seconds and prints a hash of its whole summary: variants that
simulate the same requests the same way print the same hash, which the report checks.
Needs valgrind (`apt-get install valgrind`); ~1 min per run at the default size.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import RunMeta, interleaved_order, short_rev, write_results  # noqa: E402
from bench.render_instructions import HOW_TO_READ, TITLE, report, setup_line  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "sim_instructions.md"
TOGGLE = "CPyDef_fleet___Fleet___run"  # the compiled Fleet.run's C function


def child(workers: int, tenants: int, duration_s: float) -> dict:
    """Run the scale bench's workload once (this process is under callgrind)."""
    from bench.bench_simulate_scale import build_workload
    from fleetsim.compiled import is_compiled
    from fleetsim.fleet import Fleet, FleetSettings
    from fleetsim.recorder import Recorder

    if not is_compiled():
        raise SystemExit("the child must run the compiled simulator")
    wl, _ = build_workload(workers, tenants, duration_s, 32, 0.8, 1)
    recorder = Recorder(wl.tenants, duration_s)
    fleet = Fleet(wl.scheduler_config, wl.tenants, recorder,
                  FleetSettings(num_workers=workers, max_num_seqs=32))
    fleet.run(wl.arrivals(), duration_s)
    summary = json.dumps(recorder.summary(), sort_keys=True, default=str)
    return {"python": f"{platform.python_version()} ({sys.executable})",
            "arrivals": fleet.num_arrivals, "events": fleet.num_events,
            "summary_sha256": hashlib.sha256(summary.encode()).hexdigest()[:16]}


def measure(python: str, env: dict[str, str], scale: str, duration_s: float,
            tmp: Path) -> dict:
    w, _, t = scale.partition("x")
    out_file = tmp / "callgrind.out"
    proc = subprocess.run(
        ["valgrind", "--tool=callgrind", "--collect-atstart=no", f"--toggle-collect={TOGGLE}",
         f"--callgrind-out-file={out_file}", python, __file__, "--child", w, t,
         str(duration_s)], env=env, capture_output=True, text=True, check=False)
    found = re.search(r"Collected : (\d+)", proc.stderr)
    if proc.returncode != 0 or found is None:
        raise SystemExit(f"callgrind run failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    out_file.unlink(missing_ok=True)
    run = json.loads(proc.stdout.strip().splitlines()[-1])
    run["instructions"] = int(found.group(1))
    run["instructions_per_arrival"] = run["instructions"] / max(1, run["arrivals"])
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=False, help="the commit the base variant runs")
    ap.add_argument("--scale", default="100x10000")
    ap.add_argument("--duration-s", type=float, default=20.0)
    ap.add_argument("--alt-python", default=None)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--child", nargs=3, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(int(a.child[0]), int(a.child[1]), float(a.child[2]))))
        return
    from bench.bench_simulate_scale import compiled_copy
    from bench.fleet import base_tree
    from fleetsim import compiled

    meta = RunMeta.here()
    runs = []
    with tempfile.TemporaryDirectory(prefix="fl-instr-") as tmp:
        pythons = {"now": sys.executable}
        roots: dict[str, Path] = {"now": ROOT}
        if a.base:
            pythons["base"] = sys.executable
            roots["base"] = base_tree(a.base, Path(tmp) / "base", compiled.PACKAGES, "fleetsim")
        if a.alt_python:
            pythons["alt"], roots["alt"] = a.alt_python, ROOT
        envs = {v: compiled.env(compiled_copy(pythons[v], roots[v])) for v in pythons}
        for rep, v in interleaved_order(list(pythons), a.reps):
            print(f"{v} rep {rep} ...", file=sys.stderr, flush=True)
            run = measure(pythons[v], envs[v], a.scale, a.duration_s, Path(tmp))
            runs.append(run | {"variant": v, "rep": rep})
    data = {"runs": runs, "scale": a.scale, "duration_s": a.duration_s,
            "base_commit": short_rev(a.base) if a.base else None}
    body = setup_line(data) + "\n\n" + report(data)
    md, js = write_results(a.out, TITLE, body, data, meta, HOW_TO_READ)
    print(body)
    print(f"wrote {md} and {js}", file=sys.stderr)


if __name__ == "__main__":
    main()
