"""The streamer's errors and how they look on the wire (OpenAI's error shape).

Every failure the edge reports is a `fairlane.errors.FairlaneError`: the edge's own
refusals are `EdgeError`s (with the offending ``param`` when known), and the producer
library's `RequestError`s pass through as they are. `EdgeError.of` gives any of them
their HTTP status and OpenAI error ``type`` from the stable code, in one place. HTTP
answers ``{"error": {"message", "type", "param", "code"}}``; websocket error frames
carry the same code, message and param.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

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
        super().__init__(message, code, retry_after_ms=retry_after_ms, param=param)
        default_status, self.type = _STATUS.get(self.code, (500, "server_error"))
        self.status = status or default_status

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


_KIND_WORDS = {"int": "an integer", "float": "a number", "str": "a string",
               "bool": "a boolean", "array": "an array", "object": "an object", "null": "null"}
_BOUND = re.compile(r"^Expected `(?P<kind>\w+)` (?P<op>[<>]=?) (?P<bound>\S+)$")
_LENGTH = re.compile(r"^Expected `(?P<kind>\w+)` of length (?P<op>[<>]=?) (?P<n>\d+)$")
_TYPE = re.compile(r"^Expected `(?P<expected>[^`]+)`, got `(?P<got>\w+)`$")
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]+)`$")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<field>[^`]+)`$")
_INVALID = re.compile(r"^Invalid (?:enum )?value (?P<value>.+)$")


def validation_message(exc: msgspec.ValidationError | msgspec.DecodeError,
                       choices: Mapping[str, Sequence[str]] | None = None,
                       ranges: Mapping[str, str] | None = None,
                       body: bytes | str | None = None) -> tuple[str, str | None]:
    """A caller-facing message and the offending parameter from a msgspec error, in
    words that say what is allowed ("temperature must be a number between 0 and 2,
    got 3"). `choices`: a field's allowed values by its name, for "invalid value"
    errors; `ranges`: a bounded field's whole range in words by its name
    (`bounded_fields`), since msgspec names only the bound that was crossed; `body`:
    the JSON the error is about, to quote a top-level value that is out of range."""
    text = str(exc)
    param = None
    if " - at `$" in text:
        text, _, path = text.rpartition(" - at `$")
        param = path.rstrip("`").lstrip(".") or None
    if m := _MISSING.match(text):
        param = f"{param}.{m['field']}" if param else m["field"]
        return f"missing required field '{param}'", param
    if m := _UNKNOWN.match(text):
        param = f"{param}.{m['field']}" if param else m["field"]
        return f"unknown field '{param}'", param
    phrase = _phrase(text, param, choices or {}, ranges or {}, body)
    return (f"{param} {phrase}" if param else phrase), param


def bounded_fields(*types: type[msgspec.Struct]) -> dict[str, str]:
    """The range of every bounded number field of `types` in words, by field name
    ({"temperature": "between 0 and 2", "max_tokens": "of at least 1", ...})."""
    out: dict[str, str] = {}
    for typ in types:
        for field in msgspec.inspect.type_info(typ).fields:
            t = field.type
            for option in t.types if isinstance(t, msgspec.inspect.UnionType) else (t,):
                if isinstance(option, msgspec.inspect.IntType | msgspec.inspect.FloatType):
                    if (words := _range_words(option)) is not None:
                        out[field.name] = words
    return out


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def _range_words(t: msgspec.inspect.IntType | msgspec.inspect.FloatType) -> str | None:
    lo, hi = t.ge if t.ge is not None else t.gt, t.le if t.le is not None else t.lt
    if t.ge is not None and t.le is not None:
        return f"between {_num(lo)} and {_num(hi)}"
    parts = []
    if lo is not None:
        parts.append(f"at least {_num(lo)}" if t.ge is not None else f"greater than {_num(lo)}")
    if hi is not None:
        parts.append(f"at most {_num(hi)}" if t.le is not None else f"less than {_num(hi)}")
    if not parts:
        return None
    return ("of " if len(parts) == 1 and lo is not None and t.ge is not None else "") + \
        " and ".join(parts)


_raw_object = msgspec.json.Decoder(dict[str, msgspec.Raw])


def _quoted_value(body: bytes | str | None, param: str | None) -> str | None:
    """The JSON text of top-level field `param` of `body`, if short enough to quote."""
    if body is None or not param or not param.isidentifier():
        return None
    try:
        raw = _raw_object.decode(body).get(param)
    except msgspec.DecodeError:
        return None
    if raw is None or len(raw) > 40:
        return None
    return bytes(raw).decode("utf-8", "replace")


def _phrase(text: str, param: str | None, choices: Mapping[str, Sequence[str]],
            ranges: Mapping[str, str], body: bytes | str | None) -> str:
    if m := _BOUND.match(text):
        kind = _KIND_WORDS.get(m["kind"], m["kind"])
        leaf = (param or "").rsplit(".", 1)[-1]
        allowed = ranges.get(leaf) or f"{m['op']} {m['bound']}"
        got = _quoted_value(body, param)
        return f"must be {kind} {allowed}" + (f", got {got}" if got is not None else "")
    if m := _LENGTH.match(text):
        unit = "characters" if m["kind"] == "str" else "items"
        if m["op"] == ">=" and m["n"] == "1":
            return "must not be empty"
        most = "at most" if m["op"].startswith("<") else "at least"
        return f"must have {most} {m['n']} {unit}"
    if m := _TYPE.match(text):
        kinds = [_KIND_WORDS.get(k.strip(), k.strip()) for k in m["expected"].split("|")]
        wanted = kinds[0] if len(kinds) == 1 else ", ".join(kinds[:-1]) + " or " + kinds[-1]
        verb = "must be" if param else "expected"
        return f"{verb} {wanted}, got {_KIND_WORDS.get(m['got'], m['got'])}"
    if m := _INVALID.match(text):
        leaf = (param or "").rsplit(".", 1)[-1]
        allowed = choices.get(leaf)
        hint = f" (expected one of: {', '.join(allowed)})" if allowed else ""
        return f"has an invalid value {m['value']}{hint}"
    return text[:1].lower() + text[1:]
