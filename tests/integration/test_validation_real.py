"""Every `check_request` rejection, through the real dispatcher, for a request
published straight to JetStream (bypassing the producer's own check): each gets its
error chunk with the right code on the reply subject."""

from __future__ import annotations

import uuid

import pytest

from dispatcher.config import DispatcherSettings
from dispatcher.service import Dispatcher
from fairlane.poolconfig import SchedulerConfig
from fairlane.protocol import ChatMessage, ErrorCode, decode_chunk, encode
from fairlane.subjects import REPLY_HEADER, Subjects
from tests.helpers import request

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

INV, LONG = ErrorCode.INVALID_REQUEST, ErrorCode.PROMPT_TOO_LONG

CASES = {
    "no_prompt": ({"prompt": None}, INV),
    "two_prompts": ({"prompt_token_ids": [1, 2]}, INV),
    "blank_prompt": ({"prompt": " \n"}, INV),
    "empty_messages": ({"prompt": None, "messages": []}, INV),
    "blank_messages": ({"prompt": None, "messages": [ChatMessage(role="user", content=" ")]}, INV),
    "empty_token_ids": ({"prompt": None, "prompt_token_ids": []}, INV),
    "negative_token_id": ({"prompt": None, "prompt_token_ids": [1, -1]}, INV),
    "max_tokens_zero": ({"max_tokens": 0}, INV),
    "max_tokens_over": ({"max_tokens": 513}, INV),
    "temperature_high": ({"temperature": 2.5}, INV),
    "temperature_negative": ({"temperature": -0.1}, INV),
    "top_p_zero": ({"top_p": 0.0}, INV),
    "top_p_over": ({"top_p": 1.5}, INV),
    "too_many_stops": ({"stop": [f"s{i}" for i in range(9)]}, INV),
    "empty_stop": ({"stop": [""]}, INV),
    "negative_expected_output": ({"expected_output_tokens": -1}, INV),
    "prompt_too_many_chars": ({"prompt": "x" * 101}, LONG),
    "prompt_too_many_tokens": ({"prompt": None, "prompt_token_ids": [1] * 32_769}, LONG),
}


@pytest.fixture
async def env(nats_server, nc, uid):
    subjects = Subjects(f"t{uid}")
    settings = DispatcherSettings(
        nats_url=nats_server.url, prefix=subjects.prefix, pool="p", worker_timeout_ms=600,
        housekeeping_ms=50, max_tokens=512, max_prompt_chars=100, ack_wait_s=5,
    )
    dispatcher = Dispatcher(settings, SchedulerConfig(policy="fifo"))
    await dispatcher.start()
    yield subjects
    await dispatcher.stop()


@pytest.mark.parametrize("name", list(CASES))
async def test_check_request_rejection_reaches_the_client(env, nc, name):
    subjects = env
    body, code = CASES[name]
    rid = uuid.uuid4().hex
    reply = f"{subjects.prefix}.inbox.o{rid[:6]}.{rid}"
    fields = dict(request_id=rid, tenant="acme", pool="p", tier="standard",
                  reply_to=reply, prompt="hi", max_tokens=8)
    data = encode(request(**{**fields, **body}))
    sub = await nc.subscribe(reply)
    js = nc.jetstream()
    await js.publish(subjects.request("p", "standard", "acme"), data,
                     headers={"Nats-Msg-Id": rid, REPLY_HEADER: reply})
    msg = await sub.next_msg(timeout=5)
    chunk = decode_chunk(msg.data)
    assert chunk.error is not None, chunk
    assert chunk.error.code == code, (chunk.error.code, chunk.error.message)
    assert chunk.error.message
