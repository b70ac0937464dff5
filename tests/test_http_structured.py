"""Structured output and tool calls through the OpenAI-compatible HTTP front, driven by the official `openai`
package against a real server (port 0): the tiny Qwen3 model served with the real Qwen3-4B-Instruct-2507
chat template, and SmolLM2."""

import json

import jsonschema
import openai
import pytest

from tests.support.schemas import SCHEMAS, WEATHER
from tests.support.servers import TIMEOUT, wait_idle

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time"}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris? Answer in JSON."}]


def serve(running):
    with openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT) as sdk:
        yield running, sdk, running.engine.info.model_id


@pytest.fixture(scope="module")
def tiny(tools_server):
    yield from serve(tools_server)  # the tiny model with the real Qwen3-4B-Instruct-2507 template


@pytest.fixture(scope="module")
def smol(smol_server):
    yield from serve(smol_server)


def json_schema(name):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_response_format_json_schema(smol, name):
    running, sdk, model = smol
    for temperature in (0.0, 1.6):
        options = {"response_format": json_schema(name), "temperature": temperature, "seed": 4, "max_tokens": 200}
        reply = sdk.chat.completions.create(model=model, messages=ASK, **options)
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMAS[name])
        chunks = sdk.chat.completions.create(model=model, messages=ASK, stream=True, **options)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == reply.choices[0].message.content


def test_json_object_and_vllm_structured_outputs(smol):
    running, sdk, model = smol
    # greedy SmolLM2 nests {"name": "Mara", "description": {...}} forever without a penalty
    obj = sdk.chat.completions.create(
        model=model,
        messages=ASK,
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=120,
        extra_body={"repetition_penalty": 1.2},
    )
    assert obj.choices[0].finish_reason == "stop" and isinstance(json.loads(obj.choices[0].message.content), dict)
    plain = sdk.chat.completions.create(model=model, messages=ASK, response_format={"type": "text"}, max_tokens=4)
    assert plain.choices[0].message.content
    for extension, check in [
        ({"regex": r"[A-Z][a-z]{2,8}"}, lambda t: t[0].isupper() and 3 <= len(t) <= 9),
        ({"choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        (
            {"json": SCHEMAS["bounded_numbers"]},
            lambda t: jsonschema.validate(json.loads(t), SCHEMAS["bounded_numbers"]) is None,
        ),
    ]:
        extra = {"structured_outputs": extension}
        chat = sdk.chat.completions.create(model=model, messages=ASK, temperature=1.5, seed=1, extra_body=extra)
        assert check(chat.choices[0].message.content), chat.choices[0].message.content
        completion = sdk.completions.create(model=model, prompt="Answer:", temperature=1.5, seed=1, extra_body=extra)
        assert check(completion.choices[0].text), completion.choices[0].text
    assert wait_idle(running.engine).num_free_blocks == running.engine.stats().num_total_blocks


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (
            {"response_format": json_schema("nested") | {"json_schema": {"name": "x", "schema": {"type": 7}}}},
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"extra_body": {"structured_outputs": {"regex": "(open"}}}, "structured_outputs.regex"),
        ({"extra_body": {"structured_outputs": {"grammar": "start: x"}}}, "structured_outputs.grammar"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}}, "structured_outputs"),
        (
            {"response_format": {"type": "json_object"}, "extra_body": {"structured_outputs": {"regex": "a"}}},
            "structured_outputs",
        ),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ],
)
def test_invalid_formats_are_400_naming_the_field(smol, kwargs, param):
    running, sdk, model = smol
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(model=model, messages=ASK, **kwargs)
    assert err.value.status_code == 400 and err.value.body["param"] == param, err.value.body
    assert err.value.body["message"].startswith(param)


def test_logprobs_of_tokens_a_grammar_rules_out_are_valid_json(smol):
    # a grammar's masked tokens had logprob -inf: the unary reply failed to serialize (a plain-text 500, logged
    # as 200) and the stream carried -Infinity, which is not JSON
    running, sdk, model = smol
    options = {
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 20,
        "extra_body": {"structured_outputs": {"choice": ["yes"]}},
    }
    reply = sdk.chat.completions.create(model=model, messages=ASK, **options).choices[0]
    assert reply.message.content == "yes"
    entries = reply.logprobs.content
    assert all(-9999.0 <= top.logprob <= 0 for e in entries for top in e.top_logprobs)
    assert any(top.logprob == -9999.0 for e in entries for top in e.top_logprobs)  # the masked ones
    chunks = list(sdk.chat.completions.create(model=model, messages=ASK, stream=True, **options))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.top_logprobs for e in streamed] == [e.top_logprobs for e in entries]


def streamed_calls(chunks):
    """Every increment in order; checks that each call opens with id, type and name and that each prefix of
    its arguments is a prefix of the final arguments. Returns (calls by index, finish_reason)."""
    calls, finish = {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for d in choice.delta.tool_calls or ():
            if d.index not in calls:
                assert d.id.startswith("call_") and d.type == "function" and d.function.name
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": d.function.arguments or ""}
            else:
                assert d.id is None and d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments
    return calls, finish


@pytest.mark.parametrize(
    "tool_choice, parallel",
    [("required", True), ({"type": "function", "function": {"name": "get_weather"}}, True), ("required", False)],
    ids=["required", "named", "required-single"],
)
def test_tool_calls_stream_valid_deltas(tiny, tool_choice, parallel):
    running, sdk, model = tiny
    for temperature in (0.0, 1.5):
        options = {"tools": TOOLS, "tool_choice": tool_choice, "parallel_tool_calls": parallel}
        options |= {"temperature": temperature, "seed": 9, "max_tokens": 300}
        chunks = list(sdk.chat.completions.create(model=model, messages=ASK, stream=True, **options))
        calls, finish = streamed_calls(chunks)
        assert finish == "tool_calls" and calls
        if not parallel or isinstance(tool_choice, dict):
            assert len(calls) == 1
        for call in calls.values():
            arguments = json.loads(call["arguments"])
            if call["name"] == "get_weather":
                jsonschema.validate(arguments, WEATHER)
        whole = sdk.chat.completions.create(model=model, messages=ASK, **options).choices[0]
        assert whole.finish_reason == "tool_calls" and whole.message.content is None
        assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == [
            (c["name"], c["arguments"]) for c in calls.values()
        ]
    assert wait_idle(running.engine).num_free_blocks == running.engine.stats().num_total_blocks


def test_auto_none_and_tool_results_in_the_conversation(tiny):
    running, sdk, model = tiny
    for seed in range(3):
        reply = sdk.chat.completions.create(
            model=model, messages=ASK, tools=TOOLS, temperature=1.0, seed=seed, max_tokens=80
        ).choices[0]
        if reply.finish_reason == "tool_calls":
            for call in reply.message.tool_calls:
                assert isinstance(json.loads(call.function.arguments), dict)
    none = sdk.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=8, extra_body={"ignore_eos": True}
    ).choices[0]
    assert none.finish_reason == "length" and not none.message.tool_calls
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    reply = sdk.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=4)
    expected = running.engine.tokenizer.encode_chat(
        [
            *ASK,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                    }
                ],
            },
            {"role": "tool", "content": '{"temp": 21}'},
        ],
        [t for t in TOOLS],
    )
    assert reply.usage.prompt_tokens == len(expected)
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(
            model=model, messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}
        )
    assert err.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(
            model=model, messages=ASK, tools=[{"type": "function", "function": {"name": "a b"}}]
        )
    assert err.value.body["param"] == "tools[0].function.name"
    # a schema that does not compile is named at its own tool, not as the reply's whole grammar
    unsatisfiable = {
        "type": "object",
        "properties": {"x": {"type": "integer", "minimum": 5, "maximum": 1}},
        "required": ["x"],
    }
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(
            model=model,
            messages=ASK,
            tools=[TOOLS[0], {"type": "function", "function": {"name": "odd", "parameters": unsatisfiable}}],
        )
    assert err.value.body["param"] == "tools[1].function.parameters", err.value.body
    assert "lark" not in err.value.body["message"]


def test_the_readme_examples_run(tiny):
    """The README's structured-output examples, pointed at this server: the curl reply is valid JSON of its
    schema, the Python example prints a call."""
    import re
    import subprocess
    import sys

    from tests.support.paths import ROOT

    running, sdk, model = tiny
    section = (ROOT / "README.md").read_text().split("### Structured output and tool calls", 1)[1].split("\n### ")[0]
    port = str(running.server.http.port)
    (curl,) = re.findall(r"```sh\n(.*?)```", section, re.S)
    result = subprocess.run(["bash", "-c", curl.replace("8000", port)], capture_output=True, text=True, timeout=60)
    body = json.loads(result.stdout)
    assert set(json.loads(body["choices"][0]["message"]["content"])) == {"name", "age"}
    (python,) = re.findall(r"```python\n(.*?)```", section, re.S)
    result = subprocess.run(
        [sys.executable, "-c", python.replace("8000", port)], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert result.returncode == 0 and result.stdout.startswith("get_weather {"), result.stderr


def test_the_tools_demo_shows_a_valid_call_end_to_end(tiny_qwen3_ir):
    """`make tools-demo`'s script on the tiny Qwen3 (the template given as a server flag here; the demo's own
    model carries it): a server of its own, a forced call that parses, its result sent back, then it stops."""
    import re
    import subprocess
    import sys

    from tests.support.paths import ROOT, TEMPLATE

    script = [sys.executable, "scripts/tools_demo.py", str(tiny_qwen3_ir), "--chat-template", str(TEMPLATE)]
    result = subprocess.run(script, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert '== tool_choice "required": the message as the API returns it' in out
    parsed = re.search(r"^parsed: get_weather\((\{.*\})\); finish_reason 'tool_calls'$", out, re.M)
    assert parsed, out
    assert "== the tool's result sent back" in out and "stopped" in result.stderr


def test_each_of_n_candidates_keeps_its_own_format_and_calls(tiny, smol):
    """Every candidate has its own grammar state: n sampled candidates are each a valid call or a valid object."""
    running, sdk, model = tiny
    options = {"tools": TOOLS, "tool_choice": "required", "temperature": 1.5, "seed": 2, "max_tokens": 300, "n": 3}
    whole = sdk.chat.completions.create(model=model, messages=ASK, **options)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    for choice in whole.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert isinstance(json.loads(call.function.arguments), dict)
    chunks = list(sdk.chat.completions.create(model=model, messages=ASK, stream=True, **options))
    for index, choice in enumerate(whole.choices):
        calls, finish = streamed_calls([c for c in chunks if c.choices and c.choices[0].index == index])
        assert finish == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [
            (c.function.name, c.function.arguments) for c in choice.message.tool_calls
        ]
    assert wait_idle(running.engine).num_free_blocks == running.engine.stats().num_total_blocks
    running, sdk, model = smol
    fmt = json_schema("person") if "person" in SCHEMAS else json_schema(sorted(SCHEMAS)[0])
    name = fmt["json_schema"]["name"]
    reply = sdk.chat.completions.create(
        model=model, messages=ASK, response_format=fmt, temperature=1.6, seed=4, max_tokens=200, n=2
    )
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])
