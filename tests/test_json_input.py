"""Clients' JSON: the checks every front end applies (json_input), without any model."""

import json

import pytest

from service.core.json_input import MAX_DEPTH, parse
from service.errors import InvalidArgument


def refused(text, field="tools[0].parameters"):
    with pytest.raises(InvalidArgument) as err:
        parse(text, field)
    return err.value.field, str(err.value)


def test_nesting_up_to_the_limit_parses_and_beyond_it_is_refused_where_it_goes_deeper():
    assert parse("[" * MAX_DEPTH + "]" * MAX_DEPTH, "f") is not None
    field, message = refused('{"a": [' + "[" * MAX_DEPTH + "]" * MAX_DEPTH + "]}")
    assert field == "tools[0].parameters.a" + "[0]" * (MAX_DEPTH - 1) and f"{MAX_DEPTH} levels" in message
    assert refused("[" * 5000 + "]" * 5000)[0] == "tools[0].parameters"  # beyond the parser: not valid JSON


def test_lone_surrogates_in_values_and_keys_are_refused_naming_their_place():
    assert refused('{"a": ["ok", "x\\ud800"]}') == (
        "tools[0].parameters.a[1]",
        "tools[0].parameters.a[1]: holds a lone UTF-16 surrogate ('\\ud800' at character 1)",
    )
    assert refused('{"k\\udc00": 1}', "")[0] == "body"
    assert parse('{"emoji": "\\ud83d\\ude00", "text": "é"}', "f") == {"emoji": "😀", "text": "é"}  # a pair is text


@pytest.mark.parametrize("text", ["{bad", "NaN", '{"a": Infinity}', b"\xff\xfe"])
def test_what_is_not_json_is_refused(text):
    assert refused(text)[0] == "tools[0].parameters"


def test_a_million_token_ids_parse():
    assert len(parse(json.dumps({"prompt": list(range(1_000_000))}), "")["prompt"]) == 1_000_000
