"""The checkpoint's tokenizer (tokenizer.json via the `tokenizers` library) and its chat template."""

from __future__ import annotations

import functools
import json
import os

from tokenizers import Tokenizer as FastTokenizer


class Tokenizer:
    def __init__(self, model_dir: str):
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no tokenizer.json in {model_dir!r}; "
                                    "dsaserve needs the checkpoint's fast tokenizer")
        self._tok = FastTokenizer.from_file(path)
        config = {}
        config_path = os.path.join(model_dir, "tokenizer_config.json")
        if os.path.isfile(config_path):
            with open(config_path) as f:
                config = json.load(f)
        self.chat_template: str | None = config.get("chat_template")
        template_path = os.path.join(model_dir, "chat_template.jinja")
        if self.chat_template is None and os.path.isfile(template_path):
            with open(template_path) as f:
                self.chat_template = f.read()
        self.special_tokens = {
            key: _token_text(config.get(key)) for key in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        added = self._tok.get_added_tokens_decoder()
        self.all_special_ids = frozenset(i for i, t in added.items() if t.special)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token's text has (its vocabulary string bounds its decoded text)."""
        return max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode does not), so a long prompt tokenized on a
        # worker thread does not stall the event loop or the engine's thread.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def vocabulary(self) -> dict[str, int]:
        """Every token's vocabulary string (byte-level encoded where the tokenizer is) → its id."""
        return self._tok.get_vocab(with_added_tokens=True)

    def backend_json(self) -> str:
        """The tokenizer.json this tokenizer was loaded from, as a string."""
        return self._tok.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value
