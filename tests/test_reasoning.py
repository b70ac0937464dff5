"""Qwen3 reasoning without a model: the hybrid-thinking template (templates/qwen3-thinking.jinja) rendered with
the real Qwen3 vocabulary as transformers renders it, the splitter and the reply assembler on real token
sequences fed a few tokens at a time, with stop strings and tool calls, and the grammar that lets a reply reason
before its format."""

import json

import pytest

from service.core.grammar import GrammarCompiler, ResponseFormat
from service.core.outputs import FinishReason
from service.core.params import SamplingParams
from service.core.reasoning import ReasoningSplitter, after_reasoning, starts_inside
from service.core.tools import Mode, Tool, ToolChoice, Tools
from service.engine.core import EngineOutput
from service.engine.reply import ReplyAssembler
from service.engine.tokenizer import Tokenizer
from service.serving.prompt import reasons
from tests.support.paths import ROOT, TEMPLATE

THINKING = ROOT / "templates/qwen3-thinking.jinja"
THINK, UNTHINK, CALL, UNCALL, IM_END = 151667, 151668, 151657, 151658, 151645
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}}]
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "<think>\nA greeting.\n</think>\n\nHello!"},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "\nI should call the tool.\n",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    },
    {"role": "tool", "content": '{"temp": 21}'},
]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """The real Qwen3 vocabulary with the hybrid-thinking template, saved as a model folder."""
    from convert.synthetic import qwen3_tokenizer

    folder = tmp_path_factory.mktemp("qwen3-thinking")
    hf = qwen3_tokenizer(THINKING.read_text())
    hf.save_pretrained(folder)
    return hf, Tokenizer(folder)


def words(tokenizer, *parts):
    """Token ids of text parts and ids, in order."""
    return [t for p in parts for t in ([p] if isinstance(p, int) else tokenizer.encode(p, add_special_tokens=False))]


@pytest.mark.parametrize("thinking", [None, True, False])
def test_the_thinking_template_renders_as_transformers_does(qwen3, thinking):
    hf, ours = qwen3
    options = {} if thinking is None else {"enable_thinking": thinking}
    text = ours.apply_chat_template(HISTORY, TOOLS, thinking)
    assert text == hf.apply_chat_template(HISTORY, tools=TOOLS, tokenize=False, add_generation_prompt=True, **options)
    # an earlier turn's reasoning is dropped; the reasoning of the tool-using turn under way is shown again
    assert "A greeting." not in text and "Hello!<|im_end|>" in text
    assert "<think>\nI should call the tool.\n</think>\n\n<tool_call>" in text
    closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert text.endswith(closed) == (thinking is False)
    assert text.endswith("<|im_start|>assistant\n" if thinking is not False else closed)


def test_only_templates_that_reason_split_replies(qwen3, tmp_path):
    hf, ours = qwen3
    assert ours.think_ids == (THINK, UNTHINK)
    assert reasons(ours, True, None) and reasons(ours, True, True)
    assert not reasons(ours, True, False) and not reasons(ours, False, None)  # off, or a raw prompt
    hf.save_pretrained(tmp_path)
    instruct = Tokenizer(tmp_path, TEMPLATE)  # Qwen3-2507 Instruct: same vocabulary, replies never reason
    assert instruct.think_ids is None and not reasons(instruct, True, None)


def test_a_prompt_that_opens_the_block_starts_the_reply_inside_it(qwen3):
    _, ours = qwen3
    closed = ours.encode_chat([{"role": "user", "content": "Hi"}], enable_thinking=False)
    tail = words(ours, THINK, "\n\n", UNTHINK, "\n\n")
    assert closed[-len(tail) :] == tail
    assert not starts_inside(closed, THINK, UNTHINK)
    assert starts_inside([*closed, THINK, 198], THINK, UNTHINK)
    assert not starts_inside(ours.encode_chat([{"role": "user", "content": "Hi"}]), THINK, UNTHINK)


def assemble(ours, ids, step, params=None, call_ids=None, inside=False):
    """The reply of ids fed step tokens at a time, the last output finishing it: (outputs, reasoning, text)."""
    reply = ReplyAssembler(
        "r",
        5,
        0.0,
        params or SamplingParams(),
        ours.decode,
        call_ids,
        reasoning=ReasoningSplitter(ours.decode, THINK, UNTHINK, inside),
    )
    outputs = []
    for i in range(0, len(ids), step):
        last = i + step >= len(ids)
        out = EngineOutput(1, ids[i : i + step], finish_reason=FinishReason.STOP if last else None)
        outputs.append(reply.add(out))
        if reply.finished:
            break
    return outputs, "".join(o.reasoning for o in outputs), "".join(o.text for o in outputs)


@pytest.mark.parametrize("step", [1, 2, 3, 1000])
def test_reasoning_and_answer_stream_apart(qwen3, step):
    _, ours = qwen3
    block = words(ours, THINK, "\nLet me think: 2 + 2 = 4 🤔.\n\n", UNTHINK)
    ids = [*block, *words(ours, "\n\nIt is 4.")]
    outputs, reasoning, text = assemble(ours, ids, step)
    assert reasoning == "Let me think: 2 + 2 = 4 🤔." and text == "It is 4."
    assert "\ufffd" not in reasoning
    usage = outputs[-1].usage
    assert usage.reasoning_tokens == len(block) and usage.completion_tokens == len(ids)
    # the reasoning comes before any text
    first_text = next(i for i, o in enumerate(outputs) if o.text)
    assert all(not o.reasoning for o in outputs[first_text + 1 :])


def test_a_reply_cut_while_reasoning_is_all_reasoning(qwen3):
    _, ours = qwen3
    ids = words(ours, "still thinking \n")
    outputs, reasoning, text = assemble(ours, ids, 2, inside=True)
    assert reasoning == "still thinking" and text == ""
    assert outputs[-1].usage.reasoning_tokens == len(ids)


def test_a_reply_without_the_opening_tag_is_all_text(qwen3):
    """Qwen3-2507 Instruct-like replies, and a <think> that is not the reply's first token."""
    _, ours = qwen3
    ids = words(ours, "Plain answer ", THINK, " then", UNTHINK)
    outputs, reasoning, text = assemble(ours, ids, 1)
    assert reasoning == "" and outputs[-1].usage.reasoning_tokens == 0
    assert text == ours.decode(ids)


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_stop_strings_match_the_answer_not_the_reasoning(qwen3, step):
    _, ours = qwen3
    ids = words(ours, THINK, "I will say STOP here.", UNTHINK, "Answer. STOP and more", IM_END)
    outputs, reasoning, text = assemble(ours, ids, step, SamplingParams(stop=("STOP",)))
    assert reasoning == "I will say STOP here." and text == "Answer. "
    assert outputs[-1].finish_reason is FinishReason.STOP
    kept = sum(len(o.token_ids) for o in outputs)
    assert "STOP" in ours.decode(ids[:kept]).split("</think>")[-1] and ids[kept - 1] != IM_END


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_a_reply_reasons_then_calls_a_tool(qwen3, step):
    _, ours = qwen3
    call = '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    ids = words(ours, THINK, "\nThe user wants weather.\n", UNTHINK, "\n\n", CALL, call, UNCALL)
    outputs, reasoning, text = assemble(ours, ids, step, call_ids=(CALL, UNCALL))
    assert reasoning == "The user wants weather." and text == ""
    calls = [d for o in outputs for d in o.tool_calls]
    assert calls[0].name == "get_weather"
    assert json.loads("".join(d.arguments for d in calls)) == {"city": "Paris"}
    assert outputs[-1].finish_reason is FinishReason.TOOL_CALLS


@pytest.fixture(scope="module")
def compiler(qwen3):
    hf, _ = qwen3
    return GrammarCompiler(hf.backend_tokenizer.to_str(), 151936, (IM_END, 151643))


SCHEMA = ResponseFormat.json_schema(
    json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
)


def test_a_format_applies_after_the_reasoning(qwen3, compiler):
    _, ours = qwen3
    fmt = after_reasoning(SCHEMA, THINK, UNTHINK, inside=False)
    answer = words(ours, '{"a": 1}', IM_END)
    thought = words(ours, THINK, "\nFree text, even {not json}.\n", UNTHINK, "\n\n")
    assert compiler.matcher(fmt).num_valid(thought + answer) == len(thought + answer)
    assert compiler.matcher(fmt).num_valid(answer) == len(answer)  # reasoning is optional
    bad = words(ours, THINK, "x", UNTHINK, "not json")
    assert compiler.matcher(fmt).num_valid(bad) < len(bad)
    assert compiler.matcher(fmt).num_valid(words(ours, "prose")) == 0  # the answer is JSON from its start


def test_a_prompt_that_opened_the_block_must_close_it_before_the_format(qwen3, compiler):
    _, ours = qwen3
    fmt = after_reasoning(ResponseFormat.regex("a/b+"), THINK, UNTHINK, inside=True)
    ids = words(ours, "hmm", UNTHINK, "a/bb", IM_END)
    assert compiler.matcher(fmt).num_valid(ids) == len(ids)
    assert compiler.matcher(fmt).num_valid(words(ours, THINK)) == 0  # already open


def test_required_tool_calls_may_follow_reasoning(qwen3, compiler):
    _, ours = qwen3
    tools = Tools((Tool("get_weather", "", WEATHER),), ToolChoice(Mode.REQUIRED))
    fmt = after_reasoning(tools.response_format(CALL, UNCALL), THINK, UNTHINK, inside=False)
    call = words(ours, CALL, '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', UNCALL, IM_END)
    ids = words(ours, THINK, "Think.", UNTHINK, "\n\n") + call
    assert compiler.matcher(fmt).num_valid(ids) == len(ids)
    assert compiler.matcher(fmt).num_valid(words(ours, "Sure")) == 0  # calls only
