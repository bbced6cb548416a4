"""A small byte-level BPE tokenizer with GLM's special tokens and a GLM-style chat template, or DeepSeek-V3.2's
special tokens and no template (that family's chats use their own encoding).

Used by the built-in demo model and by test fixtures: it exercises the same files a real checkpoint ships
(tokenizer.json, tokenizer_config.json with a jinja chat template where the family has one).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# Control tokens: special, dropped from text when skip_special_tokens is set.
GLM_SPECIAL_TOKENS = (
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>",
    "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
)
# Markup tokens: single tokens, but kept in decoded text so reasoning and tool calls can be parsed.
GLM_MARKUP_TOKENS = (
    "<think>", "</think>", "<tool_call>", "</tool_call>",
    "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
    "<tool_response>", "</tool_response>", "/nothink",
)
# Generation stops at these (GLM's eos ids point at the same three tokens).
GLM_STOP_TOKENS = ("<|endoftext|>", "<|user|>", "<|observation|>")

# DeepSeek-V3.2's control tokens, begin and end of sentence first (ids 0 and 1, as in its checkpoints).
DEEPSEEK_SPECIAL_TOKENS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜User｜>",
                           "<｜Assistant｜>")
DEEPSEEK_MARKUP_TOKENS = ("<think>", "</think>")

_CORPUS = """\
dsaserve serves GLM models with sparse attention. The lightning indexer scores the past tokens and
each query attends only to the best ones. Shared layers reuse the top-k of the last full layer.
The quick brown fox jumps over the lazy dog. Paris is the capital of France. Berlin is the capital
of Germany. Hello, world! How are you today? I am fine, thank you. What is the weather like?
def main():\n    print("hello")\n    return 0\nfor i in range(10):\n    total += i * i
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828. Questions? Answers! Tools, calls, results.
Mixture of experts routes each token to a few experts. Latent attention caches a compressed key.
"""

CHAT_TEMPLATE = """[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}
{{ tool | tojson(ensure_ascii=False) }}
{% endfor %}
</tools>

For each function call, output the function name and arguments within the following XML format:
<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>...</tool_call>
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}
<|system|>
{{ m.content }}
{%- elif m.role == 'user' -%}
<|user|>
{{ m.content }}
{%- elif m.role == 'assistant' -%}
<|assistant|>
{%- if m.reasoning_content -%}
<think>{{ m.reasoning_content }}</think>
{%- else -%}
</think>
{%- endif -%}
{%- if m.content %}
{{ m.content }}
{%- endif -%}
{%- for tc in (m.tool_calls or []) -%}
{%- set f = tc.function if tc.function is defined else tc -%}
<tool_call>{{ f.name }}
{%- set args = f.arguments -%}
{%- if args is string -%}{%- set args = {} -%}{%- endif -%}
{%- for k, v in args.items() -%}
<arg_key>{{ k }}</arg_key><arg_value>{{ v if v is string else v | tojson(ensure_ascii=False) }}</arg_value>
{%- endfor -%}
</tool_call>
{%- endfor -%}
{%- elif m.role == 'tool' -%}
<|observation|>
<tool_response>{{ m.content }}</tool_response>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|assistant|>
{%- if enable_thinking is defined and not enable_thinking -%}</think>{%- endif -%}
{%- endif -%}"""


# GPT-2's pre-tokenizer pattern, except that numbers split into pieces of at most two digits and that
# " is" joins the number after it: "The code for amber-falcon is 4821" ends "falcon", " is 48", "21", so
# the code starts right after the key's last word, and looking the code up is one step of attention
# (find the word, copy what follows) instead of matching two words at once.
NUMBER_AWARE_SPLIT = r"(?: is)? ?\d\d?|'(?:s|t|re|ve|m|ll|d)| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


@dataclass(frozen=True)
class TokenizerStyle:
    """A family's tokens: control tokens (dropped from text with skip_special_tokens), markup tokens (single
    tokens kept in decoded text, so reasoning and tool calls can be parsed), stop tokens, and its template."""

    special: tuple[str, ...]
    markup: tuple[str, ...]
    stop: tuple[str, ...]
    eos_token: str
    bos_token: str | None
    chat_template: str | None


GLM_STYLE = TokenizerStyle(GLM_SPECIAL_TOKENS, GLM_MARKUP_TOKENS, GLM_STOP_TOKENS, "<|endoftext|>", None, CHAT_TEMPLATE)
DEEPSEEK_STYLE = TokenizerStyle(DEEPSEEK_SPECIAL_TOKENS, DEEPSEEK_MARKUP_TOKENS, ("<｜end▁of▁sentence｜>",),
                                "<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>", None)
STYLES = {"glm_moe_dsa": GLM_STYLE, "deepseek_v32": DEEPSEEK_STYLE, "glm5_next": GLM_STYLE}


def build_tokenizer(vocab_size: int = 1024, corpus: list[str] | None = None, split_digits: bool = False,
                    style: TokenizerStyle = GLM_STYLE) -> Tokenizer:
    """Train a byte-level BPE (deterministic), specials first; on a fixed built-in text unless given one.

    split_digits: numbers in pieces of at most two digits, " is" joined to the number after it
    (NUMBER_AWARE_SPLIT; the trained demo model's tokenizer).
    """
    tok = Tokenizer(models.BPE())
    if split_digits:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(NUMBER_AWARE_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(style.special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus or _CORPUS.splitlines(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in style.markup])
    if style.bos_token is not None:  # a plain prompt starts with it, as DeepSeek's tokenizer does
        tok.post_processor = processors.TemplateProcessing(
            single=f"{style.bos_token} $A", special_tokens=[(style.bos_token, tok.token_to_id(style.bos_token))])
    return tok


def save_tokenizer(tok: Tokenizer, model_dir: str, style: TokenizerStyle = GLM_STYLE) -> None:
    tok.save(os.path.join(model_dir, "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {"content": t, "special": t in style.special, "lstrip": False,
                                  "rstrip": False, "normalized": False, "single_word": False}
        for t in style.special + style.markup
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": style.eos_token,
        "pad_token": style.eos_token,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
        "added_tokens_decoder": added,
    }
    if style.bos_token is not None:
        config["bos_token"] = style.bos_token
    if style.chat_template is not None:
        config["chat_template"] = style.chat_template
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)


def stop_token_ids(tok: Tokenizer, style: TokenizerStyle = GLM_STYLE) -> list[int]:
    return [tok.token_to_id(t) for t in style.stop]
