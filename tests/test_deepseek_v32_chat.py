"""DeepSeek-V3.2's chat encoding (dsaserve/deepseek_v32_chat.py) against prompts written out by hand from the
format's description, and as token ids: every marker a single special or added token at its place."""

import json

import pytest

from dsaserve.chat_template import ChatTemplateError
from dsaserve.deepseek_v32_chat import TOOLS_PROMPT, DeepseekV32Chat
from dsaserve.tokenizer import Tokenizer

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 3})}}
DSML_CALL = ("\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
             "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n"
             "<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n"
             "</｜DSML｜invoke>\n</｜DSML｜function_calls>")
TOOLS_SYSTEM = f"\n\n{TOOLS_PROMPT}{json.dumps(WEATHER['function'], ensure_ascii=False)}\n</functions>\n"
chat = DeepseekV32Chat()


def test_chat_mode_closes_the_reasoning_in_the_prompt():
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2 + 2?"}]
    assert chat.render(messages) == f"{BOS}You are terse.<｜User｜>What is 2 + 2?<｜Assistant｜></think>"


def test_thinking_mode_opens_it_after_the_last_user_turn_only():
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!", "reasoning_content": "a greeting"},
                {"role": "user", "content": "2 + 2?"}]
    expected = (f"{BOS}<｜User｜>Hi<｜Assistant｜></think>Hello!{EOS}"  # earlier reasoning is dropped
                "<｜User｜>2 + 2?<｜Assistant｜><think>")
    assert chat.render(messages, thinking=True) == expected
    assert chat.render(messages, enable_thinking=True) == expected  # the name GLM's templates use
    assert chat.render(messages).endswith("<｜User｜>2 + 2?<｜Assistant｜></think>")


def test_a_tool_round_with_thinking():
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "reasoning_content": "I need the tool.", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    expected = (f"{BOS}{TOOLS_SYSTEM}<｜User｜>Weather in Paris?<｜Assistant｜><think>"
                f"I need the tool.</think>{DSML_CALL}{EOS}"  # reasoning after the last user turn is kept
                "\n\n<function_results>\n<result>sunny</result>\n</function_results>\n\n<think>")
    assert chat.render(messages, tools=[WEATHER], thinking=True) == expected


def test_two_calls_answered_in_one_results_block_without_thinking():
    second = {**CALL, "id": "call_2", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris and Oslo?"},
                {"role": "assistant", "content": "Checking.", "tool_calls": [CALL, second]},
                {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "rain"},
                {"role": "assistant", "content": "Sunny in Paris, rain in Oslo."}]
    oslo = ("<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Oslo"
            "</｜DSML｜parameter>\n</｜DSML｜invoke>")
    calls = DSML_CALL.replace("</｜DSML｜invoke>\n</｜DSML｜function_calls>",
                              f"</｜DSML｜invoke>\n{oslo}\n</｜DSML｜function_calls>")
    expected = (f"{BOS}{TOOLS_SYSTEM}Be brief.<｜User｜>Paris and Oslo?<｜Assistant｜></think>Checking.{calls}{EOS}"
                "\n\n<function_results>\n<result>sunny</result>\n<result>rain</result>\n</function_results>\n\n"
                f"</think>Sunny in Paris, rain in Oslo.{EOS}")
    assert chat.render(messages, tools=[WEATHER]) == expected


@pytest.fixture(scope="module")
def tokenizer(make_checkpoint):
    return Tokenizer(make_checkpoint("deepseek_v32", seed=0, model_type="deepseek_v32", n_routed_experts=16,
                                     num_experts_per_tok=4, n_group=4, topk_group=2))


def test_the_markers_are_single_tokens_at_their_places(tokenizer):
    def one(token: str) -> int:
        ids = tokenizer.encode(token, add_special_tokens=False)
        assert len(ids) == 1, token
        return ids[0]

    def text(s: str) -> list[int]:
        return tokenizer.encode(s, add_special_tokens=False)

    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "What is 2 + 2?"}]
    ids = tokenizer.encode(chat.render(messages, thinking=True), add_special_tokens=False)
    assert ids == ([one(BOS)] + text("You are terse.") + [one("<｜User｜>")] + text("Hi")
                   + [one("<｜Assistant｜>"), one("</think>")] + text("Hello!") + [one(EOS), one("<｜User｜>")]
                   + text("What is 2 + 2?") + [one("<｜Assistant｜>"), one("<think>")])
    assert ids[0] == 0 and one(EOS) == 1  # DeepSeek's begin and end of sentence ids


@pytest.mark.parametrize("messages, message", [
    ([{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}], "messages.1 is a tool result with no "
                                                                             "matching call"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
      {"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}], "messages.3 is a tool result"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": "{not json"}}]}], "messages.1.tool_calls.0.function.arguments"),
])
def test_conversations_the_format_cannot_hold_name_the_message(messages, message):
    with pytest.raises(ChatTemplateError, match=message):
        chat.render(messages, tools=[WEATHER])
