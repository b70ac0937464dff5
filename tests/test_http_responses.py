"""POST /v1/responses through the openai SDK against real servers: the tiny Qwen3 (real vocabulary, random
weights) with Qwen3-4B-Instruct-2507's template (tools, no reasoning) and with the hybrid-thinking template
whose prompt opens the reasoning block (reasoning items), and the secure server (401)."""

import json

import httpx
import jsonschema
import openai
import pytest

from tests.support.servers import TIMEOUT, wait_idle
from tests.support.thinking import opened_template, serve

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Forecast", "parameters": SCHEMA}]


@pytest.fixture(scope="module")
def tiny(tools_server):
    with openai.OpenAI(base_url=tools_server.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT) as sdk:
        yield tools_server, sdk, tools_server.engine.info.model_id


@pytest.fixture(scope="module")
def thinking(tiny_qwen3_ir, tmp_path_factory):
    for running, sdk in serve(tiny_qwen3_ir, opened_template(tmp_path_factory.mktemp("opened"))):
        yield running, sdk, running.engine.info.model_id


def test_create_matches_the_chat_endpoint(tiny):
    running, sdk, model = tiny
    reply = sdk.responses.create(
        model=model, instructions="Be brief.", input="Hello", max_output_tokens=8, temperature=0
    )
    chat = sdk.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
        max_tokens=8,
        temperature=0,
    )
    assert reply.object == "response" and reply.id.startswith("resp_")
    assert reply.output_text == chat.choices[0].message.content
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage.input_tokens == chat.usage.prompt_tokens and reply.usage.output_tokens == 8
    assert reply.instructions == "Be brief." and reply.max_output_tokens == 8 and reply.store is False
    [message] = reply.output
    assert message.type == "message" and message.role == "assistant" and message.status == "incomplete"


def test_stream_events_accumulate_to_the_whole_response(tiny):
    running, sdk, model = tiny
    messages = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]
    whole = sdk.responses.create(model=model, input=messages, max_output_tokens=10, temperature=0)
    with sdk.responses.stream(model=model, input=messages, max_output_tokens=10, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    assert final.usage.output_tokens == 10
    # responses.create(stream=True) gives the same events, typed; as many text deltas only if the reader kept up
    # as well (the engine folds the tokens waiting for a lagging reader into one delta)
    raw = list(sdk.responses.create(model=model, input=messages, max_output_tokens=10, temperature=0, stream=True))
    assert folded([e.type for e in raw]) == folded(kinds)
    assert "".join(e.delta for e in raw if e.type == "response.output_text.delta") == deltas


def folded(kinds: list[str]) -> list[str]:
    """The kinds of a stream's events with each run of text deltas as one."""
    delta = "response.output_text.delta"
    return [k for i, k in enumerate(kinds) if i == 0 or not (k == delta and kinds[i - 1] == delta)]


def test_structured_output_follows_the_schema(tiny):
    running, sdk, model = tiny
    fmt = {"format": {"type": "json_schema", "name": "weather", "schema": SCHEMA, "strict": True}}
    for temperature in (0.0, 1.5):
        reply = sdk.responses.create(
            model=model,
            input="Weather as JSON",
            text=fmt,
            max_output_tokens=60,
            temperature=temperature,
            extra_body={"seed": 3},  # an extension, as on chat
        )
        assert reply.status == "completed"
        jsonschema.validate(json.loads(reply.output_text), SCHEMA)
        assert reply.text.format.type == "json_schema"


def test_function_tools_and_their_outputs_round_trip(tiny):
    running, sdk, model = tiny
    ask = {"input": "Weather in Paris?", "tools": TOOLS, "tool_choice": "required", "max_output_tokens": 80}
    ask |= {"model": model, "temperature": 0, "parallel_tool_calls": False}
    reply = sdk.responses.create(**ask)
    [call] = [item for item in reply.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), SCHEMA)
    with sdk.responses.stream(**ask) as stream:
        events = list(stream)
        final = stream.get_final_response()
    fragments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [streamed] = [item for item in final.output if item.type == "function_call"]
    assert fragments == streamed.arguments == call.arguments
    # the call and its output sent back as input items, with the earlier reply's items as they came
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        *[item.model_dump(exclude_none=True) for item in reply.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'},
    ]
    answer = sdk.responses.create(model=model, input=history, tools=TOOLS, max_output_tokens=4, temperature=0)
    assert answer.usage.input_tokens > reply.usage.input_tokens and answer.usage.output_tokens > 0
    named = sdk.responses.create(
        model=model,
        input="Weather?",
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=80,
        temperature=0,
    )
    assert [item.name for item in named.output if item.type == "function_call"] == ["get_weather"]
    wait_idle(running.engine)


def test_reasoning_comes_as_a_reasoning_item(thinking):
    running, sdk, model = thinking
    reply = sdk.responses.create(model=model, input="2 + 2?", max_output_tokens=10, temperature=0)
    [item] = reply.output
    assert item.type == "reasoning" and item.content[0].type == "reasoning_text" and item.content[0].text
    assert reply.usage.output_tokens_details.reasoning_tokens == 10 and reply.output_text == ""
    with sdk.responses.stream(model=model, input="2 + 2?", max_output_tokens=10, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == item.content[0].text
    assert [i.type for i in final.output] == ["reasoning"]
    off = sdk.responses.create(
        model=model,
        input="2 + 2?",
        max_output_tokens=10,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert [i.type for i in off.output] == ["message"] and off.usage.output_tokens_details.reasoning_tokens == 0
    # a reasoning item sent back goes with the assistant turn after it
    history = ["2 + 2?", *[i.model_dump(exclude_none=True) for i in reply.output]]
    back = [
        {"role": "user", "content": history[0]},
        *history[1:],
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3 + 3?"},
    ]
    assert sdk.responses.create(model=model, input=back, max_output_tokens=2).usage.input_tokens > 0


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "name": "a b"}]}, "tools[0].name"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]}, "tools[0].parameters"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice.type"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        ({"input": [{"type": ["message"], "role": "user", "content": "hi"}]}, "input[0].type"),  # was a 500
        ({"input": [{"type": {}, "role": "user", "content": "hi"}]}, "input[0].type"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]}, "input[0].arguments"),
        ({"input": []}, "input"),
        ({"instructions": 3}, "instructions"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": "s"}}}, "text.format.schema"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"text": {"format": {"type": "json_object", "schema": {"type": "object"}}}}, "text.format.schema"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"chat_template_kwargs": {"enable_thinking": 1}}, "chat_template_kwargs.enable_thinking"),
        ({"frobnicate": 1}, "frobnicate"),
    ],
)
def test_refusals_name_the_field(tiny, extra, param):
    running, sdk, model = tiny
    with pytest.raises(openai.BadRequestError) as err:  # extra_body: sent as given, past the SDK's types
        sdk.responses.create(model=model, input="hi", max_output_tokens=4, extra_body=extra)
    assert err.value.body["param"] == param, err.value.body


def test_the_token_is_required(secure_server):
    url, cert = secure_server.url, secure_server.cert
    with httpx.Client(verify=str(cert), timeout=TIMEOUT) as http:
        wrong = openai.OpenAI(base_url=url + "/v1", api_key="wrong", http_client=http, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.responses.create(input="hi", max_output_tokens=2)
        assert http.post(url + "/v1/responses", json={"input": "hi"}).status_code == 401
        sdk = openai.OpenAI(base_url=url + "/v1", api_key=secure_server.token, http_client=http, max_retries=0)
        assert sdk.responses.create(input="hi", max_output_tokens=2).usage.output_tokens == 2


def test_a_grammar_over_the_lexers_limit_is_refused_naming_the_field_as_the_responses_request_spelled_it(tiny):
    """A schema whose string pattern overruns the grammar lexer's limit with the reply's first token: a 400 naming
    text.format (the chat field it is translated to is response_format), streamed or not; the server serves on."""
    running, sdk, model = tiny
    late = {"type": "string", "pattern": "^(a{700}){700}$"}
    schema = {"type": "object", "properties": {"b": {"enum": ["x" * 40]}, "a": late}, "required": ["b", "a"]}
    fmt = {"type": "json_schema", "name": "x", "schema": {**schema, "additionalProperties": False}}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.responses.create(
                model=model, input="hi", max_output_tokens=40, stream=stream, extra_body={"text": {"format": fmt}}
            )
        assert refused.value.body["param"] == "text.format.schema", refused.value.body
        assert "mid-reply: lexer error" in refused.value.body["message"]
    assert sdk.responses.create(model=model, input="hi", max_output_tokens=2).status == "incomplete"
