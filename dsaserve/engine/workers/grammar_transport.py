"""Compiled grammars sent to other ranks inside a step's SchedulerOutput: xgrammar's CompiledGrammar does not
pickle, so it travels as its JSON serialization (executor.py) and is restored against the receiving rank's own
tokenizer info (worker_process.py; xgrammar checks that the two tokenizers match)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dsaserve.engine.scheduling.scheduler_output import SchedulerOutput


@dataclass(frozen=True)
class SerializedGrammar:
    json: str


def grammars_serialized(output: SchedulerOutput) -> SchedulerOutput:
    """The same step with every new request's compiled grammar replaced by its serialization."""
    if not any(new.grammar is not None for new in output.new_requests):
        return output
    new = [dataclasses.replace(n, grammar=SerializedGrammar(n.grammar.serialize_json())) if n.grammar is not None
           else n for n in output.new_requests]
    return dataclasses.replace(output, new_requests=new)


class GrammarRestorer:
    """Turns SerializedGrammar back into compiled grammars; loads the tokenizer on first use."""

    def __init__(self, model_dir: str, vocab_size: int, eos_token_ids):
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._info = None

    def restore(self, output: SchedulerOutput) -> SchedulerOutput:
        if not any(isinstance(n.grammar, SerializedGrammar) for n in output.new_requests):
            return output
        import xgrammar

        from dsaserve.structured_output.tokenizer_info import tokenizer_info
        from dsaserve.tokenizer import Tokenizer

        if self._info is None:
            self._info = tokenizer_info(xgrammar, Tokenizer(self.model_dir), self.vocab_size, self.eos_token_ids)
        new = [dataclasses.replace(n, grammar=xgrammar.CompiledGrammar.deserialize_json(n.grammar.json, self._info))
               if isinstance(n.grammar, SerializedGrammar) else n for n in output.new_requests]
        return dataclasses.replace(output, new_requests=new)
