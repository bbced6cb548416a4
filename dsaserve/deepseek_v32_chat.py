"""DeepSeek-V3.2's chat encoding. The checkpoint ships no jinja template: its messages are encoded by this format
(what vLLM's `--tokenizer-mode deepseek_v32` does), written here from DeepSeek's published description.

    <｜begin▁of▁sentence｜>{system}[\\n\\n{tools prompt}]
    <｜User｜>{user}<｜Assistant｜></think>            (chat mode, or any user turn but the last)
    <｜User｜>{user}<｜Assistant｜><think>             (thinking mode: the last user turn)
    {reasoning}</think>{answer}\\n\\n{DSML calls}<｜end▁of▁sentence｜>   (an assistant turn; reasoning only in
                                                      thinking mode and after the last user turn)
    \\n\\n<function_results>\\n<result>{tool output}</result>…\\n</function_results>\\n\\n<think> or </think>

Thinking is off unless the request says `thinking` (vLLM's name) or `enable_thinking` in chat_template_kwargs.
The generation prompt is part of the last user (or tool) turn, so `add_generation_prompt` changes nothing. With
tools, vLLM puts them in a system turn of their own ahead of the conversation; so does this encoding.
"""

from __future__ import annotations

import json

from dsaserve.chat_template import ChatTemplateError

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
THINK_START, THINK_END = "<think>", "</think>"
DSML = "｜DSML｜"

# The model's own tool prompt (DeepSeek's published encoding); the tools' schemas go in its last lines.
TOOLS_PROMPT = f"""## Tools
You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<{DSML}function_calls>" block like the following as part of your reply to the user:
<{DSML}function_calls>
<{DSML}invoke name="$FUNCTION_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$FUNCTION_NAME2">
...
</{DSML}invoke>
</{DSML}function_calls>
String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, objects).
If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:
<{DSML}function_calls>
...
</{DSML}function_calls>
<function_results>
...
</function_results>
{THINK_START}...thinking about results{THINK_END}
Here are the functions available in JSONSchema format:
<functions>
"""  # noqa: E501 (the model's text, line for line)


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


class DeepseekV32Chat:
    """Renders conversations as DeepSeek-V3.2 reads them; the same call shape as ChatTemplate.render."""

    def render(self, messages: list[dict], /, tools: list[dict] | None = None, add_generation_prompt: bool = True,
               **template_kwargs) -> str:
        thinking = bool(template_kwargs.get("thinking", template_kwargs.get("enable_thinking", False)))
        messages = list(messages)
        if tools:
            messages.insert(0, {"role": "system", "content": "", "tools": tools})
        last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
        parts = [BOS]
        for i, message in enumerate(messages):
            role = message.get("role")
            if role == "system":
                parts.append(self._system(message))
            elif role == "user":
                parts.append(f"{USER}{message.get('content') or ''}{ASSISTANT}")
                parts.append(THINK_START if thinking and i == last_user else THINK_END)
            elif role == "assistant":
                parts.append(self._assistant(message, i - (1 if tools else 0), thinking and i > last_user))
            elif role == "tool":
                parts.append(self._tool_result(messages, i, thinking and i > last_user, bool(tools)))
            else:
                raise ChatTemplateError(f"messages.{i - (1 if tools else 0)}.role {role!r} is not one DeepSeek-V3.2 "
                                        "encodes; use system, user, assistant or tool")
        return "".join(parts)

    @staticmethod
    def _system(message: dict) -> str:
        text = message.get("content") or ""
        if message.get("tools"):
            schemas = "\n".join(_json(tool.get("function", tool)) for tool in message["tools"])
            text += f"\n\n{TOOLS_PROMPT}{schemas}\n</functions>\n"
        return text

    @staticmethod
    def _assistant(message: dict, index: int, with_reasoning: bool) -> str:
        reasoning = f"{message.get('reasoning_content') or ''}{THINK_END}" if with_reasoning else ""
        calls = message.get("tool_calls") or []
        block = ""
        if calls:
            invokes = "\n".join(_invoke(call, f"messages.{index}.tool_calls.{k}") for k, call in enumerate(calls))
            block = f"\n\n<{DSML}function_calls>\n{invokes}\n</{DSML}function_calls>"
        return f"{reasoning}{message.get('content') or ''}{block}{EOS}"

    @staticmethod
    def _tool_result(messages: list[dict], index: int, thinking: bool, shifted: bool) -> str:
        caller = index - 1
        while caller >= 0 and messages[caller].get("role") == "tool":
            caller -= 1
        order = index - caller  # 1 for the first result after the assistant turn
        calls = messages[caller].get("tool_calls") if caller >= 0 and messages[caller].get("role") == "assistant" \
            else None
        if not calls or order > len(calls):
            raise ChatTemplateError(f"messages.{index - shifted} is a tool result with no matching call: it must "
                                    "follow an assistant message whose tool_calls it answers, one result per call")
        text = "\n\n<function_results>" if order == 1 else ""
        text += f"\n<result>{messages[index].get('content') or ''}</result>"
        if order == len(calls):
            text += "\n</function_results>\n\n" + (THINK_START if thinking else THINK_END)
        return text


def _invoke(call: dict, path: str) -> str:
    function = call.get("function") or call
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise ChatTemplateError(f"{path}.function.arguments is not a JSON object ({e})") from None
    if not isinstance(arguments, dict):
        raise ChatTemplateError(f"{path}.function.arguments must be a JSON object, not {type(arguments).__name__}")
    parameters = "\n".join(
        f'<{DSML}parameter name="{key}" string="{"true" if isinstance(value, str) else "false"}">'
        f'{value if isinstance(value, str) else _json(value)}</{DSML}parameter>'
        for key, value in arguments.items())
    return f'<{DSML}invoke name="{function.get("name")}">\n{parameters}\n</{DSML}invoke>'
