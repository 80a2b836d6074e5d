"""What a chaos run's evidence adds up to: the counts of `tests.chaos.scenarios`
(definitions in its docstring), computed from `tests.chaos.harness.ChaosRun` after
`finish()`. Pure: reads what the run recorded, does no I/O.
"""

from __future__ import annotations

import statistics
from bisect import bisect_right
from collections import Counter, defaultdict
from typing import Any

from fairlane.errors import ErrorCode
from tests.chaos.harness import BILLABLE_FINISH, LOST_CODES, ChaosRun, Observer, Req


def quantile(xs: list[float], q: float) -> float | None:
    """Linear-interpolated quantile (as bench/common.py), None for no samples."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 1)


def _submission_of(req: Req, t: float) -> int:
    """Index of the client's submission (explicit attempt) live at time `t`."""
    return max(0, bisect_right([a.submit_t for a in req.attempts], t) - 1)


def _run_submission(obs: Observer, req: Req, worker_id: str, t: float) -> int:
    """Submission an event of `worker_id` at `t` belongs to: that of the run (Started
    on that worker) it comes from, else by its own time."""
    starts = [s[0] for s in obs.started.get(req.rid, ()) if s[1] == worker_id and s[0] <= t + 0.5]
    return _submission_of(req, max(starts) if starts else t)


def _usage_submission(obs: Observer, req: Req, t: float, u: Any) -> int:
    """Usage records carry the library attempt they bill: exact attribution."""
    for k, a in enumerate(req.attempts):
        if a.lib_first <= u.attempt <= a.lib_last:
            return k
    return _run_submission(obs, req, u.worker_id, t)


def _ranges(seqs: list[tuple[int, float]], rel) -> list[str]:
    """Runs of consecutive seqs seen, "first-last @t_first..t_last" (in arrival order)."""
    out: list[list] = []
    for seq, t in seqs:
        if out and seq == out[-1][1] + 1:
            out[-1][1], out[-1][3] = seq, t
        else:
            out.append([seq, seq, t, t])
    return [f"{a}-{b} @{rel(ta)}..{rel(tb)}" for a, b, ta, tb in out]


def evidence_of(run: ChaosRun, rid: str) -> dict[str, Any]:
    """Everything seen of one request, times relative to the fault (for reports)."""
    obs, t0 = run.obs, run.fault_t or 0.0
    req = run.requests[rid]

    def r(t: float | None) -> float | None:
        return None if t is None else round(t - t0, 3)

    return {
        "published": [(r(t), k, nxt) for t, k, nxt in obs.published.get(rid, ())],
        "attempts": [{"submit": r(a.submit_t), "end": r(a.end_t), "outcome": a.outcome,
                      "tokens": a.tokens, "lib_attempts": [a.lib_first, a.lib_last]}
                     for a in req.attempts],
        "dispatched": [(r(t), e, k) for t, e, k in obs.dispatched.get(rid, ())],
        "started": [(r(t), w, i[:6], "resumed" if res else "fresh")
                    for t, w, i, res in obs.started.get(rid, ())],
        "finished": [(r(t), w, i[:6], code, n) for t, w, i, code, n in obs.finished.get(rid, ())],
        "preempted": [r(t) for t in obs.preempted.get(rid, ())],
        "usage": [(r(t), u.worker_id, u.attempt, u.completion_tokens, u.finish_reason)
                  for t, u in obs.usage.get(rid, ())],
        "stored_usage": [(u.worker_id, u.attempt, u.completion_tokens, u.finish_reason)
                         for u in run.stored_usage.get(rid, [])],
        "chunks_seq0": [(r(t), code) for t, seq, _, code, _ in obs.chunks.get(rid, ()) if seq == 0],
        "chunk_seqs_seen": _ranges([(c[1], c[0]) for c in obs.chunks.get(rid, ())], r),
        "error_chunks": [(r(t), seq, code) for t, seq, _, code, _ in obs.chunks.get(rid, ())
                         if code],
        "worker_log": [(r(d.get("t")), d.get("worker_id"), d["event"],
                        d.get("completion_tokens", d.get("reason")))
                       for d in run.worker_log if d.get("request_id") == rid],
    }


def analyse(run: ChaosRun, victim_worker: str | None = None) -> dict[str, Any]:
    """The counts every scenario reports (definitions: `tests.chaos.scenarios`)."""
    obs = run.obs
    fault = run.fault_t
    reqs = list(run.requests.values())
    completed = 0
    failed: Counter[str] = Counter()
    lost, twice, billed_failed, wrongly, incomplete, bad_stored = [], [], [], [], [], []
    resumed_done: list[str] = []
    republished = 0
    log_finished: dict[str, list[dict]] = defaultdict(list)
    for d in run.worker_log:
        if d.get("event") == "request_finished":
            log_finished[d.get("request_id")].append(d)
    for req in reqs:
        rid = req.rid
        if not req.done:
            lost.append(rid)
        elif req.outcome == "ok":
            a = req.attempts[-1]
            if a.finish_reason in BILLABLE_FINISH and a.usage_tokens == a.tokens and a.tokens:
                completed += 1
                stored = run.stored_usage.get(rid, [])
                if len(stored) != 1 or stored[0].completion_tokens != a.tokens:
                    bad_stored.append(rid)
            else:
                incomplete.append(rid)
        else:
            failed[req.outcome or "?"] += 1
        # Generated twice: more generations than attempts (the client's re-submissions
        # and the library's own resumes) plus preemption resumes.
        allowed = req.num_lib_attempts + len(obs.preempted.get(rid, ()))
        fresh_chunks = sum(1 for c in obs.chunks.get(rid, ()) if c[1] == 0 and c[3] is None)
        records = {(u.worker_id, u.ts_ms, u.completion_tokens, u.finish_reason, u.attempt)
                   for _, u in obs.usage.get(rid, ())}
        republished += len(obs.usage.get(rid, ())) - len(records)
        per_attempt = Counter(r[4] for r in records if r[2] > 0)
        # When each attempt was first published (the client's or the library's).
        first_pub: dict[int, float] = {}
        for t, k, _ in obs.published.get(rid, ()):
            first_pub.setdefault(k, t)
        # A superseded attempt replayed: dispatched after a newer attempt of the id was
        # published, and then generating (a usage record of it with tokens).
        superseded = any(
            u.completion_tokens > 0 and any(
                td < t and any(first_pub[k] < td for k in first_pub if k > ka)
                for td, _, ka in obs.dispatched.get(rid, ()) if ka == u.attempt)
            for t, u in obs.usage.get(rid, ()))
        # An attempt that finished on a worker although a newer one was published before.
        resumed_finished = any(
            u.finish_reason in BILLABLE_FINISH and any(
                first_pub[k] < t for k in first_pub if k > u.attempt)
            for t, u in obs.usage.get(rid, ()))
        # From scratch (not a continuation): only the client's own submissions.
        fresh_starts = sum(1 for st in obs.started.get(rid, ()) if not st[3])
        # Any generation that starts once the client already has its complete answer.
        answered_t = req.end_t if req.done and req.outcome == "ok" else None
        after_answer = answered_t is not None and any(
            st[0] > answered_t + 0.2 for st in obs.started.get(rid, ()))
        if (len(obs.started.get(rid, ())) > allowed or fresh_chunks > allowed
                or fresh_starts > max(1, len(req.attempts)) or after_answer
                or any(n > 1 for n in per_attempt.values()) or superseded
                or len(log_finished.get(rid, ())) > req.num_lib_attempts):
            twice.append(rid)
        # An attempt that finished on a worker although the library had already resumed
        # it as the next one (its last chunks were lost): the tail is generated again.
        # Not twice per attempt, and billed once (FL_USAGE keeps one record per id),
        # but GPU waste, and the library-internal form of "wrongly failed".
        if resumed_finished:
            resumed_done.append(rid)
        for k, att in enumerate(req.attempts):
            if att.outcome in (None, "ok", ErrorCode.CANCELLED.value):
                continue
            mine = [u for t, u in obs.usage.get(rid, ())
                    if _usage_submission(obs, req, t, u) == k]
            # Delivered: what the client read, plus the tokens an error chunk carried
            # (the library raises on it without yielding them).
            end = att.end_t if att.end_t is not None else float("inf")
            delivered = att.tokens + max((c[2] for c in obs.chunks.get(rid, ())
                                          if c[3] and _submission_of(req, c[0]) == k
                                          and c[0] <= end + 0.5), default=0)
            if any(u.finish_reason in BILLABLE_FINISH or u.completion_tokens > delivered
                   for u in mine):
                billed_failed.append(rid)
            if att.outcome in LOST_CODES:
                ok_fin = [f for f in obs.finished.get(rid, ())
                          if f[3] is None and _run_submission(obs, req, f[1], f[0]) == k]
                ok_log = [d for d in log_finished.get(rid, ())
                          if _run_submission(obs, req, d.get("worker_id", ""), d.get("t", 0)) == k]
                ok_use = [u for u in mine if u.finish_reason in BILLABLE_FINISH]
                if ok_fin or ok_log or ok_use:
                    wrongly.append(rid)
    ends = [r.end_t for r in reqs if r.end_t is not None]
    failures = [r.rid for r in reqs if r.done and r.outcome not in ("ok", "cancelled")]
    flagged = list(dict.fromkeys([*lost, *twice, *billed_failed, *wrongly, *incomplete,
                                  *bad_stored, *failures[:3], *resumed_done[:2],
                                  *[r.rid for r in reqs if r.num_lib_attempts > 1][:2]]))
    evidence = {rid: evidence_of(run, rid) for rid in flagged[:10]}
    out: dict[str, Any] = {
        "submitted": len(reqs),
        "completed": completed,
        "failed": dict(sorted(failed.items())),
        "lost": len(lost),
        "generated_twice": len(twice),
        "failed_but_billed": len(billed_failed),
        "wrongly_failed": len(wrongly),
        "incomplete_ok": len(incomplete),
        "submit_retries": sum(len(r.submit_errors) for r in reqs),
        "client_resubmissions": sum(max(0, len(r.attempts) - 1) for r in reqs),
        "library_resumes": sum(a.lib_last - a.lib_first for r in reqs for a in r.attempts),
        "usage_republished": republished,
        "completed_billing_mismatch": len(bad_stored),
        "finished_attempt_resumed": len(resumed_done),
        "dispatcher_restarts_by_supervisor": len(run.supervisor_restarts),
        "ids": {"lost": lost[:20], "generated_twice": twice[:20],
                "failed_but_billed": billed_failed[:20], "wrongly_failed": wrongly[:20],
                "incomplete_ok": incomplete[:20], "completed_billing_mismatch": bad_stored[:20],
                "finished_attempt_resumed": resumed_done[:20]},
        "recovery_s": {},
        "evidence": evidence,
    }
    rec = out["recovery_s"]
    if fault is not None:
        nxt = obs.first_started_after(fault)
        rec["fault_to_next_started"] = None if nxt is None else round(nxt - fault, 3)
        late = [e for e in ends if e >= fault]
        rec["fault_to_all_answered"] = round(max(late) - fault, 3) if late else 0.0
        if run.restore_t is not None:
            nxt = obs.first_started_after(run.restore_t)
            rec["restore_to_next_started"] = None if nxt is None else round(nxt - run.restore_t, 3)
    if victim_worker is not None and fault is not None:
        victims = [run.requests[r] for r in obs.running_on(victim_worker, fault)
                   if r in run.requests]
        answered, resumed, told = [], [], []
        for v in victims:
            if not v.attempts:
                continue
            a = v.attempts[0]
            final = (a.end_t if a.end_t is not None else float("inf")) - fault
            answered.append(final)
            # The fleet tells the client: an error chunk (worker_lost, which the library
            # turns into a resume) or tokens again; its stream goes on at the
            # continuation's first token elsewhere (its Started).
            errs = [c[0] for c in obs.chunks.get(v.rid, ()) if c[0] > fault and c[3]]
            nxt = [st[0] for st in obs.started.get(v.rid, ()) if st[0] > fault]
            told.append(min([*errs, *nxt]) - fault if errs or nxt else final)
            resumed.append(min(nxt) - fault if nxt else final)
        rec["victims"] = len(victims)
        rec["victims_told_max"] = round(max(told), 3) if told else None
        rec["victims_resumed_max"] = round(max(resumed), 3) if resumed else None
        rec["victims_answered_max"] = round(max(answered), 3) if answered else None
        rec["victims_answered_median"] = (round(statistics.median(answered), 3)
                                          if answered else None)
        out["victim_outcomes"] = dict(Counter(
            f"{a.outcome} after {a.lib_last - a.lib_first} resumes"
            for v in victims for a in v.attempts[:1]))
    ttfts = [a.first_t - a.submit_t for r in reqs for a in r.attempts[:1] if a.first_t]
    if ttfts:
        out["ttft_ms"] = {"p50": _ms(quantile(ttfts, 0.5)), "p99": _ms(quantile(ttfts, 0.99))}
    return out
