"""The streamer's errors and how they look on the wire (OpenAI's error shape).

Every failure the edge reports is an `EdgeError`: an HTTP status, an OpenAI error
``type``, a stable ``code`` (a `fairlane.protocol.ErrorCode` value, or one of the
edge's own below) and a message meant for the caller. HTTP answers
``{"error": {"message", "type", "param", "code"}}``; websocket error frames carry the
same code and message.
"""

from __future__ import annotations

import math

import msgspec

from fairlane.protocol import ErrorCode, ErrorInfo

# Edge-only codes (not on the NATS wire).
MODEL_NOT_FOUND = "model_not_found"
BODY_TOO_LARGE = "body_too_large"
NOT_FOUND = "not_found"
METHOD_NOT_ALLOWED = "method_not_allowed"

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
    ErrorCode.ENGINE_ERROR: (500, "server_error"),
    ErrorCode.SLOW_CONSUMER: (400, "invalid_request_error"),
    ErrorCode.INTERNAL: (500, "server_error"),
}


class EdgeError(Exception):
    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        retry_after_ms: int | None = None,
        retryable: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.type = type_
        self.param = param
        self.retry_after_ms = retry_after_ms
        self.retryable = retryable

    @classmethod
    def from_info(cls, info: ErrorInfo) -> EdgeError:
        status, type_ = _STATUS.get(info.code, (500, "server_error"))
        return cls(
            status,
            info.code.value,
            info.message,
            type_=type_,
            retry_after_ms=info.retry_after_ms,
            retryable=info.retryable,
        )

    @classmethod
    def invalid(cls, message: str, param: str | None = None) -> EdgeError:
        return cls(400, ErrorCode.INVALID_REQUEST.value, message, param=param)

    @classmethod
    def unauthorized(cls, message: str = "invalid API key") -> EdgeError:
        return cls(401, ErrorCode.UNAUTHORIZED.value, message, type_="authentication_error")

    @classmethod
    def rate_limited(cls, retry_after_ms: int) -> EdgeError:
        return cls(
            429,
            ErrorCode.RATE_LIMITED.value,
            f"rate limit exceeded; retry after {retry_after_ms} ms",
            type_="rate_limit_error",
            retry_after_ms=retry_after_ms,
            retryable=True,
        )

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
                "code": self.code,
            }
        }

    def to_info_dict(self) -> dict:
        d: dict = {"code": self.code, "message": self.message, "retryable": self.retryable}
        if self.retry_after_ms is not None:
            d["retry_after_ms"] = self.retry_after_ms
        return d


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
