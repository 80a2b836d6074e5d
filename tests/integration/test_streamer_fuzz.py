"""Fuzz the HTTP API of a running streamer: no input may produce a 5xx.

Hypothesis generates bodies that are near-valid (known fields with values of any
JSON type and range), arbitrary JSON, and arbitrary bytes, for every endpoint, with
and without valid auth. Valid ones reach the fake fleet and must succeed.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.integration.test_streamer import KEY_A, make_stack

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=10,
)

FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "stop", "seed", "stream", "stream_options", "n", "user", "priority",
          "ttft_budget_ms", "echo", "logprobs", "presence_penalty", "frequency_penalty"]

good_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "robot"]),
     "content": st.one_of(st.text(max_size=30), st.lists(
         st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                "text": st.text(max_size=10)}), max_size=2), st.none())})

field_values = {  # mostly in range, sometimes anything
    "model": st.sampled_from(["default", "default", "small", "nope", ""]) | json_values,
    "prompt": st.text(max_size=40) | st.lists(st.integers(-5, 2**40), max_size=5) | json_values,
    "messages": st.lists(good_message, max_size=3) | json_values,
    "max_tokens": st.integers(1, 50) | st.integers(-10, 10_000) | json_values,
    "max_completion_tokens": st.integers(1, 50) | json_values,
    "temperature": st.floats(0, 2) | st.floats(-1, 3) | json_values,
    "top_p": st.floats(0.01, 1) | st.floats(-0.5, 1.5) | json_values,
    "stop": st.text(min_size=1, max_size=5) | st.lists(st.text(max_size=5), max_size=10)
    | json_values,
    "seed": st.integers(-(2**64), 2**64) | json_values,
    "stream": st.booleans() | st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
    "n": st.integers(0, 3),
    "priority": st.integers(-2000, 2000),
    "ttft_budget_ms": st.integers(-5, 10**7) | st.none(),
}


@st.composite
def bodies(draw):
    kind = draw(st.sampled_from(["near", "near", "near", "json", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "json":
        return json.dumps(draw(json_values)).encode()
    keys = draw(st.lists(st.sampled_from(FIELDS + ["bogus"]), max_size=4, unique=True))
    body = {"model": "default"}
    if draw(st.booleans()):
        body["prompt"] = "n=2"
    else:
        body["messages"] = [{"role": "user", "content": "n=2"}]
    for k in keys:
        body[k] = draw(field_values.get(k, json_values))
    return json.dumps(body).encode()


@pytest.fixture
async def fuzz_stack(nats_server, redis_server, nc, uid, tmp_path):
    async with make_stack(nats_server, redis_server, nc, uid, tmp_path) as s:
        async with httpx.AsyncClient(base_url=s.url, timeout=20) as http:
            yield s, http


@settings(max_examples=400, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    route=st.sampled_from(
        [("POST", "/v1/completions")] * 4 + [("POST", "/v1/chat/completions")] * 4
        + [("GET", "/v1/models"), ("PUT", "/v1/completions"), ("POST", "/v1/x"),
           ("GET", "/v1/chat/completions")]),
    body=bodies(),
    auth=st.sampled_from([f"Bearer {KEY_A}"] * 6 + ["Bearer nope", None, "garbage"]),
    content_type=st.sampled_from(["application/json", "text/plain", None]),
)
async def test_http_api_never_5xx(fuzz_stack, route, body, auth, content_type):
    _, http = fuzz_stack
    method, path = route
    headers = {}
    if auth is not None:
        headers["Authorization"] = auth
    if content_type is not None:
        headers["Content-Type"] = content_type
    r = await http.request(method, path, content=body if method != "GET" else None,
                           headers=headers)
    event(f"status {r.status_code}")
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    elif path != "/v1/models":
        # success: either one JSON completion or an SSE stream ending in [DONE]
        if r.headers["content-type"].startswith("text/event-stream"):
            assert r.text.rstrip().endswith("data: [DONE]"), r.text[-200:]
        else:
            assert r.json()["choices"]
