"""Pure parts of the streamer: request schemas, their mapping to RequestSpec, errors."""

from __future__ import annotations

import json

import msgspec
import pytest

from fairlane.protocol import (
    ChatMessage,
    ErrorCode,
    ErrorInfo,
    InferenceRequest,
    ProtocolError,
    SamplingParams,
)
from fairlane.validation import RequestLimits, check_request
from producer.stream import RequestError
from streamer.errors import EdgeError, validation_message
from streamer.http_api import decode_body, ignored_header
from streamer.schema import (
    ChatCompletionRequest,
    CompletionRequest,
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
    ignored_fields,
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


@pytest.mark.parametrize("body,message", [
    (b"{", "request body is not valid JSON"),
    (b"", "request body is empty: expected a JSON object"),
    (b"[]", "invalid request: expected an object, got an array"),
    (b'{"prompt":"x"}', "invalid request: missing required field 'model'"),
    (b'{"model":"m","prompt":"x","temperature":2.5}',
     "invalid request: temperature must be a number between 0 and 2, got 2.5"),
    (b'{"model":"m","prompt":"x","temperature":-1}',
     "invalid request: temperature must be a number between 0 and 2, got -1"),
    (b'{"model":"m","prompt":"x","temperature":"hot"}',
     "invalid request: temperature must be a number or null, got a string"),
    (b'{"model":"m","prompt":"x","top_p":0}',
     "invalid request: top_p must be a number greater than 0 and at most 1, got 0"),
    (b'{"model":"m","prompt":"x","max_tokens":0}',
     "invalid request: max_tokens must be an integer of at least 1, got 0"),
    (b'{"model":"m","prompt":"x","priority":5000}',
     "invalid request: priority must be an integer between -1000 and 1000, got 5000"),
    (b'{"model":"m","prompt":"x","seed":99999999999999999999999}', "invalid request: seed must be"),
    (b'{"model":"m","prompt":"x","stop":["a","b","c","d","e","f","g","h","i"]}',
     "invalid request: stop must have at most 8 items"),
    (b'{"model":"","prompt":"x"}', "invalid request: model must not be empty"),
    (b'{"model":"m","prompt":5}',
     "invalid request: prompt must be a string or an array, got an integer"),
])
def test_bad_bodies_are_400_saying_what_is_allowed(body, message):
    with pytest.raises(EdgeError) as e:
        decode_body(decode_completion, body)
    assert e.value.status == 400
    assert e.value.message.startswith(message), e.value.message


def test_out_of_range_messages_name_the_whole_range():
    """msgspec names only the bound that was crossed; the message says the range (as
    vLLM's does: "temperature must be in [0, 2], got 3"), for every bounded field."""
    from streamer.schema import FIELD_RANGES
    assert FIELD_RANGES == {
        "max_tokens": "of at least 1", "max_completion_tokens": "of at least 1",
        "temperature": "between 0 and 2", "top_p": "greater than 0 and at most 1",
        "seed": "between -9223372036854775808 and 9223372036854775807",
        "priority": "between -1000 and 1000", "ttft_budget_ms": "between 1 and 3600000"}
    with pytest.raises(EdgeError) as e:
        decode_body(decode_chat, json.dumps({**CHAT, "max_completion_tokens": -3}).encode())
    assert e.value.message == ("invalid request: max_completion_tokens must be an integer of "
                               "at least 1, got -3")
    # A long value is not quoted back.
    with pytest.raises(EdgeError) as e:
        decode_body(decode_completion,
                    b'{"model":"m","prompt":"p","top_p":' + b"1" * 50 + b'.5}')
    assert e.value.message == ("invalid request: top_p must be a number greater than 0 and at "
                               "most 1")
    # A websocket frame's message says the same.
    frame = b'{"type":"request","id":"a","prompt":"p","temperature":9}'
    with pytest.raises(msgspec.ValidationError) as e:
        decode_client_frame.decode(frame)
    assert validation_message(e.value, ranges=FIELD_RANGES, body=frame) == (
        "temperature must be a number between 0 and 2, got 9", "temperature")


def test_null_sampling_knobs_are_the_defaults():
    """OpenAI's API takes null for "the default" (LangChain and others send it)."""
    req = decode_body(decode_chat, json.dumps(
        {**CHAT, "temperature": None, "top_p": None, "stream": None, "max_tokens": None,
         "seed": None, "stop": None, "n": None, "presence_penalty": None}).encode())
    spec = to_spec(req)
    assert (spec.sampling.temperature, spec.sampling.top_p) == (1.0, 1.0)
    assert not req.stream and spec.sampling.max_tokens == 99 and spec.sampling.stop == []
    req = decode_body(decode_completion, b'{"model":"m","prompt":"p","echo":null}')
    assert to_spec(req).prompt == "p"


def test_bad_chat_role_lists_the_roles():
    with pytest.raises(EdgeError) as e:
        decode_body(decode_chat, b'{"model":"m","messages":[{"role":"robot","content":"x"}]}')
    assert e.value.param == "messages[0].role"
    assert e.value.message == ("invalid request: messages[0].role has an invalid value 'robot' "
                               "(expected one of: system, user, assistant, tool, developer)")


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("extra,param,message", [
    ({"n": 3}, "n", "n = 3 is not supported: one choice per request (only n = 1 is accepted)"),
    ({"presence_penalty": 0.5}, "presence_penalty",
     "presence_penalty is not supported (only 0 is accepted)"),
    ({"frequency_penalty": -1}, "frequency_penalty",
     "frequency_penalty is not supported (only 0 is accepted)"),
    ({"logit_bias": {"50256": -100}}, "logit_bias", "logit_bias is not supported"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools",
     "tools (tool / function calling) is not supported: this fleet generates plain text"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice is not supported"),
    ({"functions": [{"name": "f"}]}, "functions", "functions (tool / function calling)"),
    ({"response_format": {"type": "json_object"}}, "response_format",
     "response_format 'json_object' is not supported (only 'text' is accepted)"),
    ({"logprobs": True}, "logprobs", "logprobs are not supported (only false is accepted)"),
    ({"top_logprobs": 5}, "top_logprobs", "top_logprobs is not supported"),
    ({"top_k": 40}, "top_k", "top_k is not supported"),
    ({"repetition_penalty": 1.2}, "repetition_penalty",
     "repetition_penalty is not supported (only 1 is accepted)"),
])
def test_features_the_fleet_cannot_honour_are_400_naming_them(extra, param, message):
    req = decode_body(decode_chat, json.dumps({**CHAT, **extra}).encode())
    with pytest.raises(EdgeError) as e:
        to_spec(req)
    assert (e.value.status, e.value.param) == (400, param)
    assert e.value.message.startswith(message), e.value.message


@pytest.mark.parametrize("extra,param", [
    ({"echo": True}, "echo"), ({"logprobs": 2}, "logprobs"), ({"best_of": 3}, "best_of"),
    ({"suffix": "tail"}, "suffix"), ({"n": 2}, "n"),
])
def test_completion_only_features_are_400_naming_them(extra, param):
    req = decode_body(decode_completion,
                      json.dumps({"model": "m", "prompt": "p", **extra}).encode())
    with pytest.raises(EdgeError) as e:
        to_spec(req)
    assert (e.value.status, e.value.param) == (400, param)


def test_neutral_values_of_unsupported_features_are_accepted():
    neutral = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
               "tools": [], "tool_choice": "none", "parallel_tool_calls": False,
               "response_format": {"type": "text"}, "logprobs": False, "top_logprobs": 0,
               "top_k": -1, "min_p": 0, "repetition_penalty": 1, "user": "u"}
    spec = to_spec(decode_body(decode_chat, json.dumps({**CHAT, **neutral}).encode()))
    assert spec.messages[0].content == "hi"
    spec = to_spec(decode_body(decode_completion, json.dumps(
        {"model": "m", "prompt": "p", "echo": False, "best_of": 1, "suffix": "",
         "logprobs": None}).encode()))
    assert spec.prompt == "p"


def test_unknown_fields_are_ignored_and_named():
    body = json.dumps({**CHAT, "tenant": "evil", "metadata": {"a": "b"},
                       "messages": [{"role": "user", "content": "hi", "refusal": None}],
                       "stream_options": {"include_usage": True, "include_obfuscation": False},
                       "temperature": 0.5}).encode()
    req = decode_body(decode_chat, body)
    spec = to_spec(req)
    assert spec.tenant == "acme"  # the tenant never comes from the body
    assert spec.sampling.temperature == 0.5 and req.stream_options.include_usage
    assert ignored_fields(body, ChatCompletionRequest) == [
        "messages[].refusal", "metadata", "stream_options.include_obfuscation", "tenant"]
    assert ignored_fields(b'{"model":"m","prompt":"x"}', CompletionRequest) == []
    # `messages` is not a completions field: the whole key is the ignored one.
    assert ignored_fields(json.dumps({"model": "m", "prompt": "x", "messages": [{"a": 1}]}
                                     ).encode(), CompletionRequest) == ["messages"]


def test_ignored_header_is_safe_and_bounded():
    assert ignored_header(["a", "messages[].b"]) == "a,messages[].b"
    assert ignored_header(["ok", "bad\r\nX-Evil: 1", "caf\u00e9", "a,b"]) == "ok,+3 more"
    names = [f"f{i:02d}" for i in range(20)]
    assert ignored_header(names) == ",".join(names[:16]) + ",+4 more"


def test_websocket_frames_stay_strict():
    for frame, param in ((b'{"type":"request","id":"a","prompt":"p","bogus":1}', "bogus"),
                         (b'{"type":"request","id":"a","messages":[{"role":"user","x":1}]}',
                          "messages[0].x")):
        with pytest.raises(msgspec.ValidationError) as e:
            decode_client_frame.decode(frame)
        assert validation_message(e.value) == (f"unknown field '{param}'", param)


def test_error_mapping_and_openai_shape():
    err = EdgeError.from_info(ErrorInfo.of(ErrorCode.QUEUE_FULL, "full", retry_after_ms=1500))
    assert err.status == 429 and err.headers() == {"Retry-After": "2"}
    assert err.openai_body() == {"error": {"message": "full", "type": "rate_limit_error",
                                           "param": None, "code": "queue_full"}}
    assert EdgeError.from_info(ErrorInfo.of(ErrorCode.WORKER_LOST, "x")).status == 503
    assert EdgeError.unauthorized().headers() == {"WWW-Authenticate": "Bearer"}


@pytest.mark.parametrize("change,param,code", [
    ({"max_tokens": 10**6}, "max_tokens", ErrorCode.INVALID_REQUEST),
    ({"temperature": 3.0}, "temperature", ErrorCode.INVALID_REQUEST),
    ({"top_p": 0.0}, "top_p", ErrorCode.INVALID_REQUEST),
    ({"stop": [""]}, "stop", ErrorCode.INVALID_REQUEST),
    ({"prompt": " "}, "prompt", ErrorCode.INVALID_REQUEST),
    ({"prompt": "x" * 201}, "prompt", ErrorCode.PROMPT_TOO_LONG),
    ({"prompt": None, "messages": [ChatMessage(role="user", content="x" * 201)]}, "messages",
     ErrorCode.PROMPT_TOO_LONG),
])
def test_a_semantic_refusal_names_its_param_at_the_edge(change, param, code):
    """check_request's refusals (the producer library's, past the edge's schema) keep
    the parameter's name through RequestError to the OpenAI error body."""
    sampling = {k: change.pop(k) for k in ("max_tokens", "temperature", "top_p", "stop")
                if k in change}
    fields = {"prompt": "hello", **change}
    req = InferenceRequest(request_id="r1", tenant="t", tier="free", pool="p",
                           reply_to="fl.reply.o.t.r1", sampling=SamplingParams(**sampling),
                           **fields)
    with pytest.raises(ProtocolError) as e:
        check_request(req, RequestLimits(max_tokens=512, max_prompt_chars=200))
    assert (e.value.param, e.value.code) == (param, code)
    body = EdgeError.of(RequestError.from_error(e.value)).openai_body()["error"]
    assert (body["param"], body["code"]) == (param, code.value), body
    assert body["message"] == e.value.message


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
                                             "retry_after_ms": None, "param": None}}
