"""The `Engine` protocol every worker engine implements (DESIGN.md section 6).

The worker shell (`gpu_worker.service`) owns NATS; an engine only turns a `WorkItem`
into a stream of `GenerationDelta`s and reports its load. Two implementations:
`gpu_worker.sim.engine.SimEngine` (a simulator of continuous batching, no model text)
and `gpu_worker.vllm_engine.VllmEngine` (vLLM's AsyncLLM).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from fairlane.errors import FairlaneError
from fairlane.protocol import EngineLoad, ErrorCode, WorkItem


class EngineError(FairlaneError):
    """A request failed inside the engine. Its `info()` goes to the client as-is."""

    default_code = ErrorCode.ENGINE_ERROR


class PromptTooLong(EngineError):
    def __init__(self, message: str) -> None:
        super().__init__(message, ErrorCode.PROMPT_TOO_LONG)


class EngineDead(EngineError):
    """The engine as a whole is gone: the worker fails every request and exits."""


@dataclass(slots=True)
class GenerationDelta:
    """New output since the previous delta of the same request.

    The last delta of a request has `finish_reason` set ("stop", "length", "abort")
    and carries the final accounting fields. For a continuation
    (``item.request.resume``) the counts are the whole request's: `token_ids` and
    `text` are only the new output, `num_output_tokens` includes the resumed-from
    tokens and `num_prompt_tokens` is the original prompt's.
    """

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    # Accounting; meaningful on the last delta (engines may fill them earlier).
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_output_tokens: int = 0  # total so far, a continuation's earlier tokens included
    kv_token_seconds: float = 0.0  # integral of this sequence's KV tokens over time
    # A continuation only: of the prompt + already generated tokens it re-prefilled,
    # those the engine's prefix cache did not hold (0 for a fresh request). The cost
    # of the resume: low on the worker that ran it before, under the same cache salt.
    num_recomputed_tokens: int = 0


@runtime_checkable
class Engine(Protocol):
    async def start(self) -> None:
        """Load the model / start the engine loop. Idempotent."""

    def generate(self, item: WorkItem) -> AsyncIterator[GenerationDelta]:
        """Stream deltas for one request. Raises EngineError (e.g. PromptTooLong).

        The worker calls it the moment it accepts the request and iterates it from the
        request's task. The request must be on its way into the engine when this
        returns, not on first iteration: the simulator admits it right here, vLLM's
        adapter starts its submission as a task. Either way an ``abort()`` called
        after this returns reaches the engine after the submission does (a
        preemption's replacement must be queued before its victim frees the slot),
        and the stream's ``aclose()`` frees whatever the request took, iterated or not.

        Honours ``item.request.resume`` (DESIGN.md 5b): the run continues after
        ``resume.generated_token_ids`` (prefilled again after the prompt, under the
        same ``item.cache_salt`` so the prefix cache can serve them). Its deltas carry
        only NEW tokens; ``num_output_tokens`` counts the whole request's output
        (earlier + new), so usage stays per request. ``sampling.max_tokens`` is the
        whole request's budget: at most ``max_tokens - len(generated_token_ids)`` new
        tokens, and with none left the stream is one delta with finish "length" and
        no tokens.
        """

    async def abort(self, request_id: str) -> None:
        """Stop a running request; its generate() iterator ends with finish 'abort'."""

    def load(self) -> EngineLoad:
        """Running/waiting sequences and KV use, for pull headroom and heartbeats.

        May raise EngineDead once the engine is gone (the worker then fails its
        in-flight requests and exits), so a dead engine is noticed even when idle.
        """

    async def close(self) -> None:
        """Stop the engine and free its resources."""
