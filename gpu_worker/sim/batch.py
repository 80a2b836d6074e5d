"""`BatchCore`: the continuous-batching physics of the simulator, with no I/O and no clock.

One engine's slots, paged KV cache, waiting queue, KV-exhaustion preemption and
prefix cache, exactly as `gpu_worker.sim.engine` describes them. Two drivers share it:

- `SimEngine` (asyncio, real or scaled time) runs one step at a time and turns each
  sequence's new token into text for its stream;
- the fleet simulator (`fleetsim.fleet`, virtual time) also runs whole runs of
  steps at once (`steps_until_change` / `run_steps`) while nothing can change the
  batch, so an hour of 1,000 engines costs events per request, not per token.

A step is: `schedule()` (grow running sequences' KV, preempting on exhaustion, then
admit waiting ones; returns the tokens to prefill), `step_ms(prefill)`, then
`end_step(step_ms)` (every running sequence gets one token; the driver decides which
finished and calls `release`).
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections import deque
from dataclasses import dataclass
from typing import Any

import structlog

from gpu_worker.sim.prefix_cache import PrefixCache
from gpu_worker.sim.step_model import StepModel

log = structlog.get_logger(__name__)


class SeqState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Seq:
    """One sequence in the engine. `owner` is the driver's (a stream, a record)."""

    request_id: str
    priority: int  # engine priority: lower runs first, is evicted last
    num_prompt_tokens: int
    target_output_tokens: int  # it finishes when it has this many (whole request)
    cache_key: tuple[str, str]  # (cache salt, request id): its prefix-cache entry
    is_resume: bool = False  # a continuation: its first admission re-prefills
    num_output_tokens: int = 0  # whole request: resumed-from tokens included
    owner: Any = None
    arrival: int = 0  # set by BatchCore.add: FIFO order within a priority
    state: SeqState = SeqState.WAITING
    num_blocks: int = 0
    num_kv_computed: int = 0  # tokens whose KV is computed (the last sampled has none yet)
    num_admissions: int = 0
    num_preemptions: int = 0
    kv_token_seconds: float = 0.0
    # A continuation's first admission: re-prefilled tokens the prefix cache did not
    # hold, and prompt tokens it did.
    num_recomputed_tokens: int = 0
    num_cached_prompt_tokens: int = 0

    @property
    def key(self) -> tuple[int, int]:
        return (self.priority, self.arrival)

    @property
    def num_kv_tokens(self) -> int:
        """Tokens whose KV this sequence holds (zero while waiting)."""
        return self.num_prompt_tokens + self.num_output_tokens if self.num_blocks else 0

    @property
    def num_tokens_left(self) -> int:
        return self.target_output_tokens - self.num_output_tokens


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One simulated engine step, kept for tests and experiments."""

    num_running: int
    kv_tokens_in_use: int
    prefill_tokens: int
    step_ms: float


class BatchCore:
    """Slots, KV blocks, waiting queue and prefix cache of one simulated engine."""

    def __init__(self, step_model: StepModel, *, max_num_seqs: int | None = None,
                 kv_tokens_total: int | None = None, step_log_size: int = 10_000) -> None:
        self.step_model = step_model
        self.max_num_seqs = max_num_seqs or step_model.max_num_seqs
        self.block_size = step_model.kv_block_size_tokens
        total = kv_tokens_total or step_model.kv_tokens_total
        self.num_blocks_total = total // self.block_size
        if self.num_blocks_total < 1:
            raise ValueError("kv_tokens_total must hold at least one KV block")
        self.running: list[Seq] = []
        self._waiting: list[tuple[int, int, Seq]] = []  # heap; stale entries skipped
        self.num_waiting = 0
        self.free_blocks = self.num_blocks_total  # includes the prefix cache's blocks
        self.prefix_cache = PrefixCache()
        self._arrivals = itertools.count()
        self.num_steps = 0
        self.num_preemptions = 0
        # Tokens prefilled again (a preempted sequence's or a continuation's prompt +
        # output) that the prefix cache no longer held, and those it did hold.
        self.num_recomputed_tokens = 0
        self.num_prefix_cache_hit_tokens = 0
        self.sim_time_s = 0.0
        self.steps: deque[StepRecord] = deque(maxlen=step_log_size)

    # --- queue ----------------------------------------------------------------------

    def add(self, seq: Seq) -> None:
        """A new sequence waits for a slot (ordered by priority, then arrival)."""
        seq.arrival = next(self._arrivals)
        self._push_waiting(seq)

    def _push_waiting(self, seq: Seq) -> None:
        seq.state = SeqState.WAITING
        heapq.heappush(self._waiting, (seq.priority, seq.arrival, seq))
        self.num_waiting += 1

    def peek_waiting(self) -> Seq | None:
        while self._waiting and self._waiting[0][2].state is not SeqState.WAITING:
            heapq.heappop(self._waiting)  # stale: aborted while waiting
        return self._waiting[0][2] if self._waiting else None

    @property
    def kv_tokens_used(self) -> int:
        return (self.num_blocks_total - self.free_blocks) * self.block_size

    @property
    def kv_tokens_total(self) -> int:
        return self.num_blocks_total * self.block_size

    # --- one step -------------------------------------------------------------------

    def schedule(self) -> int:
        """Grow running sequences (preempting on KV exhaustion), then admit waiting
        ones. Returns the number of tokens to prefill in this step."""
        if self.grow() and self.running:
            return 0  # as vLLM: no admissions in a step that had to preempt
        prefill = 0
        while len(self.running) < self.max_num_seqs:
            head = self.peek_waiting()
            if head is None:
                break
            need = self.blocks_for(head)
            if need > self.free_blocks:
                break  # head-of-line: nothing behind it jumps ahead
            heapq.heappop(self._waiting)
            self.num_waiting -= 1
            prefill += self._admit(head, need)
        return prefill

    def grow(self) -> bool:
        """The first half of `schedule`: give each running sequence the KV blocks its
        next token needs, preempting (latest, lowest priority first) when they run
        out. True if it preempted."""
        preempted = False
        for seq in sorted(self.running, key=lambda s: s.key):
            if seq.state is not SeqState.RUNNING:
                continue  # preempted earlier in this pass
            need = self.blocks_for(seq) - seq.num_blocks
            while need > self.free_blocks:
                victim = max(self.running, key=lambda s: s.key)
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.state is SeqState.RUNNING and need > 0:
                seq.num_blocks += need
                self._take_free_blocks(need)
        return preempted

    def step_ms(self, prefill_tokens: int) -> float:
        """Duration of the step about to run over the current batch."""
        kv_in_use = sum(s.num_kv_tokens for s in self.running)
        ms = self.step_model.step_ms(len(self.running), kv_in_use, prefill_tokens)
        self.steps.append(StepRecord(len(self.running), kv_in_use, prefill_tokens, ms))
        return ms

    def end_step(self, batch: list[Seq], step_ms: float) -> list[Seq]:
        """The step over `batch` (the running list when it began) ended: each of its
        sequences still running gets one token. Returns those (the driver decides
        which finished and `release`s them)."""
        self.num_steps += 1
        self.sim_time_s += step_ms / 1000.0
        out = []
        for seq in batch:
            if seq.state is SeqState.RUNNING:  # not aborted during the step
                seq.kv_token_seconds += seq.num_kv_tokens * step_ms / 1000.0
                seq.num_output_tokens += 1
                # The step fed the previously sampled token: all but the new one have KV.
                seq.num_kv_computed = seq.num_prompt_tokens + seq.num_output_tokens - 1
                out.append(seq)
        return out

    # --- many steps at once (virtual time) ---------------------------------------------

    def steps_until_change(self) -> int:
        """How many steps from now (this step's `schedule()` already ran) can run with
        exactly this batch: no admission, no KV preemption, no finish before the last
        of them. 0: step one at a time. Sequences the driver must watch token by token
        (stop strings) must not be in a batch run this way."""
        if not self.running:
            return 0
        k = min(s.num_tokens_left for s in self.running)
        if k <= 1:
            return k
        head = self.peek_waiting()
        # An admission can only follow a finish (slots full) or freed blocks (KV-bound
        # head): neither happens inside the run, whose last step is the first finish.
        if head is not None and len(self.running) < self.max_num_seqs and (
                self.blocks_for(head) <= self.free_blocks):
            return 1
        while k > 1 and self._growth_blocks(k) > self.free_blocks:
            k //= 2  # growth would need a KV preemption inside the run
        return k

    def _growth_blocks(self, num_steps: int) -> int:
        """Blocks the running sequences take on over `num_steps` more steps' schedules
        (the first step's growth is already allocated)."""
        bs = self.block_size
        return sum(-(-(s.num_prompt_tokens + s.num_output_tokens + num_steps) // bs)
                   - s.num_blocks for s in self.running)

    def _run_coeffs(self, prefill_tokens: int) -> tuple[float, float, float]:
        """Step j of a run over the current batch lasts a + b*j ms, plus the prefill
        in step 0: each step adds one KV token per sequence."""
        m = self.step_model
        n = len(self.running)
        kv0 = sum(s.num_kv_tokens for s in self.running)
        a_ms = m.step_base_ms + m.step_per_seq_ms * n + m.step_per_kv_token_ms * kv0
        return a_ms, m.step_per_kv_token_ms * n, m.prefill_ms(prefill_tokens)

    def run_ms(self, num_steps: int, prefill_tokens: int) -> list[float]:
        """End times (ms from now) of each step of a run of `num_steps` (see run_steps)."""
        a_ms, b_ms, t = self._run_coeffs(prefill_tokens)
        out = []
        for j in range(num_steps):
            t += a_ms + b_ms * j
            out.append(t)
        return out

    def run_steps(self, num_steps: int, prefill_tokens: int) -> float:
        """Run `num_steps` steps over the current batch at once (the first includes
        `prefill_tokens`), as `num_steps` rounds of schedule/end_step would with no
        admission or KV preemption in between; returns their total ms. Every running
        sequence gets `num_steps` tokens; the driver releases the finished ones."""
        k = num_steps
        a_ms, b_ms, pre_ms = self._run_coeffs(prefill_tokens)
        s1, s2 = k * (k - 1) / 2, (k - 1) * k * (2 * k - 1) / 6  # sum j, sum j^2
        total_ms = a_ms * k + b_ms * s1 + pre_ms
        # The schedules before steps 2..k grow each sequence to cover P + O + k tokens.
        grow = self._growth_blocks(k)
        if grow > 0:
            self._take_free_blocks(grow)
        bs = self.block_size
        for s in self.running:
            c = s.num_kv_tokens
            # sum over j of (c + j) * (a + b j), plus the prefill step's c * pre
            s.kv_token_seconds += (c * a_ms * k + (c * b_ms + a_ms) * s1 + b_ms * s2
                                   + c * pre_ms) / 1000.0
            s.num_blocks = max(s.num_blocks,
                               -(-(s.num_prompt_tokens + s.num_output_tokens + k) // bs))
            s.num_output_tokens += k
            s.num_kv_computed = s.num_prompt_tokens + s.num_output_tokens - 1
        self.num_steps += k
        self.sim_time_s += total_ms / 1000.0
        return total_ms

    # --- admission, release -------------------------------------------------------------

    def _admit(self, seq: Seq, need: int) -> int:
        """Move `seq` into the batch with `need` blocks; returns its prefill tokens."""
        num_tokens = seq.num_prompt_tokens + seq.num_output_tokens
        hit_tokens = 0
        # Recompute-style: a preempted sequence or a continuation re-prefills prompt +
        # generated tokens, less the full blocks its prefix-cache entry still holds. At
        # least the last token is computed again (its logits give the next token), as
        # in vLLM.
        refill = seq.is_resume or seq.num_admissions > 0
        if refill:
            hit_blocks = self.prefix_cache.take(seq.cache_key, (num_tokens - 1) // self.block_size)
            hit_tokens = hit_blocks * self.block_size
            self.num_recomputed_tokens += num_tokens - hit_tokens
            self.num_prefix_cache_hit_tokens += hit_tokens
            if seq.num_admissions == 0:  # the continuation's own re-prefill
                seq.num_recomputed_tokens = num_tokens - hit_tokens
                seq.num_cached_prompt_tokens = min(hit_tokens, seq.num_prompt_tokens)
        self._take_free_blocks(need)
        seq.state = SeqState.RUNNING
        seq.num_blocks = need
        seq.num_kv_computed = hit_tokens
        seq.num_admissions += 1
        self.running.append(seq)
        return num_tokens - hit_tokens

    def _take_free_blocks(self, n: int) -> None:
        """Allocate `n` of the free blocks, evicting cached ones only when the
        uncached free blocks do not suffice (the caller checked n <= free)."""
        shortfall = n - (self.free_blocks - self.prefix_cache.num_blocks)
        if shortfall > 0:
            self.prefix_cache.evict(shortfall)
        self.free_blocks -= n

    def blocks_for(self, seq: Seq) -> int:
        return -(-(seq.num_prompt_tokens + seq.num_output_tokens + 1) // self.block_size)

    def _preempt(self, seq: Seq) -> None:
        self.release(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._push_waiting(seq)
        log.debug("sim_preempted", request_id=seq.request_id, num_output_tokens=seq.num_output_tokens)

    def release(self, seq: Seq) -> None:
        """Take `seq` out of the batch / queue and free its KV blocks; its full
        computed blocks stay in the prefix cache (free, evictable) for a later run."""
        if seq.state is SeqState.RUNNING:
            self.running.remove(seq)
        elif seq.state is SeqState.WAITING:
            self.num_waiting -= 1  # its heap entry goes stale and is skipped
        if seq.num_blocks:
            self.free_blocks += seq.num_blocks
            full_blocks = min(seq.num_blocks, seq.num_kv_computed // self.block_size)
            self.prefix_cache.put(seq.cache_key, full_blocks)
        seq.num_blocks = 0
        seq.num_kv_computed = 0
        seq.state = SeqState.FINISHED
