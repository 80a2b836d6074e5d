"""Migration: continue a stream on another worker from the tokens its caller has read.

When a stream's worker is lost (`worker_lost`) or the stream goes silent with nobody
vouching for it (`stream_lost`), `RequestStream` asks its client to resume it, within
the client's `max_resumes` budget (DESIGN.md section 5b). The next attempt of the same
request id is published with a `Continuation`: the output token ids read so far and
the next `seq`. The worker that takes it re-prefills prompt + those tokens and numbers
its chunks from that `seq`, so the caller iterates one unbroken stream.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import msgspec
import structlog

from fairlane.protocol import Continuation, ErrorInfo, encode
from fairlane.runtime import now_ms
from fairlane.subjects import REPLY_HEADER
from fairlane.trace import TRACEPARENT_HEADER, traceparent_or_new
from producer.auth import guard_publish
from producer.watch import dedupe_key

if TYPE_CHECKING:
    from producer.client import FairlaneClient
    from producer.stream import RequestStream

log = structlog.get_logger("producer.client")


async def resume_stream(client: FairlaneClient, stream: RequestStream, error: ErrorInfo) -> bool:
    """Continue `stream` on another worker from the tokens it has read: publish
    its next attempt with a `Continuation`. The stream stays the same object and
    its chunks continue at the next `seq`. False if the fleet refused it."""
    base = stream._request
    assert base is not None
    req = msgspec.structs.replace(
        base, attempt=stream.attempt + 1, created_ms=now_ms(),
        resume=Continuation(generated_token_ids=list(stream._token_ids),
                            next_seq=stream._next_seq,
                            num_preemptions=base.resume.num_preemptions if base.resume else 0))
    # Drop what the failed attempt may still have queued (its error chunk).
    while not stream._queue.empty():
        stream._queue.get_nowait()
    stream.failure = None
    stream._ended_upstream = False
    stream._unvouched_since_s = None
    stream._last_chunk_s = asyncio.get_running_loop().time()
    stream.attempt = req.attempt
    stream._resumed_at_seq = stream._next_seq
    stream.num_resumes += 1
    client.num_resumes += 1
    log.info("stream_resuming", request_id=req.request_id, attempt=req.attempt,
             after=str(error.code), num_tokens=len(stream._token_ids),
             next_seq=stream._next_seq)
    client._streams[req.request_id] = stream
    try:
        subject = client.subjects.request(req.pool, req.tier, req.tenant)
        # As a first submit: a publish whose PubAck was lost (a stream-leader election)
        # is sent again with the same message id, never turned into yet another attempt
        # (which would run beside this one if it was stored).
        ack = await guard_publish(client.nc, subject, lambda: client.js.publish(
            subject, encode(req), headers={
                "Nats-Msg-Id": dedupe_key(req.request_id, req.attempt),
                REPLY_HEADER: req.reply_to,
                # The same trace as the first attempt: one request, one trace.
                TRACEPARENT_HEADER: traceparent_or_new(stream.traceparent),
            }))
    except Exception as exc:  # the broker refused it: the caller gets the error
        log.warning("stream_resume_failed", request_id=req.request_id, error=repr(exc))
        stream.failure = error
        return False
    client._remember(req.request_id, req.attempt)
    if getattr(ack, "duplicate", False):  # this attempt already runs: attach to it
        log.info("stream_resume_attached", request_id=req.request_id)
    stream._request = req
    return True
