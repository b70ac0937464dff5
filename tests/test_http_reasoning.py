"""Qwen3 reasoning end to end: the tiny Qwen3 (real vocabulary, random weights) served with the hybrid-thinking
template, and with a variant that opens the reasoning block in the prompt (as Qwen3's thinking-only models do),
so that the random model's reply is reasoning whatever it writes; driven by the openai SDK and the gRPC client.
Splitting a reasoning block that the reply itself opens and closes is tested on real token sequences in
tests/test_reasoning.py (the random model does not choose those tokens)."""

import json

import openai
import pytest

from service.api.ovserve.v1 import ovserve_pb2 as pb
from service.client import Client, main
from tests.support.servers import TIMEOUT, wait_idle
from tests.support.thinking import THINKING, opened_template, serve

ASK = [{"role": "user", "content": "What is 2 + 2?"}]
GREEDY = {"temperature": 0, "max_tokens": 12}


@pytest.fixture(scope="module")
def hybrid(tiny_qwen3_ir):
    yield from serve(tiny_qwen3_ir, THINKING)


@pytest.fixture(scope="module")
def opened(tiny_qwen3_ir, tmp_path_factory):
    yield from serve(tiny_qwen3_ir, opened_template(tmp_path_factory.mktemp("opened")))


def stream_parts(chunks):
    reasoning, content, usage = "", "", None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            assert not (delta.get("reasoning") and delta.get("content")), "one part per chunk"
            assert not (delta.get("reasoning") and content), "reasoning comes before the answer"
            reasoning += delta.get("reasoning") or ""
            content += delta.get("content") or ""
    return reasoning, content, usage


def test_a_reply_inside_an_opened_block_is_reasoning_whole_streamed_and_over_grpc(opened):
    running, sdk = opened
    model = running.engine.info.model_id
    reply = sdk.chat.completions.create(model=model, messages=ASK, **GREEDY)
    message, usage = reply.choices[0].message, reply.usage
    assert message.reasoning and not message.content
    assert usage.completion_tokens_details.reasoning_tokens == usage.completion_tokens == 12  # max_tokens counts it
    assert reply.choices[0].finish_reason == "length"
    stream = sdk.chat.completions.create(
        model=model, messages=ASK, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    reasoning, content, streamed_usage = stream_parts(stream)
    assert (reasoning, content) == (message.reasoning, "")
    assert streamed_usage.completion_tokens_details.reasoning_tokens == 12
    with Client(running.target) as client:
        whole = client.generate(messages=ASK, max_new_tokens=12, timeout=TIMEOUT)
        parts = list(client.stream(messages=ASK, max_new_tokens=12, timeout=TIMEOUT))
    assert whole.reasoning_text == message.reasoning and whole.text == ""
    assert whole.usage.reasoning_tokens == 12
    assert "".join(p.reasoning_text for p in parts) == whole.reasoning_text
    wait_idle(running.engine)


def test_enable_thinking_false_answers_at_once(opened):
    running, sdk = opened
    model = running.engine.info.model_id
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    reply = sdk.chat.completions.create(model=model, messages=ASK, extra_body=off, **GREEDY)
    message = reply.choices[0].message
    assert message.content and getattr(message, "reasoning", None) is None
    assert reply.usage.completion_tokens_details.reasoning_tokens == 0
    with Client(running.target) as client:
        whole = client.generate(messages=ASK, max_new_tokens=12, enable_thinking=False, timeout=TIMEOUT)
    assert whole.text == message.content and whole.reasoning_text == "" and whole.usage.reasoning_tokens == 0


def test_the_client_cli_prints_the_reasoning_to_stderr_and_can_switch_it_off(opened, capsys):
    running, _ = opened
    ask = ["What is 2 + 2?", "--target", running.target, "--max-new-tokens", "6", "--usage"]
    assert main(ask) == 0
    out, err = capsys.readouterr()
    assert out.strip() == "" and "(6 reasoning)" in err and len(err.split("\n[")[0].strip()) > 0
    assert main([*ask, "--no-thinking"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and "(0 reasoning)" in err


def test_the_hybrid_template_closes_the_block_in_the_prompt_when_thinking_is_off(hybrid):
    running, sdk = hybrid
    model = running.engine.info.model_id
    on = sdk.chat.completions.create(model=model, messages=ASK, **GREEDY)
    off = sdk.chat.completions.create(
        model=model, messages=ASK, extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **GREEDY
    )
    # <think>, "\n\n", </think>, "\n\n": the prompt grew by the closed block
    assert off.usage.prompt_tokens == on.usage.prompt_tokens + 4
    # thinking off: the reply is never split; on: split exactly when the model opened a block
    assert getattr(off.choices[0].message, "reasoning", None) is None
    assert off.usage.completion_tokens_details.reasoning_tokens == 0
    reasoned = getattr(on.choices[0].message, "reasoning", None)
    assert (on.usage.completion_tokens_details.reasoning_tokens > 0) == bool(reasoned)
    wait_idle(running.engine)


def check_reply_to_a_format(reply, answer_is_valid):
    """The grammar lets the reply open a reasoning block (free text) before its answer: either it reasoned
    (and max_tokens may end it there), or it answered validly at once."""
    message, usage = reply.choices[0].message, reply.usage
    if getattr(message, "reasoning", None):
        assert usage.completion_tokens_details.reasoning_tokens > 0
        if reply.choices[0].finish_reason == "length" and not message.content:
            assert usage.completion_tokens_details.reasoning_tokens == usage.completion_tokens
            return "reasoned"
    assert answer_is_valid(message)
    return "answered"


def test_a_format_or_tool_calls_follow_the_reasoning_the_model_may_open(hybrid):
    """The random model, masked to `<think>` or the format's first token, takes `<think>` (its weights are
    fixed by the synthetic checkpoint's seed): the reasoning it then writes is split off end to end."""
    running, sdk = hybrid
    model = running.engine.info.model_id
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    reply = sdk.chat.completions.create(model=model, messages=ASK, response_format=fmt, temperature=0, max_tokens=40)
    assert check_reply_to_a_format(reply, lambda m: isinstance(json.loads(m.content)["n"], int)) == "reasoned"
    stream = sdk.chat.completions.create(
        model=model, messages=ASK, response_format=fmt, temperature=0, max_tokens=40, stream=True
    )
    assert stream_parts(stream)[:2] == (reply.choices[0].message.reasoning, "")
    tools = [{"type": "function", "function": {"name": "add", "parameters": schema}}]
    called = sdk.chat.completions.create(
        model=model, messages=ASK, tools=tools, tool_choice="required", temperature=0, max_tokens=40
    )
    check_reply_to_a_format(called, lambda m: m.tool_calls and m.tool_calls[0].function.name == "add")
    with pytest.raises(openai.BadRequestError) as err:
        bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "a"}}}
        sdk.chat.completions.create(model=model, messages=ASK, response_format=bad, max_tokens=4)
    assert err.value.body["param"] == "response_format.json_schema.schema"  # named as without reasoning
    wait_idle(running.engine)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"chat_template_kwargs": "on"}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs.enable_thinking"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
        ({"messages": [{"role": "user", "content": "Hi", "reasoning": "x"}]}, "messages[0].reasoning"),
        ({"messages": [{"role": "assistant", "content": "a", "reasoning": 3}, *ASK]}, "messages[0].reasoning"),
    ],
)
def test_hostile_reasoning_fields_are_400_naming_the_path(hybrid, extra, param):
    running, sdk = hybrid
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(model=running.engine.info.model_id, messages=ASK, max_tokens=2, extra_body=extra)
    assert err.value.body["param"] == param, err.value.body


def test_reasoning_sent_back_in_the_history_is_accepted(hybrid):
    running, sdk = hybrid
    history = [*ASK, {"role": "assistant", "content": "4", "reasoning": "Simple sum."}, ASK[0]]
    reply = sdk.chat.completions.create(model=running.engine.info.model_id, messages=history, max_tokens=2)
    assert reply.usage.prompt_tokens > 0


def test_a_template_without_thinking_ignores_the_switch(tools_server):
    """Qwen3-2507 Instruct's template: enable_thinking changes nothing and replies carry no reasoning."""
    with openai.OpenAI(base_url=tools_server.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT) as sdk:
        model = tools_server.engine.info.model_id
        plain = sdk.chat.completions.create(model=model, messages=ASK, **GREEDY)
        off = sdk.chat.completions.create(
            model=model, messages=ASK, extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **GREEDY
        )
    assert off.choices[0].message.content == plain.choices[0].message.content
    assert off.usage.prompt_tokens == plain.usage.prompt_tokens
    assert "reasoning" not in plain.choices[0].message.model_dump(exclude_none=True)
    assert plain.usage.completion_tokens_details.reasoning_tokens == 0
    assert pb.Usage(reasoning_tokens=1).reasoning_tokens == 1
