"""How a checkpoint's conversations become prompts: its own jinja chat template when it ships one (or one given
with --chat-template), else its family's built-in encoding (DeepSeek-V3.2 ships none), else nothing."""

from __future__ import annotations

import logging

from dsaserve.chat_template import ChatTemplate
from dsaserve.deepseek_v32_chat import DeepseekV32Chat
from dsaserve.model_family import ModelFamily

logger = logging.getLogger(__name__)

ChatFormat = ChatTemplate | DeepseekV32Chat
BUILT_IN_ENCODINGS = {"deepseek_v32": DeepseekV32Chat}


def chat_format(tokenizer, family: ModelFamily, template: str | None = None, mode: str = "auto") -> ChatFormat | None:
    """template: jinja source that overrides the checkpoint's own; mode: "auto", or a built-in encoding's name to use
    it whatever the checkpoint ships (vLLM's --tokenizer-mode)."""
    if mode != "auto":
        return BUILT_IN_ENCODINGS[mode]()
    source = template or tokenizer.chat_template
    if source is not None:
        return ChatTemplate(source, tokenizer.special_tokens)
    if family.chat_encoding is not None:
        logger.info("no chat template in the checkpoint: conversations use %s's own encoding (%s)", family.name,
                    family.chat_encoding)
        return BUILT_IN_ENCODINGS[family.chat_encoding]()
    return None
