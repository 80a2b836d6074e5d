"""`SimEngine`: a simulator of continuous batching (DESIGN.md section 6).

This is a SIMULATOR. It runs no model; every token it emits is synthetic (text
``" tok<id>"``, pseudo-random ids) and its output is not model text. What it does
simulate faithfully is the scheduling physics of a vLLM-style engine, so that the
fleet's fairness and latency behave as they would on real GPUs:

- ``max_num_seqs`` batch slots; one engine loop task runs steps back to back and each
  running sequence emits one token per step;
- a paged KV cache (``kv_block_size_tokens``, ``kv_tokens_total``): a sequence holds
  ``ceil((prompt + output + 1) / block)`` blocks while running;
- a waiting queue ordered by ``WorkItem.engine_priority`` (lower first, vLLM's
  convention), then arrival; the head is admitted when a slot and its blocks are free
  (head-of-line: nothing behind it jumps ahead, as in vLLM);
- preemption when KV runs out: to grow a running sequence the engine evicts the
  lowest-priority / latest-arrived running sequence, recompute-style (its blocks are
  freed, it goes back to waiting with its original arrival, and later re-prefills
  prompt + tokens generated so far). Its stream just pauses; no tokens are repeated;
- step time from a `StepModel`: base + per-seq × batch + per-KV-token × KV in use,
  plus the prefill of prompts admitted in that step at ``prefill_tokens_per_s``;
- a prefix cache (`gpu_worker.sim.prefix_cache`), so a sequence re-admitted after a
  preemption, or resumed (``InferenceRequest.resume``, DESIGN.md 5b) under the same
  ``cache_salt``, re-prefills only the blocks evicted meanwhile. A continuation
  emits exactly the tokens the undisturbed run would have emitted after its prefix;
- ``sampling.stop`` strings (finish "stop"; the stop string is not returned).

``time_scale`` multiplies every sleep (1.0 = real time, 0.01 = 100× faster); the
accounting (``kv_token_seconds``) is always in simulated seconds.
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import itertools
import random
import zlib
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import structlog

from fairlane.protocol import EngineLoad, WorkItem
from fairlane.runtime import cancel_and_wait
from fairlane.validation import estimate_prompt_tokens
from gpu_worker.engine import EngineDead, EngineError, GenerationDelta, PromptTooLong
from gpu_worker.sim.prefix_cache import PrefixCache
from gpu_worker.sim.step_model import StepModel, load_step_model

log = structlog.get_logger(__name__)

SIM_VOCAB_SIZE = 32_000
DEFAULT_MEAN_OUTPUT_TOKENS = 128


class _State(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class _StopMatcher:
    """``sampling.stop`` over token texts: the output ends just before the earliest
    stop string (OpenAI semantics). A stop string can span tokens, so the last
    ``longest stop - 1`` characters are held back until the next token shows they do
    not begin one (as vLLM's detokenizer does). Only held text + new token is searched
    (an earlier match would have ended the stream): O(longest stop) per token.
    """

    __slots__ = ("stops", "hold_chars", "held")

    def __init__(self, stops: list[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.hold_chars = max(map(len, self.stops), default=1) - 1
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text that may be emitted now, whether a stop string was reached)."""
        buf = self.held + text
        hits = [i for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            self.held = ""
            return buf[: min(hits)], True
        cut = max(0, len(buf) - self.hold_chars)
        self.held = buf[cut:]
        return buf[:cut], False

    def flush(self) -> str:
        """The held-back text, when the stream ends for another reason: it is output."""
        held, self.held = self.held, ""
        return held


@dataclass(eq=False, slots=True)
class _Seq:
    request_id: str
    priority: int
    arrival: int
    num_prompt_tokens: int
    target_output_tokens: int
    finish_reason_at_target: str
    rng: random.Random
    cache_key: tuple[str, str]  # (cache salt, request id): its prefix-cache entry
    stop: _StopMatcher | None = None
    is_resume: bool = False
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    state: _State = _State.WAITING
    num_output_tokens: int = 0  # whole request: resumed-from tokens included
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

    def delta(self, **kw: object) -> GenerationDelta:
        return GenerationDelta(
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_prompt_tokens=self.num_cached_prompt_tokens,
            num_output_tokens=self.num_output_tokens,
            kv_token_seconds=self.kv_token_seconds,
            num_recomputed_tokens=self.num_recomputed_tokens,
            **kw,  # type: ignore[arg-type]
        )


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One simulated engine step, kept for tests and experiments."""

    num_running: int
    kv_tokens_in_use: int
    prefill_tokens: int
    step_ms: float


class SimEngine:
    """Simulator of a continuous-batching engine. Implements `gpu_worker.engine.Engine`."""

    def __init__(
        self,
        step_model: StepModel | str = "default",
        *,
        max_num_seqs: int | None = None,
        kv_tokens_total: int | None = None,
        max_model_len: int = 4096,
        time_scale: float = 1.0,
        mean_output_tokens: int = DEFAULT_MEAN_OUTPUT_TOKENS,
        fail_after_steps: int = 0,
        step_log_size: int = 10_000,
    ) -> None:
        self.step_model = load_step_model(step_model) if isinstance(step_model, str) else step_model
        self.max_num_seqs = max_num_seqs or self.step_model.max_num_seqs
        self.block_size = self.step_model.kv_block_size_tokens
        total = kv_tokens_total or self.step_model.kv_tokens_total
        self.num_blocks_total = total // self.block_size
        if self.num_blocks_total < 1:
            raise ValueError("kv_tokens_total must hold at least one KV block")
        kv_capacity = self.num_blocks_total * self.block_size
        self.max_model_len = max_model_len if max_model_len > 0 else kv_capacity  # 0: unset
        # A sequence can never hold more tokens than the whole cache (it would evict
        # itself forever), so the usable length is the smaller of the two.
        self.max_seq_len = min(self.max_model_len, kv_capacity)
        if time_scale < 0:
            raise ValueError("time_scale must be >= 0")
        self.time_scale = time_scale
        self.mean_output_tokens = max(1, mean_output_tokens)
        self.fail_after_steps = fail_after_steps  # test hook: simulated engine crash

        self._seqs: dict[str, _Seq] = {}
        self._running: list[_Seq] = []
        self._waiting: list[tuple[int, int, _Seq]] = []  # heap; stale entries skipped
        self._num_waiting = 0
        self._free_blocks = self.num_blocks_total  # includes the prefix cache's blocks
        self.prefix_cache = PrefixCache()
        self._arrivals = itertools.count()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._dead: BaseException | None = None
        self._closed = False

        self.num_steps = 0
        self.num_preemptions = 0
        # Tokens prefilled again (a preempted sequence's or a continuation's prompt +
        # output) that the prefix cache no longer held, and those it did hold.
        self.num_recomputed_tokens = 0
        self.num_prefix_cache_hit_tokens = 0
        self.sim_time_s = 0.0
        self.steps: deque[StepRecord] = deque(maxlen=step_log_size)

    @classmethod
    def from_settings(cls, settings: object) -> SimEngine:
        return cls(
            getattr(settings, "step_model", "default"),
            max_num_seqs=getattr(settings, "max_num_seqs", None),
            max_model_len=getattr(settings, "max_model_len", 4096),
            time_scale=getattr(settings, "time_scale", 1.0),
            kv_tokens_total=getattr(settings, "sim_kv_tokens_total", 0) or None,
            fail_after_steps=getattr(settings, "sim_fail_after_steps", 0),
        )

    # --- Engine protocol ----------------------------------------------------------

    async def start(self) -> None:
        self._check_alive()
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="sim-engine-loop")
            log.info(
                "sim_engine_started",
                step_model=self.step_model.name,
                step_model_measured=self.step_model.measured,
                max_num_seqs=self.max_num_seqs,
                kv_blocks_total=self.num_blocks_total,
                kv_block_size_tokens=self.block_size,
                max_model_len=self.max_model_len,
                time_scale=self.time_scale,
            )

    async def generate(self, item: WorkItem) -> AsyncIterator[GenerationDelta]:
        self._check_alive()
        if self._task is None:
            await self.start()
        seq = self._new_seq(item)
        if seq.num_output_tokens >= seq.target_output_tokens:
            # A continuation with nothing left to generate: it never takes a slot.
            yield seq.delta(finish_reason=seq.finish_reason_at_target)
            return
        self._seqs[seq.request_id] = seq
        self._push_waiting(seq)
        self._wakeup.set()
        try:
            while True:
                d = await seq.out.get()
                if isinstance(d, BaseException):
                    raise d
                yield d
                if d.finish_reason is not None:
                    return
        finally:
            # The consumer stopped early (cancelled, closed): free its slot and KV.
            if seq.state is not _State.FINISHED:
                self._finish(seq, None)
            if self._seqs.get(seq.request_id) is seq:
                del self._seqs[seq.request_id]

    async def abort(self, request_id: str) -> None:
        seq = self._seqs.get(request_id)
        if seq is not None and seq.state is not _State.FINISHED:
            self._finish(seq, "abort")

    def load(self) -> EngineLoad:
        """Current load. Raises EngineDead once the engine loop has crashed."""
        self._check_alive()
        used = self.num_blocks_total - self._free_blocks
        return EngineLoad(
            num_running=len(self._running),
            num_waiting=self._num_waiting,
            max_num_seqs=self.max_num_seqs,
            kv_tokens_used=used * self.block_size,
            kv_tokens_total=self.num_blocks_total * self.block_size,
        )

    async def close(self) -> None:
        self._closed = True
        for seq in list(self._seqs.values()):
            if seq.state is not _State.FINISHED:
                self._finish(seq, "abort")
        await cancel_and_wait(self._task)
        self._task = None

    # --- admission ----------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDead(f"simulator engine loop died: {self._dead!r}")
        if self._closed:
            raise EngineDead("simulator engine is closed")

    def _new_seq(self, item: WorkItem) -> _Seq:
        req = item.request
        if req.request_id in self._seqs:
            raise EngineError(f"request {req.request_id} is already in the engine")
        num_prompt = estimate_prompt_tokens(req)
        if num_prompt >= self.max_seq_len:
            raise PromptTooLong(
                f"prompt has {num_prompt} tokens; this engine (simulator) fits at most "
                f"{self.max_seq_len - 1} prompt tokens (max_model_len {self.max_model_len}, "
                f"KV cache {self.num_blocks_total * self.block_size} tokens)"
            )
        # Deterministic per request: the same seed (or id) always gives the same length
        # and tokens, so a continuation (same request) picks up the same stream.
        seed = req.sampling.seed
        if seed is None:
            seed = zlib.crc32(req.request_id.encode())
        rng = random.Random(seed)
        if req.expected_output_tokens is not None:
            natural = max(1, req.expected_output_tokens)
        else:
            natural = 1 + int(rng.expovariate(1.0 / self.mean_output_tokens))
        # max_tokens is the whole request's budget, a continuation's included.
        cap = max(1, min(req.sampling.max_tokens, self.max_seq_len - num_prompt))
        num_done = len(req.resume.generated_token_ids) if req.resume is not None else 0
        target = min(natural, cap)
        seq = _Seq(
            request_id=req.request_id,
            priority=item.engine_priority,
            arrival=next(self._arrivals),
            num_prompt_tokens=num_prompt,
            target_output_tokens=target,
            finish_reason_at_target="stop" if natural < cap and num_done < cap else "length",
            rng=rng,
            cache_key=(item.cache_salt or req.tenant, req.request_id),
            stop=_StopMatcher(req.sampling.stop) if any(req.sampling.stop) else None,
            is_resume=req.resume is not None,
            num_output_tokens=num_done,
        )
        if num_done < target:
            for _ in range(num_done):  # skip the tokens the client already has
                rng.randrange(SIM_VOCAB_SIZE)
        return seq

    def _push_waiting(self, seq: _Seq) -> None:
        seq.state = _State.WAITING
        heapq.heappush(self._waiting, (seq.priority, seq.arrival, seq))
        self._num_waiting += 1

    def _peek_waiting(self) -> _Seq | None:
        while self._waiting and self._waiting[0][2].state is not _State.WAITING:
            heapq.heappop(self._waiting)  # stale: aborted while waiting
        return self._waiting[0][2] if self._waiting else None

    # --- the engine loop ------------------------------------------------------------

    async def _loop(self) -> None:
        try:
            while True:
                prefill_tokens = self._schedule()
                if not self._running:
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                batch = list(self._running)
                kv_in_use = sum(s.num_kv_tokens for s in batch)
                step_ms = self.step_model.step_ms(len(batch), kv_in_use, prefill_tokens)
                self.steps.append(StepRecord(len(batch), kv_in_use, prefill_tokens, step_ms))
                await asyncio.sleep(step_ms / 1000.0 * self.time_scale)
                self.num_steps += 1
                self.sim_time_s += step_ms / 1000.0
                if self.fail_after_steps and self.num_steps >= self.fail_after_steps:
                    raise RuntimeError(f"simulated engine failure after {self.num_steps} steps")
                for seq in batch:
                    if seq.state is _State.RUNNING:  # not aborted during the step
                        seq.kv_token_seconds += seq.num_kv_tokens * step_ms / 1000.0
                        self._emit_token(seq)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._dead = exc
            log.error("sim_engine_loop_crashed", error=repr(exc))
            dead = EngineDead(f"simulator engine loop died: {exc!r}")
            for seq in list(self._seqs.values()):
                if seq.state is not _State.FINISHED:
                    self._release(seq)
                    seq.out.put_nowait(dead)

    def _schedule(self) -> int:
        """Grow running sequences (preempting on KV exhaustion), then admit waiting
        ones. Returns the number of tokens to prefill in this step."""
        preempted = False
        for seq in sorted(self._running, key=lambda s: s.key):
            if seq.state is not _State.RUNNING:
                continue  # preempted earlier in this pass
            need = self._blocks_for(seq) - seq.num_blocks
            while need > self._free_blocks:
                victim = max(self._running, key=lambda s: s.key)
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.state is _State.RUNNING and need > 0:
                seq.num_blocks += need
                self._take_free_blocks(need)
        if preempted and self._running:
            return 0  # as vLLM: no admissions in a step that had to preempt
        prefill = 0
        while len(self._running) < self.max_num_seqs:
            head = self._peek_waiting()
            if head is None:
                break
            need = self._blocks_for(head)
            if need > self._free_blocks:
                break  # head-of-line: nothing behind it jumps ahead
            heapq.heappop(self._waiting)
            self._num_waiting -= 1
            prefill += self._admit(head, need)
        return prefill

    def _admit(self, seq: _Seq, need: int) -> int:
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
        seq.state = _State.RUNNING
        seq.num_blocks = need
        seq.num_kv_computed = hit_tokens
        seq.num_admissions += 1
        self._running.append(seq)
        return num_tokens - hit_tokens

    def _take_free_blocks(self, n: int) -> None:
        """Allocate `n` of the free blocks, evicting cached ones only when the
        uncached free blocks do not suffice (the caller checked n <= free)."""
        shortfall = n - (self._free_blocks - self.prefix_cache.num_blocks)
        if shortfall > 0:
            self.prefix_cache.evict(shortfall)
        self._free_blocks -= n

    def _blocks_for(self, seq: _Seq) -> int:
        return -(-(seq.num_prompt_tokens + seq.num_output_tokens + 1) // self.block_size)

    def _preempt(self, seq: _Seq) -> None:
        self._release(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._push_waiting(seq)
        log.debug("sim_preempted", request_id=seq.request_id, num_output_tokens=seq.num_output_tokens)

    def _release(self, seq: _Seq) -> None:
        """Take `seq` out of the batch / queue and free its KV blocks; its full
        computed blocks stay in the prefix cache (free, evictable) for a later run."""
        if seq.state is _State.RUNNING:
            self._running.remove(seq)
        elif seq.state is _State.WAITING:
            self._num_waiting -= 1  # its heap entry goes stale and is skipped
        if seq.num_blocks:
            self._free_blocks += seq.num_blocks
            full_blocks = min(seq.num_blocks, seq.num_kv_computed // self.block_size)
            self.prefix_cache.put(seq.cache_key, full_blocks)
        seq.num_blocks = 0
        seq.num_kv_computed = 0
        seq.state = _State.FINISHED

    def _emit_token(self, seq: _Seq) -> None:
        seq.num_output_tokens += 1
        # The step fed the previously sampled token, so all but the new one have KV.
        seq.num_kv_computed = seq.num_prompt_tokens + seq.num_output_tokens - 1
        token_id = seq.rng.randrange(SIM_VOCAB_SIZE)
        text, finish = f" tok{token_id}", None
        if seq.stop is not None:
            text, stopped = seq.stop.feed(text)
            if stopped:
                finish = "stop"
        if finish is None and seq.num_output_tokens >= seq.target_output_tokens:
            finish = seq.finish_reason_at_target
            text += seq.stop.flush() if seq.stop is not None else ""
        if finish is None:
            seq.out.put_nowait(seq.delta(text=text, token_ids=[token_id]))
            return
        self._release(seq)
        seq.out.put_nowait(seq.delta(text=text, token_ids=[token_id], finish_reason=finish))

    def _finish(self, seq: _Seq, finish_reason: str | None) -> None:
        self._release(seq)
        if finish_reason is not None:
            # Text held back for a possible stop string belongs to tokens already
            # emitted (a continuation starts after them): it goes out now.
            held = seq.stop.flush() if seq.stop is not None else ""
            seq.out.put_nowait(seq.delta(text=held, finish_reason=finish_reason))
