"""OpenAI request bodies checked as OpenAI types them, without a model: every wrong type is a 400 naming the
exact field (only null counts as unset), objects take only their known keys, and the fields the openai SDK
sends are accepted."""

import pytest

from service.core.stats import ModelInfo
from service.errors import InvalidArgument
from service.http.openai_in import parse_chat, parse_completion

INFO = ModelInfo("m", "/nowhere", 64, 64, 100, (2,), 1, 1024, 4, 16, 2, 64)
HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"stream": {}}, "stream"),
        ({"stream": []}, "stream"),
        ({"parallel_tool_calls": {}}, "parallel_tool_calls"),
        ({"tools": {}}, "tools"),
        ({"tools": []}, "tools"),
        ({"response_format": {}}, "response_format.type"),
        ({"response_format": {"type": "text", "extra": 1}}, "response_format.extra"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "x": 1}}},
            "response_format.json_schema.x",
        ),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"user": 5}, "user"),
        ({"user": {"id": 1}}, "user"),
        ({"metadata": "x"}, "metadata"),
        ({"metadata": 3}, "metadata"),
        ({"metadata": ["a"]}, "metadata"),
        ({"metadata": {"k": 1}}, "metadata.k"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"store": "yes"}, "store"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
        ({"tools": [{"type": "function", "function": {"name": "f"}, "x": 1}]}, "tools[0].x"),
        ({"tools": [{"type": "function", "function": {"name": "f", "y": 1}}]}, "tools[0].function.y"),
        ({"tools": [{"type": "function", "function": {"name": "f", "strict": "no"}}]}, "tools[0].function.strict"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}, "z": 1}}, "tool_choice.z"),
        ({"stream": True, "stream_options": {"include_obfuscation": "no"}}, "stream_options.include_obfuscation"),
    ],
)
def test_wrong_types_are_refused_naming_the_field(extra, field):
    body = {"messages": HI} | extra
    with pytest.raises(InvalidArgument) as err:
        parse_chat(body, INFO)
    assert err.value.field == field


def test_what_the_sdk_sends_is_accepted():
    body = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ],
        "stream": True,
        "stream_options": {"include_usage": True, "include_obfuscation": False},
        "user": "u-1",
        "metadata": {"team": "docs"},
        "store": False,
        "n": 1,
        "tools": [
            {
                "type": "function",
                "function": {"name": "f", "description": "d", "parameters": {"type": "object"}, "strict": True},
            }
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "response_format": None,
        "temperature": None,
    }
    parsed = parse_chat(body, INFO)
    assert parsed.stream and parsed.include_usage and parsed.tools is not None
    assert (
        parse_chat(
            {
                "messages": HI,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "description": "d", "schema": {"type": "object"}, "strict": True},
                },
            },
            INFO,
        ).response_format
        is not None
    )


def test_a_prompt_and_max_tokens_beyond_the_context_are_refused_naming_the_field_sent():
    parsed = parse_chat({"messages": HI, "max_completion_tokens": 60}, INFO)
    with pytest.raises(InvalidArgument) as err:
        parsed.generation_request(list(range(10)), "messages", "id", INFO.max_model_len)
    assert err.value.field == "max_completion_tokens" and "at most 54 new tokens" in str(err.value)
    assert parsed.generation_request(list(range(4)), "messages", "id", INFO.max_model_len).params.max_new_tokens == 60
    # without max_tokens the reply may run to the end of the context
    unset = parse_completion({"prompt": "x"}, INFO)
    assert unset.generation_request(list(range(10)), "prompt", "id", INFO.max_model_len).prompt_token_ids
