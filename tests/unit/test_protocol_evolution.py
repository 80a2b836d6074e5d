"""Every internal NATS message obeys the schema-evolution rules (fairlane/protocol.py).

1. A message from a NEWER sender, carrying a field this version does not know, still
   decodes (so a rolling upgrade never turns a request into ``malformed``).
2. A message from an OLDER sender, without the newest optional fields, still decodes
   with their defaults.

The list of message types is read from the module, so a new message is covered
without touching this file; `SAMPLES` must hold a valid instance of each.
"""

from __future__ import annotations

import inspect

import msgspec
import pytest

from fairlane import errors, protocol
from fairlane.errors import ErrorCode, ErrorInfo, FairlaneError
from fairlane.protocol import (
    Cancel,
    ChatMessage,
    Continuation,
    EngineLoad,
    Finished,
    Heartbeat,
    HeartbeatAck,
    InferenceRequest,
    LoadStats,
    PoolInfo,
    PoolInfoRequest,
    PoolStats,
    Preempt,
    Preempted,
    ProtocolError,
    PullRequest,
    RequestStatus,
    Requeue,
    SamplingParams,
    Started,
    StatusBatch,
    StatusRequest,
    TenantStats,
    TierStats,
    TokenChunk,
    Usage,
    WorkBatch,
    WorkItem,
)
from producer.spec import RequestSpec

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

REQ = InferenceRequest(
    request_id="r1", tenant="acme", pool="p", tier="paid", reply_to="fl.inbox.o.r1",
    messages=[ChatMessage(role="user", content="hi")],
    sampling=SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, stop=["x"], seed=3),
    priority=1, deadline_ms=10, ttft_budget_ms=20, created_ms=5, return_token_ids=True,
    expected_output_tokens=6,
)
USAGE = Usage(request_id="r1", tenant="acme", pool="p", tier="paid", completion_tokens=3)
ERROR = ErrorInfo.of(ErrorCode.QUEUE_FULL, "full", retry_after_ms=100)

SAMPLES: dict[type, msgspec.Struct] = {
    ChatMessage: ChatMessage(role="user", content="hi"),
    SamplingParams: REQ.sampling,
    InferenceRequest: REQ,
    WorkItem: WorkItem(request=REQ, engine_priority=2, cache_salt="acme"),
    PullRequest: PullRequest(worker_id="w1", pool="p", max_items=4, free_slots=1),
    WorkBatch: WorkBatch(items=[WorkItem(request=REQ)]),
    Usage: USAGE,
    ErrorInfo: ERROR,
    TokenChunk: TokenChunk(request_id="r1", seq=0, text="a", usage=USAGE, error=ERROR),
    EngineLoad: EngineLoad(num_running=1),
    Started: Started(request_id="r1", worker_id="w1"),
    Finished: Finished(request_id="r1", worker_id="w1", usage=USAGE),
    Requeue: Requeue(request_id="r1", worker_id="w1", reason="drain"),
    Heartbeat: Heartbeat(worker_id="w1", pool="p", in_flight_ids=["r1"]),
    Cancel: Cancel(request_id="r1", tenant="acme"),
    PoolInfoRequest: PoolInfoRequest(tenant="acme"),
    PoolInfo: PoolInfo(pool="p", tiers=["paid"], tier="paid", max_tokens=8),
    HeartbeatAck: HeartbeatAck(known=False, epoch=3, worker_timeout_ms=3500),
    Continuation: Continuation(generated_token_ids=[5, 6], next_seq=2, num_preemptions=1),
    Preempt: Preempt(request_id="r1", worker_id="w1", epoch=2,
                     replacement=WorkItem(request=REQ, engine_priority=2, cache_salt="acme")),
    Preempted: Preempted(request_id="r1", worker_id="w1",
                         resume=Continuation(generated_token_ids=[5], next_seq=1)),
    StatusRequest: StatusRequest(request_id="r1", tenant="acme", request_ids=["r1", "r2"]),
    RequestStatus: RequestStatus(request_id="r1", state="ended", attempt=1, error=ERROR),
    StatusBatch: StatusBatch(statuses=[RequestStatus(request_id="r1", state="queued")]),
    LoadStats: LoadStats(share=0.5, num_queued=3, queue_wait_p50_ms=1.5, num_rejected=1),
    TierStats: TierStats(tier="paid", floor_share=0.3, share=0.4, ttft_p99_ms=20.0),
    TenantStats: TenantStats(tenant="acme", tier="paid", weight=2.0, fair_share=0.25),
    PoolStats: PoolStats(pool="p", ts_ms=5, epoch=2, num_tenants_active=1,
                         tiers=[TierStats(tier="paid", num_in_flight=2)],
                         tenants=[TenantStats(tenant="acme", tier="paid", share=0.1)]),
}


def _message_types() -> list[type]:
    found = {obj for module in (protocol, errors) for obj in vars(module).values()
             if inspect.isclass(obj) and issubclass(obj, msgspec.Struct)
             and obj is not msgspec.Struct}
    return sorted(found, key=lambda t: t.__name__)


def _with_unknown_fields(value: object) -> object:
    """Add a future field to every object, nested ones included."""
    if isinstance(value, dict):
        out = {k: _with_unknown_fields(v) for k, v in value.items()}
        out["logprobs_from_the_future"] = {"top_k": 5, "nested": [1, "x"]}
        return out
    if isinstance(value, list):
        return [_with_unknown_fields(v) for v in value]
    return value


def test_every_message_type_has_a_sample():
    assert set(_message_types()) == set(SAMPLES), "add the new message type to SAMPLES"


@pytest.mark.parametrize("typ", _message_types(), ids=lambda t: t.__name__)
def test_unknown_future_fields_are_ignored(typ):
    sample = SAMPLES[typ]
    raw = msgspec.json.decode(msgspec.json.encode(sample))
    data = msgspec.json.encode(_with_unknown_fields(raw))
    assert msgspec.json.decode(data, type=typ) == sample


@pytest.mark.parametrize("typ", _message_types(), ids=lambda t: t.__name__)
def test_messages_without_optional_fields_decode_with_defaults(typ):
    sample = SAMPLES[typ]
    required = {f.encode_name for f in msgspec.structs.fields(typ) if f.required}
    raw = msgspec.json.decode(msgspec.json.encode(sample))
    oldest = {k: v for k, v in raw.items() if k in required or k == "type"}
    decoded = msgspec.json.decode(msgspec.json.encode(oldest), type=typ)
    for f in msgspec.structs.fields(typ):
        if not f.required:
            default = f.default_factory() if f.default is msgspec.NODEFAULT else f.default
            assert getattr(decoded, f.name) == default, f.name


def test_protocol_decoders_accept_a_newer_request():
    """The module's own decoders (what the dispatcher and worker call) follow suit."""
    raw = msgspec.json.decode(protocol.encode(REQ))
    raw["logprobs"] = 5  # the example from the issue: a producer one version ahead
    raw["sampling"]["min_p"] = 0.1
    assert protocol.decode_request(msgspec.json.encode(raw)) == REQ
    del raw["sampling"]
    assert protocol.decode_request(msgspec.json.encode(raw)).sampling == SamplingParams()


def test_an_error_code_from_a_newer_sender_still_decodes():
    chunk = TokenChunk(request_id="r1", seq=0, error=ERROR)
    raw = msgspec.json.decode(protocol.encode(chunk))
    raw["error"]["code"] = "quota_exceeded_somewhere_new"
    decoded = protocol.decode_chunk(msgspec.json.encode(raw))
    assert decoded.error.code is ErrorCode.INTERNAL and decoded.error.message == "full"
    assert decoded.error.retryable and decoded.error.retry_after_ms == 100  # as sent
    assert protocol.decode_chunk(protocol.encode(chunk)).error.code is ErrorCode.QUEUE_FULL


def test_invalid_values_are_still_refused():
    raw = msgspec.json.decode(protocol.encode(REQ))
    raw["tenant"] = "bad tenant!"
    with pytest.raises(ProtocolError) as err:
        protocol.decode_request(msgspec.json.encode(raw))
    assert err.value.code is ErrorCode.MALFORMED


def test_request_spec_fields_are_request_fields():
    """RequestSpec is copied into InferenceRequest by name: the two must not drift."""
    spec_fields = {f.name: f.type for f in msgspec.structs.fields(RequestSpec)}
    req_fields = {f.name: f.type for f in msgspec.structs.fields(InferenceRequest)}
    assert set(spec_fields) <= set(req_fields)
    spec = RequestSpec(tenant="acme", pool="p", prompt="hi", priority=3,
                       sampling=SamplingParams(max_tokens=9))
    req = spec.to_request(request_id="r9", tier="paid", reply_to="fl.inbox.o.r9", created_ms=1)
    assert (req.tenant, req.pool, req.tier, req.prompt, req.priority) == ("acme", "p", "paid",
                                                                          "hi", 3)
    assert req.sampling.max_tokens == 9 and req.request_id == "r9"


def test_one_error_base_carries_its_wire_form():
    from gpu_worker.engine import EngineError
    from producer.client import RequestError
    from streamer.errors import EdgeError

    for cls in (ProtocolError, RequestError, EdgeError, EngineError):
        assert issubclass(cls, FairlaneError)
    exc = RequestError("full", ErrorCode.QUEUE_FULL, retry_after_ms=100)
    assert exc.info() == ERROR and exc.error == ERROR and exc.retryable
    assert RequestError.from_info(ERROR).error == ERROR
    assert str(exc) == "queue_full: full"
    edge = EdgeError.of(exc)
    assert (edge.status, edge.code, edge.retry_after_ms) == (429, ErrorCode.QUEUE_FULL, 100)
    assert EngineError("boom").info().code is ErrorCode.ENGINE_ERROR
