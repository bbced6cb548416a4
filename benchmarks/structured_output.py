"""What structured output costs per engine step, at batch 16.

    python benchmarks/structured_output.py [--model PATH] [--batch 16] [--steps 64] [--big-vocab 154880]

Part 1, the engine: `batch` requests decode together on the model (the built-in demo model by default),
once free and once each under a JSON-schema grammar that cannot end within the run (an array of
strings), so both runs take the same number of steps at full batch. It reports the mean decode-step time
of each and the ratio. The grammar's work per step is the bitmask fill of every matcher, applying the
mask to the logits, and advancing each matcher by its sampled token.

Part 2, the same grammar work alone at a GLM-sized vocabulary: the demo tokenizer has 594 tokens, GLM-5.2
has 154,880, and the bitmask fill and apply grow with it. A synthetic byte-level vocabulary of that size
(every byte, then random 2-8 letter pieces, half with a leading space, a tenth with a digit or punctuation
mark) is compiled, and `batch` matchers are
filled, applied to [batch, vocab] logits and advanced, per step. Absolute milliseconds: there is no
GLM-5.2 step on this machine to divide by.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from dsaserve.demo import demo_model_dir
from dsaserve.engine.llm_engine import LLMEngine
from dsaserve.engine_args import EngineArgs
from dsaserve.sampling_params import SamplingParams
from dsaserve.structured_output import StructuredOutputsParams
from dsaserve.structured_output.request_grammar import RequestGrammar, apply_grammars

NEVER_ENDING = {"type": "array", "items": {"type": "string"}, "minItems": 1000}  # cannot end within the run


def decode_step_times(engine: LLMEngine, batch: int, steps: int, constrained: bool) -> list[float]:
    spec = StructuredOutputsParams(json=NEVER_ENDING) if constrained else None
    # Free: ignore_eos keeps all `batch` running. Constrained: the grammar allows a stop token only where it
    # is complete, which an open array never is.
    params = SamplingParams(max_tokens=steps + 1, temperature=1.0, seed=0, ignore_eos=not constrained,
                            structured_outputs=spec)
    for i in range(batch):
        engine.add_request(f"{'c' if constrained else 'f'}{i}", "The weather in Paris is", params)
    engine.step()  # the prompts
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times[2:-1]  # full-batch decode steps: skip the first two (warm-up) and the last (finishing)


class GrammarClock:
    """Adds up the time the engine spends in grammar code (mask fill and apply, matcher advance)."""

    def __init__(self):
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def engine_part(model: str, batch: int, steps: int, repeats: int) -> dict:
    import dsaserve.sampling.logits_processors as processors

    engine = LLMEngine(EngineArgs(model=model, max_num_seqs=batch, progress=False))
    clock = GrammarClock()
    processors.apply_grammars = clock.wrap(processors.apply_grammars)
    RequestGrammar.accept = clock.wrap(RequestGrammar.accept)
    free, constrained = [], []
    for _ in range(repeats):  # interleaved, so drift in the machine's speed hits both alike
        free += decode_step_times(engine, batch, steps, constrained=False)
        constrained += decode_step_times(engine, batch, steps, constrained=True)
    f, c = statistics.median(free), statistics.median(constrained)
    grammar = clock.seconds / (repeats * (steps + 1))  # every constrained step, prompt step included
    return {"batch": batch, "steps_each": len(free), "free_step_ms": f * 1e3, "constrained_step_ms": c * 1e3,
            "step_ratio": c / f, "grammar_ms_per_step": grammar * 1e3, "grammar_pct_of_free_step": grammar / f * 100}


class SyntheticTokenizer:
    """A byte-level vocabulary of `size` tokens (the interface the grammar compiler reads)."""

    def __init__(self, size: int, seed: int = 0):
        from tokenizers import pre_tokenizers

        alphabet = pre_tokenizers.ByteLevel.alphabet()
        pieces = sorted(alphabet)
        seen = set(pieces)
        rng = random.Random(seed)
        letters, other = "abcdefghijklmnopqrstuvwxyz", "0123456789\"{}[]:,.-_()'!?/\\"
        while len(pieces) < size:  # like a real vocabulary: mostly word pieces, some with a leading space
            word = "".join(rng.choice(letters) for _ in range(rng.randint(2, 8)))
            if rng.random() < 0.1:  # a tenth carry digits or punctuation, JSON's own characters among them
                k = rng.randrange(len(word))
                word = word[:k] + rng.choice(other) + word[k + 1 :]
            piece = ("Ġ" if rng.random() < 0.5 else "") + word
            if piece not in seen:
                seen.add(piece)
                pieces.append(piece)
        self._vocab = {p: i for i, p in enumerate(pieces)}
        self.all_special_ids = frozenset()

    def vocabulary(self) -> dict[str, int]:
        return self._vocab

    def backend_json(self) -> str:
        return json.dumps({"model": {"type": "BPE"}, "decoder": {"type": "ByteLevel"},
                           "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False}})


def big_vocab_part(size: int, batch: int, steps: int) -> dict:
    from dsaserve.structured_output.compiler import GrammarCompiler

    compiler = GrammarCompiler(SyntheticTokenizer(size), size, eos_token_ids=[0])
    start = time.perf_counter()
    compiled = compiler.compile(StructuredOutputsParams(json=NEVER_ENDING))
    compile_s = time.perf_counter() - start
    grammars = [RequestGrammar(compiled, {0}) for _ in range(batch)]
    g = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        logits = torch.randn(batch, size, generator=g)
        start = time.perf_counter()
        apply_grammars(logits, grammars)
        masked = time.perf_counter() - start
        tokens = logits.argmax(-1).tolist()  # sampling: not grammar work, not timed
        start = time.perf_counter()
        for grammar, token in zip(grammars, tokens):
            assert grammar.accept(token)
        times.append(masked + time.perf_counter() - start)
    return {"vocab": size, "batch": batch, "compile_s": compile_s,
            "grammar_ms_per_step": statistics.median(times) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the built-in demo model)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--big-vocab", type=int, default=154880, help="0 skips part 2")
    args = parser.parse_args()
    torch.manual_seed(0)
    print("engine:", json.dumps(engine_part(args.model or demo_model_dir(), args.batch, args.steps, args.repeats)))
    if args.big_vocab:
        print("grammar alone:", json.dumps(big_vocab_part(args.big_vocab, args.batch, args.steps)))


if __name__ == "__main__":
    main()
