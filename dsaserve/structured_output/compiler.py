"""Compiling structured-output specs into xgrammar grammars: once per spec, shared by every request using it.

Compiles run on a small pool of their own, waited for by the thread that admits the request (the
server's worker thread, or the caller of LLM.generate), never inside an engine step. Two requests with
the same new spec wait on one compile. A spec that takes longer than `timeout` is refused (its compile
finishes in the background and is cached), so pathological schemas cannot tie up the server's threads.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from dsaserve.structured_output.params import StructuredOutputsParams
from dsaserve.structured_output.schema_support import unsupported_feature

MAX_CACHED_GRAMMARS = 256
COMPILE_TIMEOUT_S = 20.0
MAX_JSON_WHITESPACE = 16  # per gap: allows pretty-printing, stops a model padding with whitespace forever
INSTALL_HINT = "structured output needs the xgrammar package, a dsaserve dependency: pip install 'xgrammar>=0.2.9'"


class GrammarError(ValueError):
    """The spec cannot be compiled (bad syntax, an unsupported feature, xgrammar missing)."""


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, max_threads: int = 1,
                 timeout: float = COMPILE_TIMEOUT_S):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.max_threads = max_threads
        self.timeout = timeout
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-compile")
        self.num_compiled = 0  # compiles actually run (cache misses)
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._compiler = None

    def compile(self, spec: StructuredOutputsParams):
        """The compiled grammar for spec (an xgrammar CompiledGrammar); raises GrammarError."""
        with self._lock:
            future = self._cache.get(spec.key)
            owner = future is None
            if owner:
                future = self._cache[spec.key] = Future()
                while len(self._cache) > MAX_CACHED_GRAMMARS:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(spec.key)
        if owner:
            self._pool.submit(self._fill, future, spec)
        try:
            return future.result(timeout=self.timeout)
        except FutureTimeout:
            raise GrammarError(f"structured_outputs.{spec.kind} took longer than {self.timeout:g}s to compile; "
                               "simplify it") from None

    def _fill(self, future: Future, spec: StructuredOutputsParams) -> None:
        try:
            future.set_result(self._compile(spec))
        except Exception as e:
            with self._lock:  # errors are not cached: the next request tries again
                if self._cache.get(spec.key) is future:
                    del self._cache[spec.key]
            future.set_exception(e if isinstance(e, GrammarError) else GrammarError(_clean(e, spec)))

    def _compile(self, spec: StructuredOutputsParams):
        compiler = self._xgrammar_compiler()
        self.num_compiled += 1
        kind = spec.kind
        if kind == "json":
            try:
                schema = json.loads(spec.json)
            except json.JSONDecodeError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise GrammarError("a JSON schema must be an object (or true/false)")
            problem = unsupported_feature(schema)
            if problem:
                raise GrammarError(problem)
            return compiler.compile_grammar(json_grammar(self._xgrammar, spec.json, strict=True))
        if kind == "json_object":
            return compiler.compile_grammar(json_grammar(self._xgrammar, '{"type": "object"}', strict=False))
        if kind == "regex":
            return compiler.compile_regex(spec.regex)
        if kind == "choice":  # EBNF string literals: JSON escaping is their escaping
            return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                     for c in spec.choice))
        return compiler.compile_grammar(spec.grammar)

    def _xgrammar_compiler(self):
        if self._compiler is None:
            with self._lock:
                if self._compiler is None:
                    self._compiler = self._build()
        return self._compiler

    def _build(self):
        try:
            import xgrammar
        except ImportError:
            raise GrammarError(INSTALL_HINT) from None
        self._xgrammar = xgrammar
        from dsaserve.structured_output.tokenizer_info import tokenizer_info

        info = tokenizer_info(xgrammar, self.tokenizer, self.vocab_size, self.eos_token_ids)
        # The cache above holds the compiled grammars; xgrammar's own cache would keep a second copy.
        return xgrammar.GrammarCompiler(info, max_threads=self.max_threads, cache_enabled=False)


def json_grammar(xgrammar, schema: str, strict: bool) -> str:
    r"""EBNF for a JSON schema: any whitespace (bounded per gap), and only valid JSON string characters.

    xgrammar 0.2.9 writes the characters of a length-bounded string (maxLength / minLength) as the class
    [^\"\\\r\n], which lets raw control characters into the string: invalid JSON. They are excluded here.
    """
    ebnf = str(xgrammar.Grammar.from_json_schema(schema, any_whitespace=True, strict_mode=strict,
                                                 max_whitespace_cnt=MAX_JSON_WHITESPACE))
    return ebnf.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR)


_LOOSE_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'


def _clean(error: Exception, spec: StructuredOutputsParams) -> str:
    """xgrammar's message without its timestamp and C++ source location, naming what was compiled."""
    text = re.sub(r"\[[0-9:]+\] \S+\.cc:\d+: ", "", str(error)).strip()
    return f"structured_outputs.{spec.kind} could not be compiled: {text}"
