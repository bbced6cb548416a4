"""The tokenizer as xgrammar sees it: each token id's text, with control tokens never allowed as text."""

from __future__ import annotations


def tokenizer_info(xgrammar, tokenizer, vocab_size: int, eos_token_ids: list[int]):
    """xgrammar.TokenizerInfo for the model's logits (vocab_size columns, which may exceed the tokenizer's).

    Control tokens (special ones such as <|user|>, and ids past the tokenizer) get empty text, which
    xgrammar never matches: a JSON string must not contain a token that ends the turn. The matcher allows
    stop tokens (the request's, else these eos ids) only where the grammar is complete.
    """
    encoded = [""] * vocab_size
    for text, token_id in tokenizer.vocabulary().items():
        if token_id < vocab_size and token_id not in tokenizer.all_special_ids:
            encoded[token_id] = text
    meta = xgrammar.TokenizerInfo._detect_metadata_from_hf(tokenizer.backend_json())
    return xgrammar.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=vocab_size,
                                  stop_token_ids=list(eos_token_ids), add_prefix_space=meta["add_prefix_space"])
