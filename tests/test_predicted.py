"""Predicted outputs on the default model (SmolLM2 int8, deterministic steps, speculation off by default) as
served: the prediction's tokens are drafts verified exactly, so a greedy or seeded reply is plain decoding's
whatever the prediction (right, partly right, wrong), with logprobs, penalties, stop strings, structured output
and streaming, through the openai SDK and the gRPC client; usage counts kept and rejected prediction tokens;
hostile values are refused naming the field; aborted replies leave no KV block behind. The rules without a model
are in test_predicted_rules.py."""

import asyncio
import json

import grpc
import httpx
import openai
import pytest

from service.client import Client
from service.core.params import SamplingParams
from service.engine import GenerationRequest
from tests.support.engine import assert_no_blocks_held, collect
from tests.support.servers import TIMEOUT

NEW = 64
TEXT = (
    "The town library on Alder Street opened in 1962 and has been run by volunteers for most of that time. "
    "Besides lending books, they organize a reading club on Tuesday evenings and a homework corner for children."
)
# SmolLM2-135M rewrites it shorter: its reply keeps the text's start, skips words and puts others in
MESSAGES = [{"role": "user", "content": f"Rewrite the following text so that it is clearer:\n\n{TEXT}"}]
UNRELATED = "Bananas are rich in potassium. 我们明天去公园散步吧。 SELECT * FROM orders WHERE total > 100;"


@pytest.fixture(scope="module")
def smol(smol_server):
    return smol_server  # no prefix cache: a request asked twice computes the same steps


def ask(engine, params: SamplingParams, prediction: str = "", messages=MESSAGES, **kw):
    """tokens, text and the last output of one request straight to the engine."""
    prompt = engine.tokenizer.encode_chat(messages)
    predicted = engine.tokenizer.encode(prediction, add_special_tokens=False) if prediction else []
    return asyncio.run(collect(engine, prompt, params, prediction=predicted, **kw))


def edited(text: str) -> str:
    """A partly right prediction of text: a sentence inserted in the middle, and a stretch after it left out."""
    words = text.split(" ")
    half = len(words) // 2
    return " ".join([*words[:half], "Every", "year", "it", "holds", "a", "fair.", *words[half + 6 :]])


def test_greedy_replies_are_plain_decodings_whatever_the_prediction(smol):
    engine = smol.engine
    greedy = SamplingParams(max_new_tokens=NEW)
    plain, plain_text, plain_last = ask(engine, greedy)
    assert plain_last.usage.accepted_prediction_tokens == plain_last.usage.rejected_prediction_tokens == 0
    predictions = {"right": plain_text, "edited": edited(plain_text), "original": TEXT, "wrong": UNRELATED}
    usages = {}
    for name, prediction in predictions.items():
        before = engine.stats()
        tokens, _, last = ask(engine, greedy, prediction)
        assert tokens == plain, name
        u = usages[name] = last.usage
        drafts = engine.stats().num_draft_tokens - before.num_draft_tokens
        # the kept predicted drafts are in the reply; kept and rejected ones were all verified
        assert u.accepted_prediction_tokens <= u.accepted_draft_tokens <= u.completion_tokens, (name, u)
        assert u.accepted_prediction_tokens + u.rejected_prediction_tokens <= drafts, (name, u, drafts)
    right = usages["right"]
    assert right.accepted_prediction_tokens >= right.completion_tokens // 2, right
    assert right.rejected_prediction_tokens <= right.accepted_prediction_tokens // 4, right
    for name in ("edited", "original"):  # text the reply skips or does not have: drafts go on after it
        assert 0 < usages[name].accepted_prediction_tokens < usages[name].completion_tokens, (name, usages[name])
    assert usages["wrong"].accepted_prediction_tokens <= 3, usages["wrong"]
    assert_no_blocks_held(engine)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=NEW, temperature=0.8, seed=7),
        SamplingParams(max_new_tokens=NEW, temperature=0.5, top_p=0.9, top_k=40, seed=3, logprobs=2),
        SamplingParams(max_new_tokens=NEW, logprobs=3),
        SamplingParams(max_new_tokens=NEW, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3),
    ],
    ids=["seeded", "seeded-logprobs", "greedy-logprobs", "penalties"],
)
def test_sampling_logprobs_and_penalties_give_the_reply_without_a_prediction(smol, params):
    engine = smol.engine
    plain = outputs(engine, params)
    tokens = tokens_of(plain)
    greedy_text = engine.tokenizer.decode(tokens_of(outputs(engine, SamplingParams(max_new_tokens=NEW))))
    exact = engine.tokenizer.decode(tokens)
    for prediction in (exact, greedy_text):  # the reply itself, and one like it in part
        predicted = outputs(engine, params, prediction)
        assert tokens_of(predicted) == tokens
        assert [lp for o in predicted for lp in o.logprobs] == [lp for o in plain for lp in o.logprobs]
        if prediction == exact:
            assert predicted[-1].usage.accepted_prediction_tokens > 0


def tokens_of(outs: list) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def outputs(engine, params: SamplingParams, prediction: str = "") -> list:
    """Every output of one request, whole (one output) unless logprobs or a prediction split it."""

    async def main():
        prompt = engine.tokenizer.encode_chat(MESSAGES)
        ids = engine.tokenizer.encode(prediction, add_special_tokens=False) if prediction else []
        return [out async for out in engine.generate(GenerationRequest(prompt, params, prediction=ids))]

    return asyncio.run(main())


def test_a_stop_string_inside_the_prediction_ends_the_reply_where_plain_decoding_ends_it(smol):
    engine = smol.engine
    _, text, _ = ask(engine, SamplingParams(max_new_tokens=NEW))
    stop = " ".join(text.split(" ")[5:7])  # two words well inside the reply (and the prediction)
    params = SamplingParams(max_new_tokens=NEW, stop=(stop,))
    plain, plain_text, plain_last = ask(engine, params)
    tokens, predicted_text, last = ask(engine, params, text)
    assert (tokens, predicted_text) == (plain, plain_text) and stop not in predicted_text
    assert last.finish_reason == plain_last.finish_reason
    assert last.usage.accepted_prediction_tokens <= last.usage.completion_tokens
    assert_no_blocks_held(engine)


def test_structured_output_with_a_prediction_is_the_plain_reply(smol):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "opened": {"type": "integer"}},
        "required": ["name", "opened"],
        "additionalProperties": False,
    }
    messages = [{"role": "user", "content": f"Give the library's street and opening year as JSON.\n\n{TEXT}"}]
    sdk = openai.OpenAI(base_url=f"{smol.url}/v1", api_key="-", timeout=TIMEOUT)
    asked = {
        "model": smol.engine.info.model_id,
        "messages": messages,
        "max_tokens": NEW,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "library", "schema": schema}},
    }
    plain = sdk.chat.completions.create(**asked)
    reply = plain.choices[0].message.content
    json.loads(reply)  # the grammar held
    for prediction in (reply, reply.replace(":", ": ", 1) + " trailing words", '{"name": "x", "opened": 1}'):
        predicted = sdk.chat.completions.create(**asked, prediction={"type": "content", "content": prediction})
        assert predicted.choices[0].message.content == reply
    right = sdk.chat.completions.create(**asked, prediction={"type": "content", "content": reply})
    assert right.usage.completion_tokens_details.accepted_prediction_tokens > 0


def test_the_openai_sdk_sends_a_prediction_and_streams_the_same_reply(smol):
    sdk = openai.OpenAI(base_url=f"{smol.url}/v1", api_key="-", timeout=TIMEOUT)
    asked = {"model": smol.engine.info.model_id, "messages": MESSAGES, "max_tokens": NEW, "temperature": 0}
    plain = sdk.chat.completions.create(**asked).choices[0].message.content
    parts = [{"type": "text", "text": plain[:20]}, {"type": "text", "text": plain[20:]}]
    whole = sdk.chat.completions.create(**asked, prediction={"type": "content", "content": parts})
    assert whole.choices[0].message.content == plain
    details = whole.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens is not None
    chunks = list(
        sdk.chat.completions.create(
            **asked,
            prediction={"type": "content", "content": plain},
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens > 0
    # the completions endpoint takes it too
    completion = {"model": asked["model"], "prompt": TEXT[:60], "max_tokens": 24, "temperature": 0}
    text = sdk.completions.create(**completion).choices[0].text
    again = sdk.completions.create(**completion, extra_body={"prediction": {"type": "content", "content": text}})
    assert again.choices[0].text == text and again.usage.completion_tokens_details.accepted_prediction_tokens > 0


def test_the_grpc_client_sends_a_prediction(smol):
    with Client(smol.target) as client:
        asked = {"messages": MESSAGES, "max_new_tokens": NEW, "timeout": TIMEOUT}
        plain = client.generate(**asked)
        predicted = client.generate(**asked, prediction=plain.text)
        assert list(predicted.token_ids) == list(plain.token_ids)
        assert predicted.usage.accepted_prediction_tokens > 0
        assert predicted.usage.accepted_prediction_tokens <= predicted.usage.accepted_draft_tokens
        streamed = list(client.stream(**asked, prediction=plain.text))
        assert "".join(s.text for s in streamed) == plain.text
        assert streamed[-1].usage.accepted_prediction_tokens > 0
        off = client.generate(**asked, prediction=plain.text, speculation="off")  # the request's choice holds
        assert list(off.token_ids) == list(plain.token_ids) and off.usage.accepted_prediction_tokens == 0
        assert off.usage.rejected_prediction_tokens == 0
        too_long = "word " * (smol.engine.info.max_model_len + 1)
        with pytest.raises(grpc.RpcError) as err:
            client.generate(**asked, prediction=too_long)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "prediction" in err.value.details() and str(smol.engine.info.max_model_len) in err.value.details()


@pytest.mark.parametrize(
    ("prediction", "param"),
    [
        ("just text", "prediction"),
        ({"type": "content", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": 5}]}, None),
        ({"type": "content", "content": "a", "role": "assistant"}, "prediction.role"),
        ({"type": "text", "content": "a"}, "prediction.type"),
        ({"type": "content", "content": {"text": "a"}}, "prediction.content"),
        ({"type": "content", "content": "word " * 9000}, "prediction.content"),
    ],
    ids=["string", "part-text", "unknown-key", "type", "content-object", "too-long"],
)
def test_hostile_predictions_are_refused_naming_the_field(smol, prediction, param):
    body = {"messages": MESSAGES, "max_tokens": 4, "prediction": prediction}
    reply = httpx.post(f"{smol.url}/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == (param or "prediction.content[1].text"), error
    if param == "prediction.content" and "word" in str(prediction):
        assert f"at most {smol.engine.info.max_model_len}" in error["message"]
    assert_no_blocks_held(smol.engine)


def test_replies_aborted_mid_way_with_a_prediction_leave_no_blocks(smol):
    engine = smol.engine
    _, text, _ = ask(engine, SamplingParams(max_new_tokens=NEW))
    prompt = engine.tokenizer.encode_chat(MESSAGES)
    ids = engine.tokenizer.encode(text, add_special_tokens=False)

    async def abandon(after: int, params: SamplingParams):
        stream = engine.generate(GenerationRequest(prompt, params, prediction=ids))
        seen = 0
        async for out in stream:
            seen += len(out.token_ids)
            if seen >= after:
                break
        await stream.aclose()
        return seen

    async def main():
        greedy = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
        seeded = SamplingParams(max_new_tokens=NEW, ignore_eos=True, temperature=0.7, seed=1)
        return await asyncio.gather(*(abandon(after, p) for after in (1, 5, 20) for p in (greedy, seeded)))

    assert all(seen >= 1 for seen in asyncio.run(main()))
    with httpx.stream(
        "POST",
        f"{smol.url}/v1/chat/completions",
        json={
            "messages": MESSAGES,
            "max_tokens": NEW,
            "stream": True,
            "prediction": {"type": "content", "content": text},
        },
        timeout=TIMEOUT,
    ) as reply:
        next(reply.iter_lines())  # the stream has begun; closing it now aborts the request
    assert_no_blocks_held(engine)
