"""`VllmEngine`: the `Engine` protocol on vLLM v1's `AsyncLLM` (DESIGN.md section 6).

What the adapter adds on top of vLLM:

* DELTA streaming (`RequestOutputKind.DELTA`): each `GenerationDelta` carries only new
  text and token ids; the last one has `finish_reason` and the accounting fields.
* `WorkItem.engine_priority` -> vLLM `priority` (lower runs first); the engine is
  started with `scheduling_policy="priority"` so the waiting queue honours it.
* Eager submission: `generate()` hands the request to vLLM (`AsyncLLM.add_request`)
  in a task of its own before it returns, and `abort()` waits for submissions begun
  before it, so a preemption's replacement is in vLLM's waiting queue before the
  victim's slot frees (`gpu_worker.vllm_request.VllmStream`).
* Per-tenant `cache_salt` (on by default): ``item.cache_salt or tenant`` goes into the
  prompt dict, so a prefix-cache hit never crosses tenants (one tenant cannot probe
  another's prompts through TTFT). Turn it off for a single-tenant pool.
* Usage: prompt / cached prompt / output tokens from vLLM's outputs; TTFT and
  KV-token-seconds measured here (see `_Accounting`).
* Resumable generation (DESIGN.md 5b): a continuation is submitted as token ids,
  the original prompt's (tokenized as a fresh request is) + the already generated
  ones, under the same cache salt, so vLLM's prefix cache (on by default) serves
  what it still holds; see `_resume_prompt`.
* `load()` and the engine counters the worker's /metrics read (``num_preemptions``,
  ``num_prefix_cache_*_tokens``, ``num_recomputed_tokens``, ``steps``): vLLM's own
  statistics, through a custom stat logger (`gpu_worker.vllm_stats`).

vLLM is imported lazily so that this module (and `gpu_worker.engines`) imports on
machines without vLLM; only `start()` needs it.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fairlane.protocol import EngineLoad, ErrorCode, WorkItem
from gpu_worker.chat_template import render_chat
from gpu_worker.engine import EngineDead, EngineError, GenerationDelta, PromptTooLong
from gpu_worker.vllm_request import Accounting, VllmStream
from gpu_worker.vllm_stats import VllmStatsTap


@dataclass(slots=True)
class VllmEngineConfig:
    model: str
    max_num_seqs: int = 256
    max_model_len: int | None = None  # None: the model's own limit
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    enforce_eager: bool = False
    load_format: str = "auto"  # "dummy": random weights (tests, calibration)
    skip_tokenizer_init: bool = False  # then only prompt_token_ids are accepted
    tenant_cache_salt: bool = True
    scheduling_policy: str = "priority"
    enable_prefix_caching: bool = True
    # CPU build only: KV cache size in GiB (vLLM reads VLLM_CPU_KVCACHE_SPACE).
    kv_cache_space_gib: float | None = None
    seed: int = 0


# How long an abort waits for submissions begun before it (see `VllmEngine.abort`):
# they take a tokenization, milliseconds; bounded so no abort hangs on a stuck one.
SUBMISSION_WAIT_S = 1.0


class VllmEngine:
    def __init__(self, config: VllmEngineConfig) -> None:
        self.config = config
        self._llm: Any = None
        self._start_lock = asyncio.Lock()
        self._tap = VllmStatsTap()
        self._inflight: dict[str, Accounting] = {}
        self._tokenizer: Any = None
        self._max_model_len = config.max_model_len or 0
        self._kv_tokens_total = 0

    @classmethod
    def from_settings(cls, settings: Any) -> VllmEngine:
        """Build from `gpu_worker.config.WorkerSettings` (or anything with those names)."""
        defaults = VllmEngineConfig(model="")
        kwargs = {
            name: getattr(settings, name, getattr(defaults, name))
            for name in VllmEngineConfig.__slots__
        }
        if not kwargs["model"]:
            raise ValueError("VllmEngine needs settings.model (a model name or path)")
        kwargs["max_model_len"] = kwargs["max_model_len"] or None  # 0 / "" mean unset
        return cls(VllmEngineConfig(**kwargs))

    # --- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        async with self._start_lock:
            if self._llm is not None:
                return
            cfg = self.config
            if cfg.kv_cache_space_gib is not None:
                # Read by the engine-core process it spawns; integer GiB.
                os.environ.setdefault(
                    "VLLM_CPU_KVCACHE_SPACE", str(max(1, round(cfg.kv_cache_space_gib)))
                )
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            args = AsyncEngineArgs(
                model=cfg.model,
                tokenizer=None if cfg.skip_tokenizer_init else cfg.model,
                max_num_seqs=cfg.max_num_seqs,
                max_model_len=cfg.max_model_len,
                gpu_memory_utilization=cfg.gpu_memory_utilization,
                tensor_parallel_size=cfg.tensor_parallel_size,
                dtype=cfg.dtype,
                enforce_eager=cfg.enforce_eager,
                load_format=cfg.load_format,
                skip_tokenizer_init=cfg.skip_tokenizer_init,
                scheduling_policy=cfg.scheduling_policy,
                enable_prefix_caching=cfg.enable_prefix_caching,
                seed=cfg.seed,
                # Default loggers off (they print every 5 s); our tap still gets stats,
                # each step's elapsed time included (`gpu_worker.vllm_stats`).
                disable_log_stats=True,
                enable_logging_iteration_details=True,
            )
            # Building the engine takes seconds to minutes (model load, KV profiling,
            # maybe compilation); keep the event loop (heartbeats) alive meanwhile.
            llm = await asyncio.to_thread(
                AsyncLLM.from_engine_args, args, stat_loggers=[self._tap.factory]
            )
            self._llm = llm
            self._max_model_len = llm.model_config.max_model_len
            cache = llm.vllm_config.cache_config
            self._kv_tokens_total = int((cache.num_gpu_blocks or 0) * cache.block_size)
            if not cfg.skip_tokenizer_init:
                self._tokenizer = llm.tokenizer

    async def close(self) -> None:
        llm, self._llm = self._llm, None
        if llm is None:
            return
        # Stop the output handler first: otherwise it sees the engine core go away
        # during shutdown and logs a spurious EngineDeadError traceback.
        handler = getattr(llm, "output_handler", None)
        if handler is not None:
            handler.cancel()
            await asyncio.gather(handler, return_exceptions=True)
        await asyncio.to_thread(llm.shutdown)
        # AsyncLLM.__del__ calls shutdown() again, possibly at interpreter exit when
        # vLLM's module globals are already None (a noisy TypeError); once is enough.
        llm.shutdown = lambda *args, **kwargs: None

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def kv_tokens_total(self) -> int:
        return self._kv_tokens_total

    # vLLM's own figures, for the worker's /metrics (`gpu_worker.metrics`).
    num_preemptions = property(lambda self: self._tap.num_preemptions)
    num_recomputed_tokens = property(lambda self: self._tap.num_recomputed_tokens)
    num_prefix_cache_hit_tokens = property(lambda self: self._tap.num_prefix_cache_hit_tokens)
    num_prefix_cache_queried_tokens = property(
        lambda self: self._tap.num_prefix_cache_queried_tokens)
    steps = property(lambda self: self._tap.steps)

    # --- load -----------------------------------------------------------------------

    def load(self) -> EngineLoad:
        """Running/waiting from vLLM's scheduler stats, bounded by what we have in flight.

        Requests we submitted that the scheduler has not reported yet count as
        waiting (that is what they are for pull headroom). With nothing in flight the
        engine is idle whatever the last (stale) stats said. Raises EngineDead once
        vLLM's engine core is gone, so the worker notices even when idle.
        """
        if self._llm is not None and self._llm.errored:
            raise EngineDead("vLLM engine is dead")
        num_inflight = len(self._inflight)
        if num_inflight == 0:
            return EngineLoad(
                max_num_seqs=self.config.max_num_seqs, kv_tokens_total=self._kv_tokens_total
            )
        num_running = min(self._tap.num_running, num_inflight)
        kv_used = round(self._tap.kv_cache_usage * self._kv_tokens_total)
        if not self._tap.updated_at:  # no stats yet: our own per-sequence estimate
            kv_used = sum(acc.kv_tokens for acc in self._inflight.values())
        return EngineLoad(
            num_running=num_running,
            num_waiting=num_inflight - num_running,
            max_num_seqs=self.config.max_num_seqs,
            kv_tokens_used=min(kv_used, self._kv_tokens_total),
            kv_tokens_total=self._kv_tokens_total,
        )

    # --- requests -------------------------------------------------------------------

    async def abort(self, request_id: str) -> None:
        """Abort by our (external) id; vLLM maps it to its suffixed internal ids and
        the request's stream ends with finish_reason "abort".

        An abort never overtakes a submission begun before it: the worker hands a
        preemption's replacement to the engine and then aborts the victim, and vLLM
        must see them in that order, or its next step gives the freed slot to work
        that was waiting already (`Worker._on_preempt`).
        """
        acc = self._inflight.get(request_id)
        if self._llm is not None and acc is not None:
            await self._abort_in_vllm(self._llm, request_id, acc)

    async def _abort_in_vllm(self, llm: Any, request_id: str, acc: Accounting) -> None:
        """Every abort the adapter sends goes through here: `abort()`, a stream closed
        early, an abort that raced its own request's submission.

        It first waits (bounded) for the submissions of other requests under way. vLLM's
        engine core frees an aborted slot at once, mid-step, but admits a new request
        only between steps; an abort that overtook a preemption's replacement gave the
        freed slot to work already waiting (measured: bench/preemption_vllm.py, B's slow
        probes, vLLM freeing the victim's slot 10-20 ms before the replacement arrived).
        """
        others = [a.submission for a in self._inflight.values()
                  if a is not acc and a.submission is not None and not a.submission.done()]
        if others:
            await asyncio.wait(others, timeout=SUBMISSION_WAIT_S)
        if acc.submission is not None and not acc.submission.done():
            # Its own submission is still under way (a continuation being tokenized, a
            # prompt in vLLM's input processing): vLLM may not know the request yet
            # and drop this abort. The submission or the stream honours the flag. Set
            # only here: a stream seeing it aborts on its own, and while this waited
            # above that abort would have overtaken those submissions.
            acc.abort_requested = True
        await llm.abort(request_id)

    def generate(self, item: WorkItem) -> AsyncIterator[GenerationDelta]:
        """Check `item`, then submit it to vLLM at once (a task, so before the request's
        own task first runs) and return its stream. A request the adapter can refuse
        on its own (prompt too long, bad parameters) raises here."""
        llm = self._llm
        if llm is None:
            raise EngineError("engine not started")
        if llm.errored:
            raise EngineDead("vLLM engine is dead")
        req = item.request
        prompt, tokenization_kwargs = self._build_prompt(item)
        resumed = req.resume.generated_token_ids if req.resume is not None else None
        params = self._sampling_params(item, len(resumed or ()))
        request_id = req.request_id
        if request_id in self._inflight:
            raise EngineError(f"request {request_id} is already running", ErrorCode.INVALID_REQUEST)
        acc = Accounting(None if resumed is None else len(resumed))
        self._inflight[request_id] = acc
        acc.submission = asyncio.get_running_loop().create_task(
            self._submit(llm, item, acc, prompt, tokenization_kwargs, params, resumed),
            name=f"vllm-submit-{request_id}",
        )
        return VllmStream(self._outputs(llm, request_id, acc),
                          lambda: self._release(llm, request_id, acc, finished=False))

    async def _submit(self, llm: Any, item: WorkItem, acc: Accounting, prompt: dict[str, Any],
                      tokenization_kwargs: dict[str, Any] | None, params: Any,
                      resumed: list[int] | None) -> Any:
        """Hand the request to vLLM: its output collector, or None when it ended without
        vLLM (`acc.early_finish` says how)."""
        if resumed is not None:
            prompt, acc.num_prompt = await self._resume_prompt(prompt, tokenization_kwargs,
                                                               resumed)
            tokenization_kwargs = None
            total = acc.num_prompt + len(resumed)
            # max_tokens is the whole request's budget; the model's length caps the
            # undisturbed run too (vLLM ends it with "length" there).
            if params is None or (self._max_model_len and total >= self._max_model_len):
                acc.early_finish = "length"
                return None
        if acc.abort_requested:  # aborted before vLLM knew the request
            acc.early_finish = "abort"
            return None
        return await llm.add_request(item.request.request_id, prompt, params,
                                     priority=item.engine_priority,
                                     tokenization_kwargs=tokenization_kwargs)

    async def _outputs(self, llm: Any, request_id: str,
                       acc: Accounting) -> AsyncIterator[GenerationDelta]:
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError

        assert acc.submission is not None
        finished = False
        try:
            # Shielded: a consumer cancelled here must not cancel the submission
            # half-way; `_release` waits for it and takes the request back out.
            queue = await asyncio.shield(acc.submission)
            if queue is None:
                finished = True
                yield acc.delta(finish_reason=acc.early_finish)
                return
            resumed = acc.num_resumed
            while True:
                # As AsyncLLM.generate: drain without a task switch when output is ready.
                out = queue.get_nowait() or await queue.get()
                if acc.abort_requested and not out.finished:  # reached vLLM after the abort
                    acc.abort_requested = False
                    await self._abort_in_vllm(llm, request_id, acc)
                now = time.monotonic()
                if not acc.num_prompt and out.prompt_token_ids:
                    acc.num_prompt = len(out.prompt_token_ids)
                if out.num_cached_tokens:
                    acc.num_cached = out.num_cached_tokens
                comp = out.outputs[0] if out.outputs else None
                token_ids = list(comp.token_ids) if comp is not None else []
                if resumed is not None and not acc.last_t:  # a continuation's prefill
                    self._tap.add_recomputed(acc.num_prompt + resumed - acc.num_cached)
                acc.on_output(len(token_ids), now)
                finish = comp.finish_reason if comp is not None else None
                if finish is None and out.finished:
                    finish = "abort"
                text = (comp.text or "") if comp is not None else ""
                if not token_ids and not text and finish is None:
                    continue
                finished = finish is not None
                yield acc.delta(text=text, token_ids=token_ids, finish_reason=finish)
                if finished:
                    return
        except EngineDeadError as exc:
            raise EngineDead(f"vLLM engine died: {exc}") from exc
        except EngineError:
            raise
        except (VLLMClientError, ValueError) as exc:  # the request's fault
            raise self._map_validation_error(exc) from exc
        except Exception as exc:
            if llm.errored:
                raise EngineDead(f"vLLM engine died: {exc}") from exc
            raise EngineError(f"vLLM failed the request: {exc!r}") from exc
        finally:
            await self._release(llm, request_id, acc, finished=finished)

    async def _release(self, llm: Any, request_id: str, acc: Accounting, *,
                       finished: bool) -> None:
        """The request's stream is done or its consumer went away: take it out of vLLM
        (now, not when vLLM's collector is garbage-collected) and forget it."""
        sub = acc.submission
        try:
            if sub is not None:
                if not sub.done():
                    await asyncio.wait([sub])
                queue = None if sub.cancelled() or sub.exception() else sub.result()
                if queue is not None:
                    if not finished and not llm.errored:
                        try:
                            await self._abort_in_vllm(llm, request_id, acc)
                        except Exception:  # noqa: BLE001 - best effort on the way out
                            pass
                    queue.close()
        finally:
            # Only now: vLLM aborts by external id, so a continuation of this request
            # must not be submitted (it is refused as "already running") before the
            # abort above is through, or that abort would hit it too.
            if self._inflight.get(request_id) is acc:
                del self._inflight[request_id]

    # --- helpers --------------------------------------------------------------------

    def _build_prompt(self, item: WorkItem) -> tuple[dict[str, Any], dict[str, Any] | None]:
        # Which prompt form is set was checked before publishing and again by the
        # dispatcher (`fairlane.validation.check_request`); the guards below only keep
        # the engine from crashing on a request that skipped both.
        req = item.request
        tokenization_kwargs = None
        if req.prompt_token_ids is not None:
            ids = req.prompt_token_ids
            if not ids:
                raise EngineError("prompt_token_ids is empty", ErrorCode.INVALID_REQUEST)
            self._check_prompt_len(len(ids))
            prompt: dict[str, Any] = {"prompt_token_ids": list(ids)}
        elif self.config.skip_tokenizer_init:
            raise EngineError(
                "this pool runs without a tokenizer (skip_tokenizer_init): "
                "send prompt_token_ids, not prompt or messages",
                ErrorCode.INVALID_REQUEST,
            )
        elif req.messages is not None:
            if not req.messages:
                raise EngineError("messages is empty", ErrorCode.INVALID_REQUEST)
            prompt = {"prompt": render_chat(self._tokenizer, req.messages)}
            # The template already placed any BOS / special tokens.
            tokenization_kwargs = {"add_special_tokens": False}
        else:
            if not req.prompt:
                raise EngineError("prompt is empty", ErrorCode.INVALID_REQUEST)
            prompt = {"prompt": req.prompt}
        if self.config.tenant_cache_salt:
            prompt["cache_salt"] = item.cache_salt or req.tenant
        return prompt, tokenization_kwargs

    async def _resume_prompt(
        self,
        prompt: dict[str, Any],
        tokenization_kwargs: dict[str, Any] | None,
        generated_token_ids: list[int],
    ) -> tuple[dict[str, Any], int]:
        """(original prompt ids + generated ids, same cache salt; original length).

        Text is tokenized by vLLM's renderer as `AsyncLLM.generate` does a fresh raw
        prompt, so the ids (and prefix-cache blocks) are the first run's. Internal
        vLLM API: pyproject pins vLLM to a minor release.
        """
        ids = prompt.get("prompt_token_ids")
        if ids is None:
            from vllm.renderers.inputs.preprocess import parse_model_prompt

            renderer, model_config = self._llm.renderer, self._llm.model_config
            tok_params = renderer.default_cmpl_tok_params.with_kwargs(**(tokenization_kwargs or {}))
            parsed = parse_model_prompt(model_config, {"prompt": prompt["prompt"]})
            (rendered,) = await renderer.render_cmpl_async([parsed], tok_params)
            ids = rendered["prompt_token_ids"]
            self._check_prompt_len(len(ids))
        resumed: dict[str, Any] = {"prompt_token_ids": [*ids, *generated_token_ids]}
        if "cache_salt" in prompt:
            resumed["cache_salt"] = prompt["cache_salt"]
        return resumed, len(ids)

    def _check_prompt_len(self, num_prompt_tokens: int) -> None:
        # vLLM needs room for at least one output token.
        if self._max_model_len and num_prompt_tokens >= self._max_model_len:
            raise PromptTooLong(
                f"prompt has {num_prompt_tokens} tokens; this model takes at most "
                f"{self._max_model_len - 1} (max_model_len {self._max_model_len})"
            )

    def _sampling_params(self, item: WorkItem, num_resumed_tokens: int = 0) -> Any:
        """vLLM's parameters; None when a continuation has no output budget left."""
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError
        from vllm.sampling_params import RequestOutputKind

        sp = item.request.sampling
        max_tokens = sp.max_tokens - num_resumed_tokens  # max_tokens is per request
        if num_resumed_tokens and max_tokens <= 0:
            return None
        if sp.stop and self.config.skip_tokenizer_init:
            raise EngineError(
                "stop strings need a tokenizer (skip_tokenizer_init is on)",
                ErrorCode.INVALID_REQUEST,
            )
        try:
            return SamplingParams(
                n=1,
                temperature=sp.temperature,
                top_p=sp.top_p,
                max_tokens=max_tokens,
                stop=list(sp.stop) or None,
                seed=sp.seed,
                output_kind=RequestOutputKind.DELTA,
                detokenize=not self.config.skip_tokenizer_init,
            )
        except (VLLMClientError, ValueError, TypeError) as exc:
            raise EngineError(
                f"invalid sampling parameters: {exc}", ErrorCode.INVALID_REQUEST
            ) from exc

    @staticmethod
    def _map_validation_error(exc: BaseException) -> EngineError:
        message = str(exc)
        too_long = ("maximum model length", "maximum context length", "max_model_len")
        if any(phrase in message for phrase in too_long):
            return PromptTooLong(message)
        return EngineError(message, ErrorCode.INVALID_REQUEST)
