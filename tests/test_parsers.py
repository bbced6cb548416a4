"""Reasoning and tool-call parsing (GLM's format and DeepSeek-V3.2's DSML): results, and streaming equal to
non-streaming for any chunking."""

import json
import random

import pytest

from dsaserve.server.parsers import REASONING, OutputParser
from dsaserve.server.parsers.dsml import DEEPSEEK_V32
from dsaserve.server.parsers.glm import GLM47

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                            "zip": {"type": "string"}}}


def parse_whole(text, **kwargs):
    parser = OutputParser(GLM47, **kwargs)
    return combine([parser.feed(text), parser.finish()])


def parse_chunked(text, chunks, **kwargs):
    parser = OutputParser(GLM47, **kwargs)
    return combine([parser.feed(c) for c in chunks] + [parser.finish()])


def combine(deltas):
    return {
        "reasoning": "".join(d.reasoning for d in deltas),
        "content": "".join(d.content for d in deltas),
        "tool_calls": [(c.name, c.arguments) for d in deltas for c in d.tool_calls],
    }


def test_reasoning_then_content():
    out = parse_whole("<think>Let me think.</think>\nThe answer is 4.")
    assert out == {"reasoning": "Let me think.", "content": "The answer is 4.", "tool_calls": []}


def test_reasoning_opened_by_the_template():
    out = parse_whole("The user wants 2+2.</think>4", start_in=REASONING)
    assert out["reasoning"] == "The user wants 2+2." and out["content"] == "4"


def test_unterminated_reasoning_stays_reasoning():
    assert parse_whole("<think>still thinking")["reasoning"] == "still thinking"


def test_think_tag_after_content_is_content():
    out = parse_whole("Hello <think>not reasoning</think>")
    assert out["content"] == "Hello <think>not reasoning</think>" and out["reasoning"] == ""


def test_reasoning_parser_off_keeps_tags():
    assert parse_whole("<think>x</think>y", reasoning=False)["content"] == "<think>x</think>y"


def test_several_tool_calls_with_typed_values():
    text = ("<think>need weather</think>Checking.\n"
            "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
            "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>\n"
            "<tool_call>search<arg_key>query</arg_key><arg_value>a < b && c > d</arg_value>"
            "<arg_key>filters</arg_key><arg_value>{\"lang\": \"en\", \"max\": 5}</arg_value>"
            "<arg_key>ratio</arg_key><arg_value>0.5</arg_value></tool_call>")
    out = parse_whole(text, tool_schemas={"get_weather": WEATHER})
    assert out["reasoning"] == "need weather" and out["content"] == "Checking.\n"
    assert out["tool_calls"] == [
        ("get_weather", {"city": "Paris", "days": 3}),
        ("search", {"query": "a < b && c > d", "filters": {"lang": "en", "max": 5}, "ratio": 0.5}),
    ]


def test_schema_decides_strings_versus_json():
    text = ("<tool_call>get_weather<arg_key>zip</arg_key><arg_value>01234</arg_value>"
            "<arg_key>days</arg_key><arg_value>two</arg_value></tool_call>")
    out = parse_whole(text, tool_schemas={"get_weather": WEATHER})
    assert out["tool_calls"] == [("get_weather", {"zip": "01234", "days": "two"})]
    plain = parse_whole(text)  # no schema: JSON when it parses
    assert plain["tool_calls"] == [("get_weather", {"zip": "01234", "days": "two"})]
    assert parse_whole(text.replace("01234", "1234"))["tool_calls"][0][1]["zip"] == 1234


def test_tool_call_without_arguments_and_malformed_block():
    assert parse_whole("<tool_call>list_files</tool_call>")["tool_calls"] == [("list_files", {})]
    bad = "<tool_call>broken<arg_key>x</arg_key></tool_call>"
    out = parse_whole(bad)
    assert out["tool_calls"] == [] and out["content"] == bad


def test_tool_parser_off_keeps_markup_as_content():
    text = "<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>"
    assert parse_whole(text, tools=False)["content"] == text


def test_forced_tool_call_prefix():
    out = parse_whole("<arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_call>",
                      prefix="<tool_call>get_weather", tool_schemas={"get_weather": WEATHER})
    assert out["tool_calls"] == [("get_weather", {"city": "Oslo"})]


SAMPLES = [
    "<think>Let me think.</think>\nThe answer is 4.",
    "  <think>a</think>b <tool_call>f<arg_key>x</arg_key><arg_value>{\"k\": [1, 2]}</arg_value></tool_call>\n\ntail",
    "no tags at all, just < and > and <tool and </think and <thinking>",
    "<tool_call>f<arg_key>x</arg_key><arg_value>1</arg_value></tool_call><tool_call>g</tool_call>",
    "content then <tool_call>unterminated<arg_key>x",
    "<thin",
    ("<think>reason with <tool_call> inside</think>"
     "<tool_call>h<arg_key>s</arg_key><arg_value>x<y</arg_value></tool_call>"),
]


@pytest.mark.parametrize("text", SAMPLES)
@pytest.mark.parametrize("start_in", ["content", REASONING])
def test_streaming_equals_non_streaming(text, start_in):
    whole = parse_whole(text, start_in=start_in)
    assert parse_chunked(text, list(text), start_in=start_in) == whole  # character by character
    rng = random.Random(hash(text) % 1000)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6)))) if len(text) > 1 else []
        chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert parse_chunked(text, chunks, start_in=start_in) == whole, chunks


@pytest.mark.parametrize("text", SAMPLES)
def test_streamed_content_is_always_a_prefix_of_the_final_content(text):
    """A partial tag emitted early would show up as streamed content missing from the final content."""
    final = parse_whole(text)["content"]
    parser, streamed = OutputParser(GLM47), ""
    for ch in text:
        streamed += parser.feed(ch).content
        assert final.startswith(streamed), streamed


def test_tool_call_openai_shape():
    delta = OutputParser(GLM47).feed("<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>")
    shaped = delta.tool_calls[0].to_openai(0)
    assert shaped["type"] == "function" and shaped["id"].startswith("call_") and shaped["index"] == 0
    assert shaped["function"]["name"] == "f" and json.loads(shaped["function"]["arguments"]) == {"a": 1}


# ---- DeepSeek-V3.2's DSML tool calls (--tool-call-parser deepseek_v32) ------------------------------------------

def dsml_call(name: str, *parameters: tuple[str, str, bool]) -> str:
    lines = [f'<｜DSML｜parameter name="{k}" string="{"true" if s else "false"}">{v}</｜DSML｜parameter>'
             for k, v, s in parameters]
    return "\n".join([f'<｜DSML｜invoke name="{name}">', *lines, "</｜DSML｜invoke>"])


def dsml_block(*calls: str) -> str:
    return "\n\n<｜DSML｜function_calls>\n" + "\n".join(calls) + "\n</｜DSML｜function_calls>"


DSML_TEXT = ("I need the weather.</think>Let me check." + dsml_block(
    dsml_call("get_weather", ("city", "Paris", True), ("days", "3", False)),
    dsml_call("search", ("query", "a < b </b> && c", True), ("filters", '{"lang": "en", "max": 5}', False))))


def parse_dsml(text, chunks=None, **kwargs):
    parser = OutputParser(DEEPSEEK_V32, **kwargs)
    return combine([parser.feed(c) for c in (chunks or [text])] + [parser.finish()])


def test_dsml_calls_after_reasoning_and_content():
    out = parse_dsml(DSML_TEXT, start_in=REASONING, tool_schemas={"get_weather": WEATHER})
    assert out["reasoning"] == "I need the weather." and out["content"] == "Let me check."  # the blank line is markup
    assert out["tool_calls"] == [("get_weather", {"city": "Paris", "days": 3}),
                                 ("search", {"query": "a < b </b> && c", "filters": {"lang": "en", "max": 5}})]


def test_dsml_string_flag_and_schema_decide_the_type():
    text = dsml_block(dsml_call("get_weather", ("zip", "01234", True), ("days", "4", True), ("city", "[1]", False)))
    out = parse_dsml(text, tool_schemas={"get_weather": WEATHER})
    assert out["tool_calls"] == [("get_weather", {"zip": "01234", "days": 4, "city": "[1]"})]
    assert parse_dsml(text)["tool_calls"] == [("get_weather", {"zip": "01234", "days": "4", "city": [1]})]


@pytest.mark.parametrize("body", [
    dsml_call("f", ("a", "1", False)) + "stray text",
    '<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="a">1</｜DSML｜parameter>\n</｜DSML｜invoke>',  # no string=
    dsml_call("f", ("a", "1", False), ("a", "2", False)),  # a parameter twice
    "",
])
def test_a_malformed_dsml_block_stays_content(body):
    text = "\n\n<｜DSML｜function_calls>\n" + body + "\n</｜DSML｜function_calls>"
    out = parse_dsml(text)
    assert out["tool_calls"] == [] and out["content"] == text.lstrip()


DSML_SAMPLES = [
    DSML_TEXT,
    "Answer with trailing spaces   \n\n  and more text\n\n",
    "No calls but <｜DSML｜ and </｜DSML｜function_calls> and <｜DSML｜function_call",
    dsml_block(dsml_call("f")) + "\n\nafter the block",
    "text " + dsml_block(dsml_call("f", ("x", "1", False))).rstrip("</｜DSML｜function_calls>"),  # unterminated
]


@pytest.mark.parametrize("text", DSML_SAMPLES)
@pytest.mark.parametrize("start_in", ["content", REASONING])
def test_dsml_streaming_equals_non_streaming(text, start_in):
    whole = parse_dsml(text, start_in=start_in)
    assert parse_dsml(text, list(text), start_in=start_in) == whole  # character by character
    rng = random.Random(len(text))
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6))))
        chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert parse_dsml(text, chunks, start_in=start_in) == whole, chunks


def test_dsml_forced_prefix_reads_as_the_named_call():
    out = parse_dsml('<｜DSML｜parameter name="city" string="true">Oslo</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
                     "</｜DSML｜function_calls>", prefix=DEEPSEEK_V32.forced_prefix("get_weather"))
    assert out == {"reasoning": "", "content": "", "tool_calls": [("get_weather", {"city": "Oslo"})]}
