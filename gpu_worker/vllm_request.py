"""One request's side of the vLLM adapter (`gpu_worker.vllm_engine`): its accounting
and the stream `VllmEngine.generate` returns.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from gpu_worker.engine import GenerationDelta


@dataclass(slots=True)
class VllmDelta(GenerationDelta):
    """A `GenerationDelta` plus what only the engine side can measure.

    `ttft_ms` is from submission to vLLM to the first generated token (0 until then).
    """

    ttft_ms: float = 0.0


class Accounting:
    """Per-request usage measured in the adapter.

    KV-token-seconds integrates the tokens this sequence holds in the KV cache
    (prompt + generated so far) over wall time, piecewise constant between outputs.
    It starts at the first output: before that the request waits (holds no KV) or is
    being prefilled, and the prefill step itself is not counted (a small, known
    under-count). Block rounding is ignored: this is the tenant's bill, not the
    allocator's view.
    """

    __slots__ = ("submitted", "last_t", "first_token_t", "num_prompt", "num_cached",
                 "num_output", "kv_token_seconds", "num_resumed", "abort_requested",
                 "submission", "early_finish")

    def __init__(self, num_resumed: int | None = None) -> None:
        self.submitted = time.monotonic()
        self.last_t = 0.0
        self.first_token_t = 0.0
        self.num_prompt = 0  # the original prompt's, also for a continuation
        self.num_cached = 0  # of what vLLM prefilled (a continuation's output included)
        self.num_output = num_resumed or 0  # the whole request's output
        self.kv_token_seconds = 0.0
        self.num_resumed = num_resumed  # None: not a continuation
        self.abort_requested = False
        # The task handing the request to vLLM (`VllmEngine._submit`): its result is
        # vLLM's output collector, or None when the request ended without vLLM, with
        # `early_finish` saying how.
        self.submission: asyncio.Task[Any] | None = None
        self.early_finish: str | None = None

    def delta(self, **kw: Any) -> VllmDelta:
        # A continuation re-prefilled prompt + earlier output (known done at its first
        # output), less what vLLM's prefix cache held.
        resumed, recomputed = self.num_resumed, 0
        if resumed is not None and self.last_t:
            recomputed = max(0, self.num_prompt + resumed - self.num_cached)
        return VllmDelta(num_prompt_tokens=self.num_prompt, num_output_tokens=self.num_output,
                         num_cached_prompt_tokens=min(self.num_cached, self.num_prompt),
                         kv_token_seconds=self.kv_token_seconds, ttft_ms=self.ttft_ms,
                         num_recomputed_tokens=recomputed, **kw)

    def on_output(self, num_new_tokens: int, now: float) -> None:
        if self.last_t:
            self.kv_token_seconds += (self.num_prompt + self.num_output) * (now - self.last_t)
        self.last_t = now
        if num_new_tokens and not self.first_token_t:
            self.first_token_t = now
        self.num_output += num_new_tokens

    @property
    def ttft_ms(self) -> float:
        return (self.first_token_t - self.submitted) * 1000.0 if self.first_token_t else 0.0

    @property
    def kv_tokens(self) -> int:
        return self.num_prompt + self.num_output if self.last_t else 0


class VllmStream:
    """What `VllmEngine.generate` returns: the request is already on its way into vLLM
    (its `Accounting.submission` runs), whether or not anyone iterates this.

    A plain async generator would not do: ``aclose()`` on one never iterated skips its
    ``finally``, and here the request must leave vLLM even then (a worker may close a
    stream before its pump ever ran).
    """

    __slots__ = ("_outputs", "_release", "_started")

    def __init__(self, outputs: AsyncGenerator[GenerationDelta, None],
                 release: Callable[[], Awaitable[None]]) -> None:
        self._outputs = outputs  # its own ``finally`` releases the request
        self._release = release  # the same, for a stream closed before its first item
        self._started = False

    def __aiter__(self) -> VllmStream:
        return self

    async def __anext__(self) -> GenerationDelta:
        self._started = True
        return await self._outputs.__anext__()

    async def aclose(self) -> None:
        started, self._started = self._started, True
        await self._outputs.aclose()  # a later __anext__ ends the iteration
        if not started:
            await self._release()
