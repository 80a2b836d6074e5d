"""The streamer's errors and how they look on the wire (OpenAI's error shape).

Every failure the edge reports is a `fairlane.errors.FairlaneError`: the edge's own
refusals are `EdgeError`s (with the offending ``param`` when known), and the producer
library's `RequestError`s pass through as they are. `EdgeError.of` gives any of them
their HTTP status and OpenAI error ``type`` from the stable code, in one place. HTTP
answers ``{"error": {"message", "type", "param", "code"}}``; websocket error frames
carry the same code and message.
"""

from __future__ import annotations

import math

import msgspec

from fairlane.errors import ErrorCode, FairlaneError

# Edge-only codes, kept under their old names for importers.
MODEL_NOT_FOUND = ErrorCode.MODEL_NOT_FOUND
BODY_TOO_LARGE = ErrorCode.BODY_TOO_LARGE
NOT_FOUND = ErrorCode.NOT_FOUND
METHOD_NOT_ALLOWED = ErrorCode.METHOD_NOT_ALLOWED

# ErrorCode -> (HTTP status, OpenAI error type)
_STATUS: dict[ErrorCode, tuple[int, str]] = {
    ErrorCode.MALFORMED: (400, "invalid_request_error"),
    ErrorCode.INVALID_REQUEST: (400, "invalid_request_error"),
    ErrorCode.PROMPT_TOO_LONG: (400, "invalid_request_error"),
    ErrorCode.UNKNOWN_TENANT: (401, "authentication_error"),
    ErrorCode.UNAUTHORIZED: (401, "authentication_error"),
    ErrorCode.RATE_LIMITED: (429, "rate_limit_error"),
    ErrorCode.QUEUE_FULL: (429, "rate_limit_error"),
    ErrorCode.THROTTLED: (429, "rate_limit_error"),
    ErrorCode.OVERLOADED: (503, "server_error"),
    ErrorCode.EXPIRED: (504, "server_error"),
    ErrorCode.CANCELLED: (499, "invalid_request_error"),
    ErrorCode.WORKER_LOST: (503, "server_error"),
    # Retryable like worker_lost: the tokens stopped and no dispatcher vouches for it.
    ErrorCode.STREAM_LOST: (503, "server_error"),
    # The same (request id, attempt) already ended: a conflict, not a server fault.
    ErrorCode.DUPLICATE: (409, "invalid_request_error"),
    ErrorCode.ENGINE_ERROR: (500, "server_error"),
    ErrorCode.SLOW_CONSUMER: (400, "invalid_request_error"),
    ErrorCode.INTERNAL: (500, "server_error"),
    ErrorCode.MODEL_NOT_FOUND: (404, "invalid_request_error"),
    ErrorCode.BODY_TOO_LARGE: (413, "invalid_request_error"),
    ErrorCode.NOT_FOUND: (404, "invalid_request_error"),
    ErrorCode.METHOD_NOT_ALLOWED: (405, "invalid_request_error"),
}


class EdgeError(FairlaneError):
    """A refusal at the edge; HTTP status and OpenAI type follow from `code` unless
    `status` is given (a status the code table does not know, e.g. from Starlette)."""

    default_code = ErrorCode.INVALID_REQUEST

    def __init__(
        self,
        message: str,
        code: ErrorCode | str | None = None,
        *,
        param: str | None = None,
        retry_after_ms: int | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message, code, retry_after_ms=retry_after_ms)
        default_status, self.type = _STATUS.get(self.code, (500, "server_error"))
        self.status = status or default_status
        self.param = param

    @classmethod
    def of(cls, exc: FairlaneError) -> EdgeError:
        """`exc` with its HTTP face (itself if it already is an EdgeError)."""
        return exc if isinstance(exc, EdgeError) else cls.from_error(exc)

    @classmethod
    def unauthorized(cls, message: str = "invalid API key") -> EdgeError:
        return cls(message, ErrorCode.UNAUTHORIZED)

    @property
    def retry_after_s(self) -> int | None:
        if self.retry_after_ms is None:
            return None
        return max(1, math.ceil(self.retry_after_ms / 1000))

    def headers(self) -> dict[str, str]:
        if self.status == 401:
            return {"WWW-Authenticate": "Bearer"}
        if self.retry_after_s is not None and self.status in (429, 503):
            return {"Retry-After": str(self.retry_after_s)}
        return {}

    def openai_body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code.value,
            }
        }


def validation_message(exc: msgspec.ValidationError | msgspec.DecodeError) -> tuple[str, str | None]:
    """A caller-facing message and the offending parameter from a msgspec error."""
    text = str(exc)
    param = None
    if " - at `$." in text:
        msg, _, path = text.rpartition(" - at `$.")
        param = path.rstrip("`")
        text = f"{param}: {msg}"
    elif text.startswith("Object contains unknown field"):
        param = text.rsplit("`", 2)[-2] if text.count("`") >= 2 else None
    return text, param
