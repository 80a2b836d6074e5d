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
`end_step(batch, step_ms)` (every running sequence gets one token; the driver decides
which finished and calls `release`), or, O(1), `advance_step(step_ms)` and
`pop_finished()` for a driver that only wants the sequences that finished.

Every step gives every running sequence one token, so the core keeps cumulative
counters instead of touching each sequence: `_D` tokens per running sequence so far,
`_T` step milliseconds and `_U` = sum over steps of `_D` (at the step's start) x its
milliseconds. A running sequence stores its values relative to them when admitted
(its output count is `_out + _D`; its KV token-seconds grow by
`(P + _out) * dT + dU`), and its KV blocks are a function of its length and whether
this step's growth is allocated (`_grown`). Aggregates (`_kv_off`: sum of `P + _out`;
`_res`: how many running sequences have each `(P + _out) mod block`; `_fin`: a heap
of the `_D` at which each finishes) make a step or a run of steps O(1), block growth
O(block size), and finishes O(log n) each; only KV preemption walks the batch.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from heapq import heappop, heappush  # by name: compiled, heapq.x is a lookup per call
from typing import Any

import structlog

from gpu_worker.sim.prefix_cache import PrefixCache
from gpu_worker.sim.step_model import StepModel, prefill_ms

log = structlog.get_logger(__name__)


class SeqState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_RUNNING = SeqState.RUNNING


class Seq:
    """One sequence in the engine. `owner` is the driver's (a stream, a record).

    While it runs, its output count, KV blocks, computed KV and KV token-seconds are
    read from its core's counters (properties); leaving the batch stores them."""

    __slots__ = ("request_id", "priority", "num_prompt_tokens", "target_output_tokens",
                 "cache_key", "is_resume", "owner", "arrival", "state", "num_admissions",
                 "num_preemptions", "num_recomputed_tokens", "num_cached_prompt_tokens",
                 "refill_tokens", "order", "_core", "_out", "_kvts", "_t0", "_u0", "_d0", "_hit")

    def __init__(self, request_id: str, priority: int, num_prompt_tokens: int,
                 target_output_tokens: int, cache_key: tuple[str, str], is_resume: bool = False,
                 num_output_tokens: int = 0, owner: Any = None) -> None:
        self.request_id = request_id
        self.priority = priority  # engine priority: lower runs first, is evicted last
        self.num_prompt_tokens = num_prompt_tokens
        self.target_output_tokens = target_output_tokens  # whole request: finishes here
        self.cache_key = cache_key  # (cache salt, request id): its prefix-cache entry
        self.is_resume = is_resume  # a continuation: its first admission re-prefills
        self.owner = owner
        self.arrival = 0  # set by BatchCore.add: FIFO order within a priority
        self.state = SeqState.WAITING
        self.num_admissions = 0
        self.num_preemptions = 0
        # A continuation's first admission: re-prefilled tokens the prefix cache did not
        # hold, and prompt tokens it did. refill_tokens: the latest admission's (any).
        self.num_recomputed_tokens = self.num_cached_prompt_tokens = self.refill_tokens = 0
        self._core: BatchCore | None = None  # set while running
        # Output tokens, whole request (resumed-from included); while running, less _D.
        self._out = num_output_tokens
        self._kvts = 0.0  # KV token-seconds until this residency began
        self._t0 = self._u0 = 0.0  # when admitted: the core's _T, _U, _D, and the KV
        self._d0 = self._hit = 0  # tokens the prefix cache gave
        self.order = 0  # admission order (BatchCore): its place in the running list

    def __repr__(self) -> str:
        return f"Seq({self.request_id!r}, {self.state.value}, out={self.num_output_tokens})"

    @property
    def key(self) -> tuple[int, int]:
        return (self.priority, self.arrival)

    @property
    def num_output_tokens(self) -> int:
        c = self._core
        return self._out if c is None else self._out + c._D

    @property
    def num_tokens_left(self) -> int:
        return self.target_output_tokens - self.num_output_tokens

    @property
    def num_kv_tokens(self) -> int:
        """Tokens whose KV this sequence holds (zero while waiting)."""
        c = self._core
        return 0 if c is None else self.num_prompt_tokens + self._out + c._D

    @property
    def num_blocks(self) -> int:
        """KV blocks held: while running, enough for its tokens (and the next one's
        once this step's growth is allocated)."""
        c = self._core
        if c is None:
            return 0
        return -(-(self.num_prompt_tokens + self._out + c._D + c._grown) // c.block_size)

    @property
    def num_kv_computed(self) -> int:
        """Tokens whose KV is computed (the last sampled has none yet)."""
        c = self._core
        if c is None:
            return 0
        if c._D > self._d0:  # a step fed the previously sampled token
            return self.num_prompt_tokens + self._out + c._D - 1
        return self._hit

    @property
    def kv_token_seconds(self) -> float:
        c = self._core
        if c is None:
            return self._kvts
        return self._kvts + ((self.num_prompt_tokens + self._out) * (c._T - self._t0)
                             + (c._U - self._u0)) / 1000.0


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
        # For `run_coeffs`, every run (compiled, a msgspec Struct's field is a generic lookup).
        self._step_costs = (step_model.step_base_ms, step_model.step_per_seq_ms,
                            step_model.step_per_kv_token_ms, step_model.prefill_tokens_per_s)
        self.max_num_seqs = max_num_seqs or step_model.max_num_seqs
        self.block_size = step_model.kv_block_size_tokens
        total = kv_tokens_total or step_model.kv_tokens_total
        self.num_blocks_total = total // self.block_size
        if self.num_blocks_total < 1:
            raise ValueError("kv_tokens_total must hold at least one KV block")
        self.running: list[Seq] = []  # in admission order
        self._waiting: list[tuple[int, int, Seq]] = []  # heap; stale entries skipped
        self.num_waiting = 0
        self.free_blocks = self.num_blocks_total  # includes the prefix cache's blocks
        self.prefix_cache = PrefixCache()
        self._num_added = self._num_admitted = 0  # not itertools.count: next() is generic
        self.num_steps = 0
        self.num_preemptions = 0
        # Tokens prefilled again (a preempted sequence's or a continuation's prompt +
        # output) that the prefix cache no longer held, and those it did hold.
        self.num_recomputed_tokens = 0
        self.num_prefix_cache_hit_tokens = 0
        self.sim_time_s = 0.0
        self.steps: deque[StepRecord] = deque(maxlen=step_log_size)
        # What the last `schedule()` admitted and preempted (for drivers that report
        # per sequence only when it changes).
        self.last_admitted: list[Seq] = []
        self.last_preempted: list[Seq] = []
        # Cumulative counters (module docstring); reset whenever the batch empties.
        self._D, self._T, self._U = 0, 0.0, 0.0
        self._grown = False  # this step's KV growth is allocated (schedule ran)
        self._kv_off = 0
        self._res = [0] * self.block_size
        self._fin: list[tuple[int, int, int, Seq]] = []  # (finish _D, arrival, adm, seq)

    # --- queue ----------------------------------------------------------------------

    def add(self, seq: Seq) -> None:
        """A new sequence waits for a slot (ordered by priority, then arrival)."""
        seq.arrival, self._num_added = self._num_added, self._num_added + 1
        self._push_waiting(seq)

    def _push_waiting(self, seq: Seq) -> None:
        seq.state = SeqState.WAITING
        heappush(self._waiting, (seq.priority, seq.arrival, seq))
        self.num_waiting += 1

    def peek_waiting(self) -> Seq | None:
        while self._waiting and self._waiting[0][2].state is not SeqState.WAITING:
            heappop(self._waiting)  # stale: aborted while waiting
        return self._waiting[0][2] if self._waiting else None

    @property
    def kv_tokens_used(self) -> int:
        return (self.num_blocks_total - self.free_blocks) * self.block_size

    @property
    def kv_tokens_total(self) -> int:
        return self.num_blocks_total * self.block_size

    def max_seq_len(self, max_model_len: int | None) -> int:
        """The longest sequence it holds: max_model_len (None or 0: unset), never more
        than the whole cache (a longer one would evict itself forever)."""
        return min(max_model_len or self.kv_tokens_total, self.kv_tokens_total)

    @property
    def kv_tokens_in_use(self) -> int:
        """KV tokens the running sequences hold (prompt + output each)."""
        return self._kv_off + len(self.running) * self._D

    # --- one step -------------------------------------------------------------------

    def schedule(self) -> int:
        """Grow running sequences (preempting on KV exhaustion), then admit waiting
        ones. Returns the number of tokens to prefill in this step."""
        self.last_admitted = []  # a new list: a driver may hold on to the last one
        if self.last_preempted:
            self.last_preempted = []
        if self.grow() and self.running:
            return 0  # as vLLM: no admissions in a step that had to preempt
        prefill = 0
        while self.num_waiting and len(self.running) < self.max_num_seqs:
            head = self.peek_waiting()
            if head is None:
                break
            need = self.blocks_for(head)
            if need > self.free_blocks:
                break  # head-of-line: nothing behind it jumps ahead
            heappop(self._waiting)
            self.num_waiting -= 1
            prefill += self._admit(head, need)
        return prefill

    def grow(self) -> bool:
        """The first half of `schedule`: give each running sequence the KV blocks its
        next token needs, preempting (latest, lowest priority first) when they run
        out. True if it preempted."""
        if self._grown or not self.running:
            self._grown = True
            return False
        # A sequence needs a block now iff its length is a multiple of the block size.
        need = self._res[-self._D % self.block_size]
        if need <= self.free_blocks:
            if need:
                self._take_free_blocks(need)
            self._grown = True
            return False
        return self._grow_preempting()

    def _grow_preempting(self) -> bool:
        """`grow` when the blocks run out: sequence by sequence, highest priority
        first, evicting the lowest-priority latest one until each fits. A victim is
        never one that grew in this pass (it has the highest key still running), so
        `_grown` can stay False until the end."""
        bs = self.block_size
        for seq in sorted(self.running, key=lambda s: s.key):
            if seq.state is not _RUNNING:
                continue  # preempted earlier in this pass
            need = 1 if seq.num_kv_tokens % bs == 0 else 0
            while need > self.free_blocks:
                victim = max(self.running, key=lambda s: s.key)
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.state is _RUNNING and need:
                self._take_free_blocks(need)
        self._grown = True
        return True

    def step_ms(self, prefill_tokens: int) -> float:
        """Duration of the step about to run over the current batch."""
        kv_in_use = self.kv_tokens_in_use
        ms = self.step_model.step_ms(len(self.running), kv_in_use, prefill_tokens)
        self.steps.append(StepRecord(len(self.running), kv_in_use, prefill_tokens, ms))
        return ms

    def end_step(self, batch: list[Seq], step_ms: float) -> list[Seq]:
        """The step over `batch` (the running list when it began) ended: each of its
        sequences still running gets one token. Returns those (the driver decides
        which finished and `release`s them)."""
        self.advance_step(step_ms)
        out = [s for s in batch if s.state is _RUNNING]
        if len(out) != len(self.running):
            raise RuntimeError("end_step: the batch is not the running list of the step")
        return out

    def advance_step(self, step_ms: float) -> None:
        """`end_step` in O(1), for a driver that reads finishes from `pop_finished`."""
        self.num_steps += 1
        self.sim_time_s += step_ms / 1000.0
        self._T += step_ms
        self._U += self._D * step_ms
        self._D += 1
        self._grown = False

    def pop_finished(self) -> list[Seq]:
        """The running sequences that have all their tokens (still running: the
        driver releases them), in admission order."""
        fin, d = self._fin, self._D
        if not fin or fin[0][0] > d:
            return []
        out = []
        while fin and fin[0][0] <= d:
            _, _, adm, seq = heappop(fin)
            if seq.state is _RUNNING and seq.num_admissions == adm and seq._core is self:
                out.append(seq)
        if len(out) > 1:
            out.sort(key=lambda s: s.order)
        return out

    def _min_tokens_left(self) -> int:
        fin = self._fin
        while fin:
            _, _, adm, seq = fin[0]
            if seq.state is _RUNNING and seq.num_admissions == adm and seq._core is self:
                return fin[0][0] - self._D
            heappop(fin)  # stale: released or admitted again
        return 0

    # --- many steps at once (virtual time) ---------------------------------------------

    def steps_until_change(self) -> int:
        """How many steps from now (this step's `schedule()` already ran) can run with
        exactly this batch: no admission, no KV preemption, no finish before the last
        of them. 0: step one at a time. Sequences the driver must watch token by token
        (stop strings) must not be in a batch run this way."""
        if not self.running:
            return 0
        k = self._min_tokens_left()
        if k <= 1:
            return k
        head = self.peek_waiting()
        # An admission can only follow a finish (slots full) or freed blocks (KV-bound
        # head): neither happens inside the run, whose last step is the first finish.
        if head is not None and len(self.running) < self.max_num_seqs and (
                self.blocks_for(head) <= self.free_blocks):
            return 1
        # Growth within the run never takes more than one block per sequence per
        # `block_size` steps (+1): when even that fits, no need to count.
        if len(self.running) * (k // self.block_size + 1) <= self.free_blocks:
            return k
        while k > 1 and self._growth_blocks(k) > self.free_blocks:
            k //= 2  # growth would need a KV preemption inside the run
        return k

    def _growth_blocks(self, num_steps: int) -> int:
        """Blocks the running sequences take on over `num_steps` more steps' schedules
        (the first step's growth is already allocated if `schedule` ran): for each,
        the block boundaries its length crosses, counted from the residues."""
        g = int(self._grown)
        span = num_steps - g  # lengths x + g .. x + num_steps - 1 each start a block?
        if span <= 0:
            return 0
        bs, res = self.block_size, self._res
        full, rem = span // bs, span % bs  # not divmod: a builtin looked up per call
        n = full * len(self.running)
        if rem:
            # Residues r = -D-g-d (mod bs) for d < rem: one circular slice of `res`.
            lo = (-self._D - g - rem + 1) % bs
            hi = lo + rem
            n += sum(res[lo:hi]) if hi <= bs else sum(res[lo:]) + sum(res[:hi - bs])
        return n

    def run_coeffs(self, prefill_tokens: int) -> tuple[float, float, float]:
        """Step j (from 0) of a run over the current batch lasts a + b*j ms, plus the
        prefill in step 0: each step adds one KV token per sequence."""
        base_ms, per_seq_ms, per_kv_ms, prefill_per_s = self._step_costs
        n = len(self.running)
        a_ms = base_ms + per_seq_ms * n + per_kv_ms * (self._kv_off + n * self._D)
        return a_ms, per_kv_ms * n, prefill_ms(prefill_tokens, prefill_per_s) if prefill_tokens else 0.0

    def run_ms(self, num_steps: int, prefill_tokens: int) -> list[float]:
        """End times (ms from now) of each step of a run of `num_steps` (see run_steps)."""
        a_ms, b_ms, t = self.run_coeffs(prefill_tokens)
        out = []
        for j in range(num_steps):
            t += a_ms + b_ms * j
            out.append(t)
        return out

    def run_steps(self, num_steps: int, prefill_tokens: int) -> float:
        """Run `num_steps` steps over the current batch at once (the first includes
        `prefill_tokens`), as `num_steps` rounds of schedule/end_step would with no
        admission or KV preemption in between; returns their total ms. Every running
        sequence gets `num_steps` tokens; the driver releases the finished ones
        (`pop_finished`). O(block size), whatever the batch."""
        k = num_steps
        a_ms, b_ms, pre_ms = self.run_coeffs(prefill_tokens)
        s1, s2 = k * (k - 1) / 2, (k - 1) * k * (2 * k - 1) / 6  # sum j, sum j^2
        total_ms = a_ms * k + b_ms * s1 + pre_ms
        # The schedules before steps 2..k grow each sequence to cover P + O + k tokens.
        grow = self._growth_blocks(k)
        if grow > 0:
            self._take_free_blocks(grow)
        # A sequence holding c = P + _out + _D tokens at the start gains
        # sum_j (c + j) * (a + b j) + c * pre: c * dT + dU with these.
        self._U += self._D * total_ms + a_ms * s1 + b_ms * s2
        self._T += total_ms
        self._D += k
        self._grown = False
        self.num_steps += k
        self.sim_time_s += total_ms / 1000.0
        return total_ms

    # --- admission, release -------------------------------------------------------------

    def _admit(self, seq: Seq, need: int) -> int:
        """Move `seq` into the batch with `need` blocks; returns its prefill tokens."""
        num_tokens = seq.num_prompt_tokens + seq._out
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
            seq.refill_tokens = num_tokens - hit_tokens
            if seq.num_admissions == 0:  # the continuation's own re-prefill
                seq.num_recomputed_tokens = num_tokens - hit_tokens
                seq.num_cached_prompt_tokens = min(hit_tokens, seq.num_prompt_tokens)
        self._take_free_blocks(need)  # = blocks_for(seq): consistent with _grown
        seq.state = _RUNNING
        seq.num_admissions += 1
        # From now on relative to the counters (the Seq properties read them).
        off = seq._out - self._D
        seq._out, seq._core = off, self
        seq._t0, seq._u0, seq._d0, seq._hit = self._T, self._U, self._D, hit_tokens
        seq.order, self._num_admitted = self._num_admitted, self._num_admitted + 1
        x = seq.num_prompt_tokens + off
        self._kv_off += x
        self._res[x % self.block_size] += 1
        heappush(self._fin, (seq.target_output_tokens - off, seq.arrival,
                                   seq.num_admissions, seq))
        self.running.append(seq)
        self.last_admitted.append(seq)
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
        self.last_preempted.append(seq)
        log.debug("sim_preempted", request_id=seq.request_id, num_output_tokens=seq.num_output_tokens)

    def release(self, seq: Seq) -> None:
        """Take `seq` out of the batch / queue and free its KV blocks; its full
        computed blocks stay in the prefix cache (free, evictable) for a later run."""
        if seq.state is _RUNNING and seq._core is self:
            blocks, computed = seq.num_blocks, seq.num_kv_computed
            seq._kvts = seq.kv_token_seconds
            x = seq.num_prompt_tokens + seq._out
            seq._out += self._D
            seq._core = None
            self._kv_off -= x
            self._res[x % self.block_size] -= 1
            self.running.remove(seq)
            self.free_blocks += blocks
            self.prefix_cache.put(seq.cache_key, min(blocks, computed // self.block_size))
            if not self.running:
                self._rebase()
        elif seq.state is SeqState.WAITING:
            self.num_waiting -= 1  # its heap entry goes stale and is skipped
        seq.state = SeqState.FINISHED

    def _rebase(self) -> None:
        """Nothing runs: restart the counters at 0 (keeps the floats small)."""
        self._D, self._T, self._U = 0, 0.0, 0.0
        self._fin.clear()
