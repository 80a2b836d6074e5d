"""BENCHMARKS.md's tenant-churn table (section 2) and Summary row, rendered from the JSON
bench/bench_tenant_churn.py writes ({"meta", "data": {"runs": [{"policy",
"has_idle_sweep", "checkpoints": [...]}], ...}}): timings as median (min–max) over the
repetitions at each checkpoint (bench.harness.summarize, as its own markdown)."""

from __future__ import annotations

from bench.render_common import (
    RenderError,
    Results,
    fmt_sig,
    fmt_sum,
    median,
    row_source,
    sources_line,
    table,
)


def _run(res: Results, stem: str, policy: str) -> dict:
    runs = res.load(stem).get("data", {}).get("runs", [])
    for r in runs:
        if r.get("policy") == policy:
            return r
    raise RenderError(f"{stem}.json has no run of policy {policy!r} "
                      f"(has: {[r.get('policy') for r in runs]})")


def _label(run: dict) -> str:
    return "after" if run.get("has_idle_sweep") else "before"


def _states(c: dict) -> str:
    debt = c.get("policy_states_in_debt", -1)
    return f"{c['policy_states']:,}" + (f" ({debt:,})" if debt >= 0 else "")


def _mib(nbytes: float) -> str:
    return fmt_sig(nbytes / 2**20, " MiB")


def churn_table(res: Results, args: list[str], _old: str) -> str:
    """`<!-- generated: tenant-churn POLICY STEM [STEM ...] -->`: the checkpoints of
    each file's run of POLICY, labelled before/after by whether the code had the idle
    sweep; the last checkpoint's pass, render and size in bold."""
    if len(args) < 2:
        raise RenderError("tenant-churn takes a policy and at least one results file")
    policy, stems = args[0], args[1:]
    rows = []
    for stem in stems:
        run = _run(res, stem, policy)
        cps = run.get("checkpoints", [])
        for i, c in enumerate(cps):
            b = "**" if i == len(cps) - 1 else ""
            rows.append([
                f"{_label(run)}: {c['tenants_arrived']:,}", f"{c['tenant_loads']:,}", _states(c),
                f"{c['tenant_label_sets']:,}", fmt_sig(c["rss_mib"], digits=0),
                f"{b}{fmt_sum(c['pass_ms'])}{b}", fmt_sig(median(c["snapshot_ms"])),
                f"{b}{fmt_sum(c['render_ms'])}{b}", f"{b}{_mib(c['render_bytes'])}{b}"])
    header = ["tenants passed", "tenant loads", "policy states (in debt)", "label sets",
              "RSS MiB", "pass ms", "snapshot ms", "/metrics render ms", "/metrics size"]
    return sources_line(res, stems) + "\n\n" + table(header, "lrrrrrrrr", rows)


def flat_from(cps: list[dict], key: str = "tenant_loads") -> int | None:
    """The first checkpoint from which `key` no longer changes (at least two
    checkpoints), or None."""
    last = cps[-1][key] if cps else None
    start = None
    for c in reversed(cps):
        if c[key] != last:
            break
        start = c["tenants_arrived"]
    same = sum(1 for c in cps if c["tenants_arrived"] >= (start or 0))
    return start if start is not None and same >= 2 else None


AFTER, BEFORE, POLICY = "tenant_churn", "tenant_churn_before", "drr"


def summary_churn(res: Results) -> list[str]:
    after, before = _run(res, AFTER, POLICY), _run(res, BEFORE, POLICY)
    a, b = after["checkpoints"][-1], before["checkpoints"][-1]
    flat = flat_from(after["checkpoints"])
    lead = f"flat from {flat:,} tenants" if flat is not None else "**not flat**"
    debt = a.get("policy_states_in_debt", -1)
    measured = (f"{lead}: {a['tenant_loads']:,} live tenants, {a['policy_states']:,} policy "
                f"states" + (f" ({debt:,} in debt)" if debt >= 0 else "") + f", pass {fmt_sum(a['pass_ms'])} ms, render {fmt_sig(median(a['render_ms']))} "
                f"ms / {_mib(a['render_bytes'])}, {fmt_sig(a['rss_mib'], digits=0)} MiB RSS "
                f"(before: {b['tenant_loads']:,} kept, pass {fmt_sig(median(b['pass_ms']))} ms, "
                f"render {fmt_sig(median(b['render_ms']))} ms / {_mib(b['render_bytes'])}, "
                f"{fmt_sig(b['rss_mib'], digits=0)} MiB)")
    return [f"tenant churn: {a['tenants_arrived']:,} one-visit tenants through the dispatcher "
            f"core ({POLICY}): per-tenant entries, housekeeping pass, `/metrics` render",
            measured, "flat" + ("" if flat is not None else " — missed"),
            row_source(res, AFTER) + ", " + row_source(res, BEFORE, "before")]


KINDS = {"tenant-churn": churn_table}
SUMMARY_ROWS = {"tenant-churn": summary_churn}
