"""The one error vocabulary of the fleet: stable codes, their wire form, one base class.

Every package's errors (`ProtocolError`, `RequestError`, `EdgeError`, `EngineError`)
derive from `FairlaneError`, which carries its code, message and retry hint itself,
so an error crosses a hop with `exc.info()` (onto the wire) or `Cls.from_info(info)`
(off it) instead of being re-wrapped field by field. This module imports nothing but
msgspec, so any process (and any client) may import it. `fairlane.protocol`
re-exports `ErrorCode` and `ErrorInfo`: `ErrorInfo` is part of the wire protocol and
follows its evolution rules (append fields with defaults).
"""

from __future__ import annotations

import enum
from typing import ClassVar, Self

from msgspec import Struct


class ErrorCode(enum.StrEnum):
    """Stable error codes. Clients switch on these; never rename one."""

    MALFORMED = "malformed"  # bytes that are not a valid message
    INVALID_REQUEST = "invalid_request"  # well-formed but semantically invalid
    UNKNOWN_TENANT = "unknown_tenant"
    UNAUTHORIZED = "unauthorized"
    PROMPT_TOO_LONG = "prompt_too_long"
    QUEUE_FULL = "queue_full"  # tenant's queue cap reached
    THROTTLED = "throttled"  # predicted wait exceeds the TTFT budget/deadline
    RATE_LIMITED = "rate_limited"
    OVERLOADED = "overloaded"  # shed under overload
    EXPIRED = "expired"  # deadline passed while queued
    CANCELLED = "cancelled"
    WORKER_LOST = "worker_lost"  # worker died after the request started (retryable)
    ENGINE_ERROR = "engine_error"
    SLOW_CONSUMER = "slow_consumer"
    INTERNAL = "internal"
    STREAM_LOST = "stream_lost"  # tokens stopped and no dispatcher vouches for it (retryable)
    DUPLICATE = "duplicate"  # this attempt of the request id already ended: not run again
    # Edge-only (HTTP / websocket answers); never sent on NATS, where a consumer one
    # version older could not decode them.
    MODEL_NOT_FOUND = "model_not_found"
    BODY_TOO_LARGE = "body_too_large"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"


RETRYABLE_CODES = frozenset(
    {
        ErrorCode.QUEUE_FULL,
        ErrorCode.THROTTLED,
        ErrorCode.RATE_LIMITED,
        ErrorCode.OVERLOADED,
        ErrorCode.WORKER_LOST,
        ErrorCode.STREAM_LOST,
    }
)


class ErrorInfo(Struct, kw_only=True, omit_defaults=True):
    """An error as it travels on the wire (in `TokenChunk`, `Finished`)."""

    # A plain string on the wire, so a code added by a newer sender still decodes here
    # (as ``internal``, keeping the sender's message and retryable flag) instead of
    # making the whole chunk unreadable; always an `ErrorCode` in memory.
    code: str
    message: str
    retryable: bool = False
    retry_after_ms: int | None = None

    def __post_init__(self) -> None:
        try:
            self.code = ErrorCode(self.code)
        except ValueError:
            self.code = ErrorCode.INTERNAL

    @classmethod
    def of(cls, code: ErrorCode, message: str, retry_after_ms: int | None = None) -> ErrorInfo:
        return cls(
            code=code,
            message=message,
            retryable=code in RETRYABLE_CODES,
            retry_after_ms=retry_after_ms,
        )


class FairlaneError(Exception):
    """Base of every fairlane error: a stable `code`, a `message` for the caller,
    for retryable refusals `retry_after_ms`, and for a refused parameter its name
    (`param`, e.g. "max_tokens": the HTTP edge's OpenAI error names it). Subclasses
    pick their default code."""

    default_code: ClassVar[ErrorCode] = ErrorCode.INTERNAL

    def __init__(
        self,
        message: str,
        code: ErrorCode | str | None = None,
        *,
        retry_after_ms: int | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = ErrorCode(code) if code is not None else self.default_code
        self.message = message
        self.retry_after_ms = retry_after_ms
        self.param = param

    @property
    def retryable(self) -> bool:
        return self.code in RETRYABLE_CODES

    def info(self) -> ErrorInfo:
        """This error in its wire form."""
        return ErrorInfo.of(self.code, self.message, self.retry_after_ms)

    @classmethod
    def from_info(cls, info: ErrorInfo) -> Self:
        """The error a received `ErrorInfo` describes, as this class."""
        return cls(info.message, info.code, retry_after_ms=info.retry_after_ms)

    @classmethod
    def from_error(cls, exc: FairlaneError) -> Self:
        """`exc`'s code, message, hint and parameter as this class (crossing a package
        boundary)."""
        return cls(exc.message, exc.code, retry_after_ms=exc.retry_after_ms, param=exc.param)
