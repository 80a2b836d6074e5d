"""The simulator's instruction counts (bench/sim_instructions.py): the results markdown
and BENCHMARKS.md's block, from its JSON ({"meta", "data": {"runs": [{"variant", "rep",
"python", "instructions", "arrivals", "events", "summary_sha256"}, ...], "scale",
"duration_s", "base_commit"}}). Pure: no simulator, no valgrind."""

from __future__ import annotations

from bench.harness import fmt_num
from bench.render_common import Results, one_results_file, sources_line

TITLE = "Fleet simulator: CPU instructions per simulated request (callgrind)"
HOW_TO_READ = """\
*instructions*: executed inside the compiled `Fleet.run` (callgrind; deterministic up to
the hash seed, which the range over repetitions shows), the lowest of the repetitions
in *per simulated request* and *vs base*; *summary hash*: of the run's whole
`Recorder.summary()`, equal when the simulation is."""


def setup_line(data: dict) -> str:
    w, _, t = data["scale"].partition("x")
    return (f"{int(w):,} workers × {int(t):,} tenants, {data['duration_s']:g} simulated s of "
            "bench/bench_simulate_scale.py's workload (80% of 32 slots busy), the compiled "
            f"simulator; *base*: commit {data.get('base_commit') or 'n/a'}, *now*: the "
            "results file's commit, *alt*: *now* under another interpreter.")


def report(data: dict) -> str:
    runs = data["runs"]
    base = [r["instructions"] for r in runs if r["variant"] == "base"]
    base_ir = min(base) if base else None
    lines = ["| variant | interpreter | reps | instructions in `Fleet.run`, M | per simulated "
             "request | vs base | arrivals | summary hash |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for v in dict.fromkeys(r["variant"] for r in runs):
        g = [r for r in runs if r["variant"] == v]
        ir = sorted(r["instructions"] for r in g)
        span = fmt_num(ir[0] / 1e6, 1) + (f"–{fmt_num(ir[-1] / 1e6, 1)}" if ir[-1] != ir[0]
                                          else "")
        vs = f"{(ir[0] / base_ir - 1) * 100:+.1f}%" if base_ir else "n/a"
        lines.append(f"| {v} | {g[0]['python']} | {len(g)} | {span} | "
                     f"{fmt_num(ir[0] / g[0]['arrivals'] / 1e3, 1)} k | {vs} | "
                     f"{g[0]['arrivals']:,} | {', '.join(sorted({r['summary_sha256'] for r in g}))} |")
    hashes = {r["summary_sha256"] for r in runs}
    lines += ["", "Every run simulated the same requests with the same result (one summary hash)."
              if len(hashes) == 1 else
              f"**The runs' summaries differ ({len(hashes)} hashes): not the same simulation.**"]
    return "\n".join(lines)


def instructions_kind(res: Results, args: list[str], _old: str) -> str:
    """`<!-- generated: sim-instructions STEM -->`: the setup and the table."""
    data = one_results_file(res, "sim-instructions", args)
    return "\n\n".join([sources_line(res, args), setup_line(data), report(data)])


KINDS = {"sim-instructions": instructions_kind}
