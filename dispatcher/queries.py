"""Answers to questions clients ask the pool's leading dispatcher (request/reply).

- `fl.info.<pool>`: a producer asks which tier a tenant is in and the pool's limits;
- `fl.status.<pool>`: where a request is (queued, running, ended, unknown) — what a
  silent token stream or a repeated submit is told, so no client waits forever; a
  batch of ids at once (a client's every silent stream in one round trip).

Both only read the pure core; they are kept out of the service shell for size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog
from nats.aio.msg import Msg

from fairlane.protocol import (
    MAX_STATUS_BATCH,
    ErrorInfo,
    PoolInfo,
    ProtocolError,
    RequestStatus,
    StatusBatch,
    decode_pool_info_request,
    decode_status_request,
    encode,
)
from fairlane.runtime import mono_ms

if TYPE_CHECKING:
    from dispatcher.service import Dispatcher

log = structlog.get_logger(__name__)


async def answer_info(d: Dispatcher, msg: Msg) -> None:
    if not msg.reply:
        return
    try:
        tenant = decode_pool_info_request(msg.data).tenant
    except ProtocolError as exc:
        log.warning("bad_info_request", error=exc.message)
        tenant = ""
    tcfg = d.scheduler.tenant_config(tenant) if tenant else None
    info = PoolInfo(
        pool=d.settings.pool, tiers=[t.name for t in d.scheduler.config.tiers],
        tenant=tenant, tier=tcfg.tier if tcfg else None,
        max_tokens=d.limits.max_tokens, max_prompt_tokens=d.limits.max_prompt_tokens,
        max_prompt_chars=d.limits.max_prompt_chars,
    )
    await d.nc.publish(msg.reply, encode(info))


async def answer_status(d: Dispatcher, msg: Msg) -> None:
    if not msg.reply:
        return
    try:
        ask = decode_status_request(msg.data)
    except ProtocolError as exc:
        log.warning("bad_status_request", error=exc.message)
        return
    now = mono_ms()
    if ask.request_ids:
        ids = ask.request_ids[:MAX_STATUS_BATCH]
        answer = StatusBatch(statuses=[_status(d, rid, now) for rid in ids])
        await d.nc.publish(msg.reply, encode(answer))
    else:
        await d.nc.publish(msg.reply, encode(_status(d, ask.request_id, now)))


def _status(d: Dispatcher, request_id: str, now: float) -> RequestStatus:
    st = d.core.status(request_id, now)
    err = st.error
    req = d.scheduler.queued_request(request_id) or d.scheduler.in_flight_request(request_id)
    held = req.payload if req is not None else None
    return RequestStatus(
        request_id=request_id, state=st.state.value, attempt=st.attempt,
        worker_id=st.worker_id,
        error=err and ErrorInfo.of(err.code, err.message, err.retry_after_ms),
        reply_to=held.request.reply_to if held is not None else "")
