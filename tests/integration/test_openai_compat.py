"""The official `openai` SDK against the streamer in front of a real fleet (nats-server,
dispatcher, simulated worker, all in this process): fields the SDK or a framework adds
that fairlane does not know are ignored, as vLLM's server does; features the fleet
cannot honour are a 400 that names them; models can be retrieved."""

from __future__ import annotations

import json

import openai
import pytest
import websockets
from openai import AsyncOpenAI

from fairlane.tenants import hash_api_key
from streamer.app import create_app
from streamer.config import StreamerSettings
from streamer.testing import serve_app
from tests.helpers import in_process_fleet

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

KEY = "sk-compat"
MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture
async def edge(nats_server, nc, uid, tmp_path):
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(f"pools: {{p: {{}}}}\n"
                       f"tenants: {{acme: {{api_keys: ['{hash_api_key(KEY)}']}}}}\n")
    async with in_process_fleet(nats_server.url, nc, uid, time_scale=0.05) as (client, subjects):
        settings = StreamerSettings(nats_url=nats_server.url, prefix=subjects.prefix,
                                    redis_url="", tenants_file=str(tenants),
                                    usage_settler=False)
        async with serve_app(create_app(settings, client=client)) as url:
            yield url, AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0,
                                   timeout=30)


async def test_unknown_fields_via_extra_body_get_a_normal_answer(edge):
    url, sdk = edge
    extra = {"x_trace_tag": "abc", "metadata": {"team": "search"}}
    # seed: the simulator's output length is random per request (1 + Exp(mean 128)),
    # and would end with "stop" before 6 tokens ~5% of the time; seed 2 runs long.
    raw = await sdk.chat.completions.with_raw_response.create(
        model="p", messages=MESSAGES, max_tokens=6, seed=2, extra_body=extra)
    assert raw.headers["x-fairlane-ignored-fields"] == "metadata,x_trace_tag"
    resp = raw.parse()
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 6 and resp.choices[0].message.content

    stream = await sdk.completions.create(model="p", prompt="hello", max_tokens=5, seed=2,
                                          stream=True, extra_body=extra)
    finish = [c.choices[0].finish_reason async for c in stream if c.choices]
    assert finish[-1] == "length"


async def test_neutral_values_of_unsupported_features_are_fine(edge):
    _, sdk = edge
    resp = await sdk.chat.completions.create(
        model="p", messages=MESSAGES, max_tokens=3, n=1, presence_penalty=0,
        frequency_penalty=0, response_format={"type": "text"}, logprobs=False,
        tool_choice="none", user="u-1", seed=7)
    assert resp.usage.completion_tokens == 3


@pytest.mark.parametrize("kwargs,param,message", [
    ({"n": 2}, "n", "n = 2 is not supported: one choice per request"),
    ({"presence_penalty": 0.5}, "presence_penalty",
     "presence_penalty is not supported (only 0 is accepted)"),
    ({"tools": [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]},
     "tools", "tools (tool / function calling) is not supported"),
    ({"response_format": {"type": "json_object"}}, "response_format",
     "response_format 'json_object' is not supported (only 'text' is accepted)"),
    ({"logprobs": True, "top_logprobs": 2}, "logprobs", "logprobs are not supported"),
])
async def test_features_the_fleet_cannot_honour_are_400(edge, kwargs, param, message):
    _, sdk = edge
    with pytest.raises(openai.BadRequestError) as e:
        await sdk.chat.completions.create(model="p", messages=MESSAGES, max_tokens=3, **kwargs)
    assert e.value.status_code == 400 and e.value.param == param
    assert e.value.code == "invalid_request"
    assert e.value.body["message"].startswith(message), e.value.body


async def test_simulator_honours_stop_strings(edge):
    """`stop` reaches the engine: the simulator ends the answer just before the stop
    string (not returned), finish_reason "stop", streamed or not (seeded: the same
    tokens each run)."""
    _, sdk = edge
    full = await sdk.completions.create(model="p", prompt="hello", max_tokens=8, seed=2)
    text = full.choices[0].text
    words = text.split(" ")  # the simulator's tokens are " tok<id>"
    assert len(words) == 9 and full.choices[0].finish_reason == "length", text
    stop = " " + words[4]
    want = text[:text.index(stop)]
    resp = await sdk.chat.completions.create(model="p", messages=MESSAGES, max_tokens=8,
                                             seed=2, stop=[stop, "never-seen"])
    assert (resp.choices[0].message.content, resp.choices[0].finish_reason) == (want, "stop")
    stream = await sdk.completions.create(model="p", prompt="hello", max_tokens=8, seed=2,
                                          stop=stop, stream=True)
    chunks = [c.choices[0] async for c in stream if c.choices]
    assert "".join(c.text for c in chunks) == want and chunks[-1].finish_reason == "stop"


@pytest.mark.parametrize("kwargs,message", [
    ({"temperature": 2.5}, "invalid request: temperature must be a number between 0 and 2, "
                           "got 2.5"),
    ({"top_p": 0}, "invalid request: top_p must be a number greater than 0 and at most 1, "
                   "got 0"),
    ({"max_tokens": 0}, "invalid request: max_tokens must be an integer of at least 1, got 0"),
    ({"frequency_penalty": 1.5}, "frequency_penalty is not supported (only 0 is accepted), "
                                 "got 1.5"),
])
async def test_out_of_range_errors_say_what_is_allowed(edge, kwargs, message):
    _, sdk = edge
    with pytest.raises(openai.BadRequestError) as e:
        await sdk.chat.completions.create(model="p", messages=MESSAGES, **kwargs)
    assert e.value.body["message"] == message and e.value.param == next(iter(kwargs))


async def test_a_limit_past_the_schema_names_its_param(edge):
    """max_tokens over the pool's limit: refused by the request check past the schema
    (the producer library's), still with the parameter named, as OpenAI's SDK reads it."""
    _, sdk = edge
    with pytest.raises(openai.BadRequestError) as e:
        await sdk.chat.completions.create(model="p", messages=MESSAGES, max_tokens=10**7)
    assert e.value.param == "max_tokens" and e.value.code == "invalid_request"
    assert e.value.body["message"].startswith("max_tokens must be between 1 and ")


async def test_null_knobs_mean_the_defaults(edge):
    """What OpenAI's API accepts: null for "the default" (frameworks send it)."""
    _, sdk = edge
    resp = await sdk.chat.completions.create(
        model="p", messages=MESSAGES, max_tokens=2, seed=2,
        extra_body={"temperature": None, "top_p": None, "stream": None})
    assert resp.usage.completion_tokens == 2


async def test_models_retrieve(edge):
    _, sdk = edge
    model = await sdk.models.retrieve("p")
    assert (model.id, model.object) == ("p", "model")
    assert [m.id for m in (await sdk.models.list()).data] == ["p"]
    with pytest.raises(openai.NotFoundError) as e:
        await sdk.models.retrieve("gpt-4o")
    assert e.value.code == "model_not_found" and "gpt-4o" in e.value.message


async def test_websocket_shares_the_schema_but_stays_strict(edge):
    url, _ = edge
    async with websockets.connect(url.replace("http://", "ws://") + "/v1/stream",
                                  additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
        await ws.send(json.dumps({"type": "request", "id": "a", "model": "p", "prompt": "hi",
                                  "max_tokens": 2, "metadata": {}}))
        frame = json.loads(await ws.recv())
        assert frame["type"] == "error"
        assert frame["error"]["message"] == "invalid frame: unknown field 'metadata'"
        await ws.send(json.dumps({"type": "request", "id": "b", "model": "p", "prompt": "hi",
                                  "max_tokens": 2}))
        frames = [json.loads(await ws.recv()) for _ in range(4)]
        assert [f["type"] for f in frames][0] == "accepted" and frames[-1]["type"] == "end"
