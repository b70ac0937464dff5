"""Structured output and tool calls over gRPC on real servers (port 0): the tiny Qwen3 model (random weights,
served with the real Qwen3-4B-Instruct-2507 chat template) and SmolLM2. Replies are validated with
jsonschema; the grammar, not the model, makes them valid, so sampling at high temperature must too."""

import json

import grpc
import jsonschema
import pytest

from service.api.ovserve.v1 import ovserve_pb2 as pb
from service.client import Client
from tests.support.engine import PRECISION, assert_no_blocks_held, collect, prompts
from tests.support.schemas import SCHEMAS, WEATHER
from tests.support.servers import TIMEOUT, Running, base_config, wait_idle

TOOLS = [
    pb.Tool(name="get_weather", description="The weather forecast of a city", parameters=json.dumps(WEATHER)),
    pb.Tool(name="get_time", description="The local time of a city"),
]
ASK = [{"role": "user", "content": "Answer in JSON."}]


@pytest.fixture
def tiny(tools_server):
    return tools_server  # the real Qwen3-4B-Instruct-2507 template: it renders tools


@pytest.fixture
def smol(smol_server):
    return smol_server  # no prefix cache: a seeded request asked twice computes the same steps


def schema_format(schema) -> pb.ResponseFormat:
    return pb.ResponseFormat(json_schema=pb.JsonSchema(schema=json.dumps(schema), name="reply"))


@pytest.mark.model  # its server is asked for at run time
@pytest.mark.parametrize("model", ["tiny", "smol"])
@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_schema_constrained_replies_validate(request, model, temperature):
    server = request.getfixturevalue(model)
    with Client(server.target) as client:
        for seed, (name, schema) in enumerate(sorted(SCHEMAS.items())):
            options = {"temperature": temperature, "seed": seed, "max_new_tokens": 200}
            reply = client.generate(messages=ASK, response_format=schema_format(schema), **options, timeout=TIMEOUT)
            assert reply.finish_reason == pb.FINISH_REASON_STOP, (name, reply.text)
            jsonschema.validate(json.loads(reply.text), schema)
            chunks = list(client.stream(messages=ASK, response_format=schema_format(schema), **options))
            assert "".join(c.text for c in chunks) == reply.text  # seeded: the stream is the same reply
    assert wait_idle(server.engine).num_free_blocks == server.engine.stats().num_total_blocks


def test_json_object_regex_and_choice(smol):
    with Client(smol.target) as client:
        for temperature in (0.0, 1.5):
            common = {"messages": ASK, "temperature": temperature, "seed": 1, "max_new_tokens": 120}
            if temperature == 0:  # any object: sampled at 1.5, SmolLM2 writes keys longer than any limit here
                # greedy SmolLM2 nests {"name": "Mara", "description": {...}} forever without a penalty
                any_object = pb.ResponseFormat(json_object=True)
                obj = client.generate(response_format=any_object, repetition_penalty=1.2, **common)
                assert obj.finish_reason == pb.FINISH_REASON_STOP and isinstance(json.loads(obj.text), dict)
            date = client.generate(
                response_format=pb.ResponseFormat(regex=r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"), **common
            )
            assert len(date.text) == 10 and date.text[:2] == "20" and date.finish_reason == pb.FINISH_REASON_STOP
            labels = ["positive", "negative", "neutral"]
            choice = pb.ResponseFormat(choice=pb.Choice(options=labels))
            assert client.generate(response_format=choice, **common).text in labels


def test_a_grammar_admitting_only_eos_ends_cleanly(smol):
    with Client(smol.target) as client:
        reply = client.generate(prompt="Hello", response_format=pb.ResponseFormat(regex=""), min_new_tokens=3)
    assert reply.finish_reason == pb.FINISH_REASON_STOP and reply.text == ""
    assert len(reply.token_ids) == 1 and reply.token_ids[0] in smol.engine.info.eos_token_ids


def test_stop_strings_and_length_still_apply(smol):
    with Client(smol.target) as client:
        schema = schema_format(SCHEMAS["nested"])
        cut = client.generate(messages=ASK, response_format=schema, max_new_tokens=3)
        assert cut.finish_reason == pb.FINISH_REASON_LENGTH and len(cut.token_ids) == 3  # incomplete JSON
        stopped = client.generate(messages=ASK, response_format=schema, stop=['"address"'], max_new_tokens=100)
        assert stopped.finish_reason == pb.FINISH_REASON_STOP and stopped.text.startswith('{"name": "')
        assert '"address"' not in stopped.text


@pytest.mark.parametrize(
    "response_format, field, words",
    [
        (pb.ResponseFormat(json_schema=pb.JsonSchema(schema='{"type": 12}')), "response_format.json_schema", "valid"),
        (pb.ResponseFormat(json_schema=pb.JsonSchema(schema="{")), "response_format.json_schema", "JSON"),
        (pb.ResponseFormat(regex="(unclosed"), "response_format.regex", "regex"),
        (pb.ResponseFormat(regex="x" * 70000), "response_format.regex", "65536"),
        (pb.ResponseFormat(choice=pb.Choice()), "response_format.choice", "at least one"),
        (pb.ResponseFormat(json_object=False), "response_format.json_object", "true"),
        (pb.ResponseFormat(), "response_format", "set one of"),
    ],
)
def test_invalid_formats_are_invalid_argument_naming_the_field(smol, response_format, field, words):
    with Client(smol.target) as client, pytest.raises(grpc.RpcError) as err:
        client.generate(messages=ASK, response_format=response_format)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field + ":") and words in err.value.details()


def calls_of(chunks) -> dict[int, dict]:
    """The stream's tool call increments joined per index, checking that each call opens with id and name."""
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for d in chunk.tool_calls:
            if d.index not in calls:
                assert d.id.startswith("call_") and d.name and not d.arguments
                calls[d.index] = {"id": d.id, "name": d.name, "arguments": ""}
            else:
                assert not d.id and not d.name
                calls[d.index]["arguments"] += d.arguments
    return calls


@pytest.mark.parametrize("temperature", [0.0, 1.5])
@pytest.mark.parametrize(
    "choice",
    [
        pb.ToolChoice(mode=pb.ToolChoice.MODE_REQUIRED),
        pb.ToolChoice(function="get_weather"),
        pb.ToolChoice(mode=pb.ToolChoice.MODE_REQUIRED, parallel=False),
    ],
    ids=["required", "named", "required-single"],
)
def test_forced_tool_calls_stream_valid_arguments(tiny, choice, temperature):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    options = {"temperature": temperature, "seed": 5, "max_new_tokens": 300}
    with Client(tiny.target) as client:
        chunks = list(client.stream(messages=messages, tools=TOOLS, tool_choice=choice, **options))
        whole = client.generate(messages=messages, tools=TOOLS, tool_choice=choice, **options)
    calls = calls_of(chunks)
    assert chunks[-1].finish_reason == pb.FINISH_REASON_TOOL_CALLS and calls
    assert "".join(c.text for c in chunks) == "" and whole.text == ""
    if choice.HasField("function") or choice.HasField("parallel"):
        assert len(calls) == 1
    for call in calls.values():
        arguments = json.loads(call["arguments"])
        if call["name"] == "get_weather":
            jsonschema.validate(arguments, WEATHER)
        else:
            assert call["name"] == "get_time" and arguments == {}  # declared without parameters
    assert [(c.name, c.arguments) for c in whole.tool_calls] == [(c["name"], c["arguments"]) for c in calls.values()]
    assert wait_idle(tiny.engine).num_free_blocks == tiny.engine.stats().num_total_blocks


def test_tokenize_renders_tools_as_generate_does(tiny):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    with Client(tiny.target) as client:
        with_tools = client.tokenize(messages=messages, tools=TOOLS)
        reply = client.generate(messages=messages, tools=TOOLS, max_new_tokens=1)
        none = pb.ToolChoice(mode=pb.ToolChoice.MODE_NONE)
        assert reply.usage.prompt_tokens == len(with_tools)
        assert client.tokenize(messages=messages, tools=TOOLS, tool_choice=none) == client.tokenize(messages=messages)
        assert len(with_tools) > len(client.tokenize(messages=messages))
        with pytest.raises(grpc.RpcError) as err:
            client.tokenize(text="hi", tools=TOOLS)
        with pytest.raises(grpc.RpcError) as bad_name:
            client.tokenize(messages=messages, tools=[pb.Tool(name="a b")])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("tools:")
    assert bad_name.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_name.value.details().startswith("tools[0].name:")


def test_auto_tool_choice_gives_text_or_valid_calls_and_results_go_back(tiny):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    with Client(tiny.target) as client:
        for seed in range(3):
            chunks = list(client.stream(messages=messages, tools=TOOLS, temperature=1.0, seed=seed, max_new_tokens=60))
            for call in calls_of(chunks).values():
                if chunks[-1].finish_reason == pb.FINISH_REASON_TOOL_CALLS:
                    json.loads(call["arguments"])
        # a conversation carrying a call and its result back renders and runs
        turn = [
            *messages,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}],
            },
            {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1", "name": "get_weather"},
        ]
        reply = client.generate(messages=turn, tools=TOOLS, max_new_tokens=4, ignore_eos=True)
        assert reply.usage.prompt_tokens > 0
        ids = client.tokenize(messages=turn)
    text = tiny.engine.tokenizer.decode(ids, skip_special_tokens=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>' in text


@pytest.mark.parametrize(
    "tools, choice, field",
    [
        ([pb.Tool(name="bad name")], None, "tools[0].name"),
        ([TOOLS[0], TOOLS[0]], None, "tools[1].name"),
        ([pb.Tool(name="f", parameters="[1]")], None, "tools[0].parameters"),
        ([pb.Tool(name="f", parameters='{"type": "string"}')], None, "tools[0].parameters"),
        (TOOLS, pb.ToolChoice(function="nope"), "tool_choice"),
        ([], pb.ToolChoice(mode=pb.ToolChoice.MODE_REQUIRED), "tool_choice"),
    ],
)
def test_invalid_tools_name_the_field(tiny, tools, choice, field):
    with Client(tiny.target) as client, pytest.raises(grpc.RpcError) as err:
        client.generate(messages=ASK, tools=tools, tool_choice=choice)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith(field + ":")


def test_tools_need_a_template_that_renders_them(smol):
    with Client(smol.target) as client, pytest.raises(grpc.RpcError) as err:
        client.generate(messages=ASK, tools=TOOLS)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # SmolLM2 has neither a template that renders tools nor the tokens: the message says what would serve them
    assert err.value.details().startswith(
        "tools: tool calls need a model in Qwen3's tool format, and its chat template does not render tools and "
        "it has no <tool_call> and </tool_call> tokens: serve a Qwen3 instruct model"
    ), err.value.details()


def test_constrained_streams_cancelled_mid_reply_free_their_blocks_and_spare_the_others(smol):
    """Eight requests with one schema at once (its first compile shared): every other one is cancelled after a
    few messages; the rest finish valid, and nothing is held afterwards."""
    from concurrent.futures import ThreadPoolExecutor

    schema = SCHEMAS["enum_and_array"]
    fmt = schema_format({**schema, "description": "cancelled alongside"})  # a schema not compiled before

    def one(i: int) -> str | None:
        with Client(smol.target) as client:
            call = client.stream(prompt=f"Item {i}:", response_format=fmt, temperature=1.0, seed=i, max_new_tokens=200)
            if i % 2:
                for _ in range(3):
                    next(call, None)  # a short reply may end first: cancelling then is a no-op
                call.cancel()
                return None
            return "".join(chunk.text for chunk in call)

    with ThreadPoolExecutor(8) as pool:
        replies = [r for r in pool.map(one, range(8)) if r is not None]
    assert len(replies) == 4
    for reply in replies:
        jsonschema.validate(json.loads(reply), schema)
    stats = wait_idle(smol.engine)
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks


def test_grammar_with_speculative_decoding(smollm2_ir, monkeypatch):
    """Prompt lookup proposes drafts copied from the prompt; those the grammar forbids are never offered, the
    kept ones count, and every reply is still valid. The cost rule offers every draft (it reads the busy
    machine's step times, and this test is about what the grammar does to drafts)."""
    from service.core.spec import DraftPolicy

    monkeypatch.setattr(DraftPolicy, "choose", lambda self, candidates, step: [limit for _, limit in candidates])
    running = Running(base_config(smollm2_ir, speculation="auto", speculative_tokens=4))
    schema = SCHEMAS["enum_and_array"]
    example = '{"color": "green", "tags": ["a", "b"]} ' * 6 + "plain words that no grammar here admits " * 4
    try:
        with Client(running.target) as client:
            for temperature in (0.0, 1.2):
                reply = client.generate(
                    prompt=f"Copy: {example}\n",
                    response_format=schema_format(schema),
                    temperature=temperature,
                    seed=2,
                    max_new_tokens=100,
                )
                jsonschema.validate(json.loads(reply.text), schema)
        stats = wait_idle(running.engine)
        assert stats.num_draft_tokens > 0 and stats.num_free_blocks == stats.num_total_blocks
    finally:
        running.stop()


def test_preempted_constrained_requests_resume_in_their_grammar(tiny_qwen3_fp16_ir):
    """Preemption recomputes a request's KV but keeps its tokens, and so its place in the grammar: replies of
    requests preempted mid-way equal those of an engine with room for all, and match the format."""
    import asyncio
    import re

    from service.core.grammar import ResponseFormat
    from service.core.params import SamplingParams
    from service.engine import Engine, EngineConfig

    fmt = ResponseFormat.regex("[a-z ]{80}")
    params = SamplingParams(max_new_tokens=120)
    ps = [p[:60] + [7] * max(0, 60 - len(p)) for p in prompts(4, seed=3)]

    def replies(kv_blocks: int | None) -> tuple[list[str], int]:
        probe = EngineConfig(kv_cache_gb=0.05, kv_cache_precision=PRECISION, max_num_batched_tokens=64)
        if kv_blocks is not None:
            big = Engine(tiny_qwen3_fp16_ir, probe)
            block_bytes = big.info.kv_cache_bytes / big.info.num_kv_blocks
            probe = EngineConfig(
                kv_cache_gb=kv_blocks * block_bytes / 2**30, kv_cache_precision=PRECISION, max_num_batched_tokens=64
            )
        engine = Engine(tiny_qwen3_fp16_ir, probe)
        engine.start()
        try:

            async def main():
                return await asyncio.gather(*(collect(engine, p, params, response_format=fmt) for p in ps))

            texts = [text for _, text, _ in asyncio.run(main())]
            assert_no_blocks_held(engine)
            return texts, engine.stats().num_preemptions
        finally:
            engine.shutdown()

    roomy, _ = replies(None)
    tight, preemptions = replies(8)  # 8 blocks of 32 tokens: four 60-token prompts with replies do not fit
    assert preemptions > 0 and tight == roomy
    assert all(re.fullmatch("[a-z ]{80}", text) for text in tight)
