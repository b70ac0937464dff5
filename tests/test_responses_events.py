"""The Responses stream's events without a model: a reply that reasons, writes text and calls two tools, fed
to the openai SDK's own stream accumulator (what `client.responses.stream()` runs), which must end with the same
response as the whole (non-streamed) one."""

import json

import pytest
from openai import omit
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from service.core.outputs import FinishReason, RequestOutput, ToolCallDelta, Usage
from service.http.responses_in import parse_responses
from service.http.responses_out import ResponseReply
from tests.support.fakes import INFO

TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}


def outputs(finish):
    usage = Usage(5, 9, 0, reasoning_tokens=4)
    return [
        RequestOutput("r", (1, 2), "", reasoning="Let me"),
        RequestOutput("r", (3, 4), "Sure", reasoning=" think."),
        RequestOutput("r", (5,), ", calling.", tool_calls=(ToolCallDelta(0, "call_a", "f"),)),
        RequestOutput(
            "r", (6,), "", tool_calls=(ToolCallDelta(0, arguments='{"x": '), ToolCallDelta(0, arguments="1}"))
        ),
        RequestOutput("r", (7, 8), "", tool_calls=(ToolCallDelta(1, "call_b", "f", "{}"),)),
        RequestOutput("r", (9,), "", finish_reason=finish, usage=usage),
    ]


@pytest.mark.parametrize("finish", [FinishReason.TOOL_CALLS, FinishReason.LENGTH])
def test_the_sdk_accumulates_the_stream_into_the_whole_response(finish):
    call = parse_responses({"input": "hi", "tools": [TOOL], "stream": True}, INFO)
    stream, whole = ResponseReply(call, "m", "1", str), ResponseReply(call, "m", "1", str)
    events = stream.first_chunks() + [e for out in outputs(finish) for e in stream.chunks(out)]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    state = ResponseStreamState(input_tools=[TOOL], text_format=omit)
    handled = [
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=json.loads(json.dumps(e)))) for e in events
    ]
    completed = handled[-1][-1]
    assert completed.type == "response.completed"
    final = completed.response  # as parsed by the SDK's stream helper
    expected = whole.response(outputs(finish))
    assert [i.type for i in final.output] == [i["type"] for i in expected["output"]]
    assert [i.type for i in final.output] == ["reasoning", "message", "function_call", "function_call"]
    assert final.output[0].content[0].text == "Let me think."
    assert final.output_text == "Sure, calling."
    assert [(c.call_id, c.arguments) for c in final.output[2:]] == [("call_a", '{"x": 1}'), ("call_b", "{}")]
    assert final.status == expected["status"] == ("incomplete" if finish is FinishReason.LENGTH else "completed")
    assert final.usage.output_tokens_details.reasoning_tokens == 4
