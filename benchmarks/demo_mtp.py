"""MTP speculative decoding on the trained demo model: acceptance and speed at N = 1, 2, 3 drafts.

    python benchmarks/demo_mtp.py [--model DIR] [--prompts 16] [--max-tokens 64] [--batch-sizes 1,16] [--rounds 3]

The prompts are the demo's own tasks (retrieval over ~300-token documents, arithmetic, word lists,
greetings, weather tool calls), drawn with a seed the training did not use, thinking on, greedy. For
each N it reports the mean accepted length (1 + accepted drafts per verification, vLLM's definition),
the acceptance rate per draft position, and decode tokens per second (after each group's first tokens)
at each batch size against the same engine settings without speculation: the median over the rounds,
and the median and range of the per-round speedups (each group of chats is run by every setting in
turn; end to end, prefill included, alongside). Outputs are checked to be identical to the plain ones.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from dsaserve import LLM, SamplingParams
from dsaserve.demo import demo_model_dir
from dsaserve.demo.tasks import retrieval_chat, short_chat


def prompts(count: int, seed: int = 77) -> list[tuple[list[dict], list[dict] | None]]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        chat = retrieval_chat(rng, 25, 4, 1) if i % 4 == 0 else short_chat(rng)
        first_user = next(j for j, m in enumerate(chat.messages) if m["role"] == "user")
        out.append((chat.messages[: first_user + 1], chat.tools))
    return out


def generate_batch(llm: LLM, group, params: SamplingParams):
    """The group's chats (each rendered with its own tools) to the end: (outputs in order, seconds of
    decode, tokens produced in them)."""
    from dsaserve.chat_template import ChatTemplate

    template = ChatTemplate(llm.tokenizer.chat_template, llm.tokenizer.special_tokens)
    engine = llm.engine
    ids = []
    for j, (messages, tools) in enumerate(group):
        ids.append(f"{time.monotonic_ns()}-{j}")
        engine.add_request(ids[-1], llm.tokenizer.encode(template.render(messages, tools=tools),
                                                         add_special_tokens=False), params)
    results, first_done, counted = {}, None, 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.request_id in results:
                results[delta.request_id].add(delta)
            else:
                results[delta.request_id] = delta
        if first_done is None and len(results) == len(ids):
            first_done = time.perf_counter()
            counted = sum(len(r.outputs[0].token_ids) for r in results.values())
    outputs = [results[i] for i in ids]
    produced = sum(len(o.outputs[0].token_ids) for o in outputs) - counted
    return outputs, time.perf_counter() - first_done, produced


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the shipped demo)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--drafts", default="1,2,3")
    parser.add_argument("--rounds", type=int, default=3, help="the settings take turns this many times (medians)")
    parser.add_argument("--disable-by-batch-size", type=int, default=None,
                        help="the speculative config's disable_by_batch_size (default: the engine's default)")
    args = parser.parse_args()
    chats = prompts(args.prompts)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    settings = {0: None}
    for n in [int(x) for x in args.drafts.split(",")]:
        settings[n] = {"method": "mtp", "num_speculative_tokens": n}
        if args.disable_by_batch_size is not None:
            settings[n]["disable_by_batch_size"] = args.disable_by_batch_size
    # No prefix caching: the rounds repeat the prompts, and every round should prefill them in full.
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    llms = {n: LLM(args.model or demo_model_dir(), progress=False, kv_cache_memory="256MiB",
                   enable_prefix_caching=False, speculative_config=spec) for n, spec in settings.items()}
    # Per round and batch size, each setting's (tokens, seconds) end to end and in decode. Every group of
    # chats is run by all settings one after the other, so a slow phase of a shared machine hits them all.
    totals = {}
    texts = {}
    for r in range(args.rounds):
        for b in batches:
            for i in range(0, len(chats), b):
                for n, llm in llms.items():
                    start = time.perf_counter()
                    outputs, seconds, after_first = generate_batch(llm, chats[i : i + b], params)
                    elapsed = time.perf_counter() - start
                    out = [o.outputs[0].text for o in outputs]
                    if texts.setdefault((b, i), out) != out:
                        raise AssertionError(f"N={n} batch {b}: outputs differ from the plain run")
                    t = totals.setdefault((n, b, r), [0, 0.0, 0, 0.0])
                    t[0] += sum(len(o.outputs[0].token_ids) for o in outputs)
                    t[1] += elapsed
                    t[2] += after_first
                    t[3] += seconds

    def speed(n, b, r, decode=True):
        tokens, elapsed, decode_tokens, decode_seconds = totals[n, b, r]
        return decode_tokens / decode_seconds if decode else tokens / elapsed

    def summary(n, b):
        """Median decode tok/s over the rounds, and the median and range of the per-round speedups."""
        ratios = sorted(speed(n, b, r) / speed(0, b, r) for r in range(args.rounds))
        whole = statistics.median(speed(n, b, r, False) / speed(0, b, r, False) for r in range(args.rounds))
        return (f"batch {b}: {statistics.median(speed(n, b, r) for r in range(args.rounds)):.1f} decode tok/s "
                f"({statistics.median(ratios):.2f}x, rounds {ratios[0]:.2f}-{ratios[-1]:.2f}x; "
                f"end to end {whole:.2f}x)")

    print("no speculation: " + ", ".join(
        f"batch {b}: {statistics.median(speed(0, b, r) for r in range(args.rounds)):.1f} decode tok/s"
        for b in batches), flush=True)
    for n, llm in llms.items():
        if not n:
            continue
        stats = llm.engine.stats().spec_decode
        mean_len = 1 + stats.num_accepted_tokens / max(1, stats.num_drafts)
        per_pos = [a / max(1, stats.num_drafts) for a in stats.accepted_per_pos]
        print(f"N={n}: mean accepted length {mean_len:.2f}, acceptance per position "
              f"{', '.join(f'{p:.0%}' for p in per_pos)}; " + ", ".join(summary(n, b) for b in batches), flush=True)

if __name__ == "__main__":
    main()
