"""n and logit_bias without a model: the wire formats (gRPC and OpenAI) of several candidates, their usage, the
latency clocks per candidate, the flag and the HTTP parser's checks."""

import pytest

from service.api.ovserve.v1 import ovserve_pb2 as pb
from service.client import build_request
from service.config import parse_args
from service.core.outputs import FinishReason, RequestOutput, Timings, Usage, combined_usage, summary
from service.errors import InvalidArgument
from service.http import openai_in, openai_out
from service.metrics import Metrics, TokenClocks
from service.rpc.wire import generation_request, sampling_params, unary_response
from tests.support.fakes import INFO, FakeTokenizer

TIMINGS = Timings(queue=0.0, ttft=0.1, decode=0.2, total=0.3)
LATE = Timings(queue=0.0, ttft=0.1, decode=0.5, total=0.6)
# two candidates, interleaved as the engine streams them; candidate 1 finishes first
OUTPUTS = [
    RequestOutput("r", (5,), "A", index=0),
    RequestOutput("r", (8,), "X", index=1),
    RequestOutput("r", (9,), "Y", (), FinishReason.STOP, Usage(40, 2, 0), TIMINGS, index=1),
    RequestOutput("r", (6, 7), "BC", (), FinishReason.LENGTH, Usage(40, 3, 32, 0, 1), LATE, index=0),
]


def test_usage_of_candidates_counts_the_prompt_once():
    usage = combined_usage([Usage(40, 3, 0, 0, 1), Usage(40, 2, 32), Usage(40, 4, 32, 0, 2)])
    assert usage == Usage(40, 9, 0, 0, 3, shared_prompt_tokens=64)
    assert summary(OUTPUTS[2:]).usage == Usage(40, 5, 32, 0, 1, shared_prompt_tokens=0)
    assert summary(OUTPUTS[3:]) is OUTPUTS[3]  # one candidate: its own output


def test_grpc_unary_response_of_candidates_has_choices_and_the_combined_usage():
    response = unary_response(OUTPUTS)
    assert [(c.index, c.text, list(c.token_ids)) for c in response.choices] == [
        (0, "ABC", [5, 6, 7]),
        (1, "XY", [8, 9]),
    ]
    assert [c.usage.completion_tokens for c in response.choices] == [3, 2]
    assert (response.index, response.text, response.finish_reason) == (0, "ABC", pb.FINISH_REASON_LENGTH)
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (40, 5)
    assert response.usage.cached_prompt_tokens == 32 and response.usage.accepted_draft_tokens == 1
    assert response.timings.total_seconds == pytest.approx(0.6)  # of the candidate that finished last
    single = unary_response([RequestOutput("r", (1,), "a", (), FinishReason.STOP, Usage(4, 1, 0), TIMINGS)])
    assert not single.choices and single.index == 0


def test_grpc_request_takes_n_and_logit_bias():
    request = build_request(prompt="hi", n=3, seed=5, logit_bias={7: -100.0, 2: 0.5})
    asked = generation_request(FakeTokenizer(), request, "r", None)
    assert asked.n == 3 and asked.params.seed == 5
    assert asked.params.logit_bias == ((2, 0.5), (7, -100.0))  # by id
    assert generation_request(FakeTokenizer(), build_request(prompt="hi"), "r", None).n == 1
    assert sampling_params(pb.GenerateRequest()).logit_bias == ()


def parse(body: dict) -> openai_in.ApiRequest:
    return openai_in.parse_completion({"prompt": "hi", **body}, INFO)


def test_openai_n_and_logit_bias_are_parsed():
    parsed = parse({"n": 4, "logit_bias": {"12": 3, "7": -100.0}})
    assert parsed.n == 4 and parsed.params.logit_bias == ((7, -100.0), (12, 3.0))
    assert parse({}).n == 1 and parse({"n": None}).n == 1
    assert parse({"n": 0}).n == 0  # the range is the engine's check, which names --max-n


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"n": "3"}, "n"),
        ({"n": True}, "n"),
        ({"logit_bias": {"٣": 1}}, "logit_bias.٣"),  # a digit, but not ASCII
        ({"logit_bias": {"+3": 1}}, "logit_bias.+3"),
        ({"logit_bias": {"9" * 40: 1}}, "logit_bias." + "9" * 32),  # shown cut short
        ({"logit_bias": {"3": None}}, "logit_bias.3"),
        ({"logit_bias": "3:1"}, "logit_bias"),
    ],
)
def test_openai_refuses_bad_n_and_logit_bias_naming_the_field(body, param):
    with pytest.raises(InvalidArgument) as err:
        parse(body)
    assert err.value.field == param


def reply(n: int, stream: bool, chat: bool = True) -> openai_out.Reply:
    body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    body |= {"n": n, "stream": stream} | ({"stream_options": {"include_usage": True}} if stream else {})
    parsed = (openai_in.parse_chat if chat else openai_in.parse_completion)(body, INFO)
    return openai_out.Reply(parsed, "m", "id", str)


def test_openai_response_has_a_choice_per_candidate_and_usage_once():
    body = reply(2, stream=False).response(OUTPUTS)
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "ABC", "length"),
        (1, "XY", "stop"),
    ]
    assert body["usage"]["prompt_tokens"] == 40 and body["usage"]["completion_tokens"] == 5
    assert body["usage"]["total_tokens"] == 45
    assert body["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 32,
        "disk_tokens": 0,
        "remote_tokens": 0,
        "shared_tokens": 0,
    }


def test_openai_stream_tags_chunks_and_sends_usage_after_the_last_choice():
    r = reply(2, stream=True)
    first = r.first_chunks()
    assert [c["choices"][0]["index"] for c in first] == [0, 1]
    chunks = [c for out in OUTPUTS for c in r.chunks(out)]
    assert r.done
    usage = [c for c in chunks if not c["choices"]]
    assert len(usage) == 1 and chunks[-1] is usage[0] and usage[0]["usage"]["completion_tokens"] == 5
    finishes = [(c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for c in chunks if c["choices"]]
    assert [f for f in finishes if f[1]] == [(1, "stop"), (0, "length")]
    texts = {0: "", 1: ""}
    for c in chunks:
        if c["choices"]:
            texts[c["choices"][0]["index"]] += c["choices"][0]["delta"].get("content") or ""
    assert texts == {0: "ABC", 1: "XY"}


def test_one_time_to_first_token_per_request_and_latencies_per_candidate():
    metrics = Metrics()
    now = iter([1.0, 1.5, 3.0, 3.5])
    clocks = TokenClocks(metrics, started=0.0, clock=lambda: next(now))
    for index, ids in ((0, (1,)), (1, (2,)), (0, (3, 4)), (1, (5,))):
        clocks.tick(RequestOutput("r", ids, "", index=index))
    value = metrics.registry.get_sample_value
    assert value("ovserve_time_to_first_token_seconds_count", {"tenant": ""}) == 1
    assert value("ovserve_time_to_first_token_seconds_sum", {"tenant": ""}) == 1.0
    # candidate 0: 2 tokens 2 s after its first; candidate 1: one token 2 s after its first
    assert value("ovserve_inter_token_latency_seconds_count") == 3
    assert value("ovserve_inter_token_latency_seconds_sum") == 4.0


def test_the_max_n_flag():
    assert parse_args(["--model", "m"], env={}).engine.max_n == 8
    assert parse_args(["--model", "m", "--max-n", "2"], env={}).engine.max_n == 2
    assert parse_args(["--model", "m"], env={"OVSERVE_MAX_N": "16"}).engine.max_n == 16
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--max-n", "0"], env={})
