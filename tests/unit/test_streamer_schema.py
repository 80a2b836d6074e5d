"""Pure parts of the streamer: request schemas, their mapping to RequestSpec, errors."""

from __future__ import annotations

import json

import msgspec
import pytest

from fairlane.protocol import ErrorCode, ErrorInfo
from streamer.errors import EdgeError, validation_message
from streamer.http_api import decode_body
from streamer.schema import (
    EndFrame,
    ErrorBody,
    ErrorFrame,
    TokenFrame,
    WsCancel,
    WsRequest,
    decode_chat,
    decode_client_frame,
    decode_completion,
    encode_frame,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def to_spec(body, default_max_tokens: int = 99):
    return body.to_spec(tenant="acme", tier="paid", pool="m",
                        default_max_tokens=default_max_tokens)


def test_completion_prompt_forms():
    spec = to_spec(decode_completion.decode(b'{"model":"m","prompt":"hi"}'))
    assert spec.prompt == "hi" and spec.prompt_token_ids is None
    assert (spec.tenant, spec.tier, spec.pool) == ("acme", "paid", "m")
    assert spec.sampling.max_tokens == 99  # the edge's default when the body has none
    spec = to_spec(decode_completion.decode(b'{"model":"m","prompt":[5,6]}'))
    assert spec.prompt_token_ids == [5, 6]
    spec = to_spec(decode_completion.decode(b'{"model":"m","prompt":["one"]}'))
    assert spec.prompt == "one"
    with pytest.raises(EdgeError) as e:
        to_spec(decode_completion.decode(b'{"model":"m","prompt":["a", 1]}'))
    assert e.value.status == 400 and e.value.param == "prompt"


def test_chat_content_parts_and_stop_string():
    req = decode_chat.decode(json.dumps({
        "model": "m", "stop": "END", "max_completion_tokens": 7,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                  {"type": "text", "text": "b"}]}]}).encode())
    spec = to_spec(req)
    assert spec.messages[0].content == "ab"
    assert spec.sampling.stop == ["END"] and spec.sampling.max_tokens == 7
    req = decode_chat.decode(json.dumps({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}).encode())
    with pytest.raises(EdgeError, match="only 'text'"):
        to_spec(req)


def test_every_body_maps_sampling_the_same_way():
    knobs = {"max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "stop": ["x"], "seed": 3,
             "priority": 2, "ttft_budget_ms": 500}
    bodies = [
        decode_completion.decode(json.dumps({"model": "m", "prompt": "p", **knobs})),
        decode_chat.decode(json.dumps(
            {"model": "m", "messages": [{"role": "user", "content": "p"}], **knobs})),
        decode_client_frame.decode(json.dumps({"type": "request", "id": "c", "prompt": "p",
                                               "return_token_ids": True, **knobs})),
    ]
    specs = [to_spec(b) for b in bodies]
    for spec in specs:
        assert msgspec.structs.asdict(spec.sampling) == {
            k: knobs[k] for k in ("max_tokens", "temperature", "top_p", "stop", "seed")}
        assert (spec.priority, spec.ttft_budget_ms) == (2, 500)
    assert specs[2].return_token_ids and specs[2].prompt == "p"


@pytest.mark.parametrize("body,needle", [
    (b"{", "not valid JSON"),
    (b"", "empty"),
    (b'{"model":"m","prompt":"x","temperature":2.5}', "temperature"),
    (b'{"model":"m","prompt":"x","top_p":0}', "top_p"),
    (b'{"model":"m","prompt":"x","n":3}', "n"),
    (b'{"model":"m","prompt":"x","seed":99999999999999999999999}', "seed"),
    (b'{"model":"m","prompt":"x","stop":["a","b","c","d","e","f","g","h","i"]}', "stop"),
    (b'{"model":"m","prompt":"x","tenant":"evil"}', "tenant"),
    (b'{"model":"m","prompt":"x","presence_penalty":0.5}', "presence_penalty"),
])
def test_bad_bodies_are_400_with_reason(body, needle):
    with pytest.raises(EdgeError) as e:
        decode_body(decode_completion, body)
    assert e.value.status == 400
    assert needle in e.value.message


def test_error_mapping_and_openai_shape():
    err = EdgeError.from_info(ErrorInfo.of(ErrorCode.QUEUE_FULL, "full", retry_after_ms=1500))
    assert err.status == 429 and err.headers() == {"Retry-After": "2"}
    assert err.openai_body() == {"error": {"message": "full", "type": "rate_limit_error",
                                           "param": None, "code": "queue_full"}}
    assert EdgeError.from_info(ErrorInfo.of(ErrorCode.WORKER_LOST, "x")).status == 503
    assert EdgeError.unauthorized().headers() == {"WWW-Authenticate": "Bearer"}


def test_validation_message_names_param():
    try:
        decode_completion.decode(b'{"model":"m","prompt":"x","max_tokens":0}')
    except msgspec.ValidationError as exc:
        msg, param = validation_message(exc)
    assert param == "max_tokens" and "max_tokens" in msg


def test_ws_frames_round_trip():
    assert isinstance(decode_client_frame.decode(b'{"type":"cancel","id":"a"}'), WsCancel)
    req = decode_client_frame.decode(b'{"type":"request","id":"a","prompt":"p","max_tokens":3}')
    assert isinstance(req, WsRequest) and req.max_tokens == 3
    assert json.loads(encode_frame(TokenFrame(id="a", seq=0, text="t"))) == {
        "type": "token", "id": "a", "seq": 0, "text": "t"}
    assert json.loads(encode_frame(EndFrame(id="a", finish_reason="stop"))) == {
        "type": "end", "id": "a", "finish_reason": "stop", "usage": None}
    assert json.loads(encode_frame(ErrorFrame(id=None, error=ErrorBody(code="c", message="m")))) \
        == {"type": "error", "id": None, "error": {"code": "c", "message": "m", "retryable": False,
                                             "retry_after_ms": None}}
