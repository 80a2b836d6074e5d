"""Client-facing request schemas: OpenAI-compatible HTTP bodies and websocket frames.

These are *not* NATS wire messages (those live in `fairlane/protocol.py`); they are
what a public client sends and receives. The schemas check types and shapes only; each
maps its body ONCE, with `to_spec`, into the producer library's `RequestSpec`, whose
cross-field rules (exactly one prompt form, non-empty prompt, the pool's limits)
`fairlane.validation.check_request` owns.

OpenAI bodies follow vLLM's OpenAI server: a field the schema does not know is
accepted and ignored (`ignored_fields` names them; the HTTP API logs a warning and
answers with an ``X-Fairlane-Ignored-Fields`` header), because SDKs and frameworks add
fields faster than any server learns them. A known OpenAI feature the fleet cannot
honour (tools, n > 1, logprobs, penalties, a JSON response format, ...) is a 400 that
names it and says what is accepted; at its neutral value (``n: 1``,
``presence_penalty: 0``, ``tools: []``) it is accepted. Websocket frames are fairlane's
own protocol and stay strict: an unknown field there is an error naming it.

Websocket protocol on ``/v1/stream`` (JSON text frames; several requests may be in
flight on one socket, each keyed by the client's own ``id``):

client -> server
    {"type": "request", "id": "c1", "model": "default", "prompt": "..." | "messages": [...],
     "max_tokens": 64, "temperature": 1.0, "top_p": 1.0, "stop": [], "seed": null,
     "priority": 0, "ttft_budget_ms": null, "return_token_ids": false}
    {"type": "cancel", "id": "c1"}
server -> client
    {"type": "accepted", "id": "c1", "request_id": "<fleet request id>"}
    {"type": "token", "id": "c1", "seq": 0, "text": "...", "num_tokens": 1,
     "token_ids": [..]}                                  (token_ids only if asked for)
    {"type": "end", "id": "c1", "finish_reason": "stop" | "length" | "cancelled" | ...,
     "usage": {"prompt_tokens": n, "completion_tokens": n, "total_tokens": n} | null}
    {"type": "error", "id": "c1" | null, "error": {"code": "...", "message": "...",
     "retryable": bool, "retry_after_ms": n | null, "param": "..." | null}}
                                                   (id null: frame-level error; param: the
                                                   refused field, as OpenAI's error names it)

Every request ends with exactly one ``end`` or ``error`` frame, unless the socket closes.

Websocket close codes (server -> client):
    1000  normal closure
    1012  server restarting / shutting down (sent by uvicorn; requests are cancelled upstream)
    1009  frame too large (over max_body_bytes)
    4001  unauthorized (only if the server cannot refuse the handshake with HTTP 401)
    4008  slow consumer: the client did not read its frames fast enough; every request
          on the socket was cancelled upstream. Reason text says which limit was hit.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

import msgspec
from msgspec import Meta, Struct

from fairlane.protocol import ChatMessage, SamplingParams
from producer.spec import RequestSpec
from streamer.errors import EdgeError, bounded_fields

CLOSE_NORMAL = 1000
CLOSE_SERVICE_RESTART = 1012
CLOSE_TOO_BIG = 1009
CLOSE_UNAUTHORIZED = 4001
CLOSE_SLOW_CONSUMER = 4008

MaxTokens = Annotated[int, Meta(ge=1)]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Priority = Annotated[int, Meta(ge=-1000, le=1000)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
BudgetMs = Annotated[int, Meta(ge=1, le=3_600_000)]
ModelName = Annotated[str, Meta(min_length=1, max_length=64)]
ClientId = Annotated[str, Meta(min_length=1, max_length=128)]
StopString = Annotated[str, Meta(min_length=1, max_length=256)]
StopList = Annotated[list[StopString], Meta(max_length=8)]


class ContentPart(Struct, kw_only=True):
    type: str
    text: str | None = None


Role = Literal["system", "user", "assistant", "tool", "developer"]
# Allowed values by field name, for error messages ("expected one of: ...").
FIELD_CHOICES: dict[str, tuple[str, ...]] = {"role": get_args(Role)}


class ChatMessageIn(Struct, kw_only=True):
    """A chat message of an OpenAI body (other fields, e.g. ``tool_calls``, ignored)."""

    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None


class WsChatMessage(ChatMessageIn, forbid_unknown_fields=True):
    """A chat message of a websocket frame (strict, like the frame)."""


class StreamOptions(Struct, kw_only=True):
    include_usage: bool = False


class _Knobs(Struct, kw_only=True):
    """Sampling and scheduling knobs every request body shares, mapped in one place.
    A new sampling knob is a field here and a line in `_spec`."""

    max_tokens: MaxTokens | None = None
    # null is the default, as in OpenAI's API (SDKs and frameworks send it).
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stop: StopString | StopList | None = None
    seed: Seed | None = None
    # fairlane extensions
    priority: Priority = 0
    ttft_budget_ms: BudgetMs | None = None

    def _spec(self, *, tenant: str, tier: str, pool: str, max_tokens: int,
              **content: object) -> RequestSpec:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        sampling = SamplingParams(
            max_tokens=max_tokens, stop=stop, seed=self.seed,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p)
        return RequestSpec(tenant=tenant, tier=tier, pool=pool, sampling=sampling,
                           priority=self.priority, ttft_budget_ms=self.ttft_budget_ms,
                           **content)  # type: ignore[arg-type]


class _Common(_Knobs, kw_only=True):
    model: ModelName
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: Annotated[str, Meta(max_length=256)] | None = None
    # OpenAI (and vLLM) parameters the fleet cannot honour: accepted at their neutral
    # value, refused with a 400 naming them otherwise (see `_refuse_unsupported`), so a
    # client never gets an answer generated without what it asked for.
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # only means something with tools
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    def _refuse_unsupported(self) -> None:
        if self.n not in (None, 1):
            _unsupported("n", f"n = {self.n} is not supported: one choice per request "
                              f"(only n = 1 is accepted)")
        for name, neutral in (("presence_penalty", 0), ("frequency_penalty", 0),
                              ("min_p", 0), ("repetition_penalty", 1)):
            if getattr(self, name) not in (None, neutral):
                _unsupported(name, f"{name} is not supported (only {neutral} is accepted), "
                                   f"got {getattr(self, name)}")
        if self.top_k not in (None, 0, -1):
            _unsupported("top_k", f"top_k is not supported (only -1 or 0, no limit, is "
                                  f"accepted), got {self.top_k}; top_p is supported")
        if self.logit_bias:
            _unsupported("logit_bias", "logit_bias is not supported (only an empty map is "
                                       "accepted)")
        for name in ("tools", "functions"):
            if getattr(self, name):
                _unsupported(name, f"{name} (tool / function calling) is not supported: this "
                                   f"fleet generates plain text")
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none", "auto"):
                _unsupported(name, f"{name} is not supported (tool / function calling is "
                                   f"not; only 'none' or 'auto' is accepted)")
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            _unsupported("response_format", f"response_format {kind!r} is not supported "
                                            f"(only 'text' is accepted)")


class CompletionRequest(_Common):
    # A string, a one-element list of strings, or a list of token ids.
    prompt: str | Annotated[list[str | Annotated[int, Meta(ge=0)]], Meta(min_length=1)]
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def to_spec(self, *, tenant: str, tier: str, pool: str, default_max_tokens: int) -> RequestSpec:
        self._refuse_unsupported()
        if self.echo:
            _unsupported("echo", "echo is not supported (only false is accepted)")
        if self.logprobs is not None:
            _unsupported("logprobs", "logprobs are not supported (only null is accepted)")
        if self.best_of not in (None, 1):
            _unsupported("best_of", f"best_of = {self.best_of} is not supported (only 1 is "
                                    f"accepted)")
        if self.suffix:
            _unsupported("suffix", "suffix (insertion) is not supported (only an empty "
                                   "suffix is accepted)")
        p = self.prompt
        if isinstance(p, str):
            content: dict = {"prompt": p}
        elif all(isinstance(x, int) for x in p):
            content = {"prompt_token_ids": list(p)}
        elif len(p) == 1 and isinstance(p[0], str):
            content = {"prompt": p[0]}
        else:
            raise EdgeError("prompt must be a string, a list of one string, or a list of "
                            "token ids", param="prompt")
        return self._spec(tenant=tenant, tier=tier, pool=pool,
                          max_tokens=self.max_tokens or default_max_tokens, **content)


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessageIn], Meta(min_length=1, max_length=1024)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def to_spec(self, *, tenant: str, tier: str, pool: str, default_max_tokens: int) -> RequestSpec:
        self._refuse_unsupported()
        if self.logprobs:
            _unsupported("logprobs", "logprobs are not supported (only false is accepted)")
        if self.top_logprobs:
            _unsupported("top_logprobs", "top_logprobs is not supported (only 0 is accepted)")
        max_tokens = self.max_completion_tokens or self.max_tokens or default_max_tokens
        return self._spec(tenant=tenant, tier=tier, pool=pool, max_tokens=max_tokens,
                          messages=chat_messages(self.messages))


def _unsupported(param: str, message: str) -> None:
    raise EdgeError(message, param=param)


class WsRequest(_Knobs, kw_only=True, tag="request", tag_field="type",
                forbid_unknown_fields=True):
    id: ClientId
    model: ModelName | None = None
    prompt: str | None = None
    messages: Annotated[list[WsChatMessage], Meta(min_length=1, max_length=1024)] | None = None
    prompt_token_ids: list[Annotated[int, Meta(ge=0)]] | None = None
    return_token_ids: bool = False

    def to_spec(self, *, tenant: str, tier: str, pool: str, default_max_tokens: int) -> RequestSpec:
        messages = None if self.messages is None else chat_messages(self.messages)
        return self._spec(tenant=tenant, tier=tier, pool=pool,
                          max_tokens=self.max_tokens or default_max_tokens,
                          prompt=self.prompt, messages=messages,
                          prompt_token_ids=self.prompt_token_ids,
                          return_token_ids=self.return_token_ids)


class WsCancel(Struct, kw_only=True, forbid_unknown_fields=True, tag="cancel", tag_field="type"):
    id: ClientId


ClientFrame = WsRequest | WsCancel

decode_client_frame = msgspec.json.Decoder(ClientFrame)
decode_completion = msgspec.json.Decoder(CompletionRequest)
decode_chat = msgspec.json.Decoder(ChatCompletionRequest)
# Every bounded number field's whole range in words, for error messages.
FIELD_RANGES = bounded_fields(CompletionRequest, ChatCompletionRequest, WsRequest)

_raw_object = msgspec.json.Decoder(dict[str, msgspec.Raw])
_raw_objects = msgspec.json.Decoder(list[dict[str, msgspec.Raw]])


def ignored_fields(body: bytes, typ: type[Struct]) -> list[str]:
    """The fields of an OpenAI body (already decoded as `typ`) that the schema does not
    know and so ignores: top-level names, ``messages[].x`` and ``stream_options.x``.
    Reading keys only (values stay raw) keeps this cheap next to the decode itself."""
    try:
        top = _raw_object.decode(body)
    except msgspec.DecodeError:
        return []
    out = {k for k in top if k not in typ.__struct_fields__}
    nested = {"messages": (_raw_objects, ChatMessageIn, "messages[]."),
              "stream_options": (_raw_object, StreamOptions, "stream_options.")}
    for field, (decoder, inner, prefix) in nested.items():
        if field not in typ.__struct_fields__ or field not in top:
            continue
        try:
            value = decoder.decode(top[field])
        except msgspec.DecodeError:  # null, or a shape the typed decode accepted
            continue
        for obj in value if isinstance(value, list) else [value]:
            out.update(prefix + k for k in obj if k not in inner.__struct_fields__)
    return sorted(out)


# --- server -> client frames --------------------------------------------------------


class UsageOut(Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AcceptedFrame(Struct, kw_only=True, tag="accepted", tag_field="type"):
    id: str
    request_id: str


class TokenFrame(Struct, kw_only=True, omit_defaults=True, tag="token", tag_field="type"):
    id: str
    seq: int
    text: str
    num_tokens: int = 0
    token_ids: list[int] | None = None


class EndFrame(Struct, kw_only=True, tag="end", tag_field="type"):
    id: str
    finish_reason: str
    usage: UsageOut | None = None


class ErrorBody(Struct, kw_only=True):
    code: str
    message: str
    retryable: bool = False
    retry_after_ms: int | None = None
    # The refused field when one is to blame (as OpenAI's error "param"), e.g. "max_tokens"
    # over the pool's limit; null otherwise. Added after the first release: appended last.
    param: str | None = None


class ErrorFrame(Struct, kw_only=True, tag="error", tag_field="type"):
    id: str | None
    error: ErrorBody


ServerFrame = AcceptedFrame | TokenFrame | EndFrame | ErrorFrame

_encoder = msgspec.json.Encoder()


def encode_frame(frame: Struct) -> str:
    return _encoder.encode(frame).decode()


def message_text(m: ChatMessageIn) -> str:
    """The text of a chat message; only text content parts are supported."""
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    out = []
    for part in m.content:
        if part.type != "text" or part.text is None:
            raise EdgeError(f"unsupported content part type {part.type!r}: only 'text' is "
                            f"supported", param="messages")
        out.append(part.text)
    return "".join(out)


def chat_messages(messages: list[ChatMessageIn]) -> list[ChatMessage]:
    return [ChatMessage(role=m.role, content=message_text(m)) for m in messages]
