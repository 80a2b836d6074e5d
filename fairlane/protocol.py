"""Every message that crosses NATS, as msgspec Structs (DESIGN.md section 3).

Rules for changing this module (msgspec schema evolution): append new fields with
defaults, never reorder or retype existing ones, never reuse a tag. Decoders IGNORE
unknown fields, so a newer producer's extra field (say ``logprobs``) reaches an older
dispatcher or worker as a request it still serves, and mixed versions interoperate
during a rolling upgrade; strictness belongs at the public edge (`streamer.schema`).
`tests/unit/test_protocol_evolution.py` holds every message type to both rules. All
messages are JSON so that an operator can publish or read one with the `nats` CLI.

Decoding never raises a bare msgspec error: every decoder here raises
`ProtocolError` (code ``malformed`` for unparsable bytes or a schema violation).
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta, Struct

# The error vocabulary lives in the dependency-free kernel module; re-exported here
# because ErrorInfo is part of the wire protocol.
from fairlane.errors import RETRYABLE_CODES as RETRYABLE_CODES
from fairlane.errors import ErrorCode, ErrorInfo, FairlaneError

ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"

# Ids that become subject tokens: no dots, no wildcards, no whitespace.
TenantId = Annotated[str, Meta(pattern=ID_PATTERN)]
TierId = Annotated[str, Meta(pattern=ID_PATTERN)]
PoolId = Annotated[str, Meta(pattern=ID_PATTERN)]
# Request ids double as JetStream `Nats-Msg-Id` (dedupe key) and as the last token of
# the reply subject, so the same safe alphabet applies.
RequestId = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,128}$")]
WorkerId = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.:-]{1,128}$")]


class ProtocolError(FairlaneError):
    """A payload could not be decoded or validated (code ``malformed`` by default)."""

    default_code = ErrorCode.MALFORMED


class ChatMessage(Struct, kw_only=True):
    role: Annotated[str, Meta(pattern=r"^(system|user|assistant|tool|developer)$")]
    content: str


# --- request path ---------------------------------------------------------------------


class SamplingParams(Struct, kw_only=True, omit_defaults=True):
    """How to sample a request's output: built once at the edge, mapped to its own
    parameters by each engine adapter. A new knob is appended here with a default
    (and mapped in `streamer.schema` and the engines); nothing between them changes.
    Ranges are checked by `fairlane.validation.check_request`."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = []
    seed: int | None = None


class Continuation(Struct, kw_only=True, omit_defaults=True):
    """Where a request resumes: the output its client already received (DESIGN.md 5b).

    Set on an `InferenceRequest` that continues an earlier run of the same request:
    preempted by the dispatcher to free a slot for a tenant below its fair share, or
    resubmitted by the client library after the worker running it died. The engine
    re-prefills prompt + ``generated_token_ids`` (cheap where its prefix cache still
    holds them), generates at most ``sampling.max_tokens - len(generated_token_ids)``
    more, and the worker numbers its chunks from ``next_seq``, so the client's stream
    just continues: no duplicate, no gap, no error.
    """

    generated_token_ids: list[int] = []
    next_seq: int = 0  # seq of the first chunk the resumed run sends
    num_preemptions: int = 0  # times this request was preempted so far


class InferenceRequest(Struct, kw_only=True, omit_defaults=True):
    """One generation request, published to ``fl.req.<pool>.<tier>.<tenant>``.

    Exactly one of ``prompt``, ``messages`` or ``prompt_token_ids`` is set (checked by
    `fairlane.validation.check_request`, not by the schema, so the error says why).
    """

    request_id: RequestId
    tenant: TenantId
    pool: PoolId
    tier: TierId
    reply_to: Annotated[str, Meta(min_length=1, max_length=256)]
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    prompt_token_ids: list[int] | None = None
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    priority: int = 0  # within the tenant: higher first
    deadline_ms: int | None = None  # absolute, unix epoch milliseconds
    ttft_budget_ms: int | None = None  # relative to created_ms; throttling uses it
    created_ms: int = 0  # unix epoch ms when the client submitted it
    return_token_ids: bool = False
    # Expected output length for cost estimation; defaults to sampling.max_tokens.
    expected_output_tokens: int | None = None
    # 0 for the first submission of `request_id`; a client's deliberate retry of an
    # ended request (after `worker_lost`, say) increments it. The JetStream dedupe key
    # is `request_id` for attempt 0 and `request_id.attempt` after, and the dispatcher
    # answers a repeat of an ended attempt with its status instead of generating again.
    attempt: int = 0
    # A continuation of an earlier run (preemption or migration): None = from scratch.
    resume: Continuation | None = None


class WorkItem(Struct, kw_only=True, omit_defaults=True):
    """A request handed to a worker, with what the dispatcher decided about it."""

    request: InferenceRequest
    engine_priority: int = 0  # vLLM convention: lower value runs first
    dispatched_ms: int = 0
    queue_ms: int = 0  # time it waited in the dispatcher
    cache_salt: str | None = None
    # The JetStream ack subject of the request's message: the worker acks it at the
    # first token, so "started work is not replayed" holds even if the dispatcher dies.
    ack_subject: str | None = None
    traceparent: str = ""  # W3C trace context (its JetStream message's header; "": none)


class PullRequest(Struct, kw_only=True):
    """Worker -> dispatcher on ``fl.work.<pool>``: "I have room for this much"."""

    worker_id: WorkerId
    pool: PoolId
    max_items: Annotated[int, Meta(ge=1, le=4096)]
    free_kv_tokens: int = 0
    wait_ms: Annotated[int, Meta(ge=0, le=60_000)] = 1_000  # long-poll budget
    # New at every worker process start: tells a restarted worker (same worker_id)
    # from the process it replaces. "" from workers that predate incarnations.
    incarnation: str = ""
    # Of `max_items`, how many would start at once (engine slots free); the rest is
    # prefetch, which waits inside the engine for a slot to turn over. A pull with no
    # free slot does not stop the dispatcher from preempting for a waiting tenant.
    # None: a worker that predates this field (all of max_items counts as free).
    free_slots: int | None = None


class WorkBatch(Struct, kw_only=True, omit_defaults=True):
    items: list[WorkItem] = []
    # The lease epoch of the dispatcher that answered: a worker refuses a batch whose
    # epoch is older than the newest it has seen (a deposed leader's late answer).
    epoch: int = 0


# --- token path -----------------------------------------------------------------------


class Usage(Struct, kw_only=True, omit_defaults=True):
    """The metering record of one finished request (also published to FL_USAGE)."""

    request_id: str
    tenant: str
    pool: str
    tier: str
    worker_id: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    queue_ms: int = 0
    ttft_ms: float = 0.0  # from dispatch to first token, measured on the worker
    e2e_ms: float = 0.0  # from dispatch to last token
    kv_token_seconds: float = 0.0  # integral of this sequence's KV tokens over time
    finish_reason: str = ""
    ts_ms: int = 0
    # Which attempt of the request this is the record of (a resumed continuation is
    # the next attempt; FL_USAGE keeps one record per request id).
    attempt: int = 0
    # Of this run's prefill, tokens re-computed for a continuation (not served from
    # the prefix cache): the platform's cost of preemption and migration, not billed.
    num_recomputed_tokens: int = 0


class TokenChunk(Struct, kw_only=True, omit_defaults=True):
    """One coalesced piece of a token stream, sent to the request's ``reply_to``.

    ``seq`` starts at 0 and increases by one per chunk; receivers drop duplicates and
    treat a gap as an error. The last chunk has ``finish_reason`` (and ``usage``), or
    ``error``. An error chunk is terminal and accepted whatever its ``seq``: the
    dispatcher sends some (``expired``, ``worker_lost``) without knowing how many
    chunks the worker already sent.
    """

    request_id: str
    seq: int
    text: str = ""
    token_ids: list[int] | None = None
    num_tokens: int = 0
    finish_reason: str | None = None
    usage: Usage | None = None
    error: ErrorInfo | None = None
    # The attempt (InferenceRequest.attempt) the sender served; None from a sender that
    # does not say (older workers, the dispatcher's error chunks). A receiver that has
    # moved on to a later attempt drops a stamped chunk of an earlier one: a worker cut
    # off by a partition can deliver its last chunks after the heal, when the client
    # already resumed elsewhere, and they must not mix into the new attempt's stream.
    attempt: int | None = None

    @property
    def is_last(self) -> bool:
        return self.finish_reason is not None or self.error is not None


# --- events: worker -> dispatcher on fl.evt.<pool> -------------------------------------


class EngineLoad(Struct, kw_only=True, omit_defaults=True):
    num_running: int = 0
    num_waiting: int = 0
    max_num_seqs: int = 0
    kv_tokens_used: int = 0
    kv_tokens_total: int = 0


class Started(Struct, tag="started", kw_only=True):
    request_id: str
    worker_id: str
    ts_ms: int = 0
    incarnation: str = ""
    # A continuation (preempted or migrated) started: it re-prefills what its client
    # already has and generates only the rest; not a second generation from scratch.
    resumed: bool = False


class Finished(Struct, tag="finished", kw_only=True, omit_defaults=True):
    request_id: str
    worker_id: str
    usage: Usage | None = None
    error: ErrorInfo | None = None
    ts_ms: int = 0
    incarnation: str = ""


class Requeue(Struct, tag="requeue", kw_only=True):
    """Worker hands back a request it accepted but never started (drain, no room)."""

    request_id: str
    worker_id: str
    reason: str = ""
    incarnation: str = ""


class Heartbeat(Struct, tag="heartbeat", kw_only=True, omit_defaults=True):
    """Sent as a NATS request: the dispatcher answers with a `HeartbeatAck`. A worker
    with no acknowledged heartbeat within its timeout stops its work by itself."""

    worker_id: str
    pool: str
    load: EngineLoad = msgspec.field(default_factory=EngineLoad)
    in_flight_ids: list[str] = []
    draining: bool = False
    interval_ms: int = 1_000
    ts_ms: int = 0
    incarnation: str = ""
    # Requests the worker already started (acked at the first token): the started
    # state survives a lost `Started` event.
    started_ids: list[str] = []


class HeartbeatAck(Struct, kw_only=True, omit_defaults=True):
    """Dispatcher -> worker, the reply to a heartbeat."""

    # False: this incarnation was declared lost and its work handed elsewhere; the
    # worker aborts everything without publishing tokens or usage, and rejoins as a
    # new incarnation.
    known: bool = True
    epoch: int = 0  # the answering dispatcher's lease epoch
    # After how long without a heartbeat the dispatcher declares a worker lost: the
    # worker stops publishing for its work before that (its lease), 0 = not told.
    worker_timeout_ms: int = 0


class Preempted(Struct, tag="preempted", kw_only=True, omit_defaults=True):
    """Worker -> dispatcher: it stopped a running request on the dispatcher's `Preempt`
    and hands back where it stands. The dispatcher queues the continuation at the front
    of the tenant's queue; the client sees a pause, then the next ``seq``."""

    request_id: str
    worker_id: str
    resume: Continuation = msgspec.field(default_factory=Continuation)
    incarnation: str = ""
    ts_ms: int = 0


WorkerEvent = Started | Finished | Requeue | Heartbeat | Preempted


class Preempt(Struct, kw_only=True, omit_defaults=True):
    """Dispatcher -> workers on ``fl.preempt.<pool>``: stop this request and report
    `Preempted` (the worker running it acts; others ignore it)."""

    request_id: str
    worker_id: str
    epoch: int = 0  # the leader's lease epoch: a deposed leader's order is ignored
    # The waiting request the freed slot is for, dispatched to this worker with the
    # order: started at once, before anything already queued in its engine can take
    # the slot. None: the slot goes to the worker's next pull.
    replacement: WorkItem | None = None



# A cancel with this reason stops an attempt whose client resumes it elsewhere (chunks
# were lost on the way): the worker publishes no usage for it, since the
# continuation's record covers the whole request.
GAP_CANCEL_REASON = "stream_gap"


class Cancel(Struct, kw_only=True, omit_defaults=True):
    """On ``fl.cancel.<pool>``: drop it if queued, abort it if running."""

    request_id: str
    tenant: str = ""
    reason: str = "client_gone"


# --- request status: client -> dispatcher on fl.status.<pool> --------------------------


class StatusRequest(Struct, kw_only=True):
    request_id: RequestId
    tenant: str = ""
    # A batch: one round trip for every silent stream of a client (a flood of queued
    # requests would otherwise ask one by one). Answered with a `StatusBatch` of these
    # ids in order; a dispatcher that predates batches answers `request_id` alone.
    request_ids: list[RequestId] = []


MAX_STATUS_BATCH = 1_000  # ids per StatusRequest (~70 KB of answers)


class RequestState(enum.StrEnum):
    QUEUED = "queued"  # waiting in the dispatcher (or held back after its restart)
    RUNNING = "running"  # dispatched to a worker
    ENDED = "ended"  # finished or failed recently (within the dedupe window)
    UNKNOWN = "unknown"  # never seen, or ended long ago


class RequestStatus(Struct, kw_only=True, omit_defaults=True):
    """Where a request is: what a silent stream or a repeated submit is told."""

    request_id: str
    # A plain string on the wire (a newer state decodes); see `RequestState`.
    state: str
    attempt: int = 0
    worker_id: str = ""
    error: ErrorInfo | None = None  # ENDED: how it failed (None: finished normally)
    # QUEUED/RUNNING: where its tokens go, so a client whose publish was answered
    # "duplicate" can tell its own earlier copy (attach) from another client's.
    reply_to: str = ""


class StatusBatch(Struct, kw_only=True):
    """The answer to a batch `StatusRequest`: one status per id asked, in order."""

    statuses: list[RequestStatus] = []


# --- pool info: producer -> dispatcher on fl.info.<pool> --------------------------------


class PoolInfoRequest(Struct, kw_only=True):
    tenant: TenantId


class PoolInfo(Struct, kw_only=True, omit_defaults=True):
    """What a producer needs to publish correctly: the tenant's tier and the limits."""

    pool: str
    tiers: list[str] = []
    tenant: str = ""
    tier: str | None = None  # None: the tenant may not use this pool
    max_tokens: int = 0
    max_prompt_tokens: int = 0
    max_prompt_chars: int = 0


# --- pool stats: dispatcher -> dashboards on fl.stats.<pool> (see dispatcher.stats) ----


class LoadStats(Struct, kw_only=True, omit_defaults=True):
    """A tier's or tenant's load in a `PoolStats` (counts, percentiles: its window_ms). By
    the dispatcher: queue wait = fetch to dispatch; TTFT = fetch to the Started event."""

    share: float = 0.0  # fraction of the pool's recently dispatched cost
    num_queued: int = 0
    num_in_flight: int = 0
    queue_wait_p50_ms: float | None = None
    queue_wait_p99_ms: float | None = None
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    num_rejected: int = 0  # refused at admission or dropped from the queue
    num_preempted: int = 0  # running requests preempted


class TierStats(LoadStats, kw_only=True, omit_defaults=True):
    tier: str
    floor_share: float = 0.0  # its reserved fraction of dispatched cost (soft)
    num_tenants_active: int = 0  # with requests queued or in flight


class TenantStats(LoadStats, kw_only=True, omit_defaults=True):
    tenant: str
    tier: str
    weight: float = 1.0
    fair_share: float = 0.0  # weight / active weight of its tier x the tier's share


class PoolStats(Struct, kw_only=True, omit_defaults=True):
    """A pool's snapshot from its leader every --stats-interval-s (core NATS). A row per
    tier; tenants only while recently active, busiest first and capped (stays small)."""

    pool: str
    ts_ms: int = 0  # wall clock, unix epoch ms
    epoch: int = 0  # the publishing leader's lease epoch
    policy: str = ""
    cost_model: str = ""  # the unit of the shares
    window_ms: int = 0  # what the windowed figures cover
    share_window_ms: int = 0  # the decay window of shares (the tier floors')
    num_queued: int = 0
    num_in_flight: int = 0
    num_workers: int = 0
    num_tenants_active: int = 0
    num_tenants_omitted: int = 0  # recently active tenants beyond the row cap
    tiers: list[TierStats] = []
    tenants: list[TenantStats] = []


# --- codecs ---------------------------------------------------------------------------

_encoder = msgspec.json.Encoder()

T = TypeVar("T")


def encode(msg: Struct) -> bytes:
    return _encoder.encode(msg)


class _Decoder:
    """A msgspec JSON decoder that raises ProtocolError with the type's name."""

    def __init__(self, typ: Any, name: str) -> None:
        self._dec = msgspec.json.Decoder(typ)
        self._name = name

    def __call__(self, data: bytes) -> Any:
        try:
            return self._dec.decode(data)
        except msgspec.ValidationError as exc:
            raise ProtocolError(f"invalid {self._name}: {exc}") from None
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"{self._name} is not valid JSON: {exc}") from None


decode_request = _Decoder(InferenceRequest, "InferenceRequest")
decode_pull = _Decoder(PullRequest, "PullRequest")
decode_work_batch = _Decoder(WorkBatch, "WorkBatch")
decode_chunk = _Decoder(TokenChunk, "TokenChunk")
decode_event = _Decoder(WorkerEvent, "WorkerEvent")
decode_cancel = _Decoder(Cancel, "Cancel")
decode_preempt = _Decoder(Preempt, "Preempt")
decode_usage = _Decoder(Usage, "Usage")
decode_pool_info_request = _Decoder(PoolInfoRequest, "PoolInfoRequest")
decode_pool_info = _Decoder(PoolInfo, "PoolInfo")
decode_heartbeat_ack = _Decoder(HeartbeatAck, "HeartbeatAck")
decode_status_request = _Decoder(StatusRequest, "StatusRequest")
decode_status = _Decoder(RequestStatus, "RequestStatus")
decode_pool_stats = _Decoder(PoolStats, "PoolStats")
_decode_status_batch = _Decoder(StatusBatch, "StatusBatch")


def decode_statuses(data: bytes) -> list[RequestStatus]:
    """A status answer: a batch's statuses, or the one status of a single answer (a
    dispatcher that predates batches answers a batch request that way)."""
    batch = _decode_status_batch(data)
    return batch.statuses or [decode_status(data)]


def peek_reply_fields(data: bytes) -> tuple[str | None, str | None]:
    """Best effort (request_id, reply_to) from a payload that failed to decode, so the
    sender of a malformed request can still be told why it was refused."""
    try:
        raw = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return None, None
    if not isinstance(raw, dict):
        return None, None
    rid, reply = raw.get("request_id"), raw.get("reply_to")
    return (rid if isinstance(rid, str) else None, reply if isinstance(reply, str) else None)
