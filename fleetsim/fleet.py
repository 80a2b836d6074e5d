"""The fleet in virtual time: the production `PoolCore` and N `BatchCore` engines.

A discrete-event simulation. Nothing here decides anything the product decides: every
scheduling, preemption and recovery decision is `dispatcher.scheduler.pool.PoolCore`'s
(the dispatcher's own core, unchanged), every batching, KV and step-time effect
`gpu_worker.sim.batch.BatchCore`'s (the simulator engine's physics). This module is
the glue the real processes provide over NATS, written as events:

- a worker pulls when it has room (`gpu_worker.room`: batch cap + prefetch), one pull
  at a time but for one sent full, replaced when a slot frees (`gpu_worker.pulling`);
  the dispatcher answers at once or holds it until work arrives or `pull_wait_ms`;
  queued work is spread over the waiting pulls, free slots first (`scheduler.spread`);
  when work waits and no pull has a free slot, the core is asked for preemptions;
- every message between dispatcher and worker takes `network_ms`;
- an engine runs one step at a time, or a run of steps at once when nothing can
  change its batch (`BatchCore.steps_until_change`), cut at the step in progress when
  work arrives mid-run (the real engine admits it there); a run costs O(1) whatever
  the batch: only sequences whose state changes are touched (first token, finish,
  preemption), and tokens are reported when a sequence leaves the batch;
- heartbeats (every worker's in one event: they beat in step) and housekeeping go to
  the core as the shell sends them, so its liveness rules see a live fleet.

The client and JetStream legs are one delay per request (`FleetSettings.client_ms`)
on what its client sees, ingest itself instantaneous. Not modelled: faults, the edge's
rate limits, the dispatcher's CPU (decisions take no time: `fleetsim.core_clock`).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Iterator
from itertools import chain

# Names, not `actions.X`: compiled, a module attribute is a lookup on every use.
from dispatcher.scheduler.actions import (
    Ack,
    Action,
    CheckStarted,
    Hold,
    Preempt,
    Released,
    Requeued,
    SendError,
)
from dispatcher.scheduler.core import Scheduler
from dispatcher.scheduler.pool import PoolCore
from dispatcher.scheduler.spread import spread
from dispatcher.scheduler.types import ActualUsage, Dispatch, QueuedRequest
from fairlane.errors import ErrorCode
from fairlane.poolconfig import SchedulerConfig
from fairlane.protocol import EngineLoad
from fleetsim.events import event_heap
from fleetsim.records import Arrival, Sink, StopRun, TenantTable
from fleetsim.state import FleetSettings, Pull, PullLine, Req, Run, Worker, engine_load
from gpu_worker.room import pull_room_of
from gpu_worker.sim.batch import BatchCore, Seq, SeqState
from gpu_worker.sim.step_model import StepModel, load_step_model

__all__ = ["Fleet", "FleetSettings", "StopRun"]


def _admission_order(seq: Seq) -> int:
    return seq.order


class Fleet:
    """Runs a workload through PoolCore and `num_workers` simulated engines."""

    def __init__(self, config: SchedulerConfig, tenants: TenantTable, sink: Sink,
                 settings: FleetSettings | None = None) -> None:
        self.s = settings or FleetSettings()
        self.tenants = tenants
        self.sink = sink
        self.scheduler = Scheduler(config)
        self.core = PoolCore(self.scheduler, self.s.worker_timeout_ms)
        self.step_model: StepModel = load_step_model(self.s.step_model)
        self.workers = [
            Worker(f"w{i}", BatchCore(self.step_model, max_num_seqs=self.s.max_num_seqs,
                                      kv_tokens_total=self.s.kv_tokens_total, step_log_size=0))
            for i in range(self.s.num_workers)]
        self._by_id = {w.worker_id: w for w in self.workers}
        # As `SimEngine`, a prompt that reaches the longest sequence is refused, an output cut.
        self.max_seq_len = self.workers[0].core.max_seq_len(self.s.max_model_len)
        self._events = event_heap()  # timers and step ends
        self._net: deque[tuple[float, int, Callable, object]] = deque()  # in time order
        self._expiries: deque[tuple[float, int, Pull]] = deque()  # (time, seq, pull)
        self._seq = 0  # the last event's number (an int: next() on a count is a generic call)
        # Waiting pulls by arrival, those with a free slot apart (served first, `_line`)
        self._pulls_free, self._pulls_prefetch = PullLine(), PullLine()
        self._served: list[Pull] = []  # given work by a serving pass: answered at its end
        # `spread`'s callbacks, bound once (compiled, `self._take` is a new object each use)
        self._take_fn: Callable[[Pull, int], int] = self._take
        self._num_queued_fn: Callable[[], int] = self._num_queued
        self._client_ms, self._client_rng = self.s.client_ms, random.Random(self.s.client_seed)
        self.now_ms = self.end_ms = 0.0  # end_ms: where `run` ended (duration, StopRun)
        self.num_events = self.num_preemptions = self.num_arrivals = 0

    # --- the event loop ---------------------------------------------------------------

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _at(self, t_ms: float, fn: Callable, arg: object = None) -> None:
        self._events.push(t_ms, self._next_seq(), fn, arg)

    def _send(self, fn: Callable, arg: object) -> None:
        """A message between dispatcher and worker: handled `network_ms` from now."""
        self._net.append((self.now_ms + self.s.network_ms, self._next_seq(), fn, arg))

    def run(self, arrivals: Iterator[Arrival], duration_s: float,
            progress: Callable[[float], None] | None = None,
            progress_every_s: float = 60.0) -> None:
        """Simulate until `duration_s` (arrivals after it are not taken); `progress`
        gets the simulated time every `progress_every_s`; it may raise `StopRun` to end
        the run there (`end_ms` says where it ended)."""
        end_ms = duration_s * 1000.0
        self._at(0.0, self._heartbeats)
        for w in self.workers:
            self._at(self.s.network_ms, self._pull, w)
        self._at(self.s.housekeeping_ms, self._housekeeping)
        self._at(0.0, self._sample)
        inf = float("inf")
        nxt = next(arrivals, None)
        nxt_ms = nxt.t_s * 1000.0 if nxt is not None else inf
        next_progress_ms = 0.0
        events, net, expiries = self._events, self._net, self._expiries
        while True:
            # The earliest (time, seq) of the heap (timers, step ends) and two FIFOs in
            # (time, seq) order as their delays are fixed, the messages and the pull
            # expiries (O(1), not a heap operation, for ~5 of a request's ~8.5 events).
            src, t_ev, seq_ev = 0, inf, 0
            if events:
                src, t_ev, seq_ev = 1, events.head_t_ms(), events.head_seq()
            if net:
                msg = net[0]
                if msg[0] < t_ev or (msg[0] == t_ev and msg[1] < seq_ev):
                    src, t_ev, seq_ev = 2, msg[0], msg[1]
            if expiries:
                exp = expiries[0]
                if exp[0] < t_ev or (exp[0] == t_ev and exp[1] < seq_ev):
                    src, t_ev, seq_ev = 3, exp[0], exp[1]
            if nxt_ms <= t_ev and nxt is not None:
                if nxt_ms > end_ms:
                    nxt, nxt_ms = None, inf
                    continue
                self.now_ms = nxt_ms
                self._arrive(nxt)
                nxt = next(arrivals, None)
                nxt_ms = nxt.t_s * 1000.0 if nxt is not None else inf
                continue
            if t_ev > end_ms:
                break
            self.now_ms = t = t_ev
            self.num_events += 1
            if src == 1:
                events.pop_and_run()
            elif src == 2:
                _, _, fn, arg = net.popleft()
                fn(arg)
            else:
                self._expire_pull(expiries.popleft()[2])
            if progress is not None and t >= next_progress_ms:
                next_progress_ms = t + progress_every_s * 1000.0
                try:
                    progress(t / 1000.0)
                except StopRun:  # what is due now still runs; nothing later does
                    end_ms, next_progress_ms = t, inf
        self.now_ms = self.end_ms = end_ms
        self._flush_tokens()

    # --- dispatcher side --------------------------------------------------------------

    def _arrive(self, a: Arrival) -> None:
        self.num_arrivals += 1
        tenant = self.tenants.names[a.tenant]
        rid = f"q{self.num_arrivals}"
        q = QueuedRequest(
            request_id=rid, tenant=tenant, tier=self.tenants.tiers[self.tenants.tier_of[a.tenant]],
            prompt_tokens=a.prompt_tokens, max_output_tokens=a.max_tokens,
            expected_output_tokens=min(a.output_tokens, a.max_tokens)
            if self.s.hint_output_tokens else a.max_tokens,
            priority=a.priority, arrival_ms=self.now_ms)
        q.payload = r = Req(a, tenant)
        if self._client_ms:  # random(): the same draws under any Python (randrange's vary)
            r.client_ms = self._client_ms[int(self._client_rng.random() * len(self._client_ms))]
        self._apply(self.core.submit(q, self.now_ms))
        self._serve_pulls()

    def _apply(self, actions: list[Action]) -> None:
        # isinstance, not `match`: compiled, a class pattern that fails looks the
        # action's `__class__` up generically; isinstance is a type check.
        wake = False
        for a in actions:
            if isinstance(a, Hold) or isinstance(a, Ack):  # the most common
                continue  # JetStream bookkeeping (as Term, Nak, Defer, Adopted)
            if isinstance(a, SendError):
                r: Req = a.request.payload
                self.sink.on_rejected(r.arrival.tenant, (self.now_ms + r.client_ms) / 1000,
                                      a.code.value)
            elif isinstance(a, CheckStarted):
                r = a.request.payload
                self._apply(self.core.on_start_checked(a.request.request_id, r.started,
                                                       self.now_ms))
            elif isinstance(a, Preempt):
                self.num_preemptions += 1
                self._send(self._on_preempt_order,
                           (self._by_id[a.worker_id], a.request.request_id, a.dispatch))
            elif isinstance(a, Requeued) or isinstance(a, Released):
                wake = True
        if wake:
            self._serve_pulls()

    def _maybe_preempt(self) -> None:
        if self.scheduler.num_queued and not self._pulls_free.num_waiting:
            self._apply(self.core.preemptions(self.now_ms, 0))

    def _serve_pulls(self) -> None:
        if not self.scheduler.num_queued:
            return  # nothing to serve, nothing to preempt for
        self._maybe_preempt()
        # As `dispatcher.service`: free slots first, then prefetch room, each spread
        # evenly over the waiting pulls in arrival order (`scheduler.spread`).
        free, prefetch = self._pulls_free, self._pulls_prefetch
        served, num_queued, take = self._served, self._num_queued_fn, self._take_fn
        if spread(free, num_queued, take, Pull.room_now) and self.scheduler.num_queued:
            spread(chain(free, prefetch), num_queued, take, Pull.room)
        if served:
            for p in served:
                self._line(p).remove(p)
                self._send(self._on_batch, (p, p.given))
            served.clear()
        self._maybe_preempt()

    def _num_queued(self) -> int:  # `spread`'s
        return self.scheduler.num_queued

    def _take(self, p: Pull, n: int) -> int:
        """`spread`'s take; a pull's first work makes it one to answer."""
        first = not p.given
        got = p.take(self.core, p.worker.worker_id, n, self.now_ms)
        # NOTHING_ELIGIBLE: what is queued may not go now (quota-blocked tenants). That
        # does not depend on the (live) pull, and such a select leaves nothing that would
        # let the next find something (DRR/VTC park blocked tenants, fifo puts back what
        # it scanned): no other pull would get any; `spread` stops (as the dispatcher).
        if got > 0 and first:
            self._served.append(p)
        return got

    def _line(self, p: Pull) -> PullLine:
        return self._pulls_free if p.free_slots else self._pulls_prefetch

    def _expire_pull(self, p: Pull) -> None:
        if self._line(p).remove(p):
            self._send(self._on_batch, (p, []))

    def _housekeeping(self, _: object) -> None:
        self._apply(self.core.tick(self.now_ms))
        self._maybe_preempt()
        self._at(self.now_ms + self.s.housekeeping_ms, self._housekeeping)

    def _sample(self, _: object) -> None:
        depths = self.scheduler.tier_queue_depths()
        queued = [depths.get(t, 0) for t in self.tenants.tiers]
        running = sum(len(w.core.running) for w in self.workers)
        busy = sum(1 for w in self.workers if w.core.running)
        self.sink.sample(self.now_ms / 1000, queued, running, busy)
        self._at(self.now_ms + self.s.sample_every_s * 1000, self._sample)

    # --- messages arriving at the dispatcher --------------------------------------------

    def _on_pull(self, p: Pull) -> None:
        self._apply(self.core.on_pull(p.worker.worker_id, p.free_kv_tokens, self.now_ms))
        old, p.replaces = p.replaces, None
        if old is not None and self._line(old).remove(old):
            self._send(self._on_batch, (old, []))  # replaced: answered empty
        self._line(p).add(p)
        # expires_ms is now + pull_wait_ms (sent network_ms ago, it waits that long here)
        self._expiries.append((p.expires_ms, self._next_seq(), p))
        self._serve_pulls()

    def _on_started(self, arg: tuple[Worker, str]) -> None:
        self._apply(self.core.on_started(arg[1], arg[0].worker_id, self.now_ms))

    def _on_finished(self, arg: tuple[Worker, str, ActualUsage]) -> None:
        w, rid, usage = arg
        self._apply(self.core.on_finished(rid, w.worker_id, usage, self.now_ms))
        self._serve_pulls()

    def _on_preempted(self, arg: tuple[Worker, str, int]) -> None:
        w, rid, num_generated = arg
        self._apply(self.core.on_preempted(rid, w.worker_id, num_generated, self.now_ms))

    # --- worker side -------------------------------------------------------------------

    def _heartbeats(self, _: object) -> None:
        """Every worker's heartbeat (they beat in step): one event, not one per worker,
        each worker's message handled in the same order as separate events would be."""
        beats = [(w, list(w.seqs), [rid for rid, s in w.seqs.items() if s.owner.started],
                  engine_load(w.core)) for w in self.workers]
        self._send(self._on_heartbeats, beats)
        self._at(self.now_ms + self.s.heartbeat_ms, self._heartbeats)

    def _on_heartbeats(self, beats: list[tuple[Worker, list[str], list[str], EngineLoad]]) -> None:
        for w, ids, started, load in beats:
            self._apply(self.core.on_heartbeat(w.worker_id, ids, self.now_ms, load=load,
                                               interval_ms=self.s.heartbeat_ms,
                                               started_ids=started))

    def _pull(self, w: Worker) -> None:
        """`gpu_worker.pulling`: ask for the room beyond what unanswered pulls asked for;
        with one waiting, only to replace one sent with no slot free, once one is."""
        core, waiting = w.core, w.pull
        if waiting is not None and (waiting.free_slots or len(w.seqs) >= core.max_num_seqs):
            return  # (all its slots accepted: no free slot, whatever `pull_room_of` says)
        room, free_slots, free_kv = pull_room_of(
            len(core.running), core.num_waiting, core.free_blocks * core.block_size,
            len(w.seqs), core.max_num_seqs, self.s.prefetch_seqs)
        room -= w.asked
        if room <= 0 or (waiting is not None and not free_slots):
            return  # asks again when a slot frees (a finish)
        expires_ms = self.now_ms + self.s.network_ms + self.s.pull_wait_ms
        w.pull = p = Pull(max_items=room, free_slots=min(free_slots, room),
                          free_kv_tokens=free_kv, worker=w, expires_ms=expires_ms,
                          replaces=waiting)
        w.asked += room
        self._send(self._on_pull, p)

    def _on_batch(self, arg: tuple[Pull, list[Dispatch]]) -> None:
        p, items = arg
        w = p.worker
        w.asked -= p.asked
        w.pull = None if w.pull is p else w.pull
        for d in items:
            self._accept(w, d)
        self._pull(w)

    def _accept(self, w: Worker, d: Dispatch) -> None:
        q = d.request
        r: Req = q.payload
        r.started, r.accepted_ms = False, self.now_ms
        a = r.arrival
        room = self.max_seq_len - a.prompt_tokens
        if room <= 0:
            self._refuse_too_long(w, q.request_id, r)
            return
        seq = Seq(request_id=q.request_id, priority=d.engine_priority,
                  num_prompt_tokens=a.prompt_tokens,
                  target_output_tokens=max(1, min(a.output_tokens, a.max_tokens, room)),
                  cache_key=(r.tenant, q.request_id), is_resume=r.num_generated > 0,
                  num_output_tokens=r.num_generated, owner=r)
        w.seqs[q.request_id] = seq
        w.core.add(seq)
        self._wake(w)

    def _refuse_too_long(self, w: Worker, rid: str, r: Req) -> None:
        """PromptTooLong: the client gets its error, the dispatcher a tokenless Finished."""
        a = r.arrival
        self.sink.on_rejected(a.tenant, (self.now_ms + r.client_ms) / 1000,
                              ErrorCode.PROMPT_TOO_LONG.value)
        usage = ActualUsage(a.prompt_tokens, 0, 0.0, self.now_ms - a.t_s * 1000)
        self._send(self._on_finished, (w, rid, usage))

    def _on_preempt_order(self, arg: tuple[Worker, str, Dispatch | None]) -> None:
        w, rid, replacement = arg
        seq = w.seqs.get(rid)
        if seq is not None and seq.state is not SeqState.FINISHED:
            self._cut(w)
            w.seqs.pop(rid)
            w.core.release(seq)
            # Its tokens up to the step in progress (cut: the core is applied to there).
            self._report_tokens(seq, w.run.start_ms if w.run is not None else self.now_ms)
            r: Req = seq.owner
            r.num_generated = seq.num_output_tokens
            r.preemptions += 1
            self.sink.on_preempted(r.arrival.tenant, self.now_ms / 1000)
            self._send(self._on_preempted, (w, rid, seq.num_output_tokens))
        if replacement is not None:
            self._accept(w, replacement)

    # --- the engine: steps and runs -------------------------------------------------------

    def _wake(self, w: Worker) -> None:
        """New work: an idle engine starts a step, a run is cut at its step in progress."""
        if w.run is None:
            self._start_steps(w)
        else:
            self._cut(w)

    def _cut(self, w: Worker) -> None:
        run = w.run
        if run is None or run.k <= 1:
            return
        now = self.now_ms
        if run.end_of(run.k) <= now:
            return  # its end event is due now
        done = run.steps_done_by(now)
        if done:
            w.core.run_steps(done, run.prefill_tokens)
            # The step in progress had its KV growth (the first half of its schedule;
            # within the run's room, so no KV preemption).
            w.core.grow()
        step_start, step_end = run.end_of(done), run.end_of(done + 1)
        w.version += 1
        w.run = Run(step_start, 1, run.a_ms + run.b_ms * done, run.b_ms,
                    0.0 if done else run.pre_ms, 0 if done else run.prefill_tokens,
                    step_end - step_start, [], w.version)
        self._at(step_end, self._end_run, (w, w.version))

    def _start_steps(self, w: Worker) -> None:
        core = w.core
        prefill = core.schedule()
        now = self.now_ms
        for seq in core.last_preempted:  # KV exhaustion: back to the engine's queue
            self._report_tokens(seq, now)
        for seq in core.last_admitted:
            r: Req = seq.owner
            r.tok_ms, r.tok_out = now, seq.num_output_tokens
            if seq.refill_tokens:  # a re-admission: what preempting it cost
                self.sink.on_recomputed(r.arrival.tenant, now / 1000, seq.refill_tokens)
        if not core.running:
            w.run = None
            return
        # A step with admissions runs alone: its first tokens (Started) go out at its end.
        k = 1 if prefill or not self.s.batch_runs else max(1, core.steps_until_change())
        a_ms, b_ms, pre_ms = core.run_coeffs(prefill)
        w.version += 1
        w.run = run = Run(now, k, a_ms, b_ms, pre_ms, prefill, pre_ms + a_ms,
                          core.last_admitted, w.version)
        self._at(run.end_of(k), self._end_run, (w, w.version))

    def _end_run(self, arg: tuple[Worker, int]) -> None:
        w, version = arg
        run = w.run
        if run is None or version != w.version:
            return  # cut: a newer event ends the step in progress
        w.run = None
        core = w.core
        if run.k == 1:
            core.advance_step(run.step_ms)
        else:
            core.run_steps(run.k, run.prefill_tokens)
        # Only sequences whose state changes are touched: first tokens (admitted by
        # this step) and finishes, in the batch's order.
        todo = core.pop_finished()
        if run.admitted:
            todo = sorted({*todo, *(s for s in run.admitted if s.state is SeqState.RUNNING)},
                          key=_admission_order)
        for seq in todo:
            r: Req = seq.owner
            if not r.started:
                r.started = True
                if r.first_token_ms is None:
                    r.first_token_ms = self.now_ms
                    r.worker_ttft_ms = self.now_ms - r.accepted_ms
                    t_ms = self.now_ms + r.client_ms  # when its client has it
                    self.sink.on_first_token(r.arrival.tenant, t_ms / 1000,
                                             (t_ms - r.arrival.t_s * 1000) / 1000)
                self._send(self._on_started, (w, seq.request_id))
            if seq.num_tokens_left <= 0:
                self._finish(w, seq)
        self._start_steps(w)
        self._pull(w)

    def _report_tokens(self, seq: Seq, end_ms: float) -> None:
        """`seq`'s tokens since its last report, spread over the time since (once per
        residency in a batch, not per step)."""
        r: Req = seq.owner
        n = seq.num_output_tokens - r.tok_out
        if n > 0:
            self.sink.on_tokens(r.arrival.tenant, (r.tok_ms + r.client_ms) / 1000,
                                (end_ms + r.client_ms) / 1000, n)
        r.tok_ms, r.tok_out = end_ms, r.tok_out + n

    def _flush_tokens(self) -> None:
        """At the end: runs cut at their last step that ended, the running's tokens."""
        for w in self.workers:
            self._cut(w)
            t_ms = w.run.start_ms if w.run is not None else self.now_ms
            for seq in w.core.running:
                self._report_tokens(seq, t_ms)

    def _finish(self, w: Worker, seq: Seq) -> None:
        core = w.core
        core.release(seq)
        self._report_tokens(seq, self.now_ms)
        w.seqs.pop(seq.request_id, None)
        r: Req = seq.owner
        a = r.arrival
        e2e_ms = self.now_ms - a.t_s * 1000  # the fleet's; its client's is client_ms later
        e2e_s = (e2e_ms + r.client_ms) / 1000
        ttft_s = ((r.first_token_ms or self.now_ms) - a.t_s * 1000 + r.client_ms) / 1000
        self.sink.on_finished(a.tenant, (self.now_ms + r.client_ms) / 1000, e2e_s, ttft_s,
                              seq.num_output_tokens, r.preemptions, r.worker_ttft_ms / 1000,
                              r.client_ms / 1000)
        usage = ActualUsage(prompt_tokens=a.prompt_tokens,
                            completion_tokens=seq.num_output_tokens - r.num_generated,
                            kv_token_seconds=seq.kv_token_seconds, e2e_ms=e2e_ms)
        self._send(self._on_finished, (w, seq.request_id, usage))
