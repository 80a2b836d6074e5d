"""Pure parts of the streamer: request schemas, submissions, error mapping."""

from __future__ import annotations

import json

import msgspec
import pytest

from fairlane.protocol import ErrorCode, ErrorInfo
from streamer.errors import EdgeError, validation_message
from streamer.http_api import chat_submission, completion_submission, decode_body
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


def test_completion_prompt_forms():
    sub = completion_submission(decode_completion.decode(b'{"model":"m","prompt":"hi"}'))
    assert sub.prompt == "hi" and sub.prompt_token_ids is None
    sub = completion_submission(decode_completion.decode(b'{"model":"m","prompt":[5,6]}'))
    assert sub.prompt_token_ids == [5, 6]
    sub = completion_submission(decode_completion.decode(b'{"model":"m","prompt":["one"]}'))
    assert sub.prompt == "one"
    with pytest.raises(EdgeError) as e:
        completion_submission(decode_completion.decode(b'{"model":"m","prompt":["a", 1]}'))
    assert e.value.status == 400 and e.value.param == "prompt"


def test_chat_content_parts_and_stop_string():
    req = decode_chat.decode(json.dumps({
        "model": "m", "stop": "END", "max_completion_tokens": 7,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                  {"type": "text", "text": "b"}]}]}).encode())
    sub = chat_submission(req)
    assert sub.messages[0].content == "ab" and sub.stop == ["END"] and sub.max_tokens == 7
    req = decode_chat.decode(json.dumps({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}).encode())
    with pytest.raises(EdgeError, match="only 'text'"):
        chat_submission(req)


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
