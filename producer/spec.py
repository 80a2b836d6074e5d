"""`RequestSpec`: what a caller of the producer library asks for.

The one request description every front end builds (the library's users, the
producer CLI, the streamer's HTTP and websocket schemas): content, one
`SamplingParams`, scheduling hints. `FairlaneClient.submit` adds the routing the
caller does not choose (request id if absent, the tenant's tier if absent, reply
subject, creation time), checks it with `fairlane.validation.check_request`, admits
it against the rate limiter and publishes the resulting `InferenceRequest`.

Its fields are a subset of `InferenceRequest`'s, with the same names and meanings, and
are copied across by name (a unit test keeps the two from drifting): a new request
field is added to `InferenceRequest` (and here, if callers may set it), nowhere else.
"""

from __future__ import annotations

import uuid

import msgspec

from fairlane.protocol import ChatMessage, InferenceRequest, SamplingParams

# Chosen by the client when the caller leaves them unset, so not copied by name.
_ROUTING = frozenset({"request_id", "tier"})


class RequestSpec(msgspec.Struct, kw_only=True):
    tenant: str
    pool: str = "default"
    tier: str | None = None  # None: the tenant's tier as the pool's dispatcher knows it
    request_id: str | None = None  # None: a fresh one; reuse one to retry idempotently
    prompt: str | None = None  # exactly one of prompt, messages, prompt_token_ids
    messages: list[ChatMessage] | None = None
    prompt_token_ids: list[int] | None = None
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    priority: int = 0  # within the tenant: higher first
    deadline_ms: int | None = None  # absolute, unix epoch milliseconds
    ttft_budget_ms: int | None = None
    expected_output_tokens: int | None = None  # cost estimate; default sampling.max_tokens
    return_token_ids: bool = False

    def to_request(self, *, request_id: str, tier: str, reply_to: str,
                   created_ms: int) -> InferenceRequest:
        copied = {name: getattr(self, name) for name in self.__struct_fields__
                  if name not in _ROUTING}
        return InferenceRequest(request_id=request_id, tier=tier, reply_to=reply_to,
                                created_ms=created_ms, **copied)


def new_request_id() -> str:
    return uuid.uuid4().hex
