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
accounting (``kv_token_seconds``) is always in simulated seconds. Steps keep to the
model's clock: each sleeps until its due end, and a late wake-up (the worker's loop
busy) is taken out of the next step, up to one step's lateness.
"""

from __future__ import annotations

import asyncio
import random
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import structlog

from fairlane.protocol import EngineLoad, WorkItem
from fairlane.runtime import cancel_and_wait
from fairlane.validation import estimate_prompt_tokens
from gpu_worker.engine import EngineDead, EngineError, GenerationDelta, PromptTooLong
from gpu_worker.sim.batch import BatchCore, Seq, SeqState, StepRecord
from gpu_worker.sim.step_model import StepModel, load_step_model

log = structlog.get_logger(__name__)

SIM_VOCAB_SIZE = 32_000
DEFAULT_MEAN_OUTPUT_TOKENS = 128


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
class _Stream:
    """What the engine keeps per sequence beyond the batch physics (`Seq.owner`)."""

    rng: random.Random
    finish_reason_at_target: str
    stop: _StopMatcher | None = None
    out: asyncio.Queue = field(default_factory=asyncio.Queue)


def _delta(seq: Seq, **kw: object) -> GenerationDelta:
    return GenerationDelta(
        num_prompt_tokens=seq.num_prompt_tokens,
        num_cached_prompt_tokens=seq.num_cached_prompt_tokens,
        num_output_tokens=seq.num_output_tokens,
        kv_token_seconds=seq.kv_token_seconds,
        num_recomputed_tokens=seq.num_recomputed_tokens,
        **kw,  # type: ignore[arg-type]
    )


class _SeqStream:
    """One request's deltas (`SimEngine.generate`): an async iterator whose `aclose`
    frees the sequence even if it was never iterated (the request was admitted when
    the stream was made, unlike an async generator's body, which runs on first use)."""

    __slots__ = ("engine", "seq", "done", "empty")

    def __init__(self, engine: SimEngine, seq: Seq, *, empty: bool) -> None:
        self.engine, self.seq, self.done = engine, seq, False
        self.empty = empty  # a continuation with nothing left: never took a slot

    def __aiter__(self) -> _SeqStream:
        return self

    async def __anext__(self) -> GenerationDelta:
        if self.done:
            raise StopAsyncIteration
        stream: _Stream = self.seq.owner
        if self.empty:
            self.done = True
            self.seq.state = SeqState.FINISHED
            return _delta(self.seq, finish_reason=stream.finish_reason_at_target)
        d = await stream.out.get()
        if isinstance(d, BaseException):
            await self.aclose()
            raise d
        if d.finish_reason is not None:
            await self.aclose()
        return d

    async def aclose(self) -> None:
        if not self.done:
            self.done = True
            self.engine._forget(self.seq)


__all__ = ["SimEngine", "StepRecord"]


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
        # The batch physics (slots, KV, queue, prefix cache), shared with the fleet
        # simulator; this class adds streams, token texts and (scaled) real time.
        self.core = BatchCore(self.step_model, max_num_seqs=max_num_seqs,
                              kv_tokens_total=kv_tokens_total, step_log_size=step_log_size)
        self.max_num_seqs = self.core.max_num_seqs
        self.block_size = self.core.block_size
        self.num_blocks_total = self.core.num_blocks_total
        # 0: unset (the cache bounds a sequence)
        self.max_model_len = max_model_len if max_model_len > 0 else self.core.kv_tokens_total
        self.max_seq_len = self.core.max_seq_len(max_model_len)
        if time_scale < 0:
            raise ValueError("time_scale must be >= 0")
        self.time_scale = time_scale
        self.mean_output_tokens = max(1, mean_output_tokens)
        self.fail_after_steps = fail_after_steps  # test hook: simulated engine crash

        self._seqs: dict[str, Seq] = {}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._dead: BaseException | None = None
        self._closed = False

    # The counters tests, metrics and experiments read live in the core.
    num_steps = property(lambda self: self.core.num_steps)
    num_preemptions = property(lambda self: self.core.num_preemptions)
    num_recomputed_tokens = property(lambda self: self.core.num_recomputed_tokens)
    num_prefix_cache_hit_tokens = property(lambda self: self.core.num_prefix_cache_hit_tokens)
    # Only a re-prefill looks the cache up: what it found + what it computed again.
    num_prefix_cache_queried_tokens = property(
        lambda self: self.core.num_prefix_cache_hit_tokens + self.core.num_recomputed_tokens)
    sim_time_s = property(lambda self: self.core.sim_time_s)
    steps = property(lambda self: self.core.steps)
    prefix_cache = property(lambda self: self.core.prefix_cache)

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
            self._start_loop()

    def _start_loop(self) -> None:
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

    def generate(self, item: WorkItem) -> AsyncIterator[GenerationDelta]:
        """Admit `item` now (it is in the engine's queue when this returns) and return
        its stream. Admission is synchronous on purpose: a real engine takes a request
        between two steps whenever it arrives (vLLM's engine core runs in its own
        process), so the worker's event loop being busy for a moment (flushing a
        step's tokens) must not make a request miss the next step boundary here."""
        self._check_alive()
        if self._task is None:
            self._start_loop()
        seq = self._new_seq(item)  # raises PromptTooLong before anything is taken
        empty = seq.num_output_tokens >= seq.target_output_tokens
        if not empty:
            self._seqs[seq.request_id] = seq
            self.core.add(seq)
            self._wakeup.set()
        return _SeqStream(self, seq, empty=empty)

    def _forget(self, seq: Seq) -> None:
        """The stream of `seq` is done or its consumer went away: free its slot and KV."""
        if seq.state is not SeqState.FINISHED:
            self._finish(seq, None)
        if self._seqs.get(seq.request_id) is seq:
            del self._seqs[seq.request_id]

    async def abort(self, request_id: str) -> None:
        seq = self._seqs.get(request_id)
        if seq is not None and seq.state is not SeqState.FINISHED:
            self._finish(seq, "abort")

    def load(self) -> EngineLoad:
        """Current load. Raises EngineDead once the engine loop has crashed."""
        self._check_alive()
        return EngineLoad(
            num_running=len(self.core.running),
            num_waiting=self.core.num_waiting,
            max_num_seqs=self.max_num_seqs,
            kv_tokens_used=self.core.kv_tokens_used,
            kv_tokens_total=self.core.kv_tokens_total,
        )

    async def close(self) -> None:
        self._closed = True
        for seq in list(self._seqs.values()):
            if seq.state is not SeqState.FINISHED:
                self._finish(seq, "abort")
        await cancel_and_wait(self._task)
        self._task = None

    # --- admission ----------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDead(f"simulator engine loop died: {self._dead!r}")
        if self._closed:
            raise EngineDead("simulator engine is closed")

    def _new_seq(self, item: WorkItem) -> Seq:
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
        seq = Seq(
            request_id=req.request_id,
            priority=item.engine_priority,
            num_prompt_tokens=num_prompt,
            target_output_tokens=target,
            cache_key=(item.cache_salt or req.tenant, req.request_id),
            is_resume=req.resume is not None,
            num_output_tokens=num_done,
            owner=_Stream(
                rng=rng,
                finish_reason_at_target="stop" if natural < cap and num_done < cap else "length",
                stop=_StopMatcher(req.sampling.stop) if any(req.sampling.stop) else None,
            ),
        )
        if num_done < target:
            for _ in range(num_done):  # skip the tokens the client already has
                rng.randrange(SIM_VOCAB_SIZE)
        return seq

    # --- the engine loop ------------------------------------------------------------

    async def _loop(self) -> None:
        core = self.core
        clock = asyncio.get_running_loop().time
        step_start_s = clock()
        try:
            while True:
                prefill_tokens = core.schedule()
                if not core.running:
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    step_start_s = clock()
                    continue
                batch = list(core.running)
                step_ms = core.step_ms(prefill_tokens)
                # Until the step's end, not for its length: the step model's time is the
                # whole step, so handing out the last step's tokens and scheduling this
                # one happen within it (sleeping the full length after that work made
                # the fleet's workers 4-16% slower than their model).
                step_end_s = step_start_s + step_ms / 1000.0 * self.time_scale
                await asyncio.sleep(max(0.0, step_end_s - clock()))
                # The next step starts where this one should have ended: a late wake-up
                # (the loop busy publishing, timer slack) is taken out of the next step,
                # as a GPU's steps do not slow down with the host's event loop. Late
                # wake-ups alone kept the fleet's simulated workers 3-4% slower than
                # their model (bench/fidelity.py: TPOT 13.7-13.8 ms against 13.2-13.3).
                # A stall longer than the step itself (a starved process) is not caught
                # up: the engine restarts from now rather than racing through steps.
                now_s = clock()
                step_start_s = step_end_s if now_s - step_end_s <= step_end_s - step_start_s \
                    else now_s
                if self.fail_after_steps and core.num_steps + 1 >= self.fail_after_steps:
                    raise RuntimeError(
                        f"simulated engine failure after {core.num_steps + 1} steps")
                for seq in core.end_step(batch, step_ms):
                    self._emit_token(seq)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._dead = exc
            log.error("sim_engine_loop_crashed", error=repr(exc))
            dead = EngineDead(f"simulator engine loop died: {exc!r}")
            for seq in list(self._seqs.values()):
                if seq.state is not SeqState.FINISHED:
                    core.release(seq)
                    seq.owner.out.put_nowait(dead)

    def _emit_token(self, seq: Seq) -> None:
        """`seq` just got a token (BatchCore.end_step): its text, and maybe its end."""
        stream: _Stream = seq.owner
        token_id = stream.rng.randrange(SIM_VOCAB_SIZE)
        text, finish = f" tok{token_id}", None
        if stream.stop is not None:
            text, stopped = stream.stop.feed(text)
            if stopped:
                finish = "stop"
        if finish is None and seq.num_output_tokens >= seq.target_output_tokens:
            finish = stream.finish_reason_at_target
            text += stream.stop.flush() if stream.stop is not None else ""
        if finish is None:
            stream.out.put_nowait(_delta(seq, text=text, token_ids=[token_id]))
            return
        self.core.release(seq)
        stream.out.put_nowait(_delta(seq, text=text, token_ids=[token_id], finish_reason=finish))

    def _finish(self, seq: Seq, finish_reason: str | None) -> None:
        self.core.release(seq)
        if finish_reason is not None:
            # Text held back for a possible stop string belongs to tokens already
            # emitted (a continuation starts after them): it goes out now.
            stream: _Stream = seq.owner
            held = stream.stop.flush() if stream.stop is not None else ""
            stream.out.put_nowait(_delta(seq, text=held, finish_reason=finish_reason))
